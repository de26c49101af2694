"""Shared CLI pieces: option declarations, argv normalisation and error reporting.

rich is imported where a line is printed, never at start-up: it would double `pax --help`'s time.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import sys
from typing import Optional

import typer
import typer.main

from paxcli import compat
from paxcli.errors import UserError, shorten
from paxcli.runtime import distributed

EXP_HELP = ('Experiment: a registered name (`pax experiments`), `module.Class`, or '
            '`path/file.py:Class`. Default: the built-in default.StdlibDocsLm.')
SET_HELP = ('Override KEY=VALUE, repeatable: a knob (NUM_LAYERS=2) or a config field by dotted '
            'path (task.train.learning_rate=3e-4). Values are Python literals, else strings.')
JOB_DIR_HELP = 'Job directory (checkpoints, summaries, config). Default: ./runs/<experiment>.'
COORDINATOR_HELP = ('Several processes (one per host): HOST:PORT of process 0, where JAX\'s coordinator '
                    'listens; the same on every process. With none of --coordinator, --num-processes, '
                    '--process-id, JAX detects a cluster (Cloud TPU, SLURM, Open MPI, Kubernetes) or '
                    'one process runs.')
NUM_PROCESSES_HELP = 'Several processes: how many in all. 1 means one process, even on a cluster.'
PROCESS_ID_HELP = 'Several processes: this process\'s index, 0 to N-1 (0 runs the coordinator).'
HEARTBEAT_HELP = ('Several processes: when another process dies or its host drops off the network for this long, '
                  'every process stops with one line naming it (exit code 124), for a scheduler or `pax launch '
                  '--max-restarts` to restart the job. Default: 100.')


def exp_option():
  return typer.Option(None, '--exp', '-e', metavar='NAME', help=EXP_HELP)


def set_option():
  return typer.Option([], '--set', '-s', metavar='KEY=VALUE', help=SET_HELP)


def job_dir_option():
  return typer.Option(None, '--job-log-dir', metavar='DIR', help=JOB_DIR_HELP)  # --job_log_dir: normalize_argv


def coordinator_option():
  return typer.Option(None, '--coordinator', metavar='HOST:PORT', envvar='PAX_COORDINATOR', help=COORDINATOR_HELP,
                      rich_help_panel='Several processes')


def num_processes_option():
  return typer.Option(None, '--num-processes', metavar='N', envvar='PAX_NUM_PROCESSES', help=NUM_PROCESSES_HELP,
                      min=1, rich_help_panel='Several processes')


def process_id_option():
  return typer.Option(None, '--process-id', metavar='I', envvar='PAX_PROCESS_ID', help=PROCESS_ID_HELP, min=0,
                      rich_help_panel='Several processes')


def heartbeat_timeout_option():
  return typer.Option(None, '--heartbeat-timeout', metavar='SECONDS', envvar='PAX_HEARTBEAT_TIMEOUT',
                      help=HEARTBEAT_HELP, min=1.0, rich_help_panel='Several processes')


def normalize_argv(argv: list[str]) -> list[str]:
  """Accepts Pax spellings: `--job_log_dir=x` becomes `--job-log-dir=x`; and renamed options
  (compat.RENAMED_OPTIONS), with a warning.

  Arguments after a bare `--` belong to another command and are left alone.
  """
  out = []
  for i, arg in enumerate(argv):
    if arg == '--':
      return out + argv[i:]
    if arg.startswith('--') and '_' in arg.split('=', 1)[0]:
      name, eq, value = arg.partition('=')
      arg = name.replace('_', '-') + eq + value
    if arg.startswith('--'):
      arg = compat.new_option(arg)
    out.append(arg)
  return out


def console(stderr: bool = False, wide: bool = False):
  """A rich Console; wide when the output is a file or pipe, so tables are not cut (160 columns, or
  with `wide` as wide as a table's rows need: one line per row)."""
  stream = sys.stderr if stderr else sys.stdout
  return rich_console(stderr=stderr, width=None if stream.isatty() else (100_000 if wide else 160))


# rich, loaded by the command that prints (`pax --help` loads none of it): one place for each part.

def rich_console(**settings):
  from rich.console import Console
  return Console(**settings)


def table(*args, **settings):
  """A rich Table."""
  from rich.table import Table
  return Table(*args, **settings)


def text(*args, **settings):
  """A rich Text: printed as it is, never read as markup."""
  from rich.text import Text
  return Text(*args, **settings)


def escape(value: str) -> str:
  """`value` with rich's markup escaped, for printing text others wrote."""
  from rich.markup import escape as rich_escape
  return rich_escape(value)


def progress(console, label: str):
  """A transient rich bar labelled `label`, with its count and elapsed time."""
  from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
  return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                  transient=True)


def counting_bar(console, label: str):
  """A context factory for the loops' `progress` argument: bar(total) yields advance(n), drawing a
  transient rich bar labelled `label` (decode's prompts, score's windows)."""

  @contextlib.contextmanager
  def bar(total: int):
    with progress(console, label) as shown:
      task = shown.add_task(label, total=total)
      yield lambda n: shown.advance(task, n)

  return bar


