"""SLURM and a real network, measured on the tests' cluster (root only): what a job waits for and what a fault costs.

  sudo .venv/bin/python benchmarks/cluster.py [--timeouts 10,30] [--steps 40] [--parts start,preempt,kill,cut]

Brings up Debian's slurmctld, two slurmd nodes (each in its own network namespace) and munge, as
tests/test_slurm.py does, and a tiny LM on 2 processes x 4 fake CPU devices (`pax launch --slurm`):

1. sbatch to first step: from `pax launch --slurm --submit` to the job running, to JAX distributed
   started, and to the first train step; with a cold XLA compilation cache, then a warm one.
2. A preemption (`scancel --signal=TERM` at step 8): the steps lost (the furthest step reached less the
   step resumed from: 0 expected) and the seconds from the signal to the first new step of the requeued job.
3. A `kill -9` of node2's process at step 12, with a fast tier every 5 steps (LOCAL_CHECKPOINT_EVERY) and the
   persistent tier every 100: the steps lost, and the seconds from the kill to the first new step.
4. A cut link (`ip link set down`, no SLURM): the seconds from the cut to every process stopped, for each
   --heartbeat-timeout in --timeouts.

The machine is shared and noisy: read each row against its own parts, not across runs.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'tests')
sys.path.insert(0, TESTS)

import cluster_net  # noqa: E402  (the tests' helpers: the same cluster the tests run)
import slurm_cluster  # noqa: E402
import machine   # benchmarks/machine.py: the processor beside the table

PAX = [sys.executable, '-m', 'paxcli.cli.app']
TINY = ['--exp', 'lm_cloud.LmCloudSpmdTest', '--set', 'NUM_LAYERS=2', '--set', 'MODEL_DIMS=32',
        '--set', 'HIDDEN_DIMS=64', '--set', 'NUM_HEADS=4', '--set', 'DIMS_PER_HEAD=8', '--set', 'MAX_SEQ_LEN=16',
        '--set', 'VOCAB_SIZE=64', '--set', 'task.train.summary_interval_steps=1', '--set', 'PERCORE_BATCH_SIZE=1']


class Job:
  """A `pax launch --slurm --submit` job whose output is watched line by line, with the time each line was seen."""

  def __init__(self, cluster, work: str, name: str, steps: int, extra: list[str], env: dict, launch: list[str] = ()):
    self.cluster, self.job_dir = cluster, os.path.join(work, name)
    self.submitted = time.monotonic()
    done = cluster.run([*PAX, 'launch', '--slurm', '--nodes', '2', '--devices-per-process', '4', *launch, '--submit',
                        '--', 'train', *TINY, '--set', f'task.train.num_train_steps={steps}', *extra,
                        '--job-log-dir', self.job_dir], env=env, cwd=work)
    self.id = int(re.search(r'Submitted SLURM job (\d+)', done.stdout).group(1))
    self.out = os.path.join(self.job_dir, 'slurm', f'pax-train-{self.id}.out')
    self.seen: list[tuple[float, str]] = []

  def poll(self) -> None:
    if os.path.exists(self.out):
      with open(self.out, encoding='utf-8', errors='replace') as f:
        lines = f.read().splitlines()
      now = time.monotonic()
      self.seen += [(now, line) for line in lines[len(self.seen):]]

  def until(self, pattern: str, after: float = 0.0, timeout: float = 1200) -> tuple[float, re.Match]:
    deadline = time.monotonic() + timeout
    while True:
      self.poll()
      for t, line in self.seen:
        found = re.search(pattern, line)
        if found and t >= after:
          return t, found
      if time.monotonic() > deadline:
        raise TimeoutError(f'{pattern!r} not seen in {self.out}')
      time.sleep(0.1)

  def steps_before(self, t: float) -> int:
    return max((int(m.group(1)) for s, line in self.seen if s <= t for m in [re.match(r'step (\d+):', line)] if m),
               default=0)

  def finish(self) -> dict:
    return self.cluster.wait(self.id, lambda j: j.get('JobState') in ('COMPLETED', 'FAILED', 'CANCELLED'), 1800)


def start_to_first_step(cluster, work: str, env: dict, name: str) -> dict:
  job = Job(cluster, work, name, 6, [], env)
  running = None
  while running is None:
    state = cluster.job(job.id)
    running = time.monotonic() if state.get('JobState') == 'RUNNING' else None
    time.sleep(0.1)
  distributed, _ = job.until(r'Detected a SlurmCluster cluster')
  first, _ = job.until(r'^step 1:')
  job.finish()
  return {'running': running - job.submitted, 'distributed': distributed - job.submitted,
          'first step': first - job.submitted}


def preemption(cluster, work: str, env: dict, steps: int) -> dict:
  job = Job(cluster, work, 'preempted', steps, ['--set', 'task.train.save_interval_steps=100'], env)
  job.until(r'^step 8:')
  signalled = time.monotonic()
  cluster.run(['scancel', '--signal=TERM', str(job.id)])
  _, saved = job.until(r'agreed to stop after step (\d+)', after=signalled)
  resumed_at, resumed = job.until(r'Resumed from step (\d+) ', after=signalled)
  first, _ = job.until(rf'^step {int(resumed.group(1)) + 1}:', after=resumed_at)
  reached = job.steps_before(resumed_at)
  job.finish()
  return {'saved': int(saved.group(1)), 'reached': reached, 'resumed': int(resumed.group(1)),
          'lost': reached - int(resumed.group(1)), 'to first new step': first - signalled}


def kill_9(cluster, work: str, env: dict, steps: int) -> dict:
  job = Job(cluster, work, 'killed', steps, ['--set', 'task.train.save_interval_steps=100',
                                             '--set', f'LOCAL_CHECKPOINT_DIR={work}/local', '--set',
                                             'LOCAL_CHECKPOINT_EVERY=5'], env, launch=['--max-restarts', '1'])
  job.until(r'^step 12:')
  pid = next(p for p in slurm_cluster.pids_on(cluster, 'node2')
             if b'paxcli.cli.app\x00train' in open(f'/proc/{p}/cmdline', 'rb').read())
  os.kill(pid, signal.SIGKILL)
  killed = time.monotonic()
  stopped, _ = job.until(r'\[pax-slurm\] exit code', after=killed)
  resumed_at, resumed = job.until(r'Resumed from step (\d+) ', after=killed)
  first, _ = job.until(rf'^step {int(resumed.group(1)) + 1}:', after=resumed_at)
  reached = job.steps_before(killed + 1)
  job.finish()
  return {'reached': reached, 'resumed': int(resumed.group(1)), 'lost': reached - int(resumed.group(1)),
          'stopped': stopped - killed, 'to first new step': first - killed}


def cut_link(work: str, timeout: int) -> float:
  """Seconds from node2's link cut to both processes of a run over it stopped (no SLURM)."""
  net = cluster_net.Network.start(os.path.join(work, f'net-{timeout}'), ['node1', 'node2'])
  env = {k: v for k, v in os.environ.items() if '_proxy' not in k.lower()}
  env['XLA_FLAGS'] = '--xla_force_host_platform_device_count=4'
  try:
    procs = [net.popen(host, [*PAX, 'train', *TINY, '--set', 'task.train.num_train_steps=100000',
                              '--coordinator', 'node1:12400', '--num-processes', '2', '--process-id', str(i),
                              '--heartbeat-timeout', str(timeout),
                              '--job-log-dir', os.path.join(work, f'cut-{timeout}')],
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for i, host in enumerate(['node1', 'node2'])]
    while 'step 3:' not in procs[0].stdout.readline():
      pass
    cut = time.monotonic()
    net.cut('node2')
    for p in procs:
      p.wait(timeout=600)
    return time.monotonic() - cut
  finally:
    net.stop()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--timeouts', default='10,30', help='--heartbeat-timeout values for the cut link')
  parser.add_argument('--steps', type=int, default=40)
  parser.add_argument('--parts', default='start,preempt,kill,cut', help='which of the measures to run')
  args = parser.parse_args()
  parts = set(args.parts.split(','))
  reason = slurm_cluster.unavailable()
  if reason:
    sys.exit(f'cannot bring up the cluster here: {reason}')
  from rich.console import Console
  from rich.table import Table
  work = tempfile.mkdtemp(prefix='pax-cluster-bench-')
  cluster = slurm_cluster.Cluster.start(os.path.join(work, 'slurm'), nodes=2)
  env = cluster.env(XLA_FLAGS='--xla_force_host_platform_device_count=4', JAX_PLATFORMS='cpu',
                    JAX_COMPILATION_CACHE_DIR=os.path.join(work, 'xla-cache'),
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0')
  rows = {}
  try:
    if 'start' in parts:
      rows['cold'] = start_to_first_step(cluster, work, env, 'cold')
      rows['warm'] = start_to_first_step(cluster, work, env, 'warm')
    if 'preempt' in parts:
      rows['preempted'] = preemption(cluster, work, env, args.steps)
    if 'kill' in parts:
      rows['killed'] = kill_9(cluster, work, env, args.steps)
  finally:
    cluster.stop()
  cuts = {int(t): cut_link(work, int(t)) for t in args.timeouts.split(',')} if 'cut' in parts else {}
  console = Console()
  if 'cold' in rows:
    t = Table(title=f'SLURM 22.05, 2 nodes x 1 process x 4 CPU devices, a tiny LM, on {machine.processor()}')
    for col in ('', 'job running s', 'JAX distributed s', 'first step s'):
      t.add_column(col, justify='right' if col else 'left')
    for name, row in (('sbatch to first step, cold XLA cache', rows['cold']),
                      ('sbatch to first step, warm', rows['warm'])):
      t.add_row(name, f"{row['running']:.1f}", f"{row['distributed']:.1f}", f"{row['first step']:.1f}")
    console.print(t)
    console.print(machine.describe())
  if 'preempted' in rows or 'killed' in rows:
    t = Table(title=f'What a fault costs, on {machine.processor()}')
    for col in ('fault', 'furthest step', 'resumed from', 'steps lost', 'others stopped s', 'to first new step s'):
      t.add_column(col, justify='left' if col == 'fault' else 'right')
    if 'preempted' in rows:
      row = rows['preempted']
      t.add_row('scancel --signal=TERM at step 8', str(row['reached']), str(row['resumed']), str(row['lost']), '-',
                f"{row['to first new step']:.1f}")
    if 'killed' in rows:
      row = rows['killed']
      t.add_row("kill -9 of node2's process at step 12 (fast tier every 5)", str(row['reached']), str(row['resumed']),
                str(row['lost']), f"{row['stopped']:.1f}", f"{row['to first new step']:.1f}")
    console.print(t)
    console.print(machine.describe())
  if cuts:
    t = Table(title=f'A cut link: seconds to every process stopped, on {machine.processor()}')
    t.add_column('--heartbeat-timeout', justify='right')
    t.add_column('cut to all stopped s', justify='right')
    for timeout, seconds in cuts.items():
      t.add_row(str(timeout), f'{seconds:.1f}')
    console.print(t)
    console.print(machine.describe())


if __name__ == '__main__':
  main()
