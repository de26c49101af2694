"""`pax import-maxtext` end to end: table, JSON, recipe file, strictness, and the recipe trains."""

import json
import os

import pytest

from conftest import pax_main

from paxcli.experiment import lookup
from paxcli.maxtext.recipe import TINY

from maxtext_common import FIXTURES, SEED_2XV4_128


def fixture(name):
  return str(FIXTURES / name)


def test_table_and_default_recipe_path(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  code, out, err = pax_main(['import-maxtext', fixture('2xv4-128-scale.sh')], capsys)
  assert code == 0, err
  for text in ('era scale', 'Pax knob', 'NUM_LAYERS', '6144 (= scale 3 x 2048)', 'Not translated',
               'enable_profiler', 'ignored by design', 'WARNING', 'decoder_block_default',
               'wrote maxtext_2xv4_128_scale.py (class MaxText2xv4_128Scale)'):
    assert text in out, text
  assert os.listdir(tmp_path) == ['maxtext_2xv4_128_scale.py']
  # Never overwrite without --force.
  code, out, err = pax_main(['import-maxtext', fixture('2xv4-128-scale.sh')], capsys)
  assert code == 2 and 'exists; pass --force' in err
  code, _, err = pax_main(['import-maxtext', fixture('2xv4-128-scale.sh'), '--force'], capsys)
  assert code == 0, err


def test_json_output_and_recipe_match(tmp_path, capsys):
  recipe = tmp_path / 'recipes' / 'maxtext_2xv4_128.py'
  code, out, err = pax_main(['import-maxtext', fixture('2xv4-128.sh'), '--json', '-o', str(recipe),
                             '--class-name', 'C4Spmd22BAdam2xv4_128'], capsys)
  assert code == 0, err
  data = json.loads(out)
  assert {k: data['knobs'][k] for k in SEED_2XV4_128} == SEED_2XV4_128
  assert data['era'] == 'scale' and data['output'] == str(recipe)
  assert data['class_name'] == 'C4Spmd22BAdam2xv4_128'
  assert [u['key'] for u in data['untranslated']] == ['run_name', 'enable_profiler']
  source = recipe.read_text()
  assert fixture('2xv4-128.sh') in source and 'MaxText era: scale' in source
  assert '#   enable_profiler = true: ignored by design' in source
  cls = lookup(f'{recipe}:C4Spmd22BAdam2xv4_128')
  exp = cls()
  assert {k: getattr(exp, k) for k in data['knobs']} == data['knobs']
  # pax describe shows the same values.
  code, out, err = pax_main(['describe', '--exp', f'{recipe}:C4Spmd22BAdam2xv4_128', '--json'], capsys)
  assert code == 0, err
  described = json.loads(out)
  assert {k: described[f'knobs.{k}'] for k in data['knobs']} == data['knobs']


def test_dry_run_writes_nothing(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  code, out, err = pax_main(['import-maxtext', fixture('gqa-current.sh'), '--dry-run', '--json',
                             '--topology', 'v5p-128', 'STEPS=40'], capsys)
  assert code == 0, err
  data = json.loads(out)
  assert data['output'] is None and os.listdir(tmp_path) == []
  assert data['knobs']['ICI_MESH_SHAPE'] == [1, 16, 4] and data['knobs']['NUM_TRAIN_STEPS'] == 40
  assert data['knobs']['LR_WARMUP_STEPS'] == 2  # 0.05 x 40


def test_strict_fails_on_unknown_keys_and_missing_mesh_axes(tmp_path, capsys):
  out_file = tmp_path / 'r.py'
  code, out, err = pax_main(['import-maxtext', fixture('unsupported-axes.sh'), '-o', str(out_file),
                             '--strict'], capsys)
  assert code == 2 and '--strict' in err and not out_file.exists()
  assert 'ici_sequence_parallelism=4' in out and "Did you mean 'steps'" in out
  code, out, err = pax_main(['import-maxtext', fixture('unsupported-axes.sh'), '-o', str(out_file), '--lenient'],
                            capsys)
  assert code == 0, err
  assert 'WARNING' in out and out_file.exists()
  exp = lookup(f'{out_file}:MaxTextUnsupportedAxes')()
  assert set(exp.UNSUPPORTED_FEATURES) == {'sequence_parallelism'}


def test_bad_input_is_one_clear_line(tmp_path, capsys):
  cases = [
      ([fixture('no-trainer.sh')], 'no MaxText trainer invocation'),
      ([str(tmp_path / 'missing.sh')], 'Cannot read MaxText script'),
      ([fixture('gps-explicit.sh'), 'SCALE=3'], 'not a power of two'),
      ([fixture('2xv4-128.sh'), '--class-name', 'not valid'], 'not a valid Python class name'),
      ([fixture('2xv4-128.sh'), '--maxtext-era', 'sep2023'], 'is not one of'),
      ([fixture('2xv4-128.sh'), '--num-devices', '100'], 'Cannot build the MaxText mesh'),
  ]
  for args, message in cases:
    code, out, err = pax_main(['import-maxtext', *args, '--dry-run'], capsys)
    assert code == 2, (args, out, err)
    assert message in err and 'Traceback' not in err and len(err.strip().splitlines()) == 1, err


def test_side_effect_script_leaves_no_files(tmp_path, capsys):
  out = tmp_path / 'out'
  out.mkdir()
  (out / 'keep_me').write_text('x')
  recipe = tmp_path / 'recipe.py'
  code, _, err = pax_main(['import-maxtext', fixture('side-effects.sh'), f'OUT={out}', '-o', str(recipe)],
                          capsys)
  assert code == 0, err
  assert os.listdir(out) == ['keep_me'] and sorted(os.listdir(tmp_path)) == ['out', 'recipe.py']


def _tiny(exp):
  args = ['train', '--exp', exp]
  for item in TINY:
    args += ['--set', item]
  return args


@pytest.mark.slow  # ~50 s; run by `make test-slow`
def test_generated_recipes_train_two_steps_on_cpu(tmp_path, capsys):
  # A current-era script: gated silu, grouped-query attention, rmsnorm, rotary, no biases.
  recipe = tmp_path / 'gqa.py'
  code, _, err = pax_main(['import-maxtext', fixture('gqa-current.sh'), '-o', str(recipe)], capsys)
  assert code == 0, err
  args = _tiny(f'{recipe}:MaxTextGqaCurrent') + ['--set', 'NUM_KV_HEADS=2', '--job_log_dir',
                                                   str(tmp_path / 'job')]
  code, out, err = pax_main(args, capsys)
  assert code == 0, err
  assert 'Done: step 2' in out
  with open(tmp_path / 'job' / 'train_metrics.jsonl') as f:
    assert json.loads(f.readlines()[-1])['step'] == 2
  # A 2023 script: pax train refuses its different decoder layer until it is accepted.
  recipe = tmp_path / 'seed.py'
  code, _, err = pax_main(['import-maxtext', fixture('2xv4-128.sh'), '-o', str(recipe)], capsys)
  assert code == 0, err
  args = _tiny(f'{recipe}:MaxText2xv4_128') + ['--job_log_dir', str(tmp_path / 'job2')]
  code, out, err = pax_main(args, capsys)
  assert code == 2 and 'decoder_block_default' in err and 'UNSUPPORTED_FEATURES={}' in err
  code, out, err = pax_main(args + ['--set', 'UNSUPPORTED_FEATURES={}'], capsys)
  assert code == 0, err
  assert 'Done: step 2' in out


def test_unset_variable_in_a_number_is_one_clear_line(tmp_path, capsys):
  script = tmp_path / 'unset.sh'
  script.write_text('python3 MaxText/train.py MaxText/configs/base.yml steps=${STEPS} run_name=x\n')
  code, _, err = pax_main(['import-maxtext', str(script), '--dry-run'], capsys)
  assert code == 2 and 'steps= is empty in the script' in err and 'NAME=VALUE' in err
  code, out, err = pax_main(['import-maxtext', str(script), 'STEPS=7', '--dry-run', '--json'], capsys)
  assert code == 0 and json.loads(out)['knobs']['NUM_TRAIN_STEPS'] == 7
