"""Attention kernels: causal softmax attention with grouped-query heads, segment ids and sliding windows.

Three implementations of one function, `attention(q, k, v, segment_ids, impl, window=w)`:
  einsum       the reference: float32 logits [B, K, G, L, S] from einsums, masked and
               softmaxed in full. Simple and exact; memory grows with L x S.
  dot_product  `jax.nn.dot_product_attention`: cuDNN flash attention on NVIDIA GPUs for
               bfloat16/float16 (causal masking skips the upper triangle and no L x S
               logits are stored), XLA's implementation elsewhere.
  blockwise    the queries a block at a time (BLOCK_Q rows or more): a block sees only the keys up to
               its last query (the upper triangle is never computed), its float32 logits
               exist only while the block runs and are recomputed in the backward pass, so
               memory holds one block's logits, not L x S. Soft-capped attention (Gemma 2,
               Pax's atten_logit_cap) runs here: neither jax.nn.dot_product_attention nor
               cuDNN's kernel in JAX 0.10 can cap logits, and the cap is applied per block.
  auto         blockwise for capped logits; else dot_product with cuDNN where it applies,
               else XLA's dot_product.
  local        (not a choice: what auto, dot_product and blockwise run for a window where cuDNN does not)
               blockwise sliding-window attention, queries in blocks against the key blocks their window
               reaches: time and memory O(L x window), not O(L x L); it also soft-caps.

Tests hold `dot_product`, `blockwise` and `local` to the `einsum` reference, values and gradients.

Sliding window (`window` w > 0, Hugging Face's sliding_window): query i attends key j when
i - w < j <= i (and both are in one segment): the w most recent tokens, itself included. A window
as long as the sequence or longer is full causal attention.

Shapes: B batch, L query length, S key length, H query heads, K kv heads,
G = H // K query heads per kv head, E dims per head. Values may have heads of another size than queries and
keys (latent attention's, paxcli.layers.mla): the output's heads are the values'.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from paxcli.options import ATTENTION_IMPLS as IMPLEMENTATIONS

# cuDNN flash attention: half-precision inputs, head dims a multiple of 8 up to 256.
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
# The blockwise kernel's blocks: BLOCK_Q query rows, or L / MAX_BLOCKS for longer sequences (each block is
# its own piece of the compiled program). One block's logits are [B, H, rows, <= L] float32. Small blocks
# skip more of the upper triangle: on a CPU, with 128 rows a Gemma-2-shaped training step of 1,024 tokens ran
# capped 1.15x as fast as uncapped on XLA's dot_product, and 1.6x as fast as capped on einsum
# (benchmarks/soft_caps.py).
BLOCK_Q = 128
MAX_BLOCKS = 16


def attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL: Optional[jax.Array] = None,
              impl: str = 'auto', logit_cap: float = 0.0, window: int = 0, scale: Optional[float] = None):
  """Causal attention; tokens attend only within their segment when segment_ids are given, and
  only to the `window` most recent tokens (themselves included) when window > 0.

  logit_cap > 0 soft-caps the logits (cap * tanh(logits / cap), Pax's atten_logit_cap, Gemma 2's
  attn_logit_softcapping): the einsum kernel when `impl` asks for it, else the blockwise one (the
  local one with a window). `scale` multiplies the logits (None: 1/sqrt(E)).

  Returns [B, L, H, E] in the dtype of q.
  """
  window = effective_window(window, k_BxSxKxE.shape[1])
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f'attention impl {impl!r} is not one of {IMPLEMENTATIONS}')
  self_attention = q_BxLxHxE.shape[1] == k_BxSxKxE.shape[1]
  if impl == 'einsum' or (logit_cap and not self_attention):
    return einsum_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL, logit_cap, window, scale)
  kernel = kernel_for(q_BxLxHxE.dtype, q_BxLxHxE.shape[-1])
  if window and self_attention and (kernel != 'cudnn' or logit_cap or impl == 'blockwise'):
    # XLA's local_window_size only masks [L, L] logits; the local kernel computes [L, ~w].
    return local_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL, window, logit_cap, scale=scale)
  if logit_cap or impl == 'blockwise':
    return blockwise_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL, logit_cap, scale)
  e, ev = q_BxLxHxE.shape[-1], v_BxSxKxE.shape[-1]
  if ev > e:   # wider values than keys: no family has them; the reference kernel
    return einsum_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL, 0.0, window, scale)
  # jax.nn.dot_product_attention takes one head size: narrower values padded with zeros, the output cut back.
  v_BxSxKxE = jnp.pad(v_BxSxKxE, [(0, 0)] * 3 + [(0, e - ev)])
  out = dot_product_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL, implementation=kernel,
                              window=window, scale=scale)
  return out[..., :ev]


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
                          window: int = 0, scale: Optional[float] = None):
  """jax.nn.dot_product_attention; a window is its local_window_size (w - 1 keys before, none after),
  which cuDNN turns into its sliding_window_length w."""
  mask_Bx1xLxS = None
  if segment_ids_BxL is not None:
    mask_Bx1xLxS = (segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :])[:, None]
  return jax.nn.dot_product_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, mask=mask_Bx1xLxS, is_causal=True,
                                      local_window_size=(window - 1, 0) if window else None,
                                      implementation=implementation, scale=scale)


def local_block(window: int, length: int) -> int:
  """Query block of the local kernel: about a quarter of the window (a power of two, 16 to 512), so that the
  keys a block reads, ceil((w - 1) / c) + 1 blocks of c, stay within w + c; never longer than the sequence."""
  block = 16
  while block < 512 and block * 4 < window:
    block *= 2
  return min(block, length)


def local_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, segment_ids_BxL=None, window: int = 0,
                    logit_cap: float = 0.0, block: int = 0, scale: Optional[float] = None):
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
  q = jnp.pad(q_BxLxHxE, [(0, 0), (0, pad_end), (0, 0), (0, 0)]) * (e ** -0.5 if scale is None else scale)
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
  out = jnp.einsum('bnkgcs,bnske->bnckge', probs, v_BxNxSxKxE).reshape(b, blocks * c, h, v_BxLxKxE.shape[-1])
  return out[:, :l]


def einsum_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL=None, logit_cap: float = 0.0,
                     window: int = 0, scale: Optional[float] = None):
  """The reference: explicit float32 logits, masked (causal, same segment, window), softmaxed, applied to values."""
  b, l = q_BxLxHxE.shape[:2]
  mask_BxLxS = _causal_mask(segment_ids_BxL, b, 0, l, k_BxSxKxE.shape[1], window)
  return masked_einsum_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxLxS, logit_cap, scale)


def blockwise_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL=None, logit_cap: float = 0.0,
                        scale: Optional[float] = None, block_q: Optional[int] = None):
  """Causal self-attention (L == S) a block of `block_q` query rows at a time (module docstring); a
  sliding window is local_attention's.

  Block i's queries [start, end) meet keys [0, end) only. With several blocks each one is
  rematerialised (jax.checkpoint): its logits are made again in the backward pass instead of kept,
  so no array of L x S logits exists in either pass. One block (L <= block_q) is the einsum kernel.
  """
  b, l = q_BxLxHxE.shape[:2]
  if k_BxSxKxE.shape[1] != l:
    raise ValueError(f'blockwise attention is self-attention: {l} queries, {k_BxSxKxE.shape[1]} keys')
  block_q = block_q or max(BLOCK_Q, -(-l // MAX_BLOCKS))
  if l <= block_q:
    return einsum_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL, logit_cap, 0, scale)
  run = jax.checkpoint(_query_block, static_argnums=(4, 5, 6, 7))
  outs = [run(q_BxLxHxE[:, start:start + block_q], k_BxSxKxE, v_BxSxKxE, segment_ids_BxL, start,
              min(l, start + block_q), logit_cap, scale) for start in range(0, l, block_q)]
  return jnp.concatenate(outs, axis=1)


def _query_block(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL, start: int, end: int, logit_cap: float,
                 scale: Optional[float]):
  """Queries [start, end) against keys [0, end): the keys after the block's last query are never read."""
  mask_BxTxS = _causal_mask(segment_ids_BxL, q_BxTxHxE.shape[0], start, end, end)
  return masked_einsum_attention(q_BxTxHxE, k_BxSxKxE[:, :end], v_BxSxKxE[:, :end], mask_BxTxS, logit_cap, scale)


