"""Job directories in a bucket (`--job-log-dir gs://...`), against a real GCS-protocol server on
127.0.0.1 (tests/gcs_server.py: fake-gcs-server; gcsfs and tensorstore reach it by their endpoint
settings). One trained bucket job serves the module; the kill -9 resume is slow."""

import json
import os
import signal
import struct
import subprocess
import sys
import time
import types

import pytest

import gcs_server
from conftest import pax_main, run_pax

TINY = ['--exp', 'lm_cloud.LmCloudSpmdTest', '--set', 'MODEL_DIMS=32', '--set', 'HIDDEN_DIMS=64',
        '--set', 'NUM_HEADS=4', '--set', 'PERCORE_BATCH_SIZE=1', '--set', 'MAX_SEQ_LEN=16', '--set', 'VOCAB_SIZE=64']
TRAIN = ['train', *TINY, '--set', 'task.train.num_train_steps=10', '--set', 'task.train.save_interval_steps=5',
         '--set', 'EVAL_INTERVAL_STEPS=5']


def _one_line(err: str) -> str:
  """The one line of an error, after the line naming the job's own settings (`... (as trained ...)`)."""
  lines = [l for l in err.strip().splitlines() if l.strip() and '(as trained' not in l]
  assert len(lines) == 1 and 'Traceback' not in err, err[-3000:]
  return lines[0]


@pytest.fixture(scope='module')
def server():
  with gcs_server.running() as s:
    yield s


@pytest.fixture(scope='module')
def job(server, tmp_path_factory):
  """A job trained into the bucket by `pax train` in a fresh process, from an empty directory."""
  bucket = server.make_bucket('pax-tests')
  cwd = tmp_path_factory.mktemp('cwd')
  path = f'{bucket}/runs/tiny'
  result = run_pax(*TRAIN, '--job-log-dir', path, cwd=str(cwd))
  assert result.returncode == 0, result.stderr[-3000:]
  return types.SimpleNamespace(path=path, bucket=bucket, cwd=cwd, out=result.stdout, err=result.stderr)


def _storage():
  from paxcli.jobdir import storage
  return storage


def _jsonl(path):
  return [json.loads(line) for line in _storage().read_text(path).splitlines()]


def _events(data: bytes) -> list:
  """The Event protos of a TensorBoard event file's bytes (TFRecord framing)."""
  from tensorboard.compat.proto import event_pb2
  out, i = [], 0
  while i < len(data):
    (n,) = struct.unpack('<Q', data[i:i + 8])
    out.append(event_pb2.Event.FromString(data[i + 12:i + 12 + n]))
    i += 12 + n + 4
  return out


def test_train_writes_its_whole_job_into_the_bucket(job):
  storage = _storage()
  from paxcli.jobdir import checkpoint, layout
  assert checkpoint.complete_steps(layout.checkpoints(job.path)) == [5, 10]
  assert [r['step'] for r in _jsonl(layout.train_metrics(job.path))] == [10]   # summary every 10 steps
  assert [r['step'] for r in _jsonl(os.path.join(job.path, 'eval_metrics.jsonl'))] == [5, 10]
  assert storage.read_text(layout.config(job.path)).strip()
  assert 'pax train' in storage.read_text(layout.invocations(job.path))
  train_events = storage.listdir(layout.summaries(job.path, 'train'))
  assert len(train_events) == 1
  events = _events(storage.read_bytes(os.path.join(layout.summaries(job.path, 'train'), train_events[0])))
  tags = {(e.step, v.tag) for e in events for v in e.summary.value}
  assert (10, 'loss') in tags
  assert not storage.exists(layout.lock(job.path))            # released at the end
  assert json.loads(storage.read_text(layout.format_file(job.path)))['format_version'] >= 1
  assert os.listdir(job.cwd) == []                            # nothing local: no `gs:/...` directory
  assert f'checkpoints: {job.path}/checkpoints' in job.out
  # Issue 38: tensorstore's INFO line naming the credentials it chose is held back (once per process).
  assert 'google_auth_provider' not in job.err and 'GOOGLE_AUTH_TOKEN_FOR_TESTING' not in job.err, job.err


