"""Issue 31, proof by faults: processes killed (`kill -9`) and stopped (SIGSTOP) during real runs.

Two jax.distributed processes (gloo, 2 x 4 fake CPU devices) train a tiny model under
`pax launch --max-restarts`; the test kills one of them at random steps, or stops one to make a
hang, and checks that the run finishes with the losses of an uninterrupted run, that each restart
went back at most the fast tier's interval, and that the goodput ledger accounts for every second.
Slow, and alone: several processes that a busy machine starves of CPU miss their heartbeats.
"""

import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

import numpy as np
import pytest

import injected
from conftest import pax_main, run_pax
from paxcli.jobdir import checkpoint, layout
from test_multiprocess import _losses

TINY = ['--exp', 'lm_cloud.LmCloudSpmdTest', '--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=32',
        '--set', 'HIDDEN_DIMS=64', '--set', 'NUM_HEADS=2', '--set', 'DIMS_PER_HEAD=16', '--set', 'VOCAB_SIZE=64',
        '--set', 'MAX_SEQ_LEN=16', '--set', 'PERCORE_BATCH_SIZE=1', '--set', 'task.train.summary_interval_steps=1',
        '--set', 'task.train.save_interval_steps=8']
EVERY = 3   # LOCAL_CHECKPOINT_EVERY
RTOL = 1e-5  # float32 reductions in another order across processes


def _reference(tmp_path, steps: int) -> dict[int, float]:
  """The same global batches, uninterrupted, on one process of 8 devices."""
  job = str(tmp_path / 'reference')
  result = run_pax('train', *TINY, '--set', f'task.train.num_train_steps={steps}', '--job-log-dir', job, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return _losses(job)


class Launch:
  """`pax launch` of 2 processes in the background, its lines read as they come."""

  def __init__(self, job: str, steps: int, *flags: str, sets: tuple = (), env: Optional[dict] = None):
    self.cmd = [sys.executable, '-m', 'paxcli.cli.app', 'launch', '--processes', '2', '--devices-per-process', '4',
                '--grace', '2', *flags, '--', 'train', *TINY, '--set', f'task.train.num_train_steps={steps}',
                '--set', f'LOCAL_CHECKPOINT_DIR={job}-local', '--set', f'LOCAL_CHECKPOINT_EVERY={EVERY}',
                *sets, '--job-log-dir', job]
    self.began = time.time()
    self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env={**os.environ, **(env or {})})
    self.lines: queue.Queue = queue.Queue()
    self.seen: list[str] = []
    self.pids: dict[int, int] = {}
    threading.Thread(target=lambda: [self.lines.put(l) for l in self.proc.stdout], daemon=True).start()

  def story(self) -> str:
    """For a failure: the launcher's own lines (each failure and restart), then the output's tail."""
    own = [l for l in self.seen if l.startswith('[launch]')]
    return ''.join(own) + '...\n' + ''.join(self.seen)[-3000:]

  def next_line(self, deadline: float) -> str:
    while True:
      assert time.monotonic() < deadline, self.story()
      try:
        line = self.lines.get(timeout=1)
      except queue.Empty:
        assert self.proc.poll() is None or not self.lines.empty(), self.story()
        continue
      self.seen.append(line)
      found = re.findall(r'p(\d) pid (\d+)', line)
      if found and 'coordinator' in line:
        self.pids = {int(i): int(p) for i, p in found}
      return line

  def wait_for_step(self, step: int, deadline: float) -> int:
    """Reads lines until process 0 reports `step` or later; returns the step it reported."""
    while True:
      match = re.match(r'\[p0\] step (\d+):', self.next_line(deadline))
      if match and int(match.group(1)) >= step:
        return int(match.group(1))

  def wait_for(self, text: str, deadline: float) -> float:
    while text not in self.next_line(deadline):
      pass
    return time.monotonic()

  def finish(self, timeout: float) -> tuple[int, str, float]:
    try:
      self.proc.wait(timeout=timeout)
    finally:
      if self.proc.poll() is None:
        self.proc.kill()
    wall = time.time() - self.began
    time.sleep(0.5)
    while not self.lines.empty():
      self.seen.append(self.lines.get())
    return self.proc.returncode, ''.join(self.seen), wall


def _account(job, capsys) -> dict:
  code, out, err = pax_main(['goodput', job, '--json'], capsys)
  assert code == 0, err
  return json.loads(out)


