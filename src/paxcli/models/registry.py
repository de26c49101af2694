"""The model families paxcli has, one line each, and the lookups every consumer shares:
`--from hf` (for_hf_config), `--to hf` and `pax describe` (fitting), `pax import-maxtext` and
`--from maxtext` (maxtext_block, maxtext_family), recipes (by_name).

Adding a family: its module under paxcli/models/ (a paxcli.models.family.Family subclass and one
instance), one line in FAMILIES, and its tests (docs/development/adding-a-family.md).
"""

from __future__ import annotations

import re
from typing import Optional

from paxcli.errors import UserError, did_you_mean, shorten
from paxcli.models.family import Family, MaxTextBlock
from paxcli.models.gemma import GEMMA2
from paxcli.models.gemma3 import GEMMA3
from paxcli.models.llama import LLAMA
from paxcli.models.mistral import MISTRAL
from paxcli.models.mixtral import MIXTRAL
from paxcli.models.qwen2 import QWEN2
from paxcli.models.qwen3 import QWEN3
from paxcli.models.qwen3_moe import QWEN3_MOE

FAMILIES: tuple[Family, ...] = (
    LLAMA,
    MISTRAL,
    QWEN2,
    QWEN3,
    GEMMA2,
    GEMMA3,
    MIXTRAL,
    QWEN3_MOE,
)


def by_name(name: str) -> Family:
  for family in FAMILIES:
    if family.name == name:
      return family
  raise UserError(f'No model family {shorten(repr(name))}; paxcli has {names()}.'
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


def fitting(model) -> tuple[Optional[Family], dict[str, list[str]]]:
  """The first family with a Hugging Face layout that `model` (a flat view) is one of, and why each
  family it is not refuses it (family name -> reasons)."""
  why = {}
  for family in FAMILIES:
    if not family.hf_model_types:
      continue
    reasons = family.misfit(model)
    if not reasons:
      return family, why
    why[family.name] = reasons
  return None, why


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
