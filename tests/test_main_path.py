"""The README's main path as a user runs it, with relative paths, and `pax eval --follow` beside it.

The default experiment (default.StdlibDocsLm, made small with --set) is trained once per module
into its default job directory, `runs/default.StdlibDocsLm`, relative to the directory `pax` runs
in. Each test copies that directory and runs `pax` as a subprocess from the copy (cwd), so every
path is relative as typed: train -> eval -> decode (text prompts, the real sentencepiece
tokenizer) -> resume -> convert -> launch. Issue 17 section 1 (orbax refused relative paths and
every checkpoint was called damaged, then moved aside) and the `--follow` defects of section 4.
"""

import json
import os
import pathlib
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import pax_main, run_pax
from paxcli.errors import UserError

JOB = os.path.join('runs', 'default.StdlibDocsLm')  # the default job directory, relative
SMALL = ['--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=64', '--set', 'HIDDEN_DIMS=128', '--set', 'NUM_HEADS=2',
         '--set', 'PERCORE_BATCH_SIZE=4', '--set', 'MAX_SEQ_LEN=64', '--set', 'SAVE_INTERVAL_STEPS=2',
         '--set', 'EVAL_INTERVAL_STEPS=4']


SEED = '30'  # a sampling seed whose 16 rows of 40 tokens draw EOS three times (see the decode test)


def steps(n):
  return ['--set', f'NUM_TRAIN_STEPS={n}']


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """`pax train` of the default experiment for 4 steps in ./runs/default.StdlibDocsLm: checkpoints 2 and 4,
  the trainer's eval at step 4 and its greedy decode of the recipe's prompts at the end."""
  cwd = tmp_path_factory.mktemp('main_path')
  result = run_pax('train', *SMALL, *steps(4), cwd=cwd)
  assert result.returncode == 0, result.stderr[-3000:]
  assert _checkpoints(cwd) == [2, 4]
  assert os.path.isfile(cwd / JOB / 'tokenizer' / 'spm.model')
  return cwd


def _copy(trained, tmp_path) -> pathlib.Path:
  shutil.copytree(trained / 'runs', tmp_path / 'runs')
  return tmp_path


def _checkpoints(cwd, job=JOB):
  return sorted(int(s) for s in os.listdir(os.path.join(cwd, job, 'checkpoints')) if s.isdigit())


