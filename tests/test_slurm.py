"""SLURM for real: Debian's slurmctld and two slurmd nodes, each in its own network and UTS namespace, munge auth.

The cluster (tests/slurm_cluster.py) runs as root, as CI does; the packages are installed from Debian's archive
where missing, and the tests skip, saying why, only where the machine cannot (not root, no apt-get). Every run
is a tiny model for a few steps; the losses of a job are held to one process on 8 devices.
"""

import json
import os
import re
import signal
import subprocess
import time

import pytest

import slurm_cluster
import tiny_runs
from tiny_runs import PAX, TINY, assert_same_losses, cpu_devices, losses

pytestmark = [pytest.mark.slow, pytest.mark.alone]   # several jax.distributed processes on 2 cores

REFERENCE_STEPS = 30


@pytest.fixture(scope='module')
def cluster(tmp_path_factory):
  reason = slurm_cluster.unavailable()
  if reason:
    pytest.skip(reason)
  cluster = slurm_cluster.Cluster.start(str(tmp_path_factory.mktemp('slurm')), nodes=2)
  yield cluster
  cluster.stop()


@pytest.fixture(scope='module')
def one_process(tmp_path_factory):
  """The uninterrupted reference: 1 process x 8 devices, global batch 8."""
  return tiny_runs.one_process(tmp_path_factory.mktemp('one') / 'job', REFERENCE_STEPS)


def env_with(cluster, devices: int, **extra) -> dict:
  """The jobs' environment: fake CPU devices per process, no SLURM_* of ours."""
  return cpu_devices(cluster.env(**extra), devices)


def launch_slurm(cluster, args: list[str], cwd, env=None) -> tuple[int, str]:
  """`pax launch --slurm ... --submit -- train ...` on the control host: (job id, what it printed)."""
  result = cluster.run([*PAX, 'launch', '--slurm', *args], env=env or cluster.env(), cwd=str(cwd), check=False)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
  return int(re.search(r'Submitted SLURM job (\d+)', result.stdout).group(1)), result.stdout


def output(job_dir, job_id: int, name: str = 'pax-train') -> str:
  path = os.path.join(job_dir, 'slurm', f'{name}-{job_id}.out')
  return open(path, encoding='utf-8', errors='replace').read() if os.path.exists(path) else ''


def wait_for_text(cluster, job_dir, job_id: int, pattern: str, timeout: float = 900) -> re.Match:
  deadline = time.monotonic() + timeout
  while True:
    found = re.search(pattern, output(job_dir, job_id))
    if found:
      return found
    state = cluster.job(job_id).get('JobState')
    assert state not in ('COMPLETED', 'FAILED', 'CANCELLED', 'TIMEOUT'), (state, output(job_dir, job_id)[-3000:])
    assert time.monotonic() < deadline, output(job_dir, job_id)[-3000:]   # a hang guard only
    time.sleep(0.5)


def resumed_from(cluster, job_dir, job_id: int, starts: int, timeout: float = 900) -> int:
  """The step the `starts`-th requeue of the job resumed from, once it did."""
  deadline = time.monotonic() + timeout
  while True:
    found = re.findall(r'Resumed from step (\d+) ', output(job_dir, job_id))
    if len(found) >= starts:
      return int(found[starts - 1])
    assert not finished(cluster.job(job_id)), output(job_dir, job_id)[-3000:]
    assert time.monotonic() < deadline, output(job_dir, job_id)[-3000:]   # a hang guard only
    time.sleep(0.5)


def finished(job: dict) -> bool:
  return job.get('JobState') in ('COMPLETED', 'FAILED', 'CANCELLED', 'TIMEOUT', 'NODE_FAIL', 'OUT_OF_MEMORY')


# ---- 2 nodes, both modes ----------------------------------------------------------------------------


def test_srun_on_two_nodes_trains_like_one_process(cluster, one_process, tmp_path):
  """`srun -N 2 -n 2 pax train`: a process per node (4 devices each), JAX's SLURM detection with paxcli's port."""
  job = tmp_path / 'job'
  result = cluster.run(['srun', '-N', '2', '-n', '2', *PAX, 'train', *TINY, '--set', 'PERCORE_BATCH_SIZE=1',
                        '--set', 'task.train.num_train_steps=6', '--job-log-dir', str(job)],
                       env=env_with(cluster, 4), cwd=str(tmp_path), timeout=1200, check=False)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  out = result.stdout
  assert re.search(r'Detected a SlurmCluster cluster; started JAX distributed \(coordinator node1:6\d{4}\)', out), out
  assert 'Process 0 of 2: 4 local of 8 cpu devices' in out and 'Process 1 of 2: 4 local of 8 cpu devices' in out
  assert_same_losses(losses(job), one_process, range(1, 7))


