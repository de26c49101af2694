"""Preemption on every host: a signal reaches one process, or each at its own step, and every process saves
the one step they agree on (JAX's preemption sync point), exits 143, and the same command resumes from it:
0 steps lost, the losses of an uninterrupted run, the restarts in the goodput ledger.

Real processes under `pax launch` (2 x 4 fake CPU devices, gloo); the same under SLURM is in test_slurm.py.
"""

import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest

import tiny_runs
from tiny_runs import PAX, TINY, assert_same_losses, losses

pytestmark = [pytest.mark.slow, pytest.mark.alone]   # 2 jax.distributed processes on 2 cores

STEPS = 30
LAUNCH = [*PAX, 'launch', '--processes', '2', '--devices-per-process', '4']


class Launch:
  """A `pax launch` whose merged output is read as it comes; `until(pattern)` waits for a line."""

  def __init__(self, job_dir, *launch_options: str):
    self.proc = subprocess.Popen([*LAUNCH, *launch_options, '--', 'train', *TINY, '--set', 'PERCORE_BATCH_SIZE=1',
                                  '--set', 'task.train.save_interval_steps=100', *tiny_runs.steps(STEPS),
                                  '--job-log-dir', str(job_dir)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    self.lines: list[str] = []
    self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
    self._reader.start()

  @property
  def text(self) -> str:
    return ''.join(self.lines)

  def until(self, pattern: str, timeout: float = 900) -> re.Match:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, self.text):
      assert self.proc.poll() is None or self._reader.is_alive(), self.text[-3000:]
      assert time.monotonic() < deadline, self.text[-3000:]   # a hang guard only
      time.sleep(0.1)
    return re.search(pattern, self.text)

  def pids(self) -> dict[int, int]:
    return {int(i): int(p) for i, p in re.findall(r'p(\d) pid (\d+)', self.until(r'p1 pid \d+').string)}

  def wait(self) -> int:
    code = self.proc.wait(timeout=900)
    self._reader.join(30)
    return code


def stopped_at(text: str) -> int:
  return int(re.search(r'all agreed to stop after step (\d+); saved a checkpoint at step \1', text).group(1))


def test_signals_to_one_process_then_to_each_at_its_own_step_lose_no_step(tmp_path):
  job = tmp_path / 'job'
  reference = tiny_runs.one_process(tmp_path / 'one', STEPS)

  # 1. SIGTERM to process 1 alone: both stop after the same step and save it.
  first = Launch(job)
  pids = first.pids()
  first.until(r'\[p0\] step 4:')
  os.kill(pids[1], signal.SIGTERM)
  assert first.wait() == 143, first.text[-3000:]
  one = stopped_at(first.text)
  assert os.listdir(job / 'checkpoints') == [str(one)]   # complete: every process wrote its part of it
  assert re.search(r'\[launch\] p[01] stopped for preemption \(exit code 143\); waiting for the other processes',
                   first.text), first.text[-3000:]

  # 2. Resumed; then SIGTERM to process 0 and, half a second (a step or two) later, before JAX's notifier (it
  #    looks once a second) and the agreement are done, SIGUSR1 (a time-limit warning) to process 1.
  second = Launch(job)
  pids = second.pids()
  second.until(rf'\[p0\] Resumed from step {one} ')
  second.until(rf'\[p0\] step {one + 3}:')
  os.kill(pids[0], signal.SIGTERM)
  time.sleep(0.5)
  os.kill(pids[1], signal.SIGUSR1)
  assert second.wait() == 143, second.text[-3000:]
  two = stopped_at(second.text)
  assert two > one and sorted(int(s) for s in os.listdir(job / 'checkpoints')) == [one, two]
  assert '[p1] SIGUSR1: a preemption warning' in second.text

  # 3. The same command again runs to the end: the losses of an uninterrupted run, each step once.
  third = Launch(job)
  assert third.wait() == 0, third.text[-3000:]
  assert f'[p0] Resumed from step {two} ' in third.text
  assert_same_losses(losses(job), reference, range(1, STEPS + 1))

  account = json.loads(subprocess.run([*PAX, 'goodput', str(job), '--json'], capture_output=True, text=True,
                                      check=True).stdout)
  assert [(r['resumed_step'], r['redone_steps']) for r in account['restarts']] == [(one, 0), (two, 0)]
  assert account['steps']['recomputed'] == 0


def test_sigterm_to_the_launcher_reaches_every_process_and_is_not_restarted(tmp_path):
  """The launcher's own SIGTERM (the machine it runs on is preempted) goes to every process: they save the step
  they agree on; the launcher waits for them, does not restart them (--max-restarts) and exits 143."""
  launch = Launch(tmp_path / 'job', '--max-restarts', '1')
  launch.until(r'\[p0\] step 3:')
  launch.proc.send_signal(signal.SIGTERM)
  assert launch.wait() == 143, launch.text[-3000:]
  step = stopped_at(launch.text)
  assert '[launch] SIGTERM: passed to every process, to save and stop.' in launch.text
  assert 'not restarting: the launcher itself was asked to stop (SIGTERM).' in launch.text
  assert os.listdir(tmp_path / 'job' / 'checkpoints') == [str(step)]
