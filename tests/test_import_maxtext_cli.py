"""`pax import-maxtext` recipes through the CLI: the recipe's own tiny check runs, MaxText's norm
epsilon is kept, and a refused run leaves no job directory."""

import ast
import json
import os
import shlex

import pytest

from conftest import pax_main
from maxtext_common import FIXTURES
from paxcli.maxtext.recipe import TINY


def _tiny_check_command(recipe_source: str) -> list[str]:
  doc = ast.get_docstring(ast.parse(recipe_source))
  lines = doc.split('A tiny check on CPU')[1].split('\n')
  start = next(i for i, line in enumerate(lines) if line.strip().startswith('pax train'))
  command = []
  for line in lines[start:]:
    command.append(line.strip().rstrip('\\'))
    if not line.rstrip().endswith('\\'):
      break
  return shlex.split(' '.join(command))


@pytest.mark.slow  # a 2-step train (~25 s quiet, ~60 s on a loaded machine); `make test-slow`
def test_the_recipes_own_tiny_check_runs_though_it_has_unsupported_features(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  code, _, err = pax_main(['import-maxtext', str(FIXTURES / '2xv4-128.sh')], capsys)
  assert code == 0, err
  command = _tiny_check_command((tmp_path / 'maxtext_2xv4_128.py').read_text())
  assert command[:2] == ['pax', 'train']
  code, out, err = pax_main(command[1:], capsys)
  assert code == 0, err
  assert 'Done: step 2' in out


def test_a_refused_run_leaves_no_job_directory(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  code, _, err = pax_main(['import-maxtext', str(FIXTURES / '2xv4-128.sh')], capsys)
  assert code == 0, err
  sets = [a for s in TINY for a in ('--set', s)]
  code, out, err = pax_main(['train', '--exp', 'maxtext_2xv4_128.py:MaxText2xv4_128', *sets], capsys)
  assert code == 2 and 'UNSUPPORTED_FEATURES={}' in err and 'Traceback' not in err
  assert os.listdir(tmp_path) == ['maxtext_2xv4_128.py']  # no runs/<exp>/


def test_normalization_layer_epsilon_becomes_norm_epsilon(tmp_path, capsys):
  # The script does not set it: base.yml's 1e-5 (2024 defaults) reaches NORM_EPSILON.
  code, out, err = pax_main(['import-maxtext', str(FIXTURES / 'gqa-current.sh'), '--dry-run', '--json'], capsys)
  assert code == 0, err
  data = json.loads(out)
  assert data['knobs']['NORM_EPSILON'] == 1e-5
  assert 'normalization_layer_epsilon' not in [u['key'] for u in data['untranslated']]
  # The script sets it: its value, in the recipe, and pax describe shows it.
  script = tmp_path / 'eps.sh'
  script.write_text('python3 MaxText/train.py MaxText/configs/base.yml run_name=x model_name=llama2-7b '
                    'normalization_layer_epsilon=3e-6 steps=5\n')
  recipe = tmp_path / 'eps.py'
  code, out, err = pax_main(['import-maxtext', str(script), '-o', str(recipe)], capsys)
  assert code == 0, err
  assert 'NORM_EPSILON = 3e-06  # normalization_layer_epsilon=3e-6' in recipe.read_text()
  code, out, err = pax_main(['describe', '--exp', f'{recipe}:MaxTextEps', '--json'], capsys)
  assert code == 0, err
  assert json.loads(out)['knobs.NORM_EPSILON'] == 3e-6
