"""The job directory of `pax train`: checked before any work, locked while a trainer writes it.

The lock is `<job>/train.lock`, held with `flock` by one process of the run (process 0)
and holding the owner's host, pid, start time, boot id, PID namespace and command as JSON; the
trainer renews it (touches the file) every LEASE_S / 4 seconds. A second trainer is refused with
one line naming the owner. The kernel drops an flock when its process dies; if the file still
names a process (it was killed before removing the file, or flock is not honoured there):
  - where the owner's pid means a process of this machine's PID namespace, which paxcli knows
    only when the record's boot id and PID namespace are this process's own (a container with
    host networking has the host's name but its own pids), a dead pid (or a pid reused by
    another process) is a stale lock: it is taken over with a note, and a live one refuses;
  - anywhere else (another host, another PID namespace, another boot) a pid says nothing: the
    lock is live while it is renewed, and taken over LEASE_S seconds after its last renewal;
  - a record of an older paxcli (no boot id, no renewals) is judged by its pid on this host,
    and refused on another (remove the file if that run is gone).
The file is never followed as a link nor opened if it is not a regular file (a FIFO, a device).
`pax eval`, `pax decode` and `pax inspect-input` only read, and take no lock.

A job directory in a bucket has no flock and no pids of this host to ask: there the lock is an
object created only if absent (a precondition on its generation, ifGenerationMatch=0) holding
the same owner record and a lease: the trainer rewrites it every LEASE_S / 4 seconds, each
rewrite conditional on the generation it last wrote (`BucketLease`). A second trainer finds a
live lease and is refused; a lease not renewed for LEASE_S seconds (by the bucket's clock of the
last write), or one naming a dead process of this PID namespace (boot id and namespace recorded
and this process's own, as above), is taken over by a rewrite conditional on the generation it
read, so that of two successors only one wins. A trainer that finds its
lease taken over stops before its next save, never writing over its successor's checkpoints.

Evaluation (`pax eval`, `--follow`, the trainer's eval) writes one row per step into each
`*_metrics.jsonl`, in step order (`put_row`, an atomic rewrite under an flock on the job
directory itself; in a bucket a rewrite conditional on the generation read, storage.update);
`pax eval --follow` claims a step by an flock on the step's checkpoint directory (in a bucket, a
lease object eval_claims/<step>) while it evaluates it, so two followers never evaluate one step
twice (`StepClaim`).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import functools
import json
import os
import socket
import stat
import sys
import threading
import time
from typing import Callable, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from paxcli import files
from paxcli.errors import UserError, shorten
from paxcli.jobdir import layout, ledger, storage

LEASE_S = 60.0   # a bucket lock not renewed for this long belongs to a trainer that is gone


def check_writable(job_dir: str) -> None:
  """One clear line, before any work, for a job directory that cannot hold a run."""
  shown = shorten(job_dir, 200)
  if not storage.is_local(job_dir):
    storage.check_reachable(job_dir)
    probe = os.path.join(job_dir, f'.pax-write-test-{socket.gethostname()}-{os.getpid()}')
    try:
      storage.write_bytes(probe, b'ok')
    except storage.BucketError as e:
      raise UserError(f'Job directory {shown} cannot be written: {e} Choose another --job-log-dir.') from None
    storage.remove(probe)
    return
  try:
    os.fsencode(job_dir).decode('utf-8')
  except UnicodeDecodeError:
    raise UserError(f'Job directory {shorten(ascii(job_dir), 200)} has a name that is not UTF-8; '
                    'checkpoints cannot be written under it. Choose another --job-log-dir.') from None
  path = os.path.abspath(job_dir)
  probe = path
  while not os.path.lexists(probe):  # the nearest existing ancestor
    probe = os.path.dirname(probe)
  if not os.path.isdir(probe):
    what = 'is a file' if probe == path else f'is under {probe}, which is a file'
    raise UserError(f'Job directory {shown} {what}, not a directory. Choose another --job-log-dir.')
  try:
    files.probe_writable(path)
  except OSError as e:
    reason = {errno.EACCES: 'is not writable (permission denied)', errno.EROFS: 'is on a read-only file system',
              errno.ENOSPC: 'is on a full disk (no space left)'}.get(e.errno, f'cannot be written ({e.strerror})')
    raise UserError(f'Job directory {shown} {reason}. Choose another --job-log-dir.') from None


def _start_time(pid: int) -> Optional[str]:
  """The kernel's start time of `pid` (clock ticks since boot; Linux), to tell a reused pid apart."""
  return ledger.start_ticks(pid)


