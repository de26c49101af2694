"""The wheel installs into a clean virtual environment at the locked versions, and `pax` runs from it,
recipes included, outside the checkout (slow: the install fetches the dependencies, a few GB)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO


def _run(argv, **kwargs):
  done = subprocess.run(argv, capture_output=True, text=True, **kwargs)
  assert done.returncode == 0, f'{argv}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}'
  return done.stdout


@pytest.mark.slow
def test_the_wheel_installs_into_a_clean_venv_and_trains(tmp_path):
  dist = tmp_path / 'dist'
  _run([sys.executable, '-m', 'build', '--wheel', '--no-isolation', '-o', str(dist), str(REPO)], timeout=600)
  wheel = next(dist.glob('paxcli-*.whl'))
  venv = tmp_path / 'venv'
  _run([sys.executable, '-m', 'venv', str(venv)])
  python, pax = str(venv / 'bin' / 'python'), str(venv / 'bin' / 'pax')
  env = {k: v for k, v in os.environ.items() if k not in ('PYTHONPATH', 'VIRTUAL_ENV')}
  env['XLA_FLAGS'] = ' '.join(f for f in env.get('XLA_FLAGS', '').split()
                              if not f.startswith('--xla_force_host_platform_device_count'))
  _run([python, '-m', 'pip', 'install', '--quiet', '-c', str(REPO / 'constraints.txt'), str(wheel)], env=env,
       timeout=3000)

  work = tmp_path / 'elsewhere'   # no checkout around: what runs is the installed package
  work.mkdir()
  where = _run([python, '-c', 'import paxcli; print(paxcli.__file__, paxcli.__version__)'], cwd=work, env=env)
  assert where.startswith(str(venv)), where
  listed = json.loads(_run([pax, 'experiments', '--json'], cwd=work, env=env))
  names = {row['name'] for row in listed}
  assert {'default.StdlibDocsLm', 'lm_cloud.LmCloudSpmdTest', 'finetune.LlamaSft'} <= names
  out = _run([pax, 'train', '--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=32', '--set', 'HIDDEN_DIMS=64',
              '--set', 'NUM_HEADS=2', '--set', 'NUM_TRAIN_STEPS=4', '--set', 'SUMMARY_INTERVAL_STEPS=2',
              '--set', 'DECODE_INTERVAL_STEPS=0', '--job-log-dir', 'job'], cwd=work, env=env, timeout=900)
  assert 'Done: step 4' in out
  assert (work / 'job' / 'tokenizer' / 'spm.model').is_file()
