"""The decoder-only LM: TransformerLm (the network) and LanguageModel (network + loss + decoding),
lm_config (their fiddle config from flat knob settings) and flat_view (a model read back under them).
"""

from __future__ import annotations

import copy
import math
import types
from typing import Any, Optional

import fiddle as fdl
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from paxcli.errors import UserError
from paxcli.layers import cpu_isa, lora, pipeline
from paxcli.layers.fp8 import FP8_STATE
from paxcli.layers.activation_sharding import active_axis_size, constrain
from paxcli.layers.base import (AUX_LOSS, NON_TRAINABLE, RANDOM, SUMMARIES, BaseLayer, LayerTpl, build_arguments,
                                template_field)
from paxcli.layers.transformer import (Attention, Block, Mlp, Norm, dtype_of, fill_template, fuse_for_decoding,
                                       sinusoidal)
from paxcli.models import knobs, pattern
from paxcli.models.base import DecodingModel, dtype_name
from paxcli.models.flops import ModelFlops, stack_flops
from paxcli.models.losses import Head, head_lm_loss, token_scores
from paxcli.models.validation import validate_expert_axis, validate_family, validate_lm

REMAT_POLICIES = {
    'save_nothing': lambda: jax.checkpoint_policies.nothing_saveable,
    'save_everything': lambda: jax.checkpoint_policies.everything_saveable,
    'save_dot_only': lambda: jax.checkpoint_policies.checkpoint_dots,
    'save_dot_with_no_batch_dim': lambda: jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    'save_qkv_out_proj': lambda: jax.checkpoint_policies.save_only_these_names(
        'query_proj', 'key_proj', 'value_proj', 'out_proj'),
}


# The cache entry holding the output projection as [D, V] on a CPU: made once per cache (init_cache) from the tied
# embedding table (or an untied kernel decoding_params laid out [V, D]), and read when a step decodes one row.
# XLA:CPU's product of one row runs about 1.3x (AVX2) to 1.8x (AVX-512) faster against [D, V] than against
# [V, D], and of 2 rows or more about as much faster against [V, D] (benchmarks/decode_vs_hf.py), so steps of
# several rows read the [V, D] weights themselves. Every CPU cache holds the entry whatever its rows, so that a
# cache keeps one form when its rows change (the server's staging row and its rows share it). Accelerators read
# either layout at the same speed: no copy there.
LOGITS_TABLE = 'logits_table'
# The cache entries of a LongRoPE model's text, [B, S] each: its ids, their positions + 1 (0: an empty slot), and
# how many slots are written. A text that grows past ROTARY_ORIGINAL_MAX_LEN while decoding rotates with the long
# factors at every position, so the cache of every layer is computed again from it (LanguageModel._extend), as
# transformers' Phi-3 does in generate().
TEXT_IDS, TEXT_POSITIONS, TEXT_INDEX = 'text_ids', 'text_positions', 'text_index'


def longrope_threshold(lm) -> Optional[int]:
  """ROTARY_ORIGINAL_MAX_LEN of a TransformerLm (config or layer) whose attention rotates with LongRoPE's two sets
  of factors, where a decoded text turns over to the long set; None for any other model."""
  attention = getattr(getattr(lm, 'block_tpl', None), 'attention_tpl', None)
  if getattr(attention, 'rotary_scaling', 'none') != 'longrope' or not getattr(attention, 'rotary', False):
    return None
  return int(attention.rotary_original_max_len)


def logits_table_for_decoding() -> bool:
  return jax.default_backend() == 'cpu'


# decoding_params: the untied output projection's kernel transposed ([V, D]) on a CPU, under this name.
LOGITS_KERNEL_T = 'kernel_t'


