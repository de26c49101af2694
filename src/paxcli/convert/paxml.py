"""Pax checkpoints (paxml/praxis 1.4 TransformerLm) as a conversion source: `--from paxml`.

A paxml job directory holds `model_params.txt` (the experiment's task config as
`dotted.key : value` lines) and `checkpoints/checkpoint_<step>/state/<name>/` with one
zarr array per train-state leaf, named like
`mdl_vars.params.lm.transformer.repeat.sub.x_layers_0.self_attention.combined_qkv.w`.

`PaxmlSource` reads that metadata only; `knobs()` derives from model_params.txt the paxcli
knobs of the same function (praxis semantics as in praxis 1.4.0's source), with
UNSUPPORTED_FEATURES naming what paxcli's model cannot express; `paxcli_view(model)` shows
the parameters under paxcli names and shapes, in the layout of the paxcli model given,
each converted on request (one array, or one layer):

  combined QKV [3, D, N, H]   -> attention/{query,key,value}/kernel [D, N, H]
  post projection [D, N, H]   -> attention/out/kernel [N, H, D]
  LayerNorm scale s           -> 1 + s (praxis' default parametrisation; direct_scale: s)
  softmax w [D, V]            -> embedding/embedding [V, D] (tied) or logits/kernel
  StackedTransformerRepeated [x_times, ...] and StackedTransformer's x_layers_<i> -> either
                                 params/layers/... (scanned) or params/layer_<i>/...

Optimizer states are not carried over (praxis' optimizer states are not optax's): the
result is a params-only checkpoint at the Pax step, from which `pax train` starts a fresh
optimizer state.
"""

from __future__ import annotations

import base64
import math
import json
import os
import re
from typing import Any, Callable, Optional

import numpy as np

from paxcli import files, gencode
from paxcli.convert import formats
from paxcli.convert.formats import ArrayInfo
from paxcli.errors import UserError, shorten
from paxcli.models import registry
from paxcli.models.knobs import LM_KNOB, LM_KNOBS, MAX_COUNT, MAX_INT32, effective
from paxcli.runtime import engine

_STEP_RE = re.compile(r'^checkpoint_(\d+)$')
_PARAMS = 'mdl_vars.params.lm.'
CONFIG_FILE = 'model_params.txt'
MAX_CONFIG_BYTES = 64 << 20   # a large Pax task config is under a megabyte


# ---- locating the checkpoint --------------------------------------------------------------------


def _step_dirs(checkpoints: str) -> dict[int, str]:
  if not os.path.isdir(checkpoints):
    return {}
  out = {}
  for name in os.listdir(checkpoints):
    m = _STEP_RE.match(name)
    if m and os.path.isdir(os.path.join(checkpoints, name, 'state')):
      out[int(m.group(1))] = os.path.join(checkpoints, name)
  return out


def locate(path: str, step: Optional[int] = None) -> tuple[str, int, str]:
  """(step directory, step, job directory) for a step dir, a checkpoints dir or a job dir."""
  path = os.path.abspath(path)
  m = _STEP_RE.match(os.path.basename(path))
  if m and os.path.isdir(os.path.join(path, 'state')):
    if step is not None and step != int(m.group(1)):
      raise UserError(f'{path} is the checkpoint of step {int(m.group(1))}, not step {step}.')
    return path, int(m.group(1)), os.path.dirname(os.path.dirname(path))
  for checkpoints, job in ((path, os.path.dirname(path)), (os.path.join(path, 'checkpoints'), path)):
    steps = _step_dirs(checkpoints)
    if steps:
      return (*formats.pick_step(steps, step, checkpoints), job)
  raise UserError(f'{path} is not a paxml checkpoint (checkpoints/checkpoint_<step>/state/...).')


def is_paxml_checkpoint(path: str) -> bool:
  try:
    state = os.path.join(locate(path)[0], 'state')
  except UserError:
    return False
  return any(n.startswith('mdl_vars.') for n in os.listdir(state)) or \
      os.path.exists(os.path.join(state, 'manifest.ocdbt'))


# ---- model_params.txt ---------------------------------------------------------------------------


def parse_params_text(text: str) -> dict[str, Any]:
  """`key : value` lines of paxml's model_params.txt -> {key: python value}.

  Values: numbers, True/False, 'quoted strings', NoneType -> None, `type/module/Class` ->
  'module.Class'; anything else (lists, reprs) is kept as its text.
  """
  out = Params()
  for n, line in enumerate(text.splitlines(), 1):
    key, sep, raw = line.partition(' : ')
    if not sep or not key or ' ' in key:
      continue
    out[key.strip()] = _value(raw.strip())
    out.lines[key.strip()] = n
  return out


