"""`pax goodput JOB`: where a job's wall time went, by category, across every process and restart."""

from __future__ import annotations

import json

import typer

from paxcli.cli import common
from paxcli.errors import printable

NAMES = {'productive': 'productive steps', 'recomputed': 'recomputed steps (after restarts)', 'startup': 'start-up',
         'compile': 'compilation', 'data': 'data waits', 'checkpoint': 'checkpoint stalls', 'eval': 'eval/decode',
         'shutdown': 'shut-down', 'restart': 'restart gaps (failure to next start)'}


def goodput(
    job_dir: str = typer.Argument(..., metavar='JOB', help='The job directory of a `pax train` run.'),
    json_out: bool = typer.Option(False, '--json', help='Print the account as JSON (with each process\'s).'),
) -> None:
  """Where a job's wall time went: productive steps, start-up, compilation, data waits, checkpoint stalls,
  eval/decode, steps recomputed after restarts, and the gaps between a failure and the next start.

  Read from the job's ledger (goodput/ in the job directory), written by every process of every
  `pax train` and `pax launch` on it; the figures add up to the wall time. The job's are process 0's.
  """
  from paxcli import api
  account = api.goodput(job_dir)
  if json_out:   # the ledger's numbers are bounded (jobdir/ledger.py): never NaN or Infinity, which are not JSON
    typer.echo(json.dumps(account, indent=1, allow_nan=False))
    return
  console = common.console()
  wall = account['wall_seconds']
  t = common.table(title=f"Goodput of {_text(account['job_dir'])}: {account['goodput']:.1%} of {_clock(wall)} wall time",
            caption=_caption(account), caption_justify='left')
  for col, just in (('where the time went', 'left'), ('seconds', 'right'), ('share', 'right')):
    t.add_column(col, justify=just)
  for key, seconds in account['seconds'].items():
    t.add_row(NAMES[key], f'{seconds:,.1f}', f'{seconds / wall:.1%}' if wall else '-')
  t.add_row('wall time', f'{wall:,.1f}', '100.0%' if wall else '-', style='bold')
  console.print(t)
  ended = account.get('ended') or {}
  died = ended.get('state') in ('died', 'diverged', 'refused')
  if account['restarts'] or died:
    r = common.table(title='Restarts, and the failure that ended the job' if died and account['restarts']
              else 'The failure that ended the job' if died else 'Restarts')
    for col in ('#', 'process', 'reason', 'gap s', 'reached step', 'resumed from', 'steps redone'):
      r.add_column(col, justify='left' if col in ('process', 'reason') else 'right', overflow='fold')
    for i, one in enumerate(account['restarts'], 1):
      resumed = '-' if one['resumed_step'] is None else f"{one['resumed_step']} ({one['tier'] or 'fresh'})"
      r.add_row(str(i), _process(one.get('process')), _text(one['reason']), f"{one['gap_seconds']:.1f}",
                _or_dash(one['reached_step']), resumed, _or_dash(one['redone_steps']))
    if died:
      r.add_row(ended['state'], _process(ended.get('process')), _text(ended.get('reason') or '-'), '-',
                _or_dash(ended.get('step')), '-', '-', style='bold red')
    console.print(r)


def _process(index) -> str:
  return '-' if index is None else f'p{index}'


def _caption(account: dict) -> str:
  steps = account['steps']
  lines = [f"{steps['productive']:,} steps trained, {steps['recomputed']:,} recomputed; "
           f"{account['incarnations']} start(s) of process 0, {len(account['restarts'])} restart(s); "
           f"{len(account['processes'])} process ledger(s)."]
  ended = account.get('ended')
  if ended:
    lines.append(_ending(ended))
  if account.get('lines_skipped'):
    lines.append(f"{account['lines_skipped']} unreadable ledger line(s) skipped (a killed process's last line).")
  return '\n'.join(lines)


def _text(value) -> str:
  """A string from a ledger (a launcher's failure reason) or a path, as text in a rich table: its markup
  escaped and its control characters written out, so that a ledger never draws on the terminal."""
  return common.escape(printable(value))


def _ending(ended: dict) -> str:
  """'The job died at step 7: p1 was killed by SIGKILL ...' (the restart table's last row says it too)."""
  at = f" at step {ended['step']}" if ended.get('step') is not None else ''
  who = f"p{ended['process']} " if ended.get('process') is not None else ''
  why = f": {who}{_text(ended['reason'])}" if ended.get('reason') else ''
  state = {'running': 'is running (or its last run lost its end record)' if ended.get('reason') else 'is running'}
  return f"The job {state.get(ended['state'], ended['state'])}{at}{why}."


def _clock(seconds: float) -> str:
  minutes, secs = divmod(int(round(seconds)), 60)
  hours, minutes = divmod(minutes, 60)
  return f'{hours}:{minutes:02d}:{secs:02d}'


def _or_dash(value) -> str:
  return '-' if value is None else str(value)


def register(app: typer.Typer) -> None:
  app.command('goodput', short_help='Where a job\'s time went (goodput, restarts).')(goodput)
