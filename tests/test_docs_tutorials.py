"""Every tutorial, run as printed: its shell and Python blocks in order, in a fresh directory, from a
user's shell (one CPU device, `pax` on PATH), except those marked `<!-- not run: REASON -->`."""

import os
import subprocess
import sys

import pytest

from docs_blocks import TUTORIALS, blocks


def _user_env():
  env = dict(os.environ)
  env['PATH'] = os.path.dirname(sys.executable) + os.pathsep + env['PATH']   # `pax`, `python` of this venv
  flags = [f for f in env.get('XLA_FLAGS', '').split() if not f.startswith('--xla_force_host_platform_device_count')]
  env['XLA_FLAGS'] = ' '.join(flags)   # a user's shell: the devices the machine has
  env.pop('JAX_NUMPY_RANK_PROMOTION', None)
  return env


@pytest.mark.slow
@pytest.mark.parametrize('page', TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs_as_printed(page, tmp_path):
  env = _user_env()
  for block in blocks(page):
    if block.not_run is not None or block.lang not in ('bash', 'python'):
      continue
    if block.file:
      (tmp_path / block.file).write_text(block.code)
      continue
    argv = ['bash', '-e', '-o', 'pipefail', '-c', block.code] if block.lang == 'bash' else [sys.executable, '-c', block.code]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f'{block.where()} failed ({done.returncode}):\n{block.code}\n{done.stderr[-3000:]}'
