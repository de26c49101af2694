"""Attention kernels: causal softmax attention with grouped-query heads, segment ids and sliding windows.

Two implementations of one function, `attention(q, k, v, segment_ids, impl, window=w)`:
  einsum       the reference: float32 logits [B, K, G, L, S] from einsums, masked and
               softmaxed in full. Simple and exact; memory grows with L x S.
  dot_product  `jax.nn.dot_product_attention`: cuDNN flash attention on NVIDIA GPUs for
               bfloat16/float16 (causal masking skips the upper triangle and no L x S
               logits are stored), XLA's implementation elsewhere.
  auto         dot_product with cuDNN where it applies, else XLA's dot_product.
  local        (not a choice: what auto and dot_product run for a window where cuDNN does not) blockwise
               sliding-window attention, queries in blocks against the key blocks their window reaches:
               time and memory O(L x window), not O(L x L); it also soft-caps.

Tests hold `dot_product` and `local` to the `einsum` reference, values and gradients.

Sliding window (`window` w > 0, Hugging Face's sliding_window): query i attends key j when
i - w < j <= i (and both are in one segment): the w most recent tokens, itself included. A window
as long as the sequence or longer is full causal attention.

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
              impl: str = 'auto', logit_cap: float = 0.0, window: int = 0):
  """Causal attention; tokens attend only within their segment when segment_ids are given, and
  only to the `window` most recent tokens (themselves included) when window > 0.

  logit_cap > 0 soft-caps the logits (cap * tanh(logits / cap), Pax's atten_logit_cap), which
  only the einsum kernel (and, with a window, the local one) can do: it is used then, whatever
  `impl` says.

  Returns [B, L, H, E] in the dtype of q.
  """
  window = effective_window(window, k_BxSxKxE.shape[1])
  if impl == 'einsum' or (logit_cap and not window):
    return einsum_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL, logit_cap, window)
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f'attention impl {impl!r} is not one of {IMPLEMENTATIONS}')
  kernel = kernel_for(q_BxLxHxE.dtype, q_BxLxHxE.shape[-1])
  if window and (kernel != 'cudnn' or logit_cap) and q_BxLxHxE.shape[1] == k_BxSxKxE.shape[1]:
    # XLA's local_window_size only masks [L, L] logits; the blockwise kernel computes [L, ~w].
    return local_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL, window, logit_cap)
  return dot_product_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL, implementation=kernel,
                               window=window)


def effective_window(window: int, length: int) -> int:
  """The window that changes anything over `length` keys: 0 (full causal) when it reaches them all."""
  return window if 0 < window < length else 0


def visible(q_idx, k_idx, window: int = 0):
  """Whether query index q_idx may attend key index k_idx (broadcasting): k <= q, and k > q - window
  when window > 0 (Hugging Face's sliding_window_overlay on its causal mask)."""
  mask = k_idx <= q_idx
  return mask & (k_idx > q_idx - window) if window else mask


def kernel_for(dtype, head_dim: int) -> str:
  """'cudnn' where cuDNN flash attention applies (a GPU, half precision), else 'xla'."""
  if jax.default_backend() != 'gpu' or jnp.dtype(dtype) not in [jnp.dtype(d) for d in _CUDNN_DTYPES]:
    return 'xla'
  if head_dim % 8 or head_dim > 256:
    return 'xla'
  return 'cudnn'


def dot_product_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL=None, implementation='xla',
                          window: int = 0):
  """jax.nn.dot_product_attention; a window is its local_window_size (w - 1 keys before, none after),
  which cuDNN turns into its sliding_window_length w."""
  mask_Bx1xLxS = None
  if segment_ids_BxL is not None:
    mask_Bx1xLxS = (segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :])[:, None]
  return jax.nn.dot_product_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, mask=mask_Bx1xLxS, is_causal=True,
                                      local_window_size=(window - 1, 0) if window else None,
                                      implementation=implementation)


def local_block(window: int, length: int) -> int:
  """Query block of the local kernel: about a quarter of the window (a power of two, 16 to 512), so that the
  keys a block reads, ceil((w - 1) / c) + 1 blocks of c, stay within w + c; never longer than the sequence."""
  block = 16
  while block < 512 and block * 4 < window:
    block *= 2
  return min(block, length)


