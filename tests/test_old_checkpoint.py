"""Checkpoints written before the layers rework (issue 11) still load and give the same eval.

The fixtures under tests/fixtures/old_lm/ were written by paxcli's train command before
the model became pluggable (`pax train --exp lm_cloud.LmCloudSpmdTest` with the knobs
below, 2 steps, one CPU device); the expected eval losses were measured with that same
code on the test suite's 8 fake devices.
"""

import json
import os
import shutil

import pytest

from conftest import REPO, pax_main

FIXTURES = REPO / 'tests' / 'fixtures' / 'old_lm'
TINY = ['NUM_LAYERS=1', 'MODEL_DIMS=16', 'HIDDEN_DIMS=32', 'NUM_HEADS=2', 'DIMS_PER_HEAD=8', 'VOCAB_SIZE=64',
        'MAX_SEQ_LEN=16', 'PERCORE_BATCH_SIZE=2', 'NUM_TRAIN_STEPS=2', 'SAVE_INTERVAL_STEPS=2',
        'SUMMARY_INTERVAL_STEPS=1']
VARIANTS = {
    'plain': [],
    'scan': ['USE_REPEATED_LAYER=True', 'NUM_LAYERS=2', 'POSITION_EMBEDDING=rotary', 'USE_GATED_ACTIVATION=True',
             'SEPARATE_EMBEDDING=True', 'NORM_TYPE=rmsnorm', 'NUM_KV_HEADS=1'],
}
EXPECTED_EVAL_LOSS = {'plain': 4.729037284851074, 'scan': 4.500903129577637}


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_checkpoint_from_before_the_layers_rework_loads(variant, tmp_path, capsys):
  job = tmp_path / variant
  shutil.copytree(FIXTURES / variant, job)
  sets = [a for kv in TINY + VARIANTS[variant] for a in ('--set', kv)]
  code, out, err = pax_main(['eval', '--exp', 'lm_cloud.LmCloudSpmdTest', *sets, '--job-log-dir', str(job),
                             '--json'], capsys)
  assert code == 0, err
  result = json.loads(out.strip().splitlines()[-1])
  assert result['step'] == 2
  assert result['results']['eval']['loss'] == pytest.approx(EXPECTED_EVAL_LOSS[variant], rel=1e-5)
