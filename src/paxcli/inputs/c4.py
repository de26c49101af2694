"""C4 as Pax reads it: seqio over the TFDS dataset `c4/en:3.0.1`, sentencepiece-tokenized.

Pax's C4 task (paxml/tasks/lm/params/c4.py, `c4_lm_v301_gpt`, in the c4/en:3.0.1 version that
the README's C4 runs were written against) takes each document's `text` as `targets`, tokenizes
it, concatenates the tokens of `concat_batch` consecutive documents (t5's reduce_concat_tokens,
batch 128), splits that stream into pieces of seq_len - 1 tokens and ends each piece with EOS.
Training packs the pieces (segment ids and positions) and shuffles; eval reads the
`validation` split once, unpacked, in order. Host i of n reads TFDS's files i, i + n, ... of a
split (seqio's ShardInfo), so hosts never share a document.

Where the data and the vocabulary live are the experiment's knobs (recipes/c4.py): a local
TFDS data directory or a gs:// path (read through tf.io.gfile), and a sentencepiece model file.
When either is missing, building the input stops with one line saying what is missing and
how to get it; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from typing import Optional

import numpy as np
import sentencepiece as spm

from paxcli.errors import UserError
from paxcli.files import atomic_write
from paxcli.inputs.corpus import cache_root
from paxcli.inputs.seqio_input import SeqIOInput
from paxcli.inputs.tfrecord import import_seqio, import_tf

TFDS_NAME = 'c4/en:3.0.1'
# Where Pax reads its vocabularies: T5's 32000-piece model (the default of t5.data and seqio),
# and the MLPerf GPT-3 model that paxml's C4 task uses (GPT_SPM_PATH).
T5_VOCABULARY = 'gs://t5-data/vocabs/cc_all.32000.100extra/sentencepiece.model'
GPT_VOCABULARY = 'gs://mlperf-llm-public2/vocab/c4_en_301_5Mexp2_spm.model'
CONCAT_BATCH = 128          # t5's reduce_concat_tokens default, as Pax's c4/en:3.0.1 task used it
SHUFFLE_BUFFER = 100_000    # that task's shuffle_buffer_size
_HOW_TO_GET_DATA = ('prepare c4/en/3.0.1 with TFDS (tensorflow.org/datasets/catalog/c4) or copy it, and set '
                    'C4_DATA_DIR to the directory holding c4/ (local or gs://)')


def _expand(path: str) -> str:
  """A local path with ~ expanded; gs:// and other URLs as they are."""
  return path if '://' in path else os.path.expanduser(path)


def resolve_data_dir(data_dir: Optional[str]) -> str:
  """The TFDS data directory: `data_dir`, else TFDS's own default, $TFDS_DATA_DIR or ~/tensorflow_datasets."""
  return _expand(data_dir or os.environ.get('TFDS_DATA_DIR') or '~/tensorflow_datasets')


def dataset_dir(tfds_name: str, data_dir: Optional[str]) -> str:
  """`<data_dir>/c4/en/3.0.1` for 'c4/en:3.0.1': where TFDS keeps a prepared dataset version."""
  name, _, version = tfds_name.partition(':')
  if not version:
    raise UserError(f'C4_TFDS_NAME {tfds_name!r} needs a version, e.g. {TFDS_NAME!r} (Pax pins one).')
  return '/'.join([resolve_data_dir(data_dir).rstrip('/'), name, version])


def _readable(path: str) -> bool:
  """os.path for local paths (no tensorflow import); tf.io.gfile for gs:// and other schemes, where
  no network, no credentials or no such bucket all mean: not readable here."""
  if '://' not in path:
    return os.path.exists(_expand(path))
  try:
    return import_tf().io.gfile.exists(path)
  except Exception:  # tensorflow's errors for a filesystem it cannot reach have no common type
    return False


def check_available(tfds_name: str, data_dir: Optional[str], vocabulary: Optional[str],
                    vocab_size: Optional[int] = None) -> None:
  """One UserError line naming whatever is missing (data, vocabulary) and how to get it."""
  missing = []
  info = dataset_dir(tfds_name, data_dir) + '/dataset_info.json'
  if not _readable(info):
    missing.append(f'C4 data: no {info}; {_HOW_TO_GET_DATA}')
  if not vocabulary:
    missing.append(f'C4 vocabulary: set C4_VOCABULARY to a sentencepiece model (T5\'s: {T5_VOCABULARY})')
  elif not _readable(vocabulary):
    missing.append(f'C4 vocabulary: cannot read {vocabulary}; copy it locally and set C4_VOCABULARY to the file')
  if missing:
    raise UserError('. '.join(missing) + '.')
  if vocab_size:
    pieces = _piece_count(vocabulary)
    if pieces > vocab_size:
      raise UserError(f'C4_VOCABULARY {vocabulary} has {pieces:,} pieces but VOCAB_SIZE is {vocab_size:,}: '
                      'ids past VOCAB_SIZE cannot be embedded. Raise VOCAB_SIZE or use a smaller vocabulary.')


def _piece_count(vocabulary: str) -> int:
  return spm.SentencePieceProcessor(model_proto=_read_bytes(vocabulary)).get_piece_size()


