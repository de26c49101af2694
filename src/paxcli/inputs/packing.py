"""Tokenized documents packed into fixed-length rows, the Pax way (seqio's packing features).

A document (paxcli.inputs.sft chunks) is tokenized chunk by chunk, with EOS after the chunks
that end a text, into tokens t_0..t_n and per-token weights; its training pairs are
ids = t_0..t_{n-1}, labels = t_1..t_n, weights = the labels' weights. Rows of seq_len pairs
hold several documents: `segment_ids` numbers them 1, 2, ... within a row (0: padding) and
`positions` restarts at 0 for each, so attention never crosses a document's boundary and
rotary or learned positions see each document from its start.

A document longer than a row is cut into row-sized pieces (each its own segment); shorter
ones are never cut. Pieces go into the first of up to `open_rows` partly filled rows with
room for them (first fit); when none has room, the fullest leaves (zero-padded) to make
room for a new row. Everything is a function of the order of the documents: the same
documents give the same rows.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np

from paxcli.inputs.sft import Chunk

ROW_KEYS = ('ids', 'labels', 'weights', 'segment_ids', 'positions')


@dataclasses.dataclass
class Example:
  """One document's training pairs (all of one length)."""
  ids: np.ndarray
  labels: np.ndarray
  weights: np.ndarray

  def __len__(self) -> int:
    return len(self.ids)

  def cut(self, start: int, stop: int) -> 'Example':
    return Example(self.ids[start:stop], self.labels[start:stop], self.weights[start:stop])


def token_weights(chunks: Sequence[Chunk], encoded: Sequence[Sequence[int]], eos_id: int,
                  bos_id: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
  """A document's tokens (int32; after `bos_id` when given, EOS after the chunks that end a text) and
  each token's weight (uint8: 1 trained, 0 not). Arrays, not lists: a 100 MB document's tokens
  take 5 bytes each here, not the ~40 of a Python list of ints and floats."""
  tokens, weights = [], []
  if bos_id is not None:
    tokens.append(np.asarray([bos_id], np.int32))
    weights.append(np.zeros(1, np.uint8))
  for chunk, ids in zip(chunks, encoded):
    tokens.append(np.asarray(ids, np.int32))
    if chunk.eos:
      tokens.append(np.asarray([eos_id], np.int32))
    weights.append(np.full(len(ids) + bool(chunk.eos), chunk.trained, np.uint8))
  if not tokens:
    return np.zeros(0, np.int32), np.zeros(0, np.uint8)
  return np.concatenate(tokens), np.concatenate(weights)


def tokenize(chunks: Sequence[Chunk], encoded: Sequence[Sequence[int]], eos_id: int,
             bos_id: Optional[int] = None) -> Optional[Example]:
  """A document's training pairs (token_weights: EOS after the chunks that end a text, BOS first for a
  tokenizer that starts every text with it: tokenizers' bos_first); None when under 2 tokens."""
  tokens, weights = token_weights(chunks, encoded, eos_id, bos_id)
  if len(tokens) < 2:
    return None
  return Example(tokens[:-1], tokens[1:], weights[1:].astype(np.float32))


def pieces(example: Example, seq_len: int) -> Iterator[Example]:
  for start in range(0, len(example), seq_len):
    yield example.cut(start, start + seq_len)


class Row:
  """A row being filled: its arrays, and the tag of each piece in it (what a resumable reader
  saves instead of the arrays: the row is rebuilt by putting the same pieces again)."""

  def __init__(self, seq_len: int):
    self.arrays = {k: np.zeros(seq_len, np.float32 if k == 'weights' else np.int32) for k in ROW_KEYS}
    self.used = 0
    self.segments = 0
    self.tags: list = []

  def room(self) -> int:
    return len(self.arrays['ids']) - self.used

  def put(self, piece: Example, tag=None) -> None:
    end = self.used + len(piece)
    self.segments += 1
    self.tags.append(tag)
    self.arrays['ids'][self.used:end] = piece.ids
    self.arrays['labels'][self.used:end] = piece.labels
    self.arrays['weights'][self.used:end] = piece.weights
    self.arrays['segment_ids'][self.used:end] = self.segments
    self.arrays['positions'][self.used:end] = np.arange(len(piece))
    self.used = end


class Packer:
  """First-fit packing of examples into rows of `seq_len` (module docstring)."""

  def __init__(self, seq_len: int, open_rows: int = 8):
    self.seq_len = seq_len
    self.open_rows = max(1, open_rows)
    self._rows: list[Row] = []

  def add(self, example: Example) -> Iterator[dict]:
    """Packs one example; yields the rows that it completes or pushes out."""
    for row in self.add_rows(example):
      yield row.arrays

  def add_rows(self, example: Example, tag=None) -> Iterator[Row]:
    """`add`, yielding the Rows; piece k of the example is tagged (tag, k)."""
    for k, piece in enumerate(pieces(example, self.seq_len)):
      row = next((r for r in self._rows if r.room() >= len(piece)), None)
      if row is None:
        if len(self._rows) == self.open_rows:
          fullest = min(self._rows, key=Row.room)
          self._rows.remove(fullest)
          yield fullest
        row = Row(self.seq_len)
        self._rows.append(row)
      row.put(piece, (tag, k))
      if not row.room():
        self._rows.remove(row)
        yield row

  def flush(self) -> Iterator[dict]:
    """The partly filled rows, oldest first (the end of a finite input)."""
    for row in self.flush_rows():
      yield row.arrays

  def flush_rows(self) -> list[Row]:
    rows, self._rows = self._rows, []
    return rows

  def open_tags(self) -> list[list]:
    """The tags of the pieces in each open row, oldest row first: the packer's whole state."""
    return [list(row.tags) for row in self._rows]

  def reopen(self, rows_tags: list[list], piece_of) -> None:
    """Rebuilds the open rows from `open_tags()`; piece_of(tag) gives the piece a tag names."""
    self._rows = [self.rebuild(tags, piece_of) for tags in rows_tags]

  def rebuild(self, tags: list, piece_of) -> Row:
    row = Row(self.seq_len)
    for tag in tags:
      row.put(piece_of(tag), tag)
    return row


def pack(examples: Iterable[Example], seq_len: int, open_rows: int = 8) -> Iterator[dict]:
  packer = Packer(seq_len, open_rows)
  for example in examples:
    yield from packer.add(example)
  yield from packer.flush()


def shuffled(rows: Iterable[dict], buffer_size: int, rng: np.random.Generator) -> Iterator[dict]:
  """Rows in a random order from a buffer of `buffer_size` (tf.data's shuffle, seeded)."""
  buffer: list[dict] = []
  for row in rows:
    if len(buffer) < buffer_size:
      buffer.append(row)
      continue
    i = int(rng.integers(len(buffer)))
    yield buffer[i]
    buffer[i] = row
  for i in rng.permutation(len(buffer)):
    yield buffer[i]


def batches(rows: Iterable[dict], batch_size: int) -> Iterator[dict]:
  """Rows stacked into batches; a short last batch is filled with zero rows (zero weight)."""
  group = []
  for row in rows:
    group.append(row)
    if len(group) == batch_size:
      yield _stack(group, batch_size)
      group = []
  if group:
    yield _stack(group, batch_size)


def _stack(group: list[dict], batch_size: int) -> dict:
  out = {}
  for k in ROW_KEYS:
    column = np.stack([row[k] for row in group])
    if len(group) < batch_size:
      column = np.concatenate([column, np.zeros((batch_size - len(group),) + column.shape[1:], column.dtype)])
    out[k] = column
  return out
