"""Shared CLI pieces: option declarations, argv normalisation and error reporting."""

from __future__ import annotations

import os
import sys
from typing import Optional

import typer

from paxcli.errors import UserError

EXP_HELP = ('Experiment: a registered name (`pax experiments`), `module.Class`, or '
            '`path/file.py:Class`. Default: the built-in default.StdlibDocsLm.')
SET_HELP = ('Override KEY=VALUE, repeatable: a knob (NUM_LAYERS=2) or a config field by dotted '
            'path (task.train.learning_rate=3e-4). Values are Python literals, else strings.')
JOB_DIR_HELP = 'Job directory (checkpoints, summaries, config). Default: ./runs/<experiment>.'


def exp_option():
  return typer.Option(None, '--exp', '-e', help=EXP_HELP)


def set_option():
  return typer.Option([], '--set', '-s', help=SET_HELP)


def job_dir_option():
  return typer.Option(None, '--job-log-dir', '--job_log_dir', help=JOB_DIR_HELP)


def normalize_argv(argv: list[str]) -> list[str]:
  """Accepts Pax spellings: `--job_log_dir=x` becomes `--job-log-dir=x`.

  Arguments after a bare `--` belong to another command and are left alone.
  """
  out = []
  for i, arg in enumerate(argv):
    if arg == '--':
      return out + argv[i:]
    if arg.startswith('--') and '_' in arg.split('=', 1)[0]:
      name, eq, value = arg.partition('=')
      arg = name.replace('_', '-') + eq + value
    out.append(arg)
  return out


def error(message: str) -> None:
  from rich.console import Console
  Console(stderr=True, highlight=False, soft_wrap=True).print(f'[bold red]error:[/] {message}',
                                                              markup=True)


def run_app(app: typer.Typer, argv: list[str]) -> None:
  """Runs the app; a UserError becomes one red line and its exit code, never a traceback."""
  try:
    app(args=argv, prog_name='pax')  # standalone: usage errors print and exit 2 themselves
  except UserError as e:
    error(_escape(str(e)))
    sys.exit(e.exit_code)
  except KeyboardInterrupt:
    error('interrupted.')
    sys.exit(130)


def _escape(text: str) -> str:
  from rich.markup import escape
  return escape(text)


def default_job_dir(exp_name: str) -> str:
  return os.path.join('runs', exp_name.replace(':', '_').replace('/', '_'))


def resolve_name(exp: Optional[str]) -> str:
  from paxcli.experiment import DEFAULT_EXPERIMENT
  return exp or DEFAULT_EXPERIMENT
