"""Preference pairs from JSONL files: a prompt, the completion preferred (chosen) and the other (rejected).

Each line is one pair, in either of the layouts TRL reads:

  {"prompt": "text", "chosen": "text", "rejected": "text"}                       plain text
  {"prompt": [{"role": "user", "content": ...}, ...],                             chat messages, rendered by
   "chosen": [{"role": "assistant", "content": ...}], "rejected": [...]}          the model's own chat template

(a chat's chosen and rejected may also be strings: one assistant message each). Plain text is the prompt
then the completion and EOS, tokenized apart (as SFT's prompt/completion records: paxcli.inputs.sft); a
chat is the prompt's messages then the completion's, through the tokenizer's own template
(paxcli.inputs.chat_template, CHAT_TEMPLATE as for SFT). Either way only the completion's tokens weigh 1:
the prompt is read, never trained on (an assistant turn inside a chat prompt included).

A pair is two rows of MAX_SEQ_LEN tokens, one a side, each its own segment (no packing: the loss sums a
side's log-probabilities), right-padded. TRUNCATION says what happens to a side longer than a row:
'completion' (the default) cuts the completion's end, as TRL's keep_start does; 'none' makes it a bad pair.
A prompt that leaves no room for one completion token is a bad pair either way.

Bad pairs: a missing or malformed field, an empty completion, chosen identical to rejected (as written, or
once cut to the row), a side that does not fit. With BAD_PAIRS='error' (the default) the first one stops
the run in one line naming its file and line; 'skip' leaves them out, and the input's note counts them by
reason. Every file is read and checked when the input is built, before anything compiles.

The eval split is SFT's (1 in 20 pairs by a hash of the text, paxcli.inputs.documents); training reads
the pairs in a seeded order, epoch after epoch.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import time
from typing import Iterator, Optional

import numpy as np

from paxcli.errors import UserError, shorten
from paxcli.inputs import chat_template, documents, packing, sft
from paxcli.inputs.file_input import FileLmInput
from paxcli.inputs.synthetic import SyntheticLmInput
from paxcli.options import BAD_PAIRS, TRUNCATIONS

SIDES = ('chosen', 'rejected')
ROW_FEATURES = ('ids', 'labels', 'weights', 'segment_ids')
_PAIR_ORDER = 3   # the random stream of the pairs' order (file_input's streams are 0-2)


class BadPair(UserError):
  """A pair that cannot be trained on; `reason` is its kind, for the count BAD_PAIRS='skip' reports."""

  def __init__(self, where: str, reason: str, detail: str):
    super().__init__(f'{where}: {detail}')
    self.reason = reason


@dataclasses.dataclass(frozen=True)
class Pair:
  chosen: packing.Example
  rejected: packing.Example

  @property
  def key(self) -> str:
    """What identifies the pair as it is trained (its tokens and weights): REFERENCE='precomputed' keeps each
    pair's reference log-probabilities under it."""
    h = hashlib.sha1()
    for ex in (self.chosen, self.rejected):
      for a in (ex.ids, ex.labels, ex.weights):
        h.update(np.ascontiguousarray(a).tobytes())
        h.update(b'|')
    return h.hexdigest()


def pair_batch(pairs: list[Optional[Pair]], seq_len: int, reference: Optional[dict] = None) -> dict[str, np.ndarray]:
  """The batch of `pairs` (None: a padding pair, every weight 0): per side ids, labels, weights and
  segment_ids [pairs, seq_len]; with `reference` (pair key -> its (chosen, rejected) reference log-probabilities)
  also ref_chosen_logps and ref_rejected_logps [pairs]."""
  n = len(pairs)
  out = {}
  if reference is not None:
    values = np.array([reference[p.key] if p is not None else (0.0, 0.0) for p in pairs], np.float32).reshape(n, 2)
    out['ref_chosen_logps'], out['ref_rejected_logps'] = values[:, 0], values[:, 1]
  for side in SIDES:
    ids, labels = np.zeros((n, seq_len), np.int32), np.zeros((n, seq_len), np.int32)
    weights, segments = np.zeros((n, seq_len), np.float32), np.zeros((n, seq_len), np.int32)
    for i, pair in enumerate(pairs):
      if pair is None:
        continue
      ex = getattr(pair, side)
      k = len(ex)
      ids[i, :k], labels[i, :k], weights[i, :k], segments[i, :k] = ex.ids, ex.labels, ex.weights, 1
    out.update({f'{side}_ids': ids, f'{side}_labels': labels, f'{side}_weights': weights,
                f'{side}_segment_ids': segments})
  return out


