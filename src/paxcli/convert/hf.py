"""Hugging Face directories: export (`--to hf`), import (`--from hf`) and inspect.

What a directory's config.json means and which weight is which belong to its family
(paxcli.models.registry: the family of its model_type; paxcli.models.llama holds Llama's map);
here are the reading of safetensors under paxcli's names, the export and the imported recipe.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import types
from typing import Optional

from paxcli import files, gencode
from paxcli.convert import formats, hf_tokenizer, safetensors_io
from paxcli.convert.formats import ArrayInfo
from paxcli.errors import UserError
from paxcli.models import registry
from paxcli.models.knobs import LM_KNOBS, effective
from paxcli.models.weight_map import WeightMap

# Bytes a token of the dummy batch paxcli's LM is traced on (ids and labels int32, weights float32).
_LM_TOKEN_BYTES = 12


def family_of(model, chosen: Optional[str] = None):
  """The family `model` (a flat view) is written as (registry.of_model: the one it records, checked; --family's,
  `chosen`); a UserError saying why there is none."""
  return registry.of_model(model, chosen)


def knobs_from_config(config: dict, path: str) -> tuple[dict, list[str]]:
  """paxcli knobs for a config.json, read by its family (paxcli.models.registry), and notes."""
  return registry.for_hf_config(config, path).from_hf_config(config, path)


def _model_of(knobs: dict):
  """The settings a family's weight map reads, from knobs (no model is built)."""
  return types.SimpleNamespace(**effective(knobs, LM_KNOBS))


def shape_problems(have: dict, model, family) -> list[str]:
  """What in the weights (name -> ArrayInfo) does not fit a model of `family` with `model`'s settings."""
  layers = {int(m.group(1)) for m in map(_LAYER.match, have) if m}
  if layers and model.num_layers != len(layers):   # before listing 9 names for each of a million layers
    return [f'config.json says num_hidden_layers {model.num_layers}; the weights hold {len(layers)} layers']
  experts = {int(m.group(1)) for m in map(_EXPERT.search, have) if m}
  fused = any(n.endswith('.experts.gate_up_proj') for n in have)   # every expert of a layer in one array
  if getattr(model, 'num_experts', 0) and not fused and model.num_experts != len(experts):  # before 3 names an expert
    return [f'config.json says {model.num_experts:,} experts a layer; the weights hold {len(experts)}']
  problems = []
  expected = WeightMap(family.hf_read_weights(model, have)).hf_shapes
  for name, shape in expected.items():
    if name not in have:
      problems.append(f'{name}: missing (expected {list(shape)})')
    elif tuple(have[name].shape) != shape:
      problems.append(f'{name}: {list(have[name].shape)}, expected {list(shape)}')
  known = set(expected) | {'lm_head.weight'}
  problems += [f'{n}: not part of a {family.title} of this config' for n in have if n not in known
               and not n.endswith('rotary_emb.inv_freq')]
  return problems


_LAYER = re.compile(r'model\.layers\.(\d+)\.')
_EXPERT = re.compile(r'\.experts\.(\d+)\.')


def is_hf(path: str) -> bool:
  return os.path.isdir(path) and os.path.exists(os.path.join(path, 'config.json')) and (
      bool(safetensors_io.files_of(path)) or bool([n for n in os.listdir(path) if n.endswith('.bin')]))


def other_layout(path: str) -> Optional[str]:
  """The architecture of the Hugging Face directory `path` when its modules are named otherwise than in what
  `--to hf` writes for its family (a Gemma3ForConditionalGeneration's text model sits under a prefix); None when
  they are named alike or the directory cannot be read as a model paxcli knows."""
  try:
    config = HfSource(path).native
  except (UserError, OSError):
    return None
  family, model_type = registry.for_hf_config(config, path), config.get('model_type')
  if model_type and model_type != family.hf_model_types[0]:
    return str((config.get('architectures') or [model_type])[0])[:60]
  return None


class HfSource(formats.SourceBase):
  """A Hugging Face directory; names are HF's. paxcli_view(model) gives paxcli names."""
  kind = 'hf'
  paxcli_names = False

  def __init__(self, path: str, step: Optional[int] = None, target=None):
    self.path = path
    text = files.read_text(files.member(path, 'config.json', 'config'), 'config.json', 16 << 20)
    self.native = files.parse_json(text, f'{path}/config.json')
    if not isinstance(self.native, dict):
      raise UserError(f'{path}/config.json is a JSON {type(self.native).__name__}, not an object.')
    if not safetensors_io.files_of(path):
      raise UserError(f'{path} has no .safetensors weights (PyTorch .bin files are not read: convert them '
                      'to safetensors first).')
    self._st = safetensors_io.SafetensorsSource(path)
    self.step = self._st.step if step is None else step
    self.family = registry.for_hf_config(self.native, path)
    self._knobs = None
    # The arrays the family reads, under its names (a multimodal checkpoint's text model; paxcli.models.gemma3),
    # and what it says of those it leaves out (printed by the conversion, kept in the recipe's NOTES).
    self._names, self.load_notes = self.family.hf_checkpoint_names(
        self.native, [a.name for a in self._st.arrays()], path)
    self._file_name = {ours: theirs for theirs, ours in self._names.items()}

  def arrays(self):
    return [dataclasses.replace(a, name=self._names[a.name]) for a in self._st.arrays() if a.name in self._names]

  def read(self, name, index=None):
    if name not in self._file_name:
      raise KeyError(name)
    return self._st.read(self._file_name[name], index)

  def knobs(self) -> dict:
    """The knobs of config.json, checked against the weights' shapes before any model is built."""
    if self._knobs is None:
      knobs, notes = self.family.from_hf_config(self.native, self.path)
      self.notes = [*self.load_notes, *notes]
      problems = shape_problems({a.name: a for a in self.arrays()}, _model_of(knobs), self.family)
      if problems:
        raise UserError(f'{self.path}: the weights do not match its config.json:\n  ' + '\n  '.join(problems[:20]))
      from paxcli.runtime import engine   # JAX: only once a model is to be built from the config
      engine.check_sequence(knobs['MAX_SEQ_LEN'], _LM_TOKEN_BYTES, f'{self.path}/config.json: '
                            f'max_position_embeddings {knobs["MAX_SEQ_LEN"]:,}', 'Set it in config.json to the '
                            'length the model was trained on.')
      self._knobs = knobs
    return self._knobs

  def extra_files(self) -> dict:
    return hf_tokenizer.find_in(self.path)

  def paxcli_view(self, model) -> 'PaxView':
    return PaxView(self, model)


