"""FileLmInput: LM batches from the user's own files (the TRAIN_DATA and EVAL_DATA knobs).

The pipeline, one stage per module so that another backend (Grain) can take any stage over:
  files and documents   paxcli.inputs.documents (formats, eval split, per-process share)
  records to chunks     paxcli.inputs.sft (text, prompt/completion, chat template), or a chat
                        through the model's own template (paxcli.inputs.chat_template)
  tokens                paxcli.inputs.tokenizers (sentencepiece or tokenizer.json)
  rows and batches      paxcli.inputs.packing (segment ids, positions, EOS between documents)

`data` is a glob, or {glob: weight} for a weighted mixture: training draws each next
document from source k with probability weight_k / sum(weights) (a seeded generator), and
every source repeats on its own; an eval input reads each source once, in order.

Training reads the documents of its share of the files in a seeded per-epoch order, packs
them and shuffles rows through a buffer; eval reads its share once, in file order, the
last batch padded with zero-weight rows. A resume re-reads and drops the batches consumed
(as the tf.data inputs do).

With no `tokenizer`, a sentencepiece model of `vocab_size` pieces is trained at first use on
the train side of `tokenizer_data` (default: `data`) and cached under $PAXCLI_CACHE by the
names, sizes and times of the files; `pax train` keeps it in the job directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import sys
from typing import Iterator, Optional, Union

import numpy as np

from paxcli.errors import UserError, shorten
from paxcli.files import check_output
from paxcli.inputs import chat_template, documents, packing, tokenizers
from paxcli.inputs.base import StreamInput, decode_rows
from paxcli.inputs.corpus import cache_root

SPLITS = ('train', 'eval', 'all')
AUTO_TOKENIZER_VERSION = 1
DEFAULT_VOCAB_SIZE = 2048  # of a trained tokenizer when the input is given no vocab_size
# Random streams, each seeded by [seed, stream, ...]: independent of one another.
_FILE_ORDER, _MIXTURE, _ROW_SHUFFLE = 0, 1, 2
Data = Union[str, dict]


@dataclasses.dataclass
class FileLmInput(StreamInput):
  """Documents from files -> tokens -> packed rows -> batches (see the module docstring)."""
  data: Data = ''
  split: str = 'all'  # 'train' or 'eval': that side of the hash split (documents.in_eval_split)
  seq_len: int = 128
  text_field: str = 'text'
  tokenizer: Optional[str] = None  # a sentencepiece .model or a tokenizer.json; None: trained
  # chat records: '' the tokenizer's own template (its default), refused when it ships none unless the
  # tokenizer is trained here; a name of another it ships; 'paxcli' paxcli's own format (inputs.sft)
  chat_template: str = ''
  tokenizer_data: Optional[Data] = None  # what a trained tokenizer learns from; None: `data`
  vocab_size: int = 0  # the model's: the tokenizer must fit in it; 0: no check
  shuffle_buffer: int = 1024  # rows, when training
  open_rows: int = 8  # rows the packer fills at once

  def __post_init__(self):
    super().__post_init__()
    if self.split not in SPLITS:
      raise UserError(f'Input {self.name!r}: split must be one of {SPLITS}, got {self.split!r}.')
    if self.seq_len < 1:
      raise UserError(f'Input {self.name!r}: seq_len must be positive, got {self.seq_len}.')
    self.sources = [(documents.expand(glob), weight) for glob, weight in sources(self.data, self.name)]
    self._tok = tokenizers.load_for_documents(self.tokenizer or auto_tokenizer(
        self.tokenizer_data or self.data, self.text_field, self.vocab_size or DEFAULT_VOCAB_SIZE))
    self._chat = chat_template.of_tokenizer(self._tok, self.chat_template)   # None: paxcli's own (inputs.sft)
    # a tokenizer paxcli trained has no format but paxcli's; any other shipping none is asked to choose
    self._own_chat = self.chat_template == chat_template.OWN or (self._chat is None and self._tok.trained_here())
    self.eos_id = self._tok.eos_id
    note = tokenizers.check_fits(self._tok.vocab_size, self.vocab_size, self._tok.path)
    self.notes = [note] if note else []   # what the command says once the run's checks pass (NOTES)
    for files, _ in self.sources:
      self._check_has_documents(files)

  # ---- the contract -------------------------------------------------------------------------

  def _open(self, start: int) -> Iterator[dict]:
    batches = self._batches()
    for _ in range(start):  # a resume: the batches consumed before
      next(batches, None)
    return batches

  def tokenizer_file(self) -> Optional[str]:
    return self._tok.path

  def ids_to_strings(self, ids, lengths=None) -> list[str]:
    """The rows' text with special tokens written out: what the model reads, template included."""
    return decode_rows(lambda row: self._tok.decode(row, specials=True), ids, lengths)

  # ---- the pipeline ---------------------------------------------------------------------------

  def _batches(self) -> Iterator[dict]:
    rows = packing.pack(self._examples(), self.seq_len, self.open_rows)
    if self.is_training:
      rng = np.random.default_rng([self.seed, _ROW_SHUFFLE, self._host()[1]])
      rows = packing.shuffled(rows, self.shuffle_buffer, rng)
    return packing.batches(rows, self.batch_size)

  def _examples(self) -> Iterator[packing.Example]:
    streams = [self._source_examples(files) for files, _ in self.sources]
    if not (self.is_training and self.repeat) or len(streams) == 1:
      return itertools.chain.from_iterable(streams)
    return _mixed(streams, [w for _, w in self.sources], np.random.default_rng([self.seed, _MIXTURE]))

  def _source_examples(self, files: list[str]) -> Iterator[packing.Example]:
    """This process's examples of one source: one pass, or epoch after epoch when training."""
    num_hosts, host = self._host()
    mine, share = documents.host_share(files, num_hosts, host)
    for epoch in itertools.count():
      order = mine
      if self.is_training:  # the same order on every process: shares of documents stay disjoint
        order = [mine[i] for i in np.random.default_rng([self.seed, _FILE_ORDER, epoch]).permutation(len(mine))]
      count = 0
      for doc in documents.keep_share(self._documents(order), share):
        example = self._example(doc)
        if example is not None:
          count += 1
          yield example
      if not (self.is_training and self.repeat):
        return
      if not count:
        raise UserError(f'Input {self.name!r}: process {host} of {num_hosts} has no document of '
                        f'{shorten(files[0], 120)}{" ..." if len(files) > 1 else ""} to train on '
                        f'({len(files)} file(s), {self.split} split); give more documents or files.')

  def _example(self, doc: documents.Document) -> Optional[packing.Example]:
    """A document's training pairs: a chat through the model's own template when it ships one."""
    if self._chat is not None and doc.messages is not None:
      return self._chat.example(doc.messages, self._tok, doc.where)
    if doc.messages is not None and not self._own_chat:
      raise chat_template.no_template(doc.where, self._tok, f'CHAT_TEMPLATE={chat_template.OWN}')
    return packing.tokenize(doc.chunks, self._tok.encode_many([c.text for c in doc.chunks]), self.eos_id,
                            self._tok.bos_id if self._tok.bos_first else None)

  def _documents(self, files: list[str]) -> Iterator[documents.Document]:
    for path in files:
      yield from documents.read_split(path, self.text_field, self.split)

  def _host(self) -> tuple[int, int]:
    return self.num_infeed_hosts or 1, self.infeed_host_index or 0

  def _check_has_documents(self, files: list[str]) -> None:
    """UserError at start-up, not at the first eval, when a split holds no document at all."""
    if next(self._documents(files), None) is None:
      side = {'eval': ' on the eval side (1 in 20 documents, by a hash of the text); give EVAL_DATA or more '
                      'documents', 'train': ' on the train side', 'all': ''}[self.split]
      raise UserError(f'Input {self.name!r}: no document in {shorten(repr(files[0]), 120)}'
                      f'{f" and {len(files) - 1} more file(s)" if len(files) > 1 else ""}{side}.')


