"""`pax tokenizer train`: a sentencepiece model for your own data (then `--set TOKENIZER=...`)."""

from __future__ import annotations

import time
from typing import List

import typer

from paxcli.cli import common

app = typer.Typer(help='Train a tokenizer on your own files.', no_args_is_help=True)


@app.command('train')
def train_command(
    data: List[str] = typer.Option(..., '--data', metavar='GLOB', help='Files to learn from: a glob of .txt, '
                                   '.jsonl, .parquet, TFRecord or ArrayRecord files (repeatable).'),
    vocab_size: int = typer.Option(..., '--vocab-size', metavar='N', min=260, help='Pieces in the model (at '
                                   'most: fewer when the text holds fewer). Match the model\'s VOCAB_SIZE.'),
    output: str = typer.Option(..., '--output', '-o', metavar='FILE', help='Where to write the model '
                               '(e.g. spm.model; a FIFO or /dev/stdout is written into).'),
    force: bool = typer.Option(False, '--force', help='Replace an existing --output file.'),
    text_field: str = typer.Option('text', '--text-field', metavar='NAME', help='The JSONL / Parquet / '
                                   'tf.train.Example field of the text (as the TEXT_FIELD knob).'),
    max_chars: int = typer.Option(10_000_000, '--max-chars', metavar='N', min=1, help='Learn from the first N '
                                  'characters (about a minute on one core per 10 million).'),
) -> None:
  """Train a Unigram sentencepiece model: deterministic (the same files give a byte-identical
  model), never on the 1 in 20 documents that the eval split takes when EVAL_DATA is not given.
  Use it with `pax train --set TRAIN_DATA=GLOB --set TOKENIZER=FILE`."""
  from paxcli import api, files
  from paxcli.inputs.file_input import train_tokenizer
  start = time.perf_counter()
  source = data[0] if len(data) == 1 else {glob: 1.0 for glob in data}
  output = api.output_arg(output, '--output')
  size = train_tokenizer(source, text_field, vocab_size, output, max_chars, force=force)
  fewer = f', fewer than the {vocab_size:,} asked: the text holds no more.' if size < vocab_size else '.'
  console = common.console(stderr=files.is_stream(output))  # the model itself may be on stdout
  console.print(f'Wrote {output}: {size:,} pieces ({time.perf_counter() - start:.1f} s){fewer}', highlight=False)


def register(parent: typer.Typer) -> None:
  parent.add_typer(app, name='tokenizer')