@pytest.mark.slow
@pytest.mark.alone
def test_kill9_at_random_steps_finishes_with_the_uninterrupted_losses(tmp_path, capsys):
  steps, job = 30, str(tmp_path / 'job')   # 10 steps past the last kill: the run is still going when it lands
  rng = random.Random(int(os.environ.get('PAXCLI_FAULT_SEED', time.time())))
  kills = [rng.randint(4, 7), rng.randint(10, 14), 20]   # the last two steps after fast step 18
  victims = [rng.randint(0, 1) for _ in kills]
  launch = Launch(job, steps, '--max-restarts', '4', '--heartbeat-timeout', '300')
  deadline = time.monotonic() + 1500
  reached = []
  for i, (at, victim) in enumerate(zip(kills, victims)):
    reached.append(launch.wait_for_step(at, deadline))
    os.kill(launch.pids[victim], signal.SIGKILL)
    launch.wait_for(f'restart {i + 1} of 4', deadline)
    if i == len(kills) - 1:  # a replaced machine: the killed process's host comes back without its local tier
      shutil.rmtree(f'{job}-local/process_{victim}-of-2')
  code, out, wall = launch.finish(timeout=900)
  assert code == 0, out[-4000:]
  note = f'kills at steps {reached} of processes {victims}'

  # The losses of an uninterrupted run, every step once (the rows past each resume step are replaced).
  losses, reference = _losses(job), _reference(tmp_path, steps)
  assert sorted(losses) == list(range(1, steps + 1)), note
  np.testing.assert_allclose([losses[s] for s in range(1, steps + 1)], [reference[s] for s in range(1, steps + 1)],
                             rtol=RTOL, err_msg=note)

  resumed = [int(s) for s in re.findall(r'\[p0\] Resumed from step (\d+)', out)]
  assert len(resumed) == 3 and out.count('of the fast checkpoint tier') == 2, note + out[-4000:]
  assert 'has step 18 on some processes but not all' in out and '[p0] Resumed from step 16 (' in out, note

  account = _account(job, capsys)
  # Every second: the figures add up to the span the launcher's ledger covers, which the outside clock saw
  # whole (give or take the kernel's 10 ms on the launcher's start); how close they are is
  # benchmarks/goodput_wall.py's question.
  with open(layout.launch_ledger(job)) as f:
    launcher = [json.loads(line) for line in f]
  (start,), (end,) = ([r for r in launcher if r['kind'] == kind] for kind in ('launch', 'end'))
  assert sum(account['seconds'].values()) == pytest.approx(end['t'] - start['t'], abs=1e-6)
  assert account['wall_seconds'] <= wall + 0.02, (account['wall_seconds'], wall, note)
  restarts = account['restarts']
  assert [r['reason'] for r in restarts] == ['was killed by SIGKILL (exit code -9)'] * 3, note
  assert [r['resumed_step'] for r in restarts] == resumed and [r['tier'] for r in restarts] == ['fast', 'fast', 'persistent']
  for r, seen in zip(restarts[:2], reached):
    # The heartbeat follows a step's hooks: a kill right after the summary line of step `seen` finds `seen - 1`.
    assert r['reached_step'] >= seen - 1, (r, note)
    newest = r['reached_step'] // EVERY * EVERY
    # At most the fast tier's interval redone, unless the newest fast save was still being written at the
    # kill: then the one before it (written while training went on, so the restart went back one more).
    assert r['redone_steps'] <= EVERY or r['resumed_step'] == newest - EVERY, (r, note)
  # The steps each restart redid are the steps its run counted recomputed (one reading of the ledger for both).
  assert account['steps']['recomputed'] == sum(r['redone_steps'] for r in restarts), (account, note)
  # Steps done in the seconds a kill took from the ledger are counted neither way: never more than were run.
  assert account['step'] == steps and account['steps']['productive'] <= steps and account['seconds']['restart'] > 0


