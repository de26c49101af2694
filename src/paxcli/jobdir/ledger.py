"""The goodput ledger: where a job's wall time went, across every process and every restart.

Each process of `pax train` appends JSON lines to `<job>/goodput/process_<i>.jsonl` (never rewritten):

  start     an incarnation begins (a `pax train` process): when it started, pid, host, launch attempt
  progress  every PROGRESS_SECONDS: the seconds closed so far in each category, the interval open now
            (its category and since when) and the last step done; a `kill -9` loses only the seconds
            since the last one
  resume    the step this incarnation restored and from which tier (fast or persistent)
  end       the incarnation's final seconds and exit status

`pax launch` appends its own to `launch.jsonl`: its start and end, each failure it saw (which process,
how, the step each process had reached) and each restart. `summarize` reads them all back into one
account whose categories add up to the job's wall time:

  productive  train steps run for the first time
  recomputed  train steps run again after a restart (at or below the furthest step reached before)
  startup     from a start (the process's, or `pax launch`'s) to the first step: imports, jax.distributed,
              building the model, restoring a checkpoint
  compile     XLA compilation of the train step and of start-up and checkpoint programs (an eval's own
              compilation counts as eval)
  data        waiting for the next input batch
  checkpoint  the loop stopped for saves (both tiers), and the wait for the last save at the end
  eval        evals and decodes during training
  shutdown    after the last step until the process (or `pax launch`) ended
  restart     from a failure (the last progress of the process that was lost) to the next start

Time after an incarnation that ended by itself (finished, a Ctrl-C, a refused start, a divergence) until
the next start is nobody's run and is not counted; after a kill, a crash, a hang or a preemption it is
`restart`. The job's figures are process 0's (the processes run in lock step); `--json` has each's.

Nothing here imports JAX: `pax goodput` and `pax launch` read and write ledgers without it. The files
of a job directory someone gave you are read bounded (size, line length, strict JSON) and a line that
does not parse (the last one of a killed process may be cut short) is skipped and counted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import socket
import sys
import threading
import time
from typing import Callable, Optional

from paxcli import files
from paxcli.errors import UserError
from paxcli.jobdir import layout
from paxcli.jobdir import storage
from paxcli.runtime import distributed  # no JAX: its module imports it inside functions only

PROCESS_CATEGORIES = ('productive', 'recomputed', 'startup', 'compile', 'data', 'checkpoint', 'eval', 'shutdown')
CATEGORIES = PROCESS_CATEGORIES + ('restart',)
PROGRESS_SECONDS = 2.0
# Exit statuses after which the next start is the user's doing, not a recovery: finished, refused
# (UserError), diverged, interrupted (Ctrl-C). The time until the next start is not the job's.
ENDED_BY_ITSELF = (0, 2, 3, 130)
MAX_LEDGER_BYTES = 1 << 30
MAX_LINE_BYTES = 1 << 16
# The start of a `pax` command: the process's own start when the command is the process (`pax ...`,
# `python -m paxcli.cli.app ...`: its interpreter start-up and imports count, however long a loaded
# machine makes them), else the moment main() was entered (pax called in-process, as tests do).
_command_started: Optional[float] = None
WHOLE_PROCESS_MAX_S = 3600.0  # sanity: a process start further back than this is not this command's


def mark_command_start(whole_process: bool) -> None:
  """Called by the CLI's main(): the time this command started (see _command_started)."""
  global _command_started
  now = time.time()
  began = process_started_at() if whole_process else None
  _command_started = began if began is not None and 0 <= now - began < WHOLE_PROCESS_MAX_S else now


def command_started() -> float:
  return _command_started if _command_started is not None else time.time()


