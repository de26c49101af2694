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

import contextlib
import dataclasses
import json
import os
from typing import Optional

import numpy as np

from paxcli import files
from paxcli.errors import UserError, shorten
from paxcli.inputs.packing import Example

MANIFEST = 'prepared.json'
FORMAT = 'paxcli-tokens'
VERSION = 1
SPLITS = ('train', 'eval')


def encode(tokens: np.ndarray, weights: np.ndarray) -> bytes:
  """The record of one document: int32 tokens then uint8 weights, both of its length."""
  return encode_taking([tokens, weights])


def encode_taking(arrays: list) -> bytes:
  """encode(*arrays), taking the two arrays out of the list: when the list held the only references,
  they are freed before the record's bytes are made (a 100 MB document's arrays are not held three
  times over)."""
  tokens, weights = np.asarray(arrays.pop(0)), arrays.pop(0)
  if tokens.ndim != 1 or len(tokens) != len(weights):
    raise ValueError(f'tokens {tokens.shape} and weights {np.shape(weights)} must be 1-D of one length')
  n = len(tokens)
  record = np.empty(5 * n, np.uint8)
  record[:4 * n] = np.ascontiguousarray(tokens, '<i4').view(np.uint8)
  record[4 * n:] = np.asarray(weights).astype(np.uint8, copy=False)
  del tokens, weights
  return record.tobytes()


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
  tmp = path + '.partial'
  writer = _array_record().ArrayRecordWriter(tmp, 'group_size:1')
  count = tokens = 0
  try:
    for record in records:
      writer.write(record)
      count += 1
      tokens += len(record) // 5
  except BaseException:  # bad input met while writing: no half shard left behind either
    writer.close()
    os.remove(tmp)
    raise
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


# A manifest of a million shards is a few hundred MB; no real one comes near this.
MAX_MANIFEST_BYTES = 64 << 20


def member(directory: str, name: str, what: str) -> str:
  """The resolved path of `name` in a prepared directory (files.member: never a path out of it)."""
  return files.member(directory, name, what)


def read_manifest(directory: str) -> Manifest:
  """The manifest of a prepared directory, checked against the directory: every field of the type it
  must have, every name a file inside it (no symlink leading out, the tokenizer's shipped config
  too), and each shard holding the records the manifest counts (read from the shard's footer:
  a deleted, truncated or edited shard, or an edited count, is a UserError naming it)."""
  path = member(directory, MANIFEST, 'manifest')
  if not os.path.isfile(path):
    raise UserError(f'{directory}: no {MANIFEST}: not a prepared data directory, or `pax data prepare` '
                    'did not finish writing it (run it again: it resumes).')
  raw = files.read_json(path, 'prepared-data manifest', MAX_MANIFEST_BYTES)
  where = shorten(path, 200)
  if not isinstance(raw, dict) or raw.get('format') != FORMAT:
    raise UserError(f'{where}: not a paxcli prepared-data manifest (format {FORMAT!r}).')
  if raw.get('version') != VERSION:
    raise UserError(f'{where}: version {shorten(repr(raw.get("version")), 40)}; this paxcli reads version {VERSION}.')
  field = _Fields(raw, where)
  vocab_size = field.integer('vocab_size', low=1)
  shards_raw = field.typed('shards', dict)
  unknown = set(shards_raw) - set(SPLITS)
  if unknown:
    raise UserError(f'{where}: unknown split(s) {shorten(sorted(unknown), 100)}; a prepared directory has '
                    f'{list(SPLITS)}.')
  shards = {split: [_shard(entry, f'shards.{split}[{i}]', where)
                    for i, entry in enumerate(_Fields(shards_raw, where).typed(split, list, f'shards.{split}'))]
            for split in shards_raw}
  manifest = Manifest(field.typed('tokenizer', str), vocab_size, field.integer('eos_id', high=vocab_size - 1), shards,
                      field.typed('sources', list, default=[]), field.typed('text_field', str, default='text'))
  if not all(isinstance(s, str) for s in manifest.sources):
    raise UserError(f'{where}: sources must be a list of file names.')
  _check_files(directory, manifest, where)
  return manifest


class _Fields:
  """Typed reads of a manifest's fields: a missing or mistyped one is a UserError naming it."""

  def __init__(self, raw: dict, where: str):
    self.raw, self.where = raw, where

  def typed(self, key: str, kind: type, name: Optional[str] = None, default=None):
    name = name or key
    if key not in self.raw:
      if default is not None:
        return default
      raise UserError(f'{self.where}: no {name!r} field; was this directory written by `pax data prepare`?')
    value = self.raw[key]
    if not isinstance(value, kind) or isinstance(value, bool):
      raise UserError(f'{self.where}: {name} must be a {_KIND_NAMES[kind]}, got {shorten(repr(value), 60)}.')
    return value

  def integer(self, key: str, name: Optional[str] = None, low: int = 0, high: Optional[int] = None) -> int:
    value = self.typed(key, int, name)
    if value < low or (high is not None and value > high):
      bound = f'between {low} and {high}' if high is not None else f'at least {low}'
      raise UserError(f'{self.where}: {name or key} must be {bound}, got {value}.')
    return value