def test_eval_decode_score_and_inspect_read_the_bucket_job(job, tmp_path, capsys):
  storage = _storage()
  code, out, err = pax_main(['eval', *TINY, '--job-log-dir', job.path, '--json'], capsys)
  assert code == 0, err
  result = json.loads(out)
  during = _jsonl(os.path.join(job.path, 'eval_metrics.jsonl'))
  assert result['step'] == 10 and abs(result['results']['eval']['loss'] - during[-1]['loss']) < 1e-5

  code, out, err = pax_main(['decode', *TINY, '--job-log-dir', job.path, '--prompt-ids', '1,2,3',
                             '--max-decode-steps', '4', '--json'], capsys)
  assert code == 0, err
  written = f'{job.path}/decoder_out/prompts/pax_decode_step10_1.jsonl'
  assert _jsonl(written) == [json.loads(line) for line in out.strip().splitlines()]

  requests = tmp_path / 'requests.jsonl'
  requests.write_text(json.dumps({'context_ids': [1, 2], 'continuation_ids': [3, 4]}) + '\n')
  code, out, err = pax_main(['score', str(requests), *TINY, '--job-log-dir', job.path], capsys)
  assert code == 0, err
  scored = _jsonl(f'{job.path}/scores/pax_score_step10_1.jsonl')
  assert len(scored) == 1 and scored[0]['logprob'] < 0

  code, out, err = pax_main(['checkpoint', 'inspect', job.path, '--json'], capsys)
  assert code == 0, err
  info = json.loads(out)
  assert info['path'] == job.path and info['step'] == 10 and info['has_optimizer_state']
  assert storage.listdir(f'{job.path}/checkpoints') == ['10', '5']   # readers changed nothing


def test_convert_reads_a_bucket_job_and_writes_one(job, tmp_path, capsys):
  out_path = f'{job.bucket}/converted/params'
  code, out, err = pax_main(['checkpoint', 'convert', job.path, out_path, '--params-only', '--json'], capsys)
  assert code == 0, err
  result = json.loads(out)
  assert result['source'] == job.path and result['output'] == out_path and result['verify']['ok']
  code, out, err = pax_main(['checkpoint', 'inspect', out_path, '--json'], capsys)
  assert code == 0, err
  assert not json.loads(out)['has_optimizer_state']
  from paxcli.jobdir import restore
  assert restore.read_meta(out_path, 10)['converted_from']['path'] == job.path

  local = tmp_path / 'local'
  code, out, err = pax_main(['checkpoint', 'convert', out_path, str(local), '--json'], capsys)
  assert code == 0, err
  assert json.loads(out)['verify']['ok'] and (local / 'checkpoints' / '10' / 'commit_success.txt').exists()
  code, out, err = pax_main(['checkpoint', 'convert', job.path, out_path, '--params-only'], capsys)
  assert code == 2 and 'exists; pass --force' in _one_line(err)   # never replaced without --force


def test_a_second_trainer_is_refused_while_the_lease_is_held(job, capsys):
  from paxcli.jobdir import lock
  held = lock.BucketJobLock(job.path)
  held.acquire()
  try:
    code, out, err = pax_main([*TRAIN, '--job-log-dir', job.path], capsys)
  finally:
    held.release()
  assert code == 2
  line = _one_line(err)
  assert 'Another trainer is using this job directory' in line and f'pid {os.getpid()}' in line
  assert not _storage().exists(f'{job.path}/train.lock')


def test_the_lease_of_a_gone_trainer_is_taken_over_and_a_live_one_is_not(server, capsys):
  from paxcli.jobdir import lock
  storage = _storage()
  bucket = server.make_bucket('pax-lease')
  path = f'{bucket}/run/train.lock'
  other = {'host': 'another-host', 'pid': 1, 'started': 'then', 'command': 'pax train'}
  assert storage.create_new(path, json.dumps({**other, 'lease_s': 600}).encode())
  with pytest.raises(Exception, match='another-host'):
    lock.BucketJobLock(f'{bucket}/run').acquire()
  assert json.loads(storage.read_bytes(path))['host'] == 'another-host'   # a live lease is left alone

  storage.write_bytes(path, json.dumps({**other, 'lease_s': 1}).encode())
  time.sleep(1.5)   # unrenewed past its lease (the bucket's clock of the last write)
  notes = []
  taker = lock.BucketJobLock(f'{bucket}/run')
  taker.acquire(log=notes.append)
  assert 'taking over the lock of a trainer that is gone (host another-host' in notes[0]
  assert json.loads(storage.read_bytes(path))['pid'] == os.getpid()
  second = lock.BucketJobLock(f'{bucket}/run')
  with pytest.raises(Exception, match='Another trainer'):   # the taker's own lease is live
    second.acquire()
  taker.release()
  assert not storage.exists(path)


