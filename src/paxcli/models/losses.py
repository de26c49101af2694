"""The LM's loss: weighted softmax cross-entropy, plain (lm_loss) and fused (fused_lm_loss, a
custom VJP that keeps no second float32 [B, L, V] array)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
  weights = weights_BxL.astype(jnp.float32)
  nll_BxL = _token_nll(logits_BxLxV, labels_BxL)
  total_weight = jnp.sum(weights)
  loss_sum = jnp.sum(nll_BxL * weights)
  correct = jnp.sum((jnp.argmax(logits_BxLxV, axis=-1) == labels_BxL) * weights)
  loss = loss_sum / jnp.maximum(total_weight, 1e-8)
  return loss, {'loss_sum': loss_sum, 'correct_sum': correct, 'weight_sum': total_weight}


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
