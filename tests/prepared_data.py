"""Prepared-data directories for tests: random documents written with paxcli.inputs.prepared
(until `pax data prepare` makes them), with a tiny word-level tokenizer.json over the ids."""

import os

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers

from paxcli.inputs import prepared

EOS = 1


def write_tokenizer(path: str, vocab_size: int) -> None:
  """A word-level tokenizer.json whose token i is the word 'w<i>' (id 1: '</s>')."""
  vocab = {f'w{i}': i for i in range(vocab_size)}
  vocab['</s>'] = EOS
  del vocab[f'w{EOS}']
  tok = Tokenizer(models.WordLevel(vocab, unk_token='w0'))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(path)


def make(directory, num_docs: int = 60, shards: int = 2, vocab_size: int = 64, max_len: int = 40, seed: int = 0,
         eval_docs: int = 0) -> list[np.ndarray]:
  """Writes `num_docs` random documents (2..max_len tokens, EOS last) over `shards` train shards
  (and `eval_docs` in one eval shard); returns the train documents in shard order."""
  directory = str(directory)
  os.makedirs(os.path.join(directory, 'tokenizer'), exist_ok=True)
  write_tokenizer(os.path.join(directory, 'tokenizer', 'tokenizer.json'), vocab_size)
  rng = np.random.default_rng(seed)
  docs = [np.append(rng.integers(2, vocab_size, size=rng.integers(1, max_len)), EOS) for _ in range(num_docs + eval_docs)]
  manifest = prepared.Manifest('tokenizer/tokenizer.json', vocab_size, EOS, {})
  for split, part, count in (('train', docs[:num_docs], shards), ('eval', docs[num_docs:], 1 if eval_docs else 0)):
    bounds = np.linspace(0, len(part), count + 1).astype(int)
    for i in range(count):
      name = prepared.shard_name(split, i, count)
      records, tokens = prepared.write_shard(os.path.join(directory, name), [
          prepared.encode(d, np.ones(len(d))) for d in part[bounds[i]:bounds[i + 1]]])
      manifest.shards.setdefault(split, []).append(prepared.Shard(name, records, tokens))
  prepared.write_manifest(directory, manifest)
  return docs[:num_docs]
