"""Transformer layers on flax.linen; every weight carries logical axis names.

Logical axes: vocab, embed, mlp, heads, kv_heads, head_dim, layers (see sharding.py
for how they map onto the mesh). Shapes in names: B batch, L length, S source length,
D model dims, H heads, K kv heads, G query heads per kv head, E dims per head, F hidden.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from typing import Callable, Optional

import fiddle as fdl
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from paxcli.layers import attention_ops, fp8, lora
from paxcli.layers.activation_sharding import constrain
from paxcli.layers.base import BaseLayer, LayerTpl, template_field
from paxcli.options import ACTIVATIONS

_ACTIVATIONS: dict[str, Callable] = {
    'gelu': nn.gelu,
    'relu': nn.relu,
    'silu': nn.silu,
    'swish': nn.silu,
}
assert set(_ACTIVATIONS) == set(ACTIVATIONS), 'paxcli.options.ActivationName and _ACTIVATIONS disagree'


def dtype_of(name: str):
  return {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float16': jnp.float16}[name]



def _init(names):
  """Fan-in scaled truncated normal with logical axis names (DenseGeneral passes the
  kernel flattened to 2-D, so fan-in is the product of the input axes)."""
  return nn.with_logical_partitioning(
      nn.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal'), names)


class Norm(nn.Module):
  """LayerNorm or RMSNorm computed in float32, returned in `dtype`.

  `plus_one`: the normalised x is multiplied by (1 + scale), scale stored as it is and starting at 0
  (Gemma's RMSNorm, praxis' RmsNorm without direct_scale); else by scale, starting at 1.
  """
  kind: str = 'layernorm'
  use_bias: bool = True
  dtype: jnp.dtype = jnp.float32
  epsilon: float = 1e-6
  plus_one: bool = False

  @nn.compact
  def __call__(self, x_BxLxD):
    x = x_BxLxD.astype(jnp.float32)
    dims = x.shape[-1]
    init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
    scale = self.param('scale', nn.with_logical_partitioning(init, ('norm',)), (dims,))
    if self.plus_one:
      scale = 1.0 + scale
    if self.kind == 'rmsnorm':
      y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.epsilon)
    else:
      mean = jnp.mean(x, axis=-1, keepdims=True)
      var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
      y = (x - mean) * jax.lax.rsqrt(var + self.epsilon)
    expand = (1,) * (x.ndim - 1) + (dims,)  # explicit broadcasting (tests forbid rank promotion)
    y = y * scale.reshape(expand)
    if self.kind == 'layernorm' and self.use_bias:
      bias = self.param('bias', nn.with_logical_partitioning(nn.initializers.zeros, ('norm',)), (dims,))
      y = y + bias.reshape(expand)
    return y.astype(self.dtype)


def rotary_dims(dims_per_head: int, fraction: float) -> int:
  """The dimensions of a head that rotary positions rotate, the first ones (Hugging Face's int(head_dim x
  partial_rotary_factor)); the rest pass unrotated."""
  return int(dims_per_head * fraction)


@dataclasses.dataclass(frozen=True)
class RotaryScaling:
  """What a rope scaling does to the rotated part of a head (ROTARY_SCALINGS makes one from a layer's settings):
  per rotated pair, the factor its timescale is stretched by (`short`; with LongRoPE's two sets, `long` for a
  text reaching past `original_max_len` positions, every position of it), and the factor on the rotated part
  of queries and keys (`attention_factor`: Hugging Face's attention scaling of cos and sin)."""
  short: np.ndarray
  long: Optional[np.ndarray] = None
  original_max_len: int = 0
  attention_factor: float = 1.0


def _linear_scaling(timescale, layer) -> RotaryScaling:
  """'linear': every pair by ROTARY_SCALING_FACTOR (positions / factor)."""
  return RotaryScaling(np.full_like(timescale, layer.rotary_scaling_factor))


def _llama3_scaling(timescale, layer) -> RotaryScaling:
  """'llama3' (Llama 3.1's): pairs whose wavelength 2 pi timescale is above original_max_len / low_freq_factor
  by `factor`, those below original_max_len / high_freq_factor not at all, those between by
  1 / ((1 - s) / factor + s) with s = (original_max_len / wavelength - low_freq_factor) / (high_freq_factor -
  low_freq_factor)."""
  factor, low, high = layer.rotary_scaling_factor, layer.rotary_low_freq_factor, layer.rotary_high_freq_factor
  original = layer.rotary_original_max_len
  wavelength = 2 * np.pi * timescale
  smooth = (original / wavelength - low) / (high - low)
  inverse = np.where(wavelength > original / low, 1 / factor,
                     np.where(wavelength < original / high, 1.0, (1 - smooth) / factor + smooth))
  return RotaryScaling(1 / inverse)


def _longrope_scaling(timescale, layer) -> RotaryScaling:
  """'longrope' (Phi-3's LongRoPE): a factor per pair, ROTARY_SHORT_FACTORS for a text of at most
  ROTARY_ORIGINAL_MAX_LEN positions and ROTARY_LONG_FACTORS for a longer one; rotated queries and keys x
  ROTARY_ATTENTION_FACTOR, else sqrt(1 + ln(factor) / ln(original_max_len)) (1 at factor 1), as transformers."""
  factor, original = layer.rotary_scaling_factor, layer.rotary_original_max_len
  attention = layer.rotary_attention_factor
  if attention is None:
    attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
  return RotaryScaling(np.asarray(layer.rotary_short_factors, np.float64),
                       np.asarray(layer.rotary_long_factors, np.float64), original, float(attention))


def _yarn_scaling(timescale, layer) -> RotaryScaling:
  """'yarn' (YaRN, Peng et al. 2023; DeepSeek-V3, long Qwen): pairs that turn more than ROTARY_BETA_FAST times
  over ROTARY_ORIGINAL_MAX_LEN positions kept, those turning less than ROTARY_BETA_SLOW times by `factor`, a
  linear ramp over the pair index between (the bounds floored and ceiled, as transformers' truncate); rotated
  queries and keys x ROTARY_ATTENTION_FACTOR, else yarn_attention_factor's."""
  factor = layer.rotary_scaling_factor
  inverse = _yarn_inverse(2 * len(timescale), layer.rotary_max_timescale, factor, layer.rotary_original_max_len,
                          layer.rotary_beta_fast, layer.rotary_beta_slow)
  attention = layer.rotary_attention_factor
  if attention is None:
    attention = yarn_attention_factor(factor, layer.rotary_mscale, layer.rotary_mscale_all_dim)
  return RotaryScaling(1 / inverse, attention_factor=float(attention))


def _yarn_inverse(dims: int, base: float, factor: float, original_max_len: int, beta_fast: float,
                  beta_slow: float) -> np.ndarray:
  """YaRN's frequency of each pair over the unscaled one [dims // 2]: 1 for the fast pairs, 1 / factor for the
  slow ones, the ramp between."""
  def pair_of(rotations):   # the (fractional) pair index that turns `rotations` times over original_max_len
    return dims * math.log(original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(base))
  low, high = max(math.floor(pair_of(beta_fast)), 0), min(math.ceil(pair_of(beta_slow)), dims - 1)
  ramp = np.clip((np.arange(dims // 2, dtype=np.float64) - low) / ((high - low) or 0.001), 0, 1)
  return ramp / factor + (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude correction 0.1 mscale ln(factor) + 1 (1 for factor <= 1)."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(factor: float, mscale: Optional[float], mscale_all_dim: Optional[float]) -> float:
  """YaRN's own factor on the rotated queries and keys (transformers' attention_scaling of cos and sin):
  yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) where both are set (DeepSeek's), else
  yarn_mscale(factor)."""
  if mscale and mscale_all_dim:
    return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
  return yarn_mscale(factor)


# Hugging Face's rope scalings, by ROTARY_SCALING (paxcli.options.RotaryScalingName; models.hf_config.ROPE_TYPES
# reads and writes their config.json keys): (the head's timescales [pairs], float64; the attention layer) ->
# RotaryScaling. A new rope type is one entry here and one there, and its knobs.
ROTARY_SCALINGS: dict[str, Callable] = {
    'linear': _linear_scaling,
    'llama3': _llama3_scaling,
    'longrope': _longrope_scaling,
    'yarn': _yarn_scaling,
}


def rotary_scaling(layer, dims: int) -> Optional[RotaryScaling]:
  """The scaling of `layer`'s (an Attention's) rotary positions over `dims` rotated dimensions; None for none.
  Computed once, in float64, from the settings alone (no traced values)."""
  if layer.rotary_scaling == 'none':
    return None
  if layer.rotary_scaling not in ROTARY_SCALINGS:
    raise ValueError(f'unknown rotary scaling {layer.rotary_scaling!r}')
  timescale = layer.rotary_max_timescale ** (np.arange(dims // 2, dtype=np.float64) * 2.0 / dims)
  return ROTARY_SCALINGS[layer.rotary_scaling](timescale, layer)


def _timescales(dims: int, max_timescale: float, factors) -> jax.Array:
  """[dims // 2] float32 timescales of the rotated pairs, stretched by `factors` (None: not)."""
  timescale = max_timescale ** (jnp.arange(dims // 2, dtype=jnp.float32) * 2.0 / dims)
  return timescale if factors is None else timescale * jnp.asarray(factors, jnp.float32)


def rotary(x_BxLxHxE, positions_BxL, max_timescale: float, scaling: Optional[RotaryScaling] = None, long_BxL=None,
           fraction: float = 1.0, interleave: bool = False):
  """Rotary position embedding (split-half form, Hugging Face Llama's rotate_half) of queries or keys: the first
  rotary_dims(E, fraction) dimensions of each head rotate, the rest pass as they are. `scaling` (rotary_scaling
  gives it; None: none) stretches each pair's timescale and multiplies the rotated part by its attention
  factor; with two sets of factors (LongRoPE), the tokens where `long_BxL` holds take the long ones.
  `interleave`: the rotated pairs are (x0, x1), (x2, x3), ... (DeepSeek's rope_interleave) rather than the two
  halves; they come out as halves, which queries and keys share, so their products are those of the
  interleaved rotation."""
  dims = rotary_dims(x_BxLxHxE.shape[-1], fraction)
  if scaling is None:
    timescale = _timescales(dims, max_timescale, None)[None, None, None, :]
  elif scaling.long is not None and long_BxL is not None:
    short, long = _timescales(dims, max_timescale, scaling.short), _timescales(dims, max_timescale, scaling.long)
    timescale = jnp.where(long_BxL[:, :, None, None], long[None, None, None, :], short[None, None, None, :])
  else:
    timescale = _timescales(dims, max_timescale, scaling.short)[None, None, None, :]
  angles_BxLx1xR = positions_BxL[:, :, None, None].astype(jnp.float32) / timescale
  return _rotate(x_BxLxHxE, angles_BxLx1xR, dims, scaling.attention_factor if scaling else 1.0, interleave)


def _rotate(x_BxLxHxE, angles_BxLx1xR, dims: int, factor: float = 1.0, interleave: bool = False):
  """The first `dims` dimensions of each head turned by the angles of their pairs (x1, x2) -> (x1 cos - x2 sin,
  x2 cos + x1 sin), times `factor`; the rest as they are. Pairs: the two halves of the `dims`, or neighbours
  with `interleave`."""
  sin, cos = jnp.sin(angles_BxLx1xR), jnp.cos(angles_BxLx1xR)
  if factor != 1.0:
    sin, cos = sin * factor, cos * factor
  x = x_BxLxHxE.astype(jnp.float32)
  half = dims // 2
  x1, x2 = (x[..., 0:dims:2], x[..., 1:dims:2]) if interleave else (x[..., :half], x[..., half:dims])
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., dims:]], axis=-1)
  return out.astype(x_BxLxHxE.dtype)


def beyond(positions_BxL, segment_ids_BxL, original_max_len: int):
  """Per token, whether its text reaches past `original_max_len` positions (some position of it is at least
  that): the whole row, or with `segment_ids_BxL` the token's segment (a run of one id; packed texts each on
  their own, as transformers sees them one by one)."""
  reached = positions_BxL >= original_max_len
  if segment_ids_BxL is None:
    return jnp.broadcast_to(jnp.any(reached, axis=1, keepdims=True), reached.shape)
  length = reached.shape[1]
  starts = jnp.concatenate([jnp.ones_like(segment_ids_BxL[:, :1], jnp.int32),
                            (segment_ids_BxL[:, 1:] != segment_ids_BxL[:, :-1]).astype(jnp.int32)], axis=1)
  runs_BxL = jnp.cumsum(starts, axis=1) - 1

  def row(reached_L, runs_L):
    return jax.ops.segment_max(reached_L.astype(jnp.int32), runs_L, num_segments=length)[runs_L] > 0
  return jax.vmap(row)(reached, runs_BxL)

def sinusoidal(positions_BxL, dims: int, min_timescale: float = 1.0, max_timescale: float = 10000.0):
  """Fixed sinusoidal position embedding, Pax's PositionalEmbedding: [sin | cos] halves with
  timescales geometric from min to max (zero-padded when dims is odd). Returns float32 [B, L, D]."""
  half = dims // 2
  log_increment = math.log(max_timescale / min_timescale) / max(half - 1, 1)
  inv_timescale = min_timescale * jnp.exp(jnp.arange(half, dtype=jnp.float32) * -log_increment)
  angles_BxLxD2 = positions_BxL[:, :, None].astype(jnp.float32) * inv_timescale[None, None, :]
  signal = jnp.concatenate([jnp.sin(angles_BxLxD2), jnp.cos(angles_BxLxD2)], axis=-1)
  return jnp.pad(signal, [(0, 0), (0, 0), (0, dims % 2)])


def soft_cap(logits, cap: float):
  """cap * tanh(logits / cap): bounds |logits| below cap smoothly; cap 0 leaves them as they are."""
  return cap * jnp.tanh(logits / cap) if cap else logits


# Decoding's fused products (paxcli.models.lm: LanguageModel.decoding_params): an attention's query, key and
# value kernels joined into one [D, N] kernel, a gated MLP's wi_0 and wi_1 into one, so that a step reads its
# input once and runs one product where it ran three (two). The decoder prepares them from the checkpoint's
# weights once per set of params; checkpoints and weight maps keep the separate kernels. `_kernel_t` holds the
# joined kernel transposed ([N, D]), the layout AVX2's matrix kernels run faster (fuse_for_decoding); there the
# products after them, the attention's `out` and the MLP's `wo`, are laid out so too (`out_kernel_t`, `wo_kernel_t`).
FUSED_QKV, FUSED_WI = 'qkv', 'wi'
KERNEL, KERNEL_T, BIAS = '_kernel', '_kernel_t', '_bias'


def has_fused(module: nn.Module, name: str) -> bool:
  return module.has_variable('params', name + KERNEL) or module.has_variable('params', name + KERNEL_T)


def fused_product(module: nn.Module, name: str, x_BxLxD, dtype):
  """x times the fused kernel `name` ([D, N], or [N, D] when transposed) plus its bias: [B, L, N] in `dtype`,
  the product nn.Dense would make of the same kernel."""
  transposed = module.has_variable('params', name + KERNEL_T)
  w = module.get_variable('params', name + (KERNEL_T if transposed else KERNEL))
  bias = module.get_variable('params', name + BIAS) if module.has_variable('params', name + BIAS) else None
  x, w, bias = nn.dtypes.promote_dtype(x_BxLxD, w, bias, dtype=dtype)
  y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (1 if transposed else 0,)), ((), ())))
  return y if bias is None else y + bias.reshape((1,) * (y.ndim - 1) + (-1,))


def fuse_for_decoding(params: dict, shardings: dict, transposed: bool) -> tuple[dict, dict]:
  """(params, their shardings) with every attention's query/key/value and every gated MLP's wi_0/wi_1 joined
  (FUSED_QKV, FUSED_WI; [N, D] when `transposed`), where the joined axes are whole on each device (a
  product split over devices by heads or hidden units keeps its own kernels); other weights are the same
  arrays. A scanned stack's [layers, ...] weights join layer by layer."""
  if not isinstance(params, dict):
    return params, shardings
  params, shardings = dict(params), dict(shardings)
  for group, names, tail, after in ((FUSED_QKV, ('query', 'key', 'value'), 2, ('out', 2)),
                                    (FUSED_WI, ('wi_0', 'wi_1'), 1, ('wo', 1))):
    if _joinable(params, shardings, names, tail):
      _join(params, shardings, group, names, tail, transposed)
      if transposed:   # the product after the joined one, [N, D] too: AVX2 ran wo 1.8x as fast so at 16 rows
        _transpose_alone(params, shardings, *after)
  for key in params:
    params[key], shardings[key] = fuse_for_decoding(params[key], shardings[key], transposed)
  return params, shardings


def _joinable(params: dict, shardings: dict, names: tuple, tail: int) -> bool:
  """Whether `names` are dense projections ({'kernel'[, 'bias']}) of one input, their output axes (the last
  `tail` of each kernel) unsplit and the rest split alike."""
  parts = [params.get(n) for n in names]
  if not all(isinstance(p, dict) and 'kernel' in p and set(p) <= {'kernel', 'bias'} for p in parts):
    return False
  if len({'bias' in p for p in parts}) > 1 or len({p['kernel'].shape[:-tail] for p in parts}) > 1:
    return False
  specs = [_spec(shardings[n]['kernel'], p['kernel'].ndim) for n, p in zip(names, parts)]
  if None in specs or len({s[:-tail] for s in specs}) > 1:
    return False
  return all(_whole(shardings[n]['kernel'], axis) for n, s in zip(names, specs) for axis in s[-tail:])


def _spec(sharding, ndim: int) -> Optional[tuple]:
  """A NamedSharding's spec padded to `ndim` entries; None for another kind of sharding (not joined)."""
  spec = getattr(sharding, 'spec', None)
  return None if spec is None else tuple(spec) + (None,) * (ndim - len(spec))


def _whole(sharding, axis) -> bool:
  """Whether a spec entry (None, a mesh axis or a tuple of them) leaves its array axis unsplit."""
  names = () if axis is None else (axis if isinstance(axis, tuple) else (axis,))
  return all(sharding.mesh.shape[n] == 1 for n in names)


def _join(params: dict, shardings: dict, group: str, names: tuple, tail: int, transposed: bool) -> None:
  mesh = shardings[names[0]]['kernel'].mesh
  lead = _spec(shardings[names[0]]['kernel'], params[names[0]]['kernel'].ndim)[:-tail]   # [..., D]'s split
  name = group + (KERNEL_T if transposed else KERNEL)
  shardings[name] = NamedSharding(mesh, PartitionSpec(*lead[:-1], *((None, lead[-1]) if transposed else lead[-1:])))
  params[name] = jax.device_put(_joined([params[n]['kernel'] for n in names], tail, transposed), shardings[name])
  if 'bias' in params[names[0]]:
    shardings[group + BIAS] = NamedSharding(mesh, PartitionSpec(*lead[:-1], None))
    params[group + BIAS] = jax.device_put(_joined([params[n]['bias'] for n in names], tail, False),
                                          shardings[group + BIAS])
  for n in names:
    del params[n], shardings[n]


def _transpose_alone(params: dict, shardings: dict, name: str, inputs: int) -> None:
  """The projection `name` ({'kernel'[, 'bias']}, its last `inputs` + 1 axes its own: inputs, then output) as
  one [N, D] kernel under name + KERNEL_T, split as before (its input axes flattened into one, so only the
  first of them may be split)."""
  part = params.get(name)
  if not (isinstance(part, dict) and 'kernel' in part and set(part) <= {'kernel', 'bias'}):
    return
  kernel, sharding = part['kernel'], shardings[name]['kernel']
  own = kernel.ndim - inputs - 1
  spec = _spec(sharding, kernel.ndim)
  if own < 0 or spec is None or not all(_whole(sharding, axis) for axis in spec[own + 1:-1]):
    return
  target = NamedSharding(sharding.mesh, PartitionSpec(*spec[:own], spec[-1], spec[own]))
  flat = kernel.reshape(kernel.shape[:own] + (-1, kernel.shape[-1]))
  params[name + KERNEL_T], shardings[name + KERNEL_T] = jax.device_put(jnp.swapaxes(flat, -1, -2), target), target
  if 'bias' in part:
    params[name + BIAS], shardings[name + BIAS] = part['bias'], shardings[name]['bias']
  del params[name], shardings[name]


@functools.partial(jax.jit, static_argnums=(1, 2))
def _joined(arrays: list, tail: int, transposed: bool):
  """The arrays' last `tail` axes flattened and joined end to end; the last two axes swapped if `transposed`."""
  joined = jnp.concatenate([a.reshape(a.shape[:a.ndim - tail] + (-1,)) for a in arrays], axis=-1)
  return jnp.swapaxes(joined, -1, -2) if transposed else joined


class Attention(nn.Module):
  """Causal multi-head attention with grouped-query support (num_kv_heads <= num_heads).

  `segment_ids_BxL` None: one segment per row (no packing). The kernel is
  `attention_ops.attention`; attention_impl: auto (cuDNN flash attention on GPUs), dot_product
  (jax.nn.dot_product_attention) or einsum (the reference).
  Queries: 1/sqrt(E), or 1/sqrt(query_pre_attn_scalar) when that is set (Gemma's), times Pax's
  learned PerDimScale with `per_dim_scale` (softplus(w) / softplus(0) per dimension, w starting
  at 0). `atten_logit_cap` > 0 soft-caps the logits with tanh before the mask, as Pax's
  atten_logit_cap and Gemma 2's attn_logit_softcapping do (attention_ops: the blockwise kernel).
  `sliding_window` w > 0: each token attends to the w most recent tokens of its segment, itself
  included (Hugging Face's sliding_window; attention_ops.visible); 0 is full causal attention.
  `qkv_bias`: the query, key and value projections have a bias even where `use_bias` is off
  (Qwen 2's layer: the output projection has none). `qk_norm`: each head's query and key go
  through an RMSNorm over E (`query_norm`, `key_norm`, epsilon `norm_epsilon`, x (1 + w) with
  `norm_plus_one` as Gemma 3's) before rotary (Qwen 3's layer), or after it with
  `qk_norm_after_rotary` (praxis' attention ln_tpl: the two differ where the scale does); with
  `qk_norm_per_head` off, one RMSNorm over the whole query projection [H x E] and one over the key's
  [K x E] (OLMo 2's). Rotary positions rotate the first rotary_dims(E, rotary_fraction) dimensions of a
  head, scaled by `rotary_scaling` (ROTARY_SCALINGS); with LongRoPE's two sets of factors, a text (a row, or a
  segment of a packed one) takes the long ones at every position once it reaches past
  rotary_original_max_len (`beyond`; decoding recomputes its cache there: paxcli.models.lm).
  `attention_multiplier` set: the logits are q . k times it (Granite's), whatever E.
  """
  num_heads: int
  num_kv_heads: int
  dims_per_head: int
  use_bias: bool = True
  rotary: bool = False
  rotary_max_timescale: float = 10000.0
  # Longer texts than trained on (ROTARY_SCALINGS): 'none', 'linear', 'llama3', 'longrope' or 'yarn'.
  rotary_scaling: str = 'none'
  rotary_scaling_factor: float = 1.0
  rotary_low_freq_factor: float = 1.0
  rotary_high_freq_factor: float = 4.0
  rotary_original_max_len: int = 8192
  # 'longrope': a factor per rotated pair for texts within rotary_original_max_len and beyond it.
  rotary_short_factors: tuple = ()
  rotary_long_factors: tuple = ()
  # 'yarn': the ramp's bounds (_yarn_scaling) and its magnitude correction (yarn_attention_factor).
  rotary_beta_fast: float = 32.0
  rotary_beta_slow: float = 1.0
  rotary_mscale: Optional[float] = None
  rotary_mscale_all_dim: Optional[float] = None
  rotary_attention_factor: Optional[float] = None   # 'longrope' and 'yarn'; None: the scaling's own rule
  rotary_fraction: float = 1.0   # the share of a head's dimensions rotated (partial_rotary_factor)
  rotary_interleave: bool = False   # rotated pairs (x0, x1), (x2, x3), ... (DeepSeek's rope_interleave)
  dtype: jnp.dtype = jnp.float32
  per_dim_scale: bool = False
  query_pre_attn_scalar: Optional[float] = None
  atten_logit_cap: float = 0.0
  sliding_window: int = 0
  attention_impl: str = 'auto'
  qkv_bias: bool = False
  qk_norm: bool = False
  norm_epsilon: float = 1e-6
  norm_plus_one: bool = False
  qk_norm_after_rotary: bool = False
  qk_norm_per_head: bool = True
  attention_multiplier: Optional[float] = None
  # LoRA (paxcli.layers.lora): rank 0 is off; targets among query, key, value, output.
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple = ('query', 'value')
  lora_dropout: float = 0.0
  deterministic: bool = True  # the LoRA dropout's; the block fills it in
  # fp8 projections (paxcli.layers.fp8): 'none', 'delayed' or 'current' scaling.
  fp8: str = 'none'
  fp8_amax_history: int = 1024

  def _lora(self, x, projection, in_names, out_shape, out_names):
    """The LoRA term of `projection`, or 0 when it is not adapted."""
    if not self.lora_rank or not lora.targets_projection(self.lora_targets, projection):
      return 0
    return lora.delta(self, x, projection, in_names, out_shape, out_names, self.lora_rank, self.lora_alpha,
                      self.lora_dropout, self.deterministic)

  def _proj(self, x, heads, head_axis, name):
    y = nn.DenseGeneral(
        features=(heads, self.dims_per_head), axis=-1, use_bias=self.use_bias or self.qkv_bias, dtype=self.dtype,
        dot_general_cls=fp8.dot_general_cls(self.fp8, self.fp8_amax_history),
        kernel_init=_init(('embed', head_axis, 'head_dim')),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (head_axis, 'head_dim')),
        name=name)(x)
    y = y + self._lora(x, name, ('embed',), (heads, self.dims_per_head), (head_axis, 'head_dim'))
    y = constrain(y, ('batch', 'length', head_axis, 'head_dim'))
    return checkpoint_name(y, f'{name}_proj')

  def _fused_qkv(self, x_BxLxD):
    """Queries, keys and values from one product with the kernel decoding prepared (`fuse_for_decoding`):
    the same products as `_proj`'s three, one pass over x."""
    e, h, k = self.dims_per_head, self.num_heads, self.num_kv_heads
    y_BxLxN = fused_product(self, FUSED_QKV, x_BxLxD, self.dtype)
    y_BxLxNxE = y_BxLxN.reshape(y_BxLxN.shape[:-1] + (h + 2 * k, e))
    out = []
    for name, part, axis in zip(('query', 'key', 'value'), jnp.split(y_BxLxNxE, [h, h + k], axis=2),
                                ('heads', 'kv_heads', 'kv_heads')):
      part = part + self._lora(x_BxLxD, name, ('embed',), part.shape[2:], (axis, 'head_dim'))
      out.append(checkpoint_name(constrain(part, ('batch', 'length', axis, 'head_dim')), f'{name}_proj'))
    return out

  def _rotator(self, positions_BxL, segment_ids_BxL):
    """x [B, L, N, E] -> x with rotary positions on its last axis as the rotary_* fields say (the scaling
    computed for that axis: latent attention rotates a part of its heads' dimensions only)."""
    def turn(x_BxLxNxE):
      scaling = rotary_scaling(self, rotary_dims(x_BxLxNxE.shape[-1], self.rotary_fraction))
      long_BxL = None
      if scaling is not None and scaling.long is not None:
        long_BxL = beyond(positions_BxL, segment_ids_BxL, scaling.original_max_len)
      return rotary(x_BxLxNxE, positions_BxL, self.rotary_max_timescale, scaling, long_BxL, self.rotary_fraction,
                    self.rotary_interleave)
    return turn

  def _scale(self) -> float:
    """The logits' factor: attention_multiplier, else 1/sqrt(query_pre_attn_scalar), or 1/sqrt(E) when neither
    is set."""
    if self.attention_multiplier is not None:
      return float(self.attention_multiplier)
    return float(self.query_pre_attn_scalar or self.dims_per_head) ** -0.5

  def _per_dim_factor(self, e: int):
    """[1, 1, 1, E] softplus(w) / softplus(0): Pax's PerDimScale over the kernels' 1/sqrt(E)."""
    w = self.param('per_dim_scale', nn.with_logical_partitioning(nn.initializers.zeros, ('head_dim',)), (e,))
    return (jax.nn.softplus(w) / math.log(2.0)).reshape(1, 1, 1, e)  # softplus(0) = ln 2

  def _qk_norm(self, q_BxLxHxE, k_BxSxKxE):
    norm = lambda name: Norm('rmsnorm', False, self.dtype, self.norm_epsilon, self.norm_plus_one, name=name)
    if self.qk_norm_per_head:
      return norm('query_norm')(q_BxLxHxE), norm('key_norm')(k_BxSxKxE)
    whole = lambda name, x: norm(name)(x.reshape(x.shape[:2] + (-1,))).reshape(x.shape)   # over heads x E
    return whole('query_norm', q_BxLxHxE), whole('key_norm', k_BxSxKxE)

  @nn.compact
  def __call__(self, x_BxLxD, segment_ids_BxL, positions_BxL):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f'num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}')
    if has_fused(self, FUSED_QKV):
      q_BxLxHxE, k_BxSxKxE, v_BxSxKxE = self._fused_qkv(x_BxLxD)
    else:
      q_BxLxHxE = self._proj(x_BxLxD, self.num_heads, 'heads', 'query')
      k_BxSxKxE = self._proj(x_BxLxD, self.num_kv_heads, 'kv_heads', 'key')
      v_BxSxKxE = self._proj(x_BxLxD, self.num_kv_heads, 'kv_heads', 'value')
    if self.qk_norm and not self.qk_norm_after_rotary:
      q_BxLxHxE, k_BxSxKxE = self._qk_norm(q_BxLxHxE, k_BxSxKxE)
    if self.rotary:
      turn = self._rotator(positions_BxL, segment_ids_BxL)
      q_BxLxHxE, k_BxSxKxE = turn(q_BxLxHxE), turn(k_BxSxKxE)
    if self.qk_norm and self.qk_norm_after_rotary:
      q_BxLxHxE, k_BxSxKxE = self._qk_norm(q_BxLxHxE, k_BxSxKxE)
    if self.per_dim_scale:
      q_BxLxHxE = q_BxLxHxE * self._per_dim_factor(q_BxLxHxE.shape[-1]).astype(q_BxLxHxE.dtype)
    if self.is_mutable_collection('cache') and not self.is_initializing():
      # Decoding: keys/values go into the KV cache; queries attend over all of it.
      if segment_ids_BxL is None:
        segment_ids_BxL = jnp.ones(x_BxLxD.shape[:2], jnp.int32)
      if self._rolling(x_BxLxD.shape[1]):
        out_BxLxHxE = self._rolling_cache(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL, positions_BxL)
      else:
        out_BxLxHxE = self._decode_cache(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL)
    else:
      out_BxLxHxE = attention_ops.attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL,
                                            self.attention_impl, self.atten_logit_cap, self.sliding_window,
                                            scale=self._scale())
    out_BxLxHxE = constrain(out_BxLxHxE, ('batch', 'length', 'heads', 'head_dim'))
    if has_fused(self, 'out'):   # laid out [D, H E] for decoding (fuse_for_decoding)
      out = fused_product(self, 'out', out_BxLxHxE.reshape(out_BxLxHxE.shape[:2] + (-1,)), self.dtype)
    else:
      out = nn.DenseGeneral(
        features=x_BxLxD.shape[-1], axis=(-2, -1), use_bias=self.use_bias, dtype=self.dtype,
          dot_general_cls=fp8.dot_general_cls(self.fp8, self.fp8_amax_history),
          kernel_init=_init(('heads', 'head_dim', 'embed')),
          bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('embed',)),
          name='out')(out_BxLxHxE)
    out = out + self._lora(out_BxLxHxE, 'out', ('heads', 'head_dim'), (x_BxLxD.shape[-1],), ('embed',))
    return checkpoint_name(constrain(out, ('batch', 'length', 'embed')), 'out_proj')

  def _decode_cache(self, q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, segment_ids_BxL):
    """Attention of L new tokens over the KV cache for decoding (flax collection 'cache', used when it is
    mutable), after writing their keys and values into it.

    The first call (the model's `init_cache`) only sizes the cache from its input: [B, S] ids
    give S slots. Every later call writes each row's L new keys/values at that row's own slot
    `index[b]` (all rows advance together in `pax decode`, whose prompts are left-padded; a server's
    rows join and leave at their own times), marks which slots hold real tokens (segment id
    != 0) and attends over the whole cache: each query sees the real slots up to its own. Prefill is
    one call with the prompts; a decode step one with L=1. The cache is heads-major (keys
    [B, K, E, S], values [B, K, S, E]), which attention_ops.cached_attention reads in place.
    Each entry carries its logical axes, so that the decoder can shard the cache and move
    its rows (beam search) without knowing these names; zero slots appended at the end of
    the 'length' axes are empty slots (a decoder may grow a cache so).
    """
    initialized = self.has_variable('cache', 'cached_key')
    b, l, kv_heads, e = k_BxLxKxE.shape
    boxed = lambda axes: nn.with_logical_partitioning(jnp.zeros, axes)
    key = self.variable('cache', 'cached_key', boxed(('batch', 'kv_heads', 'head_dim', 'length')),
                        (b, kv_heads, e, l), k_BxLxKxE.dtype)
    value = self.variable('cache', 'cached_value', boxed(('batch', 'kv_heads', 'length', 'head_dim')),
                          (b, kv_heads, l, e), v_BxLxKxE.dtype)
    valid = self.variable('cache', 'cached_valid', boxed(('batch', 'length')), segment_ids_BxL.shape, jnp.bool_)
    index = self.variable('cache', 'cache_index', boxed(('batch',)), (b,), jnp.int32)
    k_BxKxExL = k_BxLxKxE.transpose(0, 2, 3, 1).astype(key.value.dtype)
    v_BxKxLxE = v_BxLxKxE.transpose(0, 2, 1, 3).astype(value.value.dtype)
    if not initialized:   # init_cache: only the shapes of this call matter
      causal_LxS = attention_ops.visible(jnp.arange(l)[:, None], jnp.arange(l)[None, :], self.sliding_window)
      return attention_ops.cached_attention(q_BxLxHxE, k_BxKxExL, v_BxKxLxE, jnp.broadcast_to(causal_LxS, (b, l, l)),
                                            self.atten_logit_cap, self._scale())
    i_B = index.value
    key.value = _write_rows(key.value, k_BxKxExL, i_B, axis=3)
    value.value = _write_rows(value.value, v_BxKxLxE, i_B, axis=2)
    valid.value = _write_rows(valid.value, segment_ids_BxL != 0, i_B, axis=1)
    index.value = i_B + l
    s = key.value.shape[-1]
    # Slots are time: a left-padded row's tokens are contiguous, so slot distance is position distance.
    slot_BxL = i_B[:, None] + jnp.arange(l)[None, :]
    visible_BxLxS = attention_ops.visible(slot_BxL[:, :, None], jnp.arange(s)[None, None, :], self.sliding_window)
    mask_BxLxS = visible_BxLxS & valid.value[:, None, :]
    return attention_ops.cached_attention(q_BxLxHxE, key.value, value.value, mask_BxLxS, self.atten_logit_cap,
                                          self._scale())

  def _rolling(self, length: int) -> bool:
    """Whether this layer's KV cache is the rolling one: a window shorter than the cache's length (the
    first call, `init_cache`, has that length; later calls find the cache it made)."""
    if self.has_variable('cache', 'cached_key'):
      return self.has_variable('cache', 'cached_position')
    return 0 < self.sliding_window < length

  def _rolling_cache(self, q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, segment_ids_BxL, positions_BxL):
    """Decoding attention of a windowed layer over a KV cache of W = sliding_window slots: memory bounded by
    the window, however long the text. A ring: the token written n-th (cache_index counts them, as the
    full cache's slots do) lives in slot n mod W, with its row's position and whether it is a real token;
    what a query may see is computed from the stored positions (p - W < p' <= p), so the ring's order
    never matters.

    A call attends over the ring as it was and its own L keys, then keeps the last min(L, W) of them. For
    L > W (a long prompt) the ring is unrolled into time order in front of the new keys and the blockwise
    window kernel runs over both, so a prefill also costs O(L x W): a row's tokens are contiguous in its
    cache (left padding only), so distance in the cache is distance in positions there.
    """
    w = self.sliding_window
    initialized = self.has_variable('cache', 'cached_key')
    b, l = segment_ids_BxL.shape
    kv_shape = (b, w) + k_BxLxKxE.shape[2:]
    kv_axes = ('batch', 'length', 'kv_heads', 'head_dim')
    boxed = lambda axes: nn.with_logical_partitioning(jnp.zeros, axes)
    key = self.variable('cache', 'cached_key', boxed(kv_axes), kv_shape, k_BxLxKxE.dtype)
    value = self.variable('cache', 'cached_value', boxed(kv_axes), kv_shape, v_BxLxKxE.dtype)
    valid = self.variable('cache', 'cached_valid', boxed(('batch', 'length')), (b, w), jnp.bool_)
    position = self.variable('cache', 'cached_position', boxed(('batch', 'length')), (b, w), jnp.int32)
    index = self.variable('cache', 'cache_index', boxed(('batch',)), (b,), jnp.int32)
    if not initialized:   # init_cache: only the shapes of this call matter
      return attention_ops.attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, segment_ids_BxL, 'einsum', 0.0, w)
    i_B = index.value
    k_BxLxKxE, v_BxLxKxE = k_BxLxKxE.astype(key.value.dtype), v_BxLxKxE.astype(value.value.dtype)
    new_valid, new_position = segment_ids_BxL != 0, positions_BxL.astype(jnp.int32)
    if l <= w:
      keys = jnp.concatenate([key.value, k_BxLxKxE], axis=1)
      values = jnp.concatenate([value.value, v_BxLxKxE], axis=1)
      seen_BxS = jnp.concatenate([valid.value, new_valid], axis=1)
      at_BxS = jnp.concatenate([position.value, new_position], axis=1)
      mask_BxLxS = seen_BxS[:, None, :] & attention_ops.visible(new_position[:, :, None], at_BxS[:, None, :], w)
      out = attention_ops.masked_einsum_attention(q_BxLxHxE, keys, values, mask_BxLxS, self.atten_logit_cap,
                                                 self._scale())
    else:
      oldest_B = -(i_B % w)   # ring slot i mod W holds a row's oldest token
      rolled = jax.vmap(lambda row, shift: jnp.roll(row, shift, axis=0))
      timed = lambda ring, new: jnp.concatenate([rolled(ring, oldest_B), new], axis=1)
      segments = timed(valid.value, new_valid).astype(jnp.int32)
      queries = jnp.concatenate([jnp.zeros((b, w) + q_BxLxHxE.shape[2:], q_BxLxHxE.dtype), q_BxLxHxE], axis=1)
      out = attention_ops.attention(queries, timed(key.value, k_BxLxKxE), timed(value.value, v_BxLxKxE), segments,
                                    self.attention_impl, self.atten_logit_cap, w, self._scale())[:, w:]
    for var, new in ((key, k_BxLxKxE), (value, v_BxLxKxE), (valid, new_valid), (position, new_position)):
      var.value = jax.vmap(_ring_write)(var.value, new, i_B)
    index.value = i_B + l
    return out


