"""Checkpoints with orbax: save every N steps and at the end, keep K, resume from the latest.

A checkpoint step holds two items: `state` (params, optimizer state, step; sharded
arrays written by every process) and `meta` (JSON written by process 0: the global
count of input batches consumed, and the config the run was started with); a run whose
train input keeps its own position (Grain) adds a third, `input`: one small JSON file per
process, written by Grain's orbax handler.

A save interrupted by a kill leaves either orbax's temporary directory (ignored by
orbax) or, on file systems without atomic rename, a step directory without orbax's
commit marker. Such an unfinished step is moved aside to `checkpoints_unfinished/`
(never deleted) and resume uses the last complete one. In a bucket orbax writes each step in
place and finalises it with its commit marker (commit_success.txt), written last: a step
without it is unfinished, and moving it aside copies its objects before deleting them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import re
import sys
import time
import warnings
from typing import Any, Optional

import grain.checkpoint
import jax
import orbax.checkpoint as ocp

from paxcli.errors import UserError, shorten
from paxcli.jobdir import format as job_format
from paxcli.jobdir import layout, storage
from paxcli.runtime import distributed

_MARKERS = layout.COMMIT_MARKERS
_TMP_RE = re.compile(r'^(\d+)\.orbax-checkpoint-tmp')
ITEMS = (layout.STATE, layout.META)


def _is_complete(step_dir: str) -> bool:
  names = set(storage.listdir(step_dir))
  if not all(m in names for m in _MARKERS) or not all(item in names for item in ITEMS):
    return False
  if not all(storage.isdir(layout.entry(step_dir, item)) for item in ITEMS):
    return False
  if not storage.is_local(step_dir):
    return True   # in a bucket the commit marker is what finalises a step (orbax writes it last)
  return ocp.step.is_path_finalized(step_dir) if hasattr(ocp.step, 'is_path_finalized') else True


def step_dirs(directory: str) -> dict[int, str]:
  """Step number -> directory for every numeric entry (complete or not)."""
  return {int(name): layout.entry(directory, name) for name in storage.listdir(directory) if name.isdigit()}


def complete_steps(directory: str) -> list[int]:
  return sorted(s for s, d in step_dirs(directory).items() if _is_complete(d))


def _unfinished(directory: str) -> list[tuple[int, str]]:
  """(step, path) of step directories without orbax's markers and of orbax's tmp directories."""
  found = [(step, path) for step, path in step_dirs(directory).items() if not _is_complete(path)]
  for name in storage.listdir(directory):
    match = _TMP_RE.match(name)
    if match:
      found.append((int(match.group(1)), layout.entry(directory, name)))
  return sorted(found)


KEEP_SET_ASIDE = 3  # unfinished saves kept in checkpoints_unfinished/ (the most recent ones)


def set_aside_unfinished(directory: str, log=print) -> list[int]:
  """Moves unfinished saves out of `directory` (process 0 only); returns their steps.

  They go to `checkpoints_unfinished/` beside it: orbax itself would delete its temporary
  directory when it saves that step again. A step below the newest complete one is the
  leftover of an interrupted deletion (orbax removing an old checkpoint to keep the last
  K), not of a save: the line says which. Only the KEEP_SET_ASIDE most recent set-asides
  are kept there; older ones are removed.
  """
  moved = []
  if jax.process_index() != 0:
    return moved
  aside = layout.unfinished(os.path.dirname(directory))
  complete = complete_steps(directory)
  for step, path in _unfinished(directory):
    storage.makedirs(aside)
    target = layout.entry(aside, f'{os.path.basename(path)}-{int(time.time())}')
    try:
      storage.move_tree(path, target)
    except FileNotFoundError:  # gone meanwhile (orbax finished or removed it)
      continue
    if complete and step < complete[-1]:
      log(f'Checkpoint at step {step} is the leftover of an interrupted deletion (an old checkpoint being '
          f'removed to keep the last ones); moved it to {target}. The newest complete one is step {complete[-1]}.')
    else:
      log(f'Checkpoint at step {step} is unfinished (a save was interrupted); moved it to {target} '
          'and resuming from the last complete one.')
    moved.append(step)
  if moved:
    _prune_set_aside(aside, log)
  return moved


def _prune_set_aside(aside: str, log) -> None:
  entries = sorted((storage.mtime(layout.entry(aside, n)), n) for n in storage.listdir(aside))
  for _, name in entries[:-KEEP_SET_ASIDE]:
    storage.rmtree(layout.entry(aside, name))
    log(f'Removed {layout.entry(aside, name)}: only the {KEEP_SET_ASIDE} most recent unfinished checkpoints '
        'are kept.')


class CheckpointWriteError(UserError):
  """A save that could not be written (the disk is full): one line, the complete ones intact."""
  exit_code = 1


class BucketSaveError(storage.BucketError):
  """A save to a bucket that could not be reached (or did not finish in time): one line naming the step
  and the bucket; the trainer stops, and the next start resumes from the last complete checkpoint."""


def _bound_bucket_saves() -> None:
  """A save to a bucket ends within storage.save_timeout(): tensorstore's retries of one request bounded
  (its context's `gcs_request_retries`, which orbax builds every context from) and orbax's gcsfs requests
  given up when they stall. orbax keeps those defaults in module dicts; where they moved, the async
  timeout (Checkpointer) still bounds the save."""
  storage.bound_gcsfs()
  _quiet_bucket_failure_logs()
  from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
  for name in ('_BASE_TS_CONTEXT', '_DEFAULT_OCDBT_TS_CONTEXT'):
    base = getattr(ts_utils, name, None)
    if isinstance(base, dict):
      base['gcs_request_retries'] = storage.request_retries()


def _no_space(e: BaseException) -> bool:
  """True when e (or what caused it) is 'no space left on device', however the layer below wraps it."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if getattr(e, 'errno', None) == errno.ENOSPC or 'No space left on device' in str(e):
      return True
    e = e.__cause__ or e.__context__
  return False


def _device_of(path: str) -> str:
  """The mount point holding `path` (and its source from /proc/mounts when known); a bucket's name."""
  if not storage.is_local(path):
    return storage.bucket_of(path)
  path = os.path.abspath(path)
  while not os.path.exists(path):
    path = os.path.dirname(path)
  mount = path
  while not os.path.ismount(mount):
    mount = os.path.dirname(mount)
  try:
    with open('/proc/mounts', encoding='utf-8', errors='replace') as f:
      sources = {fields[1]: fields[0] for fields in (line.split() for line in f) if len(fields) > 1}
  except OSError:
    sources = {}
  return f'{mount} ({sources[mount]})' if mount in sources else mount


class _NoSpaceFilter:
  """Drops orbax's own log records (with tracebacks) of a full disk: we report it in one line."""

  @staticmethod
  def filter(record) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not ('No space left on device' in record.getMessage() or (exc is not None and _no_space(exc)))


class _BucketFailureFilter:
  """Drops orbax's own log records (with tracebacks) of a save to a bucket that failed in its background
  threads: the failure reaches the trainer through wait_until_finished, which says it in one line."""
  _SAID = ('raised an exception', 'Handler Commit operations', 'Save Finalize thread', 'retry attempts failed',
           'Cannot connect to host', 'Timed out while waiting')

  @classmethod
  def filter(cls, record) -> bool:
    return not (record.levelno >= logging.ERROR and any(s in record.getMessage() for s in cls._SAID))


def _quiet_bucket_failure_logs() -> None:
  for logger in (logging.getLogger('absl'), logging.getLogger('asyncio')):
    if not any(isinstance(f, _BucketFailureFilter) for f in logger.filters):
      logger.addFilter(_BucketFailureFilter())
  for name in ('gcsfs', 'fsspec'):   # gcsfs logs each request it gives up on, with its traceback
    logging.getLogger(name).setLevel(logging.CRITICAL)
  # The coroutines of a save abandoned when its bucket stopped answering, collected at exit.
  warnings.filterwarnings('ignore', message=r"coroutine '.*' was never awaited", category=RuntimeWarning)


def _quiet_no_space_logs() -> None:
  # absl: orbax's own records; asyncio: "Task exception was never retrieved" for the other
  # writes of a save that one write's failure abandoned.
  for logger in (logging.getLogger('absl'), logging.getLogger('asyncio')):
    if not any(isinstance(f, _NoSpaceFilter) for f in logger.filters):
      logger.addFilter(_NoSpaceFilter())


CHUNK_BYTES = 64 << 20


def save_args(state) -> Any:
  """orbax SaveArgs storing each array in chunks of at most CHUNK_BYTES.

  orbax's default is one chunk per array (per shard): a reader then holds the encoded and the
  decoded copy of a whole array at once. Bounded chunks, and one layer per chunk for the
  stacked arrays of a scanned model (a `layers` level in the path), let `pax checkpoint
  convert` read one layer or one block of rows at a time.
  """

  def one(path, x):
    if not getattr(x, 'ndim', 0):
      return ocp.SaveArgs()
    stacked = x.ndim > 1 and any(getattr(k, 'key', None) == 'layers' for k in path)
    return ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES, shard_axes=(0,) if stacked else ())
  return jax.tree_util.tree_map_with_path(one, state)


