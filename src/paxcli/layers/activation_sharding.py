"""Activation sharding by logical axes: layers name their activations' axes, one table maps them.

Weights carry logical axis names (`embed`, `mlp`, `heads`, ...) that paxcli.runtime.sharding maps
onto the mesh. Activations need the same, with their own table: without constraints GSPMD
is free to gather the batch instead of the weights, and under FSDP (Pax's `[1, N, 1]`
mesh, weights and batch both on `data`) per-device temporaries then grow with N. Layers
call `constrain(x, ('batch', 'length', 'embed'))` at the natural points (embedding output,
attention q/k/v and output, MLP hidden, block outputs, logits); the train and eval steps
trace the model inside `rules(mesh, overrides)`, which turns those calls into
`jax.lax.with_sharding_constraint`. Outside that context (init, decode, conversions,
plain `model.apply` in a notebook) `constrain` returns its input unchanged.

The default table (as MaxText's `logical_axis_rules`, flax's `nn.with_logical_constraint`):
batch over (replica, data), heads/kv_heads/mlp/vocab over mdl, length over `context` (context
parallelism, paxcli.layers.context_parallel: a mesh without that axis leaves it whole), embed and
head_dim unsharded, a pipeline's stage dimension over `stage`. A mesh axis is used for a dimension only if it divides it and no earlier
dimension of the same array took it; otherwise that dimension stays unsharded. An
experiment overrides entries with `task.activation_sharding_rules` (see tasks.Task).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

ACTIVATION_RULES: dict[str, tuple[str, ...]] = {
    'batch': ('replica', 'data', 'expert'),   # expert: the batch outside the experts (paxcli.layers.moe)
    'length': ('context',),   # context parallelism (paxcli.layers.context_parallel)
    'embed': (),
    'heads': ('mdl',),
    'kv_heads': ('mdl',),
    'head_dim': (),
    'mlp': ('mdl',),
    'vocab': ('mdl',),
    'stage': ('stage',),      # the pipeline's stage dimension (paxcli.layers.pipeline)
    'exp': ('expert',),       # the experts of a mixture-of-experts layer (paxcli.layers.moe)
}

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar('paxcli_activation_sharding', default=None)


@dataclasses.dataclass(frozen=True)
class ContextParallel:
  """How a step splits each sequence over the `context` axis (paxcli.layers.context_parallel):
  attention by 'all_gather' of keys and values or by 'ring'; load_balance: each device holds
  chunks d and 2N-1-d of the 2N chunks of a sequence (the causal work evened out)."""
  strategy: str = 'all_gather'
  load_balance: bool = True


def spec_for(names: Sequence[Optional[str]], shape: Sequence[int], mesh_shape: dict,
             rules: dict[str, Sequence[str]]) -> P:
  """PartitionSpec for one array from its logical axis names, its shape and a rules table.

  Each logical name's mesh axes are tried in order; an axis is taken if the mesh has it
  (size > 1), it divides the dimension (with the axes already taken for it) and no earlier
  dimension took it. Shared by weights (paxcli.runtime.sharding) and activations.
  """
  used: set[str] = set()
  spec: list[Any] = []
  for name, dim in zip(names, shape):
    chosen, size = [], 1
    for axis in (rules.get(name, ()) if name else ()):
      axis_size = mesh_shape.get(axis, 1)
      if axis in used or axis_size == 1 or dim % (size * axis_size):
        continue
      chosen.append(axis)
      size *= axis_size
    used.update(chosen)
    spec.append(tuple(chosen) if len(chosen) > 1 else (chosen[0] if chosen else None))
  return P(*spec)


@contextlib.contextmanager
def rules(mesh, overrides: Optional[dict] = None, context: Optional[ContextParallel] = None):
  """Within this context (while a step is traced), `constrain` applies the rules on `mesh`, and
  sequences split over its context axis as `context` says."""
  table = {**ACTIVATION_RULES, **{k: tuple(v) if v else () for k, v in (overrides or {}).items()}}
  token = _ACTIVE.set((mesh, table, context or ContextParallel()))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def active() -> Optional[tuple[Any, dict]]:
  """(mesh, table) of the active `rules` context; None outside one."""
  active = _ACTIVE.get()
  return None if active is None else active[:2]


def context_parallel() -> ContextParallel:
  """The active context's ContextParallel settings (the defaults outside one)."""
  active = _ACTIVE.get()
  return ContextParallel() if active is None else active[2]


def active_axis_size(axis: str) -> int:
  """The size of `axis` on the mesh of the active `rules` context (1 outside one, or if it has none)."""
  active = _ACTIVE.get()
  return dict(active[0].shape).get(axis, 1) if active is not None else 1


def active_shards(names: Sequence[Optional[str]], shape: Sequence[int]) -> tuple[int, ...]:
  """Into how many pieces the active `rules` split each dimension of an array (all 1 outside a context)."""
  active = _ACTIVE.get()
  if active is None:
    return (1,) * len(shape)
  mesh_shape = dict(active[0].shape)
  spec = spec_for(names, shape, mesh_shape, active[1])
  sizes = []
  for entry in tuple(spec) + (None,) * (len(shape) - len(spec)):
    axes = entry if isinstance(entry, tuple) else ((entry,) if entry else ())
    sizes.append(math.prod(mesh_shape[a] for a in axes))
  return tuple(sizes)


def snapshot() -> Callable[[], contextlib.AbstractContextManager]:
  """A context manager factory that re-enters the rules active now: for code traced after the step's
  context has closed (a custom VJP's backward pass)."""
  active = _ACTIVE.get()

  @contextlib.contextmanager
  def enter():
    token = _ACTIVE.set(active)
    try:
      yield
    finally:
      _ACTIVE.reset(token)
  return enter


def constrain(x, names: Sequence[Optional[str]]):
  """`x` constrained to the sharding its logical axis `names` map to; unchanged outside `rules`."""
  active = _ACTIVE.get()
  if active is None:
    return x
  mesh, table = active[:2]
  if len(names) != x.ndim:
    raise ValueError(f'constrain: {len(names)} axis names {tuple(names)} for an array of shape {x.shape}.')
  spec = spec_for(names, x.shape, dict(mesh.shape), table)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
