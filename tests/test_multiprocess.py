"""Several processes: jax.distributed start-up, multihost infeed, `pax launch`, checkpoints.

The tests marked by the `two_processes` fixture spawn real processes (2 x 4 fake CPU
devices, gloo collectives, real orbax checkpoints); each run is a few tiny steps.
"""

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import injected
from conftest import pax_main, run_pax
from tiny_runs import RTOL, TINY, losses as _losses, assert_same_losses as _close
from paxcli import config
from paxcli.runtime import distributed
from paxcli.runtime import infeed
from paxcli.runtime import sharding
from paxcli.errors import UserError

TWO_SLICES = ['--set', 'ICI_MESH_SHAPE=[1,4,1]', '--set', 'DCN_MESH_SHAPE=[2,1,1]']
LAUNCH_2x4 = ['launch', '--processes', '2', '--devices-per-process', '4', '--grace', '2', '--']


@pytest.fixture(scope='module')
def two_processes(tmp_path_factory):
  """6 steps on 2 processes x 4 devices, ICI [1,4,1] x DCN [2,1,1]; checkpoints at 3 and 6."""
  job = tmp_path_factory.mktemp('two') / 'job'
  result = run_pax(*LAUNCH_2x4, 'train', *TINY, *TWO_SLICES, '--set', 'PERCORE_BATCH_SIZE=1',
                   '--set', 'task.train.num_train_steps=6', '--job-log-dir', str(job), timeout=300)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
  return job, result


@pytest.fixture(scope='module')
def one_process(tmp_path_factory):
  """The same global batches on 1 process x 8 devices, 8 steps: a reference, trained in this process (its
  compilations then serve test_checkpoint_from_two_processes_resumes_in_one's run of the same step)."""
  from paxcli.cli.app import main
  job = tmp_path_factory.mktemp('one') / 'job'
  try:
    main(['train', *TINY, '--set', 'ICI_MESH_SHAPE=[1,8,1]', '--set', 'PERCORE_BATCH_SIZE=1',
          '--set', 'task.train.num_train_steps=8', '--job-log-dir', str(job)])
  except SystemExit as e:
    assert not e.code, f'pax train (one process) exited with {e.code}'
  return job


# ---- real processes ---------------------------------------------------------------------


def test_two_processes_train_like_one(two_processes, one_process):
  job, result = two_processes
  out = result.stdout
  # Each process logs its place once; only process 0 reports progress and writes summaries.
  assert out.count('[p0] Process 0 of 2: 4 local of 8 cpu devices') == 1
  assert out.count('[p1] Process 1 of 2: 4 local of 8 cpu devices') == 1
  assert '[p0] Devices: 8 x cpu (cpu), 2 process(es); mesh replica=2 x data=4 x mdl=1' in out
  assert '[p0] step 6: loss' in out and '[p1] step' not in out and '[p1] Experiment' not in out
  two, one = _losses(job), _losses(one_process)
  assert sorted(two) == [1, 2, 3, 4, 5, 6]
  _close(two, one, range(1, 7))
  assert two[6] < two[1]


def test_checkpoint_from_two_processes_resumes_in_one(two_processes, one_process, tmp_path, capsys):
  job = tmp_path / 'job'
  shutil.copytree(two_processes[0], job)
  code, out, err = pax_main(['train', *TINY, '--set', 'ICI_MESH_SHAPE=[1,8,1]', '--set', 'PERCORE_BATCH_SIZE=1',
                             '--set', 'task.train.num_train_steps=8', '--job-log-dir', str(job)], capsys)
  assert code == 0, err
  assert 'Resumed from step 6 (6 batches consumed)' in out
  assert 'input layout changed' in out and 'num_processes 2 -> 1' in out
  # The synthetic input is defined per global batch: steps 7-8 see the data of the
  # uninterrupted 1-process run and land on its losses.
  _close(_losses(job), _losses(one_process), [7, 8])