def local_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, segment_ids_BxL=None, window: int = 0,
                    logit_cap: float = 0.0, block: int = 0):
  """Sliding-window self-attention at O(window) per query: queries in blocks of c, each block against the
  n = ceil((w - 1) / c) + 1 key blocks that end with its own, so logits are [L, n c] rather than [L, L].

  The same function as einsum_attention with the window (causal, same segment, i - w < j <= i; logit_cap
  before the mask), values and gradients, in memory and time linear in L.
  """
  b, l, h, e = q_BxLxHxE.shape
  kv_heads = k_BxLxKxE.shape[2]
  c = block or local_block(window, l)
  n = -(-(window - 1) // c) + 1
  blocks = -(-l // c)
  pad_end = blocks * c - l
  if segment_ids_BxL is None:
    segment_ids_BxL = jnp.zeros((b, l), jnp.int32)

  def key_blocks(x):
    """[B, blocks, n c, ...]: for query block i, key blocks i - n + 1 .. i (zeros before the start)."""
    pads = [(0, 0), ((n - 1) * c, pad_end)] + [(0, 0)] * (x.ndim - 2)
    x = jnp.pad(x, pads).reshape(b, blocks + n - 1, c, *x.shape[2:])
    return jnp.concatenate([x[:, o:o + blocks] for o in range(n)], axis=2)

  k_BxNxSxKxE, v_BxNxSxKxE, seg_k_BxNxS = key_blocks(k_BxLxKxE), key_blocks(v_BxLxKxE), key_blocks(segment_ids_BxL)
  q = jnp.pad(q_BxLxHxE, [(0, 0), (0, pad_end), (0, 0), (0, 0)]) * (e ** -0.5)
  q_BxNxCxKxGxE = q.reshape(b, blocks, c, kv_heads, h // kv_heads, e)
  seg_q_BxNxC = jnp.pad(segment_ids_BxL, [(0, 0), (0, pad_end)]).reshape(b, blocks, c)
  q_idx_NxCx1 = (jnp.arange(blocks)[:, None] * c + jnp.arange(c)[None, :])[:, :, None]
  k_idx_Nx1xS = (jnp.arange(blocks)[:, None] * c + jnp.arange(n * c)[None, :] - (n - 1) * c)[:, None, :]
  mask_NxCxS = visible(q_idx_NxCx1, k_idx_Nx1xS, window) & (k_idx_Nx1xS >= 0)
  mask_BxNxCxS = mask_NxCxS[None] & (seg_q_BxNxC[:, :, :, None] == seg_k_BxNxS[:, :, None, :])
  logits = jnp.einsum('bnckge,bnske->bnkgcs', q_BxNxCxKxGxE, k_BxNxSxKxE).astype(jnp.float32)
  if logit_cap:
    logits = logit_cap * jnp.tanh(logits / logit_cap)
  logits = jnp.where(mask_BxNxCxS[:, :, None, None], logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(q_BxLxHxE.dtype)
  out = jnp.einsum('bnkgcs,bnske->bnckge', probs, v_BxNxSxKxE).reshape(b, blocks * c, h, e)
  return out[:, :l]


def einsum_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL=None, logit_cap: float = 0.0,
                     window: int = 0):
  """The reference: explicit float32 logits, masked (causal, same segment, window), softmaxed, applied to values."""
  b, l = q_BxLxHxE.shape[:2]
  s = k_BxSxKxE.shape[1]
  mask_BxLxS = jnp.broadcast_to(visible(jnp.arange(l)[:, None], jnp.arange(s)[None, :], window)[None], (b, l, s))
  if segment_ids_BxL is not None:
    mask_BxLxS = mask_BxLxS & (segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :])
  return masked_einsum_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxLxS, logit_cap)


def masked_einsum_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxLxS, logit_cap: float = 0.0):
  """Attention under any boolean mask (True: may attend); decoding uses it with its KV cache."""
  b, l, h, e = q_BxLxHxE.shape
  kv_heads = k_BxSxKxE.shape[2]
  groups = h // kv_heads
  q_BxLxKxGxE = q_BxLxHxE.reshape(b, l, kv_heads, groups, e) * (e ** -0.5)
  logits_BxKxGxLxS = jnp.einsum('blkge,bske->bkgls', q_BxLxKxGxE, k_BxSxKxE).astype(jnp.float32)
  if logit_cap:   # before the mask: the cap would lift the masked logits too
    logits_BxKxGxLxS = logit_cap * jnp.tanh(logits_BxKxGxLxS / logit_cap)
  logits_BxKxGxLxS = jnp.where(mask_BxLxS[:, None, None], logits_BxKxGxLxS, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits_BxKxGxLxS, axis=-1).astype(q_BxLxHxE.dtype)
  out_BxLxKxGxE = jnp.einsum('bkgls,bske->blkge', probs, v_BxSxKxE)
  return out_BxLxKxGxE.reshape(b, l, h, e)