def _read_bytes(path: str) -> bytes:
  if '://' not in path:
    with open(_expand(path), 'rb') as f:
      return f.read()
  with import_tf().io.gfile.GFile(path, 'rb') as f:
    return f.read()


def local_vocabulary(vocabulary: str) -> str:
  """A local path of the sentencepiece model: itself, or a cached copy of a gs:// one (for the job dir)."""
  if '://' not in vocabulary:
    return os.path.abspath(_expand(vocabulary))
  data = _read_bytes(vocabulary)
  path = os.path.join(cache_root(), 'c4_vocabularies', hashlib.sha256(data).hexdigest()[:16] + '.model')
  if not os.path.exists(path):
    atomic_write(path, data)
  return path


# ---- seqio preprocessors (t5.data's reduce_concat_tokens and split_tokens_to_targets_length) ----

def concat_tokens(dataset, batch_size: int = CONCAT_BATCH):
  """The targets of `batch_size` consecutive documents joined into one token stream."""
  tf = import_tf()
  dataset = dataset.map(lambda x: {'targets': x['targets']})
  dataset = dataset.padded_batch(batch_size, padded_shapes={'targets': [None]})

  def join(x):
    tokens = tf.reshape(x['targets'], [-1])
    return {'targets': tf.boolean_mask(tokens, tokens > 0)}  # drop the batch padding (id 0)

  return dataset.map(join)


def split_to_length(dataset, sequence_length: dict, output_features: dict):
  """Each token stream cut into pieces that fill `targets`' length, leaving room for EOS."""
  tf = import_tf()
  piece = sequence_length['targets'] - (1 if output_features['targets'].add_eos else 0)

  def pieces(x):
    tokens = x['targets']
    count = (tf.size(tokens) + piece - 1) // piece
    rows = tf.reshape(tf.pad(tokens, [[0, count * piece - tf.size(tokens)]]), [count, piece])  # id 0 pads the last
    return tf.data.Dataset.from_tensor_slices({'targets': rows}).map(
        lambda row: {'targets': tf.boolean_mask(row['targets'], row['targets'] > 0)})

  return dataset.flat_map(pieces)


def register_task(tfds_name: str, data_dir: Optional[str], vocabulary: str, concat_batch: int = CONCAT_BATCH) -> str:
  """The seqio task of Pax's C4 LM input over these files and this vocabulary; returns its name."""
  seqio = import_seqio()
  data_dir = resolve_data_dir(data_dir)
  key = '|'.join([tfds_name, data_dir, vocabulary, str(concat_batch)])
  name = 'paxcli_c4_' + hashlib.sha256(key.encode()).hexdigest()[:12]
  if name in seqio.TaskRegistry.names():
    return name
  vocab = seqio.SentencePieceVocabulary(_expand(vocabulary))
  seqio.TaskRegistry.add(
      name,
      source=seqio.TfdsDataSource(tfds_name=tfds_name, tfds_data_dir=data_dir, read_only=True),  # never download
      preprocessors=[
          functools.partial(seqio.preprocessors.rekey, key_map={'targets': 'text'}),
          seqio.preprocessors.tokenize,
          functools.partial(concat_tokens, batch_size=concat_batch),
          split_to_length,
          seqio.preprocessors.append_eos_after_trim,
      ],
      output_features={'targets': seqio.Feature(vocab, add_eos=True)},
      metric_fns=[],
      shuffle_buffer_size=SHUFFLE_BUFFER)
  return name


@dataclasses.dataclass
class C4Input(SeqIOInput):
  """Pax's C4 LM input (see the module docstring): packed for training, `validation` for eval.

  `vocab_size` is the model's: a vocabulary with more pieces is refused at once rather than
  feeding ids the embedding does not have.
  """
  tfds_name: str = TFDS_NAME
  data_dir: Optional[str] = None       # None: $TFDS_DATA_DIR or ~/tensorflow_datasets
  spm_model: Optional[str] = None      # the vocabulary: a sentencepiece model file, local or gs://
  seq_len: int = 1024
  vocab_size: Optional[int] = None
  concat_batch: int = CONCAT_BATCH

  def __post_init__(self):
    check_available(self.tfds_name, self.data_dir, self.spm_model, self.vocab_size)
    self.mixture_name = register_task(self.tfds_name, self.data_dir, self.spm_model, self.concat_batch)
    self.task_feature_lengths = {'targets': self.seq_len}
    super().__post_init__()

  def tokenizer_file(self) -> Optional[str]:
    return local_vocabulary(self.spm_model)

  @classmethod
  def example_batch(cls, cfg, batch_size: int) -> dict:
    """A batch of the shapes and features this input yields, without reading any data.

    `pax bench mfu --compile-only` plans a C4 run from this on a machine that has no C4.
    """
    shape = (batch_size, cfg.seq_len)
    batch = {'ids': np.zeros(shape, np.int32), 'labels': np.zeros(shape, np.int32),
             'weights': np.ones(shape, np.float32)}
    if cfg.pack:
      batch['segment_ids'] = np.ones(shape, np.int32)
      batch['positions'] = np.broadcast_to(np.arange(cfg.seq_len, dtype=np.int32), shape).copy()
    return batch
