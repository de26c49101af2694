"""The engine's model interfaces: BaseModel (what train, eval and init call) and DecodingModel.

A model is a BaseLayer with three methods the engine calls, and nothing else:

  compute_predictions(batch, deterministic) -> predictions
  compute_loss(predictions, batch) -> (loss, metrics)   metrics: name -> (value, weight)
  dummy_batch(batch_size, seq_len) -> numpy batch        shapes for init and eval padding

`fprop(batch, deterministic)` chains the first two; train, eval and init call it through
`model.apply(..., method='fprop')`. Eval reports each metric as the weighted mean over
the whole eval set (sum of value x weight over sum of weight, across batches and hosts),
then `eval_summary` may add derived numbers (the LM adds perplexity). A model may define
`validate()` (UserError for impossible settings) and `max_seq_len`, and `train_flops(seq_len)`
(its training FLOPs per token, a paxcli.models.flops.ModelFlops, or None where it cannot count
them), from which train and `pax bench mfu` report MFU; a model without that method reports MFU
as n/a.

A model that generates tokens (`pax decode`, decoding while training) is a DecodingModel:
it also defines `init_cache` and `extend`, the only calls the decoder makes.
"""

from __future__ import annotations

from typing import Any, Optional

import jax.numpy as jnp

from paxcli.layers.base import BaseLayer


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

  def validate_mesh(self, axis_sizes: dict) -> None:
    """Raises paxcli.errors.UserError for settings the mesh cannot hold; axis_sizes: mesh axis -> size
    (None: a size the devices will fill, not known yet)."""

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
        search moves rows along it); the others are shared by all rows. The cache for a
        longer length must be this one with zeros appended at the end of the axes that grow
        with it (the others the same): the decoder starts short and grows a cache so as a
        batch fills it (paxcli.loops.decode.decoder.grown). A leaf may hold what the steps
        read of the params in another form (the LM's transposed logits table on a CPU).
    extend(params, cache, ids_BxL, positions_BxL, last_only=False) -> (logits_BxLxV float32, cache)
        Feeds L more tokens per row into the next L cache slots, the same slots for every
        row. positions_BxL is each token's position in its own row, -1 for padding: a
        padding slot is never attended to, so that a left-padded prompt reads as alone.
        `last_only`: the logits of the last position alone ([B, 1, V]), all a prefill needs.
    decoding_params(params, shardings) -> (params, shardings)
        The params as decoding reads them, and their shardings: what `init_cache` and
        `extend` get from a decoder, made once per set of params (the LM joins products
        and lays out weights for the device's kernels there). By default the params as
        they are; checkpoints and weight maps never see the prepared ones.
    with_fprop_dtype(dtype) -> model
        This model computing its activations in `dtype` ('float32', 'bfloat16', ...).

  and the properties `vocab_size` and `max_seq_len` (room for prompt and new tokens).
  """

  def init_cache(self, params, batch: int, length: int):
    raise NotImplementedError(f'{type(self).__name__} must define init_cache().')

  def extend(self, params, cache, ids_BxL, positions_BxL, last_only: bool = False):
    raise NotImplementedError(f'{type(self).__name__} must define extend().')

  def decoding_params(self, params, shardings):
    return params, shardings

  def with_fprop_dtype(self, dtype: str) -> 'DecodingModel':
    raise NotImplementedError(f'{type(self).__name__} must define with_fprop_dtype().')


def dtype_name(dtype) -> str:
  """'float32', 'bfloat16', ... for a dtype given by name or as a jnp type (None: float32)."""
  if dtype is None:
    return 'float32'
  return dtype if isinstance(dtype, str) else getattr(dtype, '__name__', str(dtype))


