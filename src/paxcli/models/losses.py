"""The LM's loss: weighted softmax cross-entropy, plain (lm_loss), fused (fused_lm_loss, a custom VJP
that keeps no second float32 [B, L, V] array) and chunked (head_lm_loss: from the final features and
the output projection, a custom VJP whose [B, L, V] logits never exist whole)."""

from __future__ import annotations

from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp

from paxcli.layers import activation_sharding
from paxcli.layers.activation_sharding import constrain
from paxcli.layers.transformer import soft_cap


def lm_loss(logits_BxLxV, labels_BxL, weights_BxL):
  """Weighted softmax cross-entropy; padding (weight 0) is ignored.

  Returns (mean loss, metrics) where metrics hold sums so that they can be added
  across batches and hosts before dividing.
  """
  weights = weights_BxL.astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits_BxLxV, axis=-1)
  nll_BxL = -jnp.take_along_axis(log_probs, labels_BxL[..., None], axis=-1)[..., 0]
  total_weight = jnp.sum(weights)
  loss_sum = jnp.sum(nll_BxL * weights)
  correct = jnp.sum((jnp.argmax(logits_BxLxV, axis=-1) == labels_BxL) * weights)
  loss = loss_sum / jnp.maximum(total_weight, 1e-8)
  return loss, {'loss_sum': loss_sum, 'correct_sum': correct, 'weight_sum': total_weight}


def fused_lm_loss(logits_BxLxV, labels_BxL, weights_BxL):
  """`lm_loss` without a second float32 [B, L, V] array: same value, gradient and metrics.

  The plain loss keeps log-softmax [B, L, V] in float32 for its backward pass (and its
  gradient builds more of the same size). Here the forward pass keeps only the
  log-sum-exp per token ([B, L]) and the backward pass recomputes softmax - onehot
  from the logits in one elementwise pass, producing the logits' gradient directly.
  Logits may be bfloat16: they are read in float32 inside the fused reductions.
  """
  return _weighted(_token_nll(logits_BxLxV, labels_BxL), jnp.argmax(logits_BxLxV, axis=-1) == labels_BxL,
                   weights_BxL)


def _logsumexp_BxL(logits_BxLxV):
  x = logits_BxLxV.astype(jnp.float32)
  m_BxL = jax.lax.stop_gradient(jnp.max(x, axis=-1))
  return m_BxL + jnp.log(jnp.sum(jnp.exp(x - m_BxL[..., None]), axis=-1))


def _label_logit_BxL(logits_BxLxV, labels_BxL):
  return jnp.take_along_axis(logits_BxLxV, labels_BxL[..., None], axis=-1)[..., 0].astype(jnp.float32)


@jax.custom_vjp
def _token_nll(logits_BxLxV, labels_BxL):
  return _logsumexp_BxL(logits_BxLxV) - _label_logit_BxL(logits_BxLxV, labels_BxL)


def _token_nll_fwd(logits_BxLxV, labels_BxL):
  lse_BxL = _logsumexp_BxL(logits_BxLxV)
  return lse_BxL - _label_logit_BxL(logits_BxLxV, labels_BxL), (logits_BxLxV, labels_BxL, lse_BxL)


def _token_nll_bwd(residuals, g_BxL):
  logits_BxLxV, labels_BxL, lse_BxL = residuals
  vocab = logits_BxLxV.shape[-1]
  probs = jnp.exp(logits_BxLxV.astype(jnp.float32) - lse_BxL[..., None])
  onehot = labels_BxL[..., None] == jax.lax.broadcasted_iota(labels_BxL.dtype, (1, 1, vocab), 2)
  grad_BxLxV = (probs - onehot.astype(jnp.float32)) * g_BxL[..., None]
  return grad_BxLxV.astype(logits_BxLxV.dtype), None


_token_nll.defvjp(_token_nll_fwd, _token_nll_bwd)


# ---- the loss whose logits never exist whole -------------------------------------------------------


@flax.struct.dataclass
class Head:
  """The output projection as arrays, so that a loss can make logits a chunk of positions at a time.

  `w` is the embedding table [V, D] (tied logits) or the logits kernel [D, V]; `bias` [V] or None.
  `logits(x)` is the one place logits are made from the final features, whole (TransformerLm's output)
  or in chunks (chunked_lm_loss, token_scores): float32, divided by `divisor` (Granite's logits_scaling),
  soft-capped by `cap` (0: not capped), then divided by `temperature` (GRPO scores its samples at the
  temperature they were drawn at, as TRL does).
  """
  w: jax.Array
  bias: Optional[jax.Array]
  tied: bool = flax.struct.field(pytree_node=False)
  dtype: Any = flax.struct.field(pytree_node=False)        # the compute dtype the product runs in
  table_dtype: Any = flax.struct.field(pytree_node=False)  # tied: the table's dtype in the product
  cap: float = flax.struct.field(pytree_node=False, default=0.0)
  divisor: float = flax.struct.field(pytree_node=False, default=1.0)
  temperature: float = flax.struct.field(pytree_node=False, default=1.0)

  @property
  def vocab(self) -> int:
    return self.w.shape[0] if self.tied else self.w.shape[-1]

  def logits(self, x_BxCxD):
    x = x_BxCxD.astype(self.dtype)
    if self.tied:   # the table rounded to table_dtype (MaxText's attend_on_embedding), else as Embed.attend
      out = jnp.dot(x, self.w.astype(self.table_dtype).T, preferred_element_type=self.dtype)
    else:
      out = jax.lax.dot_general(x, self.w.astype(self.dtype), (((x.ndim - 1,), (0,)), ((), ())))
    if self.bias is not None:
      out = out + self.bias.astype(out.dtype).reshape(1, 1, -1)
    out = constrain(out, ('batch', 'length', 'vocab')).astype(jnp.float32)
    if self.divisor != 1.0:
      out = out / self.divisor
    out = soft_cap(out, self.cap)
    return out if self.temperature == 1.0 else out / jnp.float32(self.temperature)