def test_sbatch_script_with_a_process_per_device(cluster, one_process, tmp_path):
  """`pax launch --slurm --nodes 2 --tasks-per-node 2 --devices-per-process 1 --submit`: 4 processes of one
  device each, the same global batch of 8 (PERCORE_BATCH_SIZE=2), the same losses."""
  job = tmp_path / 'job'
  job_id, shown = launch_slurm(cluster, ['--nodes', '2', '--tasks-per-node', '2', '--devices-per-process', '1',
                                         '--submit', '--', 'train', *TINY, '--set', 'PERCORE_BATCH_SIZE=2',
                                         '--set', 'task.train.num_train_steps=6', '--job-log-dir', 'job'], tmp_path)
  assert '#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n' in shown and '#SBATCH --requeue' in shown
  assert f'Wrote {job}/slurm/pax-train.sbatch' in shown   # the relative --job-log-dir, made absolute once
  state = cluster.wait(job_id, finished, timeout=1200)
  text = output(job, job_id)
  assert state['JobState'] == 'COMPLETED', text[-3000:]
  assert 'Process 3 of 4: 1 local of 4 cpu devices' in text, text[-3000:]
  assert '[pax-slurm] finished.' in text
  assert_same_losses(losses(job), one_process, range(1, 7))


# ---- partial SLURM environments ------------------------------------------------------------------


def test_salloc_shell_with_two_tasks_is_refused_with_the_srun_line(cluster, tmp_path):
  result = cluster.run(['salloc', '-N', '2', '-n', '2', *PAX, 'train', '--set', 'task.train.num_train_steps=2'],
                       env=env_with(cluster, 4), cwd=str(tmp_path), check=False, timeout=600)
  assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
  error = [line for line in result.stderr.splitlines() if line.startswith('error:')]
  assert len(error) == 1, result.stderr
  assert "a shell in SLURM job" in error[0] and 'SLURM_NTASKS=2 on 2 node(s)' in error[0]
  assert 'srun pax train --set task.train.num_train_steps=2' in error[0]
  assert 'Traceback' not in result.stderr
  assert not (tmp_path / 'runs').exists()


def test_sbatch_script_without_srun_is_refused_and_one_task_runs_as_one_process(cluster, tmp_path):
  """An sbatch script of 2 tasks that calls pax without srun: refused in its output; with one task: one line, and
  one process trains."""
  command = ' '.join([*PAX, 'train', *TINY, '--set', 'task.train.num_train_steps=2', '--job-log-dir', 'job'])
  jobs = {}
  for tasks in (2, 1):
    jobs[tasks] = cluster.sbatch(['-N', str(tasks), '-n', str(tasks), '-o', f'{tmp_path}/out-{tasks}.txt',
                                  f'--wrap={command}'], env=env_with(cluster, 8), cwd=str(tmp_path))
  refused = cluster.wait(jobs[2], finished)
  text = (tmp_path / 'out-2.txt').read_text()
  assert refused['JobState'] == 'FAILED' and refused['ExitCode'] == '2:0', text
  assert 'the batch script of SLURM job' in text and 'SLURM_NTASKS=2 on 2 node(s)' in text
  assert 'Start one process per task with: srun pax train' in text and 'Traceback' not in text
  one = cluster.wait(jobs[1], finished, timeout=900)
  text = (tmp_path / 'out-1.txt').read_text()
  assert one['JobState'] == 'COMPLETED', text[-3000:]
  assert 'has 1 task and no job step (no SLURM_STEP_NODELIST): running as one process' in text
  assert 'Devices: 8 x cpu (cpu), 1 process(es)' in text


# ---- two steps of one allocation -------------------------------------------------------------------


