"""A small real C4 for tests: TFDS's own c4 builder writes it, from lines made here.

`write_c4(root)` prepares `<root>/c4/en/3.0.1` with TFDS's C4 builder class (its features,
file format, dataset_info.json), its split generators replaced by a few hundred local documents
(no Common Crawl, no Beam), in 2 files per split so that 2 hosts read one each. A sentencepiece
model is trained on the same text. Every document carries a unique marker `docNNNN` so a
reader can tell which documents it saw.

Run as a module (`python -m c4_data DATA_DIR VOCABULARY OUT.json`, with PAX_COORDINATOR etc. set),
it is one host of a multi-process run: it builds recipes/c4.py's inputs as `pax train` does and
writes which documents, and how many target tokens, it read in one epoch of each split.
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import re
import sys

import numpy as np

from paxcli import config
from paxcli.inputs.base import EndOfInput
from paxcli.runtime import distributed
from paxcli.runtime import engine, infeed

SEQ_LEN = 32
TRAIN_DOCS = 160
EVAL_DOCS = 32
WORDS = ('the model reads tokens from the corpus and every host keeps its own share of files while '
         'training packs short pieces into long rows so that no slot is wasted and the loss falls').split()


def document(i: int) -> str:
  """Document i: its marker, then 12-36 words in lines of 8 (about 3 lines), deterministic."""
  rng = random.Random(i)
  words = [f'doc{i:04d}'] + [rng.choice(WORDS) for _ in range(rng.randint(12, 36))]
  return '\n'.join(' '.join(words[j:j + 8]) for j in range(0, len(words), 8)) + '.'


def document_ids(split: str) -> list[str]:
  ids = range(TRAIN_DOCS) if split == 'train' else range(TRAIN_DOCS, TRAIN_DOCS + EVAL_DOCS)
  return [f'{i:04d}' for i in ids]


def write_c4(root: str) -> dict:
  """Writes C4 (c4/en:3.0.1, train + validation, 2 files each) and a sentencepiece model under root.

  Returns {'data_dir', 'vocabulary', 'train', 'validation'} (the last two: document texts).
  """
  from paxcli.inputs.tfrecord import import_tf
  import_tf()  # quiet tensorflow start-up, no GPU
  import tensorflow_datasets as tfds
  from tensorflow_datasets.text import c4 as tfds_c4
  tfds.disable_progress_bar()

  splits = {'train': range(TRAIN_DOCS), 'validation': range(TRAIN_DOCS, TRAIN_DOCS + EVAL_DOCS)}

  class LocalC4(tfds_c4.C4, skip_registration=True):
    """TFDS's C4 (its _info: features and citation) with local documents for its splits."""
    name = 'c4'
    VERSION = tfds.core.Version('3.0.1')
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name='en', version='3.0.1', description='a few local documents')]

    def _split_generators(self, dl_manager):  # no `pipeline` argument: TFDS then runs no Beam
      return {split: self._examples(ids) for split, ids in splits.items()}

    def _examples(self, ids):
      for i in ids:
        yield f'doc{i}', {'text': document(i), 'url': f'https://example.com/{i}', 'content-type': 'text/plain',
                          'content-length': str(len(document(i))), 'timestamp': '2019-04-18T00:00:00Z'}

  data_dir = os.path.join(root, 'tfds')
  LocalC4(data_dir=data_dir, config='en', version='3.0.1').download_and_prepare(
      download_config=tfds.download.DownloadConfig(num_shards=2, try_download_gcs=False))
  texts = {split: [document(i) for i in ids] for split, ids in splits.items()}
  return {'data_dir': data_dir, 'vocabulary': _train_vocabulary(root, texts['train']), **texts}


def _train_vocabulary(root: str, lines: list[str]) -> str:
  import sentencepiece as spm
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=80,
                                 hard_vocab_limit=False,
                                 model_type='unigram', character_coverage=1.0, pad_id=0, eos_id=1, unk_id=2,
                                 bos_id=-1, minloglevel=2, num_threads=1)
  path = os.path.join(root, 'spm.model')
  with open(path, 'wb') as f:
    f.write(model.getvalue())
  return path


def expected_tokens(c4: dict, split: str, seq_len: int) -> int:
  """Target tokens of one epoch with each document on its own (concat_batch 1): its tokens, cut
  into pieces of seq_len - 1, each piece ending in EOS."""
  import sentencepiece as spm
  sp = spm.SentencePieceProcessor(model_file=c4['vocabulary'])
  lengths = [len(ids) for ids in sp.encode(c4[split])]
  return sum(n + math.ceil(n / (seq_len - 1)) for n in lengths)


# ---- one host of a multi-process read --------------------------------------------------------

HOST_READ = ['NUM_LAYERS=2', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=4', 'DIMS_PER_HEAD=8', 'VOCAB_SIZE=128',
             f'MAX_SEQ_LEN={SEQ_LEN}', 'ICI_MESH_SHAPE=[1,8,1]', 'PERCORE_BATCH_SIZE=1',
             'datasets.C4Train.repeat=False', 'datasets.C4Train.shuffle=False',
             # each document its own token stream, so its marker stays whole in its first piece
             'datasets.C4Train.concat_batch=1', 'datasets.C4Validation.concat_batch=1']


def read_epoch(inp) -> dict:
  """The markers of the documents in one epoch of `inp`, and its target tokens (weight > 0)."""
  documents, tokens = [], 0
  while True:
    try:
      batch = inp.get_next()
    except EndOfInput:
      return {'documents': documents, 'tokens': tokens}
    real = batch['weights'] > 0
    tokens += int(real.sum())
    segments = batch.get('segment_ids', real.astype(np.int32))
    for row in range(real.shape[0]):
      for segment in np.unique(segments[row][real[row]]):
        piece = batch['labels'][row][(segments[row] == segment) & real[row]]
        documents += re.findall(r'doc(\d{4})', inp.ids_to_strings(piece[None])[0])


def read_as_host(data_dir: str, vocabulary: str, out: str) -> None:
  distributed.start(distributed.settings_from())
  resolved = config.resolve('c4.C4Spmd1BAdam4Replicas',
                            HOST_READ + [f'C4_DATA_DIR={data_dir}', f'C4_VOCABULARY={vocabulary}'])
  setup = engine.build(resolved)
  result = {'infeed_host_index': setup.infeed.host_index}
  for split, cfg in (('train', resolved.train_dataset()), ('validation', resolved.eval_datasets()[0])):
    result[split] = read_epoch(infeed.build_input(cfg, setup))
  with open(out, 'w') as f:
    json.dump(result, f)


if __name__ == '__main__':
  read_as_host(*sys.argv[1:4])
