"""`pax data prepare`: the user's files tokenized once into a prepared directory (paxcli.inputs.prepared).

Three steps:
  scan    every document read, none tokenized: each bad line, row or record is reported (file and
          line, documents' own messages) before anything is written; each split's documents counted
  plan    each split cut into shards of contiguous documents; the plan (the files with their sizes
          and times, the settings, the shards' document ranges) written to OUT/prepare-plan.json
  write   the documents read again in order and tokenized by `workers` processes, whose results are
          taken in order: the bytes written do not depend on their number. Each shard is written
          under a temporary name and renamed when complete (prepared.write_shard); prepared.json last.

Records are what the file input trains on: a document's chunks encoded one by one, EOS after the
chunks that end a text, with each token's loss weight (packing.token_weights); a document under
2 tokens, which never trains, is left out. The split is the file input's (documents.in_eval_split),
so prepared and unprepared runs hold out the same documents.

Resume: run the same command again. A directory whose plan names the same files (sizes and times),
settings and tokenizer keeps its finished shards and redoes the unfinished one; any other non-empty
directory is refused, never overwritten. A prepare holds OUT/.prepare.lock while it writes OUT (a
second prepare into it is refused, not interleaved), and files under OUT are never its inputs (an
OUT inside an input directory resumes).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import time
from typing import Callable, Iterator, Optional

import numpy as np

from paxcli import files
from paxcli.errors import UserError, shorten
from paxcli.inputs import chat_template, documents, packing, prepared, tokenizers
from paxcli.inputs.file_input import DEFAULT_VOCAB_SIZE, anchored, auto_tokenizer

PLAN = 'prepare-plan.json'
LOCK = '.prepare.lock'  # held while a prepare writes the directory (_locked)
PLAN_FORMAT = 'paxcli-prepare-plan'
PLAN_VERSION = 1
SHARD_CHARS = 64_000_000  # of text per train shard when --num-shards is not given (~16M tokens, ~80 MB)
BATCH_DOCS = 64           # documents a worker tokenizes at a time
MAX_ERRORS_SHOWN = 20

Progress = Callable[[str, Optional[int]], Callable[[int, int], None]]  # (phase, total) -> advance(docs, tokens)


@dataclasses.dataclass(frozen=True)
class Options:
  sources: tuple[str, ...]   # globs
  output: str                # absolute
  tokenizer: Optional[str] = None  # a .model or tokenizer.json; None: trained on the train side
  vocab_size: int = DEFAULT_VOCAB_SIZE  # of a trained tokenizer
  text_field: str = 'text'
  num_shards: Optional[int] = None  # train shards; None: one per SHARD_CHARS of text
  eval_split: bool = True
  workers: int = 1
  chat_template: str = ''   # chat records: '' the tokenizer's own template; a name it ships; 'paxcli' (inputs.sft)


@dataclasses.dataclass
class Counts:
  """A split's documents and characters, as the scan finds them."""
  documents: int = 0
  chars: int = 0


def prepare(options: Options, progress: Progress, log: Callable[[str], None]) -> dict:
  """Scans, plans and writes (the module docstring); returns the summary `--json` prints."""
  start = time.perf_counter()
  paths = source_files(options.sources, options.output)
  with _locked(options.output):
    return _prepare(options, paths, start, progress, log)


def _prepare(options: Options, paths: list[str], start: float, progress: Progress, log: Callable[[str], None]) -> dict:
  settings = _settings(options, paths)
  plan = _existing_plan(options.output, settings)
  if plan is not None and prepared.is_prepared(options.output):
    log(f'{options.output} is already prepared from these files and settings: nothing to do.')
    return summary(options.output, plan, time.perf_counter() - start, 0, 0, options.workers, 0.0)
  if plan is None:
    counts = scan(paths, options.text_field, options.eval_split, progress)
    plan = {'format': PLAN_FORMAT, 'version': PLAN_VERSION, 'settings': settings,
            'shards': _shard_plan(counts, options.num_shards)}
  tokenizer_source = options.tokenizer or _kept_tokenizer(options.output) or auto_tokenizer(
      _data(options.sources), options.text_field, options.vocab_size)
  tok = tokenizers.load_for_documents(tokenizer_source)
  if not os.path.isfile(os.path.join(options.output, PLAN)):
    files.atomic_write(os.path.join(options.output, PLAN), (json.dumps(plan, indent=1) + '\n').encode())
  tokenizer_rel = _copy_tokenizer(tokenizer_source, options.output)
  tokenizing = time.perf_counter()
  docs, tokens = write(paths, plan, options, tokenizer_source, progress, log)
  tokenizing = time.perf_counter() - tokenizing
  shards = {split: [_shard_stats(options.output, name) for name, _, _ in ranges]
            for split, ranges in plan['shards'].items()}
  prepared.write_manifest(options.output, prepared.Manifest(
      tokenizer_rel, tok.vocab_size, tok.eos_id, shards, paths, options.text_field))
  return summary(options.output, plan, time.perf_counter() - start, docs, tokens, options.workers, tokenizing)