def test_two_concurrent_steps_of_one_job_take_their_own_coordinator_ports(cluster, tmp_path):
  """A job of 4 tasks runs two 2-process trainings side by side (two srun steps): JAX alone would give both
  the job's one port, and the second would join the first's coordinator."""
  steps = []
  for name in ('a', 'b'):
    steps.append(' '.join(['srun', '-N', '2', '-n', '2', '--exact', *PAX, 'train', *TINY,
                           '--set', 'task.train.num_train_steps=4', '--job-log-dir', name, f'> {name}.log 2>&1 &']))
  script = tmp_path / 'two.sh'
  script.write_text('#!/bin/bash\n' + '\n'.join(steps) + '\nwait\n')
  job_id = cluster.sbatch(['-N', '2', '--ntasks-per-node', '2', '-o', f'{tmp_path}/two.out', str(script)],
                          env=env_with(cluster, 4), cwd=str(tmp_path))
  state = cluster.wait(job_id, finished, timeout=1500)
  logs = {name: (tmp_path / f'{name}.log').read_text() for name in ('a', 'b')}
  assert state['JobState'] == 'COMPLETED', logs
  ports = {name: re.search(r'coordinator node1:(\d+)', log).group(1) for name, log in logs.items()}
  assert ports['a'] != ports['b'], ports
  for name in ('a', 'b'):
    assert 'Done: step 4' in logs[name], logs[name][-3000:]
    assert sorted(losses(tmp_path / name)) == [1, 2, 3, 4]


def test_sbatch_export_none_runs_pax_by_its_interpreter(cluster, tmp_path):
  """`sbatch --export=NONE` starts the script without this environment (no venv on PATH): the script paxcli
  wrote calls its interpreter by path, and exports what the run needs (--env)."""
  keep = [f'--env={k}={os.environ[k]}' for k in ('JAX_PLATFORMS', 'JAX_COMPILATION_CACHE_DIR', 'PAXCLI_CACHE')
          if k in os.environ]
  result = cluster.run([*PAX, 'launch', '--slurm', '--nodes', '2', '--devices-per-process', '4', *keep, '--',
                        'train', *TINY, '--set', 'task.train.num_train_steps=3', '--job-log-dir', 'job'],
                       cwd=str(tmp_path))
  script = re.search(r'Wrote (\S+)', result.stdout).group(1)
  env = cluster.env(PATH='/usr/sbin:/usr/bin:/sbin:/bin')
  job_id = cluster.sbatch(['--export=NONE', script], env=env, cwd=str(tmp_path))
  state = cluster.wait(job_id, finished, timeout=1200)
  text = output(tmp_path / 'job', job_id)
  assert state['JobState'] == 'COMPLETED', text[-3000:]
  assert 'execve' not in text and 'Done: step 3' in text


# ---- preemption and requeue ------------------------------------------------------------------------


def train_pid(cluster, node: str) -> int:
  """The pid of the `pax train` process running on `node` (in its network namespace)."""
  pids = [pid for pid in slurm_cluster.pids_on(cluster, node)
          if b'paxcli.cli.app\x00train' in open(f'/proc/{pid}/cmdline', 'rb').read()]
  assert len(pids) == 1, pids
  return pids[0]


def test_preemptions_of_one_node_by_scancel_and_by_a_higher_priority_job_lose_no_step(cluster, one_process, tmp_path):
  """Three preemptions of one job: SIGTERM to the process on node2 alone, `scancel --signal=TERM`, and a job of a
  higher-priority partition that needs both nodes (SLURM's PreemptMode=REQUEUE: SIGTERM, grace, its own requeue).
  Each time every process saves the step they agree on and exits 143, the job is requeued and resumes from that
  step (0 steps lost); the losses are those of an uninterrupted run; `pax goodput` counts the three requeues."""
  job = tmp_path / 'job'
  job_id, _ = launch_slurm(cluster, ['--nodes', '2', '--devices-per-process', '4', '--submit', '--', 'train',
                                     *TINY, '--set', 'PERCORE_BATCH_SIZE=1', '--set', 'task.train.save_interval_steps=100',
                                     '--set', f'task.train.num_train_steps={REFERENCE_STEPS}', '--job-log-dir', 'job'],
                           tmp_path, env=env_with(cluster, 4))
  preempt = [lambda: os.kill(train_pid(cluster, 'node2'), signal.SIGTERM),
             lambda: cluster.run(['scancel', '--signal=TERM', str(job_id)]),
             lambda: cluster.sbatch(['--partition=urgent', '--exclusive', '-N', '2', '-o', f'{tmp_path}/urgent.out',
                                     '--wrap=sleep 1'], cwd=str(tmp_path))]
  resumed = 0
  for starts, event in enumerate(preempt, start=1):
    wait_for_text(cluster, job, job_id, rf'step {resumed + 4}:')
    event()
    resumed = resumed_from(cluster, job, job_id, starts)
  state = cluster.wait(job_id, finished, timeout=1500)
  text = output(job, job_id)
  assert state['JobState'] == 'COMPLETED' and state['Restarts'] == '3', text[-4000:]
  saved = [int(s) for s in re.findall(r'all agreed to stop after step (\d+); saved a checkpoint at step \1', text)]
  assert saved == [int(s) for s in re.findall(r'Resumed from step (\d+) ', text)] and saved[-1] == resumed, text[-4000:]
  assert text.count('stopped for preemption after saving (exit code 143); requeueing.') == 3
  assert_same_losses(losses(job), one_process, range(1, REFERENCE_STEPS + 1))
  account = json.loads(subprocess.run([*PAX, 'goodput', str(job), '--json'], capture_output=True, text=True,
                                      check=True).stdout)
  assert [r['reason'].split(':')[0] for r in account['restarts']] == [
      f'requeued by SLURM (job {job_id}, requeue {i})' for i in (1, 2, 3)], account['restarts']
  assert [(r['resumed_step'], r['redone_steps']) for r in account['restarts']] == [(s, 0) for s in saved]