def _quiet_closed_loop_callbacks() -> None:
  """Drops tensorstore's late 'Event loop is closed' callback errors (nothing else).

  When one write of a save fails (a full disk), orbax abandons the others and closes its event
  loop; their tensorstore callbacks then try to post into it and print tracebacks, after our
  one-line error. tensorstore reports them through sys.excepthook (PyErr_Print) or, from other
  call sites, sys.unraisablehook (PyErr_WriteUnraisable): both are filtered. Only that error,
  raised by asyncio's own closed-loop check, is dropped.
  """

  def closed_loop(kind, value, tb) -> bool:
    frames, t = [], tb
    while t is not None:
      frames.append(t.tb_frame.f_code.co_name)
      t = t.tb_next
    return kind is RuntimeError and str(value) == 'Event loop is closed' and frames[-1:] == ['_check_closed']

  previous = sys.excepthook
  if not getattr(previous, '_paxcli_closed_loop', False):
    def hook(kind, value, tb):
      if not closed_loop(kind, value, tb):
        previous(kind, value, tb)
    hook._paxcli_closed_loop = True
    sys.excepthook = hook
  previous_unraisable = sys.unraisablehook
  if not getattr(previous_unraisable, '_paxcli_closed_loop', False):
    def unraisable(info):
      if not closed_loop(info.exc_type, info.exc_value, info.exc_traceback):
        previous_unraisable(info)
    unraisable._paxcli_closed_loop = True
    sys.unraisablehook = unraisable


