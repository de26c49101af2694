"""The fast tier of checkpoints: frequent saves of each process's own shards to its host's local disk.

    LOCAL_CHECKPOINT_DIR=/local/ckpt LOCAL_CHECKPOINT_EVERY=10      # knobs (task.train.local_checkpoint_*)

Beside the persistent checkpoints in the job directory (every SAVE_INTERVAL_STEPS, all of the state,
readable anywhere), every LOCAL_CHECKPOINT_EVERY steps each process writes the shards it holds (its
addressable arrays, replicated ones included) to `<local>/process_<i>-of-<n>/<step>/`, with the
step's meta and its input position, and keeps the newest LOCAL_CHECKPOINT_KEEP. A restart restores
the newest step complete on every process, in either tier, and says which (`choose`); a host whose
local tier is gone (a replaced machine) has no complete step there, so every process goes back to
the persistent tier together. A step whose files are damaged falls back the same way.

Why not orbax's own multi-tier (`orbax.checkpoint.experimental.emergency.CheckpointManager`), tried
off Google Cloud with jax.distributed on CPU (orbax 0.12.8): with one data-parallel replica (every
recipe's default mesh) it drops the local directory and saves only at the persistent interval; with
two or more it works after two undocumented set-up calls (orbax's distributed-to-device id maps, and
absl flags marked parsed), but the replica holding process 0 never writes a local copy, it takes one
item (the state: no meta, no per-process input position), and its persistent tier is its own layout,
which the job directory's readers (eval, decode, convert, resume, checksums) do not read. What it
does per process is kept: orbax's array handler with no primary host and no replica filter (each
process writes every shard it holds), in a plain orbax CheckpointManager per process.

Recovery from replica peers (a host with no local copy reading its shards from a host that holds
the same replica) is not built: it needs the state moved between hosts at restore (orbax's
emergency manager broadcasts a whole replica over the replica axis); such a host reads the
persistent tier instead, and so do the others, since every process must restore the same step.

The tier is local only, whatever the job directory is (a bucket, for one): it is written and read
with local file calls here, while the persistent tier goes through the job directory's functions.

The tier deletes (old steps, unfinished saves, all of it once a run finishes), so it is careful with
what it finds, which is received data like a job directory (`claim`): it works only in a
directory it made and marked (`paxcli-tier.json`, naming the job), or in an empty one it then marks;
the mark lists every step it writes there, before it writes it, and a directory holding anything
else is refused before training, so that it deletes only entries it wrote. It follows no symlink:
one at the tier's root (`process_0-of-1 -> ~/data`) or anywhere under it is refused. And a tier that
is, holds or lies inside the job directory (or its checkpoints) is refused before training: clearing
it would delete the job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import sys
from typing import Callable, Optional

import grain.checkpoint
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint._src.serialization import type_handler_registry, type_handlers

from paxcli import files
from paxcli.errors import UserError, shorten
from paxcli.jobdir import checkpoint as ckpt
from paxcli.jobdir import format as job_format
from paxcli.jobdir import layout
from paxcli.jobdir import restore as restore_lib
from paxcli.jobdir import storage
from paxcli.runtime import train_state

OWNER_MAX_BYTES = 1 << 16
MARK_MAX_BYTES = 1 << 20
MAX_MARKED_STEPS = 100_000   # steps a mark lists (those on disk and the one being written): far above any KEEP
_TMP_RE = re.compile(r'^(\d+)\.orbax-checkpoint-tmp')   # orbax's directory of a step being written


@dataclasses.dataclass(frozen=True)
class Settings:
  directory: str   # LOCAL_CHECKPOINT_DIR, absolute
  every: int       # LOCAL_CHECKPOINT_EVERY
  keep: int        # LOCAL_CHECKPOINT_KEEP

  @classmethod
  def of(cls, train_cfg) -> Optional[Settings]:
    directory = getattr(train_cfg, 'local_checkpoint_dir', None)
    every = getattr(train_cfg, 'local_checkpoint_interval_steps', 0)
    if not directory or not every:
      return None
    storage.check_scheme_typo(directory, 'LOCAL_CHECKPOINT_DIR')
    if not storage.is_local(directory):
      raise UserError(f'{_shown(directory)}: the fast checkpoint tier is a directory on each host\'s own disk '
                      '(the persistent checkpoints go to the job directory, a bucket included); give a local path.')
    return cls(os.path.realpath(os.path.expanduser(directory)), int(every),
               max(int(getattr(train_cfg, 'local_checkpoint_max_to_keep', 2)), 1))


def open_tier(settings: Settings, job_dir: str, job_id: str, setup, log: Callable[[str], None]) -> FastTier:
  """The fast tier of this process, after the checks every process agrees on: the directory is
  writable, belongs to this job, and has room for its saves (refused before training otherwise)."""
  refusal, mark = None, None
  try:
    check_placement(settings.directory, job_dir)
    _check_writable(settings.directory)
    mark = claim(settings.directory, job_dir, job_id)
  except UserError as e:
    refusal = str(e)
  _agree(refusal)
  _check_room(settings, _bytes_per_save(setup))
  return FastTier(settings, setup, log, mark)


def _shown(directory: str) -> str:
  return f'LOCAL_CHECKPOINT_DIR={shorten(directory, 160)}'


def check_placement(directory: str, job_dir: str) -> None:
  """Refuses a tier that is, holds or lies inside the job directory or its checkpoints (both resolved):
  the tier deletes what it wrote, and at the end of a run clears itself."""
  if not storage.is_local(job_dir):
    return   # a bucket job: the tier is on this machine's disk
  tier = os.path.realpath(directory)
  for place, what in ((job_dir, 'the job directory'), (layout.checkpoints(job_dir), "the job's checkpoints")):
    real = os.path.realpath(place)
    if not storage.inside(tier, real):
      continue
    how = 'is' if tier == real else 'lies inside' if os.path.commonpath([tier, real]) == real else 'holds'
    raise UserError(f'{_shown(directory)} {how} {what} ({shorten(real, 160)}); the fast tier writes, deletes '
                    'and at the end clears its directory, so it must be one of its own outside the job. Give '
                    'another LOCAL_CHECKPOINT_DIR.')


def _lstat(path: str) -> Optional[os.stat_result]:
  try:
    return os.lstat(path)
  except FileNotFoundError:
    return None


def _refuse_link(path: str, st: Optional[os.stat_result]) -> None:
  if st is not None and stat.S_ISLNK(st.st_mode):
    raise UserError(f'{shorten(path, 200)} in the fast checkpoint tier is a symlink (to '
                    f'{shorten(os.readlink(path), 160)}); the tier follows no link, it writes and deletes only '
                    'what it made. Remove the link, or give another LOCAL_CHECKPOINT_DIR.')


def _check_writable(directory: str) -> None:
  shown = f'LOCAL_CHECKPOINT_DIR={shorten(directory, 200)}'
  try:
    files.probe_writable(directory)
  except OSError as e:
    raise UserError(f'{shown} cannot hold the fast checkpoint tier on {socket.gethostname()}: {e.strerror}. '
                    'Give a writable local directory, or turn the tier off with LOCAL_CHECKPOINT_EVERY=0.') from None


def claim(directory: str, job_dir: str, job_id: str) -> dict:
  """Makes the tier this job's (owner.json at its root; this process's directory, made and marked), after
  checking both (nothing is written when either is refused: another job's tier, files the tier did not
  write). Returns this process's mark."""
  owner_path = layout.local_tier_owner(directory)
  mine = {'job_dir': job_dir, 'job_id': job_id}
  st = _lstat(owner_path)
  _refuse_link(owner_path, st)
  if st is not None:
    _check_mine(files.read_json(owner_path, 'the fast tier owner file', OWNER_MAX_BYTES), mine, directory)
  path = layout.local_tier_process(directory, jax.process_index(), jax.process_count())
  mark = checked_process_dir(path, mine, directory)
  if st is None:
    files.atomic_write(owner_path, json.dumps(mine).encode())
  if mark is None:   # made (or an empty one taken) and marked before anything is written in it
    made = not os.path.lexists(path)
    if made:
      os.mkdir(path)
    mark = {**mine, 'made': made, 'steps': []}
    files.atomic_write(layout.local_tier_marker(path), json.dumps(mark).encode())
  return mark


