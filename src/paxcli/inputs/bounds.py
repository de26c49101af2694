"""Bounds on what a received data file can make paxcli do, and the environment variables that raise them.

Each bound stops the command with one line naming the file (and line) that crossed it; a user
whose real data needs more raises it (docs/reference/limits.md lists them all):

  PAXCLI_MAX_LINE_BYTES      a line of a .txt or JSONL file (after gunzip), a block of text
                             lines (a .txt document) and a record of any format, in bytes
  PAXCLI_TEMPLATE_SECONDS    a chat template's rendering of one conversation (all its renders)
  PAXCLI_TEMPLATE_MAX_CHARS  the text one render of a chat template may produce
  PAXCLI_TEMPLATE_MEMORY_MB  the memory of the process that renders chat templates
"""

from __future__ import annotations

import os

from paxcli.errors import UserError, shorten

MAX_LINE_BYTES = 128 << 20
TEMPLATE_SECONDS = 10.0
TEMPLATE_MAX_CHARS = 16_000_000
TEMPLATE_MEMORY_MB = 1024


def positive_env(name: str, default, kind):
  """The value of environment variable `name` (a positive finite `kind`), `default` when unset; one line
  when it is no such number."""
  return _value(name, default, kind)


def _value(name: str, default, kind):
  text = os.environ.get(name)
  if text is None or not text.strip():
    return default
  try:
    value = kind(text)
  except ValueError:
    value = None
  if value is None or not value > 0 or value == float('inf'):
    raise UserError(f'{name}={shorten(text, 40)} must be a positive number (the default is {default}).')
  return value


def max_line_bytes() -> int:
  return _value('PAXCLI_MAX_LINE_BYTES', MAX_LINE_BYTES, int)


def template_seconds() -> float:
  return _value('PAXCLI_TEMPLATE_SECONDS', TEMPLATE_SECONDS, float)


def template_max_chars() -> int:
  return _value('PAXCLI_TEMPLATE_MAX_CHARS', TEMPLATE_MAX_CHARS, int)


def template_memory_mb() -> int:
  return _value('PAXCLI_TEMPLATE_MEMORY_MB', TEMPLATE_MEMORY_MB, int)
