"""A real SIGKILL during a checkpoint save: the run resumes from the last complete one."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ARGS = ['train', '--exp', 'lm_cloud.LmCloudSpmdTest', '--set', 'MODEL_DIMS=512', '--set', 'HIDDEN_DIMS=2048',
        '--set', 'NUM_LAYERS=4', '--set', 'VOCAB_SIZE=8192', '--set', 'PERCORE_BATCH_SIZE=1',
        '--set', 'MAX_SEQ_LEN=16', '--set', 'task.train.num_train_steps=24',
        '--set', 'task.train.save_interval_steps=2', '--set', 'task.train.summary_interval_steps=2']


def _is_complete(step_dir):
  """orbax's markers of a finished save (the step directory is renamed from its tmp name last)."""
  return os.path.exists(os.path.join(step_dir, 'commit_success.txt')) and os.path.exists(
      os.path.join(step_dir, '_CHECKPOINT_METADATA'))


@pytest.mark.slow
def test_sigkill_during_save_resumes_from_last_complete_checkpoint(tmp_path):
  """The trainer is frozen (SIGSTOP) while a save is in flight after a complete one; what is on
  disk then is what SIGKILL leaves. The rerun sets each unfinished save aside by name and resumes
  from the newest complete step: nothing else is an acceptable outcome."""
  job = tmp_path / 'job'
  ckpt = job / 'checkpoints'
  cmd = [sys.executable, '-m', 'paxcli.cli.app', *ARGS, '--job-log-dir', str(job)]
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  at_kill = None
  while time.time() < deadline and proc.poll() is None:
    entries = os.listdir(ckpt) if ckpt.exists() else []
    if any('tmp' in e for e in entries) and any(e.isdigit() for e in entries):
      proc.send_signal(signal.SIGSTOP)
      entries = os.listdir(ckpt)  # frozen: this is what the kill leaves
      unfinished = [e for e in entries if 'orbax-checkpoint-tmp' in e]
      complete = sorted(int(e) for e in entries if e.isdigit() and _is_complete(ckpt / e))
      if unfinished and complete:
        at_kill = unfinished, complete
        proc.send_signal(signal.SIGKILL)
        break
      proc.send_signal(signal.SIGCONT)  # the save finished between the two listings: catch the next one
    time.sleep(0.005)
  proc.wait()
  assert at_kill, 'never caught a save in flight'
  unfinished, complete = at_kill
  assert proc.returncode == -signal.SIGKILL
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr
  for entry in unfinished:
    step = int(entry.split('.')[0])
    assert f'Checkpoint at step {step} is unfinished (a save was interrupted)' in result.stdout, result.stdout
  assert f'Resumed from step {complete[-1]} ' in result.stdout, result.stdout
  aside = os.listdir(job / 'checkpoints_unfinished')
  assert sorted(e.rsplit('-', 1)[0] for e in aside) == sorted(unfinished)  # moved, not deleted
  records = [json.loads(line) for line in open(job / 'train_metrics.jsonl')]
  assert records[-1]['step'] == 24
  assert [r['step'] for r in records] == list(range(2, 25, 2))  # rows past the resumed step were replayed once
