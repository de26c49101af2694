"""Renamed modules, knobs and options keep working, with a warning (paxcli.compat).

tests/fixtures/compat/maxtext_run_paxcli_8b08f3b.py is what `pax import-maxtext` wrote at commit
8b08f3b (paxcli 0.1.0, before paxcli.lm moved to paxcli.families.lm): a recipe users keep.
"""

import subprocess
import sys

import pytest

from conftest import REPO, pax_main
from paxcli import compat, gencode
from paxcli.errors import UserError
from paxcli.experiment import instantiate

OLD_RECIPE = REPO / 'tests' / 'fixtures' / 'compat' / 'maxtext_run_paxcli_8b08f3b.py'
TINY = ['NUM_LAYERS=1', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=2', 'NUM_KV_HEADS=1', 'DIMS_PER_HEAD=16',
        'VOCAB_SIZE=64', 'MAX_SEQ_LEN=16', 'PERCORE_BATCH_SIZE=1', 'ICI_MESH_SHAPE=None', 'DCN_MESH_SHAPE=None',
        'NUM_TRAIN_STEPS=2']


def test_old_module_name_is_the_new_module_with_a_warning():
  code = ('import warnings; warnings.simplefilter("error", DeprecationWarning)\n'
          'import paxcli.models.lm_experiment as new\n'
          'from paxcli.lm import LmExperiment\n'
          'import paxcli.lm as old\n'
          'assert old is new and LmExperiment is new.LmExperiment and new.__spec__.name == "paxcli.models.lm_experiment"\n')
  done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
  assert done.returncode == 0, done.stderr
  assert 'PaxcliDeprecationWarning: The module paxcli.lm is now paxcli.models.lm_experiment' in done.stderr


@pytest.mark.slow  # a scanned model's compile: about 40 s on a loaded 2-core machine
def test_a_recipe_an_earlier_paxcli_wrote_trains(tmp_path, capsys):
  sets = [a for kv in TINY for a in ('--set', kv)]
  code, out, err = pax_main(['train', '--exp', f'{OLD_RECIPE}:MaxTextRun', *sets, '--job-log-dir', str(tmp_path / 'job')],
                            capsys)
  assert code == 0, err[-2000:]
  assert 'Done: step 2' in out


def test_a_recipe_an_earlier_paxcli_wrote_reads_as_data():
  knobs = gencode.knobs_of(OLD_RECIPE.read_text(), 'MaxTextRun', str(OLD_RECIPE))
  assert knobs['NUM_LAYERS'] == 4 and knobs['NUM_KV_HEADS'] == 2
  # Only the moved module's own name is accepted, never another module.
  with pytest.raises(UserError, match='an import other than'):
    gencode.check_shape(OLD_RECIPE.read_text().replace('from paxcli.lm import', 'from os import'), 'x.py')


@pytest.fixture
def renamed(monkeypatch):
  monkeypatch.setitem(compat.RENAMED_KNOBS, 'TRAIN_STEPS', 'NUM_TRAIN_STEPS')
  monkeypatch.setitem(compat.RENAMED_OPTIONS, '--log-dir', '--job-log-dir')


def test_a_renamed_knob_on_the_command_line_sets_the_new_one(renamed):
  with pytest.warns(compat.PaxcliDeprecationWarning, match='TRAIN_STEPS is now NUM_TRAIN_STEPS'):
    exp, _ = instantiate('lm_cloud.LmCloudSpmdTest', ['TRAIN_STEPS=7'])
  assert exp.NUM_TRAIN_STEPS == 7


def test_a_renamed_knob_in_a_class_sets_the_new_one(renamed, tmp_path, monkeypatch):
  (tmp_path / 'old_knobs.py').write_text('from paxcli.models import LmExperiment\n\n'
                                        'class Old(LmExperiment):\n  TRAIN_STEPS = 5\n')
  with pytest.warns(compat.PaxcliDeprecationWarning, match='TRAIN_STEPS'):
    exp, _ = instantiate(f'{tmp_path}/old_knobs.py:Old', [])
  assert exp.NUM_TRAIN_STEPS == 5 and 'TRAIN_STEPS' not in exp.knobs()


def test_an_unknown_knob_is_still_an_error(renamed):
  with pytest.raises(UserError, match='Unknown knob'):
    instantiate('lm_cloud.LmCloudSpmdTest', ['TRAIN_STEPZ=7'])


def test_a_renamed_option_reaches_the_new_one(renamed, tmp_path, capsys):
  with pytest.warns(compat.PaxcliDeprecationWarning, match='--log-dir is now --job-log-dir'):
    code, out, err = pax_main(['eval', '--exp', 'lm_cloud.LmCloudSpmdTest', f'--log_dir={tmp_path}/none'], capsys)
  assert code == 2 and 'No complete checkpoint in ' + str(tmp_path / 'none') in err
