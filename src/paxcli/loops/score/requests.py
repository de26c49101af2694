"""What `pax score` reads: a JSONL file of requests, each turned into token pairs to score.

A line is one request, in one of four forms:

  {"context": "The cat", "continuation": " sat"}        log-likelihood of the continuation
  {"context_ids": [5, 9], "continuation_ids": [12]}      the same on token ids
  {"text": "A whole document."}                          log-likelihood of the whole text (rolling)
  {"text_ids": [5, 9, 12]}                               the same on token ids

(lm-evaluation-harness' `loglikelihood` and `loglikelihood_rolling` requests). Other fields of a
line are kept and written back with its scores. Text is tokenized as the harness does
(`TemplateLM._encode_pair`): the context's trailing whitespace moves to the front of the
continuation, context + continuation are encoded together (after a BOS token where the tokenizer
starts every text with one, `bos_first`, as transformers' tokenizer does by default), and the
continuation's tokens are those after the context's own encoding; an empty context is the tokenizer's BOS (else EOS)
token, unless the continuation starts with that token. A pair longer than the model's window
keeps its last MAX_SEQ_LEN + 1 tokens (the context loses its start; the record says how many).
A text is scored in windows of MAX_SEQ_LEN predictions, each but the first with a full window of
the tokens before it as context, after a BOS (else EOS) token (the harness' rolling windows).

Light on purpose (no JAX): the file is checked before the backend starts.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from paxcli import files
from paxcli.errors import UserError, shorten

MAX_REQUESTS_FILE_BYTES = 1 << 30  # requests are held in memory; a bigger file is a mistake
TEXT_FIELDS = {'pair': ('context', 'continuation'), 'rolling': ('text',)}
ID_FIELDS = {'pair': ('context_ids', 'continuation_ids'), 'rolling': ('text_ids',)}
FORMS = ('"context" and "continuation" (text), "context_ids" and "continuation_ids" (token ids), "text" or '
         '"text_ids" (a whole text, scored in rolling windows)')


@dataclasses.dataclass
class Request:
  """One line of the requests file: its number (from 1), its object, and which form it has."""
  line: int
  fields: dict
  kind: str        # 'pair' (context, continuation) or 'rolling' (a whole text)
  as_ids: bool     # the *_ids form


@dataclasses.dataclass
class Pair:
  """Tokens to score: the model reads tokens[:-1] and predicts tokens[1:]; the last `scored` count."""
  request: int     # index of its Request
  tokens: list
  scored: int
  dropped: int = 0  # context tokens cut from the start to fit the window


def read_requests(path: str) -> list[Request]:
  """The requests of a JSONL file, each checked for one of the forms; UserError naming file and line."""
  text = files.read_text(path, 'the requests file', MAX_REQUESTS_FILE_BYTES)
  requests = []
  for n, line in enumerate(text.splitlines(), 1):
    if line.strip():
      requests.append(_request(path, n, line))
  if not requests:
    raise UserError(f'The requests file {path} is empty: write one JSON object per line with {FORMS}.')
  return requests


def _request(path: str, n: int, line: str) -> Request:
  where = f'{path} line {n}'
  obj = files.parse_json(line, where)   # bounded: depth, digits; NaN and Infinity are not JSON
  if not isinstance(obj, dict):
    raise UserError(f'{where}: expected a JSON object with {FORMS}; got {shorten(repr(line), 80)}')
  forms = [(kind, as_ids) for as_ids, table in ((False, TEXT_FIELDS), (True, ID_FIELDS))
           for kind, names in table.items() if any(k in obj for k in names)]
  if len(forms) != 1:
    found = 'none of them' if not forms else 'fields of several forms'
    raise UserError(f'{where}: a request has {FORMS}; this line has {found}.')
  kind, as_ids = forms[0]
  for name in (ID_FIELDS if as_ids else TEXT_FIELDS)[kind]:
    _check_field(where, obj, name, as_ids)
  last = (ID_FIELDS if as_ids else TEXT_FIELDS)[kind][-1]
  if not obj[last]:
    raise UserError(f'{where}: "{last}" is empty; there is nothing to score.')
  return Request(n, obj, kind, as_ids)


def _check_field(where: str, obj: dict, name: str, as_ids: bool) -> None:
  if name not in obj:
    raise UserError(f'{where}: "{name}" is missing.')
  value = obj[name]
  if as_ids:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
      raise UserError(f'{where}: "{name}" must be a list of integers.')
  elif not isinstance(value, str):
    raise UserError(f'{where}: "{name}" must be a string.')
  else:
    files.check_unicode(value, f'{where}: "{name}"')


def to_pairs(requests: Sequence[Request], tokenizer, vocab_size: int, window: int, path: str) -> list[Pair]:
  """Every request as token pairs (a rolling text gives one per window), in request order."""
  prefix = _prefix_id(tokenizer)
  pairs = []
  for index, req in enumerate(requests):
    where = f'{path} line {req.line}'
    if req.kind == 'pair':
      context, continuation = _pair_ids(req, tokenizer, prefix, where)
      _check_ids(context + continuation, vocab_size, where)
      pairs.append(_fit(index, context, continuation, window, where))
    else:
      ids = list(req.fields['text_ids']) if req.as_ids else _encode(tokenizer, req.fields['text'], where)
      _check_ids(ids, vocab_size, where)
      if prefix is None:
        raise UserError(f'{where}: a whole text is scored after a BOS or EOS token, and this model has no '
                        'tokenizer that names one; give "context_ids" and "continuation_ids" instead.')
      pairs += [Pair(index, ctx + cont, len(cont)) for ctx, cont in rolling_windows(ids, prefix, window)]
  return pairs


def _pair_ids(req: Request, tokenizer, prefix: Optional[int], where: str) -> tuple[list, list]:
  """(context ids, continuation ids) of a pair request, as the harness splits them."""
  if req.as_ids:
    context, continuation = list(req.fields['context_ids']), list(req.fields['continuation_ids'])
  else:
    context, continuation = encode_pair(tokenizer, req.fields['context'], req.fields['continuation'], where)
  if context:
    return context, continuation
  if prefix is None:
    raise UserError(f'{where}: the context is empty, and this model has no tokenizer with a BOS or EOS token to '
                    'condition on; give a context.')
  if continuation[0] == prefix:  # the harness: the continuation's own first token is the context then
    if len(continuation) == 1:
      raise UserError(f'{where}: the continuation is only the BOS/EOS token {prefix}; nothing is left to score.')
    return continuation[:1], continuation[1:]
  return [prefix], continuation


def encode_pair(tokenizer, context: str, continuation: str, where: str) -> tuple[list, list]:
  """lm-evaluation-harness' split: trailing whitespace of the context goes to the continuation; the
  whole text is encoded once and the continuation's ids are those after the context's encoding."""
  spaces = len(context) - len(context.rstrip())
  if spaces:
    context, continuation = context[:-spaces], context[-spaces:] + continuation
  if not context:  # the harness encodes a lone continuation without special tokens; the caller adds BOS/EOS
    return [], _encode(tokenizer, continuation, where)
  whole, head = _encode(tokenizer, context + continuation, where), _encode(tokenizer, context, where)
  if len(whole) <= len(head):
    raise UserError(f'{where}: the continuation {shorten(repr(continuation), 60)} adds no tokens after the context '
                    '(the tokenizer merged it into the context\'s last token); there is nothing to score.')
  bos = [tokenizer.bos_id] if tokenizer.bos_first else []  # a text starts with BOS as the model was trained
  return bos + head, whole[len(head):]


def _fit(index: int, context: list, continuation: list, window: int, where: str) -> Pair:
  """The pair cut to the model's window: at most window + 1 tokens, the context losing its start."""
  if len(continuation) > window:
    raise UserError(f'{where}: the continuation has {len(continuation)} tokens, more than the model reads at once '
                    f'(MAX_SEQ_LEN {window}); score it as a "text" (rolling windows) instead.')
  tokens = context + continuation
  dropped = max(0, len(tokens) - (window + 1))
  return Pair(index, tokens[dropped:], len(continuation), dropped)