def _check_mine(owner, mine: dict, directory: str) -> None:
  """Refuses a record (owner.json, a mark) naming another job than `mine`, naming that job."""
  if isinstance(owner, dict) and {k: owner.get(k) for k in mine} == mine:
    return
  other = owner.get('job_dir') if isinstance(owner, dict) else None
  whose = (f'an earlier job of the same directory {shorten(mine["job_dir"], 160)} (since made anew)'
           if other == mine['job_dir'] else f'another job ({shorten(str(other), 160)})')
  raise UserError(f'{_shown(directory)} holds the fast checkpoint tier of {whose}; two jobs cannot share one. '
                  'Give this job its own directory, or remove that one if its job is gone.')


def checked_process_dir(path: str, mine: dict, directory: str) -> Optional[dict]:
  """The mark of this process's directory of the tier when it is this job's own (marked for it, holding
  only the steps its mark lists, no symlink anywhere); None when it is missing or empty (to be made and
  marked). UserError for anything else: nothing of it is ever deleted then."""
  mark_path = layout.local_tier_marker(path)
  st = _lstat(path)
  _refuse_link(path, st)
  if st is None or (stat.S_ISDIR(st.st_mode) and not os.listdir(path)):
    return None
  if not stat.S_ISDIR(st.st_mode):
    raise UserError(f'{shorten(path, 200)} is {files.kind_of(st.st_mode)}, where the fast checkpoint tier keeps '
                    'this process\'s saves; move it, or give another LOCAL_CHECKPOINT_DIR.')
  mark_st = _lstat(mark_path)
  _refuse_link(mark_path, mark_st)
  if mark_st is None:
    raise UserError(f'{shorten(path, 200)} holds files the fast checkpoint tier did not make (it has no '
                    f'{os.path.basename(mark_path)}); the tier deletes only what it wrote. Move them, or give '
                    'another LOCAL_CHECKPOINT_DIR.')
  mark = _read_mark(mark_path)
  _check_mine(mark, mine, directory)
  _check_entries(path, mark)
  return mark


