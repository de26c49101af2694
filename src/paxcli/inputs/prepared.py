"""Prepared data: a directory of tokenized ArrayRecord shards and the manifest that describes them.

`pax data prepare` writes it and the Grain input reads it, so a run never tokenizes again and
every document can be addressed by (shard, record): the index a Grain sampler shuffles.

  OUT/prepared.json                   the manifest (below); written last, so its presence says complete
  OUT/tokenizer/spm.model             the tokenizer the ids come from (or tokenizer/tokenizer.json)
  OUT/train-00000-of-00008.array_record, ...   one record per document
  OUT/eval-00000-of-00001.array_record, ...    the eval side (documents.in_eval_split), when split

A record is one document: its n tokens t_0..t_{n-1} (EOS already inserted where the document's
chunks end) as little-endian int32, then n uint8 loss weights, the weight of each token as a
label (0 for an SFT prompt, 1 elsewhere): 5n bytes. Its training pairs are ids t[:-1],
labels t[1:], weights w[1:] (paxcli.inputs.packing.Example), exactly what the file input makes.
The bytes are data only: nothing in a record or the manifest is ever run or imported.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import numpy as np

from paxcli import files
from paxcli.errors import UserError
from paxcli.inputs.packing import Example

MANIFEST = 'prepared.json'
FORMAT = 'paxcli-tokens'
VERSION = 1
SPLITS = ('train', 'eval')


def encode(tokens: np.ndarray, weights: np.ndarray) -> bytes:
  """The record of one document: int32 tokens then uint8 weights, both of its length."""
  tokens = np.asarray(tokens)
  if tokens.ndim != 1 or len(tokens) != len(weights):
    raise ValueError(f'tokens {tokens.shape} and weights {np.shape(weights)} must be 1-D of one length')
  return tokens.astype('<i4').tobytes() + np.asarray(weights).astype(np.uint8).tobytes()


def decode(record: bytes, where: str = 'record') -> tuple[np.ndarray, np.ndarray]:
  """(tokens int32, weights float32) of a record; a UserError naming `where` if it is not one."""
  if len(record) % 5:
    raise UserError(f'{where}: {len(record)} bytes is not a prepared document (5 bytes a token); '
                    'was this directory written by `pax data prepare`?')
  n = len(record) // 5
  tokens = np.frombuffer(record, '<i4', count=n).astype(np.int32)
  weights = np.frombuffer(record, np.uint8, offset=4 * n).astype(np.float32)
  return tokens, weights


def example(record: bytes, where: str = 'record') -> Optional[Example]:
  """The training pairs of a record (packing.Example); None for a document under 2 tokens."""
  tokens, weights = decode(record, where)
  if len(tokens) < 2:
    return None
  return Example(tokens[:-1], tokens[1:], weights[1:])


def write_shard(path: str, records) -> tuple[int, int]:
  """Writes encoded records (an iterable of bytes) to an ArrayRecord file through a temporary
  name renamed at the end (a killed writer leaves no half shard under the real name);
  returns (records, tokens). group_size:1 keeps random access cheap for a shuffling reader."""
  from array_record.python.array_record_module import ArrayRecordWriter  # Linux/macOS wheels only
  tmp = path + '.partial'
  writer = ArrayRecordWriter(tmp, 'group_size:1')
  count = tokens = 0
  try:
    for record in records:
      writer.write(record)
      count += 1
      tokens += len(record) // 5
  finally:
    writer.close()
  os.replace(tmp, path)
  return count, tokens


def tokenizer_name(kind: str) -> str:
  """Where a directory keeps its tokenizer of `kind` (paxcli.inputs.tokenizers.kind_of), relative to it."""
  return {'hf': 'tokenizer/tokenizer.json', 'sentencepiece': 'tokenizer/spm.model'}[kind]


def shard_name(split: str, index: int, count: int) -> str:
  return f'{split}-{index:05d}-of-{count:05d}.array_record'


@dataclasses.dataclass
class Shard:
  name: str  # a file name inside the directory (never a path)
  records: int
  tokens: int


@dataclasses.dataclass
class Manifest:
  """What prepared.json says: the tokenizer, its vocabulary and EOS, and each split's shards."""
  tokenizer: str  # relative to the directory: tokenizer/spm.model or tokenizer/tokenizer.json
  vocab_size: int
  eos_id: int
  shards: dict[str, list[Shard]]  # split -> shards, in order
  sources: list[str] = dataclasses.field(default_factory=list)  # the files it was made from, for people
  text_field: str = 'text'

  def records(self, split: str) -> int:
    return sum(s.records for s in self.shards.get(split, []))

  def to_json(self) -> dict:
    return {'format': FORMAT, 'version': VERSION, 'tokenizer': self.tokenizer, 'vocab_size': self.vocab_size,
            'eos_id': self.eos_id, 'text_field': self.text_field, 'sources': list(self.sources),
            'shards': {split: [dataclasses.asdict(s) for s in shards] for split, shards in self.shards.items()}}


def is_prepared(path: str) -> bool:
  return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


def write_manifest(directory: str, manifest: Manifest) -> None:
  """prepared.json, written through a temporary file: a directory with it is complete."""
  files.atomic_write(os.path.join(directory, MANIFEST), (json.dumps(manifest.to_json(), indent=1) + '\n').encode())


def read_manifest(directory: str) -> Manifest:
  """The manifest of a prepared directory, checked; a UserError in the user's terms otherwise."""
  path = os.path.join(directory, MANIFEST)
  if not os.path.isfile(path):
    raise UserError(f'{directory}: no {MANIFEST}: not a prepared data directory, or `pax data prepare` '
                    'did not finish writing it (run it again: it resumes).')
  try:
    with open(path, encoding='utf-8') as f:
      raw = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise UserError(f'{path}: not readable JSON ({e}).') from None
  if not isinstance(raw, dict) or raw.get('format') != FORMAT:
    raise UserError(f'{path}: not a paxcli prepared-data manifest (format {FORMAT!r}).')
  if raw.get('version') != VERSION:
    raise UserError(f'{path}: version {raw.get("version")!r}; this paxcli reads version {VERSION}.')
  try:
    shards = {split: [Shard(str(s['name']), int(s['records']), int(s['tokens'])) for s in raw['shards'][split]]
              for split in raw['shards']}
    manifest = Manifest(str(raw['tokenizer']), int(raw['vocab_size']), int(raw['eos_id']), shards,
                        [str(s) for s in raw.get('sources', [])], str(raw.get('text_field', 'text')))
  except (KeyError, TypeError, ValueError) as e:
    raise UserError(f'{path}: malformed manifest ({type(e).__name__}: {e}).') from None
  for name in [manifest.tokenizer] + [s.name for shards in shards.values() for s in shards]:
    _check_inside(directory, name, path)
  unknown = set(shards) - set(SPLITS)
  if unknown:
    raise UserError(f'{path}: unknown split(s) {sorted(unknown)}; a prepared directory has {list(SPLITS)}.')
  return manifest


def _check_inside(directory: str, name: str, manifest_path: str) -> None:
  """A name in the manifest must be a plain file inside the directory (no '..', no absolute
  path, no symlink leading out): a manifest a user received cannot point the reader elsewhere."""
  root = os.path.realpath(directory)
  target = os.path.realpath(os.path.join(root, name))
  if os.path.isabs(name) or os.path.commonpath([root, target]) != root:
    raise UserError(f'{manifest_path}: {name!r} is outside the prepared directory.')