def start_ticks(pid: int) -> Optional[str]:
  """The kernel's start time of `pid` (clock ticks since boot; Linux), or None."""
  try:
    with open(f'/proc/{pid}/stat', 'rb') as f:
      stat = f.read().decode('utf-8', 'replace')
    return stat.rsplit(')', 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def process_started_at() -> Optional[float]:
  """This process's start (epoch seconds) from the kernel (Linux), or None."""
  ticks = start_ticks(os.getpid())
  try:
    with open('/proc/uptime', encoding='ascii') as f:  # seconds since boot, to 10 ms (btime is whole seconds)
      uptime = float(f.read().split()[0])
    return time.time() - (uptime - int(ticks) / os.sysconf('SC_CLK_TCK'))
  except (OSError, IndexError, TypeError, ValueError):
    return None


# ---- writing ----------------------------------------------------------------------------------------


class Ledger:
  """One process's append-only ledger: a line per event, flushed at once; `keep_flushing` adds a
  progress line every PROGRESS_SECONDS from a thread, so that a kill loses at most those seconds.

  In a bucket, where an object cannot be appended to, this run (incarnation) writes an object of its own
  (layout.goodput_ledger_part), rewritten at each line with its few lines (its start, resume and end, and
  its last progress line only): a write costs this run's lines, never the job's history.
  """

  def __init__(self, job_dir: str, process: int):
    self.inc = secrets.token_hex(6)
    self._local = storage.is_local(job_dir)
    self.path = (layout.goodput_ledger(job_dir, process) if self._local
                 else layout.goodput_ledger_part(job_dir, process, self.inc))
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None
    self._closed, self._failed = False, False
    if self._local:
      os.makedirs(os.path.dirname(self.path), exist_ok=True)
      self._file = open(self.path, 'a', encoding='utf-8')
    else:
      self._lines, self._progress = [], ''

  def write(self, kind: str, **fields) -> None:
    line = json.dumps({'kind': kind, 'inc': self.inc, **fields}, separators=(',', ':'), allow_nan=False) + '\n'
    with self._lock:
      if self._closed:
        return
      if self._local:
        self._file.write(line)
        self._file.flush()
        return
      if kind == 'progress':
        self._progress = line
      else:
        self._lines.append(line)
        self._progress = '' if kind == 'end' else self._progress
      storage.write_bytes(self.path, ''.join(self._lines + [self._progress]).encode())

  def keep_flushing(self, snapshot: Callable[[], dict], every: float = PROGRESS_SECONDS) -> None:
    def run():
      while not self._stop.wait(every):
        try:
          self.write('progress', **snapshot())
        except Exception as e:  # pylint: disable=broad-except
          self._warn(e)   # a full disk or an unreachable bucket: said once, and training goes on
    self._thread = threading.Thread(target=run, name='paxcli-goodput-ledger', daemon=True)
    self._thread.start()

  def _warn(self, e: BaseException) -> None:
    if not self._failed:
      self._failed = True
      print(f'WARNING: could not write the goodput ledger {self.path} ({type(e).__name__}: {e}); '
            'training goes on, its account may miss time.', file=sys.stderr, flush=True)

  def close(self, **end) -> None:
    """Stops the progress thread and writes the `end` line."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)
    try:
      self.write('end', **end)
    except storage.BucketError as e:   # the bucket does not answer: said once, as for a progress line
      self._warn(e)
    with self._lock:
      self._closed = True
      if self._local:
        self._file.close()


def start_fields(started: float, process: int, processes: int) -> dict:
  """The `start` line of this incarnation, with the launch attempt it belongs to (from `pax launch`) and the
  SLURM job and its requeue count (SLURM_RESTART_COUNT) where SLURM started it."""
  launch = distributed.launch_attempt()
  job, requeues = os.environ.get('SLURM_JOB_ID', ''), os.environ.get('SLURM_RESTART_COUNT', '0')
  return {'t': started, **whereabouts(), 'process': process,
          'processes': processes, **({'launch': launch[0], 'attempt': launch[1]} if launch else {}),
          **({'slurm_job': job, 'requeue': int(requeues)} if job.isdigit() and requeues.isdigit() else {})}


def whereabouts() -> dict:
  """This process's host, pid and kernel start time, in a start line: what tells a process without an end
  line that still runs from one that was killed (a pid alone may have been reused)."""
  return {'pid': os.getpid(), 'host': socket.gethostname(), 'ticks': start_ticks(os.getpid())}


def append(path: str, records: list[dict]) -> None:
  """Appends `records` as lines (the launcher's ledger: a few lines, written as they happen)."""
  storage.makedirs(storage.dirname(path))
  storage.append_text(path, ''.join(json.dumps(r, separators=(',', ':'), allow_nan=False) + '\n' for r in records))


def job_id(job_dir: str, create: bool) -> Optional[str]:
  """The job's identity (job.json), made at its first start when `create` (process 0); None if absent."""
  path = layout.job_identity(job_dir)
  if create:
    storage.create_new(path, json.dumps({'id': secrets.token_hex(8), 'created': time.time()}).encode())
  try:
    text = storage.read_bytes(path, 4096)
  except FileNotFoundError:
    return None
  record = files.parse_json(text, f'the job identity {path}')
  value = record.get('id') if isinstance(record, dict) else None
  if not isinstance(value, str) or not value.isalnum() or len(value) > 64:
    raise UserError(f'{path} is not a job identity paxcli wrote; move it aside to start a new one.')
  return value


# ---- reading ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Incarnation:
  """One `pax train` process's run, as its ledger lines tell it."""
  inc: str
  start: float
  launch: Optional[str] = None
  attempt: Optional[int] = None
  closed: dict = dataclasses.field(default_factory=dict)  # seconds per category, closed intervals only
  last: Optional[float] = None   # the end of what is accounted: its end, or its last progress (a kill)
  step: Optional[int] = None     # the last step done
  steps: dict = dataclasses.field(default_factory=dict)
  status: Optional[int] = None   # exit status; None: it never wrote an end (killed, or running)
  resumed: Optional[dict] = None  # {'step', 'tier'}
  where: Optional[tuple] = None   # (host, pid, kernel start ticks) of its process, to tell running from killed
  slurm: Optional[tuple] = None  # (SLURM job id, its requeue count) where SLURM started it


@dataclasses.dataclass
class Launch:
  """One `pax launch`: when it ran, what it saw fail, and its exit code."""
  id: str
  start: float
  end: Optional[float] = None
  code: Optional[int] = None
  failures: list = dataclasses.field(default_factory=list)
  where: Optional[tuple] = None   # as Incarnation's


def read(job_dir: str) -> tuple[dict[int, list[Incarnation]], dict[str, Launch], int]:
  """({process: incarnations in start order}, {launch id: launch}, lines skipped) of a job directory."""
  by_process, skipped = {}, [0]
  for name in sorted(storage.listdir(layout.goodput(job_dir))):
    process = layout.goodput_process(name)
    if process is not None:   # its ledger, and in a bucket each run's own part
      by_process.setdefault(process, []).append(layout.entry(layout.goodput(job_dir), name))
  processes = {p: incarnations(r for path in paths for r in _records(path, skipped))
               for p, paths in by_process.items()}
  launches = {}
  if storage.isfile(layout.launch_ledger(job_dir)):
    launches = _launches(_records(layout.launch_ledger(job_dir), skipped))
  return processes, launches, skipped[0]


def _records(path: str, skipped: list[int]):
  """The well-formed lines of one ledger file, one at a time, read a bounded line at a time (a line over
  MAX_LINE_BYTES is skipped without being held); skipped[0] counts those that are not well formed."""
  size = storage.regular_file_size(path)
  if size is None:
    raise UserError(f'{path} is not a file; a goodput ledger is one.')
  if size > MAX_LEDGER_BYTES:
    raise UserError(f'{path} is {size:,} bytes; paxcli reads goodput ledgers of at most {MAX_LEDGER_BYTES:,}.')
  with storage.open_binary(path) as f:
    for raw in files.bounded_lines(f, MAX_LINE_BYTES):
      record = _record(raw, path)
      if record is None:
        skipped[0] += 1
      else:
        yield record


def _record(raw: Optional[bytes], path: str) -> Optional[dict]:
  """One ledger line as a record with a kind and a time, or None (cut short, too long, not one)."""
  if raw is None or not raw.endswith(b'\n'):
    return None
  try:
    record = files.parse_json(raw, path, max_depth=4)
  except UserError:
    return None
  ok = isinstance(record, dict) and isinstance(record.get('kind'), str) and _number(record.get('t')) is not None
  return record if ok else None


# Every time and duration a ledger holds is seconds (since the epoch, or of a run): beyond this (three
# centuries) a number is no time paxcli wrote, and sums of such numbers could overflow to infinity.
MAX_SECONDS = 1e10


def _number(value) -> Optional[float]:
  ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        and abs(value) <= MAX_SECONDS)
  return float(value) if ok else None


def _seconds(closed) -> dict:
  """A `closed` map, checked: known categories, finite non-negative seconds."""
  if not isinstance(closed, dict):
    return {}
  return {k: max(v, 0.0) for k, v in ((k, _number(v)) for k, v in closed.items())
          if k in PROCESS_CATEGORIES and v is not None}


MAX_STEPS = 2**31 - 1   # a step or a count of steps (the train state's step is an int32)


def _int(value) -> Optional[int]:
  return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_STEPS else None


def incarnations(records) -> list[Incarnation]:
  """The incarnations of one process's ledger lines (progress lines reduced to the last of each)."""
  found: dict[str, Incarnation] = {}
  for r in records:
    inc = r.get('inc')
    if not isinstance(inc, str):
      continue
    if r['kind'] == 'start':
      launch = r.get('launch') if isinstance(r.get('launch'), str) else None
      job = r.get('slurm_job') if isinstance(r.get('slurm_job'), str) and r['slurm_job'].isdigit() else None
      found[inc] = Incarnation(inc, float(r['t']), launch, _int(r.get('attempt')), last=float(r['t']),
                               where=_where(r), slurm=(job[:20], _int(r.get('requeue'))) if job else None)
      continue
    got = found.get(inc)
    if got is None or got.status is not None:  # nothing counts after an incarnation's end
      continue
    if r['kind'] in ('progress', 'end'):
      closed = _seconds(r.get('closed'))
      if r['kind'] == 'progress':  # the open interval was lost if nothing follows: account up to its start
        opened = r.get('open')
        since = _number(opened[1]) if isinstance(opened, list) and len(opened) == 2 else None
        got.last = since if since is not None else float(r['t'])
      else:
        got.last, got.status = float(r['t']), _int(r.get('status')) if _int(r.get('status')) is not None else 1
      got.closed = closed
      got.step = _int(r.get('step')) if _int(r.get('step')) is not None else got.step
      steps = r.get('steps') if isinstance(r.get('steps'), dict) else {}
      got.steps = {k: v for k, v in steps.items() if k in ('productive', 'recomputed') and _int(v) is not None}
    elif r['kind'] == 'resume':
      got.resumed = {'step': _int(r.get('step')), 'tier': r.get('tier') if r.get('tier') in ('fast', 'persistent')
                     else None}
  return sorted(found.values(), key=lambda i: i.start)


def _where(record: dict) -> Optional[tuple]:
  host, pid, ticks = record.get('host'), _int(record.get('pid')), record.get('ticks')
  if not isinstance(host, str) or len(host) > 255 or pid is None:
    return None
  return host, pid, ticks if isinstance(ticks, str) and ticks.isdigit() and len(ticks) < 32 else None


def _launches(records) -> dict[str, Launch]:
  out: dict[str, Launch] = {}
  for r in records:
    lid = r.get('id')
    if not isinstance(lid, str):
      continue
    if r['kind'] == 'launch':
      out[lid] = Launch(lid, float(r['t']), where=_where(r))
    elif lid in out and r['kind'] == 'failure':
      beats = r.get('steps') if isinstance(r.get('steps'), dict) else {}
      out[lid].failures.append({'t': float(r['t']), 'attempt': _int(r.get('attempt')),
                                'process': _int(r.get('process')), 'reason': str(r.get('reason', ''))[:300],
                                'step': max((v for v in beats.values() if _int(v) is not None), default=None)})
    elif lid in out and r['kind'] == 'end':
      out[lid].end, out[lid].code = float(r['t']), _int(r.get('code'))
  return out


def furthest_step(processes: dict[int, list[Incarnation]], launches: dict[str, Launch],
                  before: float = math.inf) -> int:
  """The furthest step reached, by the ledgers of incarnations (of any process) accounted up to before
  `before`, or by `pax launch`'s records of failures before it: a step at or below it, run again, is
  recomputed. (A peer started beside a run is not 'before' it: its account goes on past its start.)"""
  steps = [i.step for incs in processes.values() for i in incs if i.step is not None and i.last < before]
  steps += [f['step'] for launch in launches.values() for f in launch.failures
            if f['step'] is not None and f['t'] < before]
  return max(steps, default=0)


# ---- the account ------------------------------------------------------------------------------------


def summarize(job_dir: str, live: Optional[tuple[int, Incarnation]] = None, history: Optional[tuple] = None) -> dict:
  """The job's account (see the module docstring). `live`: (process, its running incarnation so far), beside
  `history` (what `read` gave at its start; read now when None)."""
  processes, launches, skipped = history if history is not None else read(job_dir)
  processes = dict(processes)
  if live is not None:
    process, running = live
    processes[process] = [i for i in processes.get(process, []) if i.inc != running.inc] + [running]
  if not processes:
    raise UserError(f'No goodput ledger in {job_dir} ({layout.goodput(job_dir)} is missing or empty): '
                    'it is written by `pax train`; train in this job directory first.')
  per_process = {p: account(incs, launches, lambda t: furthest_step(processes, launches, t))
                 for p, incs in sorted(processes.items())}
  job = per_process.get(0) or next(iter(per_process.values()))
  return {'job_dir': job_dir, **job, 'ended': ending(processes, launches),
          'processes': {str(p): {k: v for k, v in a.items() if k != 'restarts'} for p, a in per_process.items()},
          'lines_skipped': skipped}


def account(incs: list[Incarnation], launches: dict[str, Launch], furthest: Callable[[float], int]) -> dict:
  """One process's seconds by category (adding up to its wall time), steps, and restarts; `furthest(t)`: the
  furthest step reached before time t (what the stopwatch of a run started then counted recomputed steps by)."""
  seconds = dict.fromkeys(CATEGORIES, 0.0)
  steps = {'productive': 0, 'recomputed': 0}
  restarts, previous, until = [], None, None   # `until`: where the account stands after `previous`
  for i, inc in enumerate(incs):
    launch = launches.get(inc.launch) if inc.launch else None
    if previous is None or previous.status in ENDED_BY_ITSELF:
      if launch is not None and inc.attempt == 0 and launch.start < inc.start:
        seconds['startup'] += inc.start - launch.start  # `pax launch`'s own start-up
    else:
      gap = max(inc.start - until, 0.0)
      seconds['restart'] += gap
      restarts.append(_restart(previous, inc, gap, launches, furthest(inc.start)))
    for k, v in inc.closed.items():
      seconds[k] += v
    for k, v in inc.steps.items():
      steps[k] += v
    previous, until = inc, inc.last
    following = incs[i + 1] if i + 1 < len(incs) else None
    if launch is not None and launch.end is not None and launch.end > inc.last and (
        following is None or following.launch != inc.launch):
      # `pax launch` after its processes ended, or after it gave up on a lost one
      seconds['shutdown' if inc.status in ENDED_BY_ITSELF else 'restart'] += launch.end - inc.last
      until = launch.end
  wall = sum(seconds.values())
  return {'wall_seconds': wall, 'seconds': seconds, 'goodput': seconds['productive'] / wall if wall > 0 else 0.0,
          'steps': steps, 'step': max((i.step for i in incs if i.step is not None), default=None),
          'incarnations': len(incs), 'restarts': restarts}


def _restart(previous: Incarnation, inc: Incarnation, gap: float, launches: dict[str, Launch], reached: int) -> dict:
  """One restart: why (the launcher's record of it, if any), the gap, and the steps it cost."""
  failure = _failure_of(previous, launches, [inc.launch], inc.start + 1)
  resumed = inc.resumed or {}
  redone = reached - resumed['step'] if resumed.get('step') is not None else None
  reason = failure['reason'] if failure else ('killed (no end record)' if previous.status is None
                                              else f'exited with status {previous.status}')
  if inc.slurm and inc.slurm[1]:
    reason = f'requeued by SLURM (job {inc.slurm[0]}, requeue {inc.slurm[1]}): {reason}'
  return {'at': previous.last, 'gap_seconds': gap, 'process': failure['process'] if failure else None,
          'reason': reason, 'reached_step': reached,
          'resumed_step': resumed.get('step'), 'tier': resumed.get('tier'),
          'redone_steps': max(redone, 0) if redone is not None else None}


def _failure_of(inc: Incarnation, launches: dict[str, Launch], also: list, until: float) -> Optional[dict]:
  """`pax launch`'s record of the failure that ended `inc`: the one of its launch and attempt; without
  those, the last one recorded from its start to `until` by its launch or those in `also`. (By time
  alone, the failure that ended the attempt before can read as this one's: the launcher records it and
  starts the next attempt within the kernel's 10 ms resolution of a process start.)"""
  launch = launches.get(inc.launch) if inc.launch else None
  if launch is not None and inc.attempt is not None:
    found = [f for f in launch.failures if f['attempt'] == inc.attempt]
    if found:
      return found[-1]
  window = [f for lid in dict.fromkeys([inc.launch, *also]) if lid in launches for f in launches[lid].failures
            if inc.start <= f['t'] <= until]
  return window[-1] if window else None


# How a job's last run ended, by the status its processes' `end` lines give (or `pax launch`'s exit code).
ENDED_AS = {0: 'finished', 2: 'refused', 3: 'diverged', 130: 'interrupted'}


def ending(processes: dict[int, list[Incarnation]], launches: dict[str, Launch]) -> dict:
  """How the job's last run ended: {'state', 'process', 'reason', 'step'}.

  state: finished, refused, diverged, interrupted; died (a process failed or was killed and nothing
  restarted it: `process` and `reason` say which and how); running (no end yet). A process without
  an end line is running if its pid is alive on this host with the same start time, killed if not;
  one on another host cannot be told apart from here (`reason` says so).
  """
  last = {p: incs[-1] for p, incs in processes.items() if incs}
  newest = max(last.values(), key=lambda i: i.start)
  launch = launches.get(newest.launch) if newest.launch else None
  if launch is not None:
    return _launch_ending(launch, newest)
  for p, inc in sorted(last.items()):
    if inc.status is not None and inc.status not in ENDED_AS:
      return _ended('died', p, f'exited with status {inc.status}', inc.step)
  unended = [(p, i, _alive(i.where)) for p, i in sorted(last.items()) if i.status is None]
  for p, inc, alive in unended:
    if alive is False:
      return _ended('died', p, 'was killed (its ledger has no end line)', inc.step)
  if unended:
    elsewhere = any(alive is None for _, _, alive in unended)
    return _ended('running', None, 'no end line yet: running on another host, or killed there' if elsewhere
                  else None, newest.step)
  statuses = {i.status for i in last.values()}
  return _ended(next((ENDED_AS[s] for s in (3, 2, 130) if s in statuses), 'finished'), None, None, newest.step)


def _launch_ending(launch: Launch, newest: Incarnation) -> dict:
  """The ending of a run under `pax launch`: its exit code, and the failure of its last attempt."""
  if launch.end is None:
    if _alive(launch.where) is False:
      return _ended('died', None, 'pax launch was killed (its ledger has no end line)', newest.step)
    return _ended('running', None, None, newest.step)
  if launch.code == 0:
    return _ended('finished', None, None, newest.step)
  failure = _failure_of(newest, {launch.id: launch}, [], launch.end)
  state = ENDED_AS.get(launch.code, 'died')
  if failure is None:
    return _ended(state, None, f'pax launch exited with code {launch.code}' if state == 'died' else None,
                  newest.step)
  reason = failure['reason'] + ('; pax launch did not restart it' if state == 'died' else '')
  return _ended(state, failure['process'], reason, failure['step'] if failure['step'] is not None else newest.step)


def _ended(state: str, process: Optional[int], reason: Optional[str], step: Optional[int]) -> dict:
  return {'state': state, 'process': process, 'reason': reason, 'step': step}


def _alive(where: Optional[tuple]) -> Optional[bool]:
  """Whether the process a start line names still runs; None when it ran on another host (or is unknown)."""
  if where is None or where[0] != socket.gethostname():
    return None
  ticks = start_ticks(where[1])
  return ticks is not None and (where[2] is None or ticks == where[2])
