"""`pax inspect-input`: look at real batches, or at a raw TFRecord file."""

from __future__ import annotations

import json
import os
from typing import List, Optional

import typer

from paxcli.cli import common


def inspect_input(
    path: Optional[str] = typer.Argument(None, metavar='FILE', show_default=False, help='A TFRecord file (or glob) of tf.train.Example to inspect '
                                                    'without an experiment.'),
    exp: Optional[str] = common.exp_option(),
    overrides: List[str] = common.set_option(),
    job_log_dir: Optional[str] = typer.Option(None, '--job-log-dir', metavar='DIR', help='Show the input of this '
                                              'job: the experiment, --set settings and tokenizer it was trained '
                                              'with (--exp/--set on top).'),
    split: str = typer.Option('train', '--split', metavar='NAME', help='train, eval, or an input name.'),
    num_batches: int = typer.Option(3, '--num-batches', '-n', metavar='N', min=1, help='Batches to read.'),
    num_examples: int = typer.Option(2, '--num-examples', metavar='N', min=0, help='Examples of each batch to decode.'),
    host_index: int = typer.Option(0, '--host-index', metavar='I', help='Which host to impersonate.'),
    num_hosts: int = typer.Option(1, '--num-hosts', metavar='N', min=1, help='How many hosts feed the run.'),
    check_sharding: bool = typer.Option(False, '--check-sharding',
                                        help='Build every host\'s input and check that they never overlap.'),
    json_out: bool = typer.Option(False, '--json', help='JSON lines instead of tables.'),
) -> None:
  """Show batches of an experiment's input: shapes, dtypes, padding, decoded text, throughput."""
  from paxcli import api
  console = common.console()
  if path is not None:
    _emit_file(console, api.inspect_input(path=path, num_examples=num_examples), json_out)
    return

  def emit(name: str, record: dict) -> None:  # each batch as it is read
    if json_out:
      typer.echo(json.dumps(record))
    else:
      _print_batch(console, name, record)

  report = api.inspect_input(exp, overrides=overrides, job_dir=job_log_dir, split=split, num_batches=num_batches,
                             num_examples=num_examples, host_index=host_index, num_hosts=num_hosts,
                             check_sharding=check_sharding, console=common.console(stderr=True), on_batch=emit)
  if check_sharding:
    _emit_sharding(console, report, json_out)
    if not report['ok']:
      raise typer.Exit(1)
    return
  rate = report['throughput']
  if json_out:
    typer.echo(json.dumps({'throughput': rate}))
    return
  count = rate['batches']
  end = (f" The input ended after {count} batch{'es' if count != 1 else ''} of the {num_batches} asked for "
         '(a finite input, e.g. an eval epoch with repeat=False).') if rate['input_ended'] else ''
  console.print(f"Read {count} batch{'es' if count != 1 else ''}: {rate['batches_per_sec']:.1f} batches/s, "
                f"{rate['examples_per_sec']:.1f} examples/s.{end}", highlight=False)


def _print_batch(console, name: str, record: dict) -> None:
  table = common.table(title=f"{name}: batch {record['batch']} (host {record['host']} of {record['num_hosts']})")
  for col in ('feature', 'shape', 'dtype', 'min', 'max', 'padding', 'weight 0'):
    table.add_column(col, justify='left' if col in ('feature', 'dtype') else 'right')
  for s in record['features']:
    unweighted = '' if s.get('unweighted') is None else f"{100 * s['unweighted']:.1f}%"
    table.add_row(s['feature'], str(tuple(s['shape'])), s['dtype'], str(s['min']), str(s['max']),
                  f"{100 * s['padding']:.1f}%", unweighted)
  console.print(table)
  console.print('padding: after the documents of a row; weight 0: inside them but not trained on (prompts, chat '
                'headers).', highlight=False)
  for ex in record['examples']:
    if 'text' in ex:
      console.print(f"[bold]row {ex['row']}[/] ({ex['length']} tokens): {common.escape(ex['text'])!s}")
      console.print(f"  ids: {ex['ids'][:48]}{' ...' if len(ex['ids']) > 48 else ''}", highlight=False)
      if ex.get('trained'):   # the targets of weight 1: what the row teaches the model to say
        console.print('  trained on: ' + ' | '.join(repr(t) for t in ex['trained']), highlight=False, markup=False)
    else:
      console.print(ex, highlight=False)


def _emit_sharding(console, report, json_out) -> None:
  if json_out:
    typer.echo(json.dumps(report))
    return
  table = common.table(title=f"{report['kind']} input over {report['num_hosts']} hosts")
  for col in ('host', 'batches', 'examples'):
    table.add_column(col, justify='right')
  for h in report['hosts']:
    table.add_row(str(h['host']), str(h['batches']), str(h['examples']))
  console.print(table)
  if report['kind'] == 'eval':
    console.print(f"The eval loop runs {report['eval_steps']} steps on every host; hosts with fewer batches "
                  'feed zero-weight padding.')
  if report['num_duplicates']:
    console.print(f"[bold red]Problem:[/] {report['num_duplicates']} examples are emitted by more than one host, "
                  'e.g.:')
    for d in report['duplicates'][:5]:
      console.print(f"  example {d['example']}: host {d['first'][0]} batch {d['first'][1]} row {d['first'][2]}"
                    f" and host {d['again'][0]} batch {d['again'][1]} row {d['again'][2]}", highlight=False)
  elif report['ok']:
    console.print('[green]OK:[/] no example is emitted by two hosts.')
  else:
    console.print('[bold red]Problem:[/] some host emitted no examples.')


def _emit_file(console, report, json_out) -> None:
  if json_out:
    typer.echo(json.dumps(report, default=str))
    return
  files = report['files']
  console.print(f"{len(files)} file(s): {', '.join(os.path.basename(f) for f in files[:5])}"
                f"{' ...' if len(files) > 5 else ''}; {report['records_scanned']} records scanned "
                f"({report['records_per_sec']:.0f} records/s)", highlight=False)
  table = common.table(title='Features')
  for col in ('feature', 'kind', 'lengths seen'):
    table.add_column(col)
  for f in report['features']:
    span = str(f['min_length']) if f['min_length'] == f['max_length'] else f"{f['min_length']}-{f['max_length']}"
    table.add_row(f['feature'], f['kind'], span)
  console.print(table)
  for i, record in enumerate(report['first_records']):
    console.print(f'[bold]record {i}[/]')
    for name, value in record.items():
      console.print(f'  {name}: {value}', highlight=False, markup=False)


def register(app: typer.Typer) -> None:
  app.command('inspect-input', short_help='Show real batches of an input or TFRecord.')(inspect_input)
