"""`pax describe`'s summary, the end-of-run TensorBoard line, the progress bar's ETA, and one-line hints
for MaxText and paxml spellings, through the CLI."""

import json
import os
import sys

import pytest

from conftest import pax_main

TINY = ['--exp', 'lm_cloud.LmCloudSpmdTest']


def test_describe_shows_parameters_flops_batch_and_devices(capsys):
  code, out, err = pax_main(['describe', *TINY, '--set', 'ICI_MESH_SHAPE=[1,4,2]'], capsys)
  assert code == 0, err
  head = out.splitlines()[:5]
  assert head[0] == '# experiment: lm_cloud.LmCloudSpmdTest'
  assert head[1].startswith('# parameters: ') and '(120,576)' in head[1]
  assert head[2].startswith('# FLOPs per token: 737 KFLOP')
  assert head[3] == '# global batch: 32 sequences x 64 tokens = 2,048 tokens per step'
  assert head[4] == '# devices needed: 8'
  code, out, err = pax_main(['describe', *TINY, '--json'], capsys)
  assert code == 0, err
  data = json.loads(out)
  assert data['summary.parameters'] == 120576 and data['summary.flops_per_token'] == 737280
  assert data['summary.devices'] is None and 'any number' in data['summary.devices_note']
  assert '4 sequences x 64 tokens per device' in data['summary.global_batch_note']


@pytest.mark.slow  # the default suite keeps the main path; CI runs this in make test-slow
def test_a_piped_train_log_has_an_eta_and_names_the_tensorboard_beside_python(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv('PATH', '/usr/bin:/bin')  # as in a shell where the virtual environment is not activated
  code, out, err = pax_main(['train', *TINY, '--job-log-dir', str(tmp_path / 'job'), '--set', 'NUM_TRAIN_STEPS=4',
                             '--set', 'SUMMARY_INTERVAL_STEPS=2', '--set', 'EVAL_INTERVAL_STEPS=0'], capsys)
  assert code == 0, err
  step2 = next(line for line in out.splitlines() if line.startswith('step 2:'))
  assert ' eta 0:' in step2
  assert ' eta ' not in next(line for line in out.splitlines() if line.startswith('step 4:'))  # nothing left
  tensorboard = os.path.join(os.path.dirname(sys.executable), 'tensorboard')
  assert os.path.isfile(tensorboard)
  assert f"TensorBoard: {tensorboard} --logdir {tmp_path / 'job' / 'summaries'}" in out


@pytest.mark.parametrize('argv, hint', [
    (['train', 'NUM_LAYERS=2'], 'pax train --set NUM_LAYERS=2'),
    (['train', '--exp', 'lm_cloud.LmCloudSpmdTest', 'NUM_LAYERS=2'], 'pax train --set NUM_LAYERS=2'),
    (['bench', 'mfu', 'PERCORE_BATCH_SIZE=2'], 'pax bench mfu --set PERCORE_BATCH_SIZE=2'),
    (['train', '--set', 'NUM_LAYERS', '2'], 'pax train --set NUM_LAYERS=2'),
    (['decode', '-s', 'NUM_LAYERS', '2', '--prompt-ids', '1'], 'pax decode --set NUM_LAYERS=2'),
    (['--exp=lm_cloud.LmCloudSpmdTest', '--mode=train', '--job_log_dir=/tmp/j'],
     'pax train --exp=lm_cloud.LmCloudSpmdTest --job-log-dir=/tmp/j'),
    (['--exp', 'E', '--mode', 'eval'], 'pax eval --exp E'),
    (['--mode=decode_once', '--exp=E'], 'pax decode --exp=E'),
    (['--exp=E'], 'pax train --exp=E'),
])
def test_maxtext_and_paxml_habits_get_a_one_line_hint(capsys, argv, hint):
  code, out, err = pax_main(argv, capsys)
  assert code == 2
  assert hint in ' '.join(err.split()), err
  assert len(err.strip().splitlines()) == 1 and 'Traceback' not in err


def test_hints_leave_commands_that_take_key_value_arguments_alone(tmp_path, capsys):
  from maxtext_common import FIXTURES
  code, out, err = pax_main(['import-maxtext', str(FIXTURES / 'gqa-current.sh'), 'STEPS=40', '--dry-run',
                             '--json'], capsys)
  assert code == 0, err
  assert json.loads(out)['knobs']['NUM_TRAIN_STEPS'] == 40