def count(n: int, noun: str) -> str:
  """'1 result', '2 results', '1,024 windows': a number with its noun in the right number."""
  return f'{n:,} {noun}' + ('' if n == 1 else 's')


def error(message: str) -> None:
  rich_console(stderr=True, highlight=False, soft_wrap=True).print(f'[bold red]error:[/] {message}', markup=True)


def tidy_help(command) -> None:
  """One help style for every subcommand, whoever wrote it: an option that names no
  metavar gets its own name (`--dtype DTYPE`, not typer's `<str>`), and the command list
  shows whole first sentences, never cut with `...`."""
  for param in command.params:  # duck-typed: typer vendors its own click in recent versions
    if getattr(param, 'param_type_name', '') == 'option' and not param.is_flag and param.metavar is None:
      param.metavar = (param.name or 'value').strip('_').upper()
    elif getattr(param, 'param_type_name', '') == 'argument':
      if param.metavar is None:
        param.metavar = (param.name or 'value').strip('_').upper()
      if hasattr(param, 'display_type_rich'):  # typer >= 0.20 would add `<str>` after the name
        param.display_type_rich = lambda ctx=None: None
  for sub in getattr(command, 'commands', {}).values():
    if sub.short_help is None and sub.help:
      first = sub.help.strip().split('\n\n')[0].replace('\n', ' ')
      first = first.split('. ')[0].split(' (')[0].rstrip('.:')
      sub.short_help = first + '.'
    tidy_help(sub)


def run_app(app: typer.Typer, argv: list[str], whole_process: bool = False) -> None:
  """Runs the app; a UserError becomes one red line and its exit code, never a traceback. In a multi-process
  run the others are told how this process ends, and a failure ends it at once (distributed.end_command).

  `whole_process`: the command is this process (`pax ...`), which may then end at once after a bucket
  stopped answering (`_end_now`).
  """
  try:
    _run_app(app, argv, whole_process)
  except SystemExit as e:
    distributed.end_command(e.code if isinstance(e.code, int) else (0 if e.code is None else 1))
    raise
  except Exception as e:  # noqa: BLE001 - shown by end_command in a multi-process run, else by Python
    distributed.end_command(1, error=e)
    raise
  distributed.end_command(0)


def _run_app(app: typer.Typer, argv: list[str], whole_process: bool) -> None:
  try:
    command = typer.main.get_command(app)
    tidy_help(command)
    hint = habit_hint(command, argv)
    if hint:
      raise UserError(hint)
    code = command.main(args=argv, prog_name='pax', standalone_mode=False)
  except UserError as e:
    # fiddle appends its build context to errors raised while building a config.
    message = _cap_lines(str(e).split('\n\nFiddle context:')[0])
    distributed.say_exit(e.exit_code, message.splitlines()[0] if message else '')
    error(escape(message))
    if whole_process:
      _end_now(e.exit_code)
    sys.exit(e.exit_code)
  except KeyboardInterrupt:
    error('interrupted.')
    sys.exit(130)
  except Exception as e:  # noqa: BLE001 - click's own (typer vendors click): a usage error, an abort
    if _out_of_device_memory(e):
      error(escape(_OUT_OF_MEMORY.format(shorten(str(e).strip().splitlines()[0], 300))))
      sys.exit(UserError.exit_code)
    if not (hasattr(e, 'format_message') and isinstance(getattr(e, 'exit_code', None), int)):
      if type(e).__name__ != 'Abort':
        raise
      error('interrupted.')
      sys.exit(130)
    if type(e).__name__ == 'NoArgsIsHelpError':   # `pax`, `pax launch` alone: their help, as before
      e.show()
    else:
      _usage_error(e)
    sys.exit(e.exit_code)
  if isinstance(code, int) and code:   # typer.Exit(N) inside a command
    sys.exit(code)


_OUT_OF_MEMORY = ('The device ran out of memory ({}). The settings ask for more than it holds: lower '
                  'PERCORE_BATCH_SIZE or MAX_SEQ_LEN, shard over more devices (ICI_MESH_SHAPE), or keep less for the '
                  'backward pass (CHECKPOINT_POLICY); `pax bench mfu --compile-only` shows what a step needs.')


def _out_of_device_memory(e: BaseException) -> bool:
  """XLA's RESOURCE_EXHAUSTED (a step, an array or a compilation past the device's memory): a setting too
  large for the machine, said in one line like every other, not a traceback."""
  return type(e).__name__ in ('JaxRuntimeError', 'XlaRuntimeError') and 'RESOURCE_EXHAUSTED' in str(e)


def _end_now(code: int) -> None:
  """Ends the process at once when it gave up on a bucket that stopped answering (storage.give_up): the
  libraries' own threads (orbax's writes of the abandoned save) would otherwise hold the interpreter's exit
  for as long as each of their requests takes to time out, minutes after the one line was said."""
  from paxcli.jobdir import storage   # no heavy import: storage is paxcli's own module
  if not storage.gave_up():
    return
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(Exception):
      stream.flush()
  os._exit(code)