@pytest.mark.slow
@pytest.mark.alone
def test_a_stopped_process_is_a_hang_detected_and_restarted(tmp_path, capsys):
  # Every process stopped (a job wedged as a whole): no peer is left running to give up inside a gloo
  # collective first (one stopped process of two was seen to make the other abort before a 60 s timeout on a
  # loaded machine), so the launcher's heartbeat is what detects it, at any load.
  steps, job, timeout = 30, str(tmp_path / 'job'), 45   # the stop at step 7 lands well before the end
  launch = Launch(job, steps, '--max-restarts', '1', '--heartbeat-timeout', str(timeout))
  deadline = time.monotonic() + 1200
  reached = launch.wait_for_step(7, deadline)
  stopped = list(launch.pids.values())
  for pid in stopped:
    os.kill(pid, signal.SIGSTOP)
  stopped_at = time.monotonic()
  try:
    detected = launch.wait_for('hung: no heartbeat for', min(deadline, stopped_at + timeout + 300))
  finally:
    for pid in stopped:   # the launcher SIGKILLs them; never leave a stopped process behind
      try:
        os.kill(pid, signal.SIGCONT)
      except ProcessLookupError:
        pass
  code, out, _ = launch.finish(timeout=900)
  assert code == 0, out[-4000:]
  line = next(l for l in out.splitlines() if 'hung: no heartbeat for' in l)
  assert f'(--heartbeat-timeout {timeout})' in line and 'restart 1 of 1' in out
  # Detected by the launcher's heartbeat, once the timeout had passed: never sooner (the silence it reports
  # is past the timeout, and so is the time since the stop, give or take the last beat's lead).
  assert float(re.search(r'no heartbeat for ([\d.]+) s', line).group(1)) >= timeout, line
  assert detected - stopped_at >= timeout - 2, (detected - stopped_at, line)
  resumed = int(re.search(r'\[p0\] Resumed from step (\d+) of the fast checkpoint tier', out).group(1))
  # The newest fast step before the stop, or the one before it where that save was still being written when
  # the processes stopped (the save is asynchronous: at a few steps a second it is often still in flight).
  newest = reached // EVERY * EVERY
  assert resumed in (newest, newest - EVERY), (reached, out[-3000:])
  account = _account(job, capsys)
  (restart,) = account['restarts']
  assert restart['reason'].startswith('hung: no heartbeat') and restart['resumed_step'] == resumed
  assert restart['gap_seconds'] >= timeout - 2 and account['step'] == steps
  # Steps run after a stopped process's last ledger line are counted neither way (as after a kill -9).
  assert account['steps']['productive'] <= steps and account['steps']['recomputed'] == restart['redone_steps']


@pytest.mark.slow
@pytest.mark.alone
def test_restarts_at_many_steps_keep_the_processes_agreed_on_their_checkpoints(tmp_path, capsys):
  """Issue 38: after a restart, the first save that deleted an old step stopped both processes with
  `sync_global_devices name mismatch` (process 0 in orbax's deletion barrier, process 1 in its save
  barrier): each process chose the steps to delete from its own listing of the directory, while process 0,
  which alone deletes, was already deleting. Here one process is killed (`kill -9`) at many steps, each
  process in turn, around saves and deletions (a persistent save every 2 steps keeping 2, a fast one every
  3), under `pax launch --max-restarts`, with process 1 late at every save. The last kill is one too many:
  `pax goodput` says the job died, and by which process; the same command then finishes the job with the
  losses of an uninterrupted run and the checkpoints retention keeps."""
  steps, job = 16, str(tmp_path / 'job')
  kills, victims = [3, 6, 8, 11], [1, 0, 1, 1]   # a fast step, both tiers' step, a persistent one, neither
  env = injected.env(tmp_path, injected.LATE_SAVES, PAXCLI_TEST_SAVE_LAG='2')
  sets = ('--set', 'task.train.save_interval_steps=2', '--set', 'task.train.save_max_to_keep=2')
  restarts = len(kills) - 1
  launch = Launch(job, steps, '--max-restarts', str(restarts), '--heartbeat-timeout', '300', sets=sets, env=env)
  deadline = time.monotonic() + 2400
  reached = []
  for i, (at, victim) in enumerate(zip(kills, victims)):
    reached.append(launch.wait_for_step(at, deadline))
    os.kill(launch.pids[victim], signal.SIGKILL)
    if i < restarts:
      launch.wait_for(f'restart {i + 1} of {restarts}', deadline)
  code, out, _ = launch.finish(timeout=600)
  note = f'kills at steps {reached} of processes {victims}\n'
  assert 'sync_global_devices' not in out and 'Traceback' not in out, note + launch.story()
  assert code == 137 and f'no restarts left (--max-restarts {restarts}); giving up' in out, note + launch.story()
  assert len(re.findall(r'\[p0\] Resumed from step', out)) == restarts, note + launch.story()

  account = _account(job, capsys)
  assert [r['process'] for r in account['restarts']] == victims[:-1], (account['restarts'], note)
  ended = account['ended']
  assert ended['state'] == 'died' and ended['process'] == victims[-1], (ended, note)
  assert ended['reason'].startswith('was killed by SIGKILL (exit code -9)'), ended
  code, table, _ = pax_main(['goodput', job], capsys)
  flat = ' '.join(table.split())
  assert code == 0 and f"The job died at step {ended['step']}: p{victims[-1]} was killed by SIGKILL" in flat, table
  assert 'the failure that ended the job' in flat, table

  again = Launch(job, steps, '--max-restarts', '0', sets=sets, env=env)
  code, out, _ = again.finish(timeout=900)
  assert code == 0 and 'sync_global_devices' not in out, again.story()
  losses, reference = _losses(job), _reference(tmp_path, steps)
  np.testing.assert_allclose([losses[s] for s in range(1, steps + 1)], [reference[s] for s in range(1, steps + 1)],
                             rtol=RTOL, err_msg=note)
  kept = checkpoint.complete_steps(layout.checkpoints(job))
  assert kept[-2:] == [steps - 2, steps] and len(kept) <= 3, kept   # the newest 2, and the best by loss if older
  assert _account(job, capsys)['ended']['state'] == 'finished'