class TransformerLm(BaseLayer):
  """Token embedding, optional learned or sinusoidal positions, a stack of blocks, final norm, logits.

  Options Pax's lm_cloud models use, off by default: token embeddings scaled by
  sqrt(model_dims) (`scale_embedding_sqrt_depth`), a bias on the output logits
  (`softmax_bias`), output logits soft-capped by tanh (`softmax_cap_logits`). Granite's, 1 (off) by
  default: token embeddings times `embedding_multiplier`, output logits divided by `logits_scaling`.

  The blocks come from `block_tpl` (attention, feed-forward and norm templates inside it)
  and the final norm from `final_norm_tpl`; the LM fills model_dims, dropout and the compute
  dtype into them. `__call__(ids, segment_ids=None, positions=None)` returns float32 logits.

  With a `layer_pattern` (paxcli.models.pattern) the stack is groups of kinds: each kind is
  block_tpl with its fields from `layer_kinds` ((kind, ((field, value), ...)), ...), and the
  scan runs over groups (a LayerGroup applies one block of every kind in order).
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
  embedding_multiplier: float = 1.0
  logits_scaling: float = 1.0
  # Pipeline parallelism (paxcli.layers.pipeline; needs scan_layers): the stacked layers run as
  # num_stages stages over num_microbatches microbatches (or microbatches of microbatch_size
  # rows; neither: as many as stages), pipeline_repeats times round (circular). 1 stage: off.
  num_stages: int = 1
  num_microbatches: Optional[int] = None
  microbatch_size: Optional[int] = None
  pipeline_repeats: int = 1
  # Layer kinds (paxcli.models.pattern): () is a uniform stack of block_tpl; layer_prefix, the kinds of the first
  # layers, before the repeating groups (never scanned: layer_<i> in either layout).
  layer_pattern: tuple = ()
  layer_kinds: tuple = ()
  layer_prefix: tuple = ()
  block_tpl: LayerTpl = template_field(Block)
  final_norm_tpl: LayerTpl = template_field(Norm)

  def _pipelined(self, x_BxLxD, segment_ids_BxL, positions_BxL, dtype, deterministic: bool):
    """The scanned stack's weights (`layers`, [L, ...] or [groups, ...]) run by paxcli.layers.pipeline."""
    schedule = pipeline_schedule(self, x_BxLxD.shape[0])
    module = self._stack_unit(dtype, deterministic, remat=False)
    variables = nn.meta.unbox(self.variables)
    others = sorted(c for c, tree in variables.items() if c != 'params' and 'layers' in tree)
    if others:
      raise UserError(f'Pipelined layers may hold trainable weights only; these blocks also have {others}. '
                      'Set NUM_STAGES=1.')
    rng = None if deterministic else self.make_rng('dropout')

    def layer_fn(params, x, extras, key):
      rngs = {} if key is None else {'dropout': key, RANDOM: jax.random.fold_in(key, 1)}
      (out, _), side = module.apply({'params': params}, x, extras.get('segment_ids'), extras['positions'], rngs=rngs,
                                    mutable=[SUMMARIES, AUX_LOSS])
      return out, side

    extras = {'positions': positions_BxL}
    if segment_ids_BxL is not None:
      extras['segment_ids'] = segment_ids_BxL
    policy = None if self.checkpoint_policy == 'none' else REMAT_POLICIES[self.checkpoint_policy]()
    x_BxLxD, side = pipeline.run(layer_fn, variables['params']['layers'], x_BxLxD, extras, schedule, policy, rng)
    for collection, tree in side.items():   # what the layers reported, laid out as the scanned stack's
      if tree and self.is_mutable_collection(collection):
        self.put_variable(collection, 'layers', tree)
    return x_BxLxD

  def _kind_tpls(self, dtype, deterministic: bool, prefix: bool = False) -> list:
    """One filled block template per position of a group (one for a uniform stack), or per layer of the prefix."""
    kinds = (pattern.prefix_kinds(self.layer_prefix, self.layer_kinds) if prefix
             else pattern.kinds_in_order(self.layer_pattern, self.layer_kinds))
    return [fill_template(pattern.kind_template(self.block_tpl, fields) if fields else self.block_tpl, dtype,
                          model_dims=self.model_dims, dropout_prob=self.dropout_prob, deterministic=deterministic)
            for _, fields in kinds]

  def _block_kwargs(self, dtype, deterministic: bool, remat: bool = True, prefix: bool = False) -> list[tuple[type, dict]]:
    """Per position of a group (or layer of the prefix), the block class (remat-wrapped per checkpoint_policy)
    and its arguments."""
    out = []
    for tpl in self._kind_tpls(dtype, deterministic, prefix):
      cls = fdl.get_callable(tpl)
      if remat and self.checkpoint_policy != 'none':
        cls = nn.remat(cls, policy=REMAT_POLICIES[self.checkpoint_policy](), prevent_cse=not self.scan_layers)
      out.append((cls, build_arguments(tpl, self)))
    return out

  def _stack_unit(self, dtype, deterministic: bool, remat: bool):
    """What the scan (and the pipeline) repeats, unbound: the block of a uniform stack, else a LayerGroup."""
    tpls = self._kind_tpls(dtype, deterministic)
    if len(tpls) == 1:
      block, kwargs = self._block_kwargs(dtype, deterministic, remat)[0]
      return block(**kwargs, parent=None)
    policy = self.checkpoint_policy if remat else 'none'
    return LayerGroup(tuple(tpls), policy, parent=None)

  @nn.compact
  def __call__(self, ids_BxL, segment_ids_BxL=None, positions_BxL=None, deterministic: bool = True,
               features: bool = False):
    dtype = dtype_of(self.fprop_dtype) if isinstance(self.fprop_dtype, str) else self.fprop_dtype
    pattern.check(self.num_layers, self.layer_pattern, self.layer_prefix)   # also where no validation ran
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
    if self.embedding_multiplier != 1.0:
      x_BxLxD = x_BxLxD * jnp.asarray(self.embedding_multiplier, dtype)
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
    if self.is_mutable_collection('cache') and longrope_threshold(self) is not None:
      self._remember_text(ids_BxL, segment_ids_BxL, positions_BxL)
    # The pipeline runs in train and eval steps on a mesh with stages; init, decoding (KV cache) and
    # plain `apply` (conversions, notebooks) run the stack unpipelined, on the same [L, ...] weights.
    if (self.scan_layers and not decoding and not self.is_initializing()
        and active_axis_size(pipeline.STAGE_AXIS) > 1 and pipeline_schedule(self, b)):
      x_BxLxD = self._pipelined(x_BxLxD, segment_ids_BxL, positions_BxL, dtype, deterministic)
    else:
      first = self._block_kwargs(dtype, deterministic, remat=not decoding, prefix=True)
      for i, (block, block_kwargs) in enumerate(first):   # LAYER_PREFIX: by their index in either layout
        x_BxLxD, _ = block(**block_kwargs, name=f'layer_{i}')(x_BxLxD, segment_ids_BxL, positions_BxL)
      if self.scan_layers:
        x_BxLxD = self._scanned(x_BxLxD, segment_ids_BxL, positions_BxL, dtype, deterministic, remat=not decoding)
      else:
        blocks = self._block_kwargs(dtype, deterministic, remat=not decoding)
        for i in range(len(first), self.num_layers):
          block, block_kwargs = blocks[(i - len(first)) % len(blocks)]
          x_BxLxD, _ = block(**block_kwargs, name=f'layer_{i}')(x_BxLxD, segment_ids_BxL, positions_BxL)

    final_norm = fill_template(self.final_norm_tpl, dtype)
    x_BxLxD = fdl.get_callable(final_norm)(**build_arguments(final_norm, self), name='final_norm')(x_BxLxD)
    head = self._head(embed, dtype, b)
    return (x_BxLxD, head) if features else head.logits(x_BxLxD)

  def _remember_text(self, ids_BxL, segment_ids_BxL, positions_BxL):
    """Decoding with LongRoPE: the text's ids and positions into the cache (TEXT_IDS), after what it holds. The
    first call (init_cache) only sizes the entries."""
    initialized = self.has_variable('cache', TEXT_IDS)
    boxed = lambda axes: nn.with_logical_partitioning(jnp.zeros, axes)
    shape = ids_BxL.shape
    ids = self.variable('cache', TEXT_IDS, boxed(('batch', 'length')), shape, jnp.int32)
    at = self.variable('cache', TEXT_POSITIONS, boxed(('batch', 'length')), shape, jnp.int32)
    index = self.variable('cache', TEXT_INDEX, boxed(()), [], jnp.int32)
    if not initialized or self.is_initializing():
      return
    real = jnp.ones(shape, bool) if segment_ids_BxL is None else segment_ids_BxL != 0
    ids.value = jax.lax.dynamic_update_slice(ids.value, ids_BxL.astype(jnp.int32), (0, index.value))
    at.value = jax.lax.dynamic_update_slice(at.value, jnp.where(real, positions_BxL + 1, 0).astype(jnp.int32),
                                            (0, index.value))
    index.value = index.value + shape[1]

  def _head(self, embed, dtype, rows: int) -> Head:
    """The output projection (paxcli.models.losses.Head): the tied embedding table, or the `logits`
    kernel [D, V] (SEPARATE_EMBEDDING; [V, D] as decoding_params lays it out on a CPU), with its bias
    (USE_SOFTMAX_BIAS), LOGITS_SCALING and the final soft cap; while a CPU decodes one row, the cache's
    LOGITS_TABLE."""
    if self.separate_embedding:
      w, bias, transposed = LogitsProjection(self.vocab_size, self.model_dims, self.softmax_bias, name='logits')()
      table_dtype = dtype
    else:
      w, transposed, bias = embed.embedding, True, None
      if self.softmax_bias:
        bias = self.param('logits_bias', nn.with_logical_partitioning(nn.initializers.zeros, ('vocab',)),
                          (self.vocab_size,))
      table_dtype = self._table_dtype(dtype)
    if self.is_mutable_collection('cache') and logits_table_for_decoding():
      table = self.variable('cache', LOGITS_TABLE, nn.with_logical_partitioning(jnp.zeros, ('embed', 'vocab')),
                            (self.model_dims, self.vocab_size), table_dtype)
      if rows == 1:
        w, transposed = table.value, False
    return Head(w, bias, tied=transposed, dtype=dtype, table_dtype=table_dtype, cap=self.softmax_cap_logits,
                divisor=self.logits_scaling)

  def _table_dtype(self, dtype):
    """The tied table's dtype in the logits' product. TIED_LOGITS_BFLOAT16: rounded to bfloat16 (MaxText's
    attend_on_embedding); else the compute dtype, as Embed.attend."""
    return jnp.bfloat16 if self.tied_logits_bfloat16 else dtype

  def decoding_logits_table(self):
    """The output projection [D, V] as LOGITS_TABLE holds it: the tied table transposed, or the untied
    kernel, in its product's dtype."""
    dtype = dtype_of(self.fprop_dtype) if isinstance(self.fprop_dtype, str) else self.fprop_dtype
    if self.separate_embedding:
      kernel = nn.meta.unbox(self.get_variable('params', 'logits'))
      return (kernel[LOGITS_KERNEL_T].T if LOGITS_KERNEL_T in kernel else kernel['kernel']).astype(dtype)
    table = nn.meta.unbox(self.get_variable('params', 'embedding')['embedding'])
    return table.astype(self._table_dtype(dtype)).T

  def _scanned(self, x_BxLxD, segment_ids_BxL, positions_BxL, dtype, deterministic: bool, remat: bool):
    """One nn.scan over the stack (`layers`): over layers of a uniform stack, over groups of a pattern."""
    blocks = self._block_kwargs(dtype, deterministic, remat)
    layers = self.num_layers - pattern.prefix_of(self)
    if len(blocks) == 1:
      unit, kwargs, length = blocks[0][0], blocks[0][1], layers
    else:
      policy = self.checkpoint_policy if remat else 'none'
      unit, kwargs = LayerGroup, {'block_tpls': tuple(self._kind_tpls(dtype, deterministic)), 'policy': policy}
      length = layers // len(blocks)
    stack = nn.scan(unit, variable_axes={'params': 0, NON_TRAINABLE: 0, SUMMARIES: 0, AUX_LOSS: 0, 'cache': 0,
                                         FP8_STATE: 0},
                    split_rngs={'params': True, 'dropout': True, RANDOM: True},
                    in_axes=(nn.broadcast, nn.broadcast), length=length,
                    metadata_params={nn.PARTITION_NAME: 'layers'})
    return stack(**kwargs, name='layers')(x_BxLxD, segment_ids_BxL, positions_BxL)[0]


