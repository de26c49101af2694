"""A pipelined run's checkpoint does not depend on its stage count (through `pax`, tiny model).

A run saved with 2 stages resumes with 4 stages and with none, each to the losses of a
straight unpipelined run; eval (pipelined and not), decode and checkpoint conversion read it.
"""

import json
import os
import shutil

import numpy as np
import pytest

from conftest import pax_main

EXP = 'lm_cloud.LmCloudSpmdTest'
TINY = ['NUM_LAYERS=4', 'MODEL_DIMS=16', 'HIDDEN_DIMS=32', 'NUM_HEADS=2', 'DIMS_PER_HEAD=8', 'VOCAB_SIZE=32',
        'MAX_SEQ_LEN=8', 'USE_REPEATED_LAYER=True', 'PERCORE_BATCH_SIZE=1', 'SUMMARY_INTERVAL_STEPS=1',
        'SAVE_INTERVAL_STEPS=2']
NONE = ['ICI_MESH_SHAPE=[1,4,2]']
TWO = ['NUM_STAGES=2', 'NUM_MICROBATCHES=4', 'ICI_MESH_SHAPE=[2,1,2,2]']
FOUR = ['NUM_STAGES=4', 'NUM_MICROBATCHES=4', 'ICI_MESH_SHAPE=[4,1,2,1]']


def _sets(knobs):
  return [a for k in TINY + knobs for a in ('--set', k)]


def _pax(capsys, *argv):
  code, out, err = pax_main(list(argv), capsys)
  assert code == 0, err
  return out


def _train(capsys, job, knobs, steps):
  return _pax(capsys, 'train', '--exp', EXP, *_sets(knobs + [f'NUM_TRAIN_STEPS={steps}']), '--job-log-dir', str(job))


def _losses(job):
  with open(os.path.join(job, 'train_metrics.jsonl')) as f:
    return {r['step']: r['loss'] for r in map(json.loads, f)}


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """A straight unpipelined run of 4 steps and a 2-stage run of 2 steps (saved at step 2)."""
  from paxcli.cli.app import main
  root = tmp_path_factory.mktemp('pipeline_runs')
  for job, knobs, steps in (('straight', NONE, 4), ('two', TWO, 2)):
    try:
      main(['train', '--exp', EXP, *_sets(knobs + [f'NUM_TRAIN_STEPS={steps}']), '--job-log-dir', str(root / job)])
    except SystemExit as e:
      assert not e.code, f'pax train ({job}) exited with {e.code}'
  return root, _losses(root / 'straight')


def test_two_stages_start_as_the_straight_run(runs):
  root, straight = runs
  two = _losses(root / 'two')
  np.testing.assert_allclose([two[1], two[2]], [straight[1], straight[2]], rtol=1e-5)


@pytest.mark.parametrize('name,knobs', [('four', FOUR), ('none', NONE)])
def test_two_stages_resume_with_four_and_with_none(runs, tmp_path, capsys, name, knobs):
  root, straight = runs
  shutil.copytree(root / 'two', tmp_path / name)
  out = _train(capsys, tmp_path / name, knobs, 4)
  assert 'Resumed from step 2' in out
  resumed = _losses(tmp_path / name)
  np.testing.assert_allclose([resumed[3], resumed[4]], [straight[3], straight[4]], rtol=1e-5)


def test_eval_decode_and_convert_read_a_pipelined_run(runs, capsys):
  root, _ = runs
  two = str(root / 'two')
  # Eval pipelined (4 stages) and not on the 2-stage run's checkpoint: the same loss.
  evals = [json.loads(_pax(capsys, 'eval', '--exp', EXP, *_sets(knobs + ['NUM_TRAIN_STEPS=2']), '--job-log-dir', two,
                           '--json').strip().splitlines()[-1])
           for knobs in (FOUR, NONE)]
  assert evals[0]['step'] == evals[1]['step'] == 2
  np.testing.assert_allclose(evals[0]['results']['eval']['loss'], evals[1]['results']['eval']['loss'], rtol=1e-5)
  # Decode runs unpipelined on the pipelined run's weights (still sharded over stages).
  out = _pax(capsys, 'decode', '--exp', EXP, *_sets(TWO + ['NUM_TRAIN_STEPS=2']), '--job-log-dir', two,
             '--prompt-ids', '1,2,3', '--max-decode-steps', '3', '--json')
  assert len(json.loads(out.strip().splitlines()[0])['decoded_ids']) == 3
  # The saved arrays have the unpipelined scanned model's names and shapes; conversion reads them.
  infos = [json.loads(_pax(capsys, 'checkpoint', 'inspect', str(root / d), '--json')) for d in ('two', 'straight')]
  shapes = [{a['name']: a['shape'] for a in info['arrays']} for info in infos]
  assert shapes[0] == shapes[1] and shapes[0]['params/layers/attention/query/kernel'] == [4, 16, 2, 8]
  out = _pax(capsys, 'checkpoint', 'convert', two, str(root / 'st'), '--to', 'safetensors', '--json')
  assert json.loads(out)['verify']['ok']
