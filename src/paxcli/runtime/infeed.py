"""Infeed: which rows of the global batch each process reads, and the inputs that read them.

Pax's multihost infeed: every process feeds its block of the global batch array; the
block is read off the batch sharding itself, so a process's infeed host index is its
block's place in the global batch on any mesh. With PERCORE_BATCH_SIZE below 1 some
processes feed zero-weight padding instead of data.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

import fiddle as fdl
import jax

from paxcli.errors import UserError
from paxcli.inputs.base import padding_like
from paxcli.runtime import sharding


@dataclasses.dataclass(frozen=True)
class Infeed:
  """How the processes feed one global batch, Pax style.

  Every process feeds `process_rows` rows of the global array. Processes whose devices
  hold the same rows (model parallelism across processes) form one infeed host and read
  the same data. With PERCORE_BATCH_SIZE below 1 there can be fewer examples than rows:
  then only the first `num_hosts` infeed hosts read data and the others feed padding
  (weight 0), which leaves loss and gradients those of the real examples.
  """
  examples: int                 # real examples per step (PERCORE_BATCH_SIZE x devices)
  rows: int                     # rows of the global array (examples, or more with padding)
  process_rows: int             # rows each process feeds
  num_hosts: int                # num_infeed_hosts: hosts that read real data
  host_index: Optional[int]     # this process's infeed_host_index; None: it feeds padding
  num_processes: int

  @property
  def padding(self) -> bool:
    return self.host_index is None

  def describe(self) -> str:
    if self.rows == self.examples:
      return f'{self.examples}'
    return (f'{self.examples} (padded to {self.rows} rows: {self.num_hosts} of {self.num_processes} '
            'processes read data, the others feed zero-weight padding)')


# The most examples a step paxcli feeds: far above any real global batch (thousands of sequences), and what
# planning the infeed (a set of rows a process) and one host batch can afford. A knob beyond it is a typo.
MAX_GLOBAL_BATCH = 1 << 20


def global_batch_size(percore: float, num_devices: int) -> int:
  value = percore * num_devices
  if value > MAX_GLOBAL_BATCH:
    raise UserError(f'PERCORE_BATCH_SIZE {percore:g} x {num_devices} devices = {value:.6g} examples a step; paxcli '
                    f'feeds at most {MAX_GLOBAL_BATCH:,} a step. Lower PERCORE_BATCH_SIZE.')
  if value < 1 or abs(value - round(value)) > 1e-9:
    raise UserError(f'PERCORE_BATCH_SIZE {percore} x {num_devices} devices = {value:g} is not a whole '
                    'number of examples per step; choose a PERCORE_BATCH_SIZE that makes it one.')
  return int(round(value))


def plan_infeed(mesh, examples: int, process_index: Optional[int] = None) -> Infeed:
  """Which rows of the global batch each process feeds, from the batch sharding itself.

  Reading the rows off `devices_indices_map` (rather than assuming process i holds the
  i-th block) keeps the host index equal to the block's place in the global batch on
  any mesh, which is what makes per-global-batch inputs independent of process count.
  """
  dp = sharding.data_parallel_size(mesh)
  num_processes = len({d.process_index for d in mesh.devices.flat})
  rows = examples
  if examples % dp:
    if examples > dp or num_processes == 1:
      raise UserError(f'The global batch of {examples} examples does not divide over the {dp}-way data '
                      f'parallelism of the mesh ({sharding.describe_mesh(mesh)}); change '
                      'PERCORE_BATCH_SIZE or ICI_MESH_SHAPE.')
    rows = dp  # Pax: PERCORE_BATCH_SIZE < 1 on several processes; some hosts feed padding
  by_process: dict[int, set[int]] = {}
  for device, index in sharding.batch_sharding(mesh).devices_indices_map((rows,)).items():
    by_process.setdefault(device.process_index, set()).update(range(*index[0].indices(rows)))
  return infeed_from_rows(by_process, examples, rows, dp,
                          jax.process_index() if process_index is None else process_index)


def infeed_from_rows(by_process: dict[int, set[int]], examples: int, rows: int, dp: int,
                     process_index: int) -> Infeed:
  """Infeed from {process: global rows its devices hold}; raises UserError if uneven."""
  blocks = sorted({tuple(sorted(r)) for r in by_process.values()})
  sizes = {len(b) for b in blocks}
  flat = [r for b in blocks for r in b]
  if len(sizes) != 1 or len(flat) != len(set(flat)):
    raise UserError('The processes hold uneven or overlapping parts of the batch on this mesh '
                    f'({ {p: len(r) for p, r in sorted(by_process.items())} } rows by process); choose '
                    'ICI_MESH_SHAPE/DCN_MESH_SHAPE so that each process holds whole data-parallel shards.')
  block = sizes.pop()
  if examples % block:
    raise UserError(f'The global batch of {examples} examples does not divide over the {dp}-way data '
                    f'parallelism: with PERCORE_BATCH_SIZE below 1 some processes read data and the '
                    f'others feed padding, but each process holds {block} rows, so the global batch '
                    f'must be a multiple of {block}. Change PERCORE_BATCH_SIZE or the mesh.')
  num_hosts = examples // block
  rank = blocks.index(tuple(sorted(by_process[process_index])))
  return Infeed(examples=examples, rows=rows, process_rows=block, num_hosts=num_hosts,
                host_index=rank if rank < num_hosts else None, num_processes=len(by_process))


def input_layout(resolved, setup) -> dict:
  """What decides which data each step sees, beyond the global batch (stored in checkpoints)."""
  exp = resolved.experiment
  ici, dcn = sharding.mesh_shape(exp.ICI_MESH_SHAPE, exp.DCN_MESH_SHAPE, setup.mesh.size)
  return {'ici_mesh_shape': ici, 'dcn_mesh_shape': dcn,
          'percore_batch_size': exp.PERCORE_BATCH_SIZE, 'num_processes': jax.process_count(),
          'num_infeed_hosts': setup.infeed.num_hosts, 'process_batch': setup.process_batch}


def layout_change_note(saved: Optional[dict], now: dict) -> Optional[str]:
  """A note for a resume whose mesh, PERCORE_BATCH_SIZE or process count differ, else None."""
  if not saved:
    return None
  changed = [f'{k} {saved.get(k)} -> {now[k]}' for k in now if k in saved and saved[k] != now[k]]
  if not changed:
    return None
  return ('Note: the input layout changed since the checkpoint (' + ', '.join(changed) + '); the data '
          'order from here differs from an uninterrupted run, except for inputs defined per global '
          'batch (the synthetic input, the built-in corpus) while the global batch stays the same.')


def build_input(cfg, setup=None, process_batch: Optional[int] = None,
                num_hosts: Optional[int] = None, host_index: Optional[int] = None):
  """Builds an input from its fiddle config, filling batch size and host fields Pax-style.

  With a runtime Setup (engine.build) and no explicit process_batch, the fields come from
  its Infeed, and a padding host gets a PaddingInput.
  """
  cfg = copy.deepcopy(cfg)
  infeed = setup.infeed if setup is not None and process_batch is None else None
  if infeed is not None:
    defaults = (infeed.process_rows, infeed.num_hosts, infeed.host_index or 0)
  else:
    defaults = (process_batch if process_batch is not None else setup.process_batch,
                num_hosts if num_hosts is not None else jax.process_count(),
                host_index if host_index is not None else jax.process_index())
  for field, value in zip(('batch_size', 'num_infeed_hosts', 'infeed_host_index'), defaults):
    if getattr(cfg, field, None) is None:
      setattr(cfg, field, value)
  try:
    built = fdl.build(cfg)
  except (FileNotFoundError, ValueError, TypeError) as e:
    raise UserError(f'Building input {getattr(cfg, "name", "?")!r} failed: {e}') from e
  return PaddingInput(built) if infeed is not None and infeed.padding else built


class PaddingInput:
  """What a padding host feeds (PERCORE_BATCH_SIZE < 1): host 0's batches with every array zeroed.

  Reading host 0's input keeps shapes, dtypes and the end of a finite input in step with
  the hosts that read data; zero weights keep the padding out of loss and gradients.
  Everything else (skip, reset, fields) is the wrapped input's.
  """

  def __init__(self, inner):
    self.inner = inner

  def get_next(self):
    return padding_like(self.inner.get_next())

  def __getattr__(self, name):
    return getattr(self.inner, name)