def anchored(data: Optional[Data]) -> Optional[Data]:
  """`data` (a glob, a {glob: weight} mixture, or a file) with local paths made absolute, `~`
  expanded: resolved once, where the command starts, so a resume from another directory reads
  the same files. URLs (gs://...) and malformed values pass as they are (sources() says why)."""
  def one(path):
    return path if not isinstance(path, str) or not path or '://' in path else os.path.abspath(os.path.expanduser(path))
  if isinstance(data, dict):
    return {one(glob): weight for glob, weight in data.items()}
  return one(data)


def sources(data: Data, name: str = 'data', what: tuple[str, str] = ('glob', 'globs')) -> list[tuple[str, float]]:
  """[(glob, weight)] of a glob or a {glob: weight} mixture; UserError when empty or malformed.
  `what` names the keys in messages, singular and plural (the Grain input's are prepared directories)."""
  if isinstance(data, str) and data:
    return [(data, 1.0)]
  if isinstance(data, dict) and data:
    out = []
    for key, weight in data.items():
      if (not isinstance(key, str) or not isinstance(weight, (int, float)) or isinstance(weight, bool)
          or not 0 < weight < float('inf')):
        raise UserError(f'Input {name!r}: a mixture maps {what[1]} to positive weights, as {{"a": 3, "b": 1}}; '
                        f'got {shorten(repr(key), 80)}: {shorten(repr(weight), 40)}.')
      out.append((key, float(weight)))
    return out
  raise UserError(f'Input {name!r}: give the data as a {what[0]} or as {{{what[0]}: weight}}; got {shorten(repr(data), 80)}.')


