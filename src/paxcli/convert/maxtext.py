"""MaxText checkpoints as a conversion source: `pax checkpoint convert --from maxtext`.

A MaxText run saves `<run>/checkpoints/<step>/items/`, an orbax PyTree checkpoint of its
train state (Linen's on-disk layout, which pure-NNX MaxText writes too):
`params/params/{token_embedder, decoder, ...}` and the optimizer state beside it. The
checkpoint holds no config: the paxcli experiment is the recipe `pax import-maxtext` writes
for the script that trained it, given with --exp (its knobs name sizes, block and layout).

Mapping (MaxText, under params/params/ -> paxcli; E = head_dim; the names below a layer are the
family's, paxcli.models.llama.Llama.maxtext_layer_params, the family the experiment's knobs compute):
  token_embedder/embedding [V, D]                 params/embedding/embedding [V, D]
  decoder/decoder_norm/scale [D]                  params/final_norm/scale
  decoder/logits_dense/kernel [D, V] (untied)     params/logits/kernel
  decoder/layers/... (scanned, the layer axis at param_scan_axis, 1 by default) or
  decoder/layers_<i>/...                           params/layers/... [L, ...] or params/layer_<i>/...
    self_attention/query/kernel [D, H, E]          attention/query/kernel x sqrt(E)
    self_attention/key|value/kernel [D, K, E]      attention/key|value/kernel
    self_attention/out/kernel [H, E, D]            attention/out/kernel
    mlp/wi_0, wi_1 (gated) or wi; wo [F, D]        mlp/wi_0, wi_1; wo
    pre_self_attention_layer_norm/scale (llama2),
    pre_self_attention_norm/scale (default block)  attention_norm/scale
    post_self_attention_layer_norm/scale (llama2)  mlp_norm/scale (the default block has none:
                                                   PARALLEL_BLOCK, one norm for attention and MLP)
  A gemma2 decoder layer is a (local, global) pair (paxcli.models.gemma: maxtext_layer_params):
    self_attention_local/..., mlp_local/..., pre_self_attention_norm_local, post_self_attention_norm_local,
    pre_ffw_norm_local, post_ffw_norm_local (and _global)   -> layer 2i (2i + 1), or row i of
                                                    params/layers/block_0 (block_1) of LAYER_PATTERN
MaxText's attention does not divide the logits by sqrt(E): its query kernel is initialised
divided by sqrt(E) instead, and so carries the factor paxcli's attention applies (1/sqrt(E), or
1/sqrt(QUERY_PRE_ATTN_SCALAR)), which the conversion multiplies back in. MaxText's Gemma blocks store
the embedding x sqrt(emb_dim) and divide the tied logits by sqrt(emb_dim) (normalize_embedding_logits):
paxcli's SCALE_EMBEDDING_SQRT_DEPTH with the embedding / sqrt(D) (the bfloat16 copy tied logits read
rounds the same where sqrt(D) is a power of two); their RMSNorm scales are plain: s - 1 under
NORM_PLUS_ONE. Rotary: both rotate halves (x1, x2) with timescale
max_timescale^(2i/E), the same convention; norms are RMSNorm with a plain scale in both. Tied
output logits (logits_via_embedding) read a bfloat16 copy of the embedding in MaxText: the
recipe's TIED_LOGITS_BFLOAT16.
Optimizer states are not carried over: the result is a params-only checkpoint at MaxText's step.
"""

from __future__ import annotations

import math
import os
import re
from typing import Callable, Optional

import numpy as np

from paxcli.convert import formats
from paxcli.convert.formats import ArrayInfo
from paxcli.convert.orbax_io import PyTreeDir
from paxcli.errors import UserError
from paxcli.models import pattern, registry
from paxcli.models.knobs import LM_KNOBS

_PARAMS = 'params/params/'
_LAYER_RE = re.compile(r'^decoder/layers_(\d+)/(.+)$')
NEEDS_EXPERIMENT = ('A MaxText checkpoint holds no model config: pass --exp with the recipe `pax import-maxtext '
                    'SCRIPT` wrote for the script that trained it (--exp maxtext_<script>.py:<Class>).')

# MaxText's names below decoder/layers belong to the family (paxcli.models.llama: maxtext_layer_params);
# the embedding, final norm and output layer are MaxText's own, whatever the block.
_TOP_PARAMS = {
    'token_embedder/embedding': 'params/embedding/embedding',
    'decoder/decoder_norm/scale': 'params/final_norm/scale',
    'decoder/logits_dense/kernel': 'params/logits/kernel',
}