def _read_mark(path: str) -> dict:
  mark = files.read_json(path, 'the fast tier mark', MARK_MAX_BYTES)
  steps = mark.get('steps') if isinstance(mark, dict) else None
  if not (isinstance(steps, list) and len(steps) <= MAX_MARKED_STEPS and isinstance(mark.get('made'), bool)
          and all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 1 << 62 for s in steps)):
    raise UserError(f'{shorten(path, 200)} is not a fast tier mark paxcli wrote (a JSON object with the job, '
                    '`made` and the list of `steps`); remove its directory if its job is gone.')
  return mark


def _marked(root: str, name: str) -> bool:
  """Whether `name` at the tier's root is a process's directory still holding the tier's mark."""
  try:
    return os.path.lexists(layout.local_tier_marker(layout.entry(root, name)))
  except UserError:   # a link out: no directory of the tier's
    return False


def _entry_step(name: str) -> Optional[int]:
  """The step of a name the tier writes in its directory: `<step>` or orbax's `<step>.orbax-checkpoint-tmp...`."""
  match = _TMP_RE.match(name)
  return int(name) if name.isdigit() else int(match.group(1)) if match else None


def _check_entries(path: str, mark: dict) -> None:
  """Every entry of a marked directory is a step its mark lists (a real directory, links nowhere under it)."""
  listed = set(mark['steps'])
  for name in sorted(os.listdir(path)):
    entry = os.path.join(path, name)
    if name == os.path.basename(layout.local_tier_marker(path)):
      continue
    st = os.lstat(entry)
    _refuse_link(entry, st)
    if name.startswith('.tmp-') and stat.S_ISREG(st.st_mode):
      continue   # a rewrite of the mark a kill cut short (files.atomic_write): left alone, never read
    if _entry_step(name) not in listed or not stat.S_ISDIR(st.st_mode):
      raise UserError(f'{shorten(entry, 200)} is in the fast checkpoint tier, but the tier did not write it '
                      '(its mark lists no such step); the tier deletes only what it wrote. Move it out, or give '
                      'another LOCAL_CHECKPOINT_DIR.')
    for parent, dirs, names in os.walk(entry):
      for inner in dirs + names:
        _refuse_link(os.path.join(parent, inner), os.lstat(os.path.join(parent, inner)))