class _Saved:
  """What Grain's orbax handler saves: an object whose get_state() gives the JSON bytes."""

  def __init__(self, data: bytes):
    self._data = data

  def get_state(self) -> bytes:
    return self._data


class Manager(ocp.CheckpointManager):
  """orbax's CheckpointManager, without its own look at JAX's preemption sync point.

  The train loop asks JAX at every step, with the step it runs (loops/train.py, GracefulStop). orbax asks
  too, with the step of a save, and also from the thread that finishes an async save: a step or two late,
  which sets JAX's counter back while its protocol may be reading it, and could put the agreed step behind
  every process (then never reached). Nothing of orbax's that paxcli uses depends on the answer.
  """

  def reached_preemption(self, step: int) -> bool:
    del step
    return False


class Checkpointer:
  """orbax's CheckpointManager with our items, completeness rules and retention.

  Retention (max_to_keep=K): the K newest complete checkpoints, and also the one saved
  with the lowest loss (meta 'loss'), so that a run whose loss ran away keeps the last
  checkpoint from before it. Old ones are removed after the next save has finished.

  With several processes, which steps exist and which to delete are process 0's view, sent to
  the others (distributed.agreed), never each process's own listing: process 0 alone deletes,
  and a process listing the directory while it does sees fewer steps, skips a deletion the
  others make, and the processes then meet in different orbax barriers (`sync_global_devices
  name mismatch`, seen after a restart under `pax launch`). orbax's own list of steps is
  process 0's too (single_host_load_and_broadcast).
  """

  def __init__(self, directory: str, max_to_keep: int, async_save: bool = True, before_save=None):
    self.directory = directory if not storage.is_local(directory) else os.path.abspath(directory)
    self._before_save = before_save   # raises to stop a save (a trainer that lost its bucket lock)
    self.max_to_keep = max_to_keep or None
    bounded = {}
    if not storage.is_local(self.directory):
      _bound_bucket_saves()
      bounded = dict(async_options=ocp.AsyncOptions(timeout_secs=max(int(math.ceil(storage.save_timeout())), 1)))
    options = ocp.CheckpointManagerOptions(max_to_keep=None, create=True, enable_async_checkpointing=async_save,
                                           single_host_load_and_broadcast=True, **bounded)
    self._manager = Manager(self.directory, options=options, item_names=ITEMS + (layout.INPUT,))
    _quiet_no_space_logs()
    _quiet_closed_loop_callbacks()
    self._losses: dict[int, Optional[float]] = {}
    self._in_flight: Optional[int] = None
    self._failed = False
    self.latest_saved = self.latest_step()  # the newest step saved (complete, or being written)
    self._complete = self.latest_saved      # the newest step known complete (said when a save fails)

  def latest_step(self) -> Optional[int]:
    """The newest complete step, as process 0 sees it (a collective with several processes)."""
    steps = distributed.agreed(complete_steps(self.directory) if jax.process_index() == 0 else None)
    return steps[-1] if steps else None

  def save(self, step: int, state: Any, meta: dict, input_state: Optional[bytes] = None) -> None:
    """`input_state`: this process's train-input position (JSON bytes), for an input that keeps one."""
    self._finish()  # the previous save: its errors surface here
    if self._before_save is not None:
      self._before_save()
    with self._write_faults(step):
      self._rotate()
    self._in_flight = self.latest_saved = step
    meta = job_format.stamp(meta)
    items = dict(state=ocp.args.StandardSave(state, save_args=save_args(state)), meta=ocp.args.JsonSave(meta))
    if input_state is not None:
      items[layout.INPUT] = grain.checkpoint.CheckpointSave(_Saved(input_state))
    with self._write_faults(step):
      self._manager.save(step, args=ocp.args.Composite(**items), force=True)
    loss = meta.get('loss')
    self._losses[step] = float(loss) if isinstance(loss, (int, float)) and math.isfinite(loss) else None

  def _finish(self) -> None:
    with self._write_faults(self._in_flight):
      self._manager.wait_until_finished()
    if self._in_flight is not None:
      self._complete = self._in_flight
    self._in_flight = None

  @contextlib.contextmanager
  def _write_faults(self, step: Optional[int]):
    """A full disk while saving `step` becomes one line; the unfinished save is set aside. A bucket that
    cannot be reached (or does not finish the save in time) becomes one line too (BucketSaveError)."""
    try:
      yield
    except Exception as e:
      if not storage.is_local(self.directory) and not _no_space(e) and (
          isinstance(e, storage.BucketError) or not isinstance(e, UserError)):
        self._failed = True
        raise self._bucket_failure(step, e) from None
      if not _no_space(e):
        raise
      self._failed = True
      complete = complete_steps(self.directory)
      set_aside_unfinished(self.directory, log=lambda m: None)
      last = f'step {complete[-1]}' if complete else 'none (no checkpoint was completed)'
      raise CheckpointWriteError(
          f'No space left on {_device_of(self.directory)} while saving step {step}; the last complete '
          f'checkpoint is {last}. Free space and run the same command to resume.') from None

  @property
  def last_complete(self) -> Optional[int]:
    """The newest step known complete (without asking the storage: it may not answer)."""
    return self._complete

  def _bucket_failure(self, step: Optional[int], e: BaseException) -> BucketSaveError:
    """The one line of a save the bucket did not take: the step, the bucket, why, the step to resume from.
    Nothing is asked of the bucket here (it does not answer): the last complete step is the one known."""
    storage.give_up(self.directory)
    if isinstance(e, BucketSaveError):
      return e
    if isinstance(e, TimeoutError) or 'DEADLINE_EXCEEDED' in str(e):
      why = (f'it did not finish within {storage.save_timeout():.0f} s (PAXCLI_BUCKET_SAVE_TIMEOUT_S raises the '
             'bound)')
    elif isinstance(e, storage.BucketError):
      why = str(e).split(': ', 1)[-1].rstrip('.')
    else:
      text = str(e).strip().splitlines()[0] if str(e).strip() else ''
      why = f'the bucket did not take it ({type(e).__name__}: {shorten(text, 200)})'
    what = f'the checkpoint of step {step}' if step is not None else 'a checkpoint'
    last = f'step {self._complete}' if self._complete is not None else 'none yet'
    return BucketSaveError(f'Could not save {what} to {storage.bucket_of(self.directory)}: {why}. The last complete '
                           f'checkpoint is {last}; the trainer stops here. Run the same command to resume from it '
                           'once the bucket answers.')

  def _loss_of(self, step: int) -> Optional[float]:
    if step not in self._losses:
      try:
        loss = json.loads(storage.read_bytes(layout.meta_file(layout.entry(self.directory, str(step))))).get('loss')
      except (OSError, ValueError, AttributeError, UserError):  # unreadable: no loss known, so never the "best"
        loss = None
      self._losses[step] = float(loss) if isinstance(loss, (int, float)) and math.isfinite(loss) else None
    return self._losses[step]

  def _rotate(self) -> None:
    """Removes complete checkpoints beyond the newest max_to_keep, except the best by loss: the steps
    process 0 chose, on every process (a collective with several processes)."""
    if not self.max_to_keep:
      return
    for s in distributed.agreed(self._old_steps() if jax.process_index() == 0 else None):
      self._manager.delete(s)
      self._losses.pop(s, None)

  def _old_steps(self) -> list[int]:
    """The complete steps beyond the newest max_to_keep, less the best by loss, that orbax knows of (it
    refuses to delete others; a step it does not list is left in place)."""
    steps = complete_steps(self.directory)
    old = steps[:-self.max_to_keep]
    if not old:
      return []
    losses = {s: self._loss_of(s) for s in steps}
    known = [s for s in steps if losses[s] is not None]
    best = min(known, key=lambda s: (losses[s], -s)) if known else None
    listed = set(self._manager.all_steps())
    return [s for s in old if s != best and s in listed]

  def wait(self) -> None:
    self._finish()

  def reload(self) -> None:
    """Re-reads the steps on disk (after a damaged one was moved aside)."""
    self._manager.reload()
    self.latest_saved = self.latest_step()

  def close(self, rotate: bool = True) -> None:
    """Waits for the save in flight, removes old checkpoints (unless rotate=False: a run that failed leaves
    that to its next start) and closes orbax's manager."""
    if self._failed:  # a write already failed: do not raise (or wait on) it again while unwinding
      try:
        self._manager.close()
      except Exception:
        pass
      return
    self._finish()
    if rotate:
      with self._write_faults(None):
        self._rotate()
    self._manager.close()
