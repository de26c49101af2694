"""Transformer layers on flax.linen; every weight carries logical axis names.

Logical axes: vocab, embed, mlp, heads, kv_heads, head_dim, layers (see sharding.py
for how they map onto the mesh). Shapes in names: B batch, L length, S source length,
D model dims, H heads, K kv heads, G query heads per kv head, E dims per head, F hidden.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Callable, Optional

import fiddle as fdl
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from paxcli.layers import attention_ops, context_parallel, fp8, lora
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


def rotary(x_BxLxHxE, positions_BxL, max_timescale: float, scaling: tuple = ()):
  """Rotary position embedding (split-half form) applied to queries or keys; `scaling` as
  rotary_scale gives it (empty: none)."""
  dims = x_BxLxHxE.shape[-1]
  half = dims // 2
  fraction = jnp.arange(half, dtype=jnp.float32) * 2.0 / dims
  timescale = max_timescale ** fraction
  if scaling:
    timescale = timescale * jnp.asarray(rotary_scale(dims, max_timescale, *scaling), jnp.float32)
  angles_BxLx1xE2 = positions_BxL[:, :, None, None].astype(jnp.float32) / timescale[None, None, None, :]
  sin, cos = jnp.sin(angles_BxLx1xE2), jnp.cos(angles_BxLx1xE2)
  x = x_BxLxHxE.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLxHxE.dtype)


def rotary_scale(dims: int, max_timescale: float, kind: str, factor: float, low_freq_factor: float,
                 high_freq_factor: float, original_max_len: int) -> np.ndarray:
  """How much longer each rotated pair's timescale gets [dims // 2], for a model trained on
  original_max_len positions to read longer texts (Hugging Face's rope_scaling):

    'linear'  every pair by `factor` (positions / factor)
    'llama3'  Llama 3.1's: pairs whose wavelength 2 pi timescale is above original_max_len /
              low_freq_factor by `factor`, those below original_max_len / high_freq_factor not
              at all, those between by 1 / ((1 - s) / factor + s) with s = (original_max_len /
              wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)

  Computed once, in float64, from the settings alone (no traced values).
  """
  timescale = max_timescale ** (np.arange(dims // 2, dtype=np.float64) * 2.0 / dims)
  if kind == 'linear':
    return np.full_like(timescale, factor)
  if kind != 'llama3':
    raise ValueError(f'unknown rotary scaling {kind!r}')
  wavelength = 2 * np.pi * timescale
  smooth = (original_max_len / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
  inverse = np.where(wavelength > original_max_len / low_freq_factor, 1 / factor,
                     np.where(wavelength < original_max_len / high_freq_factor, 1.0, (1 - smooth) / factor + smooth))
  return 1 / inverse


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


class Attention(nn.Module):
  """Causal multi-head attention with grouped-query support (num_kv_heads <= num_heads).

  `segment_ids_BxL` None: one segment per row (no packing). The kernel is
  `attention_ops.attention`; attention_impl: auto (cuDNN flash attention on GPUs), dot_product
  (jax.nn.dot_product_attention), blockwise, flash or einsum (the reference). In a step that splits
  sequences over the mesh's context axis, paxcli.layers.context_parallel's attention runs instead.
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
  `qk_norm_after_rotary` (praxis' attention ln_tpl: the two differ where the scale does).
  """
  num_heads: int
  num_kv_heads: int
  dims_per_head: int
  use_bias: bool = True
  rotary: bool = False
  rotary_max_timescale: float = 10000.0
  # Longer texts than trained on (layers.transformer.rotary_scale): 'none', 'linear' or 'llama3'.
  rotary_scaling: str = 'none'
  rotary_scaling_factor: float = 1.0
  rotary_low_freq_factor: float = 1.0
  rotary_high_freq_factor: float = 4.0
  rotary_original_max_len: int = 8192
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

  def _scale(self) -> float:
    """The logits' factor: 1/sqrt(query_pre_attn_scalar), or 1/sqrt(E) when that is unset."""
    return float(self.query_pre_attn_scalar or self.dims_per_head) ** -0.5

  def _per_dim_factor(self, e: int):
    """[1, 1, 1, E] softplus(w) / softplus(0): Pax's PerDimScale over the kernels' 1/sqrt(E)."""
    w = self.param('per_dim_scale', nn.with_logical_partitioning(nn.initializers.zeros, ('head_dim',)), (e,))
    return (jax.nn.softplus(w) / math.log(2.0)).reshape(1, 1, 1, e)  # softplus(0) = ln 2

  def _qk_norm(self, q_BxLxHxE, k_BxSxKxE):
    norm = lambda name: Norm('rmsnorm', False, self.dtype, self.norm_epsilon, self.norm_plus_one, name=name)
    return norm('query_norm')(q_BxLxHxE), norm('key_norm')(k_BxSxKxE)

  @nn.compact
  def __call__(self, x_BxLxD, segment_ids_BxL, positions_BxL):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f'num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}')
    q_BxLxHxE = self._proj(x_BxLxD, self.num_heads, 'heads', 'query')
    k_BxSxKxE = self._proj(x_BxLxD, self.num_kv_heads, 'kv_heads', 'key')
    v_BxSxKxE = self._proj(x_BxLxD, self.num_kv_heads, 'kv_heads', 'value')
    if self.qk_norm and not self.qk_norm_after_rotary:
      q_BxLxHxE, k_BxSxKxE = self._qk_norm(q_BxLxHxE, k_BxSxKxE)
    if self.rotary:
      scaling = () if self.rotary_scaling == 'none' else (
          self.rotary_scaling, self.rotary_scaling_factor, self.rotary_low_freq_factor,
          self.rotary_high_freq_factor, self.rotary_original_max_len)
      q_BxLxHxE = rotary(q_BxLxHxE, positions_BxL, self.rotary_max_timescale, scaling)
      k_BxSxKxE = rotary(k_BxSxKxE, positions_BxL, self.rotary_max_timescale, scaling)
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
    else:   # a sequence split over the context axis (a train or eval step) has its own attention
      out_BxLxHxE = context_parallel.attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL, self.sliding_window,
                                               self.atten_logit_cap, self._scale())
      if out_BxLxHxE is None:
        out_BxLxHxE = attention_ops.attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL,
                                              self.attention_impl, self.atten_logit_cap, self.sliding_window,
                                              scale=self._scale())
    out_BxLxHxE = constrain(out_BxLxHxE, ('batch', 'length', 'heads', 'head_dim'))
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
    give S slots. Every later call writes its L new keys/values at slot `index` (the same
    for all rows: prompts are left-padded), marks which slots hold real tokens (segment id
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
    index = self.variable('cache', 'cache_index', boxed(()), [], jnp.int32)
    k_BxKxExL = k_BxLxKxE.transpose(0, 2, 3, 1).astype(key.value.dtype)
    v_BxKxLxE = v_BxLxKxE.transpose(0, 2, 1, 3).astype(value.value.dtype)
    if not initialized:   # init_cache: only the shapes of this call matter
      causal_LxS = attention_ops.visible(jnp.arange(l)[:, None], jnp.arange(l)[None, :], self.sliding_window)
      return attention_ops.cached_attention(q_BxLxHxE, k_BxKxExL, v_BxKxLxE, jnp.broadcast_to(causal_LxS, (b, l, l)),
                                            self.atten_logit_cap, self._scale())
    i = index.value
    key.value = jax.lax.dynamic_update_slice(key.value, k_BxKxExL, (0, 0, 0, i))
    value.value = jax.lax.dynamic_update_slice(value.value, v_BxKxLxE, (0, 0, i, 0))
    valid.value = jax.lax.dynamic_update_slice(valid.value, segment_ids_BxL != 0, (0, i))
    index.value = i + l
    s = key.value.shape[-1]
    # Slots are time: a left-padded row's tokens are contiguous, so slot distance is position distance.
    visible_LxS = attention_ops.visible((i + jnp.arange(l))[:, None], jnp.arange(s)[None, :], self.sliding_window)
    mask_BxLxS = visible_LxS[None] & valid.value[:, None, :]
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
    index = self.variable('cache', 'cache_index', boxed(()), [], jnp.int32)
    if not initialized:   # init_cache: only the shapes of this call matter
      return attention_ops.attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, segment_ids_BxL, 'einsum', 0.0, w)
    i = index.value
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
      oldest = -(i % w)   # ring slot i mod W holds the oldest token
      timed = lambda ring, new: jnp.concatenate([jnp.roll(ring, oldest, axis=1), new], axis=1)
      segments = timed(valid.value, new_valid).astype(jnp.int32)
      queries = jnp.concatenate([jnp.zeros((b, w) + q_BxLxHxE.shape[2:], q_BxLxHxE.dtype), q_BxLxHxE], axis=1)
      out = attention_ops.attention(queries, timed(key.value, k_BxLxKxE), timed(value.value, v_BxLxKxE), segments,
                                    self.attention_impl, self.atten_logit_cap, w, self._scale())[:, w:]
    for var, new in ((key, k_BxLxKxE), (value, v_BxLxKxE), (valid, new_valid), (position, new_position)):
      var.value = _ring_write(var.value, new, i)
    index.value = i + l
    return out