def _write_rows(cache, new, i_B, axis: int):
  """`cache` [B, ...] with each row's `new` entries written along `axis` from that row's own slot i_B[b]."""
  return jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice_in_dim(c, n, i, axis - 1))(cache, new, i_B)


def _ring_write(ring_W, new_L, i):
  """One row's ring [W, ...] after writing the L new entries as the tokens i .. i + L - 1 (token n in slot n mod
  W); of more than W only the last W stay."""
  w, l = ring_W.shape[0], new_L.shape[0]
  if l == 1:
    return jax.lax.dynamic_update_slice_in_dim(ring_W, new_L, i % w, axis=0)
  if l < w:
    return ring_W.at[(i + jnp.arange(l)) % w].set(new_L)
  return jnp.roll(new_L[l - w:], (i + l - w) % w, axis=0)


class Mlp(nn.Module):
  """Feed-forward: act(x W1) W2, or gated act(x W1_gate) * (x W1) W2."""
  hidden_dims: int
  activation: str = 'gelu'
  gated: bool = False
  use_bias: bool = True
  dtype: jnp.dtype = jnp.float32
  # LoRA (paxcli.layers.lora) on wi_0, wi_1 and wo when lora_targets holds 'mlp'; rank 0 is off.
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple = ('query', 'value')
  lora_dropout: float = 0.0
  deterministic: bool = True  # the LoRA dropout's; the block fills it in
  fp8: str = 'none'           # fp8 products (paxcli.layers.fp8), as Attention's
  fp8_amax_history: int = 1024

  def _dense(self, x, features, names, name):
    y = nn.Dense(features, use_bias=self.use_bias, dtype=self.dtype, kernel_init=_init(names),
                 dot_general_cls=fp8.dot_general_cls(self.fp8, self.fp8_amax_history),
                 bias_init=nn.with_logical_partitioning(nn.initializers.zeros, names[-1:]),
                 name=name)(x)
    if self.lora_rank and lora.targets_projection(self.lora_targets, name):
      y = y + lora.delta(self, x, name, names[:1], (features,), names[1:], self.lora_rank, self.lora_alpha,
                         self.lora_dropout, self.deterministic)
    return y

  def _lora_term(self, h_BxLxF, features: int, name: str):
    if not (self.lora_rank and lora.targets_projection(self.lora_targets, name)):
      return 0
    return lora.delta(self, h_BxLxF, name, ('mlp',), (features,), ('embed',), self.lora_rank, self.lora_alpha,
                      self.lora_dropout, self.deterministic)

  @nn.compact
  def __call__(self, x_BxLxD):
    act = _ACTIVATIONS[self.activation]
    hidden = ('batch', 'length', 'mlp')
    if self.gated and has_fused(self, FUSED_WI):
      h_BxLxF = self._fused_wi(x_BxLxD, act, hidden)
    else:
      h_BxLxF = act(constrain(self._dense(x_BxLxD, self.hidden_dims, ('embed', 'mlp'), 'wi_0'), hidden))
    if self.gated and not has_fused(self, FUSED_WI):
      h_BxLxF = h_BxLxF * constrain(self._dense(x_BxLxD, self.hidden_dims, ('embed', 'mlp'), 'wi_1'), hidden)
    if has_fused(self, 'wo'):   # laid out [D, F] for decoding (fuse_for_decoding)
      y_BxLxD = fused_product(self, 'wo', h_BxLxF, self.dtype) + self._lora_term(h_BxLxF, x_BxLxD.shape[-1], 'wo')
    else:
      y_BxLxD = self._dense(h_BxLxF, x_BxLxD.shape[-1], ('mlp', 'embed'), 'wo')
    return constrain(y_BxLxD, ('batch', 'length', 'embed'))


  def _fused_wi(self, x_BxLxD, act, hidden):
    """act(x wi_0) * (x wi_1) from one product with the kernel decoding prepared (`fuse_for_decoding`)."""
    y_BxLx2F = fused_product(self, FUSED_WI, x_BxLxD, self.dtype)
    parts = []
    for name, part in zip(('wi_0', 'wi_1'), jnp.split(y_BxLx2F, 2, axis=-1)):
      if self.lora_rank and lora.targets_projection(self.lora_targets, name):
        part = part + lora.delta(self, x_BxLxD, name, ('embed',), (self.hidden_dims,), ('mlp',), self.lora_rank,
                                 self.lora_alpha, self.lora_dropout, self.deterministic)
      parts.append(constrain(part, hidden))
    return act(parts[0]) * parts[1]