def _kill_at_step_5(cmd: list[str]) -> None:
  """Runs `pax train` and `kill -9`s it once it reports step 5."""
  first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    for line in first.stdout:
      if line.startswith('step 5:'):
        break
    first.kill()
  finally:
    first.wait(timeout=60)


@pytest.mark.slow
def test_a_killed_trainer_run_again_by_hand_resumes_from_the_fast_tier(tmp_path, capsys):
  """No launcher (a cluster that requeues the job): `kill -9`, then the same command again."""
  job = str(tmp_path / 'job')
  cmd = [sys.executable, '-m', 'paxcli.cli.app', 'train', *TINY, '--set', 'task.train.num_train_steps=12',
         '--set', f'LOCAL_CHECKPOINT_DIR={job}-local', '--set', 'LOCAL_CHECKPOINT_EVERY=2', '--job-log-dir', job]
  _kill_at_step_5(cmd)
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  resumed = int(re.search(r'Resumed from step (\d+) of the fast checkpoint tier', result.stdout).group(1))
  # 4, the newest fast save before step 5; 2 if that one was still being written at the kill; 6 if the
  # trainer ran on past step 5 before the kill landed.
  assert resumed in (2, 4, 6) and 'no persistent one yet' in result.stdout
  losses, reference = _losses(job), _reference(tmp_path, 12)
  np.testing.assert_allclose([losses[s] for s in range(1, 13)], [reference[s] for s in range(1, 13)], rtol=RTOL)
  account = _account(job, capsys)
  (restart,) = account['restarts']
  assert restart['reason'] == 'killed (no end record)' and restart['tier'] == 'fast'
  assert restart['resumed_step'] == resumed and account['seconds']['restart'] > 0
  assert not os.listdir(f'{job}-local')   # a finished run leaves its fast tier empty


@pytest.mark.slow
def test_a_bucket_job_keeps_its_ledger_there_and_its_fast_tier_local(tmp_path, capsys):
  """The job directory in a bucket (a real GCS-protocol server on 127.0.0.1): the ledger goes there, the fast
  tier stays on this machine's disk, and a killed run resumes from it."""
  import gcs_server
  with gcs_server.running() as server:
    job = server.make_bucket('pax-goodput') + '/runs/tiny'
    local = str(tmp_path / 'local')
    cmd = [sys.executable, '-m', 'paxcli.cli.app', 'train', *TINY, '--set', 'task.train.num_train_steps=8',
           '--set', f'LOCAL_CHECKPOINT_DIR={local}', '--set', 'LOCAL_CHECKPOINT_EVERY=2', '--job-log-dir', job]
    _kill_at_step_5(cmd)
    assert any(n.startswith('process_') for n in os.listdir(local))
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r'Resumed from step [246] of the fast checkpoint tier', result.stdout), result.stdout[-2000:]
    account = _account(job, capsys)
    (restart,) = account['restarts']
    assert restart['tier'] == 'fast' and account['step'] == 8 and account['steps']['productive'] <= 8
    assert sum(account['seconds'].values()) == pytest.approx(account['wall_seconds'], rel=1e-9)
    from paxcli.jobdir import layout, storage
    runs = [n for n in storage.listdir(layout.goodput(job)) if layout.goodput_process(n) == 0]
    assert len(runs) == 2 and not os.listdir(local)   # each run of process 0 its own object in the bucket