def _ring_write(ring_BxW, new_BxL, i):
  """The ring [B, W, ...] after writing the L new entries as the tokens i .. i + L - 1 (token n in slot n mod W);
  of more than W only the last W stay."""
  w, l = ring_BxW.shape[1], new_BxL.shape[1]
  if l == 1:
    return jax.lax.dynamic_update_slice_in_dim(ring_BxW, new_BxL, i % w, axis=1)
  if l < w:
    return ring_BxW.at[:, (i + jnp.arange(l)) % w].set(new_BxL)
  return jnp.roll(new_BxL[:, l - w:], (i + l - w) % w, axis=1)


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

  @nn.compact
  def __call__(self, x_BxLxD):
    act = _ACTIVATIONS[self.activation]
    hidden = ('batch', 'length', 'mlp')
    h_BxLxF = act(constrain(self._dense(x_BxLxD, self.hidden_dims, ('embed', 'mlp'), 'wi_0'), hidden))
    if self.gated:
      h_BxLxF = h_BxLxF * constrain(self._dense(x_BxLxD, self.hidden_dims, ('embed', 'mlp'), 'wi_1'), hidden)
    return constrain(self._dense(h_BxLxF, x_BxLxD.shape[-1], ('mlp', 'embed'), 'wo'), ('batch', 'length', 'embed'))