class Params(dict):
  """model_params.txt's values by key, and (`lines`) the line each came from, for messages."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.lines: dict[str, int] = {}


def _value(raw: str) -> Any:
  if raw == 'NoneType':
    return None
  if raw in ('True', 'False'):
    return raw == 'True'
  if raw.startswith('type/'):
    return raw[len('type/'):].replace('/', '.')
  if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in '\'"':
    return raw[1:-1]
  try:
    return int(raw)
  except ValueError:
    pass
  try:
    return float(raw)
  except ValueError:
    return raw


def _cls(value) -> str:
  return value.rsplit('.', 1)[-1] if isinstance(value, str) else str(value)


# ---- knobs from the Pax config ------------------------------------------------------------------


class PaxConfig:
  """The TransformerLm part of a paxml task config: where things are, and the paxcli knobs.

  `knobs` are those of a paxcli LmExperiment computing the same function; `unsupported`
  names what no knob expresses (feature -> why), as the MaxText importer does.
  """

  def __init__(self, cfg: dict, source: str):
    self.cfg, self.source = cfg, source
    self.knobs: dict[str, Any] = {}
    self.unsupported: dict[str, str] = {}
    self.notes: list[str] = []
    lm = 'model.lm_tpl.'
    if _cls(cfg.get('model.lm_tpl.cls')) != 'TransformerLm':
      raise UserError(f'{source}: the model is not a praxis TransformerLm (model.lm_tpl.cls = '
                      f'{cfg.get("model.lm_tpl.cls")}); only the TransformerLm family (lm_cloud, c4) converts.')
    self.lm = lm
    stack = lm + 'stacked_transformer_tpl.'
    kind = _cls(cfg.get(stack + 'cls'))
    if kind == 'StackedTransformerRepeated':
      self.repeated, self.repeat_name = True, cfg.get(stack + 'repeat_layer_name', 'repeat')
      self.sub_name = cfg.get(stack + 'sublayer_name', 'sub')
      self.x_times = self.int(stack + 'x_times', maximum=MAX_COUNT)
      self.block = stack + 'block.'
      self.per_block = self.int(self.block + 'num_layers', maximum=MAX_COUNT // self.x_times)
    elif kind == 'StackedTransformer':
      self.repeated, self.x_times, self.block = False, 1, stack
      self.per_block = self.int(stack + 'num_layers', maximum=MAX_COUNT)
    else:
      raise UserError(f'{source}: {kind} layers cannot be converted (StackedTransformer and '
                      'StackedTransformerRepeated can; a pipelined model cannot yet).')
    self.layer = self.block + 'transformer_layer_params_tpl.'
    self.atten = self.layer + 'tr_atten_tpl.'
    self.ffn = self.layer + 'tr_fflayer_tpl.'
    self.softmax = lm + 'softmax_tpl.'
    self._derive()

  def get(self, key: str, default=None):
    return self.cfg.get(key, default)

  def where(self, key: str) -> str:
    """'<file>:<line>' of `key` (the file alone when the key is not in it)."""
    line = getattr(self.cfg, 'lines', {}).get(key)
    return f'{self.source}:{line}' if line else str(self.source)

  def int(self, key: str, default=None, minimum: int = 1, maximum: int = MAX_INT32) -> int:
    """The integer at `key` (`default` when missing or None), or UserError naming file:line. A count of
    layers or experts is at most MAX_COUNT, any other integer a 32-bit size (the knobs' bounds)."""
    value = self.cfg.get(key)
    if value is None:
      if default is None:
        raise UserError(f'{self.where(key)}: {key} is missing; paxcli needs it to convert the model.')
      return default
    if isinstance(value, float) and value.is_integer():
      value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
      raise UserError(f'{self.where(key)}: {key} is {shorten(repr(value), 60)}; it must be an integer from '
                      f'{minimum} to {maximum:,}.')
    return value

  def float(self, key: str, default: float) -> float:
    """The finite number at `key` (`default` when missing or None), or UserError naming file:line."""
    value = self.cfg.get(key)
    if value is None:
      return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
      raise UserError(f'{self.where(key)}: {key} is {shorten(repr(value), 60)}; it must be a finite number.')
    return float(value)

  def _off(self, name: str, key: str, why: str, ok=(None, False, 0, 0.0, '')) -> None:
    if self.get(key) not in ok:
      self.unsupported[name] = f'{why} ({key} = {self.get(key)!r})'

  def _derive(self) -> None:
    g, k, lm = self.get, self.knobs, self.lm
    k['NUM_LAYERS'] = self.x_times * self.per_block
    k['MODEL_DIMS'] = self.int(lm + 'model_dims')
    k['HIDDEN_DIMS'] = self.int(self.block + 'hidden_dims')
    k['NUM_HEADS'] = self.int(self.block + 'num_heads')
    k['NUM_KV_HEADS'] = None
    k['DIMS_PER_HEAD'] = self.int(self.block + 'dim_per_head', max(k['MODEL_DIMS'] // k['NUM_HEADS'], 1))
    k['VOCAB_SIZE'] = self.int(lm + 'vocab_size')
    self.qk_norm = self._qk_norm()
    self._layer_kinds()
    self._activation()
    self._norms()
    self._positions()
    self._attention()
    self._softmax()
    self._training_only()
    self._moe()
    self._quantization()
    dtype = str(g('model.fprop_dtype') or '')
    self.fprop_dtype = 'bfloat16' if dtype.endswith('bfloat16') else 'float32'

  def _layer_kinds(self) -> None:
    for key, want in ((self.layer + 'cls', 'Transformer'), (self.atten + 'cls', 'DotProductAttention'),
                      (self.ffn + 'cls', 'TransformerFeedForward')):
      if _cls(self.get(key)) != want:
        self.unsupported[f'layer {_cls(self.get(key))}'] = f'paxcli has only praxis\' {want} here ({key})'
    self._norm_policy()
    self._off('cross attention', self.layer + 'use_cross_attention', 'decoder-only model without cross attention')
    self._off('ngrammer', self.lm + 'ngrammer_tpl', 'no NGrammer in paxcli')
    self._off('post-attention ngrammer', self.lm + 'post_attention_ngrammer_tpls', 'no NGrammer in paxcli')
    self._off('ngrammer', self.layer + 'ngrammer_tpl', 'no NGrammer in paxcli')
    self._off('model type', self.lm + 'model_type', 'paxcli LMs are causal', ok=('causal',))
    self._off('residual weight', self.ffn + 'residual_weight', 'residuals are added with weight 1',
              ok=(1, 1.0))
    self._off('residual droppath', self.block + 'residual_droppath_prob', 'no stochastic depth in paxcli')

  def _norm_policy(self) -> None:
    """praxis' norm_policy (the layer's; it sets the feed-forward's too): 'pre', 'primer_hybrid' (pre and post
    norms: POST_NORMS), 'post' (the sublayer's output normalised, its input not: PRE_NORMS=False, POST_NORMS)."""
    policy = self.get(self.layer + 'norm_policy') or 'pre'
    self.norm_policy = policy
    if policy not in ('pre', 'primer_hybrid', 'post'):
      self.unsupported[f'norm_policy {policy}'] = (f'paxcli normalises before and/or after attention and MLP, not after '
                                                   f'the residual ({self.layer}norm_policy = {policy!r})')
      return
    if policy != 'pre':
      self.knobs['POST_NORMS'] = True
    if policy == 'post':
      self.knobs['PRE_NORMS'] = False

  def _activation(self) -> None:
    act_cls = _cls(self.get(self.ffn + 'activation_tpl.cls'))
    names = {'GELU': 'gelu', 'ReLU': 'relu', 'SiLU': 'silu', 'Swish': 'swish'}
    self.knobs['ACTIVATION'] = names.get(act_cls, 'gelu')
    if act_cls not in names:
      self.unsupported['activation'] = f'praxis {act_cls} has no paxcli equivalent'
    elif act_cls == 'GELU' and self.get(self.ffn + 'activation_tpl.approximate') is False:
      self.unsupported['exact GELU'] = 'paxcli uses the tanh approximation of GELU (approximate=True)'
    self.knobs['USE_GATED_ACTIVATION'] = bool(self.get(self.ffn + 'use_gated_activation'))

  def _norms(self) -> None:
    g = self.get
    norms = {'attention': self.layer + 'ln_tpl.', 'feed-forward': self.ffn + 'ln_tpl.',
             'final': self.lm + 'final_ln_tpl.'}
    if g(self.lm + 'final_ln_tpl') is None and g(self.lm + 'final_ln_tpl.cls') is None:
      self.unsupported['no final norm'] = 'paxcli LMs end with a norm (model.lm_tpl.final_ln_tpl is None)'
    kinds = {w: _cls(g(p + 'cls')) for w, p in norms.items()}
    kind = kinds['attention']
    if len(set(kinds.values())) > 1:
      self.unsupported['mixed norms'] = f'one norm kind for all norms in paxcli, Pax has {kinds}'
    if self.qk_norm:   # always an RMSNorm in paxcli; its epsilon and scale parametrisation as the others'
      norms['query/key'] = self.atten + 'ln_tpl.'
      kinds['query/key'] = 'RmsNorm'
    self.knobs['NORM_TYPE'] = {'LayerNorm': 'layernorm', 'RmsNorm': 'rmsnorm'}.get(kind, 'layernorm')
    if kind not in ('LayerNorm', 'RmsNorm'):
      self.unsupported['norm'] = f'praxis {kind} has no paxcli equivalent'
    eps = {w: self.float(p + 'epsilon', 1e-6) for w, p in norms.items()}
    if len(set(eps.values())) > 1:
      self.unsupported['norm epsilons'] = f'one NORM_EPSILON for all norms in paxcli, Pax has {eps}'
    self.knobs['NORM_EPSILON'] = float(eps['attention'])
    self.direct_scale = {}
    for w, p in norms.items():   # praxis' defaults: LayerNorm (1 + scale), RmsNorm scale
      direct = g(p + 'direct_scale')
      self.direct_scale[w] = kinds[w] == 'RmsNorm' if direct is None else bool(direct)
      if g(p + 'use_scale') is False:
        self.unsupported[f'{w} norm without scale'] = 'paxcli norms always have a learned scale'
    ffn_bias = bool(g(self.ffn + 'has_bias', True))
    self.knobs['USE_BIAS'] = ffn_bias
    if kind == 'LayerNorm':
      ln_bias = {w: g(p + 'use_bias', True) for w, p in norms.items() if w != 'query/key'}
      if set(ln_bias.values()) != {ffn_bias}:
        self.unsupported['norm bias'] = (f'USE_BIAS sets both feed-forward and LayerNorm biases in paxcli; '
                                         f'Pax has feed-forward bias {ffn_bias}, LayerNorm bias {ln_bias}')

  def _positions(self) -> None:
    g, lm = self.get, self.lm
    pos_cls = _cls(g(lm + 'position_emb_tpl.cls')) if g(lm + 'position_emb_tpl.cls') else None
    rotary = bool(g(self.atten + 'use_rotary_position_emb'))
    self.learned_rows = None
    if rotary:
      rp = self.atten + 'rotary_position_emb_tpl.'
      if _cls(g(rp + 'cls')) != 'RotaryPositionalEmbedding' or g(rp + 'min_timescale', 1) != 1:
        self.unsupported['rotary variant'] = (f'{_cls(g(rp + "cls"))} with min_timescale '
                                              f'{g(rp + "min_timescale")}: paxcli has the plain one, min 1')
      self.knobs['ROTARY_MAX_TIMESCALE'] = self.float(rp + 'max_timescale', 10000.0)
    if pos_cls is None:
      self.knobs['POSITION_EMBEDDING'] = 'rotary' if rotary else 'none'
      return
    if rotary:
      self.unsupported['rotary and absolute positions'] = 'paxcli uses one kind of position embedding'
    if pos_cls == 'PositionalEmbedding':
      self.knobs['POSITION_EMBEDDING'] = 'sinusoidal'
      lo, hi = g(lm + 'position_emb_tpl.min_timescale', 1), g(lm + 'position_emb_tpl.max_timescale', 10000)
      if (lo, hi) != (1, 10000):
        self.unsupported['sinusoid timescales'] = f'paxcli uses timescales 1..10000, Pax {lo}..{hi}'
    elif pos_cls == 'TrainablePositionalEmbedding':
      self.knobs['POSITION_EMBEDDING'] = 'learned'
      self.learned_rows = self.int(lm + 'position_emb_tpl.max_seq_length', 0, minimum=0)
    else:
      self.knobs['POSITION_EMBEDDING'] = 'none'
      self.unsupported['position embedding'] = f'praxis {pos_cls} has no paxcli equivalent'

  def _attention(self) -> None:
    g, k, a = self.get, self.knobs, self.atten
    k['USE_ATTENTION_BIAS'] = bool(g(a + 'use_bias', True))
    cap = self.float(a + 'atten_logit_cap', 0.0)
    k['ATTEN_LOGIT_CAP'] = cap if cap > 0 else 0.0
    per_dim = g(a + 'internal_enable_per_dim_scale', True)
    if g(a + 'internal_enable_query_scale', True) is False:
      self.unsupported['unscaled queries'] = 'paxcli always scales queries'
    k['USE_PER_DIM_SCALE'] = bool(per_dim)
    if not per_dim:   # praxis scales by (hidden_dim // num_heads) ** -0.5, hidden_dim = MODEL_DIMS
      by_head = g(a + 'scale_query_by_dim_per_head') and g(self.block + 'dim_per_head')
      dims = k['DIMS_PER_HEAD'] if by_head else k['MODEL_DIMS'] // k['NUM_HEADS']
      if dims != k['DIMS_PER_HEAD']:
        self.unsupported['query scale'] = (f'Pax scales queries by 1/sqrt({dims}), paxcli by '
                                           f'1/sqrt(DIMS_PER_HEAD={k["DIMS_PER_HEAD"]})')
    self._off('logits scaled by head dims', a + 'scale_logits_by_head_dims', 'an extra 1/sqrt(H) on logits')
    self._off('relative bias', a + 'relative_bias_tpl', 'no relative position bias in paxcli')
    self._off('depthwise conv on QKV (Primer)', a + 'dconv_qkv', 'no dconv in paxcli')
    self._off('attention extra logit', a + 'attention_extra_logit', 'no extra softmax logit in paxcli')
    self.combine_qkv = bool(g(a + 'combine_qkv'))
    self.nhd_post = bool(g(a + 'output_proj_use_nhd_shape'))

  def _qk_norm(self) -> bool:
    """praxis' QK norm (attention ln_tpl): each head's query and key normalised after rotary positions."""
    a = self.atten
    if self.get(a + 'ln_tpl') is None and self.get(a + 'ln_tpl.cls') is None:
      return False
    kind = _cls(self.get(a + 'ln_tpl.cls'))
    if kind != 'RmsNorm':
      self.unsupported['QK norm'] = f'paxcli normalises queries and keys with RMSNorm, Pax with {kind} ({a}ln_tpl)'
      return False
    self.knobs['USE_QK_NORM'] = True
    self.knobs['QK_NORM_AFTER_ROTARY'] = bool(self.get(a + 'use_rotary_position_emb'))
    return True

  def _softmax(self) -> None:
    g, k, s = self.get, self.knobs, self.softmax
    cls = _cls(g(s + 'cls'))
    self.separate = g(self.lm + 'separate_embedding_tpl.cls') is not None
    k['SEPARATE_EMBEDDING'] = self.separate
    want = 'FullSoftmax' if self.separate else 'SharedEmbeddingSoftmax'
    if cls not in (want, 'FullSoftmax', 'SharedEmbeddingSoftmax'):
      self.unsupported['softmax'] = f'praxis {cls} (paxcli reads {want})'
    scale_key = (self.lm + 'separate_embedding_tpl.' if self.separate else s) + 'scale_sqrt_depth'
    k['SCALE_EMBEDDING_SQRT_DEPTH'] = bool(g(scale_key))
    if self.separate and _cls(g(self.lm + 'separate_embedding_tpl.cls')) != 'Embedding':
      self.unsupported['embedding'] = f'praxis {_cls(g(self.lm + "separate_embedding_tpl.cls"))}'
    if g(s + 'feed_forward_tpl') is None and g(s + 'feed_forward_tpl.cls') is None:
      self.unsupported['softmax without weights'] = 'paxcli computes logits from weights'
    k['USE_SOFTMAX_BIAS'] = bool(g(s + 'feed_forward_tpl.has_bias', True))
    k['SOFTMAX_CAP_LOGITS'] = self.float(s + 'soft_cap_logits', 0.0)
    self._off('scale before logits', s + 'scale_before_logits', 'no 1/sqrt(D) before the softmax in paxcli')
    self._off('label smoothing', s + 'label_smoothing_prob', 'paxcli trains on plain cross-entropy')
    self._off('z-loss', s + 'z_loss_weight', 'paxcli trains on plain cross-entropy')
    self._off('bi-tempered loss', s + 'bi_tempered_loss_tpl', 'paxcli trains on plain cross-entropy')
    self._off('entropy loss', self.lm + 'entropy_loss_weight', 'paxcli trains on plain cross-entropy')

  def _training_only(self) -> None:
    g = self.get
    probs = {key: g(key) for key in (self.block + 'dropout_prob', self.block + 'input_dropout_prob',
                                      self.block + 'atten_dropout_prob', self.block + 'residual_dropout_prob',
                                      self.block + 'relu_dropout_prob')}
    probs = {key: v for key, v in probs.items() if v}
    self.knobs['DROPOUT_PROB'] = self.float(self.block + 'dropout_prob', 0.0)
    if probs:
      self.unsupported['dropout'] = (f'Pax drops out {", ".join(k.rsplit(".", 1)[-1] for k in probs)}; '
                                     'paxcli one DROPOUT_PROB on embeddings and residuals')

  def _quantization(self) -> None:
    """praxis' quantized layers (praxis.layers.quantization, set by quantize.for_transformer): in training mode
    with int8 weights and activations (AQT or fake quant) they keep float weights under the float layers' names,
    which paxcli reads, and train as AQT='int8' does; anything else (weights only, other precisions, an inference
    model's int8 weights, a quantized softmax) is named in UNSUPPORTED_FEATURES."""
    prefixes = sorted(k[:-len('quantization_type')] for k in self.cfg if k.endswith('quantization.quantization_type'))
    if not prefixes:
      return
    seen = {(self.get(p + 'mode'), self.get(p + 'weight_params.precision'), self.get(p + 'act_params.precision'))
            for p in prefixes}
    if seen == {('training', 8, 8)} and all(p.startswith(self.layer) for p in prefixes):
      self.knobs['AQT'] = 'int8'
      return
    self.unsupported['quantization'] = (
        f'praxis quantizes {len(prefixes)} layers as (mode, weight bits, activation bits) {sorted(map(str, seen))}; '
        "paxcli reads float weights and trains int8 weights and activations (AQT='int8') only "
        f'({prefixes[0]}quantization_type)')

  def _moe(self) -> None:
    """praxis' GShard MoE (the stack's num_experts and moe_layers: TransformerFeedForwardMoe in those layers of
    each block) as paxcli's MoE layer, in every layer or as the kind 'moe' of a LAYER_PATTERN. Its top-2 gating
    is a softmax over all experts, the best two renormalised to sum to 1 (praxis' legacy_mtf_behavior):
    ROUTER_SOFTMAX 'before_topk' with ROUTER_NORMALIZE_TOPK."""
    b, m = self.block, self.block + 'moe_layer_tpl.'
    experts = self.int(b + 'num_experts', 0, minimum=0, maximum=MAX_COUNT)
    sparse = self._moe_layers()
    if not experts or not sparse:
      return
    kind = {'NUM_EXPERTS': experts, 'EXPERTS_PER_TOKEN': 2, 'ROUTER_SOFTMAX': 'before_topk',
            'ROUTER_NORMALIZE_TOPK': True, 'ROUTER_Z_LOSS_WEIGHT': 0.0,
            'LOAD_BALANCE_LOSS_WEIGHT': self.float(m + 'moe_load_balance_loss_weight', 1.0)}
    if _cls(self.get(m + 'cls')) != 'TransformerFeedForwardMoe':
      self.unsupported[f'MoE layer {_cls(self.get(m + "cls"))}'] = (f'paxcli reads praxis\' TransformerFeedForwardMoe '
                                                                   f'({m}cls)')
    self._off('MoE gating', b + 'gating_func', 'paxcli routes as praxis\' top2 gating', ok=('top2', None))
    self._off('MoE second expert', m + 'second_expert_policy', 'paxcli takes the second-best expert (\'all\')',
              ok=('all', None))
    self._off('MoE gating logit cap', m + 'gating_logit_cap', 'no cap on router logits in paxcli')
    self._off('MoE sentence routing', m + 'moe_gating_embedding_level', 'paxcli routes each token',
              ok=('token', None))
    self._off('MoE residual weight', m + 'residual_weight', 'residuals are added with weight 1', ok=(1, 1.0, None))
    self._moe_capacity(kind, experts)
    self._moe_ffn(kind)
    pattern = self._moe_pattern(sparse)
    if pattern is None:
      self.knobs.update(kind)
    else:
      self.knobs['LAYER_PATTERN'] = pattern
      self.knobs['LAYER_KINDS'] = {'moe': kind}

  def _moe_layers(self) -> set[int]:
    """The layers of a block that praxis makes MoE (moe_layers: a list of indices as model_params.txt writes it)."""
    key = self.block + 'moe_layers'
    raw = self.get(key)
    if raw in (None, '', '()', '[]'):
      return set()
    text = (raw if isinstance(raw, str) else repr(raw)).strip()
    text = re.sub(r'np\.int\d+\((-?\d+)\)', r'\1', text) if len(text) < 100_000 else ''
    wrapped = re.fullmatch(r'array\((.*)\)', text)   # a numpy array's repr
    text = wrapped.group(1) if wrapped else text
    if not re.fullmatch(r'[\[(]\s*(-?\d+\s*,\s*)*(-?\d+\s*,?\s*)?[\])]', text):
      raise UserError(f'{self.where(key)}: {key} is {shorten(repr(raw), 60)}; paxcli reads a list of layer indices.')
    return {int(n) for n in re.findall(r'-?\d+', text) if 0 <= int(n) < self.per_block}

  def _moe_pattern(self, sparse: set[int]) -> Optional[tuple]:
    """LAYER_PATTERN of one block's dense and MoE layers at its shortest period (None: every layer is MoE)."""
    kinds = tuple('moe' if i in sparse else 'dense' for i in range(self.per_block))
    if set(kinds) == {'moe'}:
      return None
    return next(kinds[:p] for p in range(1, len(kinds) + 1)
                if len(kinds) % p == 0 and kinds == kinds[:p] * (len(kinds) // p))

  def _moe_capacity(self, kind: dict, experts: int) -> None:
    """praxis' capacity: the batch's tokens in num_groups groups, an expert taking int(factor x group / E) tokens
    of one, rounded up to a multiple of 4 (MOE_GROUPS, EXPERT_CAPACITY_RULE 'praxis'). A factor of at least the
    number of experts gives every expert room for its whole group (a token picks an expert once): dropless then,
    the same function without the dispatch's one-hot tensors."""
    m = self.block + 'moe_layer_tpl.'
    factor = self.float(m + 'unadjusted_expert_capacity_factor', 0.0)
    if factor >= experts:
      kind['MOE_DISPATCH'] = 'dropless'
      return
    kind.update(MOE_DISPATCH='capacity', EXPERT_CAPACITY_FACTOR=factor or 1.0, EXPERT_CAPACITY_RULE='praxis',
                MOE_GROUPS=self.int(self.block + 'num_groups', 1))
    self._off('MoE fixed capacity', m + 'expert_capacity_dim', 'paxcli derives the capacity from the factor alone')
    if not factor:
      self.unsupported['MoE capacity factor'] = f'paxcli needs a capacity factor ({m}unadjusted_expert_capacity_factor)'
    self._off('MoE minimum group size', self.block + 'min_group_size', 'paxcli routes in MOE_GROUPS groups')

  def _moe_ffn(self, kind: dict) -> None:
    """The experts' MLP where it differs from the dense layers' (hidden units, activation, gating), and its norm,
    which paxcli shares with theirs."""
    g, m = self.get, self.block + 'moe_layer_tpl.'
    hidden = self.int(m + 'hidden_dims', 0, minimum=0)
    if hidden and hidden != self.knobs['HIDDEN_DIMS']:
      kind['HIDDEN_DIMS'] = hidden
    names = {'GELU': 'gelu', 'ReLU': 'relu', 'SiLU': 'silu', 'Swish': 'swish'}
    act = _cls(g(m + 'activation_tpl.cls', 'praxis.layers.activations.ReLU'))
    if act not in names or (act == 'GELU' and g(m + 'activation_tpl.approximate') is False):
      self.unsupported['MoE activation'] = f'praxis {act} has no paxcli equivalent ({m}activation_tpl.cls)'
    elif names[act] != self.knobs['ACTIVATION']:
      kind['ACTIVATION'] = names[act]
    gated = bool(g(m + 'use_gated_activation'))   # praxis: act(x wi_gate_0) * (x wi_0)
    if gated != self.knobs['USE_GATED_ACTIVATION']:
      kind['USE_GATED_ACTIVATION'] = gated
    for field, default in (('cls', None), ('epsilon', 1e-6), ('direct_scale', None), ('use_bias', True),
                           ('use_scale', True)):
      mine, dense = g(m + 'ln_tpl.' + field, default), g(self.ffn + 'ln_tpl.' + field, default)
      if mine != dense:
        self.unsupported['MoE norm'] = (f'paxcli\'s MoE layers share the dense layers\' norm settings; praxis\' '
                                        f'{m}ln_tpl.{field} = {mine!r}, {self.ffn}ln_tpl.{field} = {dense!r}')

  # ---- Pax array names ----

  def layer_prefix(self, i: int) -> tuple[str, Optional[int]]:
    """(Pax name prefix of layer i, index into its leading axis or None)."""
    if self.repeated:
      r, j = divmod(i, self.per_block)
      return f'{_PARAMS}transformer.{self.repeat_name}.{self.sub_name}.x_layers_{j}.', r
    return f'{_PARAMS}transformer.x_layers_{i}.', None


def knobs_text(knobs: dict) -> list[str]:
  return [f'  {k} = {gencode.literal(v)}' for k, v in knobs.items()]


# ---- reading zarr arrays -----------------------------------------------------------------------


class _Arrays:
  """The arrays of a paxml state directory (zarr per array; metadata from .zarray alone)."""

  def __init__(self, state_dir: str):
    self.dir = state_dir
    if os.path.exists(os.path.join(state_dir, 'manifest.ocdbt')):
      raise UserError(f'{state_dir} is an OCDBT paxml checkpoint (tensorstore_use_ocdbt); paxcli reads the '
                      'default per-array layout only.')
    self.meta: dict[str, tuple[tuple, str]] = {}
    for name in sorted(os.listdir(state_dir)):
      path = os.path.join(state_dir, name, '.zarray')
      if os.path.exists(path):
        with open(path, encoding='utf-8') as f:
          z = json.load(f)
        self.meta[name] = (tuple(z['shape']), np.dtype(z['dtype']).name if z['dtype'] != 'bfloat16' else 'bfloat16')
    self.sharding = self._sharding()

  def _sharding(self) -> dict[str, str]:
    path = os.path.join(self.dir, '_sharding')
    if not os.path.exists(path):
      return {}
    out = {}
    try:
      with open(path, encoding='utf-8') as f:
        raw = json.load(f)
      for key, value in raw.items():
        name = base64.b64decode(key).decode()
        s = json.loads(value)
        mesh = ','.join(f'{a}={n}' for a, n in zip(s.get('axis_names', []), s.get('shape', [])))
        spec = ', '.join(repr(p) if not isinstance(p, list) else repr(tuple(p)) for p in s.get('partition_spec', []))
        out[name] = f'P({spec}) on {mesh}'
    except (OSError, ValueError):
      return {}
    return out

  def read(self, name: str, index=()) -> np.ndarray:
    import tensorstore as ts
    if name not in self.meta:
      raise UserError(f'{self.dir}: no array {name}.')
    store = ts.open({'driver': 'zarr', 'kvstore': {'driver': 'file', 'path': os.path.join(self.dir, name)}},
                    open=True, read=True).result()
    return np.asarray(store[index].read().result() if index != () else store.read().result())


# ---- the source --------------------------------------------------------------------------------


class PaxmlSource(formats.SourceBase):
  """A paxml checkpoint: Pax's own array names; `paxcli_view(model)` gives paxcli's."""
  kind = 'paxml'
  paxcli_names = False

  def __init__(self, path: str, step: Optional[int] = None, target=None):
    self.path = path
    self.step_dir, self.step, self.job_dir = locate(path, step)
    self.arrays_ = _Arrays(os.path.join(self.step_dir, 'state'))
    cfg_path = files.member(self.job_dir, CONFIG_FILE, 'paxml config')
    self.config_path = cfg_path if os.path.exists(cfg_path) else None
    self.native = None
    if self.config_path:
      self.native = parse_params_text(files.read_text(cfg_path, 'paxml config', MAX_CONFIG_BYTES))
    self._pax: Optional[PaxConfig] = None

  def pax(self) -> PaxConfig:
    if self._pax is None:
      if self.native is None:
        raise UserError(f'{self.path}: paxml writes the model config to <job dir>/{CONFIG_FILE}, and there is '
                        f'none at {os.path.join(self.job_dir, CONFIG_FILE)}; copy it there from the Pax job '
                        'directory (the arrays alone do not say caps, scales or positions).')
      self._pax = PaxConfig(self.native, self.config_path)
    return self._pax

  def arrays(self) -> list[ArrayInfo]:
    a = self.arrays_
    return [ArrayInfo(n, shape, dtype, a.sharding.get(n)) for n, (shape, dtype) in a.meta.items()]

  def read(self, name: str, index: Optional[int] = None) -> np.ndarray:
    return self.arrays_.read(name, () if index is None else index)

  def is_param(self, name: str) -> bool:
    return name.startswith('mdl_vars.')

  def inspect_config(self) -> dict:
    """What inspect shows: the paxcli knobs of the same model and what paxcli cannot honour."""
    if self.native is None:
      return {}
    pax = self.pax()
    out = {f'knobs.{k}': v for k, v in pax.knobs.items()}
    out['knobs.USE_REPEATED_LAYER'] = pax.repeated
    out['knobs.FPROP_DTYPE'] = pax.fprop_dtype
    out.update({f'unsupported.{k}': v for k, v in pax.unsupported.items()})
    return out

  def knobs(self) -> dict:
    """Knobs of the paxcli experiment computing this model's function (UNSUPPORTED_FEATURES included)."""
    pax = self.pax()
    out = dict(pax.knobs)
    out['UNSUPPORTED_FEATURES'] = dict(pax.unsupported)
    return out

  def check_experiment(self, experiment, log=print) -> None:
    """UserError listing each knob of the target experiment that differs from what the checkpoint
    needs, and the features paxcli cannot honour unless the experiment lists them in
    UNSUPPORTED_FEATURES (accepting the difference; its config keeps them, so `pax train`
    refuses until --set UNSUPPORTED_FEATURES={})."""
    need = self.knobs()
    unsupported = need.pop('UNSUPPORTED_FEATURES')
    have = experiment.knobs()
    now, needed = _settings(have), _settings({**have, **need})
    wrong = [f'{k} = {have.get(k)!r}, the checkpoint needs {v!r}' for k, v in need.items()
             if k in have and not _same(now.get(k, have[k]), needed.get(k, v))]
    accepted = getattr(experiment, 'UNSUPPORTED_FEATURES', None) or {}
    missing = {f: why for f, why in unsupported.items() if f not in accepted}
    if wrong:
      raise UserError(f'{type(experiment).__name__} does not compute the function of the Pax model in '
                      f'{self.path}: ' + '; '.join(wrong) + '. Set these knobs (or --set them).')
    if missing:
      items = '; '.join(f'{f}: {why}' for f, why in missing.items())
      raise UserError(f'The Pax model in {self.path} needs features paxcli cannot honour ({items}). The '
                      'converted model would compute another function. To convert anyway, list them in the '
                      'experiment\'s UNSUPPORTED_FEATURES (pax train then refuses until you accept with --set '
                      'UNSUPPORTED_FEATURES={}).')
    if unsupported:
      log('Note: the converted model differs from the Pax model where paxcli cannot follow it (listed in '
          'UNSUPPORTED_FEATURES): ' + '; '.join(f'{f}: {w}' for f, w in unsupported.items()))

  def paxcli_view(self, model) -> 'PaxView':
    return PaxView(self, model)

  def recipe_text(self, class_name: str) -> str:
    """A recipe of the model's knobs, with Pax's layer layout, FPROP_DTYPE and sequence length."""
    knobs = self.recipe_knobs()
    lines = ['"""A Pax model as a paxcli experiment (written by pax checkpoint convert --from paxml).',
             '', 'SOURCE is the checkpoint it was converted from, CONFIG the paxml config the knobs were',
             'derived from. UNSUPPORTED_FEATURES lists what paxcli cannot reproduce; `pax train` refuses',
             'to run until you accept it with --set UNSUPPORTED_FEATURES={}. Set the data (datasets(),',
             'MAX_SEQ_LEN, PERCORE_BATCH_SIZE) and optimizer for your runs.',
             '"""', '', 'from paxcli.experiment import register', 'from paxcli.models import LmExperiment', '',
             f'SOURCE = {gencode.literal(os.path.abspath(self.path))}',
             f'CONFIG = {gencode.literal(self.config_path)}', '', '',
             '@register', f'class {class_name}(LmExperiment):', '  """Converted from the paxml checkpoint SOURCE."""', '']
    return '\n'.join(lines + knobs_text(knobs)) + '\n'

  def recipe_knobs(self) -> dict:
    """The model's knobs plus Pax's layer layout, FPROP_DTYPE, sequence length and UNSUPPORTED_FEATURES."""
    pax = self.pax()
    knobs = dict(pax.knobs)
    knobs['USE_REPEATED_LAYER'] = pax.repeated
    seq = pax.get('input.seq_len') if isinstance(pax.get('input.seq_len'), int) else None
    lengths = [n for n in (seq, pax.learned_rows) if n]   # the input's, within a learned table
    knobs['MAX_SEQ_LEN'] = min(lengths) if lengths else 2048
    knobs['FPROP_DTYPE'] = pax.fprop_dtype
    family = registry.of_knobs(knobs)   # a Pax model computing one family's function is one of it
    if family is not None and not pax.unsupported:
      knobs['MODEL_FAMILY'] = family.name
    knobs['UNSUPPORTED_FEATURES'] = dict(pax.unsupported)
    return knobs

  def experiment_name(self):
    return None


def _settings(knob_values: dict) -> dict:
  """Knob name -> the value the model gets from it (NUM_KV_HEADS None: NUM_HEADS), for the LM's knobs."""
  values = effective(knob_values, LM_KNOBS)
  return {name: values[knob.flat] for name, knob in LM_KNOB.items()}


def _same(a, b) -> bool:
  if isinstance(b, float) or isinstance(a, float):
    return a is not None and abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(b)))
  return a == b


# ---- the view under paxcli names ---------------------------------------------------------------


class PaxView(formats.SourceBase):
  """Model parameters of a paxml checkpoint under paxcli names and shapes, in the layout of
  the paxcli model given (scanned `params/layers/...` or `params/layer_<i>/...`); each
  array is read and converted on request, a scanned one layer by layer when asked so."""
  kind = 'paxml'

  def __init__(self, src: PaxmlSource, model):
    self.path, self.step, self.src = src.path, src.step, src
    self.knobs = src.knobs
    self.pax = src.pax()
    self._have = src.arrays_.meta
    self._map: dict[str, tuple[tuple, Callable[..., np.ndarray], str]] = {}
    self._used: set[str] = set()
    self._problems: list[str] = []
    shapes = _param_shapes(model)
    period = len({n.split('/')[2] for n in shapes if re.match(r'^params/layers/block_\d+/', n)}) or 1
    for name, shape in shapes.items():
      rel = name[len('params/'):]
      if rel.startswith('layers/'):   # row r of layers/block_<j>/... is layer r x period + j (models.pattern)
        sub = rel[len('layers/'):]
        j, sub = (int(sub.split('/', 1)[0][len('block_'):]), sub.split('/', 1)[1]) if period > 1 else (0, sub)
        rows = [r * period + j for r in range(shape[0])]
        per = [self._layer(f'params/layer_{i}/{sub}', i, sub, shape[1:]) for i in rows]
        if None not in per:
          self._map[name] = (shape, _stacked([p[1] for p in per]), per[0][2])
        continue
      if rel.startswith('layer_'):
        i, sub = rel[len('layer_'):].split('/', 1)
        entry = self._layer(name, int(i), sub, shape)
      else:
        entry = self._top(name, rel, shape)
      if entry is not None:
        self._map[name] = entry
    stray = sorted(n for n in self._have if n.startswith(_PARAMS) and n not in self._used)
    self._problems += [f'{n}: {list(self._have[n][0])} has no place in the paxcli model' for n in stray]
    if self._problems:
      shown = self._problems[:20] + ([f'... {len(self._problems) - 20} more'] if len(self._problems) > 20 else [])
      raise UserError(f'{src.path}: the Pax arrays do not fit the paxcli model of its config:\n  '
                      + '\n  '.join(shown))

  def _top(self, name, rel, shape):
    pax = self.pax
    sm = f'{_PARAMS}softmax.logits_ffn.'
    if rel == 'embedding/embedding' and pax.separate:
      return self._entry(name, shape, f'{_PARAMS}embedding_lookup.emb_var')
    if rel == 'embedding/embedding':                      # tied: the softmax weight [D, V]
      return self._entry(name, shape, sm + 'linear.w', lambda x: x.T, src_shape=shape[::-1])
    if rel == 'logits/kernel':
      return self._entry(name, shape, sm + 'linear.w')
    if rel in ('logits_bias', 'logits/bias'):
      return self._entry(name, shape, sm + 'bias.b')
    if rel == 'position_embedding':                        # Pax's table may be longer than MAX_SEQ_LEN
      pax_name = f'{_PARAMS}position_emb.emb_var'
      rows = self._have.get(pax_name, ((shape[0],), ''))[0][0]
      if rows < shape[0]:
        self._used.add(pax_name)
        self._problems.append(f'{pax_name}: {rows} positions, the experiment needs MAX_SEQ_LEN {shape[0]}')
        return None
      return self._entry(name, shape, pax_name, lambda x: x[:shape[0]], src_shape=(rows,) + shape[1:])
    if rel.startswith('final_norm/'):
      return self._norm(name, shape, f'{_PARAMS}final_ln.', rel.rsplit('/', 1)[1], 'final', None)
    self._problems.append(f'{name}: in the paxcli model, but no Pax array maps to it')
    return None

  def _layer(self, name, i, sub, shape):
    """Entry of one layer's array `sub` (e.g. 'attention/query/kernel'), or None (problem noted)."""
    pax = self.pax
    pre, rep = pax.layer_prefix(i)
    lead, sel = ((), ()) if rep is None else ((pax.x_times,), (rep,))
    att = pre + 'self_attention.'
    parts = sub.split('/')
    leaf = lambda field: 'w' if field == 'kernel' else 'b'
    if parts[0] in _BLOCK_NORMS and (pax.norm_policy == 'primer_hybrid' or _BLOCK_NORMS[parts[0]][2] ==
                                     {'pre': 'pre', 'post': 'post'}.get(pax.norm_policy)):
      sub_layer, which, when = _BLOCK_NORMS[parts[0]]
      norm = f'{when}_layer_norm' if pax.norm_policy == 'primer_hybrid' else 'layer_norm'
      return self._norm(name, shape, f'{pre}{sub_layer}{norm}.', parts[1], which, rep)
    if parts[0] == 'attention' and parts[1] in ('query_norm', 'key_norm'):
      return self._norm(name, shape, f'{att}layer_norm_{parts[1][0]}.', parts[2], 'query/key', rep)
    if parts[0] == 'attention' and parts[1] in ('query', 'key', 'value'):
      if pax.combine_qkv:                                  # [(L,) 3, D, N, H]: one slice of it
        return self._entry(name, shape, att + 'combined_qkv.' + leaf(parts[2]), src_shape=lead + (3,) + shape,
                           sel=sel + ('qkv'.index(parts[1][0]),))
      return self._entry(name, shape, f'{att}{parts[1]}.{leaf(parts[2])}', src_shape=lead + shape, sel=sel)
    if parts[0] == 'attention' and parts[1] == 'out' and parts[2] == 'kernel':
      n, h, d = shape
      if pax.nhd_post:
        return self._entry(name, shape, att + 'post.w', src_shape=lead + shape, sel=sel)
      return self._entry(name, shape, att + 'post.w', lambda x: np.transpose(x, (1, 2, 0)),
                         src_shape=lead + (d, n, h), sel=sel)
    if parts[0] == 'attention' and parts[1] == 'out':
      return self._entry(name, shape, att + 'post.b', src_shape=lead + shape, sel=sel)
    if parts[0] == 'attention' and parts[1] == 'per_dim_scale':
      return self._entry(name, shape, att + 'per_dim_scale.per_dim_scale', src_shape=lead + shape, sel=sel)
    if parts[0] == 'mlp' and len(parts) == 2:   # the MoE layer's router and expert weights
      return self._moe(name, shape, f'{pre}ff_layer.', parts[1], lead, sel)
    if parts[0] == 'mlp':
      gated = pax.knobs['USE_GATED_ACTIVATION']   # praxis: act(x W_gate) * (x W1); paxcli act(wi_0) * wi_1
      ffn = {'wi_0': 'ffn_layer1_gate' if gated else 'ffn_layer1', 'wi_1': 'ffn_layer1', 'wo': 'ffn_layer2'}
      part = 'linear.w' if parts[2] == 'kernel' else 'bias.b'
      return self._entry(name, shape, f'{pre}ff_layer.{ffn[parts[1]]}.{part}', src_shape=lead + shape, sel=sel)
    self._problems.append(f'{name}: in the paxcli model, but no Pax array maps to it')
    return None

  def _moe(self, name, shape, ff, leaf, lead, sel):
    """praxis' gate [D, E] is the router; wi_0 [E, D, F] and wo_0 [E, F, D] are wi_0 and wo, or with the gated
    activation act(x wi_gate_0) * (x wi_0) paxcli's act(x wi_0) * (x wi_1). praxis' experts have no biases:
    paxcli's (USE_BIAS, which the dense layers' feed-forward and norms need) start at zero."""
    gated = f'{ff}wi_gate_0' in self._have
    pax_leaf = {'router': 'gate', 'wi_0': 'wi_gate_0' if gated else 'wi_0', 'wi_1': 'wi_0', 'wo': 'wo_0'}.get(leaf)
    if pax_leaf is None and leaf in ('bi_0', 'bi_1', 'bo'):
      return tuple(shape), lambda: np.zeros(shape, np.float32), 'float32'
    if pax_leaf is None:
      self._problems.append(f'{name}: in the paxcli model, but no Pax array maps to it')
      return None
    return self._entry(name, shape, ff + pax_leaf, src_shape=lead + tuple(shape), sel=sel)

  def _norm(self, name, shape, prefix, leaf, which, rep):
    lead, sel = ((), ()) if rep is None else ((self.pax.x_times,), (rep,))
    plus_one = leaf == 'scale' and not self.pax.direct_scale[which]   # praxis: x * (1 + scale)
    fix = (lambda x: x + np.asarray(1, x.dtype)) if plus_one else (lambda x: x)
    return self._entry(name, shape, prefix + leaf, fix, src_shape=lead + shape, sel=sel)

  def _entry(self, name, shape, pax_name, fix=lambda x: x, src_shape=None, sel=()):
    """(shape, read, dtype): `name` read as pax_name[sel] (leading indices), reshaped to the rest of
    src_shape (praxis' attention_combine_dims keeps N*H in one axis), then `fix`."""
    self._used.add(pax_name)
    if pax_name not in self._have:
      self._problems.append(f'{name}: no {pax_name} in the checkpoint')
      return None
    got, dtype = self._have[pax_name]
    expect = tuple(src_shape if src_shape is not None else shape)
    k = len(sel)
    if got != expect and not (got[:k] == expect[:k] and int(np.prod(got)) == int(np.prod(expect))):
      self._problems.append(f'{pax_name}: {list(got)}, the paxcli model needs {list(expect)} for {name}')
      return None
    arrays, inner = self.src.arrays_, expect[k:]

    def read():
      x = arrays.read(pax_name, sel) if sel else arrays.read(pax_name)
      return fix(np.asarray(x).reshape(inner))

    return tuple(shape), read, dtype

  def arrays(self) -> list[ArrayInfo]:
    return [ArrayInfo(n, shape, dtype) for n, (shape, _, dtype) in self._map.items()]

  def read(self, name: str, index: Optional[int] = None) -> np.ndarray:
    if name not in self._map:
      raise KeyError(name)
    _, read, _ = self._map[name]
    if getattr(read, 'layered', False):
      return read(index)
    x = read()
    return x[index] if index is not None else x


# paxcli's block norms: (praxis sub-layer, which norm config, praxis' primer_hybrid name); praxis' 'pre'
# and 'post' policies have one norm a sub-layer, `layer_norm`, before or after it.
_BLOCK_NORMS = {'attention_norm': ('', 'attention', 'pre'), 'post_attention_norm': ('', 'attention', 'post'),
                'mlp_norm': ('ff_layer.', 'feed-forward', 'pre'), 'post_mlp_norm': ('ff_layer.', 'feed-forward', 'post')}


def _stacked(reads: list):
  """A reader of a scanned array from one reader per layer: all layers stacked, or one."""
  def read(index=None):
    return np.stack([r() for r in reads]) if index is None else reads[index]()
  read.layered = True
  return read


def _param_shapes(model) -> dict[str, tuple]:
  """'params/...' -> shape of the model's parameters (jax.eval_shape: no memory)."""
  import jax   # only here: reading and inspecting checkpoints never starts jax
  ids = jax.ShapeDtypeStruct((1, 1), jax.numpy.int32)
  model = getattr(model, 'model', model)   # models.flat_view(...) carries the module
  boxed = jax.eval_shape(lambda r, x: model.init({'params': r, 'dropout': r}, x)['params'],
                         jax.random.key(0), ids)
  flat = jax.tree_util.tree_flatten_with_path(engine.unbox(boxed))[0]
  return {'params/' + formats.join(p): tuple(x.shape) for p, x in flat}


formats.register_reader('paxml', lambda path, step=None, target=None: PaxmlSource(path, step),
                        detect=is_paxml_checkpoint)