@contextlib.contextmanager
def _locked(output: str):
  """Holds OUT/.prepare.lock (an flock) while a prepare writes OUT: a second prepare into the same
  directory is refused in one line, never interleaved with the first. The lock file goes when the
  prepare ends, and so does OUT when this prepare made it and wrote nothing else into it (bad input
  found by the scan leaves no trace)."""
  if os.path.lexists(output) and not os.path.isdir(output):
    raise UserError(f'{output} is a file; give a directory to write the prepared data to.')
  made = not os.path.isdir(output)
  path = os.path.join(output, LOCK)
  fd = _lock(output, path)
  try:
    yield
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.remove(path)
    os.close(fd)
    if made and not os.listdir(output):
      os.rmdir(output)


def _lock(output: str, path: str) -> int:
  """An open descriptor of `path` holding its flock; UserError when another process holds it."""
  for attempt in itertools.count():
    try:
      os.makedirs(output, exist_ok=True)
      fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # FileNotFoundError: a prepare that failed removed the directory it had made
      if isinstance(e, FileNotFoundError) and attempt < 3:
        continue
      raise UserError(f'Cannot write the prepared data to {output}: {e.strerror}.') from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)
      raise UserError(f'Another `pax data prepare` is writing {output} now: nothing written. Let it finish (the '
                      'same command run again afterwards resumes or finds it done), or give another '
                      'directory.') from None
    try:
      if os.stat(path).st_ino == os.fstat(fd).st_ino:
        return fd
    except FileNotFoundError:
      pass
    os.close(fd)  # its holder removed the file as this one opened it: lock the new one


def source_files(sources, output: Optional[str] = None) -> list[str]:
  """The files of every glob, in the order given, each once; absolute. Files under `output` (the
  prepare's own output lying inside an input directory) are left out: its shards never become
  inputs of a resume."""
  out, seen = [], set()
  inside = os.path.realpath(output) + os.sep if output else None
  for glob in sources:
    for path in documents.expand(anchored(glob)):
      if path not in seen and not (inside and os.path.realpath(path).startswith(inside)):
        seen.add(path)
        out.append(path)
  if not out:
    raise UserError(f'No file to prepare in {shorten(", ".join(sources), 200)} besides the output\'s own.')
  return out


def _data(sources):
  """The file input's `data` for these globs: one glob, or an equal mixture (the tokenizer trainer's input)."""
  globs = [anchored(glob) for glob in sources]
  return globs[0] if len(globs) == 1 else {glob: 1.0 for glob in globs}


def _settings(options: Options, paths: list[str]) -> dict:
  """What makes two prepares the same: the files as they are now, the tokenizer's bytes, the settings."""
  tokenizer = None
  if options.tokenizer:
    files.check_regular_file(options.tokenizer, 'tokenizer')
    with open(options.tokenizer, 'rb') as f:
      tokenizer = {'path': options.tokenizer, 'sha1': hashlib.sha1(f.read()).hexdigest()}
  return {'files': [[path, *documents.file_stamp(path)] for path in paths], 'text_field': options.text_field,
          'tokenizer': tokenizer, 'vocab_size': None if tokenizer else options.vocab_size,
          'num_shards': options.num_shards, 'eval_split': options.eval_split,
          **({'chat_template': options.chat_template} if options.chat_template else {})}


def _existing_plan(output: str, settings: dict) -> Optional[dict]:
  """The plan of an earlier prepare of the same settings into `output`; None for a new or empty
  directory; UserError for anything else (user data is never overwritten)."""
  if not os.path.isdir(output) or not set(os.listdir(output)) - {LOCK}:
    return None
  path = os.path.join(output, PLAN)
  if not os.path.isfile(path):
    raise UserError(f'{output} is not empty and was not written by `pax data prepare`: nothing written. '
                    'Give a new or empty directory.')
  try:
    plan = files.read_json(path, 'prepare plan', prepared.MAX_MANIFEST_BYTES)
    same = plan['format'] == PLAN_FORMAT and plan['version'] == PLAN_VERSION and plan['settings'] == settings
    _check_shard_plan(plan['shards'], path)
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise UserError(f'{path}: not a readable prepare plan ({e}); give a new or empty directory.') from None
  if not same:
    old = plan.get('settings', {}) if isinstance(plan, dict) else {}
    differ = [k for k in settings if old.get(k) != settings[k]] or ['format']
    raise UserError(f'{output} holds a `pax data prepare` of other files or settings ({", ".join(differ)} '
                    'differ; a file\'s size or time counts): nothing written. Give a new directory, or the '
                    'same files and options to resume it.')
  return plan