def _rows(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def _untouched(cwd, expected=(2, 4)):
  """Every checkpoint where it was; nothing called damaged or set aside."""
  assert _checkpoints(cwd) == list(expected)
  assert not os.path.exists(cwd / JOB / 'checkpoints_damaged')


def _clean(result):
  text = result.stdout + result.stderr
  assert 'Traceback' not in text and 'damaged' not in text, text[-3000:]


def _popen(cwd, *args, code=None):
  """A `pax` subprocess whose stdout lines arrive in a queue (to act on a follower's progress); `code`: Python
  run in its place, the arguments in sys.argv[1:]."""
  command = ['-c', code] if code else ['-m', 'paxcli.cli.app']
  proc = subprocess.Popen([sys.executable, *command, *args], cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  lines: queue.Queue = queue.Queue()
  proc.lines, proc.seen, proc.err = lines, [], []
  proc.readers = [threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True),
                  threading.Thread(target=lambda: proc.err.extend(proc.stderr), daemon=True)]
  for reader in proc.readers:
    reader.start()
  return proc


def _wait_for_line(proc, predicate, timeout=300):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    try:
      line = proc.lines.get(timeout=1)
    except queue.Empty:
      assert proc.poll() is None, f'exited {proc.returncode}: {"".join(proc.err)[-3000:]}'
      continue
    proc.seen.append(line)
    if predicate(line):
      return line
  raise AssertionError('timed out; got:\n' + ''.join(proc.seen)[-3000:])


def _finish(proc, timeout=300):
  """(stdout, stderr) once the process has exited."""
  try:
    proc.wait(timeout=timeout)
  finally:
    proc.kill()
  for reader in proc.readers:
    reader.join(timeout=10)
  while not proc.lines.empty():
    proc.seen.append(proc.lines.get())
  return ''.join(proc.seen), ''.join(proc.err)


def _followed_steps(out):
  return [json.loads(line)['step'] for line in out.splitlines() if line.startswith('{')]


# ---- the main path ----------------------------------------------------------------------------


def test_eval_from_the_relative_default_job_dir_keeps_one_row_per_step(trained, tmp_path, capsys,
                                                                       monkeypatch):
  cwd = _copy(trained, tmp_path)
  by_trainer = _rows(cwd / JOB / 'eval_metrics.jsonl')
  assert [r['step'] for r in by_trainer] == [4]
  result = run_pax('eval', *SMALL, '--json', cwd=cwd)
  assert result.returncode == 0, result.stderr[-3000:]
  _clean(result)
  out = json.loads(result.stdout)
  assert out['step'] == 4
  # The same parameters give the trainer's own eval at step 4 (an independent computation of it).
  assert out['results']['eval']['loss'] == pytest.approx(by_trainer[0]['loss'], rel=1e-5)
  monkeypatch.chdir(cwd)  # the same relative paths, in this process (cheaper than another start)
  code, out2, err = pax_main(['eval', *SMALL, '--step', '2', '--json'], capsys)
  assert code == 0, err[-3000:]
  assert json.loads(out2)['step'] == 2
  # One row per step, in step order, whoever evaluated it (trainer, then pax eval at 4, then at 2).
  rows = _rows(cwd / JOB / 'eval_metrics.jsonl')
  assert [r['step'] for r in rows] == [2, 4]
  assert rows[1]['loss'] == pytest.approx(out['results']['eval']['loss'], rel=1e-6)
  _untouched(cwd)


def test_decode_text_with_the_real_tokenizer_stops_at_a_stop_string_and_at_eos(trained, tmp_path, capsys,
                                                                                   monkeypatch):
  import sentencepiece as spm
  cwd = _copy(trained, tmp_path)
  sp = spm.SentencePieceProcessor(model_file=str(cwd / JOB / 'tokenizer' / 'spm.model'))
  eos = sp.eos_id()
  assert eos >= 0
  # The trainer decoded the recipe's prompts greedily at its last step; pax decode from the checkpoint
  # must give the same tokens, cut where a stop string (a word of that continuation) appears.
  by_trainer = _rows(cwd / JOB / 'decoder_out' / 'prompts' / 'decode_step4.jsonl')
  record = next(r for r in by_trainer if len(set(r['decoded'].split())) > 1)
  words = record['decoded'].split()
  stop = next(w for w in words if w != words[0])
  result = run_pax('decode', *SMALL, '--prompt', record['prompt'], '--stop', stop, '--max-decode-steps',
                   str(len(record['decoded_ids'])), '--output', 'out/greedy.jsonl', '--json', cwd=cwd)
  assert result.returncode == 0, result.stderr[-3000:]
  _clean(result)
  [got] = [json.loads(line) for line in result.stdout.splitlines()]
  assert got['prompt_ids'] == sp.encode(record['prompt']) == record['prompt_ids']
  assert got['stop_reason'] == 'stop_string'
  n = len(got['decoded_ids'])
  assert 0 < n < len(record['decoded_ids']) and got['decoded_ids'] == record['decoded_ids'][:n]
  assert stop not in got['decoded'] and stop in sp.decode(got['decoded_ids'])
  assert got['decoded'].strip() == record['decoded'][:record['decoded'].index(stop)].strip()
  assert _rows(cwd / 'out' / 'greedy.jsonl') == [got]  # --output out/greedy.jsonl, relative to the cwd
  # Sampling at a huge temperature draws nearly uniformly from the 2048 pieces, so which rows draw the
  # tokenizer's EOS depends on the seed alone (16 rows of 40 tokens: about one seed in three gives
  # some); each such row must end right there.
  monkeypatch.chdir(cwd)
  code, out, err = pax_main(['decode', *SMALL, '--prompt', 'Return the number of', '--prompt', 'Create a new',
                             '--temperature', '1e6', '--num-samples', '8', '--seed', SEED, '--max-decode-steps',
                             '40', '--json'], capsys)
  assert code == 0, err[-3000:]
  rows = [json.loads(line) for line in out.splitlines()]
  assert len(rows) == 16
  ended = [r for r in rows if eos in r['decoded_ids']]
  assert ended, f'no row drew EOS with --seed {SEED}: if the sampler\'s random stream changed, choose another seed'
  for r in ended:
    assert r['decoded_ids'].index(eos) == len(r['decoded_ids']) - 1 and r['stop_reason'] == 'eos', r
  for r in rows:
    if r not in ended:
      assert r['stop_reason'] == 'max_steps' and r['num_decoded_tokens'] == 40, r
  _untouched(cwd)


def test_resume_with_more_steps_while_eval_follows_with_the_same_set(trained, tmp_path):
  """The follower's end is this config's num_train_steps (with --set), not the checkpoint's old one:
  it has evaluated steps 2 and 4 (the old run's last) before the resumed trainer even starts."""
  cwd = _copy(trained, tmp_path)
  follower = _popen(cwd, 'eval', *SMALL, *steps(8), '--follow', '--poll', '0.2', '--json')
  try:
    _wait_for_line(follower, lambda line: line.startswith('{') and json.loads(line)['step'] == 4)
    trainer = run_pax('train', *SMALL, *steps(8), cwd=cwd)
    out, err = _finish(follower)
  finally:
    follower.kill()
  assert trainer.returncode == 0, trainer.stderr[-3000:]
  _clean(trainer)
  assert 'Resumed from step 4' in trainer.stdout
  assert follower.returncode == 0, err[-3000:]
  assert _followed_steps(out) == [2, 4, 6, 8]
  assert 'damaged' not in err
  # The trainer (at 8) and the follower (each step) both wrote eval rows: one row per step, in order.
  assert [r['step'] for r in _rows(cwd / JOB / 'eval_metrics.jsonl')] == [2, 4, 6, 8]
  assert _checkpoints(cwd) == [4, 6, 8]
  assert not os.path.exists(cwd / JOB / 'checkpoints_damaged')


def test_convert_with_relative_paths_then_eval_the_output(trained, tmp_path, capsys, monkeypatch):
  cwd = _copy(trained, tmp_path)
  result = run_pax('checkpoint', 'convert', JOB, 'out/params', '--params-only', cwd=cwd)
  assert result.returncode == 0, result.stderr[-3000:]
  _clean(result)
  assert _checkpoints(cwd, 'out/params') == [4]
  monkeypatch.chdir(cwd)
  code, out, err = pax_main(['eval', *SMALL, '--job-log-dir', 'out/params', '--json'], capsys)
  assert code == 0 and 'damaged' not in err, err[-3000:]
  out = json.loads(out)
  by_trainer = _rows(cwd / JOB / 'eval_metrics.jsonl')[-1]
  assert out['step'] == 4 and out['results']['eval']['loss'] == pytest.approx(by_trainer['loss'], rel=1e-5)
  _untouched(cwd)


@pytest.mark.slow  # the default suite keeps the main path; CI runs this in make test-slow
def test_launch_evaluates_the_relative_default_job_dir(trained, tmp_path):
  cwd = _copy(trained, tmp_path)
  result = run_pax('launch', '--processes', '2', '--devices-per-process', '4', '--', 'eval', *SMALL, '--json',
                   cwd=cwd)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  _clean(result)
  [line] = [line for line in result.stdout.splitlines() if line.startswith('[p0] {')]
  out = json.loads(line[len('[p0] '):])
  by_trainer = _rows(cwd / JOB / 'eval_metrics.jsonl')[-1]
  assert out['step'] == 4 and out['results']['eval']['loss'] == pytest.approx(by_trainer['loss'], rel=1e-5)
  _untouched(cwd)


# ---- what must never happen to good checkpoints -------------------------------------------------------


def test_a_restore_error_that_is_not_damage_moves_nothing(trained, tmp_path, monkeypatch):
  """A real orbax error that is not the checkpoint's fault (the relative path the CLI used to pass):
  one line saying so, every checkpoint left in place, no older one tried."""
  from paxcli import config
  from paxcli.runtime import engine
  from paxcli.jobdir import restore
  cwd = _copy(trained, tmp_path)
  monkeypatch.chdir(cwd)
  sets = [v for v in SMALL if v != '--set']
  setup = engine.build(config.resolve('default.StdlibDocsLm', sets))
  notes = []
  with pytest.raises(UserError) as e:
    restore.restore(setup, JOB, 4, fallback=True, set_aside=True, action='resume from', log=notes.append)
  _untouched(cwd)
  assert isinstance(e.value, restore.CheckpointReadError), e.value
  assert 'Checkpoint path should be absolute' in str(e.value) and 'damaged' not in str(e.value)
  assert 'left in place' in str(e.value)
  assert notes == []  # no other checkpoint tried


def test_read_only_commands_never_make_a_mistyped_job_dir(tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  for command in (['eval'], ['decode', '--prompt', 'Return the number of']):
    code, _, err = pax_main([*command, *SMALL, '--job-log-dir', 'typo/run'], capsys)
    assert code == 2 and 'No complete checkpoint' in err, err[-2000:]
    assert not os.path.exists(tmp_path / 'typo'), command


# ---- pax eval --follow ------------------------------------------------------------------------------


@pytest.mark.slow  # the default suite keeps the main path; CI runs this in make test-slow
def test_follow_stops_when_the_trainer_died(trained, tmp_path):
  """A run started for 8 steps whose trainer died after step 4, its train.lock left behind (as SIGKILL
  leaves it): without --timeout, the follower evaluates what is there and stops, saying why."""
  cwd = _copy(trained, tmp_path)
  for step in (2, 4):  # the checkpoints' own config says 8 steps, as that trainer's did
    path = cwd / JOB / 'checkpoints' / str(step) / 'meta' / 'metadata'
    meta = json.loads(path.read_text())
    meta['config'].update({'task.train.num_train_steps': '8', 'knobs.NUM_TRAIN_STEPS': '8'})
    path.write_text(json.dumps(meta))
  gone = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True, text=True)
  pid = int(gone.stdout)
  with open(cwd / JOB / 'train.lock', 'w') as f:
    json.dump({'host': socket.gethostname(), 'pid': pid, 'started': 'earlier', 'command': 'pax train'}, f)
  result = run_pax('eval', *SMALL, *steps(8), '--follow', '--poll', '0.2', '--json', cwd=cwd, timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  assert _followed_steps(result.stdout) == [2, 4]
  err = ' '.join(result.stderr.split())
  assert f'(pid {pid}) is no longer running' in err and 'evaluated up to step 4 of the 8' in err
  _untouched(cwd)


@pytest.mark.slow  # the default suite keeps the main path; CI runs this in make test-slow
def test_two_followers_evaluate_each_step_once(trained, tmp_path):
  cwd = _copy(trained, tmp_path)
  followers = [_popen(cwd, 'eval', *SMALL, *steps(4), '--follow', '--poll', '0.1', '--json') for _ in range(2)]
  try:
    outs = [_finish(f) for f in followers]
  finally:
    for f in followers:
      f.kill()
  for f, (_, err) in zip(followers, outs):
    assert f.returncode == 0, err[-3000:]
  evaluated = sorted(s for out, _ in outs for s in _followed_steps(out))
  assert evaluated == [2, 4]  # between them, each step once
  assert sorted(r['step'] for r in _rows(cwd / JOB / 'eval_done.jsonl')) == [2, 4]
  assert [r['step'] for r in _rows(cwd / JOB / 'eval_metrics.jsonl')] == [2, 4]
  _untouched(cwd)


# The follower, its read of step 6's metadata held until the test says go: the deletion lands mid-restore
# at the same point every run (paxcli refuses a FIFO in a job directory, so one cannot be the gate).
_HELD_READ = (
    'import os, sys, time\n'
    'from paxcli.jobdir import storage\n'
    'read = storage.read_bytes\n'
    'def held(path, *args, **kwargs):\n'
    '  if path.endswith(os.path.join("checkpoints", "6", "meta", "metadata")):\n'
    '    open(os.environ["HELD"] + ".waiting", "w").close()\n'
    '    deadline = time.monotonic() + 300\n'
    '    while not os.path.exists(os.environ["HELD"] + ".go") and time.monotonic() < deadline:\n'
    '      time.sleep(0.05)\n'
    '  return read(path, *args, **kwargs)\n'
    'storage.read_bytes = held\n'
    'from paxcli.cli.app import main\n'
    'main(sys.argv[1:])\n')


@pytest.mark.slow  # the default suite keeps the main path; CI runs this in make test-slow
def test_a_checkpoint_deleted_while_it_is_evaluated_is_skipped_not_damaged(trained, tmp_path, monkeypatch):
  """The trainer deletes old checkpoints (save_max_to_keep) whenever it saves. Here the deletion is
  made to land mid-restore: the follower's read of step 6's metadata waits until the test has deleted
  the step directory, then finds nothing."""
  cwd = _copy(trained, tmp_path)
  ckpts = cwd / JOB / 'checkpoints'
  shutil.copytree(ckpts / '4', ckpts / '6')
  held = tmp_path / 'held'
  monkeypatch.setenv('HELD', str(held))
  follower = _popen(cwd, 'eval', *SMALL, *steps(6), '--follow', '--poll', '0.1', '--json', code=_HELD_READ)
  try:
    deadline = time.monotonic() + 300
    while not (tmp_path / 'held.waiting').exists():
      assert time.monotonic() < deadline and follower.poll() is None, ''.join(follower.err)[-3000:]
      time.sleep(0.05)
    shutil.rmtree(ckpts / '6')
    (tmp_path / 'held.go').touch()
    out, err = _finish(follower)
  finally:
    follower.kill()
  assert follower.returncode == 0, err[-3000:]
  assert 'the checkpoint at step 6 was deleted before it could be evaluated' in ' '.join(err.split())
  assert 'damaged' not in err and 'Traceback' not in err
  assert _followed_steps(out) == [2, 4]
  _untouched(cwd)