def test_eval_on_two_processes_equals_one(two_processes, capsys):
  """`pax eval` under `pax launch`: each host reads its rows, the metrics are global."""
  job = two_processes[0]
  result = run_pax(*LAUNCH_2x4, 'eval', *TINY, *TWO_SLICES, '--set', 'PERCORE_BATCH_SIZE=1',
                   '--job-log-dir', str(job), '--json', timeout=300)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  line = next(l for l in result.stdout.splitlines() if l.startswith('[p0] {'))
  two = json.loads(line[len('[p0] '):])
  code, out, err = pax_main(['eval', *TINY, '--set', 'ICI_MESH_SHAPE=[1,8,1]', '--set', 'PERCORE_BATCH_SIZE=1',
                             '--job-log-dir', str(job), '--json'], capsys)
  assert code == 0, err
  one = json.loads(out)
  assert two['step'] == one['step'] == 6
  assert two['results']['eval']['num_examples'] == one['results']['eval']['num_examples'] == 16
  np.testing.assert_allclose(two['results']['eval']['loss'], one['results']['eval']['loss'], rtol=RTOL)


@pytest.mark.slow  # ~50 s; run by `make test-slow`
def test_percore_below_one_lets_one_process_read_and_the_other_pad(tmp_path):
  # 2 processes x 4 devices, 8-way data parallelism, PERCORE_BATCH_SIZE 0.5: 4 examples a
  # step, read by process 0 alone; process 1 feeds 4 rows of zero weight (as in Pax).
  padded = tmp_path / 'padded'
  result = run_pax(*LAUNCH_2x4, 'train', *TINY, *TWO_SLICES, '--set', 'PERCORE_BATCH_SIZE=0.5',
                   '--set', 'task.train.num_train_steps=4', '--job-log-dir', str(padded), timeout=300)
  assert result.returncode == 0, result.stderr[-4000:]
  assert 'global batch 4 (padded to 8 rows: 1 of 2 processes read data' in result.stdout
  # The same 4 examples a step on 1 process x 4 devices, no padding.
  plain = tmp_path / 'plain'
  result = run_pax('train', *TINY, '--set', 'ICI_MESH_SHAPE=[1,4,1]', '--set', 'PERCORE_BATCH_SIZE=1',
                   '--set', 'task.train.num_train_steps=4', '--job-log-dir', str(plain),
                   env={'XLA_FLAGS': '--xla_force_host_platform_device_count=4'}, timeout=300)
  assert result.returncode == 0, result.stderr[-4000:]
  _close(_losses(padded), _losses(plain), range(1, 5))


@pytest.mark.slow
@pytest.mark.alone  # 4 jax.distributed processes: starved of CPU by another worker, they miss heartbeats
def test_checkpoint_from_two_processes_resumes_in_four(two_processes, one_process, tmp_path):
  """Slow (4 processes on a small machine): orbax reshards the 2-process checkpoint over 4."""
  job = tmp_path / 'job'
  shutil.copytree(two_processes[0], job)
  result = run_pax('launch', '--processes', '4', '--devices-per-process', '2', '--', 'train', *TINY,
                   '--set', 'ICI_MESH_SHAPE=[1,8,1]', '--set', 'PERCORE_BATCH_SIZE=1',
                   '--set', 'task.train.num_train_steps=8', '--job-log-dir', str(job), timeout=600)
  assert result.returncode == 0, result.stderr[-4000:]
  assert '[p0] Resumed from step 6' in result.stdout and 'num_processes 2 -> 4' in result.stdout
  _close(_losses(job), _losses(one_process), [7, 8])


START_TRIES = 3