_KIND_NAMES = {str: 'string', int: 'whole number', list: 'list', dict: 'JSON object'}


def _shard(entry, name: str, where: str) -> Shard:
  if not isinstance(entry, dict):
    raise UserError(f'{where}: {name} must be a JSON object with name, records and tokens.')
  field = _Fields(entry, where)
  return Shard(field.typed('name', str, f'{name}.name'), field.integer('records', f'{name}.records'),
               field.integer('tokens', f'{name}.tokens'))


def _check_files(directory: str, manifest: Manifest, where: str) -> None:
  """The tokenizer (and the config shipped beside it) and every shard are regular files inside the
  directory; each shard holds the records the manifest counts."""
  tokenizer = member(directory, manifest.tokenizer, 'tokenizer')
  files.check_regular_file(tokenizer, f'{where}: the tokenizer')
  config = os.path.join(os.path.dirname(tokenizer), _config_name())  # read beside the file the tokenizer is
  if os.path.lexists(config):
    member(directory, os.path.relpath(config, os.path.realpath(directory)), 'tokenizer config')
  seen = set()
  for split, shards in manifest.shards.items():
    for i, shard in enumerate(shards):
      if shard.name in seen:
        raise UserError(f'{where}: the shard {shorten(shard.name, 100)!r} is listed twice.')
      seen.add(shard.name)
      path = member(directory, shard.name, 'shard')
      files.check_regular_file(path, 'shard')
      with array_records(path) as reader:
        count = reader.num_records()
      if count != shard.records:
        raise UserError(f'{where}: shards.{split}[{i}] ({shorten(shard.name, 100)}) holds {count:,} records, the '
                        f'manifest says {shard.records:,}: the directory was edited or damaged; prepare it again.')


def _config_name() -> str:
  from paxcli.inputs.tokenizers import CONFIG_NAME  # tokenizers imports sentencepiece: only when needed
  return CONFIG_NAME


# A tokenizer file paxcli compares byte for byte (the largest tokenizer.json files are ~30 MB).
MAX_TOKENIZER_BYTES = 1 << 30


def check_one_tokenizer(named: list[tuple[str, Manifest]], what: str) -> None:
  """UserError unless every (directory, manifest) was prepared with the same tokenizer (the same
  bytes, vocabulary and EOS): ids of two tokenizers mean different tokens, and neither a mixture
  nor an evaluation of one on the other's model means anything."""
  first_dir, first = named[0]
  first_bytes = _tokenizer_bytes(first_dir, first)
  for directory, manifest in named[1:]:
    if ((manifest.vocab_size, manifest.eos_id) != (first.vocab_size, first.eos_id)
        or _tokenizer_bytes(directory, manifest) != first_bytes):
      raise UserError(f'{what}: {shorten(directory, 200)} and {shorten(first_dir, 200)} were prepared with different '
                      'tokenizers, so their ids mean different tokens; prepare them all with the same --tokenizer '
                      f'(e.g. --tokenizer {shorten(os.path.join(first_dir, first.tokenizer), 200)}).')


def _tokenizer_bytes(directory: str, manifest: Manifest) -> bytes:
  path = member(directory, manifest.tokenizer, 'tokenizer')
  files.check_regular_file(path, 'tokenizer', MAX_TOKENIZER_BYTES)
  with open(path, 'rb') as f:
    return f.read(MAX_TOKENIZER_BYTES + 1)


def _array_record():
  """array_record's module: its wheels are Linux and macOS only, so it is imported where a shard is read or written."""
  from array_record.python import array_record_module
  return array_record_module


@contextlib.contextmanager
def array_records(path: str):
  """An open ArrayRecordReader of `path`; a file that is not one (random bytes, a truncated shard) is a
  UserError naming it. The reader's close() raises on such a file too, which must not hide that line."""
  try:
    reader = _array_record().ArrayRecordReader(path)
  except (RuntimeError, OSError) as e:
    raise UserError(f'{shorten(path, 200)}: cannot read it as an ArrayRecord file ({shorten(e, 160)}).') from None
  try:
    if not reader.ok():
      raise UserError(f'{shorten(path, 200)}: not an ArrayRecord file, or a truncated or damaged one.')
    yield reader
  except RuntimeError as e:  # a damaged chunk met while reading
    raise UserError(f'{shorten(path, 200)}: damaged ArrayRecord file ({shorten(e, 160)}).') from None
  finally:
    try:
      reader.close()
    except RuntimeError:
      pass