@functools.lru_cache(maxsize=1)
def boot_id() -> Optional[str]:
  """This machine's boot id (Linux: a random UUID made at each boot), or None where there is none."""
  try:
    with open('/proc/sys/kernel/random/boot_id', 'rb') as f:
      text = f.read(64).decode('ascii').strip()
  except (OSError, UnicodeDecodeError):
    return None
  return text or None


@functools.lru_cache(maxsize=1)
def pid_namespace() -> Optional[str]:
  """This process's PID namespace (the device and inode of /proc/self/ns/pid), or None where unknown."""
  try:
    st = os.stat('/proc/self/ns/pid')
  except OSError:
    return None
  return f'{st.st_dev}:{st.st_ino}'


def same_namespace(owner: dict) -> bool:
  """Whether the pid a lock record names is a pid of this process's PID namespace on this boot of this
  machine: only then does asking the kernel about it say anything (another container on this host, with
  host networking, has the same host name and its own pids)."""
  return (isinstance(owner.get('pid'), int) and owner.get('host') == socket.gethostname()
          and boot_id() is not None and owner.get('boot_id') == boot_id()
          and pid_namespace() is not None and owner.get('pid_ns') == pid_namespace())


def _legacy(owner: dict) -> bool:
  """A record of a paxcli before boot ids and renewals (0.1): judged by its pid on this host, as then."""
  return 'boot_id' not in owner and 'lease_s' not in owner


def lease_of(owner: dict) -> Optional[float]:
  """The seconds a record's holder has between renewals (None: it does not renew)."""
  lease = owner.get('lease_s')
  ok = isinstance(lease, (int, float)) and not isinstance(lease, bool) and 0 < lease < 86400
  return float(lease) if ok else None


def holder_live(owner: dict, renewed: Optional[float], local: bool) -> Optional[bool]:
  """Whether the holder a lock record names may still run: by its pid where that is provably a pid of
  this namespace (or the record is an older paxcli's on this host, locally); else by its renewals
  (`renewed`: the time of the last one, by the clock of the file system or bucket; live while less than
  its lease ago). None: paxcli cannot tell (a record that does not renew, of another host)."""
  pid = owner.get('pid')
  if same_namespace(owner) or (local and _legacy(owner) and isinstance(pid, int)
                               and owner.get('host') == socket.gethostname()):
    if pid != os.getpid() or local:
      return pid != os.getpid() and pid_alive(pid, owner.get('start_time'))
  lease = lease_of(owner)
  if lease is None or renewed is None:
    return None
  return time.time() < renewed + lease


