"""TransformerLm: the decoder-only language model, and its loss and metrics."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from paxcli.layers.transformer import Block, Norm, dtype_of

REMAT_POLICIES = {
    'save_nothing': lambda: jax.checkpoint_policies.nothing_saveable,
    'save_everything': lambda: jax.checkpoint_policies.everything_saveable,
    'save_dot_only': lambda: jax.checkpoint_policies.checkpoint_dots,
    'save_dot_with_no_batch_dim': lambda: jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    'save_qkv_out_proj': lambda: jax.checkpoint_policies.save_only_these_names(
        'query_proj', 'key_proj', 'value_proj', 'out_proj'),
}


class TransformerLm(nn.Module):
  """Token embedding, optional learned positions, a stack of blocks, final norm, logits.

  `__call__(ids, segment_ids=None, positions=None)` returns float32 logits [B, L, V].
  """
  vocab_size: int = 256
  num_layers: int = 2
  model_dims: int = 64
  hidden_dims: int = 256
  num_heads: int = 4
  num_kv_heads: int = 4
  dims_per_head: int = 16
  max_seq_len: int = 64
  activation: str = 'gelu'
  use_gated_activation: bool = False
  norm_type: str = 'layernorm'
  use_bias: bool = True
  position_embedding: str = 'learned'
  rotary_max_timescale: float = 10000.0
  separate_embedding: bool = False
  dropout_prob: float = 0.0
  fprop_dtype: str = 'float32'
  scan_layers: bool = False
  checkpoint_policy: str = 'save_nothing'
  attention_impl: str = 'auto'   # attention_ops: auto (cuDNN on GPU), dot_product, einsum

  def _block_class(self):
    block = Block
    if self.checkpoint_policy != 'none':
      block = nn.remat(Block, policy=REMAT_POLICIES[self.checkpoint_policy](),
                       prevent_cse=not self.scan_layers)
    return block

  @nn.compact
  def __call__(self, ids_BxL, segment_ids_BxL=None, positions_BxL=None, deterministic: bool = True):
    dtype = dtype_of(self.fprop_dtype)
    b, l = ids_BxL.shape
    if positions_BxL is None:
      positions_BxL = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32)[None], (b, l))
    embed = nn.Embed(
        self.vocab_size, self.model_dims, dtype=dtype,
        embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(self.model_dims ** -0.5), ('vocab', 'embed')),
        name='embedding')
    x_BxLxD = embed(ids_BxL)
    if self.position_embedding == 'learned':
      pos = self.param('position_embedding',
                       nn.with_logical_partitioning(nn.initializers.normal(0.02), (None, 'embed')),
                       (self.max_seq_len, self.model_dims))
      x_BxLxD = x_BxLxD + jnp.take(pos, positions_BxL, axis=0).astype(dtype)
    x_BxLxD = nn.Dropout(self.dropout_prob, deterministic=deterministic)(x_BxLxD)

    block_kwargs = dict(
        num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, dims_per_head=self.dims_per_head,
        hidden_dims=self.hidden_dims, activation=self.activation, gated=self.use_gated_activation,
        norm_type=self.norm_type, use_bias=self.use_bias, rotary=self.position_embedding == 'rotary',
        rotary_max_timescale=self.rotary_max_timescale, dropout_prob=self.dropout_prob,
        deterministic=deterministic, dtype=dtype, attention_impl=self.attention_impl)
    block = self._block_class()
    if self.scan_layers:
      stack = nn.scan(block, variable_axes={'params': 0}, split_rngs={'params': True, 'dropout': True},
                      in_axes=(nn.broadcast, nn.broadcast), length=self.num_layers,
                      metadata_params={nn.PARTITION_NAME: 'layers'})
      x_BxLxD, _ = stack(**block_kwargs, name='layers')(x_BxLxD, segment_ids_BxL, positions_BxL)
    else:
      for i in range(self.num_layers):
        x_BxLxD, _ = block(**block_kwargs, name=f'layer_{i}')(x_BxLxD, segment_ids_BxL, positions_BxL)

    x_BxLxD = Norm(self.norm_type, self.use_bias, dtype, name='final_norm')(x_BxLxD)
    if self.separate_embedding:
      logits = nn.Dense(self.vocab_size, use_bias=False, dtype=dtype,
                        kernel_init=nn.with_logical_partitioning(
                            nn.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal'),
                            ('embed', 'vocab')),
                        name='logits')(x_BxLxD)
    else:
      logits = embed.attend(x_BxLxD)
    return logits.astype(jnp.float32)


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
