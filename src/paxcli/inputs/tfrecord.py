"""TFRecord files of tf.train.Example on tf.data, sharded by host.

Host sharding: with at least as many files as hosts, each host reads whole files
(files[i::n]); otherwise every host reads every file and keeps records i, i+n, ...
Either way hosts never overlap and together read everything.

For LM training set `lm_feature` to an int feature of token ids: each record becomes
ids = tokens[:-1], labels = tokens[1:], truncated or padded to seq_len, weights 0 on
padding. Without it, batches hold the parsed features themselves (varlen features
padded to seq_len, or to the longest in the batch when seq_len is 0).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import random
import sys
from typing import Iterator, Optional

import numpy as np
import sentencepiece as spm

from paxcli.files import held_stderr
from paxcli.errors import UserError
from paxcli.files import check_regular_file
from paxcli.inputs.base import StreamInput, decode_rows

KINDS = ('int64', 'float', 'bytes')
_TF = None  # tensorflow, once imported quietly


# TensorFlow and seqio are the `tf` extra: the default run and the file inputs (JSONL, Parquet, text, Grain,
# prepared shards) do without them, and they are most of an install's size.
TF_EXTRA = ("TFRecord files, SeqIO tasks, C4 and gs:// data files are read with TensorFlow{}, which this "
            "install does not have: pip install 'paxcli[tf]' (make install has it).")


def import_tf():
  """tensorflow, for tf.data only: never allowed to take a GPU from jax; without it, one line naming the extra.

  TensorFlow's C++ start-up logs (oneDNN, "no CUDA drivers", cuInit) go to stderr before
  any log level applies; they are held back during the import and shown only if the
  import fails.
  """
  global _TF
  if _TF is None:
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
    with held_stderr() as captured:
      try:
        import tensorflow as tf
        try:
          tf.config.set_visible_devices([], 'GPU')
        except RuntimeError:  # tensorflow already started its devices elsewhere
          pass
      except ModuleNotFoundError as e:
        if e.name != 'tensorflow':
          sys.stderr.write(captured())
          raise
        tf = None
      except BaseException:
        sys.stderr.write(captured())
        raise
    if tf is None:
      raise UserError(TF_EXTRA.format(''))
    _TF = tf
  return _TF


def import_seqio():
  """seqio, after tensorflow (which it imports itself: import_tf's quiet start goes first); without it, one
  line naming the extra."""
  import_tf()
  try:
    import seqio
  except ModuleNotFoundError as e:
    if e.name != 'seqio':
      raise
    raise UserError(TF_EXTRA.format(' and seqio')) from None
  return seqio


def expand_files(pattern: str) -> list[str]:
  files = sorted(glob.glob(os.path.expanduser(pattern)))
  if not files:
    raise UserError(f'No file matches {pattern!r}.')
  return files


def read_examples(path: str, limit: Optional[int] = None) -> Iterator[dict[str, tuple[str, list]]]:
  """Parsed tf.train.Examples of one file: {feature: (kind, values)}; UserError if not TFRecord."""
  check_regular_file(path, 'TFRecord file')  # before tensorflow: a FIFO or /dev/zero is refused at once
  tf = import_tf()
  dataset = tf.data.TFRecordDataset(path)
  if limit is not None:
    dataset = dataset.take(limit)
  try:
    for i, record in enumerate(dataset.as_numpy_iterator()):
      example = tf.train.Example()
      try:
        example.ParseFromString(record)
      except Exception:
        raise UserError(f'{path}: record {i} is not a tf.train.Example.') from None
      yield {name: _kind_values(feature) for name, feature in example.features.feature.items()}
  except tf.errors.DataLossError:
    raise UserError(f'{path} is not a TFRecord file (or is corrupted).') from None


def _kind_values(feature) -> tuple[str, list]:
  kind = feature.WhichOneof('kind')
  if kind == 'int64_list':
    return 'int64', list(feature.int64_list.value)
  if kind == 'float_list':
    return 'float', list(feature.float_list.value)
  return 'bytes', list(feature.bytes_list.value)


def infer_features(path: str) -> dict[str, str]:
  for first in read_examples(path, limit=1):
    return {name: kind for name, (kind, _) in sorted(first.items())}
  raise UserError(f'{path} holds no records.')


@dataclasses.dataclass
class TfDataInput(StreamInput):
  """An input backed by a tf.data pipeline: a stream whose position is batches read.

  Subclasses implement `dataset(skip_batches)` (per-process batches, already host-
  sharded) and may override `convert(batch)`. Resume skips batches in the pipeline.
  """

  def dataset(self, skip_batches: int = 0):
    raise NotImplementedError

  def convert(self, batch: dict) -> dict:
    return batch

  def _open(self, start: int) -> Iterator[dict]:
    return self.dataset(start).as_numpy_iterator()

  def _finish(self, batch: dict) -> dict[str, np.ndarray]:
    return _pad_rows(self.convert(batch), self.batch_size)


@dataclasses.dataclass
class TFRecordInput(TfDataInput):
  file_pattern: str = ''
  features: Optional[dict[str, str]] = None  # name -> 'int64' | 'float' | 'bytes'; None: inferred
  seq_len: int = 0
  lm_feature: Optional[str] = None
  shuffle: bool = True
  shuffle_buffer_size: int = 10_000
  prefetch: int = 2
  spm_model: Optional[str] = None  # sentencepiece model for ids_to_strings

  def __post_init__(self):
    super().__post_init__()
    if not self.file_pattern:
      raise UserError(f'Input {self.name!r}: file_pattern is empty.')
    self.files = expand_files(self.file_pattern)
    self.features = dict(self.features or infer_features(self.files[0]))
    for name, kind in self.features.items():
      if kind not in KINDS:
        raise UserError(f'Input {self.name!r}: feature {name!r} has kind {kind!r}; use one of {KINDS}.')
    if self.lm_feature and self.features.get(self.lm_feature) != 'int64':
      raise UserError(f'Input {self.name!r}: lm_feature {self.lm_feature!r} must be an int64 feature; '
                      f'the records have {self.features}.')
    if self.lm_feature and not self.seq_len:
      raise UserError(f'Input {self.name!r}: lm_feature needs seq_len.')
    self._sp = None

  def host_files(self) -> tuple[list[str], bool]:
    """(files this host reads, whether records must be sharded within them)."""
    n, i = self.num_infeed_hosts or 1, self.infeed_host_index or 0
    files = list(self.files)
    if self.shuffle:
      random.Random(self.seed).shuffle(files)
    if len(files) >= n:
      return files[i::n], False
    return files, n > 1

  def dataset(self, skip_batches: int = 0):
    tf = import_tf()
    files, shard_records = self.host_files()
    ds = tf.data.TFRecordDataset(files)
    if shard_records:
      ds = ds.shard(self.num_infeed_hosts, self.infeed_host_index)
    if self.shuffle:
      ds = ds.shuffle(self.shuffle_buffer_size, seed=self.seed, reshuffle_each_iteration=True)
    if self.repeat:
      ds = ds.repeat()
    spec = {name: tf.io.VarLenFeature({'int64': tf.int64, 'float': tf.float32, 'bytes': tf.string}[kind])
            for name, kind in self.features.items()}
    ds = ds.map(lambda r: self._to_features(tf, tf.io.parse_single_example(r, spec)),
                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    ds = ds.padded_batch(self.batch_size, drop_remainder=False)
    if skip_batches:
      ds = ds.skip(skip_batches)
    return ds.prefetch(self.prefetch)

  def _to_features(self, tf, parsed):
    dense = {}
    for name, kind in self.features.items():
      default = b'' if kind == 'bytes' else 0
      dense[name] = tf.sparse.to_dense(parsed[name], default_value=default)
    if not self.lm_feature:
      if self.seq_len:
        dense = {k: _fit(tf, v, self.seq_len) for k, v in dense.items()}
      return dense
    tokens = tf.cast(dense[self.lm_feature][:self.seq_len + 1], tf.int32)
    n = tf.maximum(tf.shape(tokens)[0] - 1, 0)
    ids, labels = _fit(tf, tokens[:-1], self.seq_len), _fit(tf, tokens[1:], self.seq_len)
    weights = tf.cast(tf.range(self.seq_len) < n, tf.float32)
    return {'ids': ids, 'labels': labels, 'weights': weights}

  def tokenizer_file(self) -> Optional[str]:
    return self.spm_model or None

  def ids_to_strings(self, ids, lengths=None) -> list[str]:
    if not self.spm_model:
      return super().ids_to_strings(ids, lengths)
    if self._sp is None:
      self._sp = spm.SentencePieceProcessor(model_file=self.spm_model)
    return decode_rows(self._sp.decode, ids, lengths)


def _fit(tf, x, length: int):
  x = x[:length]
  return tf.pad(x, [[0, length - tf.shape(x)[0]]])


def _pad_rows(batch: dict, rows: int) -> dict:
  """Pads a short final batch to `rows` with zero rows (zero weight: counted nowhere)."""
  out = {}
  for k, v in batch.items():
    if v.shape[0] < rows:
      pad = np.zeros((rows - v.shape[0],) + v.shape[1:], v.dtype)
      if v.dtype == object:
        pad[...] = b''
      v = np.concatenate([v, pad])
    out[k] = v
  return out
