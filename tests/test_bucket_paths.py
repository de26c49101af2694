"""Bucket paths mean what they say (issue 37, 5), against a real GCS-protocol server (tests/gcs_server.py).

A path a URL would read otherwise (`gs://b/run?x=1`: tensorstore took `?x=1` as a query, gcsfs as part
of the name, and one job landed under two prefixes), a scheme typo (`gs:/b/run`) or no bucket name is
one line before any work. A name with every character that stays itself trains with every object
under its one prefix. A bucket that stops answering during a save (the server stopped for real, or
frozen) ends the trainer in one line naming the step and the bucket, within the documented bound,
and the next start resumes from the last finished checkpoint.
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

import gcs_server
from conftest import pax_main

TINY = ['--exp', 'lm_cloud.LmCloudSpmdTest', '--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=32',
        '--set', 'HIDDEN_DIMS=64', '--set', 'NUM_HEADS=2', '--set', 'DIMS_PER_HEAD=16', '--set', 'VOCAB_SIZE=64',
        '--set', 'MAX_SEQ_LEN=16', '--set', 'PERCORE_BATCH_SIZE=1']


def _line(code, err, want=2):
  lines = [l for l in err.strip().splitlines() if l.strip() and not l.startswith(('WARNING', 'I1', 'W1'))]
  assert code == want and 'Traceback' not in err, err[-3000:]
  assert len(lines) == 1, lines
  return lines[0]


def objects(server, bucket: str) -> list[str]:
  """Every object name in `bucket`, from the server's own listing (not through paxcli's clients)."""
  names, token = [], ''
  while True:
    query = urllib.parse.urlencode({'pageToken': token} if token else {})
    page = json.loads(urllib.request.urlopen(f'{server.url}/storage/v1/b/{bucket}/o?{query}', timeout=30).read())
    names += [item['name'] for item in page.get('items', [])]
    token = page.get('nextPageToken')
    if not token:
      return names


@pytest.fixture(scope='module')
def server():
  with gcs_server.running() as s:
    yield s


@pytest.mark.parametrize('path', ['gs://pax-paths/run?x=1', 'gs://pax-paths/run#1', 'gs://pax-paths/run%41',
                                  'gs://pax-paths/a|b', 'gs://pax-paths/run*', 'gs://pax-paths/run[1]',
                                  'gs://pax-paths/run\tx', 'gs://pax-paths/a/../../b'])
@pytest.mark.parametrize('command', ['train', 'eval'])
def test_a_bucket_path_a_url_reads_otherwise_is_one_line_before_any_work(path, command, server, tmp_path, capsys,
                                                                         monkeypatch):
  server.make_bucket('pax-paths') if 'pax-paths' not in _buckets(server) else None
  monkeypatch.chdir(tmp_path)
  args = [command, *TINY, '--job-log-dir', path] + (['--set', 'task.train.num_train_steps=2'] if command == 'train'
                                                     else [])
  line = _line(*pax_main(args, capsys)[::2])
  assert line.startswith(f'error: --job-log-dir {path.replace(chr(9), chr(92) + "t")}') or '..' in path, line
  assert ('cannot hold' in line and 'a URL gives them meaning' in line) or 'no `..`' in line, line
  assert objects(server, 'pax-paths') == [] and os.listdir(tmp_path) == []


def _buckets(server) -> set:
  got = json.loads(urllib.request.urlopen(f'{server.url}/storage/v1/b', timeout=30).read())
  return {b['name'] for b in got.get('items', [])}


@pytest.mark.parametrize('path, phrase', [
    ('gs:/pax-typo/run', 'did you mean gs://pax-typo/run?'),
    ('gs:pax-typo/run', 'did you mean gs://pax-typo/run?'),
    ('gs//pax-typo/run', 'did you mean gs://pax-typo/run?'),
    ('GS:/pax-typo/run', 'did you mean gs://pax-typo/run?'),
    ('gcs://pax-typo/run', 'Did you mean gs://pax-typo/run?'),
    ('gs://Pax-Typo/run', "'Pax-Typo' is not a bucket name"),
    ('gs://p/run', "'p' is not a bucket name"),
    ('gs:///', 'names no bucket'),
])
def test_a_misspelt_bucket_path_is_one_line_and_no_local_directory(path, phrase, tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  for args in (['train', *TINY, '--job-log-dir', path], ['goodput', path],
               ['train', *TINY, '--set', f'INIT_FROM={path}', '--job-log-dir', str(tmp_path / 'job')]):
    line = _line(*pax_main(args, capsys)[::2])
    assert phrase in line, line
    assert not os.path.exists(tmp_path / 'gs:') and not os.path.exists(tmp_path / 'gs')
    assert not os.path.exists(tmp_path / 'GS:') and not os.path.exists(tmp_path / 'job' / 'checkpoints')


def test_every_object_of_a_job_with_unusual_characters_lives_under_its_one_prefix(server, capsys):
  """The characters a bucket path may hold: gcsfs (paxcli's files) and tensorstore (the arrays) write the
  very same names, and a resume reads them back."""
  server.make_bucket('pax-names')
  prefix = "runs/a b+c=d,e@f:g~h;i&j$k!l'm(n)o^p{q}r`s\\té"
  job = f'gs://pax-names/{prefix}'
  train = ['train', *TINY, '--set', 'task.train.num_train_steps=2', '--set', 'task.train.save_interval_steps=2',
           '--job-log-dir', job]
  code, out, err = pax_main(train, capsys)
  assert code == 0, err[-3000:]
  names = objects(server, 'pax-names')
  assert any('/checkpoints/2/state/' in n for n in names) and any(n.endswith('/train_metrics.jsonl') for n in names)
  assert all(n.startswith(prefix + '/') for n in names), sorted(n for n in names if not n.startswith(prefix + '/'))
  code, out, err = pax_main(['train', *TINY, '--set', 'task.train.num_train_steps=4',
                             '--set', 'task.train.save_interval_steps=2', '--job-log-dir', job], capsys)
  assert code == 0, err[-3000:]
  assert 'Resumed from step 2' in out
  assert all(n.startswith(prefix + '/') for n in objects(server, 'pax-names'))


# ---- a bucket that stops answering during a save ---------------------------------------------------


def _wait_for_step(job, step, proc, timeout=600):
  from paxcli.jobdir import checkpoint, layout
  deadline = time.time() + timeout
  while time.time() < deadline and proc.poll() is None:
    if step in checkpoint.complete_steps(layout.checkpoints(job)):
      return
    time.sleep(0.5)
  raise AssertionError(f'step {step} was never saved: {proc.communicate()[1][-3000:]}')


@pytest.mark.slow
@pytest.mark.parametrize('how', ['stopped', 'frozen'])
def test_a_bucket_gone_during_a_save_ends_the_trainer_in_one_line_and_the_next_start_resumes(how, tmp_path):
  """`stopped`: the server process ends (connections refused); `frozen`: SIGSTOP (connections accepted and
  never answered). The trainer ends within the save bound and a few request timeouts, in one line naming the
  step and the bucket; once the bucket is back, a new start takes over the lease and resumes from the last
  complete step (the unfinished one set aside)."""
  bound = 30
  with gcs_server.running(tmp_path / 'objects') as server:
    server.make_bucket('pax-gone')
    job = 'gs://pax-gone/run'
    env = dict(os.environ, PAXCLI_BUCKET_SAVE_TIMEOUT_S=str(bound))
    base = [sys.executable, '-m', 'paxcli.cli.app', 'train', *TINY, '--job-log-dir', job]
    cmd = [*base, '--set', 'task.train.num_train_steps=100000', '--set', 'task.train.save_interval_steps=20',
           '--set', 'task.train.summary_interval_steps=10']
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
      _wait_for_step(job, 20, proc)
      if how == 'stopped':
        server.stop()
      else:
        server.proc.send_signal(signal.SIGSTOP)
      gone = time.monotonic()
      out, err = proc.communicate(timeout=900)
      took = time.monotonic() - gone
    finally:
      if proc.poll() is None:
        proc.kill()
      if how == 'stopped':
        server.start()
      else:
        server.proc.send_signal(signal.SIGCONT)
    line = _line(proc.returncode, err, want=1)
    assert 'gs://pax-gone' in line and ' step ' in line and 'The last complete checkpoint is step 20' in line, line
    assert ('Could not save the checkpoint of step' in line or 'Cannot reach the bucket' in line), line
    print(f'{how}: the trainer ended {took:.0f} s after the bucket went, with the save bounded to {bound} s')
    resumed = subprocess.run([*base, '--set', 'task.train.num_train_steps=30', '--set', 'task.train.save_interval_steps=10'],
                             capture_output=True, text=True, env=env, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert 'Resumed from step 20' in resumed.stdout
    from paxcli.jobdir import checkpoint, layout
    assert checkpoint.complete_steps(layout.checkpoints(job))[-1] == 30
