"""Errors that are the user's to fix: the CLI prints them as one clear message, no traceback."""

from __future__ import annotations

import difflib
import re
from typing import Iterable


class UserError(Exception):
  """A mistake in the user's input (experiment name, override, mesh, file).

  The CLI catches it, prints the message in red and exits non-zero.
  """

  exit_code = 2


def did_you_mean(name: str, candidates: Iterable[str], n: int = 3) -> str:
  """Returns ' Did you mean X or Y?' for the closest candidates, or ''."""
  candidates = list(candidates)
  if len(name) > 200:  # nothing that long is a typo of a name; difflib would take seconds
    return ''
  close = difflib.get_close_matches(name, candidates, n=n, cutoff=0.6)
  if not close:
    lowered = {c.lower(): c for c in candidates}
    close = [lowered[c] for c in difflib.get_close_matches(name.lower(), list(lowered), n=n, cutoff=0.5)]
  if not close:
    return ''
  return ' Did you mean ' + ' or '.join(repr(c) for c in close) + '?'


def shorten(text: object, limit: int = 120) -> str:
  """`text` as a string of at most about `limit` characters: long values are cut in the middle.

  For error messages that echo what the user typed: a 100 KB --set value must not fill the screen.
  """
  text = str(text)
  if len(text) <= limit:
    return text
  keep = max(limit // 2 - 10, 8)
  return f'{text[:keep]}...({len(text) - 2 * keep:,} more characters)...{text[-keep:]}'


def at_least(low, prefix: str, obj, *fields: str) -> None:
  for field in fields:
    value = getattr(obj, field)
    if value < low:
      hint = ' (0 turns it off)' if low == 0 and field == 'eval_interval_steps' else ''
      raise UserError(f'{prefix}.{field} must be at least {low}, got {value}{hint}.')


_CONTROL = re.compile(r'[\x00-\x1f\x7f-\x9f\u2028\u2029]')


def printable(text: object) -> str:
  """`text` with its control characters (line breaks too) written as escapes (`\\x1b`, `\\n`): text that came
  from a file or a record is printed as one line of text, never as terminal control sequences (colours,
  links, a cleared screen)."""
  return _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(text))