class Block(BaseLayer):
  """Pre-norm Transformer block built from templates. Returns (x, None) so that nn.scan can stack it.

  Children (names fixed: checkpoints depend on them): attention_norm and mlp_norm from
  `norm_tpl`, attention from `attention_tpl`, mlp from `ffn_tpl`. `parallel`: attention and
  MLP both read the one attention_norm and their sum is added once (MaxText's default decoder
  block, PaLM's parallel layer); there is no mlp_norm. `post_norms`: the outputs of attention and
  MLP are normalised too before they join the residual (post_attention_norm, post_mlp_norm: Gemma 2
  and 3's four norms per layer, praxis' norm_policy 'primer_hybrid'). `pre_norms` False: attention
  and MLP read the residual stream as it is (no attention_norm, mlp_norm; with post_norms, praxis'
  norm_policy 'post'). The block fills the
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
      return constrain(x_BxLxD + self.dropout(h), ('batch', 'length', 'embed')), None
    pre = (lambda norm, x: norm(x)) if self.pre_norms else (lambda norm, x: x)
    h = self.attention(pre(getattr(self, 'attention_norm', None), x_BxLxD), segment_ids_BxL, positions_BxL)
    if self.post_norms:
      h = self.post_attention_norm(h)
    x_BxLxD = x_BxLxD + self.dropout(h)
    h = self.mlp(pre(getattr(self, 'mlp_norm', None), x_BxLxD))
    if self.post_norms:
      h = self.post_mlp_norm(h)
    x_BxLxD = x_BxLxD + self.dropout(h)
    return constrain(x_BxLxD, ('batch', 'length', 'embed')), None


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
