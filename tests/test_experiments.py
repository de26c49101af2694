"""Experiments: lookup, knobs, overrides, recipes, and every user error through the CLI."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from conftest import REPO, pax_main, run_pax
from paxcli import config
from paxcli.runtime import engine
from paxcli.errors import UserError
from paxcli.experiment import import_all_recipes, lookup


def _fails(capsys, argv, *needles, code=2):
  got, out, err = pax_main(argv, capsys)
  assert got == code, (got, out, err)
  assert 'Traceback' not in err and 'Traceback' not in out
  for needle in needles:
    assert needle in err, (needle, err)
  return err


# ---- lookup and knobs -------------------------------------------------------------------

def test_lookup_by_registered_name_class_name_module_and_file(tmp_path, monkeypatch):
  assert lookup('lm_cloud.LmCloudSpmdTest').__name__ == 'LmCloudSpmdTest'
  assert lookup('LmCloudSpmdTest') is lookup('lm_cloud.LmCloudSpmdTest')
  assert lookup(None).__name__ == 'StdlibDocsLm'
  (tmp_path / 'my_experiments.py').write_text(textwrap.dedent('''
      from paxcli.models import LmExperiment
      class MyLm(LmExperiment):
        NUM_LAYERS = 3
        MY_NEW_KNOB: int = 5
  '''))
  from_file = lookup(f'{tmp_path}/my_experiments.py:MyLm')
  assert from_file.NUM_LAYERS == 3
  monkeypatch.chdir(tmp_path)
  assert lookup('my_experiments.MyLm').NUM_LAYERS == 3
  resolved = config.resolve(f'{tmp_path}/my_experiments.py:MyLm', ['MY_NEW_KNOB=7'])
  assert resolved.experiment.MY_NEW_KNOB == 7


def test_knob_and_field_overrides_are_typed():
  r = config.resolve('lm_cloud.LmCloudSpmdTest', [
      'NUM_LAYERS=3', 'FPROP_DTYPE=bfloat16', 'ICI_MESH_SHAPE=[1, 4, 2]', 'USE_BIAS=false',
      'LEARNING_RATE=1', 'task.train.learning_rate=3e-4', 'task.train.optimizer.name=sgd',
      'datasets.train.seed=7'])
  assert r.experiment.NUM_LAYERS == 3 and r.experiment.FPROP_DTYPE == 'bfloat16'
  assert r.experiment.ICI_MESH_SHAPE == [1, 4, 2] and r.experiment.USE_BIAS is False
  assert r.experiment.LEARNING_RATE == 1.0 and isinstance(r.experiment.LEARNING_RATE, float)
  flat = r.flat()
  assert flat['task.model.lm_tpl.num_layers'] == 3 and flat['task.model.lm_tpl.fprop_dtype'] == 'bfloat16'
  assert flat['task.train.learning_rate'] == 3e-4  # the field override wins over the knob
  assert flat['task.train.optimizer.name'] == 'sgd'
  assert flat['datasets.train.seed'] == 7


def test_every_recipe_builds_and_has_parameter_shapes():
  registry = import_all_recipes()
  assert {'default.StdlibDocsLm', 'lm_cloud.LmCloudSpmdTest', 'lm_cloud.LmCloudSpmd2B',
          'lm_cloud.LmCloudSpmd2BLimitSteps'} <= set(registry)
  counts, traced = {}, []   # traced: (model config, its parameter count) of each distinct model so far
  for name in registry:
    try:
      resolved = config.resolve(name)
    except UserError as e:   # a recipe that cannot run without the user's data says so in one line (GRPO's prompts)
      assert 'TRAIN_DATA' in str(e), (name, e)
      resolved = config.resolve(name, ['TRAIN_DATA="prompts.jsonl"'])
    # abstract_params builds task.model alone: a recipe whose model config equals one traced already (a variant
    # that changes steps, data or hardware only) has its parameters; tracing it again would repeat that trace
    count = next((n for model, n in traced if model == resolved.task.model), None)
    if count is None:
      params = engine.abstract_params(resolved)  # eval_shape: no devices, no memory
      count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
      traced.append((resolved.task.model, count))
    counts[name] = count
    assert resolved.train_dataset() is not None
  # 18 layers x (4 x 3072 x 3072 attention + 2 x 3072 x 12288 mlp) + 2 x 32000 x 3072 embeddings
  assert counts['lm_cloud.LmCloudSpmd2B'] == pytest.approx(2.2e9, rel=0.05)
  assert config.resolve('lm_cloud.LmCloudSpmd2BLimitSteps').flat()['task.train.num_train_steps'] == 300
  assert config.resolve('lm_cloud.LmCloudSpmd2B').experiment.ICI_MESH_SHAPE == [1, 4, 1]


def test_describe_prints_resolved_config(capsys):
  code, out, err = pax_main(['describe', '--exp=lm_cloud.LmCloudSpmdTest', '--set', 'NUM_LAYERS=5'], capsys)
  assert code == 0, err
  assert 'task.model.lm_tpl.num_layers = 5' in out and 'knobs.NUM_LAYERS = 5' in out
  code, out, _ = pax_main(['describe', '--exp', 'lm_cloud.LmCloudSpmdTest', '--json'], capsys)
  import json
  assert json.loads(out)['task.model.lm_tpl.model_dims'] == 64


def test_experiments_lists_recipes(capsys):
  code, out, _ = pax_main(['experiments', '--json'], capsys)
  import json
  names = [row['name'] for row in json.loads(out)]
  assert code == 0 and 'lm_cloud.LmCloudSpmd2B' in names


# ---- user errors through the CLI ------------------------------------------------------------

def test_unknown_experiment_suggests_close_names(capsys):
  _fails(capsys, ['train', '--exp', 'lm_cloud.LmCloudSpmdTst'], "Unknown experiment", "LmCloudSpmdTest")
  _fails(capsys, ['describe', '--exp', 'LmCloudSpmd2b'], 'LmCloudSpmd2B')


def test_unknown_knob_and_field_suggest_close_names(capsys):
  _fails(capsys, ['describe', '--exp', 'LmCloudSpmdTest', '--set', 'NUM_LAYER=2'],
         "Unknown knob 'NUM_LAYER'", "NUM_LAYERS")
  _fails(capsys, ['describe', '--exp', 'LmCloudSpmdTest', '--set', 'task.train.learning_rat=1'],
         'task.train.learning_rat', 'learning_rate')
  _fails(capsys, ['describe', '--exp', 'LmCloudSpmdTest', '--set', 'tsk.train.x=1'], "'task'")
  _fails(capsys, ['describe', '--exp', 'LmCloudSpmdTest', '--set', 'NUM_LAYERS=two'],
         "NUM_LAYERS must be int, got 'two'")
  _fails(capsys, ['describe', '--exp', 'LmCloudSpmdTest', '--set', 'FPROP_DTYPE=bfloat61'], 'bfloat16')
  _fails(capsys, ['describe', '--exp', 'LmCloudSpmdTest', '--set', 'NUM_LAYERS'], 'KEY=VALUE')


def test_undeclared_uppercase_knob_is_a_typo(tmp_path, capsys):
  path = tmp_path / 'typo.py'
  path.write_text('from paxcli.models import LmExperiment\n\nclass Typo(LmExperiment):\n  PER_CORE_BATCH_SIZE = 8\n')
  _fails(capsys, ['describe', '--exp', f'{path}:Typo'], 'PER_CORE_BATCH_SIZE is not a declared knob',
         'PERCORE_BATCH_SIZE')


def test_knob_values_in_classes_are_type_checked(tmp_path, capsys):
  path = tmp_path / 'types.py'
  path.write_text('from paxcli.models import LmExperiment\n\nclass A(LmExperiment):\n  NUM_LAYERS = 3\n\n'
                  'class B(A):\n  NUM_LAYERS = "two"\n')
  _fails(capsys, ['describe', '--exp', f'{path}:B'], "B.NUM_LAYERS must be int, got 'two'")
  code, out, _ = pax_main(['describe', '--exp', f'{path}:A'], capsys)
  assert code == 0 and 'knobs.NUM_LAYERS = 3' in out


def test_values_that_would_train_nothing_are_refused(capsys, tmp_path):
  for override, needle in (('NUM_LAYERS=0', 'task.model.lm_tpl.num_layers must be at least 1, got 0'),
                           ('NUM_HEADS=0', 'task.model.lm_tpl.block_tpl.attention_tpl.num_heads must be at least 1'),
                           ('MODEL_DIMS=-4', 'task.model.lm_tpl.model_dims must be at least 1'),
                           ('MAX_SEQ_LEN=0', 'task.model.lm_tpl.max_seq_len must be at least 1'),
                           ('task.train.num_train_steps=0', 'num_train_steps must be at least 1'),
                           ('task.train.save_interval_steps=0', 'save_interval_steps must be at least 1'),
                           ('task.train.summary_interval_steps=0', 'summary_interval_steps must be at least 1')):
    _fails(capsys, ['train', '--exp', 'LmCloudSpmdTest', '--set', override, '--job-log-dir', str(tmp_path / 'x')],
           needle)
  assert not (tmp_path / 'x' / 'checkpoints').exists()


def test_bad_experiment_files(tmp_path, capsys, monkeypatch):
  _fails(capsys, ['describe', '--exp', f'{tmp_path}/missing.py:X'], 'does not exist')
  bad = tmp_path / 'bad.py'
  bad.write_text('from paxcli.models import LmExperiment\n\nclass Bad(LmExperiment)\n  pass\n')
  _fails(capsys, ['describe', '--exp', f'{bad}:Bad'], 'line 3')
  monkeypatch.chdir(tmp_path)
  _fails(capsys, ['describe', '--exp', 'bad.Bad'], 'bad.py, line 3: syntax error')
  good = tmp_path / 'good.py'
  good.write_text('from paxcli.models import LmExperiment\n\nclass Good(LmExperiment):\n  pass\n')
  _fails(capsys, ['describe', '--exp', f'{good}:Goood'], 'Unknown experiment', "'Good'")


def test_mesh_and_batch_errors(capsys, tmp_path):
  _fails(capsys, ['train', '--exp', 'LmCloudSpmdTest', '--set', 'ICI_MESH_SHAPE=[1,3,1]',
                  '--job-log-dir', str(tmp_path / 'a')], 'needs 3 devices', 'there are 8')
  _fails(capsys, ['train', '--exp', 'LmCloudSpmdTest', '--set', 'PERCORE_BATCH_SIZE=0.5',
                  '--job-log-dir', str(tmp_path / 'b')], 'global batch of 4', '8-way data')
  _fails(capsys, ['train', '--exp', 'LmCloudSpmdTest', '--set', 'NUM_KV_HEADS=3',
                  '--job-log-dir', str(tmp_path / 'c')], 'multiple of NUM_KV_HEADS')


def test_unsupported_features_refuse_to_train(capsys, tmp_path):
  _fails(capsys, ['train', '--exp', 'LmCloudSpmdTest', '--set', "UNSUPPORTED_FEATURES={'num_experts': 'MoE'}",
                  '--job-log-dir', str(tmp_path / 'u')], 'num_experts: MoE', 'UNSUPPORTED_FEATURES={}')


def test_errors_from_a_fresh_process_have_no_traceback():
  result = run_pax('train', '--exp', 'nope.Nothing')
  assert result.returncode == 2
  assert 'Unknown experiment' in result.stderr and 'Traceback' not in result.stderr


# ---- packaging and start-up ------------------------------------------------------------------

def test_cli_start_up_imports_nothing_heavy():
  code = ('import sys, paxcli.cli.app; heavy = [m for m in ("jax", "flax", "tensorflow", "seqio", "orbax") '
          'if m in sys.modules]; print(heavy)')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout
  assert out.strip() == '[]'


def test_accepts_pax_spellings():
  from paxcli.cli.common import normalize_argv
  assert normalize_argv(['train', '--job_log_dir=/x', '--exp=a.B']) == ['train', '--job-log-dir=/x', '--exp=a.B']
  assert normalize_argv(['launch', '--', 'train', '--job_log_dir', 'x']) == ['launch', '--', 'train', '--job_log_dir', 'x']


def test_wheel_ships_the_recipes(tmp_path):
  """A normal (non-editable) install must find recipes: they go in as paxcli.recipes."""
  import zipfile
  subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '-q',
                  '-w', str(tmp_path), str(REPO)], check=True, capture_output=True)
  wheel = next(tmp_path.glob('paxcli-*.whl'))
  names = zipfile.ZipFile(wheel).namelist()
  assert 'paxcli/recipes/lm_cloud.py' in names and 'paxcli/recipes/default.py' in names
  for init in (REPO / 'src').rglob('__init__.py'):  # every sub-package of the source tree
    assert str(init.relative_to(REPO / 'src')) in names, init
  # Installed (not editable) into a directory ahead of everything else on the path, the
  # package finds its recipes by name from anywhere.
  target = tmp_path / 'site'
  subprocess.run([sys.executable, '-m', 'pip', 'install', '--no-deps', '-q', '--target', str(target), str(wheel)],
                 check=True, capture_output=True)
  code = ('import paxcli, json; from paxcli.experiment import lookup, import_all_recipes; '
          'print(json.dumps([paxcli.__file__, lookup("lm_cloud.LmCloudSpmdTest").__name__, '
          'sorted(import_all_recipes())]))')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True, cwd=tmp_path,
                       env={**os.environ, 'PYTHONPATH': str(target)}).stdout
  where, found, registry = json.loads(out)
  assert where.startswith(str(target)) and found == 'LmCloudSpmdTest'
  assert 'default.StdlibDocsLm' in registry and 'seqio_stdlib.StdlibDocsSeqIOLm' in registry


def test_user_error_type():
  with pytest.raises(UserError):
    config.resolve('lm_cloud.LmCloudSpmdTest', ['task.model.no_such_field=1'])