# LOSS_CHUNK_TOKENS counts tokens at this vocabulary or below; a larger vocabulary gets proportionally fewer
# tokens a chunk, so that a chunk's logits stay as large (2,048 x 32,768 float32: 256 MiB) whatever the vocabulary.
CHUNK_VOCAB = 32768
# LOSS_CHUNK_TOKENS 0 (the default) chunks where memory binds: the logits whole unless a device's float32 logits
# would take more than AUTO_CHUNK_BYTES (8B's 128k vocabulary at 4k tokens a device), then chunks of
# AUTO_CHUNK_TOKENS; -1 never chunks.
AUTO_CHUNK_BYTES = 2 << 30
AUTO_CHUNK_TOKENS = 2048


def chunk_length(batch: int, length: int, chunk_tokens: int, vocab: int = CHUNK_VOCAB) -> int:
  """Positions per chunk of the loss: the longest whose chunk of the batch as one device holds it (its share
  under the active activation sharding: rows over the batch axes, and, with context parallelism, positions
  over the context axis, each device's share cut alike) is at most `chunk_tokens` tokens (x CHUNK_VOCAB /
  `vocab` above that vocabulary; at least 1 position a device); `length` itself (one chunk: the logits made
  whole) when that fits or chunk_tokens is -1. chunk_tokens 0: AUTO_CHUNK_TOKENS where a device's whole
  float32 logits would pass AUTO_CHUNK_BYTES, else whole."""
  row_shards, shares = activation_sharding.active_shards(('batch', 'length'), (batch, length))
  rows, share = max(1, batch // row_shards), length // shares
  if chunk_tokens == 0:
    chunk_tokens = AUTO_CHUNK_TOKENS if rows * share * vocab * 4 > AUTO_CHUNK_BYTES else -1
  if chunk_tokens < 0:
    return length
  budget = max(1, chunk_tokens * CHUNK_VOCAB // vocab) if vocab > CHUNK_VOCAB else chunk_tokens
  if rows * share <= budget:
    return length
  fits = [c for c in range(1, share + 1) if share % c == 0 and rows * c <= budget]
  return (max(fits) if fits else 1) * shares


def _shares(batch: int, length: int) -> int:
  """Over how many devices the active activation sharding splits a row's positions (context parallelism)."""
  return activation_sharding.active_shards(('batch', 'length'), (batch, length))[1]


def head_lm_loss(x_BxLxD, head: Head, labels_BxL, weights_BxL, chunk_tokens: int):
  """`fused_lm_loss` of `head.logits(x)` (same value, gradients and metrics), with the logits made a
  chunk of positions at a time (chunk_length) when they would be more than `chunk_tokens` tokens on a
  device: the [B, L, V] logits never exist whole, in the forward pass or the backward."""
  b, l = labels_BxL.shape
  if chunk_length(b, l, chunk_tokens, head.vocab) == l:
    return fused_lm_loss(head.logits(x_BxLxD), labels_BxL, weights_BxL)
  return _weighted(*token_nll(x_BxLxD, head, labels_BxL, chunk_tokens), weights_BxL)


def token_nll(x_BxLxD, head: Head, labels_BxL, chunk_tokens: int):
  """(negative log-likelihood of each label [B, L] float32, whether it is the argmax [B, L]) under
  `head.logits(x)`, differentiable (the fused backward of fused_lm_loss), the logits made a chunk of positions at a
  time as head_lm_loss makes them: what per-sequence log-probabilities (preference tuning, GRPO) are sums of."""
  b, l = labels_BxL.shape
  c = chunk_length(b, l, chunk_tokens, head.vocab)
  if c == l:
    logits = head.logits(x_BxLxD)
    return _token_nll(logits, labels_BxL), jnp.argmax(logits, axis=-1) == labels_BxL
  return _chunked_nll(l // c, _shares(b, l), activation_sharding.snapshot())(x_BxLxD, head, labels_BxL)


def token_scores(x_BxLxD, head: Head, targets_BxL, chunk_tokens: int):
  """(log-probability of each target [B, L] float32, whether it is the argmax [B, L]) with the logits made
  a chunk of positions at a time as in head_lm_loss: for scoring, no gradient."""
  b, l = targets_BxL.shape
  n, shares = l // chunk_length(b, l, chunk_tokens, head.vocab), _shares(b, l)

  def one(x_c, y_c):
    logits = head.logits(x_c)
    return _label_logit_BxL(logits, y_c) - _logsumexp_BxL(logits), jnp.argmax(logits, axis=-1) == y_c

  logp, greedy = jax.lax.map(lambda xs: one(*xs), (_chunks(x_BxLxD, n, shares), _chunks(targets_BxL, n, shares)))
  return _unchunk(logp, shares), _unchunk(greedy, shares)


def _weighted(nll_BxL, correct_BxL, weights_BxL):
  weights = weights_BxL.astype(jnp.float32)
  total_weight = jnp.sum(weights)
  loss_sum = jnp.sum(nll_BxL * weights)
  correct = jnp.sum(correct_BxL * weights)
  loss = loss_sum / jnp.maximum(total_weight, 1e-8)
  return loss, {'loss_sum': loss_sum, 'correct_sum': correct, 'weight_sum': total_weight}


def _chunks(a_BxL, n: int, shares: int = 1):
  """[B, L, ...] -> [n, B, L / n, ...]: chunk i holds the i-th n-th of each of a row's `shares` (the devices its
  positions are split over, each cut alike so that a chunk is made where its tokens are); with 1 share,
  positions i L/n .. (i + 1) L/n - 1."""
  b, l = a_BxL.shape[:2]
  rest = a_BxL.shape[2:]
  split = a_BxL.reshape(b, shares, n, l // (shares * n), *rest)
  return jnp.moveaxis(split, 2, 0).reshape(n, b, l // n, *rest)


def _unchunk(a_NxBxC, shares: int = 1):
  """The inverse of _chunks."""
  n, b, c = a_NxBxC.shape[:3]
  rest = a_NxBxC.shape[3:]
  split = a_NxBxC.reshape(n, b, shares, c // shares, *rest)
  return jnp.moveaxis(split, 0, 2).reshape(b, n * c, *rest)


def _chunked_nll(n: int, shares: int, sharding_rules):
  """(x, head, labels) -> (nll [B, L], correct [B, L] float32), a chunk at a time both ways.

  The forward pass keeps the log-sum-exp per token; the backward pass makes each chunk's logits again
  (the head's product: one more [B, C, D] x [D, V] matmul per chunk) and sends softmax - onehot back
  through the head, adding up the head's gradients over chunks. The backward pass is traced after the
  step's activation-sharding context has closed: `sharding_rules` re-enters the forward's.
  """

  def per_chunk(head, x_c, y_c):
    logits = head.logits(x_c)
    lse = _logsumexp_BxL(logits)
    return lse - _label_logit_BxL(logits, y_c), lse, (jnp.argmax(logits, axis=-1) == y_c).astype(jnp.float32)

  def forward(x_BxLxD, head, labels_BxL):
    _, (nll, lse, correct) = jax.lax.scan(lambda carry, xs: (carry, per_chunk(head, *xs)), None,
                                          (_chunks(x_BxLxD, n, shares), _chunks(labels_BxL, n, shares)))
    return (_unchunk(nll, shares), _unchunk(correct, shares)), lse

  @jax.custom_vjp
  def nll(x_BxLxD, head, labels_BxL):
    return forward(x_BxLxD, head, labels_BxL)[0]

  def fwd(x_BxLxD, head, labels_BxL):
    out, lse_NxBxC = forward(x_BxLxD, head, labels_BxL)
    return out, (x_BxLxD, head, labels_BxL, lse_NxBxC)

  def bwd(residuals, cotangents):
    x_BxLxD, head, labels_BxL, lse_NxBxC = residuals
    g_BxL = cotangents[0]   # `correct` has no gradient

    def back(d_head, xs):
      x_c, y_c, lse_c, g_c = xs
      logits, vjp = jax.vjp(lambda h, x: h.logits(x), head, x_c)
      vocab = logits.shape[-1]
      onehot = y_c[..., None] == jax.lax.broadcasted_iota(y_c.dtype, (1, 1, vocab), 2)
      d_logits = (jnp.exp(logits - lse_c[..., None]) - onehot.astype(jnp.float32)) * g_c[..., None]
      dh, dx = vjp(d_logits)
      return jax.tree.map(jnp.add, d_head, dh), dx

    with sharding_rules():
      zero = jax.tree.map(jnp.zeros_like, head)
      d_head, dx_NxBxCxD = jax.lax.scan(back, zero, (_chunks(x_BxLxD, n, shares), _chunks(labels_BxL, n, shares),
                                                     lse_NxBxC, _chunks(g_BxL, n, shares)))
    return _unchunk(dx_NxBxCxD, shares), d_head, None

  nll.defvjp(fwd, bwd)
  return nll
