"""The first hour after `make train` (issue 32, items 2 and 5): what a new user sees of inputs, errors,
settings and recipes, each through the CLI."""

import json
import os

import numpy as np

import prepared_data
from conftest import pax_main


def _inspect(capsys, *args):
  code, out, err = pax_main(['inspect-input', '--num-batches', '1', '--num-examples', '4', '--json',
                             '--set', 'MAX_SEQ_LEN=32', '--set', 'VOCAB_SIZE=64', *args], capsys)
  assert code == 0, err
  return json.loads(out.splitlines()[0])['examples']


def test_inspect_input_shows_the_ids_with_each_documents_first_token(tmp_path, capsys):
  """`ids:` are the ids the model reads (the first token of each document included), not the labels, on
  files and on prepared directories alike."""
  tok = str(tmp_path / 'tokenizer.json')
  prepared_data.write_tokenizer(tok, 64)   # word-level: the text 'w7' is id 7
  docs = [[(i * 7 + j) % 60 + 2 for j in range(5)] for i in range(40)]
  with open(tmp_path / 'docs.jsonl', 'w') as f:
    f.writelines(json.dumps({'text': ' '.join(f'w{t}' for t in doc)}) + '\n' for doc in docs)
  for example in _inspect(capsys, '--set', f'TRAIN_DATA={str(tmp_path / "docs.jsonl")!r}', '--set', f'TOKENIZER={tok!r}'):
    ids = example['ids']   # whole documents of 5 words (their EOS is the last label, never an id)
    assert len(ids) == 30 and all(ids[i:i + 5] in docs for i in range(0, 30, 5)), ids
    assert example['text'].split() == [f'w{t}' for t in ids]
  doc = prepared_data.make(tmp_path / 'prepared', num_docs=1, shards=1, max_len=9)[0].tolist()
  for example in _inspect(capsys, '--set', f'TRAIN_DATA={str(tmp_path / "prepared")!r}'):
    assert example['ids'][:len(doc) - 1] == doc[:-1], (example['ids'], doc)
