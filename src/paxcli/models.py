"""TransformerLm: the decoder-only language model, and its loss and metrics."""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from paxcli.layers.transformer import Block, Norm, dtype_of, sinusoidal, soft_cap

REMAT_POLICIES = {
    'save_nothing': lambda: jax.checkpoint_policies.nothing_saveable,
    'save_everything': lambda: jax.checkpoint_policies.everything_saveable,
    'save_dot_only': lambda: jax.checkpoint_policies.checkpoint_dots,
    'save_dot_with_no_batch_dim': lambda: jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    'save_qkv_out_proj': lambda: jax.checkpoint_policies.save_only_these_names(
        'query_proj', 'key_proj', 'value_proj', 'out_proj'),
}


class TransformerLm(nn.Module):
  """Token embedding, optional learned or sinusoidal positions, a stack of blocks, final norm, logits.

  Options Pax's lm_cloud models use, all off by default: token embeddings scaled by
  sqrt(model_dims) (`scale_embedding_sqrt_depth`), a bias on the output logits
  (`softmax_bias`), output logits soft-capped by tanh (`softmax_cap_logits`), attention
  logits soft-capped (`atten_logit_cap`), learned per-dimension query scales
  (`per_dim_scale`), attention biases set apart from the others (`attention_use_bias`).

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
  scale_embedding_sqrt_depth: bool = False
  softmax_bias: bool = False
  softmax_cap_logits: float = 0.0
  atten_logit_cap: float = 0.0
  per_dim_scale: bool = False
  attention_use_bias: Optional[bool] = None  # None: use_bias
  norm_epsilon: float = 1e-6

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
    if segment_ids_BxL is None:
      segment_ids_BxL = jnp.ones((b, l), jnp.int32)
    if positions_BxL is None:
      positions_BxL = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32)[None], (b, l))
    embed = nn.Embed(
        self.vocab_size, self.model_dims, dtype=dtype,
        embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(self.model_dims ** -0.5), ('vocab', 'embed')),
        name='embedding')
    x_BxLxD = embed(ids_BxL)
    if self.scale_embedding_sqrt_depth:
      x_BxLxD = x_BxLxD * jnp.asarray(self.model_dims ** 0.5, dtype)
    if self.position_embedding == 'sinusoidal':
      x_BxLxD = x_BxLxD + sinusoidal(positions_BxL, self.model_dims).astype(dtype)
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
        deterministic=deterministic, dtype=dtype, attention_use_bias=self.attention_use_bias,
        per_dim_scale=self.per_dim_scale, atten_logit_cap=self.atten_logit_cap, norm_epsilon=self.norm_epsilon)
    block = self._block_class()
    if self.scan_layers:
      stack = nn.scan(block, variable_axes={'params': 0}, split_rngs={'params': True, 'dropout': True},
                      in_axes=(nn.broadcast, nn.broadcast), length=self.num_layers,
                      metadata_params={nn.PARTITION_NAME: 'layers'})
      x_BxLxD, _ = stack(**block_kwargs, name='layers')(x_BxLxD, segment_ids_BxL, positions_BxL)
    else:
      for i in range(self.num_layers):
        x_BxLxD, _ = block(**block_kwargs, name=f'layer_{i}')(x_BxLxD, segment_ids_BxL, positions_BxL)

    x_BxLxD = Norm(self.norm_type, self.use_bias, dtype, self.norm_epsilon, name='final_norm')(x_BxLxD)
    if self.separate_embedding:
      logits = nn.Dense(self.vocab_size, use_bias=self.softmax_bias, dtype=dtype,
                        kernel_init=nn.with_logical_partitioning(
                            nn.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal'),
                            ('embed', 'vocab')),
                        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('vocab',)),
                        name='logits')(x_BxLxD)
    else:
      logits = embed.attend(x_BxLxD)
      if self.softmax_bias:
        bias = self.param('logits_bias', nn.with_logical_partitioning(nn.initializers.zeros, ('vocab',)),
                          (self.vocab_size,))
        logits = logits + bias.astype(logits.dtype).reshape(1, 1, -1)
    return soft_cap(logits.astype(jnp.float32), self.softmax_cap_logits)


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
