"""Models: what the engine trains. BaseModel, LanguageModel (the Transformer LM) and its loss.

A model is a BaseLayer with three methods the engine calls, and nothing else:

  compute_predictions(batch, deterministic) -> predictions
  compute_loss(predictions, batch) -> (loss, metrics)   metrics: name -> (value, weight)
  dummy_batch(batch_size, seq_len) -> numpy batch        shapes for init and eval padding

`fprop(batch, deterministic)` chains the first two; train, eval and init call it through
`model.apply(..., method='fprop')`. Eval reports each metric as the weighted mean over
the whole eval set (sum of value x weight over sum of weight, across batches and hosts),
then `eval_summary` may add derived numbers (the LM adds perplexity). A model may define
`validate()` (UserError for impossible settings) and `max_seq_len`, and `train_flops(seq_len)`
(its training FLOPs per token, a ModelFlops, or None where it cannot count them), from which
train and `pax bench mfu` report MFU; a model without that method reports MFU as n/a.

A model that generates tokens (`pax decode`, decoding while training) is a DecodingModel:
it also defines `init_cache` and `extend`, the only calls the decoder makes.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
from typing import Any, Optional

import fiddle as fdl
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from paxcli.errors import UserError, at_least
from paxcli.families import knobs
from paxcli.layers import lora, pipeline
from paxcli.layers.activation_sharding import active_axis_size, constrain
from paxcli.layers.base import (AUX_LOSS, NON_TRAINABLE, RANDOM, SUMMARIES, BaseLayer, LayerTpl, WeightHParams,
                                WeightInit, build_arguments, instantiate, template_field)  # noqa: F401
from paxcli.layers.transformer import Attention, Block, Mlp, Norm, dtype_of, fill_template, sinusoidal, soft_cap

REMAT_POLICIES = {
    'save_nothing': lambda: jax.checkpoint_policies.nothing_saveable,
    'save_everything': lambda: jax.checkpoint_policies.everything_saveable,
    'save_dot_only': lambda: jax.checkpoint_policies.checkpoint_dots,
    'save_dot_with_no_batch_dim': lambda: jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    'save_qkv_out_proj': lambda: jax.checkpoint_policies.save_only_these_names(
        'query_proj', 'key_proj', 'value_proj', 'out_proj'),
}


class BaseModel(BaseLayer):
  """A model the engine can train, evaluate and initialise (see the module docstring)."""

  def compute_predictions(self, input_batch: dict, deterministic: bool = True) -> Any:
    raise NotImplementedError(f'{type(self).__name__} must define compute_predictions().')

  def compute_loss(self, predictions: Any, input_batch: dict) -> tuple[Any, dict]:
    raise NotImplementedError(f'{type(self).__name__} must define compute_loss().')

  def fprop(self, input_batch: dict, deterministic: bool = True):
    """(loss, metrics) for one batch: the method train, eval and init apply."""
    return self.compute_loss(self.compute_predictions(input_batch, deterministic), input_batch)

  def dummy_batch(self, batch_size: int, seq_len: int) -> dict:
    raise NotImplementedError(f'{type(self).__name__} must define dummy_batch().')

  def validate(self) -> None:
    """Raises paxcli.errors.UserError for settings that cannot work."""

  def pipeline_schedule(self, global_batch: int):
    """The pipeline's Schedule (paxcli.layers.pipeline) at this global batch; None: not pipelined."""
    return None

  def eval_summary(self, means: dict, weights: dict) -> dict:
    """Eval results from weighted means of the metrics (and their total weights)."""
    return dict(means)

  def examples_in(self, input_batch: dict):
    """How many real (non-padding) examples a batch holds."""
    weights = input_batch['weights']
    return jnp.sum(jnp.any(weights.reshape(weights.shape[0], -1) > 0, axis=-1))

  def count_in(self, metrics: dict):
    """Tokens (or examples) a step trained on, for tokens_per_sec: the loss's weight."""
    return metrics['loss'][1]

  @property
  def compute_dtype(self) -> str:
    """The activations' dtype by name: the device peak MFU is measured against depends on it."""
    return dtype_name(self.fprop_dtype)

  @property
  def has_dropout(self) -> bool:
    """True when a training step draws dropout (the step then runs non-deterministically)."""
    return getattr(self, 'dropout_prob', 0) > 0

  def is_trainable(self, path: tuple) -> bool:
    """Whether the weight at `path` (keys under params) trains; frozen ones get no gradient, no
    optimizer state and stay out of checkpoints (which name the base they came from instead)."""
    return True

  @property
  def frozen_dtype(self) -> Optional[str]:
    """The dtype frozen weights are kept in (None: as initialised)."""
    return None