def rolling_windows(ids: Sequence[int], prefix: int, window: int) -> list[tuple[list, list]]:
  """(context, continuation) pairs predicting every token of `ids` once, after `prefix`.

  The first window predicts the first `window` tokens from the prefix; each later one predicts the
  next `window` (fewer at the end) with as many earlier tokens as context as fill the window.
  """
  seq = [prefix] + list(ids)  # seq[i + 1] is ids[i]
  pairs = []
  start = 0
  while start < len(ids):
    end = min(len(ids), start + window)
    pairs.append((seq[max(0, end - window):start + 1], seq[start + 1:end + 1]))
    start = end
  return pairs


def _prefix_id(tokenizer) -> Optional[int]:
  """The token an empty context or a text starts from: BOS, else EOS (the harness' prefix_token_id)."""
  if tokenizer is None:
    return None
  return tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id


def _encode(tokenizer, text: str, where: str) -> list:
  if tokenizer is None:
    raise UserError(f'{where}: this model has no tokenizer (it was trained on ids, e.g. the synthetic input), so '
                    'it cannot score text; give "context_ids" and "continuation_ids" or "text_ids".')
  return tokenizer.encode(text)


def _check_ids(ids: Sequence[int], vocab_size: int, where: str) -> None:
  bad = [i for i in ids if not 0 <= i < vocab_size]
  if bad:
    raise UserError(f'{where}: id {bad[0]} is outside the vocabulary (0 to {vocab_size - 1}).')
