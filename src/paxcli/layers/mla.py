"""Multi-head latent attention (MLA; DeepSeek-V2 and V3, Hugging Face's DeepseekV3Attention).

Keys and values come from one small latent per token rather than from heads of their own: x is projected
down to a latent c of kv_lora_rank R (kv_down, then the RMSNorm kv_norm) and a rotary key k_r of
qk_rope_head_dim Dr shared by every head; each head's key is [c W_k | k_r] and its value c W_v, with W_k and
W_v the two parts of kv_up [R, H, Dn + Dv]. Queries are x projected to every head's [q_n | q_r] (Dn + Dr),
directly (query) or through a latent of q_lora_rank (query_down, query_norm, query_up). Only the Dr parts
are rotated. Logits are scaled by 1/sqrt(Dn + Dr), times (0.1 mscale_all_dim ln(factor) + 1)^2 under YaRN
with rotary_mscale_all_dim (DeepSeek's rule; transformers' yarn_apply_mscale).

Decoding keeps the latent in the KV cache: c and k_r, R + Dr numbers a token and layer (576 in
DeepSeek-V3) where grouped-query attention keeps 2 K E (32,768 for its 128 heads of 128). A step with
the cache reads it in one of two forms, which compute the same function:
  absorbed  the queries are taken into the latent space (q_n W_k^T: [H, R] a token) and attend over c and
            k_r as they are; the output leaves it through W_v. A step costs O(S H (R + Dr)) and reads
            only the latent: what decoding a few tokens at a time wants.
  expanded  every cached token's keys and values are made from c (O(S R H (Dn + Dv)) a call), then plain
            attention: cheaper for a long prompt (prefill), where many queries share that cost.
`decode` 'auto' picks by the products' multiply-adds for the call's L new tokens over S cached ones
(absorbed for decoding steps, expanded for prefills of more than a few hundred tokens at DeepSeek-V3's
sizes; benchmarks/mla.py measures both against GQA).

The layer is paxcli's Attention with these fields more (it takes every knob Attention does; what latent
attention has no use for is refused by paxcli.models.validation: a sliding window, QK-norm, biases, fp8).
LoRA adapts query (query, or query_down and query_up), key and value together (kv_down, kv_up) and output.

Weights (logical axes): query [embed, heads, head_dim] or query_down [embed, latent], query_norm [latent],
query_up [latent, heads, head_dim]; kv_down [embed, latent] (R + Dr outputs), kv_norm [latent], kv_up
[latent, heads, head_dim] (Dn + Dv outputs: a head's key part, then its value part, as HF's kv_b_proj);
out [heads, head_dim, embed].
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from paxcli.layers import attention_ops, lora
from paxcli.layers.activation_sharding import constrain
from paxcli.layers.transformer import Attention, Norm, yarn_mscale

# transformers' DeepseekV3RMSNorm default: the latents' norms keep it whatever rms_norm_eps says.
LATENT_NORM_EPSILON = 1e-6
LATENT = 'latent'   # the logical axis of a latent: FSDP over `data` where nothing else took it (runtime.sharding)


class Kernel(nn.Module):
  """One projection's kernel [in..., out...] (fan-in scaled truncated normal over the input axes), returned."""
  shape: tuple
  names: tuple
  inputs: int = 1

  @nn.compact
  def __call__(self):
    init = nn.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal', in_axis=tuple(range(self.inputs)),
                                            out_axis=tuple(range(self.inputs, len(self.shape))))
    return self.param('kernel', nn.with_logical_partitioning(init, self.names), self.shape)


def decode_form(length: int, slots: int, heads: int, nope: int, rope: int, value: int, rank: int) -> str:
  """'absorbed' or 'expanded': the form whose products take fewer multiply-adds for `length` new tokens
  attending over `slots` cached ones (module docstring)."""
  absorbed = length * heads * (nope * rank + slots * (2 * rank + rope) + rank * value)
  expanded = slots * rank * heads * (nope + value) + length * slots * heads * (nope + rope + value)
  return 'absorbed' if absorbed <= expanded else 'expanded'


