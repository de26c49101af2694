"""`pax data prepare|show`: your files tokenized once into ArrayRecord shards, and what such a directory holds."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from paxcli.cli import common

app = typer.Typer(help='Prepare your own data: tokenized ArrayRecord shards (the Grain input reads them).',
                  no_args_is_help=True)


@app.command('prepare')
def prepare_command(
    paths: List[str] = typer.Argument(..., metavar='SRC... OUT', help='Files to prepare (globs of .txt, .jsonl, '
                                      '.parquet, TFRecord or ArrayRecord files, as TRAIN_DATA), then the output '
                                      'directory (new or empty; or an unfinished prepare of the same files, '
                                      'which resumes).'),
    tokenizer: Optional[str] = typer.Option(None, '--tokenizer', metavar='FILE', help='A sentencepiece .model '
                                            'or a tokenizer.json (default: one trained on the train side, as '
                                            'pax train trains one without TOKENIZER).'),
    vocab_size: int = typer.Option(2048, '--vocab-size', metavar='N', min=260, help='Pieces of the trained '
                                   'tokenizer (without --tokenizer); match the model\'s VOCAB_SIZE.'),
    text_field: str = typer.Option('text', '--text-field', metavar='NAME', help='The JSONL / Parquet / '
                                   'tf.train.Example field of the text (as the TEXT_FIELD knob).'),
    num_shards: Optional[int] = typer.Option(None, '--num-shards', metavar='N', min=1, help='Shards of the train '
                                             'split (default: one per 64M characters of text).'),
    eval_split: bool = typer.Option(True, '--eval-split/--no-eval-split', help='Hold out 1 in 20 documents by '
                                    'the SHA-1 of their text (the split TRAIN_DATA makes without EVAL_DATA), '
                                    'or put every document in train.'),
    workers: Optional[int] = typer.Option(None, '--workers', metavar='N', min=1, help='Tokenizing processes '
                                          '(default: one per CPU); the output is the same for any number.'),
    chat_template: str = typer.Option('', '--chat-template', metavar='NAME', help='Chat records: a named chat '
                                      'template the tokenizer ships, or paxcli for paxcli\'s own format (default: '
                                      'the tokenizer\'s own template; refused if it ships none, unless the '
                                      'tokenizer is trained here), as the CHAT_TEMPLATE knob.'),
    json_out: bool = typer.Option(False, '--json', help='Print the summary as JSON.'),
) -> None:
  """Tokenize files into ArrayRecord shards with a manifest (prepared.json). Every bad line is
  reported, with its file and line, before anything is written; run it again after a kill: finished
  shards are kept."""
  from paxcli import api
  if len(paths) < 2:
    raise typer.BadParameter('give at least one SRC and then OUT.', param_hint='SRC... OUT')
  result = api.data_prepare(paths[:-1], paths[-1], tokenizer=tokenizer, vocab_size=vocab_size,
                            text_field=text_field, num_shards=num_shards, eval_split=eval_split, workers=workers,
                            chat_template=chat_template, console=common.console(stderr=True))
  if json_out:
    typer.echo(json.dumps(result, indent=1))
    return
  console = common.console()
  for split in result['records']:  # plain text: a path may hold [brackets] that rich reads as markup
    console.print(f'{split}: {result["documents"][split]:,} documents -> {result["records"][split]:,} records, '
                  f'{result["tokens"][split]:,} tokens in {result["shards"][split]} shard(s)', highlight=False,
                  markup=False)
  if result['tokenized_documents']:
    console.print(f'Tokenized {result["tokenized_documents"]:,} documents with {result["workers"]} worker(s): '
                  f'{result["documents_per_sec"]:,.0f} documents/s, {result["tokens_per_sec"]:,.0f} tokens/s; '
                  f'wrote {result["output"]}', highlight=False, markup=False)


@app.command('show')
def show_command(
    path: str = typer.Argument(..., help='A directory written by `pax data prepare`.'),
    json_out: bool = typer.Option(False, '--json', help='Print the manifest as JSON.'),
) -> None:
  """A prepared directory's manifest: tokenizer, shards, records and tokens per split, sources."""
  from paxcli import api
  info = api.data_show(path)
  if json_out:
    typer.echo(json.dumps(info, indent=1))
    return
  console = common.console()
  config = f' with {info["tokenizer_config"]}' if info.get('tokenizer_config') else ''
  console.print(f'{info["path"]}: tokenizer {info["tokenizer"]}{config} ({info["vocab_size"]:,} tokens, EOS '
                f'{info["eos_id"]}), text field {info["text_field"]!r}', highlight=False, markup=False)
  t = common.table()
  for col, just in (('split', 'left'), ('shard', 'left'), ('records', 'right'), ('tokens', 'right')):
    t.add_column(col, justify=just, overflow='fold')
  for split, shards in info['shards'].items():
    for shard in shards:
      t.add_row(common.escape(split), common.escape(shard['name']), f'{shard["records"]:,}', f'{shard["tokens"]:,}')
    total = info['totals'][split]
    t.add_row(common.escape(split), f'[bold]{total["shards"]} shard(s)', f'[bold]{total["records"]:,}', f'[bold]{total["tokens"]:,}',
              end_section=True)
  console.print(t)
  sources = info['sources']
  console.print(f'From {len(sources)} file(s): ' + ', '.join(sources[:5]) + (' ...' if len(sources) > 5 else ''),
                highlight=False, markup=False)


def register(parent: typer.Typer) -> None:
  parent.add_typer(app, name='data')
