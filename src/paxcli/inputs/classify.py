"""Which standard-library package a docstring comes from: a classification input, no download.

Docstrings of Python's own standard library (see corpus.py), labelled by their top-level
package (asyncio, email, ...). A docstring goes to the eval split when a hash of its path
and text falls in the last 10 buckets of 100, so every package has eval examples and the
split is stable. Tokens come from the stdlib corpus's sentencepiece model.

Batches: ids [B, L] (truncated, 0-padded), mask [B, L] (1 on real tokens), labels [B] and
weights [B] (0 on padding rows). Training batch i takes rows [i*G, (i+1)*G) of a per-epoch
shuffled order (G the global batch), host h its block of them: the data depend only on
(seed, i). Eval is one ordered pass, the last batch padded with zero weight.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Optional, Sequence

import numpy as np
import sentencepiece as spm

from paxcli.inputs.base import BaseInput, EndOfInput, decode_rows
from paxcli.inputs.corpus import build_corpus, stdlib_docstrings

PACKAGES = ('asyncio', 'email', 'importlib', 'logging', 'xml', 'multiprocessing', 'unittest', 'http')


def _is_eval(rel_path: str, text: str) -> bool:
  return int(hashlib.sha1(f'{rel_path}\0{text}'.encode()).hexdigest(), 16) % 100 >= 90


def labelled_docstrings(packages: Sequence[str], split: str) -> list[tuple[str, int]]:
  """(docstring, class index) of the split, for docstrings of the given top-level packages."""
  index = {p: i for i, p in enumerate(packages)}
  out = []
  for rel, text in stdlib_docstrings(tuple(packages)):   # their files alone: a walk of all takes seconds
    package = rel.replace('\\', '/').split('/')[0].removesuffix('.py')
    if package in index and _is_eval(rel, text) == (split == 'eval'):
      out.append((text, index[package]))
  return out


@dataclasses.dataclass
class StdlibDocsClassInput(BaseInput):
  """Docstrings labelled by standard-library package (see module docstring)."""
  split: str = 'train'
  seq_len: int = 64
  vocab_size: int = 2048
  packages: Sequence[str] = PACKAGES
  cache_dir: Optional[str] = None

  def __post_init__(self):
    super().__post_init__()
    self._dir = build_corpus(self.vocab_size, self.cache_dir)
    self._sp = spm.SentencePieceProcessor(model_file=os.path.join(self._dir, 'spm.model'))
    examples = labelled_docstrings(self.packages, self.split)
    if not examples:
      raise ValueError(f'No docstrings of packages {list(self.packages)} in the {self.split} split.')
    ids = self._sp.encode([text for text, _ in examples])
    self._ids = np.zeros((len(examples), self.seq_len), np.int32)
    self._mask = np.zeros((len(examples), self.seq_len), np.float32)
    for row, piece_ids in enumerate(ids):
      piece_ids = piece_ids[:self.seq_len]
      self._ids[row, :len(piece_ids)] = piece_ids
      self._mask[row, :len(piece_ids)] = 1.0
    self._labels = np.asarray([label for _, label in examples], np.int32)
    self.num_examples = len(examples)

  def _rows(self, index: int) -> np.ndarray:
    g = self.global_batch_size
    rows = np.arange(index * g, (index + 1) * g)
    if not self.is_training:
      return rows
    epochs, within = np.divmod(rows, self.num_examples)
    out = np.empty(g, np.int64)
    for epoch in np.unique(epochs):
      perm = np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_examples)
      out[epochs == epoch] = perm[within[epochs == epoch]]
    return out

  def num_eval_batches(self) -> int:
    return -(-self.num_examples // self.global_batch_size)

  def _next_batch(self, index: int) -> dict[str, np.ndarray]:
    if not self.is_training and index >= self.num_eval_batches():
      if not self.repeat:
        raise EndOfInput(self.name)
      index %= self.num_eval_batches()
    rows = self._rows(index)[self.host_rows()]
    valid = rows < self.num_examples
    rows = np.where(valid, rows, 0)
    return {'ids': self._ids[rows], 'mask': self._mask[rows] * valid[:, None],
            'labels': self._labels[rows], 'weights': valid.astype(np.float32)}

  def tokenizer_file(self) -> Optional[str]:
    return os.path.join(self._dir, 'spm.model')

  def ids_to_strings(self, ids, lengths=None) -> list[str]:
    return decode_rows(self._sp.decode, ids, lengths)
