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
  flash        queries and keys in blocks with an online softmax and a custom backward pass that
               makes each block's logits again from the log-sum-exp: one block's float32 logits
               ([B, H, 512, 512] at most) exist at a time, in either pass, so memory is linear in L;
               key blocks wholly after a query block (or out of its window) are skipped. Soft caps,
               windows and segments as the others. Context parallelism (paxcli.layers.context_parallel)
               runs its pieces on each device's share of a sequence, whatever the choice here.
  auto         blockwise for capped logits; else dot_product with cuDNN where it applies,
               else XLA's dot_product.
  local        (not a choice: what auto, dot_product and blockwise run for a window where cuDNN does not)
               blockwise sliding-window attention, queries in blocks against the key blocks their window
               reaches: time and memory O(L x window), not O(L x L); it also soft-caps.

Tests hold `dot_product`, `blockwise`, `flash` and `local` to the `einsum` reference, values and gradients.

Sliding window (`window` w > 0, Hugging Face's sliding_window): query i attends key j when
i - w < j <= i (and both are in one segment): the w most recent tokens, itself included. A window
as long as the sequence or longer is full causal attention.

Shapes: B batch, L query length, S key length, H query heads, K kv heads,
G = H // K query heads per kv head, E dims per head. Values may have heads of another size than queries and
keys (latent attention's, paxcli.layers.mla): the output's heads are the values'.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

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
  if impl == 'flash' and self_attention:
    return flash_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxL, window, logit_cap, scale)
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
                     scale: Optional[float] = None, k_scale_BxKxS=None, v_scale_BxKxS=None):
  """masked_einsum_attention over a KV cache kept heads-major: keys [B, K, E, S], values [B, K, S, E].

  In that layout both products are batched matrix products over (b, k), [G L, E] x [E, S] and [G L, S] x
  [S, E], whose operands XLA reads in place (the queries, small, are moved instead), and on a CPU XNNPACK
  runs them (a product with a separate length-1 axis went to a slower kernel). A decoding step reads the
  cache once; on a CPU this ran several times as fast as products summed over a [B, S, K, E] cache.
  An int8 cache (KV_CACHE_QUANT) passes its codes with their scales per head and token: a key's scale
  multiplies its logits, a value's the probability it is weighted with.
  """
  b, l, h, e = q_BxLxHxE.shape
  kv_heads, s = k_BxKxExS.shape[1], k_BxKxExS.shape[-1]
  g = h // kv_heads
  scale = e ** -0.5 if scale is None else scale
  q_BxKxMxE = (q_BxLxHxE.reshape(b, l, kv_heads, g, e) * scale).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, g * l, e)
  logits = jnp.einsum('bkme,bkes->bkms', q_BxKxMxE, k_BxKxExS.astype(q_BxKxMxE.dtype)).astype(jnp.float32)
  if k_scale_BxKxS is not None:
    logits = logits * k_scale_BxKxS[:, :, None, :]
  logits = logits.reshape(b, kv_heads, g, l, s)
  if logit_cap:   # before the mask: the cap would lift the masked logits too
    logits = logit_cap * jnp.tanh(logits / logit_cap)
  logits = jnp.where(mask_BxLxS[:, None, None], logits, jnp.finfo(jnp.float32).min)
  probs_BxKxMxS = jax.nn.softmax(logits, axis=-1).reshape(b, kv_heads, g * l, s)
  if v_scale_BxKxS is not None:
    probs_BxKxMxS = probs_BxKxMxS * v_scale_BxKxS[:, :, None, :]
  probs_BxKxMxS = probs_BxKxMxS.astype(q_BxLxHxE.dtype)
  out_BxKxGxLxE = jnp.einsum('bkms,bkse->bkme', probs_BxKxMxS,
                             v_BxKxSxE.astype(probs_BxKxMxS.dtype)).reshape(b, kv_heads, g, l, e)
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


