"""One trainer process's goodput: its stopwatch, its ledger, its summaries and its heartbeat.

    goodput = Goodput.open(job_dir, is_main)      # at the start of `pax train`: the ledger's start line
    chrono = Chrono(start, total, goodput.stopwatch) # the loop's clock switches the stopwatch's categories
    hooks.add(goodput.step_hook, every=1)          # each step done: productive or recomputed; heartbeat
    goodput.close(status)                          # the end line

The stopwatch (loops/hooks.py) runs from the start of the command; the ledger (jobdir/ledger.py) gets a
progress line from it every few seconds. At each summary, process 0 writes the job's account so far
(every earlier incarnation and this one) to TensorBoard under summaries/goodput; `line()` is the
account in one line for the end of the run.
"""

from __future__ import annotations

from typing import Optional

import jax

from paxcli.jobdir import layout, storage
from paxcli.jobdir import ledger
from paxcli.jobdir import summaries
from paxcli.loops.hooks import StepInfo, Stopwatch
from paxcli.runtime import distributed


class Goodput:
  """See the module docstring."""

  def __init__(self, job_dir: str, is_main: bool, started: Optional[float] = None):
    self.job_dir = job_dir
    self._history = ledger.read(job_dir)
    self.stopwatch = Stopwatch(started or ledger.command_started(), ledger.furthest_step(*self._history[:2]))
    self.stopwatch.__enter__()  # compilation from here on is timed apart
    self.ledger = ledger.Ledger(job_dir, jax.process_index())
    self.ledger.write('start', **ledger.start_fields(self.stopwatch.started, jax.process_index(),
                                                     jax.process_count()))
    self.ledger.keep_flushing(self.stopwatch.snapshot)
    self.heartbeat = distributed.Heartbeat()
    self.heartbeat.note_job(job_dir)
    self._is_main, self._writer = is_main, None   # made at the first summary: a refused start writes none
    self.began = False   # past the start's refusals: the run's directory is its record from here on

  def begin(self) -> None:
    """The run is set up and starts training: a failure from here on keeps its job directory."""
    self.began = True

  def resumed(self, step: int, tier: Optional[str]) -> None:
    """The step this incarnation goes on from, and the tier it came from (None: a fresh start)."""
    self.ledger.write('resume', t=self.stopwatch.snapshot()['t'], step=step, tier=tier)

  def step_hook(self, info: StepInfo) -> None:
    """Hook, every step, after the step's other hooks: the step's work is done; a heartbeat."""
    self.stopwatch.step_done(info.step)
    self.heartbeat.beat(info.step)

  def summary_hook(self, info: StepInfo) -> None:
    """Hook, every summary: the job's seconds so far by category, and its goodput, for TensorBoard."""
    if not self._is_main:
      return
    if self._writer is None:
      self._writer = summaries.SummaryWriter(layout.summaries(self.job_dir, 'goodput'))
    account = self.account()
    values = {f'seconds/{k}': v for k, v in account['seconds'].items()}
    values['goodput'] = account['goodput']
    self._writer.scalars(info.step, values)

  def account(self) -> dict:
    """The job's account so far (ledger.summarize with this incarnation's seconds up to now)."""
    snap = self.stopwatch.snapshot()
    closed = dict(snap['closed'])
    category, since = snap['open']
    closed[category] += max(snap['t'] - since, 0.0)
    live = ledger.Incarnation(self.ledger.inc, self.stopwatch.started, *_launch(), closed=closed,
                              last=snap['t'], step=snap['step'], steps=snap['steps'])
    return ledger.summarize(self.job_dir, live=(jax.process_index(), live), history=self._history)

  def line(self) -> str:
    """The job's account in one line (the end of the run)."""
    return describe(self.account())

  def close(self, status: int) -> None:
    """Ends the ledger and its TensorBoard record; a bucket that no longer answers is a warning (the ledger
    says it once), never an error that would hide why the run ended."""
    snap = self.stopwatch.finish()
    self.stopwatch.__exit__(None, None, None)
    self.ledger.close(t=snap['t'], closed=snap['closed'], step=snap['step'], steps=snap['steps'], status=status)
    self.heartbeat.close()
    if self._writer is not None:
      try:
        self._writer.close()
      except storage.BucketError:
        pass   # the ledger, in the same bucket, has said it cannot write there


def _launch() -> tuple:
  attempt = distributed.launch_attempt()
  return attempt if attempt else (None, None)


NAMES = {'productive': 'productive steps', 'recomputed': 'steps recomputed after restarts', 'startup': 'start-up',
         'compile': 'compilation', 'data': 'data waits', 'checkpoint': 'checkpoint stalls', 'eval': 'eval/decode',
         'shutdown': 'shut-down', 'restart': 'restart gaps'}


def describe(account: dict) -> str:
  """'Goodput 81.2% of 0:03:12 wall ...' for a ledger account."""
  seconds, restarts = account['seconds'], len(account['restarts'])
  parts = ', '.join(f'{NAMES[k]} {v:.1f} s' for k, v in seconds.items() if k != 'productive' and v >= 0.05)
  again = f'; {restarts} restart(s)' if restarts else ''
  return (f"Goodput {account['goodput']:.1%}: {seconds['productive']:.1f} s of {account['wall_seconds']:.1f} s wall "
          f'time trained new steps ({parts}{again}).')