@dataclasses.dataclass
class PreferenceInput(FileLmInput):
  """Batches of preference pairs from JSONL files (module docstring); `tokenizer` is required (the model's)."""
  truncation: str = 'completion'
  bad_pairs: str = 'error'
  # REFERENCE='precomputed': batches carry each pair's reference log-probabilities, which the train loop computes
  # once and hands over (set_reference; paxcli.loops.reference) before the first batch
  precomputed_reference: bool = False

  def __post_init__(self):
    if self.truncation not in TRUNCATIONS:
      raise UserError(f'TRUNCATION={self.truncation!r}: choose one of {", ".join(TRUNCATIONS)}.')
    if self.bad_pairs not in BAD_PAIRS:
      raise UserError(f'BAD_PAIRS={self.bad_pairs!r}: choose one of {", ".join(BAD_PAIRS)}.')
    if not self.tokenizer:
      raise UserError('Preference pairs are read with the model\'s own tokenizer: set TOKENIZER (BASE sets it to the '
                      'tokenizer its import kept).')
    self._pairs: dict[tuple, list[Pair]] = {}
    self._reference: Optional[dict] = None
    self.skipped: collections.Counter = collections.Counter()
    t0 = time.perf_counter()
    super().__post_init__()   # tokenizer and chat template; reads and checks every pair (_check_has_documents)
    count = sum(len(pairs) for pairs in self._pairs.values())
    self.notes.append(f'Input {self.name!r}: {count:,} preference pair(s) read and checked '
                      f'({time.perf_counter() - t0:.1f} s, {self.split} split).')
    if self.skipped:
      self.notes.append(self.skip_note())

  # ---- reading and checking -------------------------------------------------------------------

  def _check_has_documents(self, files: list[str]) -> None:
    pairs = list(self._read(files))
    if not pairs:
      side = {'eval': ' on the eval side (1 in 20 pairs, by a hash of the text); give EVAL_DATA or more pairs',
              'train': ' on the train side', 'all': ''}[self.split]
      raise UserError(f'Input {self.name!r}: no preference pair to train on in {shorten(repr(files[0]), 120)}'
                      f'{f" and {len(files) - 1} more file(s)" if len(files) > 1 else ""}{side}.')
    self._pairs[tuple(files)] = pairs

  def _read(self, files: list[str]) -> Iterator[Pair]:
    for path in files:
      for where, record in documents.json_records(path):
        try:
          texts = pair_texts(record, where)
          if self.split != 'all' and documents.in_eval_split(texts) != (self.split == 'eval'):
            continue
          yield self._pair(record, where)
        except BadPair as e:
          if self.bad_pairs == 'error':
            raise UserError(f'{e} (BAD_PAIRS=skip leaves such pairs out, counted.)') from None
          self.skipped[e.reason] += 1

  def skip_note(self) -> str:
    total = sum(self.skipped.values())
    kinds = ', '.join(f'{n} {reason}' for reason, n in self.skipped.most_common())
    return f'Input {self.name!r}: skipped {total} bad preference pair(s) (BAD_PAIRS=skip): {kinds}.'

  def _pair(self, record: dict, where: str) -> Pair:
    chat = isinstance(record['prompt'], list)
    sides = [self._side(record, side, chat, where) for side in SIDES]
    if all(np.array_equal(a, b) for a, b in zip((sides[0].ids, sides[0].labels), (sides[1].ids, sides[1].labels))):
      raise BadPair(where, 'identical', 'chosen and rejected are the same tokens'
                    + (' once cut to MAX_SEQ_LEN' if record['chosen'] != record['rejected'] else '')
                    + ': the pair prefers nothing.')
    return Pair(*sides)

  def _side(self, record: dict, side: str, chat: bool, where: str) -> packing.Example:
    """One side's tokens, weights on its completion only, fitted to the row (TRUNCATION)."""
    completion = record[side]
    if chat:
      prompt = list(record['prompt'])
      reply = [{'role': sft.TRAINED_ROLE, 'content': completion}] if isinstance(completion, str) else list(completion)
      example = self._chat_example(prompt + reply, where, sum(m.get('role') == sft.TRAINED_ROLE for m in prompt))
    else:
      chunks = (sft.Chunk(record['prompt'], False), sft.Chunk(completion, True, eos=True))
      example = packing.tokenize(chunks, self._tok.encode_many([c.text for c in chunks]), self.eos_id,
                                 self._tok.bos_id if self._tok.bos_first else None)
    trained = np.flatnonzero(example.weights) if example is not None else ()
    if not len(trained):
      raise BadPair(where, 'empty completion', f'the {side} completion has no token to train on (it is empty).')
    if len(example) <= self.seq_len:
      return example
    if trained[0] >= self.seq_len:
      raise BadPair(where, 'prompt too long', f'the prompt takes {trained[0] + 1:,} tokens, leaving no room in a '
                    f'row of {self.seq_len:,} (MAX_SEQ_LEN) for the {side} completion.')
    if self.truncation == 'none':
      raise BadPair(where, 'too long', f'the {side} side is {len(example) + 1:,} tokens, more than a row of '
                    f'{self.seq_len + 1:,} holds (MAX_SEQ_LEN + 1); TRUNCATION=completion cuts its completion to fit.')
    return example.cut(0, self.seq_len)

  def _chat_example(self, messages: list, where: str, prompt_turns: int) -> Optional[packing.Example]:
    """A conversation's pairs through the model's template (or paxcli's own), with the assistant turns of the
    prompt (its first `prompt_turns` trained spans) weighing 0."""
    if self._chat is not None:
      example = self._chat.example(messages, self._tok, where)
    elif self._own_chat:
      chunks = sft.chat(messages, where)
      example = packing.tokenize(chunks, self._tok.encode_many([c.text for c in chunks]), self.eos_id,
                                 self._tok.bos_id if self._tok.bos_first else None)
    else:
      raise chat_template.no_template(where, self._tok, f'CHAT_TEMPLATE={chat_template.OWN}')
    if example is not None and prompt_turns:
      starts = np.flatnonzero(np.diff(np.concatenate([[0.0], example.weights])) > 0)
      if len(starts) > prompt_turns:
        example.weights[:starts[prompt_turns]] = 0
      else:
        example.weights[:] = 0
    return example

  # ---- the reference's log-probabilities (REFERENCE='precomputed') -------------------------------

  def reference_batches(self) -> Iterator[tuple[list[Optional[str]], dict]]:
    """(the pairs' keys, None for padding; their batch) over this process's pairs once, in order: what the
    reference's log-probabilities are computed on."""
    mine = self._my_pairs()
    for start in range(0, len(mine), self.batch_size):
      chunk = mine[start:start + self.batch_size]
      chunk = chunk + [None] * (self.batch_size - len(chunk))
      yield [p.key if p is not None else None for p in chunk], pair_batch(chunk, self.seq_len)

  def set_reference(self, values: dict, where: str) -> None:
    """Each pair's (chosen, rejected) reference log-probabilities by pair key, read from `where`; UserError when
    one of this process's pairs has none (the data changed since they were computed)."""
    missing = sum(p.key not in values for p in self._my_pairs())
    if missing:
      raise UserError(f'{where} holds no reference log-probabilities for {missing} of input {self.name!r}\'s pairs: '
                      'the data or MAX_SEQ_LEN changed since they were computed. Train it in a new --job-log-dir.')
    self._reference = values

  # ---- batches --------------------------------------------------------------------------------

  def _batches(self) -> Iterator[dict]:
    if self.precomputed_reference and self._reference is None:
      raise UserError(f'Input {self.name!r} needs its pairs\' reference log-probabilities (REFERENCE=\'precomputed\'), '
                      'which pax train and pax eval compute or read from the job directory first.')
    mine, ref = self._my_pairs(), self._reference
    if not self.is_training:
      for start in range(0, len(mine), self.batch_size):
        chunk = mine[start:start + self.batch_size]
        yield pair_batch(chunk + [None] * (self.batch_size - len(chunk)), self.seq_len, ref)
      return
    order = (mine[i] for epoch in itertools.count()
             for i in np.random.default_rng([self.seed, _PAIR_ORDER, epoch]).permutation(len(mine)))
    while True:
      yield pair_batch(list(itertools.islice(order, self.batch_size)), self.seq_len, ref)

  def _my_pairs(self) -> list[Pair]:
    """This process's share of the pairs: every n-th, from its index (the same order on every process)."""
    num_hosts, host = self._host()
    pairs = [p for files, _ in self.sources for p in self._pairs[tuple(files)]]
    mine = pairs[host::num_hosts]
    if not mine:
      raise UserError(f'Input {self.name!r}: process {host} of {num_hosts} has no preference pair ({len(pairs)} in '
                      'all); give more pairs.')
    return mine


