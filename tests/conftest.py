"""Test set-up: 8 fake CPU devices, set before anything imports jax."""

import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
# Implicit rank promotion hides shape bugs in model code: make it an error in tests.
os.environ.setdefault('JAX_NUMPY_RANK_PROMOTION', 'raise')

import atexit
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile

# One persistent XLA compilation cache for the whole run, shared with the `pax` processes the
# tests start (they inherit the environment) and with pytest-xdist workers: most tests train the
# same tiny models, and compiling them again is most of the suite's time. Fresh for each run
# (made here, removed at exit), so no test depends on what an earlier run compiled.
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _cache = tempfile.mkdtemp(prefix='paxcli-tests-xla-cache-')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _cache
  os.environ['PAXCLI_TESTS_OWN_XLA_CACHE'] = str(os.getpid())
  atexit.register(lambda: os.environ.get('PAXCLI_TESTS_OWN_XLA_CACHE') == str(os.getpid())
                  and shutil.rmtree(_cache, ignore_errors=True))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope='session', autouse=True)
def _paxcli_cache(tmp_path_factory):
  """Corpus and tokenizer caches in a temp directory, shared by the whole session."""
  os.environ['PAXCLI_CACHE'] = str(tmp_path_factory.mktemp('paxcli_cache'))
  yield


def run_pax(*args, env=None, cwd=None, timeout=600):
  """Runs `pax` in a fresh process (a new user's shell); returns CompletedProcess."""
  full_env = dict(os.environ)
  for key, value in (env or {}).items():  # None unsets a variable
    if value is None:
      full_env.pop(key, None)
    else:
      full_env[key] = value
  return subprocess.run([sys.executable, '-m', 'paxcli.cli.app', *args], capture_output=True, text=True,
                        env=full_env, cwd=cwd, timeout=timeout)


def pax_ok(cwd, *args, **kwargs):
  """run_pax from `cwd`, which must succeed (its stderr's tail in the failure otherwise)."""
  done = run_pax(*args, cwd=cwd, **kwargs)
  assert done.returncode == 0, (args, done.stderr[-3000:])
  return done


def printed_commands(recipe: str, cwd, *flags: str) -> list[list[str]]:
  """The `pax ...` lines that `python -m paxcli.recipes.<recipe> ex [flags]` writes its example for and prints,
  run in `cwd`, each split as a shell would (comments dropped)."""
  printed = subprocess.run([sys.executable, '-m', f'paxcli.recipes.{recipe}', 'ex', *flags], cwd=cwd,
                           capture_output=True, text=True, timeout=300)
  assert printed.returncode == 0, printed.stderr
  return [shlex.split(line, comments=True) for line in printed.stdout.splitlines() if line.strip().startswith('pax ')]


def pax_main(argv, capsys):
  """Runs `pax` in this process; returns (exit code, stdout, stderr)."""
  from paxcli.cli.app import main
  code = 0
  try:
    main(list(argv))
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  out = capsys.readouterr()
  return code, out.out, out.err


def pax_main_ok(argv, capsys):
  """pax_main, which must succeed (its stderr in the failure otherwise); returns (stdout, stderr)."""
  code, out, err = pax_main(argv, capsys)
  assert code == 0, err
  return out, err


@pytest.fixture(scope='session')
def hf_reference(tmp_path_factory):
  """family name -> (transformers' tiny model of it, the directory save_pretrained wrote), built once per
  session from tests/hf_models.py REFERENCES."""
  import types

  import hf_models
  made = {}

  def get(family: str):
    if family not in made:
      ref = hf_models.REFERENCES[family]
      model = hf_models.build(ref.config)
      made[family] = types.SimpleNamespace(ref=ref, model=model,
                                           hf=hf_models.save(model, str(tmp_path_factory.mktemp(f'hf-{family}'))))
    return made[family]
  return get


@pytest.fixture(scope='session')
def tiny_trained(tmp_path_factory):
  """tests/tiny_lm.py's trained model and its HF export, (job, hf), for the modules that only read it (they
  write their own runs elsewhere): trained once per run (a minute on 2 cores), by the first pytest-xdist worker
  that asks, in the temp directory the workers share; the others wait for it and read the same."""
  import filelock

  import tiny_lm
  shared = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    shared = shared.parent   # the workers' basetemps are gw0, gw1... under one run directory
  base, done = shared / 'tiny_lm', shared / 'tiny_lm.done'
  with filelock.FileLock(str(shared / 'tiny_lm.lock'), timeout=1800):
    if not done.exists():
      shutil.rmtree(base, ignore_errors=True)   # a worker that died half-way leaves no half-trained job
      base.mkdir()
      paths = tiny_lm.train_and_export(str(base))
      done.write_text('\n'.join(paths))
  job, hf = done.read_text().split('\n')
  return job, hf


_TIMED: dict = {'config': None, 'seconds': 0.0}


def pytest_configure(config):
  _TIMED['config'] = config


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
  """With -v (the alone tests in `make test-slow`), each test's time (set-up, call and teardown) follows its
  result as it ends, so that a log cut short still shows where the time went."""
  config = _TIMED['config']
  if config is None or config.option.verbose < 1 or hasattr(config, 'workerinput'):
    return
  _TIMED['seconds'] += report.duration
  if report.when == 'teardown':
    reporter = config.pluginmanager.get_plugin('terminalreporter')
    if reporter is not None:
      reporter.write(f' ({_TIMED["seconds"]:.0f} s)')
    _TIMED['seconds'] = 0.0
