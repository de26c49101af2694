"""The model families paxcli has, one line each, and the lookups every consumer shares:
`--from hf` (for_hf_config), `--to hf`, `--to peft` and the certifications (of_model: the family a model
records, checked against its function), `pax describe` (summary), `pax import-maxtext` and `--from maxtext`
(maxtext_block, maxtext_family), recipes and MODEL_FAMILY (by_name).

Adding a family: its module under paxcli/models/ (a paxcli.models.family.Family subclass and one
instance), one line in FAMILIES, and its tests (docs/development/adding-a-family.md).
"""

from __future__ import annotations

import re
import types
from typing import Optional

from paxcli.errors import UserError, did_you_mean, shorten
from paxcli.models.deepseek import DEEPSEEK_V3
from paxcli.models.family import Family, MaxTextBlock
from paxcli.models.gemma import GEMMA2
from paxcli.models.gemma3 import GEMMA3
from paxcli.models.granite import GRANITE
from paxcli.models.knobs import LM_KNOBS, effective
from paxcli.models.llama import LLAMA
from paxcli.models.mistral import MISTRAL
from paxcli.models.mixtral import MIXTRAL
from paxcli.models.olmo2 import OLMO2
from paxcli.models.phi3 import PHI3
from paxcli.models.qwen2 import QWEN2
from paxcli.models.qwen3 import QWEN3
from paxcli.models.qwen3_moe import QWEN3_MOE

FAMILIES: tuple[Family, ...] = (
    LLAMA,
    MISTRAL,
    PHI3,
    QWEN2,
    QWEN3,
    OLMO2,
    GRANITE,
    GEMMA2,
    GEMMA3,
    MIXTRAL,
    QWEN3_MOE,
    DEEPSEEK_V3,
)


def by_name(name: str, where: str = '') -> Family:
  for family in FAMILIES:
    if family.name == name:
      return family
  raise UserError(f'{where}No model family {shorten(repr(name))}; paxcli has {names()}.'
                  f'{did_you_mean(str(name), [f.name for f in FAMILIES])}')


def names() -> str:
  """"llama (model_type 'llama': LlamaForCausalLM), ...": the families, for messages."""
  return ', '.join(f'{f.name} (model_type {", ".join(repr(t) for t in f.hf_model_types)}: '
                   f'{", ".join(f.hf_architectures)})' if f.hf_model_types else f.name for f in FAMILIES)


def for_hf_config(config: dict, path: str) -> Family:
  """The family of a config.json, by its model_type (or, without one, its architectures); one line
  naming the families paxcli has when none reads it."""
  model_type = config.get('model_type')
  arch = (config.get('architectures') or [''])[0]
  for family in FAMILIES:
    if model_type in family.hf_model_types or (not model_type and arch in family.hf_architectures):
      return family
  raise UserError(f'{path}: model_type {shorten(repr(model_type), 60)} ({shorten(str(arch), 60) or "no architectures"}) '
                  f'is not one paxcli reads; its model families are {names()}.')


def fits(model) -> tuple[list[Family], dict[str, list[str]]]:
  """The families with a Hugging Face layout whose function `model` (a flat view) computes, and why each other
  one refuses it (family name -> reasons). Several can fit one model (Phi-3 computes Mistral's function)."""
  found, why = [], {}
  for family in FAMILIES:
    if not family.hf_model_types:
      continue
    reasons = family.misfit(model)
    if reasons:
      why[family.name] = reasons
    else:
      found.append(family)
  return found, why


def of_model(model, chosen: Optional[str] = None) -> Family:
  """The family `model` (a flat view) is written as by --to hf and --to peft: `chosen` (--family), else the one it
  records (MODEL_FAMILY), each checked against the model's function. A model that records none (a checkpoint
  from before MODEL_FAMILY, a recipe without presets) is placed by its function: the family that computes it,
  where a family built on another (Mistral on Llama, Phi-3 on Mistral: a subclass) yields to the one it is built
  on, since what it adds is a layout only a record can tell. One line (UserError) saying why otherwise."""
  name = chosen or getattr(model, 'family', None)
  if name:
    family = by_name(name, '--family: ' if chosen else 'MODEL_FAMILY: ')
    reasons = family.misfit(model) if family.hf_model_types else ['the family has no Hugging Face layout']
    if reasons:
      said = f'--family {name}' if chosen else f'its MODEL_FAMILY {name!r}'
      raise UserError(f'This model is a {family.title} ({said}) but does not compute a {family.title}\'s function, '
                      'so the Hugging Face layout would hold another model: ' + '; '.join(reasons) + '.')
    return family
  found, why = fits(model)
  general = _placed(found)
  if len(general) == 1:
    return general[0]
  if found:
    listed = ', '.join(f.name for f in general)
    raise UserError(f'This model records no family (MODEL_FAMILY) and computes the function of several ({listed}): '
                    f'pass --family with the one it is (--family {found[0].name}, say), or set MODEL_FAMILY in its '
                    'recipe.')
  if len(why) == 1:
    (name, reasons), = why.items()
    raise UserError(f'This model does not fit the Hugging Face {by_name(name).title} layout: ' + '; '.join(reasons)
                    + '.')
  raise UserError('This model fits none of the Hugging Face layouts paxcli writes: '
                  + '; '.join(f'{name}: {", ".join(reasons)}' for name, reasons in why.items()) + '.')