def _launch_until_step_2(command):
  """(launcher, its reader thread, its line queue, lines seen, pids, seconds from launch to both processes'
  step 2). A start that ends before step 2 (gloo's fixed connect timeout, or a missed jax.distributed
  heartbeat, on a machine too loaded to start two processes in time) is tried again in a fresh job
  directory, up to START_TRIES times: the test is about what follows the start, and a start that is
  really broken fails every try (the failure shows the end of each)."""
  failed = []
  for attempt in range(START_TRIES):
    started = time.monotonic()
    launcher = subprocess.Popen(command(attempt), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in launcher.stdout], daemon=True)
    reader.start()
    seen, pids = [], {}
    while '[p0] step 2:' not in ''.join(seen):  # both processes are inside the train loop
      if launcher.poll() is not None and lines.empty():
        break
      assert time.monotonic() - started < 1200, ''.join(seen)[-3000:]  # a hang guard, nothing more
      try:
        seen.append(lines.get(timeout=1))
      except queue.Empty:
        continue
      pids.update({int(i): int(p) for i, p in re.findall(r'p(\d) pid (\d+)', seen[-1])})
    else:
      return launcher, reader, lines, seen, pids, time.monotonic() - started
    reader.join(10)
    seen += [lines.get() for _ in range(lines.qsize())]
    failed.append(f'start {attempt + 1} ended before step 2 after {time.monotonic() - started:.0f} s:\n'
                  + ''.join(seen)[-1500:])
  raise AssertionError('\n'.join(failed))


@pytest.mark.slow   # two processes to their second step, then the stop: a minute on a quiet machine
@pytest.mark.alone  # 2 jax.distributed processes: starved of CPU by another worker, gloo's connect times out
def test_launcher_stops_the_others_when_one_process_dies(tmp_path):
  """After a `kill -9` of p1 the launcher ends p0 itself instead of leaving it to JAX's 100 s heartbeat: p0
  either finds its peer gone in a collective and says so in one line (issue 38: not gloo's 70-line
  traceback), or sits blocked and is stopped (SIGTERM, which JAX's preemption handler takes, then SIGKILL
  after --grace 2), which the launcher says. gloo's connection lines are hidden and counted."""
  def command(attempt):
    return [sys.executable, '-m', 'paxcli.cli.app', *LAUNCH_2x4, 'train', *TINY, *TWO_SLICES,
            '--set', 'PERCORE_BATCH_SIZE=1', '--set', 'task.train.num_train_steps=100000',
            '--set', 'task.train.save_interval_steps=100000', '--job-log-dir', str(tmp_path / f'job{attempt}')]
  launcher, reader, lines, seen, pids, _ = _launch_until_step_2(command)
  try:
    os.kill(pids[1], signal.SIGKILL)
    launcher.wait(timeout=600)   # a hang guard
  finally:
    if launcher.poll() is None:
      launcher.kill()
  reader.join(10)
  while not lines.empty():
    seen.append(lines.get())
  text = ''.join(seen)
  assert launcher.returncode == 137
  assert f'process p1 (pid {pids[1]}) was killed by SIGKILL (exit code -9); stopped the other' in text, text[-3000:]
  with pytest.raises(ProcessLookupError):
    os.kill(pids[0], 0)
  survivor = [line for line in text.splitlines() if line.startswith('[p0] ')]
  said = [line for line in survivor if 'error: lost ' in line]
  stopped = f'pid {pids[0]} did not stop within 2 s of SIGTERM; killed it.' in text
  assert len(said) <= 1 and (said or stopped), text[-3000:]
  assert not any('Traceback' in line or line.startswith('[p0]   File ') for line in survivor), text[-3000:]
  shown = text.replace('"[Gloo] Rank N is connected" line(s) hidden', '')
  assert '[Gloo] Rank' not in shown and 'is connected to' not in shown, text[-3000:]
  assert 'line(s) hidden; --verbose shows them' in text