def _causal_mask(segment_ids_BxL, b: int, start: int, end: int, s: int, window: int = 0):
  """[B, end - start, s]: whether query start + t may see key j (attention_ops.visible, and of its own segment)."""
  mask_TxS = visible(jnp.arange(start, end)[:, None], jnp.arange(s)[None, :], window)
  mask_BxTxS = jnp.broadcast_to(mask_TxS[None], (b, end - start, s))
  if segment_ids_BxL is not None:
    mask_BxTxS = mask_BxTxS & (segment_ids_BxL[:, start:end, None] == segment_ids_BxL[:, None, :s])
  return mask_BxTxS


def masked_einsum_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxLxS, logit_cap: float = 0.0,
                            scale: Optional[float] = None):
  """Attention under any boolean mask (True: may attend); decoding uses it with its KV cache."""
  b, l, h, e = q_BxLxHxE.shape
  kv_heads = k_BxSxKxE.shape[2]
  groups = h // kv_heads
  scale = e ** -0.5 if scale is None else scale
  if l == 1:
    return _one_query_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxLxS, logit_cap, scale)
  q_BxLxKxGxE = q_BxLxHxE.reshape(b, l, kv_heads, groups, e) * scale
  logits_BxKxGxLxS = jnp.einsum('blkge,bske->bkgls', q_BxLxKxGxE, k_BxSxKxE).astype(jnp.float32)
  if logit_cap:   # before the mask: the cap would lift the masked logits too
    logits_BxKxGxLxS = logit_cap * jnp.tanh(logits_BxKxGxLxS / logit_cap)
  logits_BxKxGxLxS = jnp.where(mask_BxLxS[:, None, None], logits_BxKxGxLxS, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits_BxKxGxLxS, axis=-1).astype(q_BxLxHxE.dtype)
  out_BxLxKxGxE = jnp.einsum('bkgls,bske->blkge', probs, v_BxSxKxE)
  return out_BxLxKxGxE.reshape(b, l, h, v_BxSxKxE.shape[-1])