def test_a_damaged_checkpoint_in_the_bucket_is_detected_and_skipped(job, capsys):
  storage = _storage()
  copy = f'{job.bucket}/damaged'
  for name in storage.walk_files(job.path):
    if name.startswith('checkpoints/') or name == 'config.txt':
      storage.write_bytes(f'{copy}/{name}', storage.read_bytes(f'{job.path}/{name}'))
  chunks = [n for n in storage.walk_files(f'{copy}/checkpoints/10/state') if n.startswith('d/') or '/d/' in n]
  assert chunks
  for name in chunks:   # every array chunk of step 10 cut to half its length
    data = storage.read_bytes(f'{copy}/checkpoints/10/state/{name}')
    storage.write_bytes(f'{copy}/checkpoints/10/state/{name}', data[:len(data) // 2])
  code, out, err = pax_main(['eval', *TINY, '--job-log-dir', copy, '--json'], capsys)
  assert code == 0, err
  assert json.loads(out)['step'] == 5
  assert 'The checkpoint at step 10 in' in err and 'is damaged' in err and 'Falling back to the checkpoint at step 5' in err
  code, out, err = pax_main(['eval', *TINY, '--job-log-dir', copy, '--step', '10'], capsys)
  assert code == 1 and 'is damaged' in _one_line(err)


def test_bad_bucket_input_is_one_line(job, server, tmp_path, capsys):
  code, out, err = pax_main(['eval', *TINY, '--job-log-dir', 's3://somewhere/run'], capsys)
  assert code == 2 and 'cannot read or write s3:// paths' in _one_line(err)
  assert not (tmp_path / 's3:').exists()

  code, out, err = pax_main(['train', *TINY, '--job-log-dir', 'gs://no-such-bucket/run'], capsys)
  assert code == 1 and 'The bucket gs://no-such-bucket does not exist' in _one_line(err)

  # A bucket path that holds files but no job: what a local directory of files gives.
  _storage().write_text(f'{job.bucket}/notes/readme.txt', 'not a job\n')
  code, out, err = pax_main(['eval', *TINY, '--job-log-dir', f'{job.bucket}/notes'], capsys)
  assert code == 2 and f'No complete checkpoint in {job.bucket}/notes/checkpoints' in _one_line(err)

  closed = gcs_server._free_port()   # nothing listens there
  result = run_pax('train', *TINY, '--job-log-dir', f'{job.bucket}/run2', timeout=120,
                   env=gcs_server.client_env(f'http://127.0.0.1:{closed}'))
  assert result.returncode == 1
  line = _one_line(result.stderr)
  assert 'Cannot reach the bucket gs://pax-tests' in line and 'compil' not in result.stdout


def test_a_bucket_ledger_writes_each_run_apart_and_never_rewrites_the_others(job, capsys):
  """Issue 37, 7: in a bucket, where an object cannot be appended to, each run of a process writes its own
  few lines to an object of its own: a progress line every 2 s costs this run's lines, not the job's history
  (the trainer's own object, and an earlier run's, keep their generation); `pax goodput` reads them all."""
  from paxcli.jobdir import layout, ledger
  storage = _storage()
  [trained] = [n for n in storage.listdir(layout.goodput(job.path)) if n.startswith('process_0.')]
  assert layout.goodput_process(trained) == 0 and trained != 'process_0.jsonl'
  path = storage.join(layout.goodput(job.path), trained)
  before = storage.info(path)['generation']
  later = ledger.Ledger(job.path, 0)
  assert later.path == layout.goodput_ledger_part(job.path, 0, later.inc)
  later.write('start', t=time.time(), pid=1, host='h', process=0, processes=1)
  for _ in range(3):
    later.write('progress', t=time.time(), closed=dict.fromkeys(ledger.PROCESS_CATEGORIES, 0.0),
                open=['startup', time.time()], step=10, steps={})
  later.close(t=time.time() + 1, closed=dict.fromkeys(ledger.PROCESS_CATEGORIES, 0.0), step=10, steps={}, status=0)
  assert storage.info(path)['generation'] == before
  assert [json.loads(line)['kind'] for line in storage.read_text(later.path).splitlines()] == ['start', 'end']
  code, out, err = pax_main(['goodput', job.path, '--json'], capsys)
  assert code == 0, err
  assert json.loads(out)['incarnations'] == 2


def _kill_when_complete(cmd, env, job, step, timeout=600):
  """Starts `cmd`, SIGKILLs it once checkpoint `step` is complete in the bucket; returns its exit code."""
  from paxcli.jobdir import checkpoint, layout
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
  deadline = time.time() + timeout
  while time.time() < deadline and proc.poll() is None:
    if step in checkpoint.complete_steps(layout.checkpoints(job)):
      proc.send_signal(signal.SIGKILL)
      break
    time.sleep(0.2)
  return proc.wait()


@pytest.mark.slow
def test_the_emulator_block_of_the_bucket_guide_runs_as_printed(tmp_path):
  """Issue 38: docs/guides/buckets.md starts fake-gcs-server as the test extra ships it (http, a bucket made),
  points the clients at it, trains into the bucket and reads the account back: run as printed, from a user's
  shell (the port a free one: the machine is shared), and the server gone after it."""
  from docs_blocks import REPO, blocks
  (block,) = [b for b in blocks(REPO / 'docs' / 'guides' / 'buckets.md') if 'fake_gcs=' in b.code]
  code = block.code.replace('4443', str(gcs_server._free_port()))
  env = {k: v for k, v in os.environ.items() if k not in gcs_server.client_env('')}
  env['PATH'] = os.path.dirname(sys.executable) + os.pathsep + env['PATH']   # `pax`, `python` of this venv
  env['XLA_FLAGS'] = ' '.join(f for f in env.get('XLA_FLAGS', '').split()
                              if not f.startswith('--xla_force_host_platform_device_count'))
  proc = subprocess.Popen(['bash', '-e', '-o', 'pipefail', '-c', code], cwd=tmp_path, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
  try:
    out, err = proc.communicate(timeout=900)
  finally:
    try:
      os.killpg(proc.pid, signal.SIGKILL)   # the server too, whatever became of the block
    except ProcessLookupError:
      pass
  assert proc.returncode == 0, f'{block.where()} failed ({proc.returncode}):\n{err[-3000:]}'
  assert 'Done: step 4' in out and 'Goodput of gs://my-bucket/runs/tiny' in out, out[-3000:]
  assert 'google_auth_provider' not in err and 'Traceback' not in err, err[-3000:]


@pytest.mark.slow
def test_kill_9_then_resume_reaches_the_loss_of_an_uninterrupted_run(server, tmp_path):
  bucket = server.make_bucket('pax-resume')
  args = ['train', *TINY, '--set', 'task.train.num_train_steps=30', '--set', 'task.train.save_interval_steps=5',
          '--set', 'task.train.summary_interval_steps=5']
  whole = run_pax(*args, '--job-log-dir', f'{bucket}/whole', '--set', 'RANDOM_SEED=1234')
  assert whole.returncode == 0, whole.stderr[-3000:]
  cut = f'{bucket}/cut'
  cmd = [sys.executable, '-m', 'paxcli.cli.app', *args, '--job-log-dir', cut, '--set', 'RANDOM_SEED=1234']
  assert _kill_when_complete(cmd, dict(os.environ), cut, 10) == -signal.SIGKILL
  assert _storage().exists(f'{cut}/train.lock')                 # left behind by the kill
  resumed = run_pax(*args, '--job-log-dir', cut, '--set', 'RANDOM_SEED=1234')
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert 'taking over the lock of a trainer that is gone' in resumed.stdout
  assert 'Resumed from step ' in resumed.stdout
  rows = {r['step']: r['loss'] for r in _jsonl(f'{cut}/train_metrics.jsonl')}
  want = {r['step']: r['loss'] for r in _jsonl(f'{bucket}/whole/train_metrics.jsonl')}
  assert sorted(rows) == sorted(want) == [5, 10, 15, 20, 25, 30]
  assert rows[30] == pytest.approx(want[30], abs=1e-5)


@pytest.mark.slow
@pytest.mark.alone   # two jax.distributed processes
def test_launch_on_two_processes_and_a_follower_on_a_bucket_job(server):
  bucket = server.make_bucket('pax-launch')
  path = f'{bucket}/two'
  launch = ['launch', '--processes', '2', '--devices-per-process', '4', '--grace', '2', '--']
  trained = run_pax(*launch, 'train', *TINY, '--set', 'task.train.num_train_steps=6',
                    '--set', 'task.train.save_interval_steps=3', '--job-log-dir', path, timeout=400)
  assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-3000:]
  from paxcli.jobdir import checkpoint, layout
  assert checkpoint.complete_steps(layout.checkpoints(path)) == [3, 6]
  assert not _storage().exists(layout.lock(path))
  followed = run_pax('eval', *TINY, '--set', 'task.train.num_train_steps=6', '--job-log-dir', path, '--follow',
                     '--json', '--poll', '1', timeout=300)
  assert followed.returncode == 0, followed.stderr[-3000:]
  assert sorted(json.loads(line)['step'] for line in followed.stdout.strip().splitlines()) == [3, 6]
  assert {r['step'] for r in _jsonl(f'{path}/eval_done.jsonl')} == {3, 6}
  evaluated = run_pax(*launch, 'eval', *TINY, '--job-log-dir', path, '--json', timeout=300)
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  rows = {r['step']: r['loss'] for r in _jsonl(f'{path}/eval_metrics.jsonl')}
  got = json.loads([l for l in evaluated.stdout.splitlines() if l.startswith('[p0] {')][-1][len('[p0] '):])
  assert got['step'] == 6 and got['results']['eval']['loss'] == pytest.approx(rows[6], rel=1e-5)