def _placed(found: list[Family]) -> list[Family]:
  """The families of `found` that are built on none other of them (Llama, of Llama, Mistral and Phi-3)."""
  return [f for f in found if not any(g is not f and isinstance(f, type(g)) for g in found)]


def of_knobs(knob_values: dict) -> Optional[Family]:
  """The family a model of these knobs (UPPERCASE names) is placed in by its function (as of_model places a model
  that records none), or None (none, or unrelated ones): what an import from a format that names no family
  (--from paxml) records."""
  placed = _placed(fits(types.SimpleNamespace(**effective(knob_values, LM_KNOBS)))[0])
  return placed[0] if len(placed) == 1 else None


def summary(model) -> dict:
  """What `pax describe` says of a model's family (a flat view): {'family': its name or None, 'family_recorded':
  whether the model names it (MODEL_FAMILY) rather than being placed by its function, 'family_note': why --to hf
  would refuse it, where it would}."""
  recorded = getattr(model, 'family', None)
  if recorded:
    family = by_name(recorded, 'MODEL_FAMILY: ')
    reasons = family.misfit(model)
    if reasons:
      return {'family': recorded, 'family_recorded': True, 'family_note': (
          f'--to hf refuses it: it does not compute a {family.title}\'s function ({"; ".join(reasons)})')}
    return {'family': recorded, 'family_recorded': True}
  try:
    family = of_model(model)
  except UserError as e:
    found, why = fits(model)
    if found:
      return {'family': None, 'family_recorded': False, 'family_note': str(e)}
    return {'family': None, 'family_recorded': False, 'family_note': why_none(why)}
  return {'family': family.name, 'family_recorded': bool(recorded)}


_SETTING = re.compile(r"\b[A-Z][A-Z0-9_]*=(?:'[^']*'|[^\s);,]+)")


def why_none(why: dict[str, list[str]]) -> str:
  """`fitting`'s reasons in one short line: families refused for the same reason are named together, with
  the setting they share ("not llama, mistral or qwen2: norm_type is 'layernorm' (each has NORM_TYPE='rmsnorm')"),
  not the same words once per family."""
  groups: dict[str, list[tuple[str, str]]] = {}
  for name, reasons in why.items():
    core, _, detail = reasons[0].partition(' (')
    groups.setdefault(core, []).append((name, detail))
  parts = []
  for core, refused in groups.items():
    names = [n for n, _ in refused]
    listed = names[0] if len(names) == 1 else ', '.join(names[:-1]) + ' or ' + names[-1]
    settings = {tuple(_SETTING.findall(d)) for _, d in refused}
    (shared,) = settings if len(settings) == 1 else ((),)
    detail = (f' ({refused[0][1]}' if len(names) == 1 and refused[0][1]
              else f' (each has {", ".join(shared)})' if shared else '')
    parts.append(f'not {listed}: {core}{detail}')
  return '; '.join(parts)


def maxtext_block(name: str) -> Optional[tuple[Family, MaxTextBlock]]:
  """The family that computes MaxText's decoder_block `name`, and the block; None when none does."""
  for family in FAMILIES:
    if name in family.maxtext_blocks:
      return family, family.maxtext_blocks[name]
  return None


def maxtext_family(knobs: dict) -> tuple[Optional[Family], list[str]]:
  """The family whose MaxText layers an experiment's knobs compute (the knobs every one of its blocks
  sets), for `--from maxtext`; else None and what differs from the first family that reads MaxText."""
  wrong, fits = [], []
  for family in FAMILIES:
    if not family.maxtext_layer_params:
      continue
    common = _common(block.knobs for block in family.maxtext_blocks.values())
    differ = [f'{k} = {knobs.get(k)!r} (MaxText: {v!r})' for k, v in common.items() if knobs.get(k) != v]
    if not differ:
      fits.append((len(common), family))
    wrong = wrong or differ
  if fits:   # the family that says the most (Gemma 2's layer is Llama's knobs and more)
    return max(fits, key=lambda f: f[0])[1], []
  return None, wrong


def _common(dicts) -> dict:
  dicts = list(dicts)
  return {k: v for k, v in dicts[0].items() if all(d.get(k, object()) == v for d in dicts[1:])} if dicts else {}