class DecodingModel(BaseModel):
  """A model that generates tokens with a cache: the interface `pax decode` and decoding while
  training use, and all they know of the model (as flax lm1b's sampler knows `tokens_to_logits`).

  The methods are pure functions of the params, called on the unbound model, for the decoder
  to jit:

    init_cache(params, batch, length) -> cache
        A fresh cache for `batch` rows of up to `length` tokens. Each leaf is boxed with its
        logical axes (`nn.with_logical_partitioning`): the decoder shards it with the
        activation table, and a leaf with a 'batch' axis holds one entry per row there (beam
        search moves rows along it); the others are shared by all rows.
    extend(params, cache, ids_BxL, positions_BxL) -> (logits_BxLxV float32, cache)
        Feeds L more tokens per row into the next L cache slots, the same slots for every
        row. positions_BxL is each token's position in its own row, -1 for padding: a
        padding slot is never attended to, so that a left-padded prompt reads as alone.
    with_fprop_dtype(dtype) -> model
        This model computing its activations in `dtype` ('float32', 'bfloat16', ...).

  and the properties `vocab_size` and `max_seq_len` (room for prompt and new tokens).
  """

  def init_cache(self, params, batch: int, length: int):
    raise NotImplementedError(f'{type(self).__name__} must define init_cache().')

  def extend(self, params, cache, ids_BxL, positions_BxL):
    raise NotImplementedError(f'{type(self).__name__} must define extend().')

  def with_fprop_dtype(self, dtype: str) -> 'DecodingModel':
    raise NotImplementedError(f'{type(self).__name__} must define with_fprop_dtype().')


