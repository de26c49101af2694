"""The device mesh and the one table that maps logical axes onto it.

Mesh axes are Pax's: `replica` (pure data parallelism), `data` (data parallelism that
also shards weights, FSDP style) and `mdl` (tensor parallelism over heads, mlp, vocab).
A four-entry shape, Pax's pipeline form `[stage, replica, data, mdl]`, adds a leading
`stage` axis for pipeline parallelism (paxcli.layers.pipeline); three entries have none.
A five-entry shape `[stage, replica, data, expert, mdl]` adds an `expert` axis for expert
parallelism (paxcli.layers.moe): expert weights are sharded over it, and so is the batch
outside the experts, so that it is data parallelism for every other layer.
ICI_MESH_SHAPE gives the mesh within a slice; DCN_MESH_SHAPE, when set, is an outer
factor across slices (processes or groups of processes), so the global mesh is their
element-wise product (a shorter shape beside a longer one has stage 1 and expert 1).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paxcli.errors import UserError
from paxcli.layers.activation_sharding import spec_for

MESH_AXES = ('replica', 'data', 'mdl')
STAGE_AXIS = 'stage'
EXPERT_AXIS = 'expert'
PIPELINE_MESH_AXES = (STAGE_AXIS,) + MESH_AXES
EXPERT_MESH_AXES = (STAGE_AXIS, 'replica', 'data', EXPERT_AXIS, 'mdl')
AXES_BY_LENGTH = {3: MESH_AXES, 4: PIPELINE_MESH_AXES, 5: EXPERT_MESH_AXES}
BATCH_AXES = ('replica', 'data', EXPERT_AXIS)   # a mesh without an expert axis: (replica, data)

# logical axis -> mesh axes, tried in order. A mesh axis is used only if it divides
# the dimension and no earlier dimension of the same array took it.
DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    'batch': BATCH_AXES,
    'vocab': ('mdl',),
    'embed': ('data',),
    'mlp': ('mdl',),
    'heads': ('mdl',),
    'kv_heads': ('mdl',),
    'head_dim': (),
    'layers': (STAGE_AXIS,),   # the scanned layer stack: stages hold consecutive layers
    'exp': (EXPERT_AXIS,),     # the experts of a mixture-of-experts layer
  # A latent of multi-head latent attention (paxcli.layers.mla): its up-projections [latent, heads, head_dim]
  # are the attention's largest weights (2.2B of DeepSeek-V3's 11B), replicated 256 times on a v5p-512 without it.
  'latent': ('data',),
    'norm': (),
}


def mesh_shape(ici: Optional[Sequence[int]], dcn: Optional[Sequence[int]], num_devices: int) -> tuple[list[int], list[int]]:
  """Resolves ICI/DCN shapes (None: all devices on `data`; one -1: fill) or raises UserError.

  Both come back with the same number of entries: 3, 4 when either has a stage entry, 5 when
  either has an expert entry.
  """
  check_mesh_shapes(ici, dcn)
  dcn = list(dcn) if dcn is not None else None
  ici = list(ici) if ici is not None else [1, -1, 1]
  dcn = dcn if dcn is not None else [1] * len(ici)
  length = max(len(ici), len(dcn))   # a shorter shape has stage 1 (and expert 1) there
  ici, dcn = _lengthen(ici, length), _lengthen(dcn, length)
  if -1 in dcn:
    raise UserError('DCN_MESH_SHAPE may not contain -1.')
  known = math.prod(s for s in ici if s != -1) * math.prod(dcn)
  if -1 in ici:
    if num_devices % known:
      raise UserError(f'Cannot fill ICI_MESH_SHAPE {ici} x DCN_MESH_SHAPE {dcn}: {num_devices} '
                      f'devices are not a multiple of {known}.')
    ici[ici.index(-1)] = num_devices // known
  total = math.prod(ici) * math.prod(dcn)
  if total != num_devices:
    slices = math.prod(dcn)
    if slices == 1:
      hint = f'Set ICI_MESH_SHAPE so that the product of all entries is {num_devices}.'
    elif num_devices % slices == 0:
      hint = (f'ICI_MESH_SHAPE is the mesh inside one of the {slices} DCN slices, so its entries must '
              f'multiply to {num_devices // slices}.')
    else:
      hint = f'The product of DCN_MESH_SHAPE ({slices}) must divide the {num_devices} devices.'
    if jax.default_backend() == 'cpu' and jax.process_count() == 1:
      hint += (f' To try this mesh on CPU, run with {total} fake devices: '
               f'XLA_FLAGS=--xla_force_host_platform_device_count={total} JAX_PLATFORMS=cpu pax ...')
    raise UserError(f'The mesh ICI_MESH_SHAPE {ici} x DCN_MESH_SHAPE {dcn} needs {total} devices, '
                    f'but there are {num_devices} ({jax.default_backend()}). {hint}')
  return ici, dcn


def _lengthen(shape: list[int], length: int) -> list[int]:
  """A 3- or 4-entry shape written with `length` entries: stage 1 in front, expert 1 before mdl."""
  if len(shape) == 3 and length > 3:
    shape = [1] + shape
  if len(shape) == 4 and length == 5:
    shape = shape[:3] + [1] + shape[3:]
  return shape


def expert_axis_size(ici: Optional[Sequence[int]], dcn: Optional[Sequence[int]]) -> Optional[int]:
  """The expert axis of the mesh these shapes make: 1 without one, None while it is a -1 (devices fill it)."""
  entries = [list(s)[3] for s in (ici, dcn) if s is not None and len(s) == 5]
  return None if -1 in entries else math.prod(entries)


def check_mesh_shapes(ici: Optional[Sequence[int]], dcn: Optional[Sequence[int]]) -> None:
  """UserError for an ICI or DCN mesh shape no number of devices fills (checked without devices)."""
  for name, shape in (('ICI_MESH_SHAPE', ici), ('DCN_MESH_SHAPE', dcn)):
    if shape is None:
      continue
    shape = list(shape)
    if len(shape) not in AXES_BY_LENGTH:
      raise UserError(f'{name} must have 3 entries for the axes {MESH_AXES}, 4 for '
                      f'{PIPELINE_MESH_AXES} (pipeline parallelism) or 5 for {EXPERT_MESH_AXES} (expert '
                      f'parallelism), got {shape}.')
    if any(s == 0 or s < -1 for s in shape) or shape.count(-1) > 1:
      raise UserError(f'{name} {shape}: entries must be positive, with at most one -1 (fill).')
  if dcn is not None and -1 in list(dcn):
    raise UserError('DCN_MESH_SHAPE may not contain -1.')


def make_mesh(ici: Optional[Sequence[int]], dcn: Optional[Sequence[int]] = None, devices=None) -> Mesh:
  """Builds the global Mesh over all devices (of every process)."""
  devices = list(devices if devices is not None else jax.devices())
  ici, dcn = mesh_shape(ici, dcn, len(devices))
  if math.prod(dcn) == 1:
    try:
      array = mesh_utils.create_device_mesh(ici, devices=devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError):
      array = np.array(devices).reshape(ici)
  else:
    array = _hybrid_mesh(ici, dcn, devices)
  return Mesh(array, AXES_BY_LENGTH[len(ici)])


def _hybrid_mesh(ici: list[int], dcn: list[int], devices) -> np.ndarray:
  """ICI x DCN device array; each DCN coordinate gets one slice (granule) of devices.

  Granules, in order of preference: the slices devices report (multi-slice TPU);
  the processes, when there are as many as DCN_MESH_SHAPE asks for (one process per
  host, as on CPU and most GPU clusters, via `process_is_granule=True`); equal groups
  of whole processes, or equal parts of each process, otherwise.
  """
  num_slices = math.prod(dcn)
  slices = {getattr(d, 'slice_index', None) for d in devices}
  processes = sorted({d.process_index for d in devices})
  if None not in slices and len(slices) > 1:
    if len(slices) != num_slices:
      raise UserError(f'DCN_MESH_SHAPE {dcn} asks for {num_slices} slices, but the devices form '
                      f'{len(slices)} slices; make the product of DCN_MESH_SHAPE {len(slices)}.')
    return _checked_hybrid(mesh_utils, ici, dcn, devices, process_is_granule=False)
  if len(processes) > 1 and len(processes) == num_slices:
    return _checked_hybrid(mesh_utils, ici, dcn, devices, process_is_granule=True)
  if len(processes) % num_slices and num_slices % len(processes):
    raise UserError(f'DCN_MESH_SHAPE {dcn} has {num_slices} slices, which cannot be made of whole '
                    f'processes, or whole parts of one, with {len(processes)} processes; make the '
                    f'product of DCN_MESH_SHAPE divide {len(processes)} or a multiple of it.')
  # Devices ordered by process, then id: consecutive equal groups never split a
  # process across slices unless there are more slices than processes.
  ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
  per_slice = len(ordered) // num_slices
  granules = [np.array(ordered[i * per_slice:(i + 1) * per_slice]).reshape(ici) for i in range(num_slices)]
  # Place granule g at DCN coordinate g; the result is ICI x DCN element-wise.
  stacked = np.array(granules).reshape(tuple(dcn) + tuple(ici))
  k = len(ici)
  axes = [a for pair in zip(range(k), range(k, 2 * k)) for a in pair]
  return stacked.transpose(axes).reshape([d * i for d, i in zip(dcn, ici)])


def _checked_hybrid(mesh_utils, ici, dcn, devices, process_is_granule: bool) -> np.ndarray:
  try:
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices, process_is_granule=process_is_granule,
                                                allow_split_physical_axes=True)
  except (ValueError, AssertionError, NotImplementedError) as e:
    unit = 'process' if process_is_granule else 'slice'
    raise UserError(f'Cannot lay ICI_MESH_SHAPE {ici} over each {unit} for DCN_MESH_SHAPE {dcn}: '
                    f'{e}') from None


def _mesh_axes_for(names: Sequence[Optional[str]], shape: Sequence[int], mesh: Mesh,
                   rules: dict[str, tuple[str, ...]]) -> P:
  return spec_for(names, shape, dict(mesh.shape), rules)


def logical_to_sharding(logical_tree, abstract_tree, mesh: Mesh, rules: Optional[dict] = None):
  """NamedShardings for a tree of arrays from their logical axis names and shapes."""
  rules = {**DEFAULT_RULES, **(rules or {})}

  def one(names, leaf):
    names = tuple(names) if names is not None else (None,) * len(leaf.shape)
    return NamedSharding(mesh, _mesh_axes_for(names, leaf.shape, mesh, rules))

  return jax.tree.map(one, logical_tree, abstract_tree, is_leaf=lambda x: isinstance(x, (tuple, P)) or x is None)


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
  """The mesh axes the batch is sharded over: (replica, data), and expert where the mesh has it."""
  return tuple(a for a in BATCH_AXES if a in mesh.shape)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batch dimension over (replica, data[, expert]); the rest replicated."""
  return NamedSharding(mesh, P(batch_axes(mesh)))


def data_parallel_size(mesh: Mesh) -> int:
  return math.prod(mesh.shape[a] for a in batch_axes(mesh))


def num_stages(mesh: Mesh) -> int:
  """The size of the mesh's `stage` axis (1 for a three-axis mesh)."""
  return dict(mesh.shape).get(STAGE_AXIS, 1)


def describe_mesh(mesh: Mesh) -> str:
  return ' x '.join(f'{name}={size}' for name, size in mesh.shape.items())


def to_global(batch: dict, sharding, global_batch: int) -> dict:
  """Per-process numpy batch -> global jax arrays sharded over (replica, data)."""
  return {k: jax.make_array_from_process_local_data(sharding, v, (global_batch,) + v.shape[1:])
          for k, v in batch.items()}


def from_host(x: np.ndarray, sharding) -> jax.Array:
  """A global array of `x`, which every process holds whole, laid out by `sharding`."""
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def to_host(x) -> np.ndarray:
  """A replicated global array as numpy (works with several processes)."""
  return np.asarray(x.addressable_data(0))
