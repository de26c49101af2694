"""The built-in corpus: docstrings of Python's own standard library.

Present on every machine that runs paxcli, so the default experiment trains on real
English-and-code text with no download. Files are parsed with `ast` (never imported).
A sentencepiece model is trained on the text at first use; it and the token stream are
cached under $PAXCLI_CACHE (default ~/.cache/paxcli). Documents go to the eval split
when a hash of their file path falls in the last 5 buckets of 100, so the split is
stable across runs.

Batches are windows of seq_len + 1 tokens of the token stream. Training batch i takes
window rows [i*G, (i+1)*G) of a per-epoch shuffled order (G = global batch size), and
host h of n takes its block of those rows, so the data depend only on (seed, i), not on
the process count. Eval is one ordered pass, the last batch padded with zero weight.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import io
import json
import os
import sys
import sysconfig
from typing import Optional, Sequence

import numpy as np
import sentencepiece as spm

from paxcli.files import atomic_write
from paxcli.inputs.base import BaseInput, EndOfInput, decode_rows
from paxcli.inputs.tfrecord import import_seqio, import_tf

CORPUS_VERSION = 1
_SKIP_DIRS = {'site-packages', 'dist-packages', 'test', 'tests', 'idlelib', '__pycache__', 'lib2to3',
              'turtledemo'}


def cache_root() -> str:
  return os.environ.get('PAXCLI_CACHE') or os.path.join(
      os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'), 'paxcli')


def stdlib_docstrings(packages: Optional[Sequence[str]] = None) -> list[tuple[str, str]]:
  """(relative path, docstring) for every module, class and function docstring; of the top-level packages
  and modules named in `packages` only, when given (the same pairs in the same order as a filter of all)."""
  root = sysconfig.get_paths()['stdlib']
  docs = []
  for directory, dirs, files in os.walk(root):
    top = directory == root and packages is not None
    dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and (not top or d in packages))
    for name in sorted(files):
      if not name.endswith('.py') or (top and name.removesuffix('.py') not in packages):
        continue
      path = os.path.join(directory, name)
      try:
        with open(path, encoding='utf-8') as f:
          tree = ast.parse(f.read())
      except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        continue
      rel = os.path.relpath(path, root)
      for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
          text = ast.get_docstring(node)
          if text and len(text) > 20:
            docs.append((rel, text))
  return docs


def _is_eval(rel_path: str) -> bool:
  return int(hashlib.sha1(rel_path.encode()).hexdigest(), 16) % 100 >= 95


def build_corpus(vocab_size: int, directory: Optional[str] = None) -> str:
  """Builds (or finds) the tokenizer and token streams; returns the cache directory."""
  py = f'{sys.version_info.major}.{sys.version_info.minor}'
  directory = directory or os.path.join(cache_root(), f'stdlib_docs_v{CORPUS_VERSION}_py{py}_vocab{vocab_size}')
  done = os.path.join(directory, 'corpus.json')
  if os.path.exists(done):
    return directory
  os.makedirs(directory, exist_ok=True)
  print(f'Building the stdlib-docstrings corpus and a {vocab_size}-piece sentencepiece model '
        f'(first use only; cached in {directory}).', file=sys.stderr)
  docs = stdlib_docstrings()
  train_text = [t for p, t in docs if not _is_eval(p)]
  lines = [line for text in train_text for line in text.split('\n') if line.strip()]
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type='unigram',
      character_coverage=1.0, byte_fallback=True, input_sentence_size=400_000,
      shuffle_input_sentence=True, num_threads=os.cpu_count() or 1, minloglevel=2,
      pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
  atomic_write(os.path.join(directory, 'spm.model'), model.getvalue())
  sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
  counts = {}
  for split, keep in (('train', lambda p: not _is_eval(p)), ('eval', _is_eval)):
    texts = [t for p, t in docs if keep(p)]
    ids = [np.asarray(x + [sp.eos_id()], np.int32) for x in sp.encode(texts)]
    stream = np.concatenate(ids) if ids else np.zeros([0], np.int32)
    buf = io.BytesIO()
    np.save(buf, stream)
    atomic_write(os.path.join(directory, f'{split}.npy'), buf.getvalue())
    counts[split] = {'documents': len(texts), 'tokens': int(stream.size)}
  atomic_write(done, json.dumps({'vocab_size': vocab_size, 'python': py, **counts}).encode())
  return directory


@dataclasses.dataclass
class StdlibDocsInput(BaseInput):
  """Windows of the stdlib-docstring token stream (see module docstring)."""
  split: str = 'train'
  seq_len: int = 128
  vocab_size: int = 2048
  cache_dir: Optional[str] = None

  def __post_init__(self):
    super().__post_init__()
    self._dir = build_corpus(self.vocab_size, self.cache_dir)
    self._tokens = np.load(os.path.join(self._dir, f'{self.split}.npy'), mmap_mode='r')
    self.num_windows = (len(self._tokens) - 1) // self.seq_len
    self._sp = None

  def _window_rows(self, index: int) -> np.ndarray:
    g = self.global_batch_size
    if not self.is_training:
      return np.arange(index * g, (index + 1) * g)
    first = index * g
    rows = np.arange(first, first + g)
    epochs, within = np.divmod(rows, self.num_windows)
    out = np.empty(g, np.int64)
    for epoch in np.unique(epochs):
      perm = np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_windows)
      out[epochs == epoch] = perm[within[epochs == epoch]]
    return out

  def num_eval_batches(self) -> int:
    return -(-self.num_windows // self.global_batch_size)

  def _next_batch(self, index: int) -> dict[str, np.ndarray]:
    if not self.is_training and index >= self.num_eval_batches():
      if not self.repeat:
        raise EndOfInput(self.name)
      index %= self.num_eval_batches()
    rows = self._window_rows(index)[self.host_rows()]
    valid = rows < self.num_windows
    starts = np.where(valid, rows, 0) * self.seq_len
    tokens = np.stack([self._tokens[s:s + self.seq_len + 1] for s in starts]).astype(np.int32)
    weights = np.broadcast_to(valid[:, None], (len(rows), self.seq_len)).astype(np.float32)
    return {'ids': tokens[:, :-1], 'labels': tokens[:, 1:], 'weights': weights}

  def tokenizer_file(self) -> Optional[str]:
    return os.path.join(self._dir, 'spm.model')

  def ids_to_strings(self, ids, lengths=None) -> list[str]:
    if self._sp is None:
      self._sp = spm.SentencePieceProcessor(model_file=os.path.join(self._dir, 'spm.model'))
    return decode_rows(self._sp.decode, ids, lengths)


def write_tfrecords(vocab_size: int) -> dict[str, str]:
  """The corpus as TFRecord files of tf.train.Example {'text': bytes}, one per document.

  Returns {'train': path, 'eval': path, 'spm': path}; built once, in the corpus cache.
  """
  directory = build_corpus(vocab_size)
  paths = {split: os.path.join(directory, f'{split}.tfrecord') for split in ('train', 'eval')}
  paths['spm'] = os.path.join(directory, 'spm.model')
  if all(os.path.exists(p) for p in paths.values()):
    return paths
  tf = import_tf()
  docs = stdlib_docstrings()
  for split in ('train', 'eval'):
    tmp = paths[split] + f'.tmp-{os.getpid()}'
    with tf.io.TFRecordWriter(tmp) as writer:
      for rel, text in docs:
        if _is_eval(rel) == (split == 'eval'):
          feature = {'text': tf.train.Feature(bytes_list=tf.train.BytesList(value=[text.encode()]))}
          writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    os.replace(tmp, paths[split])
  return paths


def register_seqio_task(vocab_size: int, name: str = 'stdlib_docs') -> str:
  """Registers a seqio task over the local corpus files and our own sentencepiece model."""
  tf, seqio = import_tf(), import_seqio()
  if name in seqio.TaskRegistry.names():
    return name
  paths = write_tfrecords(vocab_size)
  vocab = seqio.SentencePieceVocabulary(paths['spm'])
  seqio.TaskRegistry.add(
      name,
      source=seqio.TFExampleDataSource(
          split_to_filepattern={'train': paths['train'], 'validation': paths['eval']},
          feature_description={'text': tf.io.FixedLenFeature([], tf.string)}),
      preprocessors=[
          functools.partial(seqio.preprocessors.rekey, key_map={'targets': 'text'}),
          seqio.preprocessors.tokenize,
          seqio.preprocessors.append_eos_after_trim,
      ],
      output_features={'targets': seqio.Feature(vocab, add_eos=True)})
  return name