class TransformerLm(BaseLayer):
  """Token embedding, optional learned or sinusoidal positions, a stack of blocks, final norm, logits.

  Options Pax's lm_cloud models use, off by default: token embeddings scaled by
  sqrt(model_dims) (`scale_embedding_sqrt_depth`), a bias on the output logits
  (`softmax_bias`), output logits soft-capped by tanh (`softmax_cap_logits`).

  The blocks come from `block_tpl` (attention, feed-forward and norm templates inside it)
  and the final norm from `final_norm_tpl`; the LM fills model_dims, dropout and the compute
  dtype into them. `__call__(ids, segment_ids=None, positions=None)` returns float32 logits.
  """
  vocab_size: int = 256
  num_layers: int = 2
  model_dims: int = 64
  max_seq_len: int = 64
  position_embedding: str = 'learned'
  separate_embedding: bool = False
  dropout_prob: float = 0.0
  fprop_dtype: Any = 'float32'
  scan_layers: bool = False
  checkpoint_policy: str = 'save_nothing'
  scale_embedding_sqrt_depth: bool = False
  softmax_bias: bool = False
  softmax_cap_logits: float = 0.0
  tied_logits_bfloat16: bool = False
  # Pipeline parallelism (paxcli.layers.pipeline; needs scan_layers): the stacked layers run as
  # num_stages stages over num_microbatches microbatches (or microbatches of microbatch_size
  # rows; neither: as many as stages), pipeline_repeats times round (circular). 1 stage: off.
  num_stages: int = 1
  num_microbatches: Optional[int] = None
  microbatch_size: Optional[int] = None
  pipeline_repeats: int = 1
  block_tpl: LayerTpl = template_field(Block)
  final_norm_tpl: LayerTpl = template_field(Norm)

  def _pipelined(self, x_BxLxD, segment_ids_BxL, positions_BxL, dtype, deterministic: bool):
    """The scanned stack's weights (`layers`, [L, ...]) run by paxcli.layers.pipeline."""
    schedule = pipeline_schedule(self, x_BxLxD.shape[0])
    block, kwargs = self._block_kwargs(dtype, deterministic, remat=False)
    module = block(**kwargs, parent=None)
    variables = nn.meta.unbox(self.variables)
    others = sorted(c for c, tree in variables.items() if c != 'params' and 'layers' in tree)
    if others:
      raise UserError(f'Pipelined layers may hold trainable weights only; these blocks also have {others}. '
                      'Set NUM_STAGES=1.')
    rng = None if deterministic else self.make_rng('dropout')

    def layer_fn(params, x, extras, key):
      rngs = {} if key is None else {'dropout': key, RANDOM: jax.random.fold_in(key, 1)}
      return module.apply({'params': params}, x, extras.get('segment_ids'), extras['positions'], rngs=rngs)[0]

    extras = {'positions': positions_BxL}
    if segment_ids_BxL is not None:
      extras['segment_ids'] = segment_ids_BxL
    policy = None if self.checkpoint_policy == 'none' else REMAT_POLICIES[self.checkpoint_policy]()
    return pipeline.run(layer_fn, variables['params']['layers'], x_BxLxD, extras, schedule, policy, rng)

  def _block_kwargs(self, dtype, deterministic: bool, remat: bool = True) -> tuple[type, dict]:
    """The block class (remat-wrapped per checkpoint_policy) and its arguments from block_tpl."""
    tpl = fill_template(self.block_tpl, dtype, model_dims=self.model_dims, dropout_prob=self.dropout_prob,
                        deterministic=deterministic)
    cls = fdl.get_callable(tpl)
    kwargs = build_arguments(tpl, self)
    if remat and self.checkpoint_policy != 'none':
      cls = nn.remat(cls, policy=REMAT_POLICIES[self.checkpoint_policy](), prevent_cse=not self.scan_layers)
    return cls, kwargs

  @nn.compact
  def __call__(self, ids_BxL, segment_ids_BxL=None, positions_BxL=None, deterministic: bool = True):
    dtype = dtype_of(self.fprop_dtype) if isinstance(self.fprop_dtype, str) else self.fprop_dtype
    b, l = ids_BxL.shape
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
    x_BxLxD = constrain(x_BxLxD, ('batch', 'length', 'embed'))

    decoding = self.is_mutable_collection('cache') and not self.is_initializing()  # KV cache: no remat
    block, block_kwargs = self._block_kwargs(dtype, deterministic, remat=not decoding)
    # The pipeline runs in train and eval steps on a mesh with stages; init, decoding (KV cache) and
    # plain `apply` (conversions, notebooks) run the stack unpipelined, on the same [L, ...] weights.
    if (self.scan_layers and not decoding and not self.is_initializing()
        and active_axis_size(pipeline.STAGE_AXIS) > 1 and pipeline_schedule(self, b)):
      x_BxLxD = self._pipelined(x_BxLxD, segment_ids_BxL, positions_BxL, dtype, deterministic)
    elif self.scan_layers:
      stack = nn.scan(block, variable_axes={'params': 0, NON_TRAINABLE: 0, SUMMARIES: 0, AUX_LOSS: 0, 'cache': 0},
                      split_rngs={'params': True, 'dropout': True, RANDOM: True},
                      in_axes=(nn.broadcast, nn.broadcast), length=self.num_layers,
                      metadata_params={nn.PARTITION_NAME: 'layers'})
      x_BxLxD, _ = stack(**block_kwargs, name='layers')(x_BxLxD, segment_ids_BxL, positions_BxL)
    else:
      for i in range(self.num_layers):
        x_BxLxD, _ = block(**block_kwargs, name=f'layer_{i}')(x_BxLxD, segment_ids_BxL, positions_BxL)

    final_norm = fill_template(self.final_norm_tpl, dtype)
    x_BxLxD = fdl.get_callable(final_norm)(**build_arguments(final_norm, self), name='final_norm')(x_BxLxD)
    if self.separate_embedding:
      logits = nn.Dense(self.vocab_size, use_bias=self.softmax_bias, dtype=dtype,
                        kernel_init=nn.with_logical_partitioning(
                            nn.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal'),
                            ('embed', 'vocab')),
                        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('vocab',)),
                        name='logits')(x_BxLxD)
    elif self.tied_logits_bfloat16:   # MaxText's attend_on_embedding: the table rounded to bfloat16
      table_VxD = embed.embedding.astype(jnp.bfloat16)
      logits = jnp.dot(x_BxLxD, table_VxD.T, preferred_element_type=dtype)
    else:
      logits = embed.attend(x_BxLxD)
      if self.softmax_bias:
        bias = self.param('logits_bias', nn.with_logical_partitioning(nn.initializers.zeros, ('vocab',)),
                          (self.vocab_size,))
        logits = logits + bias.astype(logits.dtype).reshape(1, 1, -1)
    logits = constrain(logits, ('batch', 'length', 'vocab'))
    return soft_cap(logits.astype(jnp.float32), self.softmax_cap_logits)


