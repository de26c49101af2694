"""The tiny LM of the multi-process tests (SLURM, preemption, network), its losses and the one-process reference.

Every run trains lm_cloud.LmCloudSpmdTest at a tiny size on the synthetic input, which defines each global
batch whatever the number of processes: a run of N processes and one of 1 process with the same global
batch have the same losses (float32 reductions in another order: to 1e-5).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from conftest import run_pax

PAX = [sys.executable, '-m', 'paxcli.cli.app']
TINY = ['--exp', 'lm_cloud.LmCloudSpmdTest', '--set', 'NUM_LAYERS=2', '--set', 'MODEL_DIMS=32',
        '--set', 'HIDDEN_DIMS=64', '--set', 'NUM_HEADS=4', '--set', 'DIMS_PER_HEAD=8',
        '--set', 'MAX_SEQ_LEN=16', '--set', 'VOCAB_SIZE=64', '--set', 'task.train.summary_interval_steps=1',
        '--set', 'task.train.save_interval_steps=3']
RTOL = 1e-5


def steps(n: int) -> list[str]:
  return ['--set', f'task.train.num_train_steps={n}']


_REFERENCES: dict[int, dict[int, float]] = {}


def one_process(job_dir, n: int) -> dict[int, float]:
  """The reference: n steps on 1 process x 8 devices, global batch 8 (PERCORE_BATCH_SIZE=1); its losses, trained
  once per pytest process for each n (in `job_dir` the first time)."""
  if n in _REFERENCES:
    return _REFERENCES[n]
  result = run_pax('train', *TINY, '--set', 'ICI_MESH_SHAPE=[1,8,1]', '--set', 'PERCORE_BATCH_SIZE=1', *steps(n),
                   '--job-log-dir', str(job_dir), timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  _REFERENCES[n] = losses(job_dir)
  return _REFERENCES[n]


def losses(job_dir) -> dict[int, float]:
  """step -> loss of train_metrics.jsonl, each step written once."""
  with open(os.path.join(job_dir, 'train_metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  seen = [r['step'] for r in records]
  assert len(seen) == len(set(seen)), f'metrics written more than once: {seen}'
  return {r['step']: r['loss'] for r in records}


def assert_same_losses(got: dict, want: dict, at) -> None:
  at = list(at)
  missing = [s for s in at if s not in got]
  assert not missing, f'no loss for steps {missing}'
  np.testing.assert_allclose([got[s] for s in at], [want[s] for s in at], rtol=RTOL)


def cpu_devices(env: dict, count: int) -> dict:
  """`env` with `count` fake CPU devices per process."""
  flags = [f for f in env.get('XLA_FLAGS', '').split() if not f.startswith('--xla_force_host_platform_device_count')]
  return dict(env, XLA_FLAGS=' '.join(flags + [f'--xla_force_host_platform_device_count={count}']))
