"""Context parallelism: each sequence split over the mesh's `context` axis, through the whole model.

In a train or eval step the activations' `length` axis is sharded over `context` (the 'length' rule of
paxcli.layers.activation_sharding), so each of the N devices of the axis holds 1/N of every sequence of
its rows, from the embedding to the loss. Every layer but attention works token by token and needs
nothing more; attention, where a query needs keys other devices hold, is a shard_map over the mesh by
one of two strategies (CONTEXT_PARALLEL_STRATEGY):

  all_gather  every device gathers the keys and values of the whole sequence (an all-gather over
              `context`; their gradients go back by reduce-scatter) and attends its own queries to them
              with the flash kernel (paxcli.layers.attention_ops): keys and values of L tokens a layer,
              logits of one block at a time.
  ring        keys and values travel round the axis (collective-permute), one device's share a step:
              each step sends the next share on while the kernel works through the one that arrived, so
              the transfer hides behind the compute where the device overlaps them. A device holds its
              own share and one other at a time (L / N tokens' keys each). The backward pass goes round
              again, the keys' gradients travelling with the keys and arriving home after the last step.
              A step no query of any device can see (keys beyond every window) is never taken.

Load balancing (CONTEXT_LOAD_BALANCE, on by default, as MaxText's context_parallel_load_balance and
torchtitan's head-tail balancer): causal attention gives the last tokens the most keys, so contiguous
shares would give the last device N times the first's work. The sequence is cut into 2N chunks and device
d holds chunks d and 2N-1-d (one early, one late), which evens the work out. The batch is put in that order
once, at the model's input (`to_device_order`: ids, labels, weights, segment ids and positions alike), so
that every per-token layer and the loss, a sum over tokens, are unchanged; attention knows each token's
place in the text from the layout (`Layout.indices`), which the causal mask, sliding windows and the
kernel's block skipping read. Soft caps and segment ids (packed documents) are kept; a function of whole texts
(LongRoPE's choice of factors) reads them in the text's order (`in_text_order`). paxcli's Attention and latent
attention (paxcli.layers.mla) call `attention` here first; paxcli.models.validation refuses, in one line, layers
that could not follow the load-balanced order.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from paxcli.errors import UserError
from paxcli.layers import activation_sharding
from paxcli.layers.activation_sharding import spec_for
from paxcli.layers.attention_ops import (FlashSpec, effective_window, flash, flash_backward, flash_block, flash_delta,
                                         flash_forward, flash_output)

CONTEXT_AXIS = 'context'   # the mesh axis sequences are split over (paxcli.runtime.sharding)


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a sequence of `length` tokens lies over the N `devices` of the context axis: in 2N chunks, device d
  holding chunks d and 2N-1-d (`balanced`), or in N contiguous shares."""
  devices: int
  length: int
  balanced: bool

  @property
  def chunks(self) -> int:
    return 2 * self.devices if self.balanced else self.devices

  @property
  def chunk(self) -> int:
    """Tokens of one chunk: the runs of consecutive text indices the kernel's blocks must not straddle."""
    return self.length // self.chunks

  def device_chunks(self, d: int) -> tuple[int, ...]:
    return (d, self.chunks - 1 - d) if self.balanced else (d,)

  def order(self) -> np.ndarray:
    """[L] the text index of each place of a sequence in device order (device 0's tokens, then 1's, ...)."""
    c = self.chunk
    return np.concatenate([np.arange(i * c, (i + 1) * c) for d in range(self.devices) for i in self.device_chunks(d)])

  def indices(self, d):
    """[L / N] int32 the text indices of device d's tokens (d may be traced: the device's axis index)."""
    c = self.chunk
    run = jnp.arange(c, dtype=jnp.int32)
    if not self.balanced:
      return d * c + run
    return jnp.concatenate([d * c + run, (self.chunks - 1 - d) * c + run])

  def ring_offsets(self, window: int) -> tuple[int, ...]:
    """The offsets t (keys from device d - t) at which some query of some device sees some key: all of
    0 .. N-1 for causal attention, fewer when a window keeps every query within a few chunks."""
    c, n = self.chunk, self.devices
    def sees(d: int, s: int) -> bool:
      for qc in self.device_chunks(d):
        for kc in self.device_chunks(s):
          first_q, last_q, first_k, last_k = qc * c, qc * c + c - 1, kc * c, kc * c + c - 1
          if first_k <= last_q and (not window or last_k > first_q - window):
            return True
      return False
    return tuple(t for t in range(n) if any(sees(d, (d - t) % n) for d in range(n)))