def _agree(refusal: Optional[str]) -> None:
  """Every process refuses together (one alone would leave the others waiting in a collective)."""
  bad = gather_ints([int(refusal is not None)])[:, 0]
  if refusal is not None:
    raise UserError(refusal)
  if bad.any():
    raise UserError(f'Process {int(np.argmax(bad))} refused its fast checkpoint tier (LOCAL_CHECKPOINT_DIR); '
                    'its log says why.')


def _bytes_per_save(setup) -> int:
  """Bytes of one fast save of this process: every distinct shard of the saved state it holds."""
  total = 0
  for leaf in jax.tree.leaves(train_state.saved_state(setup, setup.abstract_state)):
    indices = {tuple((s.start, s.stop, s.step) for s in idx)
               for idx in leaf.sharding.addressable_devices_indices_map(leaf.shape).values()}
    shard = leaf.sharding.shard_shape(leaf.shape)
    total += len(indices) * int(np.prod(shard, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
  return total


def _check_room(settings: Settings, per_save: int) -> None:
  """Refuses, before training, a tier larger than the free space of its disk (summed over the processes
  of each host that share it): the kept saves, and one more being written."""
  st = os.statvfs(settings.directory)
  key = int(hashlib.sha256(f'{socket.gethostname()}:{os.stat(settings.directory).st_dev}'.encode())
            .hexdigest()[:12], 16)
  held = _held_bytes(layout.local_tier_process(settings.directory, jax.process_index(), jax.process_count()))
  rows = gather_ints([key, (settings.keep + 1) * per_save, held, st.f_bavail * st.f_frsize])
  for disk in np.unique(rows[:, 0]):
    share = rows[rows[:, 0] == disk]
    need, held, free = int(share[:, 1].sum()), int(share[:, 2].sum()), int(share[0, 3])
    if need - held > free:
      where = 'this host' if disk == key else 'another host'
      raise UserError(
          f'The fast checkpoint tier needs {_size(need)} on {where} ({settings.keep} kept + 1 being written, '
          f'{_size(int(share[0, 1]) // (settings.keep + 1))} each, for {len(share)} process(es)) under '
          f'LOCAL_CHECKPOINT_DIR={shorten(settings.directory, 160)}, but its disk has {_size(free + held)} free'
          + (f' (with the {_size(held)} its saves already hold)' if held else '') + '. Free space, keep fewer '
          '(LOCAL_CHECKPOINT_KEEP), or turn the tier off (LOCAL_CHECKPOINT_EVERY=0).')


def _held_bytes(directory: str) -> int:
  total = 0
  for root, _, names in os.walk(directory):
    for name in names:
      try:
        total += os.lstat(os.path.join(root, name)).st_size
      except OSError:
        pass
  return total


def _size(n: int) -> str:
  for unit, size in (('GiB', 1 << 30), ('MiB', 1 << 20), ('KiB', 1 << 10)):
    if n >= size:
      return f'{n / size:.1f} {unit}'
  return f'{n} bytes'


def signature(setup) -> str:
  """What a fast save is only readable under: the mesh, the devices in it, this process's place,
  and every array's sharding (a process holds only its shards: another layout would read holes)."""
  mesh = setup.mesh
  specs = [str(getattr(s, 'spec', s)) for s in jax.tree.leaves(setup.state_shardings)]
  text = repr((dict(mesh.shape), [d.id for d in mesh.devices.flat], jax.process_index(), jax.process_count(),
               sorted(d.id for d in jax.local_devices()), specs))
  return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass
class _Flag:
  value: bool


class _NoPrimaryHostNote:
  """Drops orbax's warning that it does not log object sizes without a primary host, at every fast save."""

  @staticmethod
  def filter(record) -> bool:
    return 'Global object size logging disabled' not in record.getMessage()


class FastTier:
  """One process's fast checkpoints: orbax, this process alone (no barrier with the others)."""

  def __init__(self, settings: Settings, setup, log: Callable[[str], None], mark: dict):
    self.settings = settings
    self.directory = layout.local_tier_process(settings.directory, jax.process_index(), jax.process_count())
    self._setup, self._log, self._mark = setup, log, mark
    self._signature = signature(setup)
    ckpt._quiet_no_space_logs()  # pylint: disable=protected-access
    ckpt._quiet_closed_loop_callbacks()  # pylint: disable=protected-access
    absl_logger = logging.getLogger('absl')
    if not any(isinstance(f, _NoPrimaryHostNote) for f in absl_logger.filters):
      absl_logger.addFilter(_NoPrimaryHostNote())
    self._discard_unfinished()
    me = jax.process_index()
    self._mp = ocp.options.MultiprocessingOptions(primary_host=None, active_processes={me},
                                                  barrier_sync_key_prefix=f'paxcli-fast-{me}')
    # The options orbax's emergency manager gives its local tier: each process makes its own directories,
    # deletes in the foreground (before the next save), and its tmp directories are ours to clean.
    options = ocp.CheckpointManagerOptions(max_to_keep=settings.keep, create=False, multiprocessing_options=self._mp,
                                           enable_async_checkpointing=True, save_root_metadata=False,
                                           enable_per_process_directory_creation=True, cleanup_tmp_directories=False,
                                           enable_background_delete=False)
    self._manager = ckpt.Manager(self.directory, options=options, item_handlers={
        layout.STATE: self._handler(), layout.META: ocp.JsonCheckpointHandler(multiprocessing_options=self._mp),
        layout.INPUT: grain.checkpoint.CheckpointHandler()})

  def _handler(self):
    # Each process writes every shard it holds (no primary host, no replica filter): orbax's emergency
    # local handler.
    registry = type_handler_registry.create_type_handler_registry(
        (jax.Array, type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False)))
    return ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, multiprocessing_options=self._mp,
                                       type_handler_registry=registry)

  def _written(self) -> dict[str, int]:
    """{name: step} of the entries of this process's directory that the tier wrote (its mark lists them)."""
    listed = set(self._mark['steps'])
    try:
      names = os.listdir(self.directory)
    except FileNotFoundError:
      return {}
    return {name: step for name in names if (step := _entry_step(name)) is not None and step in listed}

  def _remove(self, name: str) -> None:
    """Removes an entry the tier wrote; a link there (put after the start) is left alone, never followed."""
    path = os.path.join(self.directory, name)
    st = _lstat(path)
    if st is not None and stat.S_ISDIR(st.st_mode):
      shutil.rmtree(path, ignore_errors=True)   # removes links inside as links

  def _mark_steps(self, new: Optional[int] = None) -> None:
    """Rewrites the mark: the steps on disk, and `new` before it is written (so a kill mid-save leaves an
    entry the next start knows as the tier's own)."""
    steps = set(self._written().values()) | ({new} if new is not None else set())
    self._mark = {**self._mark, 'steps': sorted(steps)}
    files.atomic_write(layout.local_tier_marker(self.directory), json.dumps(self._mark).encode())

  def _discard_unfinished(self) -> None:
    """Saves a kill interrupted are removed: never restorable, and the tier is a copy of our own making."""
    for name in self._written():
      if _TMP_RE.match(name) or not ckpt._is_complete(os.path.join(self.directory, name)):  # pylint: disable=protected-access
        self._remove(name)
    self._mark_steps()

  def steps(self) -> list[int]:
    """This process's complete fast steps that were saved under this run's layout (signature)."""
    out = []
    for step in [s for s in ckpt.complete_steps(self.directory) if s in self._mark['steps']]:
      try:
        if self.meta(step).get('fast_tier') == self._signature:
          out.append(step)
      except restore_lib.DamagedCheckpoint:
        continue
    return out

  def meta(self, step: int) -> dict:
    """The meta of fast step `step` (one copy per process); a DamagedCheckpoint if it cannot be read."""
    try:
      meta = files.read_json(layout.meta_file(self.step_dir(step)), 'fast checkpoint metadata', 1 << 26)
    except UserError as e:
      raise restore_lib.DamagedCheckpoint(step, self.directory, str(e)) from None
    if not isinstance(meta, dict):
      raise restore_lib.DamagedCheckpoint(step, self.directory, 'its metadata is not a JSON object')
    return meta

  def step_dir(self, step: int) -> str:
    return layout.local_tier_step(self.directory, step)

  def save(self, step: int, state, meta: dict, input_state: Optional[bytes] = None) -> None:
    """Starts writing step `step` (after the previous write has finished). A write that fails (a full or
    broken local disk) is reported in one line and training goes on: the step is then not complete on
    this process, so no restart uses it, and the persistent tier is untouched."""
    items = dict(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(job_format.stamp({**meta, 'fast_tier': self._signature})))
    if input_state is not None:
      items[layout.INPUT] = grain.checkpoint.CheckpointSave(ckpt._Saved(input_state))  # pylint: disable=protected-access
    if self.wait():
      with self._failures(step):
        self._mark_steps(step)
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  def wait(self) -> bool:
    """Waits for the write in flight; False if it failed (said in one line)."""
    with self._failures(None) as ok:
      self._manager.wait_until_finished()
    return ok.value

  @contextlib.contextmanager
  def _failures(self, step: Optional[int]):
    ok = _Flag(True)
    try:
      yield ok
    except Exception as e:  # pylint: disable=broad-except
      ok.value = False
      what = f'step {step}' if step is not None else 'a fast checkpoint'
      print(f'WARNING: writing {what} to the fast tier ({self.directory}) failed on process '
            f'{jax.process_index()} ({type(e).__name__}: {shorten(str(e), 200)}); training goes on, and a '
            'restart uses the newest step complete on every process (or the persistent tier).',
            file=sys.stderr, flush=True)
      self._discard_unfinished()
      self._manager.reload()

  def discard_after(self, step: int) -> None:
    """Removes this process's fast steps after `step`, where a run goes on from: they would collide with
    the saves to come (each process alike, so the tiers stay consistent)."""
    for name, newer in self._written().items():
      if newer > step:
        self._remove(name)
    self._mark_steps()
    self._manager.reload()

  def restore(self, step: int, flat_now: dict) -> restore_lib.Restored:
    """The state of fast step `step`, verified by its checksums. Every process restores it together and
    they fail together: a DamagedCheckpoint (or the like) on every process if any could not read its part."""
    setup, meta, error = self._setup, None, None
    abstract = train_state.saved_state(setup, setup.abstract_state)
    try:
      meta = self.meta(step)
    except restore_lib.DamagedCheckpoint as e:
      error = e
    restore_lib._agree(error, step, self.directory, 'resume from')  # pylint: disable=protected-access
    # A newer format or other shapes are refused (UserError) alike on every process: their metas are the same.
    job_format.check(meta, f'The fast checkpoint at step {step} in {self.directory}')
    restore_lib.check_shapes(meta, train_state.shape_signature(abstract), flat_now, step, False, 'resume from')
    restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape,
                                                               dtype=a.dtype), abstract)
    try:
      state = dict(self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args))).state)
      saved_tree = restore_lib.state_metadata(layout.state_dir(self.step_dir(step)))
    except Exception as e:  # pylint: disable=broad-except
      error = restore_lib._failure(e, step, self.directory, 'its arrays', 'resume from')  # pylint: disable=protected-access
    restore_lib._agree(error, step, self.directory, 'resume from')  # pylint: disable=protected-access
    bad = restore_lib.checksum_mismatches(state, meta, saved_tree)
    if bad:
      raise restore_lib.DamagedCheckpoint(step, self.directory, bad)
    if train_state.has_frozen(setup):
      base = restore_lib.checked_base(setup, meta)
      state['params'] = train_state.join_params(state['params'], restore_lib.base_params(setup, base, frozen_only=True))
    return restore_lib.Restored(step, state, meta, params_only_checkpoint=False)

  def input_states(self, step: int) -> list[dict]:
    """The input positions every process saved at `step` (each holds its own: gathered here)."""
    from paxcli.inputs import grain_input  # Grain inputs only
    own = grain_input.read_states(layout.input_dir(self.step_dir(step)))
    return gather_json(own[0] if own else None)

  def clear(self) -> None:
    """After a finished run (its last persistent checkpoint saved): the tier is left empty, and the
    directory free for another job once every process of this host has cleared its part. Only what the
    tier wrote is removed: its steps, its mark, its directory if it made it (and nothing else is in it)."""
    self.close()
    for name in self._written():
      self._remove(name)
    with contextlib.suppress(FileNotFoundError):
      os.remove(layout.local_tier_marker(self.directory))
    if self._mark.get('made'):
      with contextlib.suppress(OSError):   # not empty: something else was put there; it stays
        os.rmdir(self.directory)
    root = self.settings.directory
    if not any(_marked(root, n) for n in os.listdir(root) if n.startswith('process_')):
      with contextlib.suppress(FileNotFoundError):
        os.remove(layout.local_tier_owner(root))

  def close(self) -> None:
    if self._manager is not None:
      self._manager.close()
      self._manager = None


