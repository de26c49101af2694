"""Pipeline parallelism over a scanned layer stack: Pax's LayerwiseShardablePipelined, circular.

The layers' weights are stored as the unpipelined scanned model stores them (`layers`,
stacked [L, ...], the L dimension sharded over the mesh's `stage` axis), so a checkpoint
does not depend on the stage count. A patterned stack (paxcli.models.pattern) is stacked by
groups ([L / P, ...]); its unit here is a group, and "layer" below reads "group". Inside the step they are viewed as
[stages, repeats, layers_per_stage, ...]: with R circular repeats, visit v = r * S + s
of a microbatch to stage s runs layers v * Lps ... (v + 1) * Lps - 1, so the model is the
same L layers in the same order whatever S and R are. (With R = 1 that view is local to
each stage; with R > 1 stage s holds non-contiguous layers, and XLA moves the weights
into place once per step, like an FSDP all-gather.)

Schedule (GPipe with circular repeats, as praxis and MaxText): the batch is split into M
microbatches; iteration t runs every stage at once (the stage body is vmapped over the
stage dimension, `spmd_axis_name='stage'`), stage s working on microbatch (t - s) mod M
of repeat (t - s) // M. Between iterations the stage outputs shift one stage to the
right (a roll of the stage-sharded array, which XLA lowers to a collective permute); the
first stage takes the next microbatch, or, from iteration M on, what the last stage
finished M - S + 1 iterations before (a ring of M - S slots holds it meanwhile). After
T = R * M + S - 1 iterations every microbatch has been through all L layers; each stage
idles S - 1 of them, the bubble (S - 1) / (R * M + S - 1). The iteration is rematerialised
(jax.checkpoint with the model's policy) and each layer inside it too, as the unpipelined
scan does, so backward keeps one activation per stage per iteration.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from paxcli.errors import UserError
from paxcli.layers.activation_sharding import constrain

STAGE_AXIS = 'stage'   # the mesh axis the stage dimension is sharded over


@dataclasses.dataclass(frozen=True)
class Schedule:
  """S stages, M microbatches, R circular repeats."""
  stages: int
  microbatches: int
  repeats: int = 1

  @property
  def iterations(self) -> int:
    return self.repeats * self.microbatches + self.stages - 1

  @property
  def bubble(self) -> float:
    """The fraction of iterations a stage idles: (S - 1) / (R * M + S - 1)."""
    return (self.stages - 1) / self.iterations

  def describe(self) -> str:
    return (f'{self.stages} stages x {self.microbatches} microbatches x {self.repeats} circular repeat(s): '
            f'bubble (S-1)/(R*M+S-1) = {self.stages - 1}/{self.iterations} = {self.bubble:.1%}')


def schedule_for(num_layers: int, stages: int, repeats: int, batch: int, num_microbatches: Optional[int],
                 microbatch_size: Optional[int], group: int = 1) -> Schedule:
  """The schedule for a global batch, or a one-line UserError for knobs that cannot work. `group`: layers
  per group of a patterned stack, which the pipeline runs as one unit (stages hold whole groups)."""
  if stages < 1 or repeats < 1:
    raise UserError(f'NUM_STAGES ({stages}) and PIPELINE_CIRCULAR_REPEAT ({repeats}) must be at least 1.')
  if group > 1 and (num_layers // group) % (stages * repeats):
    raise UserError(f'NUM_LAYERS {num_layers} is {num_layers // group} groups of {group} (LAYER_PATTERN), not '
                    f'divisible by NUM_STAGES x PIPELINE_CIRCULAR_REPEAT = {stages} x {repeats}: a stage would cut '
                    'a group; each stage must hold the same number of whole groups per repeat.')
  if num_layers % (stages * repeats):
    raise UserError(f'NUM_LAYERS {num_layers} is not divisible by NUM_STAGES x PIPELINE_CIRCULAR_REPEAT = '
                    f'{stages} x {repeats}; each stage must hold the same number of layers per repeat.')
  if num_microbatches and microbatch_size:
    raise UserError(f'Set NUM_MICROBATCHES ({num_microbatches}) or MICROBATCH_SIZE ({microbatch_size}), not both.')
  if microbatch_size:
    if microbatch_size < 1 or batch % microbatch_size:
      raise UserError(f'The global batch of {batch} is not divisible by MICROBATCH_SIZE {microbatch_size}.')
    num_microbatches = batch // microbatch_size
  num_microbatches = num_microbatches or stages
  if num_microbatches < 1 or batch % num_microbatches:
    raise UserError(f'The global batch of {batch} is not divisible by NUM_MICROBATCHES {num_microbatches}.')
  if repeats > 1 and num_microbatches < stages:
    raise UserError(f'A circular pipeline (PIPELINE_CIRCULAR_REPEAT {repeats}) needs at least as many microbatches '
                    f'as stages, got {num_microbatches} microbatches for {stages} stages.')
  return Schedule(stages, num_microbatches, repeats)


def stage_view(stacked, stages: int, repeats: int):
  """[L, ...] -> [S, R, L / (S * R), ...]: layer v * Lps + j at [v % S, v // S, j]."""
  per_stage = stacked.shape[0] // (stages * repeats)
  view = stacked.reshape((repeats, stages, per_stage) + stacked.shape[1:])
  return jnp.swapaxes(view, 0, 1)


def _to_microbatches(x, m: int):
  """[B, ...] -> [M, B / M, ...]; microbatch i is rows i, i + M, ... so each keeps the batch sharding."""
  return jnp.swapaxes(x.reshape((x.shape[0] // m, m) + x.shape[1:]), 0, 1)


def _from_microbatches(x):
  return jnp.swapaxes(x, 0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def _names(x, lead: tuple) -> tuple:
  """Logical names for `x`, a [lead..., batch, length, (embed)] activation."""
  rest = ('batch', 'length', 'embed')[:x.ndim - len(lead)]
  return lead + rest


def run(layer_fn: Callable, stacked_params, x_BxLxD, extras: dict, schedule: Schedule,
        policy=None, rng=None):
  """(x after the layer stack, side) by the pipeline; x equal to applying the L layers in order.

  layer_fn(params_of_one_layer, x_mbxLxD, extras_of_the_microbatch, rng_or_None) -> (x, side), side a
  tree of arrays a layer reports (its aux losses and summaries); the returned side is stacked [L, ...]
  like the scanned stack's, each layer's the mean over the microbatches.
  stacked_params: the [L, ...] stack; extras: [B, ...] arrays (segment ids, positions) each
  layer needs for its rows; policy: a jax.checkpoint policy (None: no rematerialisation).
  """
  s_count, m_count, r_count = schedule.stages, schedule.microbatches, schedule.repeats
  weights = jax.tree.map(lambda w: stage_view(w, s_count, r_count), stacked_params)
  inputs = _to_microbatches(x_BxLxD, m_count)
  inputs = constrain(inputs, _names(inputs, (None,)))
  extras_m = {k: _to_microbatches(v, m_count) for k, v in extras.items()}
  stage_ids = jnp.arange(s_count)
  ring_size = m_count - s_count if r_count > 1 else 0
  layer = jax.checkpoint(layer_fn, policy=policy, prevent_cse=False) if policy is not None else layer_fn

  def stage_fn(w_RxLps, repeat, x, stage_extras, key):
    w_Lps = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, repeat, 0, keepdims=False), w_RxLps)

    def one_layer(h, w_j):
      w, j = w_j
      return layer(w, h, stage_extras, None if key is None else jax.random.fold_in(key, j))

    per_stage = jax.tree.leaves(w_Lps)[0].shape[0]
    return jax.lax.scan(one_layer, x, (w_Lps, jnp.arange(per_stage)))   # (x, side [Lps, ...])

  stages = jax.vmap(stage_fn, spmd_axis_name=STAGE_AXIS)
  side_shapes = jax.eval_shape(lambda: stages(
      weights, jnp.zeros(s_count, jnp.int32), jnp.zeros((s_count,) + inputs.shape[1:], inputs.dtype),
      {k: jnp.zeros((s_count,) + v.shape[1:], v.dtype) for k, v in extras_m.items()},
      None if rng is None else jax.random.split(rng, s_count))[1])
  # Per stage and repeat, each layer's side summed over the microbatches that really ran there.
  side_acc = jax.tree.map(lambda a: jnp.zeros(a.shape[:1] + (r_count,) + a.shape[1:], a.dtype), side_shapes)

  def iteration(carry, t):
    state, ring, acc = carry
    rel = t - stage_ids                                  # how far each stage is into the schedule
    repeat = jnp.clip(rel // m_count, 0, r_count - 1)
    micro = rel % m_count
    stage_extras = {k: jnp.take(v, micro, axis=0) for k, v in extras_m.items()}
    stage_extras = {k: constrain(v, _names(v, (STAGE_AXIS,))) for k, v in stage_extras.items()}
    keys = None if rng is None else jax.vmap(lambda s: jax.random.fold_in(jax.random.fold_in(rng, t), s))(stage_ids)
    out, side = stages(weights, repeat, state, stage_extras, keys)
    out = constrain(out, _names(state, (STAGE_AXIS,)))
    ran_SxR = ((rel >= 0) & (rel < r_count * m_count))[:, None] & (repeat[:, None] == jnp.arange(r_count)[None])
    acc = jax.tree.map(lambda a, v: a + jnp.where(ran_SxR.reshape(ran_SxR.shape + (1,) * (v.ndim - 1)),
                                                  v[:, None], 0).astype(a.dtype), acc, side)
    last = out[s_count - 1]
    if ring_size:   # the last stage's output waits M - S iterations before going back to the first
      slot = t % ring_size
      feed = jax.lax.dynamic_index_in_dim(ring, slot, 0, keepdims=False)
      ring = jax.lax.dynamic_update_index_in_dim(ring, last, slot, 0)
    else:
      feed = last
    nxt = jnp.where(t + 1 < m_count, jax.lax.dynamic_index_in_dim(inputs, (t + 1) % m_count, 0, keepdims=False),
                    feed)
    shifted = jnp.roll(out, 1, axis=0)                   # stage s gets stage s - 1's output
    first = (stage_ids == 0).reshape((s_count,) + (1,) * (out.ndim - 1))
    state = constrain(jnp.where(first, nxt[None], shifted), _names(out, (STAGE_AXIS,)))
    return (state, ring, acc), last

  if policy is not None:
    iteration = jax.checkpoint(iteration, policy=policy, prevent_cse=False)
  micro_shape = inputs.shape[1:]
  state = jnp.zeros((s_count,) + micro_shape, inputs.dtype).at[0].set(inputs[0])
  state = constrain(state, _names(state, (STAGE_AXIS,)))
  ring = jnp.zeros((ring_size,) + micro_shape, inputs.dtype)
  (_, _, side_acc), lasts = jax.lax.scan(iteration, (state, ring, side_acc), jnp.arange(schedule.iterations))
  outputs = lasts[schedule.iterations - m_count:]      # the final repeat's last-stage outputs, in order
  # [S, R, Lps, ...] -> [L, ...]: layer (r * S + s) * Lps + j, as stage_view laid the weights out.
  side = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1).reshape((-1,) + a.shape[3:]) / m_count, side_acc)
  return _from_microbatches(constrain(outputs, _names(outputs, (None,)))), side