class Block(BaseLayer):
  """Pre-norm Transformer block built from templates. Returns (x, None) so that nn.scan can stack it.

  Children (names fixed: checkpoints depend on them): attention_norm and mlp_norm from
  `norm_tpl`, attention from `attention_tpl`, mlp from `ffn_tpl`. `parallel`: attention and
  MLP both read the one attention_norm and their sum is added once (MaxText's default decoder
  block, PaLM's parallel layer); there is no mlp_norm. `post_norms`: the outputs of attention and
  MLP are normalised too before they join the residual (post_attention_norm, post_mlp_norm: Gemma 2
  and 3's four norms per layer, praxis' norm_policy 'primer_hybrid'). `pre_norms` False: attention
  and MLP read the residual stream as it is (no attention_norm, mlp_norm; with post_norms, praxis'
  norm_policy 'post'; with post_norms, OLMo 2's). `residual_multiplier`: attention's and the MLP's outputs
  join the residual stream times it (Granite's). The block fills the
  compute dtype into each template (field `dtype` of a plain flax module, `fprop_dtype`
  of a BaseLayer) and model_dims into a feed-forward template's input_dims/output_dims,
  unless the template sets them itself.
  """
  model_dims: int = 0
  dropout_prob: float = 0.0
  deterministic: bool = True
  parallel: bool = False
  post_norms: bool = False
  pre_norms: bool = True
  residual_multiplier: float = 1.0
  attention_tpl: LayerTpl = template_field(Attention)
  ffn_tpl: LayerTpl = template_field(Mlp)
  norm_tpl: LayerTpl = template_field(Norm)

  def setup(self):
    compute = self.fprop_dtype or jnp.float32
    if self.pre_norms or self.parallel:
      self.create_child('attention_norm', fill_template(self.norm_tpl, compute))
    self.create_child('attention', fill_template(self.attention_tpl, compute, deterministic=self.deterministic))
    if self.pre_norms and not self.parallel:
      self.create_child('mlp_norm', fill_template(self.norm_tpl, compute))
    if self.post_norms:
      self.create_child('post_attention_norm', fill_template(self.norm_tpl, compute))
      self.create_child('post_mlp_norm', fill_template(self.norm_tpl, compute))
    self.create_child('mlp', fill_template(self.ffn_tpl, compute, input_dims=self.model_dims,
                                           output_dims=self.model_dims, deterministic=self.deterministic))
    self.dropout = nn.Dropout(self.dropout_prob, deterministic=self.deterministic)

  def __call__(self, x_BxLxD, segment_ids_BxL, positions_BxL):
    if self.parallel:
      n_BxLxD = self.attention_norm(x_BxLxD)
      h = self.attention(n_BxLxD, segment_ids_BxL, positions_BxL) + self.mlp(n_BxLxD)
      return constrain(x_BxLxD + self._branch(h), ('batch', 'length', 'embed')), None
    pre = (lambda norm, x: norm(x)) if self.pre_norms else (lambda norm, x: x)
    h = self.attention(pre(getattr(self, 'attention_norm', None), x_BxLxD), segment_ids_BxL, positions_BxL)
    if self.post_norms:
      h = self.post_attention_norm(h)
    x_BxLxD = x_BxLxD + self._branch(h)
    h = self.mlp(pre(getattr(self, 'mlp_norm', None), x_BxLxD))
    if self.post_norms:
      h = self.post_mlp_norm(h)
    x_BxLxD = x_BxLxD + self._branch(h)
    return constrain(x_BxLxD, ('batch', 'length', 'embed')), None

  def _branch(self, h_BxLxD):
    """A branch's output as it joins the residual stream: dropped out, times residual_multiplier."""
    h_BxLxD = self.dropout(h_BxLxD)
    return h_BxLxD if self.residual_multiplier == 1.0 else h_BxLxD * jnp.asarray(self.residual_multiplier,
                                                                                  h_BxLxD.dtype)


def fill_template(tpl, compute_dtype, **fields):
  """A copy of `tpl` with the compute dtype and `fields` set where its class has them and
  the template leaves them unset (what a template sets itself wins)."""
  out = tpl.clone() if hasattr(tpl, 'clone') else copy.deepcopy(tpl)
  fn = fdl.get_callable(out)
  names = {f.name for f in dataclasses.fields(fn)} if dataclasses.is_dataclass(fn) else set()
  dtype_field = 'fprop_dtype' if isinstance(fn, type) and issubclass(fn, BaseLayer) else 'dtype'
  for name, value in {dtype_field: compute_dtype, **fields}.items():
    if name in names and name not in out.__arguments__:
      setattr(out, name, value)
  return out