def pipeline_schedule(lm, batch: int):
  """A TransformerLm's (config or layer) pipeline Schedule for a global batch; None: not pipelined.

  Raises UserError for knobs that cannot work (see paxcli.layers.pipeline.schedule_for).
  """
  stages, repeats = getattr(lm, 'num_stages', 1), getattr(lm, 'pipeline_repeats', 1)
  if stages == 1 and repeats == 1:
    return None
  if not lm.scan_layers:
    raise UserError('Pipeline parallelism (NUM_STAGES > 1) needs USE_REPEATED_LAYER=True: the pipeline keeps '
                    'the scanned layout [layers, ...], so checkpoints do not depend on the stage count.')
  return pipeline.schedule_for(lm.num_layers, stages, repeats, batch, lm.num_microbatches, lm.microbatch_size)


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


def lm_config(**settings) -> fdl.Config:
  """The LanguageModel config with its templates filled from flat settings: the LM knobs under
  their flat names (paxcli.families.knobs.LM_KNOBS: num_heads, norm_type, ...), each missing one
  at its knob's default.

  Each setting lands in the template fields its row names: attention heads in
  `lm_tpl.block_tpl.attention_tpl`, hidden dims and activation in `...ffn_tpl`, the norm
  kind in `...norm_tpl` and `lm_tpl.final_norm_tpl`, the rest on `lm_tpl`.
  """
  block = fdl.Config(Block, attention_tpl=fdl.Config(Attention), ffn_tpl=fdl.Config(Mlp), norm_tpl=fdl.Config(Norm))
  lm = fdl.Config(TransformerLm, block_tpl=block, final_norm_tpl=fdl.Config(Norm))
  return knobs.fill(fdl.Config(LanguageModel, lm_tpl=lm), knobs.LM_KNOBS, settings)