class LogitsProjection(nn.Module):
  """The untied output projection's weights under the names nn.Dense gave them (kernel [D, V], bias [V]),
  returned as arrays for paxcli.models.losses.Head: (kernel, bias, False), or (kernel [V, D], bias, True)
  from params decoding_params laid out so (LOGITS_KERNEL_T)."""
  vocab_size: int
  model_dims: int
  use_bias: bool

  @nn.compact
  def __call__(self):
    bias = self.param('bias', nn.with_logical_partitioning(nn.initializers.zeros, ('vocab',)),
                      (self.vocab_size,)) if self.use_bias else None
    if self.has_variable('params', LOGITS_KERNEL_T):
      return self.get_variable('params', LOGITS_KERNEL_T), bias, True
    kernel = self.param('kernel', nn.with_logical_partitioning(
        nn.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal'), ('embed', 'vocab')),
        (self.model_dims, self.vocab_size))
    return kernel, bias, False


class LayerGroup(nn.Module):
  """One group of a patterned stack: a block of each kind in order (`block_<j>`), each rematerialised
  by `policy` ('none': not); returns (x, None) so that nn.scan can stack groups."""
  block_tpls: tuple
  policy: str = 'none'

  @nn.compact
  def __call__(self, x_BxLxD, segment_ids_BxL, positions_BxL):
    for j, tpl in enumerate(self.block_tpls):
      cls = fdl.get_callable(tpl)
      if self.policy != 'none':
        cls = nn.remat(cls, policy=REMAT_POLICIES[self.policy](), prevent_cse=False)
      x_BxLxD, _ = cls(**build_arguments(tpl, self), name=f'block_{j}')(x_BxLxD, segment_ids_BxL, positions_BxL)
    return x_BxLxD, None


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
  return pipeline.schedule_for(lm.num_layers, stages, repeats, batch, lm.num_microbatches, lm.microbatch_size,
                               group=pattern.period(getattr(lm, 'layer_pattern', ())))


def lm_config(**settings) -> fdl.Config:
  """The LanguageModel config with its templates filled from flat settings: the LM knobs under
  their flat names (paxcli.models.knobs.LM_KNOBS: num_heads, norm_type, ...), each missing one
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
  # LOSS_CHUNK_TOKENS: the loss makes the logits at most this many tokens (per device) at a time
  # (paxcli.models.losses.head_lm_loss); 0: whole. Off by default: the backward pass remakes each
  # chunk's logits, a third more of the output layer's FLOPs (docs/guides/performance-knobs.md).
  loss_chunk_tokens: int = 0
  # MODEL_FAMILY: the family the model is (paxcli.models.registry), read by conversions and describe; None:
  # placed by its function. It changes nothing the model computes.
  family: Optional[str] = None

  def setup(self):
    self.create_child('lm', self.lm_tpl)
    nn.share_scope(self, self.lm)

  def __call__(self, ids_BxL, segment_ids_BxL=None, positions_BxL=None, deterministic: bool = True,
               features: bool = False):
    return self.lm(ids_BxL, segment_ids_BxL, positions_BxL, deterministic=deterministic, features=features)

  def compute_predictions(self, input_batch: dict, deterministic: bool = True):
    """(final features [B, L, D], the output projection): the loss makes the logits from them."""
    return self(input_batch['ids'], input_batch.get('segment_ids'), input_batch.get('positions'),
                deterministic=deterministic, features=True)

  def compute_loss(self, predictions, input_batch: dict):
    x_BxLxD, head = predictions
    loss, sums = head_lm_loss(x_BxLxD, head, input_batch['labels'], input_batch['weights'], self.loss_chunk_tokens)
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
    validate_family(self.family)

  def validate_mesh(self, axis_sizes: dict) -> None:
    validate_expert_axis(self.lm_tpl, axis_sizes.get('expert', 1))

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
    total, head = None, s['model_dims'] * s['vocab_size']
    for k, layers in layer_settings(self):   # each kind's layers counted with its settings
      count = stack_flops(layers, s['model_dims'], k['num_heads'], k['num_kv_heads'], k['dims_per_head'],
                          k['hidden_dims'], k['use_gated_activation'], seq_len,
                          head_params_per_token=head if total is None else 0.0, latent=_latent_settings(k),
                          **_expert_settings(k))
      if count is None:
        return None
      total = count if total is None else total + count
    return total

  def active_parameters(self, total: int) -> Optional[int]:
    """Parameters a token's forward pass uses, of `total`: all but the experts it is not routed to
    (each mixture-of-experts layer uses EXPERTS_PER_TOKEN of NUM_EXPERTS); None when not countable."""
    s = knobs.read(self, knobs.LM_KNOBS)
    unused = 0
    for k, layers in layer_settings(self):
      if not k.get('num_experts'):
        continue
      if k['hidden_dims'] is None or s['model_dims'] is None:
        return None
      d, f, gated = s['model_dims'], k['hidden_dims'], k['use_gated_activation']
      per_expert = d * f * (3 if gated else 2) + ((f * (2 if gated else 1) + d) if k['use_bias'] else 0)
      unused += layers * (k['num_experts'] - k['experts_per_token']) * per_expert
    return total - unused

  # Decoding (see DecodingModel): the network's attention layers keep keys and values in the
  # flax collection 'cache' when it is mutable (paxcli.layers.transformer.Attention).
  def init_cache(self, params, batch: int, length: int):
    """Zeros shaped by one forward pass of [batch, length] ids: its first call only sizes the cache."""
    ids = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    shapes = jax.eval_shape(lambda p, x: self.apply({'params': p}, x, mutable=['cache'])[1]['cache'], params, ids)
    cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    if LOGITS_TABLE in cache:   # the transposed tied table, made here once for all of the cache's steps
      table = self.apply({'params': params}, method=lambda lm: lm.lm.decoding_logits_table())
      cache[LOGITS_TABLE] = cache[LOGITS_TABLE].replace_boxed(table)
    return cache

  def extend(self, params, cache, ids_BxL, positions_BxL, last_only: bool = False):
    """The logits of the L new tokens (of the last one only with `last_only`: a prefill needs no more), and the
    cache."""
    return self._extend(params, cache, ids_BxL, positions_BxL,
                        lambda x_BxLxD, head: head.logits(x_BxLxD[:, -1:] if last_only else x_BxLxD))

  def decoding_params(self, params, shardings):
    """On a CPU: every attention's query/key/value kernels joined into one product, and every gated MLP's
    wi_0/wi_1 (paxcli.layers.transformer.fuse_for_decoding; about a quarter faster on those products),
    [N, D] where the matrix kernels are AVX2's (their 16-column tiles read [D, N] with a stride that
    halves their speed at 16 rows), and an untied output projection as [V, D] (logits_table_for_decoding).
    fp8 products keep their own kernels (each has its scales). Accelerators decode the params as they are."""
    if jax.default_backend() != 'cpu':
      return params, shardings
    if all(k.get('fp8') in (None, 'none') for k, _ in layer_settings(self)):
      params, shardings = fuse_for_decoding(params, shardings, transposed=cpu_isa.vector_isa() == 'avx2')
    logits = params.get('logits')
    if getattr(self.lm_tpl, 'separate_embedding', False) and isinstance(logits, dict) and 'kernel' in logits:
      sharding = shardings['logits']['kernel']
      spec = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
      transposed = NamedSharding(sharding.mesh, PartitionSpec(spec[1], spec[0]))
      rest = {k: v for k, v in logits.items() if k != 'kernel'}
      params = {**params, 'logits': {**rest, LOGITS_KERNEL_T: jax.device_put(jnp.transpose(logits['kernel']),
                                                                             transposed)}}
      shardings = {**shardings, 'logits': {**{k: shardings['logits'][k] for k in rest}, LOGITS_KERNEL_T: transposed}}
    return params, shardings

  def extend_scores(self, params, cache, ids_BxL, positions_BxL, targets_BxL):
    """`extend`, returning per token the log-probability of `targets_BxL` and whether it is the argmax
    (paxcli.models.losses.token_scores: the logits made a chunk at a time) instead of the logits."""
    scores = lambda x_BxLxD, head: token_scores(x_BxLxD, head, targets_BxL, self.loss_chunk_tokens)
    (logp_BxL, greedy_BxL), cache = self._extend(params, cache, ids_BxL, positions_BxL, scores)
    return logp_BxL, greedy_BxL, cache

  def _extend(self, params, cache, ids_BxL, positions_BxL, finish):
    """The L new tokens through the network with the cache: (finish(their final features, the output
    projection), the cache). A LongRoPE model whose text a row's new tokens take past ROTARY_ORIGINAL_MAX_LEN
    computes its cache again from the text it holds (_again)."""
    def run(cache, ids_BxL, positions_BxL):
      segment_ids_BxL = (positions_BxL >= 0).astype(jnp.int32)  # segment 0: padding, never attended to
      (x_BxLxD, head), mutated = self.apply({'params': params, 'cache': cache}, ids_BxL, segment_ids_BxL,
                                            jnp.maximum(positions_BxL, 0), features=True, mutable=['cache'])
      return x_BxLxD, head, mutated['cache']

    def plain(cache):
      x_BxLxD, head, cache = run(cache, ids_BxL, positions_BxL)
      return finish(x_BxLxD, head), cache

    threshold = longrope_threshold(self.lm_tpl)
    if threshold is None or TEXT_IDS not in cache:
      return plain(cache)
    real_BxL = positions_BxL >= 0
    last_B = positions_BxL[:, -1]
    first_B = last_B - jnp.sum(real_BxL, axis=1) + 1
    # Rows whose cache holds tokens rotated with the short factors while these reach past the threshold.
    crossing_B = (last_B >= threshold) & (first_B > 0) & (first_B <= threshold)
    again = lambda cache: self._again(run, finish, cache, ids_BxL, positions_BxL)
    return jax.lax.cond(jnp.any(crossing_B), again, plain, cache)

  def _again(self, run, finish, cache, ids_BxL, positions_BxL):
    """The cache computed again from its text and the L new tokens (as transformers' Phi-3 does when a text grows
    past original_max_position_embeddings): the text, rotated so that every row's tokens end at the last slot,
    prefilled into an empty cache; then the full-length caches rotated back into their slots (_in_slots)."""
    n, slots, l = cache[TEXT_INDEX], cache[TEXT_IDS].shape[1], ids_BxL.shape[1]
    ids_BxS = jax.lax.dynamic_update_slice(cache[TEXT_IDS], ids_BxL.astype(jnp.int32), (0, n))
    at_BxS = jax.lax.dynamic_update_slice(cache[TEXT_POSITIONS], jnp.where(positions_BxL >= 0, positions_BxL + 1,
                                                                           0).astype(jnp.int32), (0, n))
    shift = slots - (n + l)
    empty = {k: v if k == LOGITS_TABLE else jax.tree.map(jnp.zeros_like, v) for k, v in cache.items()}
    x_BxSxD, head, cache = run(empty, jnp.roll(ids_BxS, shift, axis=1), jnp.roll(at_BxS, shift, axis=1) - 1)
    cache = _in_slots(cache, shift, n + l)
    cache.update({TEXT_IDS: ids_BxS, TEXT_POSITIONS: at_BxS, TEXT_INDEX: n + l})
    return finish(x_BxSxD[:, slots - l:], head), cache

  def with_fprop_dtype(self, dtype: str) -> 'LanguageModel':
    if dtype == self.lm_tpl.fprop_dtype:
      return self
    lm = copy.deepcopy(self.lm_tpl)
    lm.fprop_dtype = dtype
    return self.clone(lm_tpl=lm)


def _in_slots(cache: dict, shift, index) -> dict:
  """A cache prefilled with its text `shift` slots late (LanguageModel._again) with every full-length attention
  cache (paxcli.layers.transformer.Attention._decode_cache: slot = time) rotated back by `shift` slots and its
  index at `index`; rolling window caches (cached_position), whose slots their positions place, stay as they are."""
  out = {}
  for name, entry in cache.items():
    if isinstance(entry, dict) and 'cached_key' in entry and 'cached_position' not in entry:
      entry = dict(entry, cached_key=jnp.roll(entry['cached_key'], -shift, axis=-1),
                   cached_value=jnp.roll(entry['cached_value'], -shift, axis=-2),
                   cached_valid=jnp.roll(entry['cached_valid'], -shift, axis=-1),
                   cache_index=jnp.full_like(entry['cache_index'], index))
    elif isinstance(entry, dict):
      entry = _in_slots(entry, shift, index)
    out[name] = entry
  return out


def _expert_settings(settings: dict) -> dict:
  """stack_flops' expert arguments from one kind's flat settings (none for a dense feed-forward)."""
  if not settings.get('num_experts'):
    return {}
  return {'num_experts': settings['num_experts'], 'experts_per_token': settings['experts_per_token'],
          'shared_hidden_dims': settings['shared_hidden_dims'] or 0}


def _latent_settings(settings: dict) -> Optional[tuple]:
  """stack_flops' latent argument from one kind's flat settings (None for attention with key and value heads)."""
  if not settings.get('kv_lora_rank'):
    return None
  return (settings['q_lora_rank'] or 0, settings['kv_lora_rank'], settings['qk_nope_head_dim'],
          settings['qk_rope_head_dim'], settings['v_head_dim'])


def layer_settings(model) -> list[tuple[dict, int]]:
  """(flat settings (knobs.read), how many layers have them) for each layer of the prefix and each position of a
  group: the model's, with each kind's block fields; one entry for a uniform stack."""
  lm = model.lm_tpl
  kinds = pattern.kinds_in_order(getattr(lm, 'layer_pattern', ()), getattr(lm, 'layer_kinds', ()))
  first = pattern.prefix_kinds(getattr(lm, 'layer_prefix', ()), getattr(lm, 'layer_kinds', ()))
  base = knobs.read(model, knobs.LM_KNOBS)
  block = [k for k in knobs.LM_KNOBS if k.fields[0].startswith(knobs.BLOCK)]
  per_kind = (base['num_layers'] - len(first)) // len(kinds)

  def settings(fields):
    view = types.SimpleNamespace(lm_tpl=types.SimpleNamespace(block_tpl=pattern.kind_template(lm.block_tpl, fields)))
    return {**base, **knobs.read(view, block)} if fields else base
  return [(settings(fields), 1) for _, fields in first] + [(settings(fields), per_kind) for _, fields in kinds]


def flat_view(model):
  """The LM's settings under the flat names of `lm_config` (num_heads, norm_type, ...), with
  `apply` of the model: for code that reads an LM's shape (conversion, export). Each name reads
  the first field of its knob (paxcli.models.knobs.LM_KNOBS), so `use_bias` is the MLP's and
  `attention_use_bias` the attention's; a field a swapped-in layer lacks reads None."""
  return types.SimpleNamespace(apply=model.apply, model=model, **knobs.read(model, knobs.LM_KNOBS))