def pair_texts(record: dict, where: str) -> documents.Document:
  """The pair's text as a document (for the eval split's hash), after checking its fields."""
  for field in ('prompt',) + SIDES:
    if field not in record:
      fields = ', '.join(repr(k) for k in list(record)[:8]) or 'none'
      raise BadPair(where, 'missing field', f'no {field!r} field; a preference pair has "prompt", "chosen" and '
                    f'"rejected" (its fields are {shorten(fields, 120)}).')
  chat = isinstance(record['prompt'], list)
  texts = []
  for field in ('prompt',) + SIDES:
    value = record[field]
    if isinstance(value, str):
      if field != 'prompt' and not value.strip():
        raise BadPair(where, 'empty completion', f'the {field} completion is empty.')
      texts.append(value)
    elif chat and isinstance(value, list) and value and all(_message(m) for m in value):
      if field != 'prompt' and not any(m['content'].strip() for m in value):
        raise BadPair(where, 'empty completion', f'the {field} completion is empty.')
      texts.extend(m['content'] for m in value)
    else:
      shape = 'a list of {"role": ..., "content": ...} messages' if chat else 'a string'
      raise BadPair(where, 'malformed field', f'{field!r} must be {shape} (as "prompt" is '
                    f'{"a list of messages" if chat else "a string"}), got {shorten(repr(value), 60)}.')
  if record['chosen'] == record['rejected']:
    raise BadPair(where, 'identical', 'chosen and rejected are identical: the pair prefers nothing.')
  return documents.Document(tuple(sft.Chunk(t, True) for t in texts), where)