class LanguageModel(DecodingModel):
  """A decoder-only LM: the network from `lm_tpl` (a TransformerLm by default) and lm_loss.

  The network shares this model's scope, so its weights keep the names they had before
  models became pluggable (embedding, layer_0/attention/query/kernel, ...), and
  `LanguageModel(...)(ids)` returns logits like the network itself.
  """
  lm_tpl: LayerTpl = template_field(TransformerLm)
  # LORA_BASE_DTYPE: the frozen base weights' dtype under LoRA (models.BaseModel.frozen_dtype).
  lora_base_dtype: str = 'float32'

  def setup(self):
    self.create_child('lm', self.lm_tpl)
    nn.share_scope(self, self.lm)

  def __call__(self, ids_BxL, segment_ids_BxL=None, positions_BxL=None, deterministic: bool = True):
    return self.lm(ids_BxL, segment_ids_BxL, positions_BxL, deterministic=deterministic)

  def compute_predictions(self, input_batch: dict, deterministic: bool = True):
    return self(input_batch['ids'], input_batch.get('segment_ids'), input_batch.get('positions'),
                deterministic=deterministic)

  def compute_loss(self, predictions, input_batch: dict):
    loss, sums = fused_lm_loss(predictions, input_batch['labels'], input_batch['weights'])
    weight = sums['weight_sum']
    accuracy = sums['correct_sum'] / jnp.maximum(weight, 1e-8)
    return loss, {'loss': (loss, weight), 'accuracy': (accuracy, weight)}

  def dummy_batch(self, batch_size: int, seq_len: int) -> dict:
    shape = (batch_size, seq_len)
    return {'ids': np.zeros(shape, np.int32), 'labels': np.zeros(shape, np.int32),
            'weights': np.zeros(shape, np.float32)}

  def eval_summary(self, means: dict, weights: dict) -> dict:
    out = dict(means)
    out['log_pplx'] = means['loss']
    out['perplexity'] = math.exp(min(means['loss'], 50.0))
    out['num_tokens'] = weights['loss']
    return out

  # The network's settings, read by the engine where it needs them.
  @property
  def max_seq_len(self) -> int:
    return self.lm_tpl.max_seq_len

  @property
  def vocab_size(self) -> int:
    return self.lm_tpl.vocab_size

  @property
  def dropout_prob(self) -> float:
    return self.lm_tpl.dropout_prob

  @property
  def compute_dtype(self) -> str:
    return dtype_name(getattr(self.lm_tpl, 'fprop_dtype', None))

  def validate(self) -> None:
    validate_lm(self.lm_tpl)

  @property
  def lora(self) -> dict:
    """LoRA settings (rank, alpha, targets, dropout) from the attention template; rank 0: off."""
    s = knobs.read(self, knobs.LM_KNOBS)
    return {'rank': s['lora_rank'] or 0, 'alpha': s['lora_alpha'], 'targets': tuple(s['lora_targets'] or ()),
            'dropout': s['lora_dropout'] or 0.0}

  @property
  def has_dropout(self) -> bool:
    return self.dropout_prob > 0 or (self.lora['rank'] > 0 and self.lora['dropout'] > 0)

  def is_trainable(self, path: tuple) -> bool:
    """With LoRA only the adapters train; otherwise everything."""
    return not self.lora['rank'] or lora.is_adapter(str(path[-1]))

  @property
  def frozen_dtype(self) -> Optional[str]:
    return self.lora_base_dtype if self.lora['rank'] else None

  def pipeline_schedule(self, global_batch: int):
    return pipeline_schedule(self.lm_tpl, global_batch)

  def train_flops(self, seq_len: int) -> Optional[ModelFlops]:
    """Training FLOPs per token, read through the knob table; None when a swapped-in layer
    lacks one of the settings the count needs."""
    s = knobs.read(self, knobs.LM_KNOBS)
    if s['model_dims'] is None or s['vocab_size'] is None:
      return None
    return stack_flops(s['num_layers'], s['model_dims'], s['num_heads'], s['num_kv_heads'], s['dims_per_head'],
                       s['hidden_dims'], s['use_gated_activation'], seq_len,
                       head_params_per_token=s['model_dims'] * s['vocab_size'])

  # Decoding (see DecodingModel): the network's attention layers keep keys and values in the
  # flax collection 'cache' when it is mutable (paxcli.layers.transformer.Attention).
  def init_cache(self, params, batch: int, length: int):
    """Zeros shaped by one forward pass of [batch, length] ids: its first call only sizes the cache."""
    ids = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    shapes = jax.eval_shape(lambda p, x: self.apply({'params': p}, x, mutable=['cache'])[1]['cache'], params, ids)
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)

  def extend(self, params, cache, ids_BxL, positions_BxL):
    segment_ids_BxL = (positions_BxL >= 0).astype(jnp.int32)  # segment 0: padding, never attended to
    logits_BxLxV, mutated = self.apply({'params': params, 'cache': cache}, ids_BxL, segment_ids_BxL,
                                       jnp.maximum(positions_BxL, 0), mutable=['cache'])
    return logits_BxLxV, mutated['cache']

  def with_fprop_dtype(self, dtype: str) -> 'LanguageModel':
    if dtype == self.lm_tpl.fprop_dtype:
      return self
    lm = copy.deepcopy(self.lm_tpl)
    lm.fprop_dtype = dtype
    return self.clone(lm_tpl=lm)