def gather_ints(values: list[int]) -> np.ndarray:
  """[process, i]: every process's `values` (0 <= v < 2**62), a collective with several processes.

  Sent as 32-bit halves: JAX without x64 would cut 64-bit integers to 32 bits on the way.
  """
  mine = np.array(values, np.int64)
  if jax.process_count() == 1:
    return mine[None]
  halves = np.stack([mine >> 31, mine & 0x7FFFFFFF]).astype(np.int32)
  rows = np.asarray(multihost_utils.process_allgather(halves)).reshape(jax.process_count(), 2, len(values))
  return (rows[:, 0].astype(np.int64) << 31) | rows[:, 1].astype(np.int64)


def gather_json(value: Optional[dict]) -> list[dict]:
  """Every process's `value` (None: none), in process order: a collective with several processes."""
  data = np.frombuffer(json.dumps(value).encode(), np.uint8)
  if jax.process_count() == 1:
    return [value] if value is not None else []
  sizes = gather_ints([data.size])[:, 0]
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:data.size] = data
  rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
  values = [json.loads(bytes(row[:n]).decode()) for row, n in zip(rows, sizes)]
  return [v for v in values if v is not None]


def common_steps(steps: list[int], keep: int) -> list[int]:
  """The steps complete on every process (a collective with several processes), newest last."""
  newest = sorted(steps)[-(keep + 2):]
  rows = gather_ints([s + 1 for s in newest] + [0] * (keep + 2 - len(newest)))  # 0: no step
  sets = [set(int(s) - 1 for s in row if s > 0) for row in rows]
  return sorted(set.intersection(*sets))


def choose(tier: Optional[FastTier], persistent: Optional[int], log: Callable[[str], None]) -> list[int]:
  """The fast steps to try, newest first, that are newer than the persistent tier's latest, with a line
  saying why the fast tier is not used when one process lacks the step the others have."""
  if tier is None:
    return []
  mine = tier.steps()
  common = common_steps(mine, tier.settings.keep)
  newest_anywhere = _newest_anywhere(mine)
  if newest_anywhere is not None and (not common or common[-1] < newest_anywhere) and \
      newest_anywhere > (persistent or 0):
    have = f'step {common[-1]}' if common else 'no step'
    log(f'The fast checkpoint tier has step {newest_anywhere} on some processes but not all (a host whose '
        f'local copy is gone?); every process has {have} there.')
  return [s for s in reversed(common) if persistent is None or s > persistent]


def _newest_anywhere(mine: list[int]) -> Optional[int]:
  top = int(gather_ints([max(mine) + 1 if mine else 0]).max()) - 1
  return top if top >= 0 else None
