"""`pax goodput JOB`: where a job's wall time went, by category, across every process and restart."""

from __future__ import annotations

import json

import typer

from paxcli.cli import common

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
  if json_out:
    typer.echo(json.dumps(account, indent=1))
    return
  console = common.console()
  wall = account['wall_seconds']
  t = common.table(title=f"Goodput of {account['job_dir']}: {account['goodput']:.1%} of {_clock(wall)} wall time",
            caption=_caption(account), caption_justify='left')
  for col, just in (('where the time went', 'left'), ('seconds', 'right'), ('share', 'right')):
    t.add_column(col, justify=just)
  for key, seconds in account['seconds'].items():
    t.add_row(NAMES[key], f'{seconds:,.1f}', f'{seconds / wall:.1%}' if wall else '-')
  t.add_row('wall time', f'{wall:,.1f}', '100.0%' if wall else '-', style='bold')
  console.print(t)
  if account['restarts']:
    r = common.table(title='Restarts')
    for col in ('#', 'reason', 'gap s', 'reached step', 'resumed from', 'steps redone'):
      r.add_column(col, justify='left' if col == 'reason' else 'right', overflow='fold')
    for i, one in enumerate(account['restarts'], 1):
      resumed = '-' if one['resumed_step'] is None else f"{one['resumed_step']} ({one['tier'] or 'fresh'})"
      r.add_row(str(i), one['reason'], f"{one['gap_seconds']:.1f}", _or_dash(one['reached_step']), resumed,
                _or_dash(one['redone_steps']))
    console.print(r)


def _caption(account: dict) -> str:
  steps = account['steps']
  lines = [f"{steps['productive']:,} steps trained, {steps['recomputed']:,} recomputed; "
           f"{account['incarnations']} start(s) of process 0, {len(account['restarts'])} restart(s); "
           f"{len(account['processes'])} process ledger(s)."]
  if account.get('lines_skipped'):
    lines.append(f"{account['lines_skipped']} unreadable ledger line(s) skipped (a killed process's last line).")
  return '\n'.join(lines)


def _clock(seconds: float) -> str:
  minutes, secs = divmod(int(round(seconds)), 60)
  hours, minutes = divmod(minutes, 60)
  return f'{hours}:{minutes:02d}:{secs:02d}'


def _or_dash(value) -> str:
  return '-' if value is None else str(value)


def register(app: typer.Typer) -> None:
  app.command('goodput', short_help='Where a job\'s time went (goodput, restarts).')(goodput)