def cached_attention(q_BxLxHxE, k_BxKxExS, v_BxKxSxE, mask_BxLxS, logit_cap: float = 0.0,
                     scale: Optional[float] = None):
  """masked_einsum_attention over a KV cache kept heads-major: keys [B, K, E, S], values [B, K, S, E].

  In that layout both products are batched matrix products over (b, k), [G L, E] x [E, S] and [G L, S] x
  [S, E], whose operands XLA reads in place (the queries, small, are moved instead), and on a CPU XNNPACK
  runs them (a product with a separate length-1 axis went to a slower kernel). A decoding step reads the
  cache once; on a CPU this ran several times as fast as products summed over a [B, S, K, E] cache.
  """
  b, l, h, e = q_BxLxHxE.shape
  kv_heads, s = k_BxKxExS.shape[1], k_BxKxExS.shape[-1]
  g = h // kv_heads
  scale = e ** -0.5 if scale is None else scale
  q_BxKxMxE = (q_BxLxHxE.reshape(b, l, kv_heads, g, e) * scale).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, g * l, e)
  logits = jnp.einsum('bkme,bkes->bkms', q_BxKxMxE, k_BxKxExS).astype(jnp.float32).reshape(b, kv_heads, g, l, s)
  if logit_cap:   # before the mask: the cap would lift the masked logits too
    logits = logit_cap * jnp.tanh(logits / logit_cap)
  logits = jnp.where(mask_BxLxS[:, None, None], logits, jnp.finfo(jnp.float32).min)
  probs_BxKxMxS = jax.nn.softmax(logits, axis=-1).astype(q_BxLxHxE.dtype).reshape(b, kv_heads, g * l, s)
  out_BxKxGxLxE = jnp.einsum('bkms,bkse->bkme', probs_BxKxMxS, v_BxKxSxE).reshape(b, kv_heads, g, l, e)
  return out_BxKxGxLxE.transpose(0, 3, 1, 2, 4).reshape(b, l, h, e)


def _one_query_attention(q_Bx1xHxE, k_BxSxKxE, v_BxSxKxE, mask_Bx1xS, logit_cap: float, scale: float):
  """masked_einsum_attention for one query per row (a decoding step) as products summed in place: the
  einsums' batched dots over (b, k) would first transpose the whole [B, S, K, E] cache, every step."""
  b, _, h, e = q_Bx1xHxE.shape
  kv_heads = k_BxSxKxE.shape[2]
  q_Bx1xKxGxE = q_Bx1xHxE.reshape(b, 1, kv_heads, h // kv_heads, e) * scale
  logits_BxSxKxG = jnp.sum(q_Bx1xKxGxE * k_BxSxKxE[:, :, :, None], axis=-1, dtype=jnp.float32)
  if logit_cap:
    logits_BxSxKxG = logit_cap * jnp.tanh(logits_BxSxKxG / logit_cap)
  logits_BxSxKxG = jnp.where(mask_Bx1xS[:, 0, :, None, None], logits_BxSxKxG, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits_BxSxKxG, axis=1).astype(q_Bx1xHxE.dtype)
  out_BxKxGxE = jnp.sum(probs[..., None] * v_BxSxKxE[:, :, :, None], axis=1, dtype=jnp.float32)
  return out_BxKxGxE.astype(q_Bx1xHxE.dtype).reshape(b, 1, h, v_BxSxKxE.shape[-1])