def pid_alive(pid: int, start_time: Optional[str] = None) -> bool:
  """Whether process `pid` runs on this host (and is the one that started at `start_time`, if given)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  now = _start_time(pid)
  return not (start_time and now and now != start_time)


def _describe(owner: dict) -> str:
  return (f"host {owner.get('host', '?')}, pid {owner.get('pid', '?')}, started {owner.get('started', '?')}"
          + (f" ({shorten(owner['command'], 160)})" if owner.get('command') else ''))


class JobLock:
  """An exclusive lock on a job directory for one trainer (see the module docstring)."""

  def __init__(self, job_dir: str):
    self.path = layout.lock(os.path.abspath(job_dir))
    self._fd: Optional[int] = None
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None

  def _open(self) -> int:
    """The lock file, made if missing: never through a symlink, and only a regular file (a FIFO or a device
    put there would be written into, or waited on)."""
    try:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
      if e.errno != errno.ELOOP:
        raise
      raise UserError(f'{self.path} is a symlink; a job\'s lock file is a file of its own, never followed. Remove '
                      'it and run again.') from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
      os.close(fd)
      raise UserError(f'{self.path} is {files.kind_of(mode)}, not the lock file paxcli writes; remove it and run '
                      'again.')
    return fd

  def acquire(self, log: Callable[[str], None] = print) -> None:
    for _ in range(5):  # the file may be replaced between open and flock: retry on a new inode
      fd = self._open()
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        owner = _read(fd)
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EACCES):
          raise UserError(self._refusal(owner)) from None
        raise
      try:
        same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
      except FileNotFoundError:
        same = False
      if not same:
        os.close(fd)
        continue
      owner = _read(fd)
      if owner:
        self._check_stale(owner, fd, log)
      self._write_owner(fd)
      self._fd = fd
      self._thread = threading.Thread(target=self._renew, name='paxcli-lock', daemon=True)
      self._thread.start()
      return
    raise UserError(f'Could not lock {self.path}: another process keeps replacing it.')

  def _refusal(self, owner: dict, renewed: Optional[float] = None) -> str:
    when = ''
    if renewed is not None and not same_namespace(owner):
      when = (f', renewed {max(time.time() - renewed, 0):.0f} s ago from another host or PID namespace (a trainer '
              f'that is gone loses it {lease_of(owner):.0f} s after its last renewal)')
    return (f'Another trainer is using this job directory ({_describe(owner) if owner else "owner unknown"}); '
            f'it holds {self.path}{when}. Wait for it to finish, stop it, or use another --job-log-dir.')

  def _check_stale(self, owner: dict, fd: int, log) -> None:
    renewed = os.fstat(fd).st_mtime
    live = holder_live(owner, renewed, local=True)
    if live is None:
      os.close(fd)
      raise UserError(f'The job directory is locked by a trainer on another host ({_describe(owner)}). '
                      f'If that run is gone, remove {self.path} and run again.')
    if live:
      os.close(fd)  # flock not honoured here (some network file systems), but the owner runs (or renews)
      raise UserError(self._refusal(owner, renewed))
    log(f'Note: taking over the lock of a trainer that is gone ({_describe(owner)}); '
        'it was stopped without releasing the job directory.')

  def _write_owner(self, fd: int) -> None:
    data = (json.dumps({**_owner_record(), 'lease_s': LEASE_S}) + '\n').encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)

  def _renew(self) -> None:
    """Touches the file every LEASE_S / 4 s: where the flock may not reach (another host on a network file
    system) or the pid says nothing (another PID namespace), the renewals say the trainer runs."""
    while not self._stop.wait(LEASE_S / 4):
      with contextlib.suppress(OSError, TypeError):
        os.utime(self._fd)

  def release(self) -> None:
    if self._fd is None:
      return
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    try:
      os.remove(self.path)  # while still holding the flock: a waiter re-checks the inode
    except OSError:
      pass
    os.close(self._fd)
    self._fd = None

  def __enter__(self):
    self.acquire()
    return self

  def __exit__(self, *exc):
    self.release()
    return False


def _owner_record() -> dict:
  pid = os.getpid()
  return {'host': socket.gethostname(), 'pid': pid, 'start_time': _start_time(pid), 'boot_id': boot_id(),
          'pid_ns': pid_namespace(), 'started': datetime.datetime.now().astimezone().isoformat(timespec='seconds'),
          'command': ' '.join(['pax'] + sys.argv[1:])[:1000]}


def _parse_owner(data: Optional[bytes]) -> dict:
  try:
    owner = json.loads(data.decode('utf-8')) if data and data.strip() else {}
  except (UnicodeDecodeError, ValueError):
    return {}
  return owner if isinstance(owner, dict) else {}


def _lease_live(owner: dict, written: float) -> bool:
  """Whether the holder of a bucket lease last written at `written` (the bucket's clock) may still run."""
  live = holder_live({**owner, 'lease_s': LEASE_S} if lease_of(owner) is None else owner, written, local=False)
  return bool(live)


class BucketLease:
  """An object in a bucket held by one process while it works: created only if absent, renewed by a
  heartbeat thread with conditional rewrites, taken over when its holder is gone (module docstring)."""

  def __init__(self, path: str, lease_s: float = LEASE_S):
    self.path, self.lease_s = path, lease_s
    self.lost = False            # set by the heartbeat when another process took the lease over
    self.previous: Optional[dict] = None   # the gone holder this one took over from, if any
    self._generation = 0
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None

  def _record(self) -> bytes:
    return (json.dumps({**_owner_record(), 'lease_s': self.lease_s, 'renewed': time.time()}) + '\n').encode()

  def acquire(self) -> Optional[dict]:
    """None once held; else the live holder's record (nothing is written then)."""
    for _ in range(5):
      generation = storage.write_if_generation(self.path, self._record(), 0)
      if generation is None:
        data, seen, written = storage.read_versioned(self.path)
        if not seen:
          continue   # released meanwhile: create it again
        owner = _parse_owner(data)
        if _lease_live(owner, written):
          return owner
        generation = storage.write_if_generation(self.path, self._record(), seen)
        if generation is None:
          continue   # another successor was first: look again
        self.previous = owner
      self._generation = generation
      self._thread = threading.Thread(target=self._heartbeat, name='paxcli-lease', daemon=True)
      self._thread.start()
      return None
    raise UserError(f'Could not take {self.path}: other processes keep replacing it.')

  def _heartbeat(self) -> None:
    while not self._stop.wait(self.lease_s / 4):
      try:
        generation = storage.write_if_generation(self.path, self._record(), self._generation)
      except UserError:
        continue   # the bucket did not answer: try again (the lease runs LEASE_S)
      if generation is None:
        self.lost = True
        return
      self._generation = generation

  def release(self) -> None:
    """Stops renewing and deletes the lease; a bucket that does not answer keeps the object, whose lease then
    lapses LEASE_S after its last renewal (or at once for a successor that sees this process gone)."""
    if self._thread is None:
      return
    self._stop.set()
    self._thread.join(timeout=self.lease_s / 4)   # a renewal stuck on an unreachable bucket is not waited for
    self._thread = None
    if not self.lost:
      with contextlib.suppress(storage.BucketError):
        storage.delete_if_generation(self.path, self._generation)


class BucketJobLock:
  """The one-trainer lock of a job directory in a bucket: a BucketLease on `<job>/train.lock`."""

  def __init__(self, job_dir: str):
    self.path = layout.lock(job_dir)
    self._lease = BucketLease(self.path)

  def acquire(self, log: Callable[[str], None] = print) -> None:
    owner = self._lease.acquire()
    if owner is not None:
      raise UserError(f'Another trainer is using this job directory ({_describe(owner) if owner else "owner unknown"}); '
                      f'it holds {self.path}, a lease it renews every {LEASE_S / 4:.0f} s. Wait for it to finish, '
                      f'stop it, or use another --job-log-dir; a trainer that is gone loses it {LEASE_S:.0f} s after '
                      'its last renewal.')
    if self._lease.previous is not None:
      log(f'Note: taking over the lock of a trainer that is gone ({_describe(self._lease.previous)}); '
          'it was stopped without releasing the job directory.')

  def check(self) -> None:
    """Refuses to go on (before a save) once another trainer took the lease over."""
    if self._lease.lost:
      raise UserError(f'This trainer lost the lock of its job directory ({self.path}) to another trainer (its lease '
                      f'was not renewed for {LEASE_S:.0f} s: the bucket was unreachable or this process stalled); '
                      'stopping without saving, so as not to write over that trainer\'s checkpoints.')

  def release(self) -> None:
    self._lease.release()


def _read(fd: int) -> dict:
  try:
    data = os.pread(fd, 65536, 0)
    owner = json.loads(data.decode('utf-8')) if data.strip() else {}
    return owner if isinstance(owner, dict) else {}
  except (OSError, ValueError):
    return {}


def lock_run(job_dir: str, log: Callable[[str], None]) -> Optional[JobLock]:
  """Locks the job directory for a run: process 0 takes the lock, and every process learns the outcome.

  Returns the lock (process 0) or None. With several processes the others raise too when
  process 0 is refused, so the whole run stops with one line instead of hanging.
  """
  lock, refusal = None, ''
  if jax.process_index() == 0:
    try:
      lock = JobLock(job_dir) if storage.is_local(job_dir) else BucketJobLock(job_dir)
      lock.acquire(log)
    except UserError as e:
      lock, refusal = None, str(e)
  if jax.process_count() > 1:
    refused = bool(multihost_utils.broadcast_one_to_all(np.int32(1 if refusal else 0)))
    if refused and not refusal:
      raise UserError('Process 0 could not lock the job directory (another trainer uses it); see its message.')
  if refusal:
    raise UserError(refusal)
  return lock


def trim_jsonl(path: str, last_step: int) -> int:
  """Drops the rows of a `*_metrics.jsonl` file past `last_step` (steps a resume replays).

  Rewrites the file atomically (storage.update: under the flock put_row takes; in a bucket,
  conditional on the version read); returns how many rows were dropped.
  """
  dropped = 0

  def change(data: Optional[bytes]) -> Optional[bytes]:
    nonlocal dropped
    if data is None:
      return None
    kept, dropped = [], 0
    for line in _lines(data):
      try:
        step = json.loads(line).get('step')
      except (ValueError, AttributeError):
        step = None
      if isinstance(step, int) and step > last_step or not line.endswith('\n'):
        dropped += 1  # a replayed step, or a row cut short by a kill
      else:
        kept.append(line)
    return ''.join(kept).encode() if dropped else None

  storage.update(path, change, _dir_lock(path))
  return dropped


def _lines(data: bytes) -> list[str]:
  return data.decode('utf-8', errors='replace').splitlines(keepends=True)


def _dir_lock(path: str):
  """The flock put_row and its kin take on a local file's directory (None in a bucket: storage.update's
  precondition stands for it)."""
  return _flock(os.path.dirname(path)) if storage.is_local(path) else None


def trim_metrics(job_dir: str, last_step: int) -> int:
  """trim_jsonl on every `*_metrics.jsonl` of the job directory (train and eval)."""
  return sum(trim_jsonl(path, last_step) for path in layout.metrics_files(job_dir))


def read_owner(job_dir: str) -> Optional[dict]:
  """The trainer named in `<job>/train.lock` ({} if the file is empty or unreadable), or None if there is none.

  In a bucket the record also says whether its lease is still renewed ('lease_live').
  """
  if not storage.is_local(job_dir):
    data, generation, written = storage.read_versioned(layout.lock(job_dir))
    if not generation:
      return None
    owner = _parse_owner(data)
    return {**owner, 'lease_live': _lease_live(owner, written)}
  try:   # never through a link, never waiting on a FIFO
    fd = os.open(layout.lock(job_dir), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
  except FileNotFoundError:
    return None
  except OSError:
    return {}
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
      return {}
    owner = _read(fd)
    return {**owner, 'lease_live': holder_live(owner, st.st_mtime, local=True)} if owner else owner
  finally:
    os.close(fd)


def trainer_state(owner: Optional[dict]) -> str:
  """'absent' (no train.lock), 'dead' (it names a trainer that is gone: a dead process of this PID
  namespace, or a lease not renewed in time), else 'running'.

  A lock paxcli cannot judge (an older paxcli's of another host, or one being written) counts as running.
  """
  if owner is None:
    return 'absent'
  return 'dead' if owner.get('lease_live') is False else 'running'


@contextlib.contextmanager
def _flock(path: str, blocking: bool = True):
  """An flock on an existing file or directory; yields False if `blocking` is off and another holds it.

  A file system without flock (some network ones) yields True: the lock is then advisory only.
  """
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    yield True
    return
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
      got = True
    except OSError as e:
      if e.errno not in (errno.EAGAIN, errno.EACCES):
        got = True  # no flock here
      else:
        got = False
    yield got
  finally:
    os.close(fd)  # releases the flock


class StepClaim:
  """The claim of the follower that evaluates a step: an flock on the checkpoint's step directory (a
  bucket: a BucketLease on eval_claims/<step>, removed when done, taken over once its holder is gone).

  Another follower is refused it and looks again later (by then the step is in eval_done.jsonl).
  Locally no file is written for it, and the kernel drops it when its holder dies.
  """

  def __init__(self, step_dir: str):
    self.step_dir, self._fd, self._lease = step_dir, None, None

  def acquire(self) -> bool:
    if not storage.is_local(self.step_dir):
      lease = BucketLease(layout.eval_claim(layout.job_dir_of(self.step_dir), int(os.path.basename(self.step_dir))))
      if lease.acquire() is not None:
        return False
      self._lease = lease
      return True
    try:
      fd = os.open(self.step_dir, os.O_RDONLY)
    except OSError:
      return True  # deleted meanwhile: the restore says so
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno in (errno.EAGAIN, errno.EACCES):
        os.close(fd)
        return False
    self._fd = fd
    return True

  def release(self) -> None:
    if self._lease is not None:
      self._lease.release()
      self._lease = None
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None


def put_row(path: str, record: dict) -> None:
  """Writes `record` ({'step': N, ...}) as the one row of step N in the JSONL file `path`.

  Rows stay one per step (a newer one replaces an older) and in step order; a row cut short by
  a kill is dropped. The file is rewritten atomically (storage.update: under an flock on its
  directory; in a bucket, conditional on the version read), so writers on one job directory (the
  trainer, `pax eval`, followers) never lose each other's rows.
  """
  step = int(record['step'])
  storage.makedirs(os.path.dirname(path))

  def change(data: Optional[bytes]) -> bytes:
    rows: dict[int, str] = {}
    other: list[str] = []
    for line in _lines(data or b''):
      if not line.endswith('\n'):
        continue
      try:
        got = json.loads(line).get('step')
      except (ValueError, AttributeError):
        got = None
      if isinstance(got, int):
        rows[got] = line  # the later of two rows of one step wins
      else:
        other.append(line)
    rows[step] = json.dumps(record) + '\n'
    return ''.join(other + [rows[s] for s in sorted(rows)]).encode()

  storage.update(path, change, _dir_lock(path))


def append_line(path: str, line: str) -> None:
  """Appends one line to a file of the job directory, under the same flock (or precondition) as put_row."""
  with _dir_lock(path) or contextlib.nullcontext():
    storage.append_text(path, line.rstrip('\n') + '\n')