# ---- locating the checkpoint --------------------------------------------------------------------


def _items(step_dir: str) -> Optional[str]:
  items = os.path.join(step_dir, 'items')
  return items if os.path.isfile(os.path.join(items, '_METADATA')) else None


def _steps(checkpoints: str) -> dict[int, str]:
  if not os.path.isdir(checkpoints):
    return {}
  return {int(n): _items(os.path.join(checkpoints, n)) for n in os.listdir(checkpoints)
          if n.isdigit() and _items(os.path.join(checkpoints, n))}


def locate(path: str, step: Optional[int] = None) -> tuple[str, int]:
  """(items directory, step) of a MaxText run directory, its checkpoints/ directory, a step
  directory (checkpoints/<step>) or its items/ directory; the latest step unless `step`."""
  path = os.path.abspath(path)
  if os.path.basename(path) == 'items' and os.path.isfile(os.path.join(path, '_METADATA')):
    path = os.path.dirname(path)
  name = os.path.basename(path)
  if name.isdigit() and _items(path):
    if step is not None and step != int(name):
      raise UserError(f'{path} is the MaxText checkpoint of step {int(name)}, not --step {step}.')
    return _items(path), int(name)
  for checkpoints in (path, os.path.join(path, 'checkpoints')):
    steps = _steps(checkpoints)
    if steps:
      return formats.pick_step(steps, step, checkpoints, 'MaxText ')
  raise UserError(f'{path} is not a MaxText checkpoint (<run>/checkpoints/<step>/items/ with an orbax '
                  '_METADATA file).')


def is_maxtext(path: str) -> bool:
  try:
    items = locate(path)[0]
  except UserError:
    return False
  with open(os.path.join(items, '_METADATA'), 'rb') as f:
    return b'"params"' in f.read(1 << 20)


# ---- the source ---------------------------------------------------------------------------------


class MaxTextSource(formats.SourceBase):
  """A MaxText checkpoint under MaxText's names (`params/params/decoder/...`, `opt_state/...`);
  paxcli_view(model) gives its parameters under paxcli's names."""
  kind = 'maxtext'
  paxcli_names = False
  needs_experiment = NEEDS_EXPERIMENT

  def __init__(self, path: str, step: Optional[int] = None):
    self.path = path
    self.family = None   # the family whose MaxText layers the experiment computes (check_experiment)
    items, self.step = locate(path, step)
    self._tree = PyTreeDir(items, f'The MaxText checkpoint {items}')

  def arrays(self) -> list[ArrayInfo]:
    return self._tree.arrays()

  def read(self, name: str, index: Optional[int] = None) -> np.ndarray:
    return self._tree.read(name, index)

  def is_param(self, name: str) -> bool:
    return name.startswith(_PARAMS)

  def check_experiment(self, experiment, log=print) -> None:
    """A UserError when the recipe says paxcli cannot compute the MaxText model (its
    UNSUPPORTED_FEATURES, as pax import-maxtext wrote them); shapes are checked by the plan."""
    unsupported = getattr(experiment, 'UNSUPPORTED_FEATURES', None) or {}
    if unsupported:
      items = '; '.join(f'{f}: {why}' for f, why in unsupported.items())
      raise UserError(f'{type(experiment).__name__} cannot compute the MaxText model of {self.path}: its '
                      f'UNSUPPORTED_FEATURES name what paxcli does not build ({items}). The converted '
                      'model would compute another function; to convert anyway, accepting the difference, '
                      'add --set UNSUPPORTED_FEATURES={}.')
    if experiment.knobs().get('NUM_EXPERTS'):
      raise UserError(f'{type(experiment).__name__} is a mixture of experts: --from maxtext reads no MaxText MoE '
                      '(mixtral) checkpoints yet; pax import-maxtext writes the recipe to train one from scratch.')
    self.family, wrong = registry.maxtext_family(experiment.knobs())
    if self.family is None:
      raise UserError(f'{type(experiment).__name__} does not compute a MaxText decoder: '
                      + '; '.join(wrong) + '. Use the recipe pax import-maxtext writes.')

  def paxcli_view(self, model) -> 'MaxTextView':
    return MaxTextView(self, model)