def _check_shard_plan(shards: dict, path: str) -> None:
  """The shards of a plan read back are the names and ranges _shard_plan makes (an edited plan
  cannot name a file outside the directory); ValueError otherwise."""
  for split, ranges in shards.items():
    ends = [0] + [hi for _, _, hi in ranges]
    expected = [[prepared.shard_name(split, k, len(ranges)), ends[k], ends[k + 1]] for k in range(len(ranges))]
    if split not in prepared.SPLITS or ranges != expected or ends != sorted(ends):
      raise ValueError(f'shards of {split!r} are not those of a plan')


# ---- scan -------------------------------------------------------------------------------------


def scan(paths: list[str], text_field: str, eval_split: bool, progress: Progress) -> dict[str, Counts]:
  """Each split's documents, having read them all; one UserError listing every bad input found."""
  counts = {'train': Counts(), 'eval': Counts()}
  errors: list[str] = []
  advance = progress('Checking', len(paths))
  for path in paths:
    try:
      for doc in documents.read(path, text_field, errors):
        split = _split_of(doc, eval_split)
        counts[split].documents += 1
        counts[split].chars += sum(len(c.text) for c in doc.chunks)
    except UserError as e:  # a file that cannot be read at all
      errors.append(str(e))
    advance(1, 0)
  if errors:
    more = len(errors) - MAX_ERRORS_SHOWN
    raise UserError(f'{len(errors)} bad input(s); nothing written:\n' + '\n'.join(errors[:MAX_ERRORS_SHOWN])
                    + (f'\n... and {more} more.' if more > 0 else ''))
  if not counts['train'].documents:
    raise UserError(f'No document to train on in {shorten(paths[0], 160)}'
                    f'{f" and {len(paths) - 1} more file(s)" if len(paths) > 1 else ""}.')
  return counts


def _split_of(doc: documents.Document, eval_split: bool) -> str:
  return 'eval' if eval_split and documents.in_eval_split(doc) else 'train'


