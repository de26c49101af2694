"""paxcli from Python (paxcli.api): the commands as functions returning data, the same as `pax` writes;
and PLATFORM_ENV reaching XLA in `pax eval` and `pax decode`, seen through what XLA does."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from rich.console import Console

import paxcli
from conftest import pax_main, run_pax
from paxcli.errors import UserError

EXP = 'default.StdlibDocsLm'
SMALL = ['NUM_LAYERS=1', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=2', 'PERCORE_BATCH_SIZE=1', 'MAX_SEQ_LEN=32',
         'NUM_TRAIN_STEPS=2', 'SAVE_INTERVAL_STEPS=2', 'EVAL_INTERVAL_STEPS=0', 'DECODE_INTERVAL_STEPS=0']
QUIET = Console(quiet=True)


def _sets(overrides):
  return [a for s in overrides for a in ('--set', s)]


def test_import_paxcli_loads_no_command_until_one_is_used():
  code = ('import sys, paxcli; before = [m for m in ("paxcli.api", "jax", "fiddle") if m in sys.modules]; '
          'f = paxcli.describe; print(before, f.__module__, "paxcli.api" in sys.modules)')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout
  assert out.split() == ['[]', 'paxcli.api', 'True']
  with pytest.raises(AttributeError):
    paxcli.no_such_command  # noqa: B018


def test_train_evaluate_decode_from_python_in_a_relative_job_dir(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  last = paxcli.train(EXP, job_dir='run', overrides=SMALL, console=QUIET)
  assert last['step'] == 2 and last['loss'] > 0
  assert sorted(os.listdir(tmp_path / 'run' / 'checkpoints')) == ['2']  # the relative job dir, under the cwd
  assert capsys.readouterr().out == ''  # progress went to the console given; stdout stays the caller's

  result = paxcli.evaluate(EXP, job_dir='run', overrides=SMALL, console=QUIET)
  assert result['step'] == 2 and result['results']['eval']['loss'] > 0
  code, out, err = pax_main(['eval', '--exp', EXP, *_sets(SMALL), '--job-log-dir', 'run', '--json'], capsys)
  assert code == 0, err
  printed = json.loads(out)
  assert printed['step'] == 2 and printed['results'].keys() == result['results'].keys()
  assert abs(printed['results']['eval']['loss'] - result['results']['eval']['loss']) < 1e-6  # same weights, data

  options = dict(prompt=['def parse(', 'import'], max_decode_steps=4)
  records = paxcli.decode(EXP, job_dir='run', overrides=SMALL, output='api.jsonl', console=QUIET, **options)
  assert capsys.readouterr().out == ''
  code, out, err = pax_main(['decode', '--exp', EXP, *_sets(SMALL), '--job-log-dir', 'run', '--prompt', 'def parse(',
                             '--prompt', 'import', '--max-decode-steps', '4', '--output', 'cli.jsonl'], capsys)
  assert code == 0, err
  written = [json.loads(line) for line in open(tmp_path / 'cli.jsonl')]
  assert len(records) == 2 and records[0]['prompt'] == 'def parse(' and records[0]['decoded_ids']
  assert records == written  # greedy: what `pax decode` writes, record for record
  assert [json.loads(line) for line in open(tmp_path / 'api.jsonl')] == written


def test_describe_returns_the_flat_config_and_the_summary_pax_describe_prints(capsys):
  described = paxcli.describe(EXP, overrides=['NUM_LAYERS=1'])
  assert described['experiment'] == EXP and described['pipeline'] is None
  assert described['config']['knobs.NUM_LAYERS'] == 1
  assert described['config']['task.model.lm_tpl.num_layers'] == 1
  assert described['text'].startswith(f'# experiment: {EXP}\n')
  code, out, err = pax_main(['describe', '--set', 'NUM_LAYERS=1', '--json'], capsys)
  assert code == 0, err
  printed = json.loads(out)
  assert {k: printed[f'summary.{k}'] for k in described['summary']} == described['summary']
  assert described['summary']['parameters'] > 0


def test_user_mistakes_raise_user_error_with_the_line_pax_prints(tmp_path, capsys):
  with pytest.raises(UserError, match='Unknown experiment'):
    paxcli.describe('no_such_module.Nothing')
  with pytest.raises(UserError, match='No prompts'):  # before any start-up
    paxcli.decode(EXP, job_dir=str(tmp_path / 'job'))
  with pytest.raises(UserError, match='--timeout goes with --follow'):
    paxcli.evaluate(EXP, timeout=5)
  with pytest.raises(UserError) as raised:
    paxcli.evaluate(EXP, job_dir=str(tmp_path / 'empty'), overrides=SMALL, console=QUIET)
  code, _, err = pax_main(['eval', *_sets(SMALL), '--job-log-dir', str(tmp_path / 'empty')], capsys)
  assert code == 2 and 'No complete checkpoint' in str(raised.value)
  assert ' '.join(str(raised.value).split())[:60] in ' '.join(err.split())


DUMPING = '''
from paxcli.models import LmExperiment


class Dumping(LmExperiment):
  NUM_LAYERS = 1
  MODEL_DIMS = 32
  HIDDEN_DIMS = 64
  NUM_HEADS = 4
  MAX_SEQ_LEN = 16
  VOCAB_SIZE = 64
  PERCORE_BATCH_SIZE = 1
  PLATFORM_ENV = {{'cpu': {{'XLA_FLAGS': '--xla_dump_to={dump}'}}}}
'''


@pytest.mark.parametrize('command', [
    ['eval', '--no-checkpoint', '--json'],
    ['decode', '--no-checkpoint', '--prompt-ids', '1,2,3', '--max-decode-steps', '2', '--json'],
])
def test_eval_and_decode_apply_platform_env_before_xla_starts(tmp_path, command):
  """The experiment's XLA_FLAGS ask XLA to dump what it compiles: the dump exists only if the flags
  were set before the backend started. The compilation cache is off, or nothing would compile."""
  dump = tmp_path / 'xla_dump'
  (tmp_path / 'dumping.py').write_text(textwrap.dedent(DUMPING.format(dump=dump)))
  result = run_pax(*command, '--exp', 'dumping.py:Dumping', '--job-log-dir', str(tmp_path / 'job'), cwd=tmp_path,
                   env={'JAX_ENABLE_COMPILATION_CACHE': 'false'})
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Set XLA_FLAGS for platform cpu.' in result.stderr
  assert any(name.endswith('.txt') for name in os.listdir(dump)), 'XLA dumped nothing: the flags came too late'
  json.loads(result.stdout.splitlines()[-1])  # stdout stays the command's JSON
