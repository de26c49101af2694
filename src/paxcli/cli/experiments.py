"""`pax experiments`: list registered experiments."""

from __future__ import annotations

import json

import typer

from paxcli.cli import common


def experiments(json_out: bool = typer.Option(False, '--json', help='Print as JSON.')) -> None:
  """List registered experiments (recipes shipped with paxcli)."""

  from paxcli.experiment import import_all_recipes
  registry = import_all_recipes()
  rows = []
  for name, cls in sorted(registry.items()):
    doc = (cls.__doc__ or '').strip().split('\n')[0]
    rows.append({'name': name, 'summary': doc})
  if json_out:
    typer.echo(json.dumps(rows, indent=1))
    return
  table = common.table(title='Experiments')
  table.add_column('name', style='bold')
  table.add_column('summary')
  for row in rows:
    table.add_row(row['name'], row['summary'])
  common.console().print(table)


def register(app: typer.Typer) -> None:
  app.command('experiments', short_help='List registered experiments.')(experiments)