class PaxView(formats.SourceBase):
  """An HF directory under paxcli's (unrolled) names and shapes, by its family's weight map."""
  kind = 'hf'

  def __init__(self, hf: HfSource, model):
    self.path, self.step, self.hf = hf.path, hf.step, hf
    self.knobs = hf.knobs
    self.extra_files = hf.extra_files
    have = {a.name: a for a in hf.arrays()}
    problems = shape_problems(have, model, hf.family)
    if problems:
      raise UserError(f'{hf.path}: the weights do not match its config.json:\n  ' + '\n  '.join(problems[:20]))
    self._map = WeightMap(hf.family.hf_read_weights(model, have))
    self._dtypes = {name: have[rows[0].hf].dtype for name, rows in self._map.by_paxcli.items()}

  def arrays(self):
    return [ArrayInfo(name, shape, self._dtypes[name]) for name, shape in self._map.paxcli_shapes.items()]

  def read(self, name, index=None):
    x = self._map.from_hf(name, self.hf.read)
    return x[index] if index is not None else x


formats.register_reader('hf', lambda path, step=None, target=None: HfSource(path, step), detect=is_hf)


def with_context(config: dict, max_positions: Optional[int]) -> dict:
  """config.json with max_position_embeddings at least max_positions: a fine-tune trained on shorter rows
  than its base keeps the base's context, so transformers sees the model it was imported as."""
  if max_positions and (config.get('max_position_embeddings') or 0) < max_positions:
    config = {**config, 'max_position_embeddings': max_positions}
  return config


def export(directory: str, src, items_by_name: dict, model, read, dtype: str, max_shard_bytes: int,
           on_bytes, max_positions: Optional[int] = None) -> None:
  """Writes model.safetensors (+ shards and index), config.json, generation_config.json and, when the
  run has a tokenizer, the tokenizer files transformers reads (hf_tokenizer) into directory.
  max_positions: a fine-tune's base's longest context (core.longest_context), when longer than its rows."""
  family = family_of(model)
  wmap = WeightMap(family.hf_weights(model))
  arrays = [(name, shape, items_by_name[wmap.by_hf[name][0].paxcli].dtype) for name, shape in wmap.hf_shapes.items()]

  def fill(hf_name, put):
    put(wmap.to_hf(hf_name, lambda pax_name: read(items_by_name[pax_name])))

  tokenizer = src.extra_files().get('tokenizer')
  ids = hf_tokenizer.token_ids(tokenizer)   # the special ids of the tokenizer the model was trained with
  safetensors_io.write(directory, arrays, fill, {'format': 'pt', 'step': src.step}, max_shard_bytes, on_bytes)
  with open(os.path.join(directory, 'config.json'), 'w', encoding='utf-8') as f:
    json.dump(with_context(family.to_hf_config(model, dtype, ids), max_positions), f, indent=2)
  with open(os.path.join(directory, 'generation_config.json'), 'w', encoding='utf-8') as f:
    json.dump({k: v for k, v in ids.items() if v is not None}, f, indent=2)
  if tokenizer:
    hf_tokenizer.write(directory, tokenizer, max(model.max_seq_len, max_positions or 0))


def recipe_text(class_name: str, knobs: dict, source: str, notes: list[str], title: str = 'Llama') -> str:
  """The recipe of an imported model of family `title`: its knobs; the source path and notes only as literals."""
  lines = [f'"""A Hugging Face {title} as a paxcli experiment (written by pax checkpoint convert --from hf).', '',
           'SOURCE is the directory it was converted from; the knobs come from its config.json.', '"""', '',
           'from paxcli.experiment import register', 'from paxcli.models import LmExperiment', '',
           f'SOURCE = {gencode.literal(os.path.abspath(source))}']
  if notes:
    lines.append(f'NOTES = {gencode.literal(tuple(str(n) for n in notes))}')
  lines += ['', '', '@register', f'class {class_name}(LmExperiment):',
            f'  """The {title} of SOURCE, with the knobs of its config.json."""', '']
  lines += [f'  {k} = {gencode.literal(v)}' for k, v in knobs.items()]
  lines += ['  PERCORE_BATCH_SIZE = 1', '  ICI_MESH_SHAPE = None  # all devices data-parallel; set a mesh for large models']
  return '\n'.join(lines) + '\n'