def _message(m) -> bool:
  return isinstance(m, dict) and isinstance(m.get('role'), str) and isinstance(m.get('content'), str)


@dataclasses.dataclass
class SyntheticPreferenceInput(SyntheticLmInput):
  """Pairs from SyntheticLmInput's rows, for plans and benchmarks (a posttrain recipe given no TRAIN_DATA): the
  row's first half is the prompt, the chosen completion goes on counting, the rejected one is random tokens (with
  precomputed_reference, reference log-probabilities of 0)."""
  precomputed_reference: bool = False

  def __post_init__(self):
    super().__post_init__()
    self.notes = [f"Input {self.name!r}: synthetic preference pairs (no TRAIN_DATA given: set TRAIN_DATA to your "
                  'JSONL pairs to tune on them).']

  def _next_batch(self, index: int) -> dict[str, np.ndarray]:
    chosen = super()._next_batch(index)
    prompt = self.seq_len // 2
    weights = chosen['weights'].copy()
    weights[:, :max(prompt - 1, 0)] = 0
    rng = np.random.default_rng([self.seed, index, 1])
    tokens = np.concatenate([chosen['ids'][:, :1], chosen['labels']], 1)
    rejected = tokens.copy()
    rejected[:, prompt:] = rng.integers(0, self.vocab_size, size=rejected[:, prompt:].shape)
    segments = np.ones(weights.shape, np.int32)
    out = {'chosen_ids': tokens[:, :-1], 'chosen_labels': tokens[:, 1:], 'chosen_weights': weights,
           'chosen_segment_ids': segments, 'rejected_ids': rejected[:, :-1], 'rejected_labels': rejected[:, 1:],
           'rejected_weights': weights.copy(), 'rejected_segment_ids': segments.copy()}
    if self.precomputed_reference:   # no reference pass for made-up pairs: the shapes are what plans need
      out['ref_chosen_logps'] = out['ref_rejected_logps'] = np.zeros((self.batch_size,), np.float32)
    return out
