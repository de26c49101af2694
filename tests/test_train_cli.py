"""End-to-end `pax train` through the CLI: summaries, metrics, checkpoints, resume."""

import json
import os

import pytest

from conftest import pax_main

TINY = ['--exp', 'lm_cloud.LmCloudSpmdTest', '--set', 'NUM_LAYERS=2', '--set', 'MODEL_DIMS=32',
        '--set', 'HIDDEN_DIMS=64', '--set', 'NUM_HEADS=4', '--set', 'PERCORE_BATCH_SIZE=1',
        '--set', 'MAX_SEQ_LEN=16', '--set', 'VOCAB_SIZE=64', '--set', 'ICI_MESH_SHAPE=[1,8,1]',
        '--set', 'task.train.summary_interval_steps=5', '--set', 'task.train.save_interval_steps=5']


def _metrics(job_dir):
  with open(os.path.join(job_dir, 'train_metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def test_train_writes_summaries_metrics_checkpoints_and_resumes_exactly(tmp_path, capsys):
  straight = str(tmp_path / 'straight')
  code, out, err = pax_main(['train', *TINY, '--job_log_dir', straight, '--set',
                             'task.train.num_train_steps=20'], capsys)
  assert code == 0, err
  assert 'Parameters:' in out and 'mesh replica=1 x data=8 x mdl=1' in out
  records = _metrics(straight)
  assert [r['step'] for r in records] == [5, 10, 15, 20]
  for key in ('loss', 'learning_rate', 'grad_norm', 'steps_per_sec', 'tokens_per_sec'):
    assert all(isinstance(r[key], float) for r in records), key
  assert records[-1]['loss'] < records[0]['loss']  # it learns
  assert sorted(os.listdir(os.path.join(straight, 'checkpoints'))) == ['10', '15', '20']  # keeps 3
  assert 'task.train.num_train_steps = 20' in open(os.path.join(straight, 'config.txt')).read()

  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  events = EventAccumulator(os.path.join(straight, 'summaries', 'train'))
  events.Reload()
  assert {'loss', 'learning_rate', 'grad_norm', 'steps_per_sec', 'tokens_per_sec'} <= set(events.Tags()['scalars'])
  assert [e.step for e in events.Scalars('loss')] == [5, 10, 15, 20]

  # The same run stopped at step 10 and started again with the same command.
  split = str(tmp_path / 'split')
  code, _, err = pax_main(['train', *TINY, '--job-log-dir', split, '--set', 'task.train.num_train_steps=10'], capsys)
  assert code == 0, err
  code, out, err = pax_main(['train', *TINY, '--job-log-dir', split, '--set', 'task.train.num_train_steps=20'], capsys)
  assert code == 0, err
  assert 'Resumed from step 10' in out
  resumed = _metrics(split)
  assert [r['step'] for r in resumed] == [5, 10, 15, 20]
  assert resumed[-1]['loss'] == pytest.approx(records[-1]['loss'], rel=1e-5, abs=1e-6)

  # Running a finished run again says so and succeeds.
  code, out, _ = pax_main(['train', *TINY, '--job-log-dir', split, '--set', 'task.train.num_train_steps=20'], capsys)
  assert code == 0 and 'already finished' in out

  # Changing a shape on resume is refused, showing the difference.
  code, _, err = pax_main(['train', *TINY, '--job-log-dir', split, '--set', 'task.train.num_train_steps=30',
                           '--set', 'MODEL_DIMS=48'], capsys)
  assert code != 0
  assert 'MODEL_DIMS: checkpoint 32 -> now 48' in err and 'Traceback' not in err


def test_unfinished_checkpoint_is_set_aside_on_resume(tmp_path, capsys):
  job = tmp_path / 'job'
  code, _, err = pax_main(['train', *TINY, '--job-log-dir', str(job), '--set', 'task.train.num_train_steps=10'], capsys)
  assert code == 0, err
  # What a kill during a save leaves: orbax's temporary directory, or (on file systems
  # without atomic rename) a step directory without the commit markers.
  (job / 'checkpoints' / '15' / 'state').mkdir(parents=True)
  (job / 'checkpoints' / '15' / 'state' / 'partial').write_bytes(b'\0' * 10)
  (job / 'checkpoints' / '20.orbax-checkpoint-tmp-1700000000').mkdir()
  code, out, err = pax_main(['train', *TINY, '--job-log-dir', str(job), '--set', 'task.train.num_train_steps=15'], capsys)
  assert code == 0, err
  assert 'step 15 is unfinished' in out and 'step 20 is unfinished' in out and 'Resumed from step 10' in out
  aside = sorted(os.listdir(job / 'checkpoints_unfinished'))
  assert len(aside) == 2 and aside[0].startswith('15-') and aside[1].startswith('20.orbax-checkpoint-tmp')
  assert (job / 'checkpoints_unfinished' / aside[0] / 'state' / 'partial').exists()  # moved, not deleted
  assert not any('tmp' in name for name in os.listdir(job / 'checkpoints'))
  assert '15' in os.listdir(job / 'checkpoints')  # a fresh, complete step 15
  assert _metrics(str(job))[-1]['step'] == 15


def test_nan_loss_stops_without_checkpoint(tmp_path, capsys):
  job = tmp_path / 'nan'
  code, _, err = pax_main(['train', *TINY, '--job-log-dir', str(job), '--set', 'LEARNING_RATE=1e30',
                           '--set', 'CLIP_GRADIENT_NORM_TO_VALUE=0.0', '--set', 'task.train.num_train_steps=10',
                           '--set', 'task.train.save_interval_steps=1'], capsys)
  assert code == 3
  assert 'The loss became nan at step' in err and 'Traceback' not in err
  step = int(err.split('at step ')[1].split(';')[0])
  saved = [int(s) for s in os.listdir(job / 'checkpoints') if s.isdigit()]
  # Saved every step up to the last finite one (each step's loss is checked before its save); none after.
  assert step >= 2 and saved and max(saved) == step - 1, (step, saved)


def test_sigterm_saves_and_stops_then_resumes(tmp_path):
  """Preemption: SIGTERM saves a checkpoint at the current step and exits 143; rerun resumes."""
  import signal
  import subprocess
  import sys
  job = tmp_path / 'preempted'
  # Every step is a summary step and none a save step: the stop must save by itself.
  cmd = [sys.executable, '-m', 'paxcli.cli.app', 'train', *TINY, '--job-log-dir', str(job),
         '--set', 'task.train.summary_interval_steps=1', '--set', 'task.train.save_interval_steps=1000',
         '--set', 'task.train.num_train_steps=100000']
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  for line in proc.stdout:
    if line.startswith('step 10:'):
      proc.send_signal(signal.SIGTERM)
      break
  rest = proc.stdout.read()
  assert proc.wait(timeout=120) == 143, rest
  assert 'Stopped by SIGTERM after step' in rest and 'Run the same command to resume' in rest
  step = int(rest.split('saved a checkpoint at step ')[1].split()[0])
  assert str(step) in os.listdir(job / 'checkpoints') and step >= 10
  result = subprocess.run(cmd[:-4] + ['--set', f'task.train.num_train_steps={step + 5}'], capture_output=True, text=True)
  assert result.returncode == 0, result.stderr
  assert f'Resumed from step {step}' in result.stdout


def test_non_finite_parameters_are_never_saved(tmp_path, capsys):
  # Plain SGD with an infinite rate (1e300 in float32): step 1's loss is finite, its update is not.
  job = tmp_path / 'blowup'
  code, _, err = pax_main(['train', *TINY, '--job-log-dir', str(job), '--set', 'OPTIMIZER=sgd',
                           '--set', 'LEARNING_RATE=1e300', '--set', 'CLIP_GRADIENT_NORM_TO_VALUE=0.0',
                           '--set', 'task.train.num_train_steps=5', '--set', 'task.train.save_interval_steps=1'],
                          capsys)
  assert code == 3 and 'Traceback' not in err
  assert 'The parameters became non-finite at step 1' in err
  assert not [s for s in os.listdir(job / 'checkpoints') if s.isdigit()]