def _usage_error(e) -> None:
  """A usage error as every other error: the command's usage line, then one `error:` line."""
  ctx = getattr(e, 'ctx', None)
  if ctx is not None:
    hint = f"Try '{ctx.command_path} {ctx.help_option_names[0]}' for help." if ctx.help_option_names else ''
    sys.stderr.write(f'{ctx.get_usage()}\n{hint}\n\n')
    sys.stderr.flush()
  error(escape(e.format_message()))


_PAXML_MODES = {'train': 'train', 'eval': 'eval', 'decode': 'decode', 'decode_once': 'decode'}
_KEY_VALUE = re.compile(r'^[A-Za-z_][A-Za-z0-9_.]*=')


def habit_hint(command, argv: list[str]) -> Optional[str]:
  """One line naming paxcli's spelling for a paxml or MaxText habit that would fail anyway:
  `pax --exp=E --mode=train`, `pax train NUM_LAYERS=2`, `--set NUM_LAYERS 2`. None otherwise."""
  if not argv:
    return None
  if argv[0].startswith('-') and argv[0] not in ('-h', '--help', '--version'):
    return _paxml_hint(argv)
  sub, rest = command, list(argv)
  while hasattr(sub, 'commands') and rest and rest[0] in sub.commands:  # `bench mfu`: the leaf command
    sub, rest = sub.commands[rest[0]], rest[1:]
  if hasattr(sub, 'commands') or any(p.param_type_name == 'argument' for p in sub.params):
    return None  # a group, or a command with arguments of its own (import-maxtext KEY=VALUE, convert SRC DST)
  takes_value = {name for p in sub.params if p.param_type_name == 'option' and not p.is_flag
                 for name in p.opts + p.secondary_opts}
  name = ' '.join(argv[:len(argv) - len(rest)])
  i = 0
  while i < len(rest):
    arg = rest[i]
    if arg == '--':
      return None
    if arg in takes_value:
      value = rest[i + 1] if i + 1 < len(rest) else None
      if arg in ('--set', '-s') and value is not None and '=' not in value:
        after = rest[i + 2] if i + 2 < len(rest) and not rest[i + 2].startswith('-') else 'VALUE'
        return (f'--set takes KEY=VALUE as one argument (paxcli\'s spelling of MaxText\'s {value}={after}): '
                f'pax {name} --set {value}={after}')
      i += 2
      continue
    if _KEY_VALUE.match(arg):
      return (f'{shorten(arg, 80)}: MaxText-style KEY=VALUE arguments are --set overrides in paxcli: '
              f'pax {name} --set {shorten(arg, 80)}')
    i += 1
  return None


def _paxml_hint(argv: list[str]) -> Optional[str]:
  """`pax --exp=E --mode=train ...` (paxml's main.py flags) -> `pax train --exp=E ...`."""
  mode, rest, skip = None, [], False
  for i, arg in enumerate(argv):
    if skip:
      skip = False
    elif arg.startswith('--mode='):
      mode = arg.split('=', 1)[1]
    elif arg == '--mode' and i + 1 < len(argv):
      mode, skip = argv[i + 1], True
    else:
      rest.append(arg)
  if mode is None and not any(a == '--exp' or a.startswith('--exp=') for a in argv):
    return None
  sub = _PAXML_MODES.get(mode or 'train')
  if sub is None:
    return (f"paxml's --mode={mode} has no paxcli command; the commands are train, eval, decode "
            '(`pax --help`).')
  shown = ' '.join(shlex.quote(a) for a in rest)
  return (f"paxml's {'--mode=' + mode if mode else 'flags before a command'}: paxcli spells it as a command "
          f'first, then its options: pax {sub} {shorten(shown, 200)}')


def _cap_lines(text: str, limit: int = 500) -> str:
  """No line of an error longer than about `limit` characters (values the user typed are echoed)."""
  return '\n'.join(shorten(line, limit) for line in text.split('\n'))


PROFILE_STEPS_HELP = 'Trace steps A-B (e.g. 10-15) with jax.profiler into <job>/profile (TensorBoard, XProf).'
PGLE_HELP = ('GPU only: `auto` turns on JAX\'s profile-guided latency estimation (the first steps are '
             'profiled, then the step is recompiled with the measured latencies).')
PGLE_PROFILE_HELP = ('GPU only: a PGLE profile file. If PATH exists it is used; else a few steps are profiled, '
                     'the latencies written to PATH, and the step recompiled with them.')


def profile_steps_option():
  return typer.Option(None, '--profile-steps', metavar='A-B', help=PROFILE_STEPS_HELP, rich_help_panel='Performance')


def pgle_option():
  return typer.Option(None, '--pgle', metavar='auto', help=PGLE_HELP, rich_help_panel='Performance')


def pgle_profile_option():
  return typer.Option(None, '--pgle-profile', metavar='PATH', help=PGLE_PROFILE_HELP, rich_help_panel='Performance')
