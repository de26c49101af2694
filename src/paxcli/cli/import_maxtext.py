"""`pax import-maxtext`: turn a MaxText run script into a paxcli experiment recipe.

Reads the script as text (never runs it), translates the trainer's `key=value` overrides
over MaxText's dated defaults, prints the translation table and writes a recipe file.
"""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from paxcli.cli import common
from paxcli.errors import UserError

_ERA_HELP = ('MaxText scaling era: scale (until 2023-07-21), jul2023, aug2023 (to 2023-09-07) '
             'or current. Default: read from the script.')


def register(app: typer.Typer) -> None:
  app.command('import-maxtext', short_help='Turn a MaxText run script into a recipe.')(import_maxtext)


def import_maxtext(
    script: str = typer.Argument(..., metavar='SCRIPT', show_default=False, help='The MaxText run script (.sh); it is read, never run.'),
    args: Optional[List[str]] = typer.Argument(
        None, metavar='KEY=VALUE', show_default=False, help='KEY=VALUE arguments as the script itself would take them (RUN_NAME=x ...).'),
    output: Optional[str] = typer.Option(
        None, '--output', '-o', metavar='FILE', help='Recipe file to write. Default: ./maxtext_<script stem>.py.'),
    class_name: Optional[str] = typer.Option(
        None, '--class-name', metavar='NAME', help='Experiment class name. Default: MaxText<ScriptStem>.'),
    force: bool = typer.Option(False, '--force', help='Overwrite an existing recipe file.'),
    as_json: bool = typer.Option(False, '--json', help='Print the translation as JSON.'),
    dry_run: bool = typer.Option(False, '--dry-run', help='Print only; write no recipe.'),
    lenient: bool = typer.Option(
        False, '--lenient', help='Translate even with keys MaxText\'s base.yml (of the script\'s era) '
        'does not define: warn and ignore them instead of refusing, as MaxText would.'),
    strict: bool = typer.Option(
        False, '--strict', help='Fail (exit 2, no recipe) on unknown keys and on mesh axes '
        'paxcli does not have.'),
    era: Optional[str] = typer.Option(None, '--maxtext-era', metavar='ERA', help=_ERA_HELP),
    date: Optional[str] = typer.Option(
        None, '--maxtext-date', metavar='YYYY-MM-DD', help='Date of the MaxText the script ran with (YYYY-MM-DD): picks '
        'the era and the base.yml defaults of that day.'),
    base_config: Optional[str] = typer.Option(
        None, '--base-config', metavar='FILE', help="Defaults from this MaxText base.yml instead of paxcli's "
        'dated copies.'),
    model_config: Optional[str] = typer.Option(
        None, '--model-config', metavar='FILE', help='A MaxText model config (configs/models/X.yml) for a '
        'model_name paxcli does not ship.'),
    num_devices: Optional[int] = typer.Option(
        None, '--num-devices', metavar='N', help='Devices of the whole run (all slices), to resolve -1 '
        'parallelism.'),
    topology: Optional[str] = typer.Option(
        None, '--topology', metavar='TYPE', help='TPU type of one slice, e.g. v4-128 (v2-v4 and v5p count '
        'TensorCores; v5e/v6e count chips).'),
    num_slices: Optional[int] = typer.Option(None, '--num-slices', metavar='N', help='Number of slices.'),
) -> None:
  """Translate a MaxText run script into a Pax-style experiment recipe.

  Prints each knob with its MaxText key and scaled value, the keys not translated, and writes a recipe.
  """
  from paxcli import api
  made = api.import_maxtext(script, list(args or []), output=output, class_name=class_name, force=force,
                            dry_run=dry_run, lenient=lenient, strict=strict, maxtext_era=era, maxtext_date=date,
                            base_config=base_config, model_config=model_config, num_devices=num_devices,
                            topology=topology, num_slices=num_slices)
  result = made.translation
  if as_json:
    typer.echo(json.dumps(made.to_json(), indent=2, default=str))
  else:
    _print(result, made.recipe, made.class_name)
  if strict and result.strict_warnings:
    raise UserError(f'--strict: {len(result.strict_warnings)} problem(s) that --strict refuses (unknown keys, '
                    f'mesh axes paxcli lacks); no recipe written. First: {result.strict_warnings[0]}')


def _print(result, path: Optional[str], class_name: str) -> None:
  from paxcli.maxtext import defaults as mt
  from paxcli.maxtext import recipe as maxtext_recipe

  console = common.rich_console(highlight=False, soft_wrap=True)
  if not console.is_terminal:
    console = common.rich_console(highlight=False, soft_wrap=True, width=150)  # logs and pipes: keep rows whole
  info = result.script
  console.print(f'Read [bold]{common.escape(info.path)}[/] as text (not run); its trainer call, on line {info.line}: '
                f'{common.escape(info.entry)} {common.escape(info.config_path or "")}')
  console.print(f'era [bold]{result.era}[/]: {common.escape(mt.ERAS[result.era].rule)}')
  console.print(f'  because {common.escape(result.era_reason)}', style='dim')
  console.print(f'defaults: {common.escape(result.defaults)}', style='dim')
  if result.preset:
    console.print(f'model preset: [bold]{common.escape(result.preset)}[/]')
  table = common.table(title='MaxText -> Pax', title_justify='left')
  for column in ('Pax knob', 'value', 'MaxText key', 'raw value', 'after scale'):
    table.add_column(column, overflow='fold')
  for row in result.rows:
    style = None if row.source == 'script' else 'dim'
    table.add_row(row.knob, common.escape(_short(row.value)), common.escape(row.key), common.escape(row.raw),
                  common.escape(row.after), style=style)
  console.print(table)
  if result.untranslated:
    rest = common.table(title='Not translated', title_justify='left')
    for column in ('MaxText key', 'value', 'reason'):
      rest.add_column(column, overflow='fold')
    for u in result.untranslated:
      rest.add_row(common.escape(u.key), common.escape(u.value), common.escape(u.reason),
                   style='yellow' if u.kind == 'unknown' else None)
    console.print(rest)
  for warning in result.warnings:
    console.print(f'[bold yellow]WARNING[/] {common.escape(warning)}')
  for note in result.notes:
    console.print(f'note: {common.escape(note)}', style='dim')
  if info.skipped:
    console.print(f'note: {len(info.skipped)} other command(s) in the script were skipped, '
                  'not run.', style='dim')
  if path:
    exp = f'{path}:{class_name}'
    check = ' '.join(maxtext_recipe.cpu_check(exp, class_name, bool(result.unsupported), result.knobs))
    console.print(f'wrote [bold]{common.escape(path)}[/] (class {class_name}). Check it on this CPU first (2 layers, 2 '
                  f'steps: seconds; it builds and trains, its docstring says more):\n'
                  f'  pax train --exp {common.escape(exp)} {common.escape(check)}\n'
                  f'then the full run: pax train --exp {common.escape(exp)}')


def _short(value) -> str:
  text = str(value)
  return text if len(text) <= 60 else text[:57] + '...'
