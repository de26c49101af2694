"""Commands users typed from an earlier version's docs still work.

tests/fixtures/recorded/*.txt hold the `pax` command lines of earlier READMEs, as recorded
(record.py there). Every one must still parse: each option and subcommand it names exists (a
rename keeps its old name, paxcli.compat). The slow test runs those that need no outside data, at
tiny sizes, one after another in one directory, as a user's shell would.
"""

import json
import os
import re
import shlex
import sys

import pytest
import typer
import typer._click as CLICK  # Typer's own copy of click, whose errors the app raises

from conftest import REPO, run_pax
from paxcli.cli import common
from paxcli.cli.app import app

RECORDED = sorted((REPO / 'tests' / 'fixtures' / 'recorded').glob('*.txt'))


def _commands(path):
  """(line, words) of each recorded command."""
  lines = [line for line in path.read_text().splitlines() if not line.startswith('#')]
  return [(line, words) for line in lines for words in _split(line)]


def _split(line):
  """The words of each command on a line; shorthand the docs used for 'and so on' is dropped:
  `[--optional ...]` parts, a bare `...`, and `a; b` is two commands."""
  parts = [re.sub(r'(?<=\s)\.\.\.(?=\s|$)', '', re.sub(r'\[[^\]]*\]', '', part)) for part in line.split('; ')]
  return [_first_command(part) for part in parts]


def _first_command(text):
  """The words of the command a shell line starts with: up to a pipe, `||`, `&&` or a redirection."""
  lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
  lexer.whitespace_split = True
  words = []
  for word in lexer:
    if word and set(word) <= set('();<>|&'):
      break
    words.append(word)
  return words


def _argv(words):
  """The arguments after `pax`, with leading VAR=value environment words dropped."""
  while words and re.match(r'^[A-Z_]+=', words[0]):
    words = words[1:]
  assert words[0].endswith('pax'), words
  return words[1:]


def _parse(argv):
  """Parses argv as `pax` would, down to the command, without running it (click raises on a bad option)."""
  argv = common.normalize_argv(argv)
  group = typer.main.get_command(app)
  context = group.make_context('pax', list(argv), resilient_parsing=False)
  # Typer carries its own copy of click: a group is what lists commands.
  while hasattr(context.command, 'list_commands') and context._protected_args + context.args:
    name, command, rest = context.command.resolve_command(context, context._protected_args + context.args)
    context = command.make_context(name, rest, parent=context)
  return context


@pytest.mark.parametrize('path', RECORDED, ids=[p.stem for p in RECORDED])
def test_recorded_commands_still_parse(path):
  commands = _commands(path)
  assert len(commands) > 50
  bad = []
  for line, words in commands:
    argv = _argv(words)
    if argv and argv[0] == 'launch':  # what follows `--` is a command of its own: parse both
      argv, inner = argv[:argv.index('--')], argv[argv.index('--') + 1:]
      _check(bad, line, inner)
    _check(bad, line, argv)
  assert not bad, '\n'.join(bad)


def _check(bad, line, argv):
  try:
    _parse(argv)
  except typer.Exit:
    pass  # --help, --version
  except CLICK.ClickException as e:
    bad.append(f'{line}\n  -> {e.format_message()}')


def _doc_commands(page):
  """(line, words) of each `pax` command in a Markdown page's bash blocks (record.py's reading)."""
  sys.path.insert(0, str(REPO / 'tests' / 'fixtures' / 'recorded'))
  from record import commands
  return [(line, words) for line in commands(page.read_text()) for words in _split(line)]


DOCS = [REPO / 'README.md', *sorted((REPO / 'docs').rglob('*.md'))]


def test_the_commands_of_todays_docs_parse():
  bad = []
  for page in DOCS:
    for line, words in _doc_commands(page):
      argv = _argv(words)
      if argv and argv[0] == 'launch':
        argv, inner = argv[:argv.index('--')], argv[argv.index('--') + 1:]
        _check(bad, f'{page.name}: {line}', inner)
      _check(bad, f'{page.name}: {line}', argv)
  assert not bad, '\n'.join(bad)


TINY = ['--set', 'MODEL_DIMS=16', '--set', 'HIDDEN_DIMS=32', '--set', 'NUM_HEADS=2', '--set', 'DIMS_PER_HEAD=8',
        '--set', 'VOCAB_SIZE=64', '--set', 'MAX_SEQ_LEN=16', '--set', 'PERCORE_BATCH_SIZE=1']
# Placeholders of the 0.1.0 README, as a user fills them in, in the order the commands run.
FILLED = {'NAME': 'lm_cloud.LmCloudSpmdTest', '/tmp/run1': 'runs/lm_cloud.LmCloudSpmdTest',
          'runs/X': 'runs/lm_cloud.LmCloudSpmdTest'}
RUN = [
    'pax train --exp lm_cloud.LmCloudSpmdTest --job-log-dir /tmp/run1 --set NUM_LAYERS=2 --set task.train.num_train_steps=20',
    'pax experiments',
    'pax describe --exp NAME [--set ...]',
    'pax eval --exp NAME [--job-log-dir D]',
    'pax eval --exp NAME --step 100',
    'pax decode --exp NAME --beam-size 4 --length-penalty 0.8 --prompt-ids 12,15,18',
    'pax score requests.jsonl --exp NAME',
    'pax checkpoint inspect runs/X [--json]',
    'pax checkpoint convert runs/X out/bf16 --params-only --dtype bfloat16',
    'pax checkpoint convert runs/X out/st --to safetensors [--max-shard-size 5GB]',
    'pax inspect-input --exp NAME --check-sharding --num-hosts 4',
    'pax --version; pax version',
]


@pytest.mark.slow
def test_recorded_commands_run(tmp_path):
  """The 0.1.0 README's commands that need no outside data, filled in and run at tiny sizes."""
  recorded = {line for line, _ in _commands(REPO / 'tests' / 'fixtures' / 'recorded' / 'paxcli-0.1.0-README.txt')}
  (tmp_path / 'requests.jsonl').write_text(json.dumps({'context_ids': [5, 6, 7], 'continuation_ids': [8, 9]}) + '\n')
  flags = [f for f in os.environ.get('XLA_FLAGS', '').split() if not f.startswith('--xla_force_host_platform_device_count')]
  env = {'XLA_FLAGS': ' '.join(flags) or None}  # None: unset (XLA reads a blank XLA_FLAGS as a file name)
  for line in RUN:
    assert line in recorded, line  # runs what was recorded, not a command of its own
    for words in _split(line):
      argv = [FILLED.get(w, w) for w in _argv(words)]
      if argv[:1] in (['eval'], ['decode'], ['score'], ['describe'], ['train'], ['inspect-input']):
        argv = [*argv[:1], *TINY, *argv[1:]]  # first: a knob the line sets wins
      if argv[:1] == ['eval'] and '--step' in argv:
        argv[argv.index('--step') + 1] = '20'
      done = run_pax(*argv, cwd=tmp_path, env=env)
      assert done.returncode == 0, f'{line}\n{argv}\n{done.stderr[-2000:]}'

