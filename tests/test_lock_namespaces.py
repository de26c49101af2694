"""The trainer's lock across PID namespaces (issue 37, 6): containers with host networking share a host
name but not their pids. A holder runs in a real second PID namespace (`unshare --pid --fork
--mount-proc`); `pax train` in this one must not judge it by a pid of its own namespace, for a job
directory on a local disk (flock, then renewals) and in a bucket (a lease)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import gcs_server
from conftest import pax_main

TINY = ['--exp', 'lm_cloud.LmCloudSpmdTest', '--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=32',
        '--set', 'HIDDEN_DIMS=64', '--set', 'NUM_HEADS=2', '--set', 'DIMS_PER_HEAD=16', '--set', 'VOCAB_SIZE=64',
        '--set', 'MAX_SEQ_LEN=16', '--set', 'PERCORE_BATCH_SIZE=1', '--set', 'task.train.save_interval_steps=2']
UNSHARE = ['unshare', '--pid', '--fork', '--mount-proc', '--kill-child']


def _namespaces_available() -> str:
  try:
    done = subprocess.run([*UNSHARE, 'true'], capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.TimeoutExpired) as e:
    return f'unshare is not available ({e})'
  return '' if done.returncode == 0 else f'unshare --pid needs root here ({done.stderr.strip()[:200]})'


pytestmark = pytest.mark.skipif(bool(_namespaces_available()), reason=_namespaces_available() or 'ok')

HOLDER = textwrap.dedent('''
    import sys, time
    from paxcli.jobdir import lock
    where, lease = sys.argv[1], float(sys.argv[2])
    held = lock.JobLock(where) if not where.startswith('gs://') else lock.BucketLease(where + '/train.lock', lease)
    owner = held.acquire()
    assert owner is None, owner
    print('held', flush=True)
    time.sleep(3600)
''')


class Holder:
  """A process in a new PID namespace holding the lock of `where` (a local job, or a bucket job's lease)."""

  def __init__(self, tmp_path, where: str, lease_s: float = 60.0):
    script = tmp_path / 'holder.py'
    script.write_text(HOLDER)
    self.proc = subprocess.Popen([*UNSHARE, sys.executable, str(script), where, str(lease_s)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    line = self.proc.stdout.readline()
    assert line.strip() == 'held', self.proc.stderr.read()[-3000:]

  def kill(self) -> None:
    """SIGKILL, as a container is stopped: its record stays behind, never released."""
    if self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGKILL)
      self.proc.wait(30)


@pytest.fixture
def holders():
  made = []
  yield lambda *args, **kw: made.append(Holder(*args, **kw)) or made[-1]
  for holder in made:
    holder.kill()


def _line(code, err, want_code=2):
  lines = [l for l in err.strip().splitlines() if l.strip() and not l.startswith('WARNING')]
  assert code == want_code and 'Traceback' not in err, err[-3000:]
  return lines[-1]


def _record(path) -> dict:
  with open(path) as f:
    return json.load(f)


def test_a_local_job_locked_from_another_namespace_is_judged_by_its_renewals(tmp_path, holders, capsys):
  job = str(tmp_path / 'job')
  os.makedirs(job)
  holder = holders(tmp_path, job)
  lock_file = os.path.join(job, 'train.lock')
  owner = _record(lock_file)
  assert owner['pid'] == 1 and owner['pid_ns'] and owner['boot_id']   # pid 1 there; here pid 1 is init, alive

  train = ['train', *TINY, '--set', 'task.train.num_train_steps=4', '--job-log-dir', job]
  line = _line(*pax_main(train, capsys)[::2])
  assert 'Another trainer is using this job directory' in line and 'pid 1' in line   # the flock, held
  from paxcli.jobdir import lock
  assert lock.trainer_state(lock.read_owner(job)) == 'running'   # what a follower concludes

  holder.kill()   # the flock goes with it; its record stays, last renewed moments ago
  line = _line(*pax_main(train, capsys)[::2])
  assert 'renewed' in line and 'from another host or PID namespace' in line and 'after its last renewal' in line
  assert _record(lock_file) == owner   # refused: left as it was
  assert lock.trainer_state(lock.read_owner(job)) == 'running'

  old = time.time() - 2 * lock.LEASE_S   # its lease lapsed: as if two minutes had passed without a renewal
  os.utime(lock_file, (old, old))
  assert lock.trainer_state(lock.read_owner(job)) == 'dead'
  code, out, err = pax_main(train, capsys)
  assert code == 0, err[-3000:]
  assert 'taking over the lock of a trainer that is gone (host' in out and 'pid 1,' in out
  assert not os.path.exists(lock_file)


def test_a_local_lock_of_this_namespace_is_still_judged_by_its_pid(tmp_path, capsys):
  """The shortcut holds where it is provable: a record of this boot and namespace naming a dead pid is
  taken over at once, without waiting for its lease."""
  from paxcli.jobdir import lock
  job = str(tmp_path / 'job')
  os.makedirs(job)
  dead = subprocess.Popen(['true'])
  dead.wait()
  record = {'host': os.uname().nodename, 'pid': dead.pid, 'boot_id': lock.boot_id(), 'pid_ns': lock.pid_namespace(),
            'lease_s': lock.LEASE_S, 'started': 'now', 'command': 'pax train'}
  with open(os.path.join(job, 'train.lock'), 'w') as f:
    json.dump(record, f)
  code, out, err = pax_main(['train', *TINY, '--set', 'task.train.num_train_steps=2', '--job-log-dir', job], capsys)
  assert code == 0, err[-3000:]
  assert f'taking over the lock of a trainer that is gone (host {record["host"]}, pid {dead.pid}' in out


@pytest.fixture(scope='module')
def server():
  with gcs_server.running() as s:
    yield s


def test_a_bucket_lease_held_from_another_namespace_is_live_while_renewed(server, tmp_path, holders, capsys):
  """The issue's case: the second trainer judged the live owner gone (its pid was not in this /proc) and
  took over at once. Both ways round: the holder in another namespace, then the contender."""
  bucket = server.make_bucket('pax-namespaces')
  job = f'{bucket}/run'
  from paxcli.jobdir import lock, storage
  holder = holders(tmp_path, job, 4.0)   # a real lease, renewed every second
  train = ['train', *TINY, '--set', 'task.train.num_train_steps=2', '--job-log-dir', job]
  line = _line(*pax_main(train, capsys)[::2])
  assert 'Another trainer is using this job directory' in line and 'pid 1,' in line
  time.sleep(2)   # renewed meanwhile, and still refused
  line = _line(*pax_main(train, capsys)[::2])
  assert 'Another trainer is using this job directory' in line
  assert not storage.exists(f'{job}/checkpoints')

  holder.kill()   # no renewal any more: its lease lapses 4 s after the last one
  time.sleep(5)
  code, out, err = pax_main(train, capsys)
  assert code == 0, err[-3000:]
  assert 'taking over the lock of a trainer that is gone (host' in out

  # This process holds the lease; a trainer in another namespace sees a pid it cannot ask about.
  here = lock.BucketJobLock(f'{bucket}/other')
  here.acquire()
  try:
    result = subprocess.run([*UNSHARE, sys.executable, '-m', 'paxcli.cli.app', 'train', *TINY,
                             '--set', 'task.train.num_train_steps=2', '--job-log-dir', f'{bucket}/other'],
                            capture_output=True, text=True, timeout=300)
  finally:
    here.release()
  line = _line(result.returncode, result.stderr)
  assert 'Another trainer is using this job directory' in line and f'pid {os.getpid()}' in line
  assert not storage.exists(f'{bucket}/other/checkpoints')