def active_layout(length: int) -> Optional[Layout]:
  """The layout of a sequence of `length` tokens in the step being traced: None where no context axis splits
  it (outside a step, a mesh without the axis, or a length it does not divide)."""
  active = activation_sharding.active()
  if active is None:
    return None
  mesh, table = active
  devices = dict(mesh.shape).get(CONTEXT_AXIS, 1)
  if devices == 1 or spec_for(('length',), (length,), dict(mesh.shape), table)[0] != CONTEXT_AXIS:
    return None
  balanced = activation_sharding.context_parallel().load_balance and length % (2 * devices) == 0
  return Layout(devices, length, balanced)


def to_device_order(batch: dict, length_key: str = 'ids') -> dict:
  """The batch with every per-token array ([B, L, ...], L the length of `length_key`) in device order, and
  positions made explicit first (0 .. L-1 when the batch has none): what the step's model reads under load
  balancing. Unchanged where the step splits no sequence, or in contiguous shares (already in order). A batch of
  another form (preference pairs, GRPO rollouts: no `length_key`) is the model's own to order: refused in one
  line where the step would split its sequences."""
  if length_key not in batch:
    lengths = {v.shape[1] for v in batch.values() if getattr(v, 'ndim', 0) >= 2}
    if any(active_layout(n) is not None for n in lengths):
      raise UserError('context parallelism (a context mesh axis over 1) splits the language model\'s own batch '
                      f'(ids, labels, ...); this model reads {", ".join(sorted(batch))}: set the context axis to 1')
    return batch
  b, length = batch[length_key].shape[:2]
  layout = active_layout(length)
  if layout is None or not layout.balanced:
    return batch
  out = dict(batch)
  if out.get('positions') is None:
    out['positions'] = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None], (b, length))
  order = jnp.asarray(layout.order())
  per_token = lambda x: getattr(x, 'ndim', 0) >= 2 and x.shape[:2] == (b, length)
  return {k: jnp.take(v, order, axis=1) if per_token(v) else v for k, v in out.items()}


def in_text_order(fn, *arrays_BxL):
  """fn(*arrays_BxL) -> [B, L] for a function of whole texts (a run of one segment read in order, as LongRoPE's
  `beyond`): applied to the arrays in the text's order and its result put back in the devices' order. fn as it is
  where the step splits no sequence or in contiguous shares. An array may be None."""
  layout = active_layout(arrays_BxL[0].shape[1])
  if layout is None or not layout.balanced:
    return fn(*arrays_BxL)
  order = layout.order()
  to_text = lambda x: None if x is None else jnp.take(x, jnp.asarray(np.argsort(order)), axis=1)
  return jnp.take(fn(*map(to_text, arrays_BxL)), jnp.asarray(order), axis=1)


def attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, segment_ids_BxL=None, window: int = 0, logit_cap: float = 0.0,
              scale: Optional[float] = None):
  """Causal self-attention of a sequence split over the context axis ([B, L, H, E] sharded over it, in device
  order), by the active step's strategy; None where the step splits no sequence (the caller's kernels run)."""
  b, length, _, e = q_BxLxHxE.shape
  layout = active_layout(length)
  if layout is None:
    return None
  mesh, table = activation_sharding.active()
  shape = dict(mesh.shape)
  q_spec = spec_for(('batch', 'length', 'heads', 'head_dim'), q_BxLxHxE.shape, shape, table)
  kv_spec = spec_for(('batch', 'length', 'kv_heads', 'head_dim'), k_BxLxKxE.shape, shape, table)
  if q_spec[2] != kv_spec[2]:   # query heads sharded but not key heads (or not alike): group them whole
    q_spec, kv_spec = P(q_spec[0], q_spec[1], None, q_spec[3]), P(kv_spec[0], kv_spec[1], None, kv_spec[3])
  if segment_ids_BxL is None:
    segment_ids_BxL = jnp.zeros((b, length), jnp.int32)
  block = flash_block(layout.chunk)
  spec = FlashSpec(effective_window(window, length), float(logit_cap),
                   float(e ** -0.5 if scale is None else scale), block, block)
  strategy = activation_sharding.context_parallel().strategy
  body = functools.partial(_ring if strategy == 'ring' else _gathered, spec, layout)
  fn = jax.shard_map(body, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, P(q_spec[0], q_spec[1])),
                     out_specs=q_spec, check_vma=False)
  return fn(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, segment_ids_BxL)


