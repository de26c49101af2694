"""Issue 12 through `pax train`/`pax eval`/`pax launch`: never lose or silently corrupt a run.

One small run (20 steps, checkpoints every 4, the last 3 kept) is trained once per module;
each test works on a copy of its job directory.
"""

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import pax_main, run_pax

TINY = ['--exp', 'lm_cloud.LmCloudSpmdTest', '--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=32',
        '--set', 'HIDDEN_DIMS=64', '--set', 'NUM_HEADS=2', '--set', 'DIMS_PER_HEAD=16', '--set', 'VOCAB_SIZE=64',
        '--set', 'MAX_SEQ_LEN=16', '--set', 'PERCORE_BATCH_SIZE=1', '--set', 'task.train.save_interval_steps=4',
        '--set', 'task.train.summary_interval_steps=4']


def steps(n):
  return ['--set', f'task.train.num_train_steps={n}']


def _metrics(job):
  with open(os.path.join(job, 'train_metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def _checkpoints(job):
  return sorted(int(s) for s in os.listdir(os.path.join(job, 'checkpoints')) if s.isdigit())


def _error_line(err):
  lines = [l for l in err.strip().splitlines() if l.strip() and not l.startswith('WARNING:absl')]
  assert 'Traceback' not in err, err[-3000:]
  return lines[-1]


@pytest.fixture(scope='module')
def base(tmp_path_factory):
  """A finished 20-step run: checkpoints 12, 16, 20."""
  job = str(tmp_path_factory.mktemp('base') / 'job')
  result = run_pax('train', *TINY, *steps(20), '--job-log-dir', job)
  assert result.returncode == 0, result.stderr
  assert _checkpoints(job) == [12, 16, 20]
  return job


@pytest.fixture(scope='module')
def reference_24(base, tmp_path_factory):
  """The loss at step 24 of the same run, resumed from its intact step 20."""
  job = str(tmp_path_factory.mktemp('ref') / 'job')
  shutil.copytree(base, job)
  result = run_pax('train', *TINY, *steps(24), '--job-log-dir', job)
  assert result.returncode == 0, result.stderr
  return _metrics(job)[-1]['loss']


def _copy(base, tmp_path):
  job = str(tmp_path / 'job')
  shutil.copytree(base, job)
  return job


# ---- 1, 8: the job-directory lock --------------------------------------------------------------


def test_second_trainer_is_refused_and_the_first_finishes_intact(tmp_path):
  job = str(tmp_path / 'job')
  first = subprocess.Popen([sys.executable, '-m', 'paxcli.cli.app', 'train', *TINY, *steps(100000), '--set',
                            'task.train.save_interval_steps=2', '--job-log-dir', job],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.time() + 300
    while time.time() < deadline and first.poll() is None and not (
        os.path.isdir(os.path.join(job, 'checkpoints')) and _checkpoints(job)):
      time.sleep(0.2)
    assert first.poll() is None, first.communicate()
    second = run_pax('train', *TINY, *steps(100000), '--set', 'task.train.save_interval_steps=2',
                     '--set', 'LEARNING_RATE=0.01', '--job-log-dir', job)
  finally:
    first.send_signal(signal.SIGTERM)  # a preemption: the first saves where it is and stops
    out, err = first.communicate(timeout=600)
  assert second.returncode == 2
  line = _error_line(second.stderr)
  assert 'Another trainer is using this job directory' in line
  assert f'pid {first.pid}' in line and f'host {socket.gethostname()}' in line and 'started ' in line
  assert first.returncode == 143, err
  last = _checkpoints(job)[-1]
  assert f'saved a checkpoint at step {last}' in out
  with open(os.path.join(job, 'checkpoints', str(last), 'meta', 'metadata')) as f:
    meta = json.load(f)
  assert meta['config']['knobs.LEARNING_RATE'] == '0.001'  # the first run's, not the second's
  rows = [r['step'] for r in _metrics(job)]
  assert rows == sorted(set(rows))  # one run's rows, once each
  assert not os.path.exists(os.path.join(job, 'checkpoints_unfinished'))
  assert not os.path.exists(os.path.join(job, 'train.lock'))  # released at the end


def test_lock_of_another_host_is_refused(base, tmp_path, capsys):
  job = _copy(base, tmp_path)
  with open(os.path.join(job, 'train.lock'), 'w') as f:
    json.dump({'host': 'some-other-host', 'pid': 4242, 'started': '2026-01-01T00:00:00+00:00'}, f)
  code, _, err = pax_main(['train', *TINY, *steps(24), '--job-log-dir', job], capsys)
  assert code == 2
  line = _error_line(err)
  assert 'another host (host some-other-host, pid 4242' in line and 'remove' in line
  assert _checkpoints(job) == [12, 16, 20]


# ---- 13, 14 and a stale lock: a resume tidies the job directory ---------------------------------


def test_resume_takes_over_a_stale_lock_and_tidies_the_job_directory(base, tmp_path, capsys):
  job = _copy(base, tmp_path)
  reference = _metrics(job)[-1]
  # A trainer killed (-9) after its summary of step 20 and before its checkpoint 20 completed,
  # while an old checkpoint's deletion was interrupted.
  shutil.rmtree(os.path.join(job, 'checkpoints', '20'))
  with open(os.path.join(job, 'train_metrics.jsonl'), 'a') as f:
    f.write('{"step": 21, "lo')  # a row cut short by the kill
  os.makedirs(os.path.join(job, 'checkpoints', '8', 'state'))
  aside = os.path.join(job, 'checkpoints_unfinished')
  for i in range(4):
    os.makedirs(os.path.join(aside, f'{i}-old'))
    os.utime(os.path.join(aside, f'{i}-old'), (1e9 + i, 1e9 + i))
  dead = subprocess.Popen(['true'])
  dead.wait()
  with open(os.path.join(job, 'train.lock'), 'w') as f:
    json.dump({'host': socket.gethostname(), 'pid': dead.pid, 'started': 'earlier'}, f)

  code, out, err = pax_main(['train', *TINY, *steps(20), '--job-log-dir', job], capsys)
  assert code == 0, err
  assert f'taking over the lock of a trainer that is gone (host {socket.gethostname()}, pid {dead.pid}' in out
  assert 'step 8 is the leftover of an interrupted deletion' in out
  assert 'Resumed from step 16' in out
  rows = _metrics(job)
  assert [r['step'] for r in rows] == [4, 8, 12, 16, 20]  # one row per step after the resume
  assert rows[-1]['loss'] == pytest.approx(reference['loss'], rel=1e-6)
  kept = sorted(os.listdir(aside))
  assert len(kept) == 3 and '0-old' not in kept and '1-old' not in kept  # the most recent 3
  assert not os.path.exists(os.path.join(job, 'train.lock'))


# ---- 3: a runaway finite loss -----------------------------------------------------------------


def test_runaway_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(base, tmp_path, capsys):
  job = _copy(base, tmp_path)
  code, _, err = pax_main(['train', *TINY, *steps(60), '--set', 'LEARNING_RATE=1e6', '--job-log-dir', job], capsys)
  assert code == 3
  line = _error_line(err)
  assert 'The loss jumped to' in line and 'its median' in line and 'the last checkpoint is step 20' in line
  assert 'task.train.loss_spike_factor=0' in line
  assert _checkpoints(job) == [12, 16, 20]
  # With the check off the run goes on, and keeping the last 3 still keeps the best one (step 20).
  code, out, err = pax_main(['train', *TINY, *steps(40), '--set', 'LEARNING_RATE=1e6',
                             '--set', 'task.train.loss_spike_factor=0', '--job-log-dir', job], capsys)
  assert code == 0, err
  assert _metrics(job)[-1]['loss'] > 1000
  assert _checkpoints(job) == [20, 32, 36, 40]


# ---- 2, 6: damaged checkpoints ------------------------------------------------------------------


def _data_files(step_dir):
  found = []
  for root, _, names in os.walk(os.path.join(step_dir, 'state')):
    if os.path.basename(root) == 'd':
      found += [os.path.join(root, n) for n in names]
  return sorted(found, key=os.path.getsize)


@pytest.mark.parametrize('damage', ['flip_a_byte', 'truncate'])
def test_damaged_latest_checkpoint_is_set_aside_and_the_run_resumes_from_the_previous(
    damage, base, reference_24, tmp_path, capsys):
  job = _copy(base, tmp_path)
  # One byte flipped (or the second half cut off) in each array data file: which of orbax's
  # files a restore reads depends on the layout, so every one is damaged.
  for path in _data_files(os.path.join(job, 'checkpoints', '20')):
    size = os.path.getsize(path)
    with open(path, 'r+b') as f:
      if damage == 'flip_a_byte':
        f.seek(size // 2)
        byte = f.read(1)[0]
        f.seek(size // 2)
        f.write(bytes([byte ^ 0x01]))
      else:
        f.truncate(size // 2)
  code, out, err = pax_main(['train', *TINY, *steps(24), '--job-log-dir', job], capsys)
  assert code == 0, err
  assert 'WARNING: The checkpoint at step 20' in out and 'is damaged' in out
  assert 'Falling back to the checkpoint at step 16' in out and 'Resumed from step 16' in out
  damaged = os.listdir(os.path.join(job, 'checkpoints_damaged'))
  assert len(damaged) == 1 and damaged[0].startswith('20-')  # set aside, never deleted
  assert os.path.exists(os.path.join(job, 'checkpoints_damaged', damaged[0], 'state', '_METADATA'))
  assert _metrics(job)[-1]['loss'] == pytest.approx(reference_24, rel=1e-6)  # the reference loss
  assert _checkpoints(job) == [16, 20, 24]


def test_checksums_catch_one_flipped_bit_and_ignore_the_sharding():
  """What each save records and each restore checks (orbax/tensorstore check no array data)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from paxcli.jobdir import restore
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ('data', 'mdl'))
  named = lambda *spec: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
  w = np.random.default_rng(0).normal(size=(64, 32)).astype(np.float32)
  state = {'step': jnp.int32(7), 'params': {'w': jax.device_put(w, named('data', 'mdl')),
                                            'b16': jnp.ones((8,), jnp.bfloat16)}}
  sums = restore.checksums(state)
  assert set(sums) == {'step', 'params/w', 'params/b16'}
  resharded = dict(state, params=dict(state['params'], w=jax.device_put(w, named(None, 'data'))))
  assert restore.checksums(resharded) == sums  # another mesh layout: the same sums
  for index in [(0, 0), (13, 7), (63, 31)]:
    for bit in (0, 17, 31):
      flipped = w.view(np.uint32).copy()
      flipped[index] ^= np.uint32(1 << bit)
      changed = dict(state, params=dict(state['params'], w=jax.device_put(flipped.view(np.float32),
                                                                            named('data', 'mdl'))))
      now = restore.checksums(changed)
      assert now['params/w'] != sums['params/w'] and now['params/b16'] == sums['params/b16']
  swapped = w.copy()
  swapped[[0, 1]] = swapped[[1, 0]]  # the same values in another order
  assert restore.checksums(dict(state, params=dict(state['params'], w=jnp.asarray(swapped))))['params/w'] \
      != sums['params/w']


def test_eval_and_decode_name_a_damaged_checkpoint_and_use_the_previous_one(base, tmp_path, capsys):
  job = _copy(base, tmp_path)
  for path in _data_files(os.path.join(job, 'checkpoints', '20')):
    os.remove(path)
  os.remove(os.path.join(job, 'checkpoints', '16', 'state', '_METADATA'))
  code, out, err = pax_main(['eval', *TINY, '--job-log-dir', job, '--json'], capsys)
  assert code == 0, err
  assert 'The checkpoint at step 20' in err and 'its arrays cannot be read' in err, err
  assert "step 16 in" in err and 'state/_METADATA' in err and 'is missing' in err, err
  assert json.loads(out)['step'] == 12
  assert _checkpoints(job) == [12, 16, 20]  # eval only reads: nothing moved
  # pax decode does the same; a damaged --step is refused, naming it.
  code, out, err = pax_main(['decode', *TINY, '--job-log-dir', job, '--prompt-ids', '1,2', '--max-decode-steps', '2',
                             '--json'], capsys)
  assert code == 0, err
  assert 'The checkpoint at step 20' in err and 'Falling back' in err
  assert json.loads(out.splitlines()[0])['num_decoded_tokens'] == 2
  code, _, err = pax_main(['decode', *TINY, '--job-log-dir', job, '--step', '20', '--prompt-ids', '1,2'], capsys)
  assert code != 0 and 'The checkpoint at step 20' in _error_line(err) and 'is damaged' in _error_line(err)
  assert _checkpoints(job) == [12, 16, 20]


# ---- 9, 7: job directories that cannot hold a run -------------------------------------------------


def test_unusable_job_directories_are_refused_in_one_line(tmp_path, capsys):
  (tmp_path / 'afile').write_text('x')
  for job, expected in [(tmp_path / 'afile', 'is a file'),
                        (tmp_path / 'afile' / 'sub' / 'job', f'is under {tmp_path / "afile"}, which is a file')]:
    code, _, err = pax_main(['train', *TINY, *steps(4), '--job-log-dir', str(job)], capsys)
    assert code == 2 and expected in _error_line(err)
  bad_name = os.fsdecode(os.fsencode(str(tmp_path)) + b'/job-\xff')
  result = run_pax('train', *TINY, *steps(4), '--job-log-dir', bad_name)
  assert result.returncode == 2 and 'not UTF-8' in _error_line(result.stderr)


def _mount_tmpfs(path, options):
  os.makedirs(path, exist_ok=True)
  result = subprocess.run(['mount', '-t', 'tmpfs', '-o', options, 'tmpfs', str(path)], capture_output=True)
  if result.returncode != 0:
    pytest.skip(f'cannot mount a tmpfs here: {result.stderr.decode(errors="replace").strip()}')


# Read-only and permission-denied job directories, made with chmod (no mount, no skip). Root ignores
# file modes through two capabilities; `pax` runs as root without them (dropped from its bounding
# set before exec, so the modes apply to it as to its owner), or as nobody where that cannot be done.
# Any other user runs it as itself.
NOBODY = 65534
_PR_CAPBSET_DROP, _CAPS = 24, (1, 2, 3)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER


def _drop_permission_override():
  import ctypes
  libc = ctypes.CDLL(None, use_errno=True)
  for cap in _CAPS:
    if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
      raise OSError(ctypes.get_errno(), 'prctl(PR_CAPBSET_DROP)')


def _as_a_user_permissions_apply_to():
  if os.geteuid() != 0:
    return {}
  probe = subprocess.run([sys.executable, '-c', 'pass'], preexec_fn=_drop_permission_override, capture_output=True)
  if probe.returncode == 0:
    return {'preexec_fn': _drop_permission_override}
  return {'user': NOBODY, 'group': NOBODY, 'extra_groups': []}  # needs the venv readable by nobody


@pytest.fixture
def open_tmp():
  """A temporary directory another user can enter (pytest's own are 0700); writable again at the end."""
  path = pathlib.Path(tempfile.mkdtemp(prefix='paxcli-permissions-'))
  os.chmod(path, 0o755)
  (path / 'home').mkdir(mode=0o777)
  os.chmod(path / 'home', 0o777)
  yield path
  for root, dirs, _ in os.walk(path):
    for d in dirs:
      os.chmod(os.path.join(root, d), 0o755)
  shutil.rmtree(path)


def _run_unprivileged(args, tmp):
  as_user = _as_a_user_permissions_apply_to()
  env = {k: v for k, v in os.environ.items() if k != 'JAX_COMPILATION_CACHE_DIR'}  # root's, 0700
  env.update(HOME=str(tmp / 'home'), PAXCLI_CACHE=str(tmp / 'home' / 'cache'))
  return subprocess.run([sys.executable, '-m', 'paxcli.cli.app', *args], capture_output=True, text=True, env=env,
                        cwd=str(tmp / 'home'), timeout=600, **as_user)


def _chmod_tree(path, dirs, files):
  for root, ds, fs in os.walk(path):
    for f in fs:
      os.chmod(os.path.join(root, f), files)
    for d in ds:
      os.chmod(os.path.join(root, d), dirs)
  os.chmod(path, dirs)


def _snapshot(path):
  """Every entry under `path`: its mode, and for a file its bytes."""
  out = {}
  for root, ds, fs in os.walk(path):
    for name in ds + fs:
      full = os.path.join(root, name)
      out[os.path.relpath(full, path)] = (os.stat(full).st_mode,
                                           open(full, 'rb').read() if os.path.isfile(full) else None)
  return out


def _one_clear_line(result):
  lines = [l for l in result.stderr.strip().splitlines() if l.strip() and not l.startswith('WARNING:absl')]
  assert len(lines) == 1 and 'Traceback' not in result.stderr, result.stderr[-3000:]
  return lines[0]


def test_read_only_job_directory_is_refused_in_one_line_and_nothing_is_lost(base, open_tmp):
  """A finished run whose directory is read-only (chmod a-w) to the user who resumes it."""
  job = open_tmp / 'job'
  shutil.copytree(base, job)
  _chmod_tree(job, dirs=0o555, files=0o444)
  before = _snapshot(job)
  result = _run_unprivileged(['train', *TINY, *steps(24), '--job-log-dir', str(job)], open_tmp)
  assert result.returncode == 2, result.stderr[-3000:]
  assert _one_clear_line(result) == (f'error: Job directory {job} is not writable (permission denied). '
                                     'Choose another --job-log-dir.')
  assert _snapshot(job) == before  # checkpoints, metrics, config: every byte and mode as it was
  assert _checkpoints(str(job)) == [12, 16, 20]


def test_job_directory_under_a_directory_without_write_permission_is_refused(open_tmp):
  """A new run under a directory the user may read but not write: nothing is created."""
  runs = open_tmp / 'runs'
  (runs / 'other').mkdir(parents=True)
  (runs / 'other' / 'notes.txt').write_text('kept')
  _chmod_tree(runs, dirs=0o555, files=0o444)
  before = _snapshot(runs)
  job = runs / 'new' / 'job'
  result = _run_unprivileged(['train', *TINY, *steps(4), '--job-log-dir', str(job)], open_tmp)
  assert result.returncode == 2, result.stderr[-3000:]
  assert _one_clear_line(result) == (f'error: Job directory {job} is not writable (permission denied). '
                                     'Choose another --job-log-dir.')
  assert _snapshot(runs) == before and not (runs / 'new').exists()


@pytest.mark.slow
def test_disk_full_is_one_line_and_leaves_no_half_written_checkpoint(tmp_path):
  mount = tmp_path / 'small'
  _mount_tmpfs(mount, 'size=3m')
  try:
    job = str(mount / 'job')
    result = run_pax('train', *TINY, *steps(400), '--set', 'task.train.save_interval_steps=1',
                     '--set', 'task.train.save_max_to_keep=0', '--job-log-dir', job)
    assert result.returncode != 0
    line = _error_line(result.stderr)
    assert line.startswith('error: No space left on') and str(mount) in line and 'while saving step' in line
    assert len([l for l in result.stderr.splitlines() if l.strip() and 'WARNING' not in l]) == 1, result.stderr
    last = int(line.split('the last complete checkpoint is step ')[1].split('.')[0])
    entries = os.listdir(os.path.join(job, 'checkpoints'))
    assert not [e for e in entries if not e.isdigit()]  # no orbax tmp directory left behind
    assert max(_checkpoints(job)) == last
  finally:
    subprocess.run(['umount', '-l', str(mount)])


# ---- 4: the launcher dies, its children too ---------------------------------------------------------


@pytest.mark.slow  # two processes joined by jax.distributed: about 20 s on a quiet machine
def test_kill_9_of_the_launcher_leaves_no_process_behind(tmp_path):
  job = str(tmp_path / 'job')
  launcher = subprocess.Popen([sys.executable, '-m', 'paxcli.cli.app', 'launch', '--processes', '2',
                               '--devices-per-process', '1', '--', 'train', *TINY, *steps(100000),
                               '--job-log-dir', job], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  pids, seen = [], []
  deadline = time.time() + 300
  for line in launcher.stdout:
    seen.append(line)
    if 'p0 pid' in line:
      pids = [int(part.split()[-1]) for part in line.split(': ', 1)[1].split(', ')]
    if line.startswith('[p0] step '):  # both are in the train loop, exchanging collectives
      break
    assert time.time() < deadline, ''.join(seen)
  assert len(pids) == 2, ''.join(seen)
  launcher.send_signal(signal.SIGKILL)
  launcher.wait()
  deadline = time.time() + 10
  alive = pids
  while alive and time.time() < deadline:
    time.sleep(0.2)
    alive = [p for p in pids if _running(p)]
  for p in alive:
    os.kill(p, signal.SIGKILL)  # do not leave them to the next test
  assert not alive, f'children {alive} outlived the launcher by 10 s'


def _running(pid):
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
  except OSError:
    return False