def sample_prompts(data: Data, text_field: str, split: str, count: int = 4, most: int = 1000) -> list[str]:
  """Up to `count` prompts from the first `most` documents of `data` on one side of the split, for decoding
  while training on them: a prompt/completion record's prompt, else a text document's first words (a
  chat, whose prompt needs the model's template, gives none). [] when the data cannot be read (its
  input says why, in one line, when it is built)."""
  prompts, seen = [], 0
  try:
    for glob, _ in sources(data):
      for path in documents.expand(glob):
        for doc in documents.read_split(path, text_field, split):
          seen += 1
          if len(prompts) == count or seen > most:
            return prompts
          if doc.messages is None:
            prompts.append(doc.chunks[0].text if len(doc.chunks) > 1 else _first_words(doc.chunks[0].text))
  except UserError:
    return []
  return [p for p in prompts if p.strip()]


def _first_words(text: str, words: int = 6, chars: int = 48) -> str:
  return ' '.join(text[:4 * chars].split()[:words])[:chars]


def _mixed(streams: list[Iterator], weights: list[float], rng: np.random.Generator) -> Iterator:
  p = np.asarray(weights) / np.sum(weights)
  while True:
    yield next(streams[int(rng.choice(len(streams), p=p))])


def auto_tokenizer(data: Data, text_field: str, vocab_size: int) -> str:
  """The cached sentencepiece model trained on the train side of `data`; trained if missing."""
  files = sorted({path for glob, _ in sources(data) for path in documents.expand(glob)})
  stamp = json.dumps([AUTO_TOKENIZER_VERSION, vocab_size, text_field,
                      [[path, *documents.file_stamp(path)] for path in files]])
  key = hashlib.sha1(stamp.encode()).hexdigest()[:16]
  path = os.path.join(cache_root(), 'tokenizers', f'{key}_vocab{vocab_size}', 'spm.model')
  if os.path.isfile(path):
    return path
  print(f'Training a {vocab_size}-piece sentencepiece tokenizer on the train side of {shorten(repr(data), 120)} '
        f'(first use only; cached in {os.path.dirname(path)}; set TOKENIZER to use your own).', file=sys.stderr)
  size = train_tokenizer(data, text_field, vocab_size, path)
  if size < vocab_size:
    print(f'The text holds {size} pieces, fewer than the {vocab_size} asked: the tokenizer has {size}.',
          file=sys.stderr)
  return path


def train_tokenizer(data: Data, text_field: str, vocab_size: int, output: str,
                    max_chars: int = tokenizers.MAX_CHARS, force: bool = False) -> int:
  """Trains a sentencepiece model on the train side of `data` (never on the documents the eval
  split takes), one document of each source in turn; returns its size. An existing `output` (never
  one of the data files) is replaced only with `force`."""
  paths = [documents.expand(glob) for glob, _ in sources(data)]
  check_output(output, '--output', force=force, inputs=[p for group in paths for p in group])
  per_source = [_split_docs(group, text_field) for group in paths]
  texts = (doc.text() for doc in _round_robin(per_source))
  return tokenizers.train_sentencepiece(texts, vocab_size, output, max_chars)


def _split_docs(files: list[str], text_field: str) -> Iterator[documents.Document]:
  for path in files:
    yield from documents.read_split(path, text_field, 'train')


def _round_robin(iterators: list[Iterator]) -> Iterator:
  """One item of each iterator in turn, until all are spent."""
  live = list(iterators)
  while live:
    for it in list(live):
      item = next(it, None)
      if item is None:
        live.remove(it)
      else:
        yield item
