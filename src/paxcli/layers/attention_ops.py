"""Attention kernels: causal softmax attention with grouped-query heads and segment ids.

Two implementations of one function, `attention(q, k, v, segment_ids, impl)`:
  einsum       the reference: float32 logits [B, K, G, L, S] from einsums, masked and
               softmaxed in full. Simple and exact; memory grows with L x S.
  dot_product  `jax.nn.dot_product_attention`: cuDNN flash attention on NVIDIA GPUs for
               bfloat16/float16 (causal masking skips the upper triangle and no L x S
               logits are stored), XLA's implementation elsewhere.
  auto         dot_product with cuDNN where it applies, else XLA's dot_product.

Tests hold `dot_product` to the `einsum` reference, values and gradients.
Shapes: B batch, L query length, S key length, H query heads, K kv heads,
G = H // K query heads per kv head, E dims per head.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from paxcli.options import ATTENTION_IMPLS as IMPLEMENTATIONS

# cuDNN flash attention: half-precision inputs, head dims a multiple of 8 up to 256.
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL: Optional[jax.Array] = None,
              impl: str = 'auto', logit_cap: float = 0.0):
  """Causal attention; tokens attend only within their segment when segment_ids are given.

  logit_cap > 0 soft-caps the logits (cap * tanh(logits / cap), Pax's atten_logit_cap), which
  only the einsum kernel can do: it is used then, whatever `impl` says.

  Returns [B, L, H, E] in the dtype of q.
  """
  if impl == 'einsum' or logit_cap:
    return einsum_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL, logit_cap)
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f'attention impl {impl!r} is not one of {IMPLEMENTATIONS}')
  return dot_product_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL,
                               implementation=kernel_for(q_BxLxHxE.dtype, q_BxLxHxE.shape[-1]))


def kernel_for(dtype, head_dim: int) -> str:
  """'cudnn' where cuDNN flash attention applies (a GPU, half precision), else 'xla'."""
  if jax.default_backend() != 'gpu' or jnp.dtype(dtype) not in [jnp.dtype(d) for d in _CUDNN_DTYPES]:
    return 'xla'
  if head_dim % 8 or head_dim > 256:
    return 'xla'
  return 'cudnn'


def dot_product_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL=None, implementation='xla'):
  mask_Bx1xLxS = None
  if segment_ids_BxL is not None:
    mask_Bx1xLxS = (segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :])[:, None]
  return jax.nn.dot_product_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, mask=mask_Bx1xLxS, is_causal=True,
                                      implementation=implementation)


def einsum_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL=None, logit_cap: float = 0.0):
  """The reference: explicit float32 logits, masked (causal, same segment), softmaxed, applied to values."""
  b, l = q_BxLxHxE.shape[:2]
  s = k_BxSxKxE.shape[1]
  mask_BxLxS = jnp.broadcast_to(jnp.tril(jnp.ones((l, s), dtype=bool))[None], (b, l, s))
  if segment_ids_BxL is not None:
    mask_BxLxS = mask_BxLxS & (segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :])
  return masked_einsum_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxLxS, logit_cap)


def masked_einsum_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxLxS, logit_cap: float = 0.0):
  """Attention under any boolean mask (True: may attend); decoding uses it with its KV cache."""
  b, l, h, e = q_BxLxHxE.shape
  kv_heads = k_BxSxKxE.shape[2]
  groups = h // kv_heads
  if l == 1:
    return _one_query_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxLxS, logit_cap)
  q_BxLxKxGxE = q_BxLxHxE.reshape(b, l, kv_heads, groups, e) * (e ** -0.5)
  logits_BxKxGxLxS = jnp.einsum('blkge,bske->bkgls', q_BxLxKxGxE, k_BxSxKxE).astype(jnp.float32)
  if logit_cap:   # before the mask: the cap would lift the masked logits too
    logits_BxKxGxLxS = logit_cap * jnp.tanh(logits_BxKxGxLxS / logit_cap)
  logits_BxKxGxLxS = jnp.where(mask_BxLxS[:, None, None], logits_BxKxGxLxS, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits_BxKxGxLxS, axis=-1).astype(q_BxLxHxE.dtype)
  out_BxLxKxGxE = jnp.einsum('bkgls,bske->blkge', probs, v_BxSxKxE)
  return out_BxLxKxGxE.reshape(b, l, h, e)


def _one_query_attention(q_Bx1xHxE, k_BxSxKxE, v_BxSxKxE, mask_Bx1xS, logit_cap: float = 0.0):
  """masked_einsum_attention for one query per row (a decoding step) as products summed in place: the
  einsums' batched dots over (b, k) would first transpose the whole [B, S, K, E] cache, every step."""
  b, _, h, e = q_Bx1xHxE.shape
  kv_heads = k_BxSxKxE.shape[2]
  q_Bx1xKxGxE = q_Bx1xHxE.reshape(b, 1, kv_heads, h // kv_heads, e) * (e ** -0.5)
  logits_BxSxKxG = jnp.sum(q_Bx1xKxGxE * k_BxSxKxE[:, :, :, None], axis=-1, dtype=jnp.float32)
  if logit_cap:
    logits_BxSxKxG = logit_cap * jnp.tanh(logits_BxSxKxG / logit_cap)
  logits_BxSxKxG = jnp.where(mask_Bx1xS[:, 0, :, None, None], logits_BxSxKxG, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits_BxSxKxG, axis=1).astype(q_Bx1xHxE.dtype)
  out_BxKxGxE = jnp.sum(probs[..., None] * v_BxSxKxE[:, :, :, None], axis=1, dtype=jnp.float32)
  return out_BxKxGxE.astype(q_Bx1xHxE.dtype).reshape(b, 1, h, e)