# ---- flash: blocks of queries against blocks of keys, an online softmax, a custom backward ----------------
#
# Every query and key carries its index in the text (`qi`, `ki`), not its place in the array, so that the
# same pieces serve one device's whole sequence (`flash_attention`) and context parallelism's shares of it in
# load-balanced order (paxcli.layers.context_parallel). A block is FLASH_BLOCK rows or fewer (a divisor of the
# contiguous runs of indices the caller names); its float32 logits [B, K, G, bq, bk] are all that exists of
# the L x S logits at any time, in the forward pass and in the backward pass, which makes them again from the
# log-sum-exp the forward pass kept. A key block entirely after a query block's last query, or entirely out
# of its window, is skipped (lax.cond): causal attention computes about half of the blocks.

FLASH_BLOCK = 512
_NEG = -1e30   # a masked logit: finite, so that a row with no visible key gives 0, not NaN


def flash_block(run: int, target: int = 0) -> int:
  """Rows of a flash block: the largest divisor of `run` (a contiguous run of indices) at most `target`
  (0: FLASH_BLOCK)."""
  return next(b for b in range(min(run, target or FLASH_BLOCK), 0, -1) if run % b == 0)


def flash_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, segment_ids_BxL=None, window: int = 0,
                    logit_cap: float = 0.0, scale: Optional[float] = None, block: int = 0):
  """Causal self-attention by the flash kernel: einsum_attention's function (causal, same segment, window,
  soft cap), values and gradients, in memory linear in L."""
  b, l = q_BxLxHxE.shape[:2]
  segment_ids_BxL = jnp.zeros((b, l), jnp.int32) if segment_ids_BxL is None else segment_ids_BxL
  index_L = jnp.arange(l, dtype=jnp.int32)
  block = flash_block(l, block)
  spec = FlashSpec(effective_window(window, l), float(logit_cap), _scale(q_BxLxHxE, scale), block, block)
  return flash(spec, q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, index_L, index_L, segment_ids_BxL, segment_ids_BxL)


def _scale(q, scale: Optional[float]) -> float:
  return float(q.shape[-1] ** -0.5 if scale is None else scale)


class FlashSpec(NamedTuple):
  """The static settings of a flash call (hashable: the custom VJP's non-differentiable argument)."""
  window: int
  logit_cap: float
  scale: float
  block_q: int
  block_k: int


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def flash(spec: FlashSpec, q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, qi_L, ki_S, segment_q_BxL, segment_k_BxS):
  """Attention of queries q (text indices qi) over keys k, v (indices ki): [B, L, H, E] in q's dtype."""
  return flash_output(flash_forward(spec, q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, qi_L, ki_S, segment_q_BxL,
                                    segment_k_BxS), q_BxLxHxE)[0]


def _flash_fwd(spec, q, k, v, qi, ki, sq, sk):
  out, lse = flash_output(flash_forward(spec, q, k, v, qi, ki, sq, sk), q)
  return out, (q, k, v, qi, ki, sq, sk, out, lse)


def _flash_bwd(spec, residuals, d_out):
  q, k, v, qi, ki, sq, sk, out, lse = residuals
  dq, dk, dv = flash_backward(spec, q, k, v, qi, ki, sq, sk, lse, flash_delta(out, d_out, k.shape[2]), d_out)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


flash.defvjp(_flash_fwd, _flash_bwd)


