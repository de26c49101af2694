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
        '--set', 'MAX_SEQ_LEN=16', '--set', 'task.train.num_train_steps=40',
        '--set', 'task.train.save_interval_steps=2', '--set', 'task.train.summary_interval_steps=2']


@pytest.mark.slow
def test_sigkill_during_save_resumes_from_last_complete_checkpoint(tmp_path):
  job = tmp_path / 'job'
  ckpt = job / 'checkpoints'
  cmd = [sys.executable, '-m', 'paxcli.cli.app', *ARGS, '--job-log-dir', str(job)]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  deadline = time.time() + 300
  killed_during_save = False
  while time.time() < deadline and proc.poll() is None:
    entries = os.listdir(ckpt) if ckpt.exists() else []
    if any('tmp' in e for e in entries) and any(e.isdigit() for e in entries):
      proc.send_signal(signal.SIGKILL)  # while a save is in flight, after one has completed
      killed_during_save = True
      break
    time.sleep(0.005)
  proc.wait()
  assert killed_during_save, 'never caught a save in flight'
  leftovers = os.listdir(ckpt)
  complete = sorted(int(e) for e in leftovers if e.isdigit())
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr
  assert f'Resumed from step {complete[-1]}' in result.stdout or 'unfinished' in result.stdout
  records = [json.loads(line) for line in open(job / 'train_metrics.jsonl')]
  assert records[-1]['step'] == 40