def test_time_limit_warning_usr1_saves_and_requeues(cluster, tmp_path):
  """`--time 3 --warn-before 60`: SLURM signals SIGUSR1 60 s before the limit (its check runs every 30 s); the
  processes save the step they agree on and the job requeues with a new time limit, resuming from that step."""
  job = tmp_path / 'job'
  job_id, shown = launch_slurm(cluster, ['--nodes', '2', '--devices-per-process', '4', '--time', '3',
                                         '--warn-before', '60', '--submit', '--', 'train', *TINY,
                                         '--set', 'task.train.save_interval_steps=100000', *tiny_runs.steps(100000),
                                         '--job-log-dir', 'job'], tmp_path, env=env_with(cluster, 4))
  assert '#SBATCH --time=3\n' in shown and '#SBATCH --signal=USR1@60\n' in shown
  saved = int(wait_for_text(cluster, job, job_id, r'all agreed to stop after step (\d+); saved', 600).group(1))
  wait_for_text(cluster, job, job_id, rf'Resumed from step {saved} ', 600)
  cluster.run(['scancel', str(job_id)])
  text = output(job, job_id)
  assert 'SIGUSR1: a preemption warning; every process saves the step they agree on and stops.' in text
  assert 'stopped for preemption after saving (exit code 143); requeueing.' in text
  assert 'TIMEOUT' not in text and 'DUE TO TIME LIMIT' not in text, text[-3000:]


def test_a_cut_link_stops_the_job_and_slurm_brings_it_back_from_the_fast_tier(cluster, one_process, tmp_path):
  """node2's link goes down mid-run: both processes end within --heartbeat-timeout, each with one line naming
  the other host; the script requeues the failed job (--max-restarts 1) and, the link back, it resumes from the
  newest step of the fast checkpoint tier to the losses of an uninterrupted run."""
  job = tmp_path / 'job'
  job_id, _ = launch_slurm(cluster, ['--nodes', '2', '--devices-per-process', '4', '--max-restarts', '1',
                                     '--heartbeat-timeout', '15', '--submit', '--', 'train', *TINY,
                                     '--set', 'PERCORE_BATCH_SIZE=1', '--set', 'task.train.save_interval_steps=100',
                                     '--set', f'LOCAL_CHECKPOINT_DIR={tmp_path}/local', '--set', 'LOCAL_CHECKPOINT_EVERY=2',
                                     '--set', f'task.train.num_train_steps={REFERENCE_STEPS}', '--job-log-dir', 'job'],
                           tmp_path, env=env_with(cluster, 4))
  wait_for_text(cluster, job, job_id, r'step 7:')
  cluster.net.cut('node2')
  try:
    wait_for_text(cluster, job, job_id, r'error: lost process 1 on node2 \(10\.77\.0\.12\): ', 300)
  finally:
    cluster.net.mend('node2')
  state = cluster.wait(job_id, finished, timeout=1500)
  text = output(job, job_id)
  assert state['JobState'] == 'COMPLETED' and state['Restarts'] == '1', text[-4000:]
  assert re.search(r'error: cannot reach the coordinator, process 0 at node1:\d+, for 15 s', text), text[-4000:]
  assert '[pax-slurm] exit code 124; failure 1 of at most 1 requeued.' in text
  assert 'Traceback' not in text and 'Check failure' not in text
  step = int(re.search(r'Resumed from step (\d+) of the fast checkpoint tier', text).group(1))
  assert step >= 6 and step % 2 == 0
  assert_same_losses(losses(job), one_process, range(1, REFERENCE_STEPS + 1))
