"""Faults a user meets before any training: bad files, bad experiment files, huge values (issue 12)."""

import os

import pytest

from conftest import pax_main, run_pax


def _one_error_line(err: str) -> str:
  lines = [l for l in err.strip().splitlines() if l.strip()]
  assert len(lines) == 1, err[-3000:]
  assert 'Traceback' not in err
  return lines[0]


@pytest.fixture
def fifo(tmp_path):
  path = tmp_path / 'pipe'
  os.mkfifo(path)
  return str(path)


@pytest.mark.parametrize('kind', ['fifo', 'dev_zero', 'directory'])
def test_import_maxtext_refuses_what_is_not_a_regular_file_at_once(kind, fifo, tmp_path):
  path = {'fifo': fifo, 'dev_zero': '/dev/zero', 'directory': str(tmp_path)}[kind]
  result = run_pax('import-maxtext', path, '--dry-run', timeout=60)  # a blocked read would time out
  assert result.returncode == 2
  line = _one_error_line(result.stderr)
  assert 'not a regular file' in line and {'fifo': 'FIFO', 'dev_zero': 'character device',
                                           'directory': 'directory'}[kind] in line


def test_import_maxtext_refuses_an_oversized_script(tmp_path, capsys):
  big = tmp_path / 'big.sh'
  big.write_text('python3 MaxText/train.py MaxText/configs/base.yml steps=5\n' + '#' * (2 << 20))
  code, _, err = pax_main(['import-maxtext', str(big), '--dry-run'], capsys)
  assert code == 2
  assert 'at most 1,048,576 bytes' in _one_error_line(err)


def test_import_maxtext_refuses_deep_nesting(tmp_path, capsys):
  n = 3000
  script = tmp_path / 'deep.sh'
  script.write_text('python3 MaxText/train.py MaxText/configs/base.yml steps=5 run_name=' + '$(' * n + 'echo x'
                    + ')' * n + '\n')
  code, out, err = pax_main(['import-maxtext', str(script), '--dry-run'], capsys)
  assert code == 2, out
  assert 'nested more than 64 deep' in _one_error_line(err)


def test_import_maxtext_base_config_fifo_refused(tmp_path, fifo):
  script = tmp_path / 'run.sh'
  script.write_text('python3 MaxText/train.py MaxText/configs/base.yml steps=5\n')
  result = run_pax('import-maxtext', str(script), '--dry-run', '--base-config', fifo, timeout=60)
  assert result.returncode == 2
  assert 'FIFO' in _one_error_line(result.stderr)


@pytest.mark.parametrize('kind', ['fifo', 'dev_zero', 'directory'])
def test_inspect_input_says_what_the_path_is(kind, fifo, tmp_path):
  path = {'fifo': fifo, 'dev_zero': '/dev/zero', 'directory': str(tmp_path)}[kind]
  result = run_pax('inspect-input', path, timeout=120)
  assert result.returncode == 2
  line = _one_error_line(result.stderr)
  assert 'no such file' not in line and 'not a regular file' in line


@pytest.fixture
def raising_file(tmp_path, monkeypatch):
  (tmp_path / 'raises.py').write_text('import os\n\nvalue = {}["missing_key"]\n')
  monkeypatch.chdir(tmp_path)
  return tmp_path / 'raises.py'


@pytest.mark.parametrize('exp', ['raises.py:X', 'raises.Anything'])
def test_experiment_file_that_raises_names_its_line(exp, raising_file):
  result = run_pax('describe', '--exp', exp, cwd=str(raising_file.parent))
  assert result.returncode == 2
  line = _one_error_line(result.stderr)
  assert "KeyError: 'missing_key'" in line
  assert f'{raising_file}, line 3' in line


def test_experiment_that_is_not_python_is_refused(capsys):
  code, _, err = pax_main(['describe', '--exp', '/etc/passwd:X'], capsys)
  assert code == 2
  assert 'not a Python file' in _one_error_line(err)


@pytest.mark.parametrize('override', ['NUM_LAYERS={big}', '{big}=1', 'task.train.num_train_steps={big}',
                                      'task.train.{big}=1', 'NOPE{big}=1'])
def test_huge_set_values_are_shortened_in_errors(override, capsys):
  big = 'x' * 100_000
  code, _, err = pax_main(['describe', '--exp', 'lm_cloud.LmCloudSpmdTest', '--set', override.format(big=big)],
                          capsys)
  assert code == 2
  line = _one_error_line(err)
  assert len(line) < 600 and 'more characters' in line