@pytest.mark.slow
@pytest.mark.alone  # 2 jax.distributed processes
def test_a_process_whose_peer_dies_in_a_collective_says_so_in_one_line(tmp_path):
  """Issue 38: p1 is killed (`kill -9`, by itself, right after dispatching step 3) while p0 is in that step's
  gloo collectives. p0 says in one line that another process is gone, instead of gloo's 70-line traceback,
  and exits by itself (not frozen by a SIGTERM that JAX's runtime takes for a preemption notice, nor held by
  JAX's shutdown barrier, until the launcher kills it); the launcher names p1."""
  env = injected.env(tmp_path, injected.DIES_IN_A_STEP, PAXCLI_TEST_DIE_AT='3')
  done = run_pax('launch', '--processes', '2', '--grace', '60', '--', 'train', '--set', 'NUM_LAYERS=1',
                 '--set', 'MODEL_DIMS=32', '--set', 'HIDDEN_DIMS=64', '--set', 'NUM_HEADS=2', '--set', 'MAX_SEQ_LEN=16',
                 '--set', 'PERCORE_BATCH_SIZE=2', '--set', 'NUM_TRAIN_STEPS=100', '--set', 'SAVE_INTERVAL_STEPS=1000',
                 '--job-log-dir', str(tmp_path / 'job'), env=env, timeout=900)
  text = done.stdout + done.stderr
  assert done.returncode == 137, text[-3000:]
  assert re.search(r'process p1 \(pid \d+\) was killed by SIGKILL \(exit code -9\); stopped the other', text), text[-3000:]
  survivor = [line for line in text.splitlines() if line.startswith('[p0] ') and not line.startswith('[p0] step ')]
  said = [line for line in survivor if 'error:' in line]
  assert len(said) == 1 and said[0].startswith('[p0] error: lost process 1 on '), text[-3000:]
  # Its collective fails (gloo), or it is still waiting on one when the launcher's note of p1's death comes.
  assert any(why in said[0] for why in ('connection reset by peer', 'connection closed by peer',
                                        'pax launch saw it was killed by SIGKILL')), said
  assert not any('Traceback' in line or line.startswith('[p0]   File ') for line in survivor), text[-3000:]
  assert 'did not stop within' not in text, text[-3000:]   # p0 ended by itself, at once


def test_launcher_refuses_commands_that_cannot_run_on_several_processes(capsys):
  code, _, err = pax_main(['launch', '--processes', '2', '--', 'describe'], capsys)
  assert code == 2 and 'cannot run as several processes' in err and 'train' in err
  code, _, err = pax_main(['launch', '--processes', '2'], capsys)
  assert code == 2 and 'Give the pax command' in err


@pytest.mark.filterwarnings('ignore:os.fork')  # JAX's warning: this test process imported JAX
def test_child_failure_is_reported_with_its_exit_code(capsys, tmp_path, monkeypatch):
  from paxcli.cli import launch
  monkeypatch.setattr(launch, '_others_end', lambda timeout: 0.5)   # p0 sleeps on: it would not end by itself
  envs = [dict(os.environ, PAX_PROCESS_ID=str(i)) for i in range(2)]
  ready = str(tmp_path / 'p0_said_hello')   # p1 fails only once p0 has spoken, however slow p0's start
  argv = [sys.executable, '-c', 'import os, sys, time\n'
          'i = int(os.environ["PAX_PROCESS_ID"])\nprint("hello from", i, flush=True)\n'
          f'if i == 0: open({ready!r}, "w").close(); time.sleep(60)\n'
          f'while not os.path.exists({ready!r}): time.sleep(0.05)\n'
          'sys.exit(3)']
  assert launch.run_children(argv, envs, grace=1) == 3
  out, err = capsys.readouterr()
  assert '[p0] hello from 0' in out and '[p1] hello from 1' in out
  assert re.search(r'process p1 \(pid \d+\) exited with code 3; stopped the other processes', err)


@pytest.mark.filterwarnings('ignore:os.fork')
def test_after_a_failure_the_others_end_by_themselves_before_any_sigterm(capsys, tmp_path):
  """A child's failure is no preemption: the others are not sent SIGTERM at once (JAX's runtime would take it as a
  notice and wait, frozen, for the failed process to agree on a step); they get OTHERS_END_SECONDS to see the
  failure and end in their own words."""
  from paxcli.cli import launch
  envs = [dict(os.environ, PAX_PROCESS_ID=str(i)) for i in range(2)]
  failed = str(tmp_path / 'p1_failed')
  argv = [sys.executable, '-c', 'import os, signal, sys, time\n'
          'signal.signal(signal.SIGTERM, lambda *_: (print("p0 got SIGTERM", flush=True), sys.exit(143)))\n'
          'i = int(os.environ["PAX_PROCESS_ID"])\n'
          f'if i == 1: open({failed!r}, "w").close(); sys.exit(3)\n'
          f'while not os.path.exists({failed!r}): time.sleep(0.05)\n'
          'time.sleep(1)\nprint("error: lost process 1", flush=True)\nsys.exit(124)']
  assert launch.run_children(argv, envs, grace=1) == 3
  out, err = capsys.readouterr()
  assert '[p0] error: lost process 1' in out and 'SIGTERM' not in out, out
  assert 'did not stop within' not in err