def _shard_plan(counts: dict[str, Counts], num_shards: Optional[int]) -> dict[str, list]:
  """split -> [[shard name, first document, end document]]: contiguous, nearly equal ranges of the
  split's documents. Train has `num_shards` (default: one per SHARD_CHARS of text); eval as many as
  its text fills at train's shard size. A split without documents has no shards."""
  train = counts['train']
  count = num_shards or max(1, math.ceil(train.chars / SHARD_CHARS))
  chars_per_shard = max(1, train.chars / count)
  per_split = {'train': count, 'eval': max(1, math.ceil(counts['eval'].chars / chars_per_shard))}
  plan = {}
  for split, n in per_split.items():
    docs = counts[split].documents
    n = min(n, docs)
    if n:
      plan[split] = [[prepared.shard_name(split, k, n), k * docs // n, (k + 1) * docs // n] for k in range(n)]
  return plan


# ---- tokenizer --------------------------------------------------------------------------------


def _kept_tokenizer(output: str) -> Optional[str]:
  """The trained tokenizer an unfinished prepare already copied into `output` (a resume needs no
  retraining, even when the cache of trained tokenizers was cleared)."""
  path = os.path.join(output, prepared.tokenizer_name('sentencepiece'))
  return path if os.path.isfile(os.path.join(output, PLAN)) and os.path.isfile(path) else None


def _copy_tokenizer(source: str, output: str) -> str:
  """The tokenizer copied into the directory (prepared.tokenizer_name), with the tokenizer_config.json
  shipped beside it (its BOS rule, special tokens and chat template: the Grain input and a job
  directory read them beside the copy, as beside the original); the tokenizer's name there."""
  rel = prepared.tokenizer_name(tokenizers.kind_of(source))
  target = os.path.join(output, rel)
  _copy_new(source, target)
  config, config_target = tokenizers.folded_config_bytes(source), os.path.join(os.path.dirname(target),
                                                                                tokenizers.CONFIG_NAME)
  if config is not None and not os.path.isfile(config_target):   # its chat templates folded in (a resume: kept)
    files.atomic_write(config_target, config, 0o644)
  return rel


def _copy_new(source: str, target: str) -> None:
  """`source` copied to `target` unless there already (a resumed prepare), complete or not at all."""
  if not os.path.isfile(target) and os.path.abspath(source) != target:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    files.copy_member(source, target)


# ---- write ------------------------------------------------------------------------------------


def write(paths: list[str], plan: dict, options: Options, tokenizer: str, progress: Progress,
          log: Callable[[str], None]) -> tuple[int, int]:
  """Writes each split's unfinished shards; returns (documents, tokens) tokenized now."""
  todo = {split: [(name, lo, hi) for name, lo, hi in ranges if not os.path.isfile(os.path.join(options.output, name))]
          for split, ranges in plan['shards'].items()}
  kept = sum(len(ranges) for ranges in plan['shards'].values()) - sum(len(t) for t in todo.values())
  if kept:
    log(f'Resuming: {kept} finished shard(s) kept.')
  advance = progress('Tokenizing', sum(hi - lo for ranges in todo.values() for _, lo, hi in ranges))
  done = [0, 0]

  def counted(records):
    for record in records:
      done[0] += 1
      done[1] += len(record) // 5 if record else 0
      advance(1, len(record) // 5 if record else 0)
      yield record

  with _Tokenizers(tokenizer, options.workers, options.chat_template) as encode:
    for split, ranges in todo.items():
      if not ranges:
        continue
      wanted = _Ranges(ranges)
      docs = (doc for i, doc in _numbered(paths, options.text_field, options.eval_split, split) if i in wanted)
      records = counted(encode(docs))
      for name, lo, hi in ranges:
        shard = itertools.islice(records, hi - lo)
        prepared.write_shard(os.path.join(options.output, name), (r for r in shard if r is not None))
  return done[0], done[1]


class _Ranges:
  """Membership in a sorted list of [lo, hi) ranges, for documents numbered in increasing order."""

  def __init__(self, ranges):
    self._ranges = sorted((lo, hi) for _, lo, hi in ranges)

  def __contains__(self, i: int) -> bool:
    while self._ranges and i >= self._ranges[0][1]:
      self._ranges.pop(0)
    return bool(self._ranges) and i >= self._ranges[0][0]



def _numbered(paths: list[str], text_field: str, eval_split: bool, split: str):
  """(index within the split, document) of the split's documents, in file order."""
  i = 0
  for path in paths:
    for doc in documents.read(path, text_field):
      if _split_of(doc, eval_split) == split:
        yield i, doc
        i += 1


class _Tokenizers:
  """Documents -> records, in order: in this process (1 worker) or in a pool of spawned processes,
  at most 2 batches per worker in flight (Pool.imap would read the whole input ahead)."""

  def __init__(self, tokenizer: str, workers: int, chat: str):
    self.tokenizer, self.workers, self.chat, self.pool = tokenizer, workers, chat, None

  def __enter__(self):
    _init_worker(self.tokenizer, self.chat)
    if self.workers > 1:
      self.pool = multiprocessing.get_context('spawn').Pool(self.workers, _init_worker, (self.tokenizer, self.chat))
    return self.encode

  def __exit__(self, *exc):
    global _worker_chat
    if self.pool is not None:
      self.pool.terminate()
      self.pool.join()
    if _worker_chat is not None:  # this process's template process: ended with the prepare
      _worker_chat.close()
      _worker_chat = None

  def encode(self, docs) -> Iterator[Optional[bytes]]:
    batches = _batches(((tuple(doc.chunks), doc.messages, doc.where) for doc in docs), BATCH_DOCS)
    if self.pool is None:
      for batch in batches:
        yield from _encode_batch(batch)
      return
    pending = collections.deque()
    for batch in batches:
      if _long(batch):  # tokenized here, in order: shipped to a worker it would be held twice (pickled)
        while pending:
          yield from pending.popleft().get()
        yield from _encode_batch(batch)
        continue
      pending.append(self.pool.apply_async(_encode_batch, (batch,)))
      if len(pending) >= 2 * self.workers:
        yield from pending.popleft().get()
    while pending:
      yield from pending.popleft().get()


def _long(batch: list[tuple]) -> bool:
  """Whether a batch holds a long document (tokenizers.LONG_TEXT: one tokenized in pieces)."""
  return any(sum(len(c.text) for c in chunks) > 2 * tokenizers.LONG_TEXT for chunks, _, _ in batch)


def _batches(items, size: int):
  batch = []
  for item in items:
    batch.append(item)
    if len(batch) == size:
      yield batch
      batch = []
  if batch:
    yield batch


_worker_tokenizer = None
_worker_chat = None  # the tokenizer's shipped chat template, if any (chat_template.of_tokenizer)
_worker_own_chat = False  # chats without a template are read in paxcli's format (else refused)


def _init_worker(path: str, chat_name: str = '') -> None:
  global _worker_tokenizer, _worker_chat, _worker_own_chat
  _worker_tokenizer = tokenizers.load(path)
  _worker_chat = chat_template.of_tokenizer(_worker_tokenizer, chat_name)
  # a tokenizer paxcli trained (here, on the train side, or before) has no chat format but paxcli's
  _worker_own_chat = chat_name == chat_template.OWN or (_worker_chat is None and _worker_tokenizer.trained_here())


def _encode_batch(batch: list[tuple]) -> list[Optional[bytes]]:
  """The records of a batch of documents ((chunks, messages, where) each); None for a document
  under 2 tokens. A chat goes through the shipped template when there is one, as the file input does."""
  tok = _worker_tokenizer
  plain = [chunks for chunks, messages, _ in batch if not _templated(messages)]
  encoded = collections.deque(tok.encode_many([chunk.text for chunks in plain for chunk in chunks]))
  out = []
  for chunks, messages, where in batch:
    if _templated(messages):
      out.append(_chat_record(_worker_chat.example(messages, tok, where)))
      continue
    if messages is not None and not _worker_own_chat:
      raise chat_template.no_template(where, tok, f'--chat-template {chat_template.OWN}')
    # Each document's ids, tokens and record held one after another, none longer than needed: a
    # 100 MB document costs a few times its size, not tens (benchmarks/prepare_memory.py).
    arrays = list(packing.token_weights(chunks, [encoded.popleft() for _ in chunks], tok.eos_id,
                                        tok.bos_id if tok.bos_first else None))
    out.append(prepared.encode_taking(arrays) if len(arrays[0]) >= 2 else None)
    arrays.clear()
  return out


def _templated(messages) -> bool:
  return _worker_chat is not None and messages is not None


def _chat_record(example: Optional[packing.Example]) -> Optional[bytes]:
  """A record from a chat's training pairs: tokens t_0 + labels, weights 0 (t_0 is never a label) + theirs."""
  if example is None:
    return None
  tokens = np.concatenate([example.ids[:1], example.labels])
  return prepared.encode(tokens, np.concatenate([[0.0], example.weights]))


# ---- summaries ----------------------------------------------------------------------------------


def _shard_stats(output: str, name: str) -> prepared.Shard:
  """A finished shard's records and tokens, read back (a resumed run did not write it)."""
  with prepared.array_records(os.path.join(output, name)) as reader:
    n = reader.num_records()
    tokens = sum(len(r) // 5 for start in range(0, n, 4096) for r in reader.read(start, min(start + 4096, n)))
  return prepared.Shard(name, n, tokens)


def summary(output: str, plan: dict, seconds: float, docs: int, tokens: int, workers: int,
            tokenizing: float) -> dict:
  """What a prepare made (from its manifest) and how fast this run tokenized and wrote (rates over
  the tokenizing step alone: the scan and a tokenizer's training are not in them)."""
  manifest = prepared.read_manifest(output)
  return {'output': output, 'tokenizer': manifest.tokenizer, 'vocab_size': manifest.vocab_size,
          'eos_id': manifest.eos_id,
          'documents': {split: ranges[-1][2] for split, ranges in plan['shards'].items()},
          'records': {split: manifest.records(split) for split in manifest.shards},
          'tokens': {split: sum(s.tokens for s in shards) for split, shards in manifest.shards.items()},
          'shards': {split: len(shards) for split, shards in manifest.shards.items()},
          'workers': workers, 'seconds': round(seconds, 3), 'tokenizing_seconds': round(tokenizing, 3),
          'tokenized_documents': docs, 'tokenized_tokens': tokens,
          'documents_per_sec': round(docs / max(tokenizing, 1e-9), 1),
          'tokens_per_sec': round(tokens / max(tokenizing, 1e-9), 1)}


def show(path: str) -> dict:
  """`pax data show`: the manifest of a prepared directory, with totals."""
  manifest = prepared.read_manifest(path)
  raw = manifest.to_json()
  raw['path'] = path
  config = tokenizers.config_beside(prepared.member(path, manifest.tokenizer, 'tokenizer'))
  raw['tokenizer_config'] = os.path.relpath(config, os.path.realpath(path)) if config else None  # shipped with --tokenizer
  raw['totals'] = {split: {'shards': len(shards), 'records': manifest.records(split),
                           'tokens': sum(s.tokens for s in shards)} for split, shards in manifest.shards.items()}
  return raw
