"""The text of what `pax serve` decodes: continuations as `pax decode` writes them, stop strings, token texts.

A continuation's text is the text its tokens add after the prompt (decoded with the prompt's last
CONTEXT tokens before them: a sentencepiece word's leading space depends on what comes before, see
paxcli.loops.decode.decoder.continuation_text), without an end-of-sequence token. While a choice
streams, text that may still change is held back: a last character that is not whole yet (a
multi-byte character split over tokens decodes to U+FFFD) and an ending that begins a stop string.
A stop string ends the choice at the first token whose text contains it (that token and those before
it are counted); the text stops before it, as OpenAI's API does.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

from paxcli.loops.decode.decoder import continuation_text

CONTEXT = 8   # prompt tokens decoded before a continuation's


class Continuation:
  """One choice's text as its tokens arrive: `add` returns what may be sent now."""

  def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = (), eos_ids: Sequence[int] = ()):
    self.tok, self.context, self.stop, self.eos = tokenizer, list(prompt_ids[-CONTEXT:]), tuple(stop), set(eos_ids)
    self.ids: list[int] = []
    self.text, self.sent = '', 0
    self.stopped = False     # a stop string ended it

  def add(self, ids: Sequence[int], final: bool) -> tuple[str, int]:
    """Takes new tokens; returns (the text to send now, how many of `ids` count: fewer when a stop string
    ends the choice before the last of them). `final`: no tokens follow (all the text is sent)."""
    kept = len(ids)
    if self.tok is None:
      self.ids += list(ids)
      return '', kept
    start = len(self.ids)
    self.ids += list(ids)
    text = self._text(self.ids)
    if self.stop and any(s in text for s in self.stop):
      for n in range(start + 1, len(self.ids) + 1):   # the first token whose text holds a stop string
        upto = self._text(self.ids[:n])
        cut = min((upto.find(s) for s in self.stop if s in upto), default=-1)
        if cut >= 0:
          kept, text, self.stopped = n - start, upto[:cut], True
          del self.ids[n:]
          break
    self.text = text
    ready = len(text) if final or self.stopped else self._ready(text)
    delta, self.sent = text[self.sent:ready], max(self.sent, ready)
    return delta, kept

  def _text(self, ids: list[int]) -> str:
    shown = ids[:-1] if ids and ids[-1] in self.eos else ids
    return continuation_text(self.tok, self.context, shown)

  def _ready(self, text: str) -> int:
    """How much of `text` cannot change with more tokens: not a partial character, not a stop string's start."""
    end = len(text)
    while end > self.sent and text[end - 1] == '\ufffd':
      end -= 1
    held = max((k for s in self.stop for k in range(1, min(len(s) - 1, end - self.sent) + 1)
                if text[end - k:end] == s[:k]), default=0)
    return max(end - held, self.sent)


class TokenTexts:
  """Each token's own text for logprobs (with its word-boundary space: decoded after the token before it)."""

  def __init__(self, tokenizer):
    self.tok = tokenizer
    self.text = functools.lru_cache(maxsize=1 << 16)(self._text)

  def _text(self, token: int, before: Optional[int]) -> str:
    if self.tok is None:
      return str(token)
    if before is None:
      return self.tok.decode([token])
    return continuation_text(self.tok, [before], [token])
