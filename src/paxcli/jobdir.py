"""The job directory of `pax train`: checked before any work, locked while a trainer writes it.

The lock is `<job>/train.lock`, held with `flock` by one process of the run (process 0)
and holding the owner's host, pid, start time and command as JSON. A second trainer is
refused with one line naming the owner. The kernel drops an flock when its process dies;
if the file still names a process (it was killed before removing the file):
  - on this host, a dead pid (or a pid reused by another process) is a stale lock: it is
    taken over with a note;
  - on another host, paxcli cannot tell, and refuses (on file systems where flock spans
    hosts, a live owner is refused by the flock itself); remove the file if that run is gone.
`pax eval`, `pax decode` and `pax inspect-input` only read, and take no lock.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import socket
import sys
from typing import Callable, Optional

from paxcli.errors import UserError, shorten

LOCK_NAME = 'train.lock'


def check_writable(job_dir: str) -> None:
  """One clear line, before any work, for a job directory that cannot hold a run."""
  shown = shorten(job_dir, 200)
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
    os.makedirs(path, exist_ok=True)
    test = os.path.join(path, f'.pax-write-test-{os.getpid()}')
    with open(test, 'w') as f:
      f.write('ok')
    os.remove(test)
  except OSError as e:
    reason = {errno.EACCES: 'is not writable (permission denied)', errno.EROFS: 'is on a read-only file system',
              errno.ENOSPC: 'is on a full disk (no space left)'}.get(e.errno, f'cannot be written ({e.strerror})')
    raise UserError(f'Job directory {shown} {reason}. Choose another --job-log-dir.') from None


def _start_time(pid: int) -> Optional[str]:
  """The kernel's start time of `pid` (clock ticks since boot; Linux), to tell a reused pid apart."""
  try:
    with open(f'/proc/{pid}/stat', 'rb') as f:
      stat = f.read().decode('utf-8', 'replace')
    return stat.rsplit(')', 1)[1].split()[19]
  except (OSError, IndexError):
    return None


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
    self.path = os.path.join(os.path.abspath(job_dir), LOCK_NAME)
    self._fd: Optional[int] = None

  def acquire(self, log: Callable[[str], None] = print) -> None:
    import fcntl
    for _ in range(5):  # the file may be replaced between open and flock: retry on a new inode
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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
      return
    raise UserError(f'Could not lock {self.path}: another process keeps replacing it.')

  def _refusal(self, owner: dict) -> str:
    return (f'Another trainer is using this job directory ({_describe(owner) if owner else "owner unknown"}); '
            f'it holds {self.path}. Wait for it to finish, stop it, or use another --job-log-dir.')

  def _check_stale(self, owner: dict, fd: int, log) -> None:
    host, pid = owner.get('host'), owner.get('pid')
    if host == socket.gethostname() and isinstance(pid, int):
      if pid_alive(pid, owner.get('start_time')) and pid != os.getpid():
        os.close(fd)  # flock not honoured here (some network file systems), but the owner runs
        raise UserError(self._refusal(owner))
      log(f'Note: taking over the lock of a trainer that is gone ({_describe(owner)}); '
          'it was stopped without releasing the job directory.')
      return
    os.close(fd)
    raise UserError(f'The job directory is locked by a trainer on another host ({_describe(owner)}). '
                    f'If that run is gone, remove {self.path} and run again.')

  def _write_owner(self, fd: int) -> None:
    pid = os.getpid()
    owner = {'host': socket.gethostname(), 'pid': pid, 'start_time': _start_time(pid),
             'started': datetime.datetime.now().astimezone().isoformat(timespec='seconds'),
             'command': ' '.join(['pax'] + sys.argv[1:])[:1000]}
    data = (json.dumps(owner) + '\n').encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)

  def release(self) -> None:
    if self._fd is None:
      return
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
  import jax
  lock, refusal = None, ''
  if jax.process_index() == 0:
    try:
      lock = JobLock(job_dir)
      lock.acquire(log)
    except UserError as e:
      lock, refusal = None, str(e)
  if jax.process_count() > 1:
    import numpy as np
    from jax.experimental import multihost_utils
    refused = bool(multihost_utils.broadcast_one_to_all(np.int32(1 if refusal else 0)))
    if refused and not refusal:
      raise UserError('Process 0 could not lock the job directory (another trainer uses it); see its message.')
  if refusal:
    raise UserError(refusal)
  return lock


def trim_jsonl(path: str, last_step: int) -> int:
  """Drops the rows of a `*_metrics.jsonl` file past `last_step` (steps a resume replays).

  Rewrites the file atomically (a temp file, then rename); returns how many rows were dropped.
  """
  if not os.path.isfile(path):
    return 0
  kept, dropped = [], 0
  with open(path, encoding='utf-8', errors='replace') as f:
    for line in f:
      try:
        step = json.loads(line).get('step')
      except (ValueError, AttributeError):
        step = None
      if isinstance(step, int) and step > last_step or not line.endswith('\n'):
        dropped += 1  # a replayed step, or a row cut short by a kill
      else:
        kept.append(line)
  if dropped:
    tmp = f'{path}.tmp-{os.getpid()}'
    with open(tmp, 'w', encoding='utf-8') as f:
      f.writelines(kept)
    os.replace(tmp, path)
  return dropped


def trim_metrics(job_dir: str, last_step: int) -> int:
  """trim_jsonl on every `*_metrics.jsonl` of the job directory (train and eval)."""
  names = [n for n in os.listdir(job_dir) if n.endswith('_metrics.jsonl')] if os.path.isdir(job_dir) else []
  return sum(trim_jsonl(os.path.join(job_dir, n), last_step) for n in sorted(names))