def _gathered(spec: FlashSpec, layout: Layout, q, k, v, segment_ids):
  """One device's queries over every device's keys, gathered (in device order: text indices layout.order())."""
  gather = lambda x: jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)
  qi = layout.indices(jax.lax.axis_index(CONTEXT_AXIS))
  return flash(spec, q, gather(k), gather(v), qi, jnp.asarray(layout.order(), jnp.int32), segment_ids,
               gather(segment_ids))


def _shift(tree, by: int, n: int):
  """Each device's `tree` sent `by` devices on round the context axis: device d then holds d - by's."""
  if by % n == 0:
    return tree
  perm = [(i, (i + by) % n) for i in range(n)]
  return jax.tree.map(lambda x: jax.lax.ppermute(x, CONTEXT_AXIS, perm), tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring(spec: FlashSpec, layout: Layout, q, k, v, segment_ids):
  """One device's queries over every device's keys, which come round the ring (module docstring)."""
  return _ring_fwd(spec, layout, q, k, v, segment_ids)[0]


def _ring_fwd(spec, layout, q, k, v, segment_ids):
  n = layout.devices
  d = jax.lax.axis_index(CONTEXT_AXIS)
  qi = layout.indices(d)
  offsets = layout.ring_offsets(spec.window)

  def step(state, kv, t):
    k_t, v_t, seg_t = kv
    return flash_forward(spec, q, k_t, v_t, qi, layout.indices((d - t) % n), segment_ids, seg_t, state)

  kv, state = (k, v, segment_ids), None
  if offsets == tuple(range(n)):   # every step: one shift at a time, scanned (one copy of the kernel)
    def body(carry, t):
      kv, state = carry
      following = _shift(kv, 1, n)   # sent on while this step's keys are worked through
      return (following, step(state, kv, t)), None
    following = _shift(kv, 1, n)
    state = step(None, kv, 0)
    (kv, state), _ = jax.lax.scan(body, (following, state), jnp.arange(1, n - 1))
    state = step(state, kv, n - 1)
  else:
    for j, t in enumerate(offsets):
      following = _shift(kv, offsets[j + 1] - t, n) if j + 1 < len(offsets) else None
      state = step(state, kv, t)
      kv = following
  out, lse = flash_output(state, q)
  return out, (q, k, v, segment_ids, out, lse)


def _ring_bwd(spec, layout, residuals, d_out):
  q, k, v, segment_ids, out, lse = residuals
  n = layout.devices
  d = jax.lax.axis_index(CONTEXT_AXIS)
  qi = layout.indices(d)
  delta = flash_delta(out, d_out, k.shape[2])
  offsets = layout.ring_offsets(spec.window)

  def step(dq, d_kv, kv, t):
    k_t, v_t, seg_t = kv
    dq_t, dk_t, dv_t = flash_backward(spec, q, k_t, v_t, qi, layout.indices((d - t) % n), segment_ids, seg_t, lse,
                                      delta, d_out)
    return dq + dq_t, (d_kv[0] + dk_t, d_kv[1] + dv_t)

  kv = (k, v, segment_ids)
  dq = jnp.zeros(q.shape, jnp.float32)
  d_kv = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  if offsets == tuple(range(n)):
    def body(carry, t):
      kv, d_kv, dq = carry
      following = _shift(kv, 1, n)
      dq, d_kv = step(dq, d_kv, kv, t)
      return (following, _shift(d_kv, 1, n), dq), None
    (kv, d_kv, dq), _ = jax.lax.scan(body, (kv, d_kv, dq), jnp.arange(n - 1))
    dq, d_kv = step(dq, d_kv, kv, n - 1)
    d_kv = _shift(d_kv, 1, n)   # the keys' gradients, from device d - (N - 1), go home
  else:
    for j, t in enumerate(offsets):
      following = _shift(kv, offsets[j + 1] - t, n) if j + 1 < len(offsets) else None
      dq, d_kv = step(dq, d_kv, kv, t)
      d_kv = _shift(d_kv, (offsets[j + 1] - t) if j + 1 < len(offsets) else n - t, n)
      kv = following
  return dq.astype(q.dtype), d_kv[0].astype(k.dtype), d_kv[1].astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)