def _scan_axis(stacked: dict[str, tuple], num_layers: int) -> int:
  """The axis the scanned layers are stacked on (MaxText's param_scan_axis), read from the shapes
  of the stacked parameters ({name: (shape, per-layer rank)}): the one axis of every array that is
  num_layers long and one more than the per-layer rank; 1 (MaxText's default) where both could be."""
  candidates = None
  for shape, rank in stacked.values():
    fit = {a for a in range(len(shape)) if len(shape) == rank + 1 and shape[a] == num_layers}
    candidates = fit if candidates is None else candidates & fit
  if not candidates:
    shapes = ', '.join(f'{n} {list(s)}' for n, (s, _) in list(stacked.items())[:4])
    raise UserError(f'The MaxText layers are not stacked {num_layers} deep on one axis as the experiment\'s '
                    f'NUM_LAYERS says ({shapes}).')
  return 1 if 1 in candidates else min(candidates)


class MaxTextView(formats.SourceBase):
  """A MaxText checkpoint's parameters under paxcli names and shapes, in the layout of the paxcli
  model given (params/layers/... [L, ...] when it scans, params/layer_<i>/... when not), whichever
  MaxText's was; anything in params the mapping does not know is named (a MaxText block or feature
  paxcli does not build)."""
  kind = 'maxtext'

  def __init__(self, src: MaxTextSource, model):
    self.path, self.step, self.src = src.path, src.step, src
    family = src.family or registry.maxtext_family({k.name: getattr(model, k.flat, None) for k in LM_KNOBS})[0]
    # MaxText layer parameter -> (paxcli name below a layer, per-layer rank, position in a MaxText layer)
    layer_params = {k: (v + (0,))[:3] for k, v in (family.maxtext_layer_params if family else {}).items()}
    self._per = 1 + max((v[2] for v in layer_params.values()), default=0)   # paxcli layers a MaxText layer holds
    self._period = pattern.period(getattr(model, 'layer_pattern', ()))
    if self._period not in (1, self._per):
      raise UserError(f'{src.path}: a MaxText {family.title if family else ""} layer holds {self._per} paxcli '
                      f'layers; the experiment\'s LAYER_PATTERN {tuple(model.layer_pattern)} repeats every '
                      f'{self._period}. Use the recipe pax import-maxtext writes.')
    if model.num_layers % self._per:
      raise UserError(f'{src.path}: NUM_LAYERS {model.num_layers} is not a whole number of MaxText layers of '
                      f'{self._per} layers each.')
    params = {a.name[len(_PARAMS):]: a for a in src.arrays() if a.name.startswith(_PARAMS)}
    if not params:
      raise UserError(f'{src.path}: the checkpoint holds no {_PARAMS}... arrays (the parameters of a MaxText '
                      'train state or params-only checkpoint).')
    self._top = {}                       # paxcli name -> MaxText name
    per_layer: dict[tuple, dict] = {}    # (paxcli name below a layer, slot) -> {MaxText layer: MaxText name}
    stacked: dict[str, tuple] = {}       # MaxText name -> (shape, per-layer rank)
    unknown = []
    for name, info in params.items():
      m = _LAYER_RE.match(name)
      inner = m.group(2) if m else name[len('decoder/layers/'):] if name.startswith('decoder/layers/') else None
      if name in _TOP_PARAMS:
        self._top[_TOP_PARAMS[name]] = name
      elif inner not in layer_params:
        unknown.append(f'{name} {list(info.shape)}')
      elif m:
        per_layer.setdefault((layer_params[inner][0], layer_params[inner][2]), {})[int(m.group(1))] = name
      else:
        stacked[name] = (tuple(info.shape), layer_params[inner][1])
    if unknown:
      raise UserError(f'{src.path}: parameters paxcli has no place for (a MaxText decoder block or feature '
                      'it does not build):\n  ' + '\n  '.join(unknown[:20]))
    self._axis = _scan_axis(stacked, model.num_layers // self._per) if stacked else None
    # (paxcli name below a layer, slot) -> (MaxText name(s): one stacked name or one per layer, MaxText
    # layer count, layer shape, dtype)
    self._layers = {}
    for name, (shape, _) in stacked.items():
      target, _, slot = layer_params[name[len('decoder/layers/'):]]
      layer_shape = shape[:self._axis] + shape[self._axis + 1:]
      self._layers[target, slot] = (name, shape[self._axis], layer_shape, params[name].dtype)
    for key, layers in per_layer.items():
      first = params[layers[min(layers)]]
      self._layers[key] = ([layers.get(i) for i in range(max(layers) + 1)], len(layers), tuple(first.shape),
                           first.dtype)
    self._scanned = bool(model.scan_layers)
    self._fixes = _Fixes(model)
    self._last = (None, None)

  def _scanned_name(self, target: str, slot: int) -> str:
    return f'params/layers/{target}' if self._period == 1 else f'params/layers/block_{slot}/{target}'

  def arrays(self):
    out = [ArrayInfo(p, tuple(self.src.info(_PARAMS + n).shape), self.src.info(_PARAMS + n).dtype)
           for p, n in self._top.items()]
    for (target, slot), (_, count, shape, dtype) in self._layers.items():
      if self._scanned and self._period == self._per:   # a row per MaxText layer
        out.append(ArrayInfo(self._scanned_name(target, slot), (count,) + shape, dtype))
      elif self._scanned:   # one kind of layer in both (self._per == 1)
        out.append(ArrayInfo(f'params/layers/{target}', (count,) + shape, dtype))
      else:
        out += [ArrayInfo(f'params/layer_{i * self._per + slot}/{target}', shape, dtype) for i in range(count)]
    return out

  def read(self, name, index=None):
    if name in self._top:
      x = self._fixes.top(name)(self.src.read(_PARAMS + self._top[name]))
      return x[index] if index is not None else x
    m = re.match(r'^params/layer_(\d+)/(.+)$', name)
    if m:
      i, slot = divmod(int(m.group(1)), self._per)
      return self._layer(m.group(2), slot, i)
    m = re.match(r'^params/layers/block_(\d+)/(.+)$', name)
    target, slot = (m.group(2), int(m.group(1))) if m else (name[len('params/layers/'):], 0)
    if index is not None:
      return self._layer(target, slot, index)
    return np.stack([self._layer(target, slot, i) for i in range(self._layers[target, slot][1])])

  def _layer(self, target: str, slot: int, i: int) -> np.ndarray:
    """MaxText layer i's paxcli layer parameter `target` at position `slot` in it, from MaxText's stacked
    array (read once) or its layers_<i>."""
    source, _, shape, _ = self._layers[target, slot]
    if isinstance(source, list):
      if source[i] is None:
        raise UserError(f'{self.src.path}: decoder/layers_{i} has no {target} (MaxText: the layers differ).')
      x = self.src.read(_PARAMS + source[i])
    else:
      if self._last[0] != source:
        self._last = (source, self.src.read(_PARAMS + source))
      x = np.take(self._last[1], i, axis=self._axis)
    return self._fixes.layer(target, shape)(x)


def _same(x):
  return x


class _Fixes:
  """The value changes from MaxText's parameters to the paxcli model's (module docstring), in float32 where a
  factor applies (a bfloat16 kernel times sqrt(128) is no longer a bfloat16 number; the writers cast to the
  target's dtype): the query kernel's sqrt(QUERY_PRE_ATTN_SCALAR or head_dim); with NORM_PLUS_ONE each norm
  scale s as s - 1; with SCALE_EMBEDDING_SQRT_DEPTH the embedding / sqrt(MODEL_DIMS) (MaxText's Gemma
  blocks store it x sqrt(emb_dim) and divide the tied logits by sqrt(emb_dim) instead)."""

  def __init__(self, model):
    self.query_scalar = getattr(model, 'query_pre_attn_scalar', None)
    self.plus_one = bool(getattr(model, 'norm_plus_one', False))
    self.embedding_scale = bool(getattr(model, 'scale_embedding_sqrt_depth', False))
    self.model_dims = model.model_dims

  def top(self, target: str) -> Callable:
    if target == 'params/embedding/embedding' and self.embedding_scale:
      return _times(1 / math.sqrt(self.model_dims))
    if target.endswith('norm/scale') and self.plus_one:
      return _minus_one
    return _same

  def layer(self, target: str, layer_shape: tuple) -> Callable:
    if target == 'attention/query/kernel':
      return _times(math.sqrt(self.query_scalar or layer_shape[-1]))
    if target.endswith('norm/scale') and self.plus_one:
      return _minus_one
    return _same


def _times(factor: float) -> Callable:
  return lambda x: np.asarray(x, np.float32) * np.float32(factor)


def _minus_one(x):
  return np.asarray(x, np.float32) - np.float32(1)


formats.register_reader('maxtext', lambda path, step=None, target=None: MaxTextSource(path, step),
                        detect=is_maxtext)
