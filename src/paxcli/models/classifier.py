"""ClassificationModel: a small sequence classifier, trained by the engine like the LM."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from paxcli.errors import at_least
from paxcli.layers.base import LayerTpl, WeightHParams, WeightInit, template_field
from paxcli.layers.transformer import Block, Norm, fill_template
from paxcli.models import knobs
from paxcli.models.base import BaseModel
from paxcli.models.flops import ModelFlops, stack_flops


class ClassificationModel(BaseModel):
  """A sequence classifier: token + position embeddings, blocks from `block_tpl`, a masked
  mean over the sequence, and a softmax over `num_classes`. Written with the BaseLayer
  verbs only; the engine trains it like the LM, with no change.

  Batch: ids [B, L], mask [B, L] (1 on real tokens), labels [B], weights [B].
  """
  vocab_size: int = 2048
  num_classes: int = 8
  model_dims: int = 64
  num_layers: int = 2
  max_seq_len: int = 64
  block_tpl: LayerTpl = template_field(Block)
  norm_tpl: LayerTpl = template_field(Norm)

  def setup(self):
    d = self.model_dims
    self.create_variable('embedding', WeightHParams(shape=[self.vocab_size, d], init=WeightInit.Gaussian(d ** -0.5),
                                                    tensor_split_dims_mapping=('vocab', 'embed')))
    self.create_variable('position', WeightHParams(shape=[self.max_seq_len, d], init=WeightInit.Gaussian(0.02),
                                                   tensor_split_dims_mapping=(None, 'embed')))
    self.create_variable('head', WeightHParams(shape=[d, self.num_classes], init=WeightInit.Xavier(),
                                               tensor_split_dims_mapping=('embed', None)))
    self.create_variable('head_bias', WeightHParams(shape=[self.num_classes], init=WeightInit.Constant(0.0)))
    compute = self.fprop_dtype or jnp.float32
    block = fill_template(self.block_tpl, compute, model_dims=d)
    self.create_children('blocks', [block] * self.num_layers)
    self.create_child('final_norm', fill_template(self.norm_tpl, compute))

  def compute_predictions(self, input_batch: dict, deterministic: bool = True):
    ids_BxL, mask_BxL = input_batch['ids'], input_batch['mask']
    b, l = ids_BxL.shape
    x_BxLxD = jnp.take(self.theta.embedding, ids_BxL, axis=0) + self.theta.position[None, :l]
    segment_ids_BxL = mask_BxL.astype(jnp.int32)  # padding attends to padding only
    positions_BxL = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32)[None], (b, l))
    for block in self.blocks:
      x_BxLxD, _ = block(x_BxLxD, segment_ids_BxL, positions_BxL)
    x_BxLxD = self.final_norm(x_BxLxD).astype(jnp.float32)
    count_B = jnp.maximum(jnp.sum(mask_BxL, axis=1), 1.0)
    pooled_BxD = jnp.einsum('bld,bl->bd', x_BxLxD, mask_BxL) / count_B[:, None]
    return pooled_BxD @ self.theta.head + self.theta.head_bias[None, :]

  def compute_loss(self, predictions, input_batch: dict):
    logits_BxC = predictions
    labels_B, weights_B = input_batch['labels'], input_batch['weights'].astype(jnp.float32)
    nll_B = -jnp.take_along_axis(jax.nn.log_softmax(logits_BxC, axis=-1), labels_B[:, None], axis=-1)[:, 0]
    total = jnp.maximum(jnp.sum(weights_B), 1e-8)
    loss = jnp.sum(nll_B * weights_B) / total
    accuracy = jnp.sum((jnp.argmax(logits_BxC, axis=-1) == labels_B) * weights_B) / total
    return loss, {'loss': (loss, jnp.sum(weights_B)), 'accuracy': (accuracy, jnp.sum(weights_B))}

  def dummy_batch(self, batch_size: int, seq_len: int) -> dict:
    return {'ids': np.zeros((batch_size, seq_len), np.int32), 'mask': np.zeros((batch_size, seq_len), np.float32),
            'labels': np.zeros((batch_size,), np.int32), 'weights': np.zeros((batch_size,), np.float32)}

  def examples_in(self, input_batch: dict):
    return jnp.sum(input_batch['weights'] > 0)

  def train_flops(self, seq_len: int) -> Optional[ModelFlops]:
    """Training FLOPs per token: the blocks as in the LM; the head (model_dims x num_classes, once
    per sequence) shared among the sequence's tokens. None for blocks of another shape."""
    at = lambda path: knobs.get_path(self.block_tpl, path)
    return stack_flops(self.num_layers, self.model_dims, at('attention_tpl.num_heads'),
                       at('attention_tpl.num_kv_heads'), at('attention_tpl.dims_per_head'),
                       at('ffn_tpl.hidden_dims'), at('ffn_tpl.gated'), seq_len,
                       head_params_per_token=self.model_dims * self.num_classes / seq_len)

  def validate(self) -> None:
    at_least(1, 'task.model', self, 'vocab_size', 'num_classes', 'model_dims', 'num_layers', 'max_seq_len')