@pytest.mark.filterwarnings('ignore:os.fork')
@pytest.mark.parametrize('verbose', [False, True])
def test_gloo_connection_lines_are_hidden_unless_verbose(capsys, verbose):
  """gloo's threads cut their `[Gloo] Rank N is connected` lines into pieces; the launcher hides them all
  (counting them) and keeps every other line, unless --verbose."""
  from paxcli.cli import launch
  pieces = ['[Gloo] Rank [Gloo] Rank 12 is connected to  is connected to 33 peer ranks.  peer ranks. Expected '
            'number of connected peer ranks is : Expected number of connected peer ranks is : 33', '',
            '[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1',
            'step 1: loss 4.2', '42']
  argv = [sys.executable, '-c', f'import sys\nfor line in {pieces!r}: print(line, file=sys.stderr)']
  assert launch.run_children(argv, [dict(os.environ)], verbose=verbose) == 0
  err = capsys.readouterr().err
  assert '[p0] step 1: loss 4.2' in err and '[p0] 42' in err
  assert ('[p0] [Gloo] Rank 0 is connected' in err) == verbose
  assert ('2 "[Gloo] Rank N is connected" line(s) hidden; --verbose shows them.' in err) == (not verbose)


# ---- infeed -------------------------------------------------------------------------------


@pytest.mark.parametrize('exp', ['lm_cloud.LmCloudSpmdTest', 'default.StdlibDocsLm'])
def test_training_inputs_differ_between_hosts(exp):
  """Pax's check: the same input built for host 0 and host 1 of 2 must never emit the same batch."""
  resolved = config.resolve(exp, ['MAX_SEQ_LEN=16'])
  cfg = resolved.train_dataset()
  hosts = [infeed.build_input(cfg, process_batch=4, num_hosts=2, host_index=h) for h in range(2)]
  whole = infeed.build_input(cfg, process_batch=8, num_hosts=1, host_index=0)
  for _ in range(3):
    a, b = (h.get_next() for h in hosts)
    assert a['ids'].shape == (4, 16)
    assert not {r.tobytes() for r in a['ids']} & {r.tobytes() for r in b['ids']}
    # ... and together they are the batch one process would read alone.
    np.testing.assert_array_equal(np.concatenate([a['ids'], b['ids']]), whole.get_next()['ids'])


def test_infeed_plan_on_one_process():
  mesh = sharding.make_mesh([1, 4, 2])
  plan = infeed.plan_infeed(mesh, 8)
  assert (plan.rows, plan.process_rows, plan.num_hosts, plan.host_index) == (8, 8, 1, 0)
  with pytest.raises(UserError, match='global batch of 2 examples does not divide over the 4-way'):
    infeed.plan_infeed(mesh, 2)


def test_infeed_plan_for_processes_with_padding_hosts():
  # 4 processes x 2 devices, 8-way data parallelism, PERCORE_BATCH_SIZE 0.5: 4 examples in
  # an 8-row array of which each process holds 2 rows; processes 0, 1 read, 2, 3 pad.
  rows = {p: set(range(2 * p, 2 * p + 2)) for p in range(4)}
  plans = [infeed.infeed_from_rows(rows, 4, 8, 8, p) for p in range(4)]
  assert [p.host_index for p in plans] == [0, 1, None, None]
  assert {(p.num_hosts, p.process_rows, p.rows) for p in plans} == {(2, 2, 8)}
  assert 'padded to 8 rows: 2 of 4 processes read data' in plans[0].describe()
  # Process order need not be row order: the host index follows the rows.
  swapped = {0: rows[1], 1: rows[0], 2: rows[2], 3: rows[3]}
  assert infeed.infeed_from_rows(swapped, 8, 8, 8, 0).host_index == 1
  # Model parallelism across processes: two processes hold the same rows, read the same data.
  shared = {0: {0, 1}, 1: {0, 1}, 2: {2, 3}, 3: {2, 3}}
  assert [infeed.infeed_from_rows(shared, 4, 4, 2, p).host_index for p in range(4)] == [0, 0, 1, 1]
  with pytest.raises(UserError, match='must be a multiple of 2'):
    infeed.infeed_from_rows(rows, 3, 8, 8, 0)
  with pytest.raises(UserError, match='uneven or overlapping'):
    infeed.infeed_from_rows({0: {0, 1, 2}, 1: {3}}, 4, 4, 4, 0)