def flat_view(model):
  """The LM's settings under the flat names of `lm_config` (num_heads, norm_type, ...), with
  `apply` of the model: for code that reads an LM's shape (conversion, export). Each name reads
  the first field of its knob (paxcli.families.knobs.LM_KNOBS), so `use_bias` is the MLP's and
  `attention_use_bias` the attention's; a field a swapped-in layer lacks reads None."""
  return types.SimpleNamespace(apply=model.apply, model=model, **knobs.read(model, knobs.LM_KNOBS))


def validate_lm(lm) -> None:
  """Checks of a TransformerLm config that one layer alone cannot make."""
  at_least(1, 'task.model.lm_tpl', lm, 'vocab_size', 'num_layers', 'model_dims', 'max_seq_len')
  if not 0 <= lm.dropout_prob < 1:
    raise UserError(f'task.model.lm_tpl.dropout_prob must be in [0, 1), got {lm.dropout_prob}.')
  if getattr(getattr(lm, 'final_norm_tpl', None), 'epsilon', 1.0) <= 0:
    raise UserError(f'NORM_EPSILON must be positive, got {lm.final_norm_tpl.epsilon}.')
  if getattr(lm, 'softmax_cap_logits', 0.0) < 0:
    raise UserError(f'SOFTMAX_CAP_LOGITS must be 0 (off) or positive, got {lm.softmax_cap_logits}.')
  attention = getattr(getattr(lm, 'block_tpl', None), 'attention_tpl', None)
  if attention is None or fdl.get_callable(attention) is not Attention:
    return
  where = 'task.model.lm_tpl.block_tpl.attention_tpl'
  at_least(1, where, attention, 'num_heads', 'num_kv_heads', 'dims_per_head')
  if attention.num_heads % attention.num_kv_heads:
    raise UserError(f'NUM_HEADS {attention.num_heads} must be a multiple of NUM_KV_HEADS '
                    f'{attention.num_kv_heads}.')
  if attention.atten_logit_cap < 0:
    raise UserError(f'ATTEN_LOGIT_CAP must be 0 (off) or positive, got {attention.atten_logit_cap}.')
  if attention.rotary and attention.dims_per_head % 2:
    raise UserError(f'Rotary positions need an even DIMS_PER_HEAD, got {attention.dims_per_head}.')
  _validate_rotary_scaling(attention)
  validate_lora(attention)
  ffn = lm.block_tpl.ffn_tpl
  if fdl.get_callable(ffn) is Mlp:
    at_least(1, 'task.model.lm_tpl.block_tpl.ffn_tpl', ffn, 'hidden_dims')


def _validate_rotary_scaling(attention) -> None:
  if getattr(attention, 'rotary_scaling', 'none') == 'none':
    return
  if not attention.rotary_scaling_factor >= 1:
    raise UserError(f'ROTARY_SCALING_FACTOR must be at least 1, got {attention.rotary_scaling_factor}.')
  if attention.rotary_scaling == 'llama3' and not (
      0 < attention.rotary_low_freq_factor < attention.rotary_high_freq_factor and attention.rotary_original_max_len > 0):
    raise UserError('ROTARY_SCALING llama3 needs 0 < ROTARY_LOW_FREQ_FACTOR < ROTARY_HIGH_FREQ_FACTOR and a positive '
                    f'ROTARY_ORIGINAL_MAX_LEN; got {attention.rotary_low_freq_factor}, '
                    f'{attention.rotary_high_freq_factor}, {attention.rotary_original_max_len}.')