def _q_blocks(x_BxLx, block: int):
  """[B, L, ...] -> [L / block, B, block, ...]."""
  b, l = x_BxLx.shape[:2]
  return jnp.moveaxis(x_BxLx.reshape(b, l // block, block, *x_BxLx.shape[2:]), 1, 0)


def _grouped(q_BxLxHxE, kv_heads: int):
  b, l, h, e = q_BxLxHxE.shape
  return q_BxLxHxE.reshape(b, l, kv_heads, h // kv_heads, e)


def flash_state(spec: FlashSpec, q_BxLxHxE, v_BxSxKxV):
  """The online softmax before any key: running max m, sum l [nq, B, K, G, bq] and output sum acc [..., V]
  (V the values' head size: latent attention's differs from the queries')."""
  b, l, h, _ = q_BxLxHxE.shape
  kv_heads, v_dims = v_BxSxKxV.shape[2:]
  shape = (l // spec.block_q, b, kv_heads, h // kv_heads, spec.block_q)
  return (jnp.full(shape, _NEG, jnp.float32), jnp.zeros(shape, jnp.float32),
          jnp.zeros(shape + (v_dims,), jnp.float32))


def _block_mask(spec, qi_Q, ki_S, sq_BxQ, sk_BxS):
  """[B, 1, 1, bq, bk]: visible (causal, window) and of one segment."""
  mask = visible(qi_Q[:, None], ki_S[None, :], spec.window)[None] & (sq_BxQ[:, :, None] == sk_BxS[:, None, :])
  return mask[:, None, None]


def _block_logits(spec, q_BxQxKxGxE, k_BxSxKxE):
  """(logits [B, K, G, bq, bk] float32 after the cap, tanh of the capped ones for the backward pass or None)."""
  s = jnp.einsum('bqkge,bske->bkgqs', q_BxQxKxGxE, k_BxSxKxE, preferred_element_type=jnp.float32)
  if not spec.logit_cap:
    return s, None
  t = jnp.tanh(s / spec.logit_cap)
  return spec.logit_cap * t, t


def _skipped(spec, qi_Q, ki_S):
  """Whether no query of the block sees any key of the block: all keys after the last query, or out of
  the window of the first."""
  far = jnp.min(ki_S) > jnp.max(qi_Q)
  if spec.window:
    far = far | (jnp.max(ki_S) <= jnp.min(qi_Q) - spec.window)
  return far


def _key_blocks(spec, k_BxSxKxE, v_BxSxKxE, ki_S, sk_BxS):
  bk = spec.block_k
  return (_q_blocks(k_BxSxKxE, bk), _q_blocks(v_BxSxKxE, bk), ki_S.reshape(-1, bk), _q_blocks(sk_BxS, bk))


def _tied(q_BxLxHxE, qi_L, ki_S):
  """The text indices tied to the queries by an optimization barrier, so that whether a block is skipped is not
  known before the queries are. Inside a scan (the layer stack) JAX's partial evaluation hoists what depends on
  constants alone out of the loop: it would precompute every pair of blocks' masks, [L / b, S / b, b, b], the
  L x S the kernel exists to avoid (benchmarks/context_parallel.py measured it growing with L squared)."""
  return jax.lax.optimization_barrier((q_BxLxHxE, qi_L, ki_S))


def flash_forward(spec: FlashSpec, q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, qi_L, ki_S, sq_BxL, sk_BxS, state=None):
  """The online softmax `state` (flash_state) after the keys k, v as well: what a ring step adds."""
  q_BxLxHxE, qi_L, ki_S = _tied(q_BxLxHxE, qi_L, ki_S)
  kv_heads = k_BxSxKxE.shape[2]
  state = flash_state(spec, q_BxLxHxE, v_BxSxKxE) if state is None else state
  q_blocks = _q_blocks(_grouped(q_BxLxHxE * jnp.asarray(spec.scale, q_BxLxHxE.dtype), kv_heads), spec.block_q)
  keys = _key_blocks(spec, k_BxSxKxE, v_BxSxKxE, ki_S, sk_BxS)

  def query_block(xs):
    q, qi, sq, m, l, acc = xs

    def key_block(carry, ks):
      k, v, ki, sk = ks

      def attend(carry):
        m, l, acc = carry
        mask = _block_mask(spec, qi, ki, sq, sk)
        s = jnp.where(mask, _block_logits(spec, q, k)[0], _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        rescale = jnp.exp(m - m_new)
        pv = jnp.einsum('bkgqs,bske->bkgqe', p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, l * rescale + jnp.sum(p, axis=-1), acc * rescale[..., None] + pv

      return jax.lax.cond(_skipped(spec, qi, ki), lambda c: c, attend, carry), None

    return jax.lax.scan(key_block, (m, l, acc), keys)[0]

  return jax.lax.map(query_block, (q_blocks, qi_L.reshape(-1, spec.block_q), _q_blocks(sq_BxL, spec.block_q))
                     + tuple(state))


def flash_output(state, q_BxLxHxE):
  """(output [B, L, H, E] in q's dtype, log-sum-exp [nq, B, K, G, bq] float32) of a finished state; a query
  that saw no key gets 0."""
  m, l, acc = state
  seen = l > 0
  lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), _NEG)
  out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
  nq, b, k, g, bq, e = out.shape
  out_BxLxHxE = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * bq, k * g, e)
  return out_BxLxHxE.astype(q_BxLxHxE.dtype), lse


def flash_delta(out_BxLxHxE, d_out_BxLxHxE, kv_heads: int):
  """sum over E of dO x O per query and head, [B, L, K, G] float32: the softmax's backward term."""
  delta = jnp.sum(d_out_BxLxHxE.astype(jnp.float32) * out_BxLxHxE.astype(jnp.float32), axis=-1)
  b, l, h = delta.shape
  return delta.reshape(b, l, kv_heads, h // kv_heads)


def flash_backward(spec: FlashSpec, q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, qi_L, ki_S, sq_BxL, sk_BxS, lse, delta_BxLxKxG,
                   d_out_BxLxHxE):
  """(dq [B, L, H, E], dk, dv [B, S, K, E]) float32 of the queries' attention over these keys, given the
  log-sum-exp over all the keys they attend to (a ring step's share of the gradients)."""
  q_BxLxHxE, qi_L, ki_S = _tied(q_BxLxHxE, qi_L, ki_S)
  kv_heads = k_BxSxKxE.shape[2]
  bq = spec.block_q
  dtype = q_BxLxHxE.dtype
  q_blocks = _q_blocks(_grouped(q_BxLxHxE * jnp.asarray(spec.scale, dtype), kv_heads), bq)
  do_blocks = _q_blocks(_grouped(d_out_BxLxHxE.astype(dtype), kv_heads), bq)
  delta_blocks = jnp.moveaxis(_q_blocks(delta_BxLxKxG, bq), 2, -1)   # [nq, B, K, G, bq]
  keys = _key_blocks(spec, k_BxSxKxE, v_BxSxKxE, ki_S, sk_BxS)

  def query_block(d_keys, xs):
    q, qi, sq, do, lse_q, delta = xs

    def key_block(dq, ks):
      k, v, ki, sk = ks

      def grads(dq):
        mask = _block_mask(spec, qi, ki, sq, sk)
        s, t = _block_logits(spec, q, k)
        p = jnp.where(mask, jnp.exp(s - lse_q[..., None]), 0.0)
        dv = jnp.einsum('bkgqs,bqkge->bske', p.astype(dtype), do, preferred_element_type=jnp.float32)
        dp = jnp.einsum('bqkge,bske->bkgqs', do, v, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[..., None])
        if t is not None:   # through cap * tanh(s / cap)
          ds = ds * (1.0 - t * t)
        dq = dq + jnp.einsum('bkgqs,bske->bqkge', ds.astype(dtype), k, preferred_element_type=jnp.float32)
        dk = jnp.einsum('bkgqs,bqkge->bske', ds.astype(dtype), q, preferred_element_type=jnp.float32)
        return dq, (dk, dv)

      zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
      return jax.lax.cond(_skipped(spec, qi, ki), lambda dq: (dq, zeros), grads, dq)

    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(q.shape, jnp.float32), keys)
    return (d_keys[0] + dk, d_keys[1] + dv), dq

  zero_keys = (jnp.zeros(keys[0].shape, jnp.float32), jnp.zeros(keys[1].shape, jnp.float32))
  (dk, dv), dq = jax.lax.scan(query_block, zero_keys, (q_blocks, qi_L.reshape(-1, bq), _q_blocks(sq_BxL, bq),
                                                       do_blocks, lse, delta_blocks))
  unblock = lambda x: jnp.moveaxis(x, 0, 1).reshape((x.shape[1], x.shape[0] * x.shape[2]) + x.shape[3:])
  b, l, h, e = q_BxLxHxE.shape
  dq = unblock(dq).reshape(b, l, h, e) * spec.scale
  return dq, unblock(dk), unblock(dv)