def test_padding_host_feeds_zero_weights():
  resolved = config.resolve('lm_cloud.LmCloudSpmdTest', ['MAX_SEQ_LEN=16'])
  inp = infeed.PaddingInput(infeed.build_input(resolved.train_dataset(), process_batch=4, num_hosts=1,
                                               host_index=0))
  batch = inp.get_next()
  assert batch['weights'].shape == (4, 16) and not batch['weights'].any() and not batch['ids'].any()
  inp.skip(2)
  assert inp.batches_read == 3


# ---- start-up and mesh ---------------------------------------------------------------------


def test_settings_flags_win_over_environment_and_are_checked():
  env = {'PAX_COORDINATOR': '10.0.0.1:1234', 'PAX_NUM_PROCESSES': '4', 'PAX_PROCESS_ID': '3'}
  assert distributed.settings_from(environ=env) == distributed.Settings('10.0.0.1:1234', 4, 3)
  assert distributed.settings_from('h:1', 2, 1, environ=env) == distributed.Settings('h:1', 2, 1)
  assert distributed.settings_from(num_processes=1, environ={}).single
  assert not distributed.settings_from(environ={}).given
  with pytest.raises(UserError, match='PAX_NUM_PROCESSES=.two. is not a whole number'):
    distributed.settings_from(environ={'PAX_NUM_PROCESSES': 'two'})
  with pytest.raises(UserError, match='--process-id 2 is out of range'):
    distributed.settings_from('h:1', 2, 2, environ={})
  with pytest.raises(UserError, match='HOST:PORT'):
    distributed.settings_from('10.0.0.1', 2, 0, environ={})


def test_child_environment_drops_proxies_and_sets_devices():
  base = {'https_proxy': 'http://proxy:3128', 'HTTP_PROXY': 'x', 'no_proxy': 'y', 'PATH': '/bin',
          'XLA_FLAGS': '--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/d'}
  env = distributed.child_environment(base, '127.0.0.1:5', 2, 1, cpu_devices=4)
  assert not [k for k in env if 'proxy' in k.lower()]
  assert env['XLA_FLAGS'] == '--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=4'
  assert (env['PAX_COORDINATOR'], env['PAX_NUM_PROCESSES'], env['PAX_PROCESS_ID']) == ('127.0.0.1:5', '2', '1')
  gpu = distributed.child_environment(base, '127.0.0.1:5', 2, 1, visible_devices=[2, 3])
  assert gpu['JAX_LOCAL_DEVICE_IDS'] == '2,3' and gpu['XLA_FLAGS'] == base['XLA_FLAGS']


def test_dcn_mesh_on_one_process_and_its_errors():
  import jax
  mesh = sharding.make_mesh([1, 4, 1], [2, 1, 1])
  assert dict(mesh.shape) == {'replica': 2, 'data': 4, 'mdl': 1}
  # Slice g (DCN coordinate g) holds the g-th group of devices.
  assert {d.id for d in mesh.devices[0].flat} == {d.id for d in jax.devices()[:4]}
  with pytest.raises(UserError, match='inside one of the 2 DCN slices, so its entries must multiply to 4'):
    sharding.make_mesh([1, 8, 1], [2, 1, 1])
  with pytest.raises(UserError, match=r'product of DCN_MESH_SHAPE \(3\) must divide the 8 devices'):
    sharding.make_mesh([1, 1, 1], [3, 1, 1])