def validate_lora(attention) -> None:
  """LORA_* knobs that cannot work (read from the attention template, which the knobs fill)."""
  rank = getattr(attention, 'lora_rank', 0)
  if rank < 0:
    raise UserError(f'LORA_RANK must be 0 (off) or positive, got {rank}.')
  if not rank:
    return
  unknown = [t for t in attention.lora_targets if t not in lora.TARGETS]
  if unknown or not attention.lora_targets:
    raise UserError(f'LORA_TARGETS {list(attention.lora_targets)}: choose some of {", ".join(lora.TARGETS)}.')
  if attention.lora_alpha <= 0:
    raise UserError(f'LORA_ALPHA must be positive, got {attention.lora_alpha}.')
  if not 0 <= attention.lora_dropout < 1:
    raise UserError(f'LORA_DROPOUT must be in [0, 1), got {attention.lora_dropout}.')


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


def dtype_name(dtype) -> str:
  """'float32', 'bfloat16', ... for a dtype given by name or as a jnp type (None: float32)."""
  if dtype is None:
    return 'float32'
  return dtype if isinstance(dtype, str) else getattr(dtype, '__name__', str(dtype))


# ---- training FLOPs ------------------------------------------------------------------------------
#
# Model FLOPs per token of a training step (forward + backward = 3 x forward, 2 FLOPs per
# multiply-add), as MaxText counts them since mid-2025:
#
#   6 x (per layer: QKV projections (grouped-query K/V heads) + output projection + MLP
#        (two input matrices when gated) ; plus the output head, D x V for an LM)
#   + per layer 12 x H x E x S attention (Q.K^T and probs.V, forward and backward),
#     halved for causal masking.
#
# The token-embedding lookup, norms, softmax, biases and the optimizer are not counted.
# PaLM's figure (appendix B) counts attention in full, without the causal halving; it is
# reported beside ours (`palm_per_token`) and is what XLA counts for the einsum attention,
# which computes every logit. paxcli.perf.flops turns these into MFU.


@dataclasses.dataclass(frozen=True)
class ModelFlops:
  """Training FLOPs per token of a Transformer model."""
  matmul_params: float        # weights that multiply activations, per token (no embedding lookup, norms, biases)
  attention_per_token: float  # 12 x layers x H x E x S, halved for causal masking
  palm_attention_per_token: float  # the same without halving

  @property
  def per_token(self) -> float:
    return 6.0 * self.matmul_params + self.attention_per_token

  @property
  def palm_per_token(self) -> float:
    return 6.0 * self.matmul_params + self.palm_attention_per_token

  def per_step(self, tokens: int) -> float:
    return self.per_token * tokens


def stack_flops(layers, model_dims, heads, kv_heads, dims_per_head, hidden_dims, gated, seq_len: int,
                head_params_per_token: float = 0.0, causal: bool = True) -> Optional[ModelFlops]:
  """The FLOPs of a stack of causal attention + MLP blocks and an output head; None when a
  setting is unknown (None: a swapped-in layer without it)."""
  if any(v is None for v in (layers, model_dims, heads, kv_heads, dims_per_head, hidden_dims, gated)):
    return None
  d, e = model_dims, dims_per_head
  qkv = d * e * (heads + 2 * kv_heads)
  out = heads * e * d
  mlp = d * hidden_dims * (3 if gated else 2)
  attention = 12.0 * layers * heads * e * seq_len
  return ModelFlops(matmul_params=layers * (qkv + out + mlp) + head_params_per_token,
                    attention_per_token=attention / 2 if causal else attention,
                    palm_attention_per_token=attention)