class LatentAttention(Attention):
  """Multi-head latent attention (module docstring). __call__(x [B, L, D], segment ids, positions) -> [B, L, D]."""
  q_lora_rank: int = 0
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128
  decode: str = 'auto'   # 'auto', 'absorbed' or 'expanded' (module docstring)

  def _weights(self, name: str, in_shape: tuple, out_shape: tuple, in_names: tuple, out_names: tuple):
    """(kernel, its LoRA adapter (A, B) or None) of projection `name`."""
    kernel = Kernel(in_shape + out_shape, in_names + out_names, len(in_shape), name=name)()
    adapted = self.lora_rank and lora.targets_projection(self.lora_targets, name)
    pair = lora.adapter(self, name, in_shape, in_names, out_shape, out_names, self.lora_rank) if adapted else None
    return kernel, pair

  def _project(self, x, weights, inputs: int = 1):
    """x [..., in...] through a projection's kernel and adapter -> [..., out...] in the compute dtype."""
    kernel, pair = weights
    x = x.astype(self.dtype)
    axes = (tuple(range(x.ndim - inputs, x.ndim)), tuple(range(inputs)))
    y = jnp.tensordot(x, kernel.astype(self.dtype), axes=axes)
    if pair is not None:
      y = y + lora.applied(x, *pair, inputs, self.lora_alpha, self.lora_dropout, self.deterministic)
    return y

  def _effective(self, weights):
    """A projection's kernel with its adapter merged (W + alpha / r A B): the absorbed form multiplies kernels."""
    kernel, pair = weights
    kernel = kernel.astype(self.dtype)
    if pair is None:
      return kernel
    a, b = (w.astype(self.dtype) for w in pair)
    return kernel + jnp.tensordot(a, b, axes=1) * jnp.asarray(self.lora_alpha / self.lora_rank, self.dtype)

  def _norm(self, name: str):
    return Norm('rmsnorm', False, self.dtype, LATENT_NORM_EPSILON, name=name)

  def _scale(self) -> float:
    scale = float(self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
    if self.rotary_scaling != 'none' and self.rotary_mscale_all_dim:
      scale *= yarn_mscale(self.rotary_scaling_factor, self.rotary_mscale_all_dim) ** 2
    return scale

  def _queries(self, x_BxLxD):
    """[B, L, H, Dn + Dr]: directly (q_lora_rank 0) or through the query latent."""
    d, h, e = x_BxLxD.shape[-1], self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
    if not self.q_lora_rank:
      w = self._weights('query', (d,), (h, e), ('embed',), ('heads', 'head_dim'))
      return self._project(x_BxLxD, w)
    r = self.q_lora_rank
    latent = self._project(x_BxLxD, self._weights('query_down', (d,), (r,), ('embed',), (LATENT,)))
    latent = self._norm('query_norm')(latent)
    return self._project(latent, self._weights('query_up', (r,), (h, e), (LATENT,), ('heads', 'head_dim')))

  @nn.compact
  def __call__(self, x_BxLxD, segment_ids_BxL, positions_BxL):
    d, h = x_BxLxD.shape[-1], self.num_heads
    dn, dr, dv, r = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, self.kv_lora_rank
    q_BxLxHxE = constrain(self._queries(x_BxLxD), ('batch', 'length', 'heads', 'head_dim'))
    q_nope_BxLxHxN = q_BxLxHxE[..., :dn]
    turn = self._rotator(positions_BxL, segment_ids_BxL)
    q_rope_BxLxHxR = turn(q_BxLxHxE[..., dn:])
    kv_BxLxC = self._project(x_BxLxD, self._weights('kv_down', (d,), (r + dr,), ('embed',), (LATENT,)))
    latent_BxLxR = self._norm('kv_norm')(kv_BxLxC[..., :r])
    k_rope_BxLxE = turn(kv_BxLxC[..., None, r:])[:, :, 0]
    up = self._weights('kv_up', (r,), (h, dn + dv), (LATENT,), ('heads', 'head_dim'))
    if self.is_mutable_collection('cache') and not self.is_initializing():
      if segment_ids_BxL is None:
        segment_ids_BxL = jnp.ones(x_BxLxD.shape[:2], jnp.int32)
      out_BxLxHxV = self._latent_cache(q_nope_BxLxHxN, q_rope_BxLxHxR, latent_BxLxR, k_rope_BxLxE, up,
                                       segment_ids_BxL)
    else:
      k_BxLxHxE, v_BxLxHxV = self._expand(latent_BxLxR, k_rope_BxLxE, up)
      q = jnp.concatenate([q_nope_BxLxHxN, q_rope_BxLxHxR], axis=-1)
      out_BxLxHxV = attention_ops.attention(q, checkpoint_name(k_BxLxHxE, 'key_proj'),
                                            checkpoint_name(v_BxLxHxV, 'value_proj'), segment_ids_BxL,
                                            self.attention_impl, self.atten_logit_cap, 0, scale=self._scale())
    out_BxLxHxV = constrain(out_BxLxHxV, ('batch', 'length', 'heads', 'head_dim'))
    out = self._project(out_BxLxHxV, self._weights('out', (h, dv), (d,), ('heads', 'head_dim'), ('embed',)), 2)
    return checkpoint_name(constrain(out, ('batch', 'length', 'embed')), 'out_proj')

  def _expand(self, latent_BxSxR, k_rope_BxSxE, up):
    """Every head's keys [B, S, H, Dn + Dr] and values [B, S, H, Dv] from the latent and the rotary key."""
    h, dn = self.num_heads, self.qk_nope_head_dim
    kv_BxSxHxF = self._project(latent_BxSxR, up)
    k_nope, v_BxSxHxV = kv_BxSxHxF[..., :dn], kv_BxSxHxF[..., dn:]
    k_rope = jnp.broadcast_to(k_rope_BxSxE[:, :, None, :].astype(k_nope.dtype), k_nope.shape[:3] + (k_rope_BxSxE.shape[-1],))
    k_BxSxHxE = constrain(jnp.concatenate([k_nope, k_rope], axis=-1), ('batch', 'length', 'heads', 'head_dim'))
    return k_BxSxHxE, constrain(v_BxSxHxV, ('batch', 'length', 'heads', 'head_dim'))

  def _latent_cache(self, q_nope_BxLxHxN, q_rope_BxLxHxR, latent_BxLxR, k_rope_BxLxE, up, segment_ids_BxL):
    """Decoding over the KV cache of latents (flax collection 'cache'): the first call (init_cache) only sizes
    it from its input; later calls write their L latents and rotary keys at slot `index` (the same for every
    row: prompts are left-padded), mark which slots hold real tokens, and attend over the whole cache, each
    query seeing the real slots up to its own, in the form `decode` picks (module docstring); expanded where every
    row has its own LoRA adapter of kv_up (`pax serve`'s), which no one merged kernel holds."""
    initialized = self.has_variable('cache', 'cached_latent')
    b, l, r = latent_BxLxR.shape
    boxed = lambda axes: nn.with_logical_partitioning(jnp.zeros, axes)
    latent = self.variable('cache', 'cached_latent', boxed(('batch', 'length', LATENT)), (b, l, r), latent_BxLxR.dtype)
    rope = self.variable('cache', 'cached_rope_key', boxed(('batch', 'length', 'head_dim')), k_rope_BxLxE.shape,
                         k_rope_BxLxE.dtype)
    valid = self.variable('cache', 'cached_valid', boxed(('batch', 'length')), segment_ids_BxL.shape, jnp.bool_)
    index = self.variable('cache', 'cache_index', boxed(()), [], jnp.int32)
    if initialized:
      i = index.value
      latent.value = jax.lax.dynamic_update_slice(latent.value, latent_BxLxR.astype(latent.value.dtype), (0, i, 0))
      rope.value = jax.lax.dynamic_update_slice(rope.value, k_rope_BxLxE.astype(rope.value.dtype), (0, i, 0))
      valid.value = jax.lax.dynamic_update_slice(valid.value, segment_ids_BxL != 0, (0, i))
      index.value = i + l
      s = latent.value.shape[1]
      visible_LxS = attention_ops.visible((i + jnp.arange(l))[:, None], jnp.arange(s)[None, :])
      mask_BxLxS = visible_LxS[None] & valid.value[:, None, :]
      cached_latent, cached_rope = latent.value, rope.value
    else:   # init_cache: only the shapes of this call matter
      mask_BxLxS = jnp.broadcast_to(attention_ops.visible(jnp.arange(l)[:, None], jnp.arange(l)[None, :]), (b, l, l))
      cached_latent, cached_rope = latent_BxLxR, k_rope_BxLxE
    form = self.decode if self.decode != 'auto' else decode_form(
        l, cached_latent.shape[1], self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, r)
    if form == 'expanded' or (up[1] is not None and lora.per_row(up[1][0], 1)):   # rows' own adapters: expanded
      k_BxSxHxE, v_BxSxHxV = self._expand(cached_latent, cached_rope, up)
      q = jnp.concatenate([q_nope_BxLxHxN, q_rope_BxLxHxR], axis=-1)
      return attention_ops.masked_einsum_attention(q, k_BxSxHxE, v_BxSxHxV, mask_BxLxS, self.atten_logit_cap,
                                                   self._scale())
    return self._absorbed(q_nope_BxLxHxN, q_rope_BxLxHxR, cached_latent, cached_rope, self._effective(up), mask_BxLxS)

  def _absorbed(self, q_nope_BxLxHxN, q_rope_BxLxHxR, latent_BxSxR, rope_BxSxE, up_RxHxF, mask_BxLxS):
    """Attention over the latents as they are: queries taken into the latent space through the key part of kv_up,
    the latent output out of it through the value part (module docstring)."""
    dn = self.qk_nope_head_dim
    dtype = q_nope_BxLxHxN.dtype
    q_lat_BxLxHxR = jnp.einsum('blhn,rhn->blhr', q_nope_BxLxHxN, up_RxHxF[..., :dn])
    logits = (jnp.einsum('blhr,bsr->bhls', q_lat_BxLxHxR, latent_BxSxR.astype(dtype))
              + jnp.einsum('blhe,bse->bhls', q_rope_BxLxHxR, rope_BxSxE.astype(dtype))).astype(jnp.float32)
    logits = logits * self._scale()
    if self.atten_logit_cap:
      logits = self.atten_logit_cap * jnp.tanh(logits / self.atten_logit_cap)
    logits = jnp.where(mask_BxLxS[:, None], logits, jnp.finfo(jnp.float32).min)
    probs_BxHxLxS = jax.nn.softmax(logits, axis=-1).astype(dtype)
    out_lat_BxLxHxR = jnp.einsum('bhls,bsr->blhr', probs_BxHxLxS, latent_BxSxR.astype(dtype))
    return jnp.einsum('blhr,rhv->blhv', out_lat_BxLxHxR, up_RxHxF[..., dn:])

