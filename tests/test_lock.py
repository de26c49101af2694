"""The lock (constraints.txt) holds every package paxcli[test,docs] needs, at the version installed,
and `make` installs with it."""

import subprocess
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / 'tools'))
import lock  # noqa: E402  (tools/lock.py)


def _pins(text):
  return dict(line.split('==', 1) for line in text.splitlines() if line and not line.startswith('#'))


def test_the_lock_pins_what_is_installed():
  locked = _pins((REPO / 'constraints.txt').read_text())
  installed = _pins(lock.render(lock.closure('paxcli', lock.EXTRAS)))
  missing = sorted(set(installed) - set(locked))
  assert not missing, f'not in constraints.txt: {missing}; run `make lock` after adding a dependency'
  differ = {k: (locked[k], v) for k, v in installed.items() if locked[k] != v}
  assert not differ, (f'installed versions differ from the lock (locked, installed): {differ}; `make install` '
                      'installs the locked ones, `make lock` (then the suite) locks the installed ones')
  assert locked['torch'] == '2.13.0'   # the CPU wheel's version without its +cpu: pip takes the CPU wheel


def test_make_train_installs_what_the_default_run_needs_and_make_test_the_rest():
  """Issue 38: `make train` installs paxcli alone (no TensorFlow, torch, lm-eval, W&B, MLflow, mkdocs: its
  extras); `make test` installs that, then the test extra, both from the lock."""
  train = subprocess.run(['make', '-n', '-B', 'train'], cwd=REPO, capture_output=True, text=True, check=True).stdout
  installs = [line for line in train.splitlines() if ' pip install ' in line and '--upgrade pip' not in line]
  assert installs == ['.venv/bin/python -m pip install --progress-bar on -c constraints.txt -e .'], train
  test = subprocess.run(['make', '-n', '-B', 'test'], cwd=REPO, capture_output=True, text=True, check=True).stdout
  installs = [line for line in test.splitlines() if ' pip install ' in line and '--upgrade pip' not in line]
  assert installs == ['.venv/bin/python -m pip install --progress-bar on -c constraints.txt -e .',
                      ".venv/bin/python -m pip install --progress-bar on -c constraints.txt -e '.[test]'"], test
  from importlib import metadata
  main = [r for r in metadata.requires('paxcli') if 'extra ==' not in r]
  heavy = ('tensorflow', 'seqio', 'torch', 'transformers', 'lm-eval', 'wandb', 'mlflow', 'mkdocs', 'pytest')
  assert not [r for r in main if r.split('>')[0].split('=')[0].split(';')[0].strip() in heavy], main


def test_make_installs_with_the_lock():
  out = subprocess.run(['make', '-n', '-B', 'install'], cwd=REPO, capture_output=True, text=True, check=True).stdout
  assert "pip install --progress-bar on -c constraints.txt -e '.[test]'" in out   # pip's progress shown
  out = subprocess.run(['make', '-n', '-B', 'install', 'CONSTRAINTS='], cwd=REPO, capture_output=True, text=True,
                       check=True).stdout
  assert '-c ' not in out and "-e '.[test]'" in out
