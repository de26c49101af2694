"""Reading the user's files safely: regular files only, with a size bound.

`open()` on a FIFO blocks until a writer comes, and `/dev/zero` never ends: a path the
user gives is checked with `os.stat` first (which neither blocks nor reads).
"""

from __future__ import annotations

import os
import stat

from paxcli.errors import UserError, shorten

_KINDS = ((stat.S_ISDIR, 'a directory'), (stat.S_ISFIFO, 'a FIFO (named pipe)'),
          (stat.S_ISCHR, 'a character device'), (stat.S_ISBLK, 'a block device'),
          (stat.S_ISSOCK, 'a socket'))


def check_regular_file(path: str, what: str, max_bytes: int | None = None) -> int:
  """Returns the size of `path`, or raises UserError: missing, not a regular file, too big."""
  shown = shorten(path, 200)
  try:
    st = os.stat(path)
  except FileNotFoundError:
    raise UserError(f'Cannot read {what} {shown}: no such file.') from None
  except OSError as e:
    raise UserError(f'Cannot read {what} {shown}: {e.strerror}.') from None
  if not stat.S_ISREG(st.st_mode):
    kind = next((name for test, name in _KINDS if test(st.st_mode)), 'not a regular file')
    raise UserError(f'{what} {shown} is {kind}, not a regular file.')
  if max_bytes is not None and st.st_size > max_bytes:
    raise UserError(f'{what} {shown} is {st.st_size:,} bytes; paxcli reads at most {max_bytes:,} bytes '
                    'of such a file. Is it the right file?')
  return st.st_size


def read_text(path: str, what: str, max_bytes: int) -> str:
  """The UTF-8 text of a regular file of at most `max_bytes` bytes, or UserError."""
  check_regular_file(path, what, max_bytes)
  try:
    with open(path, 'rb') as f:
      data = f.read(max_bytes + 1)  # bounded even if the file grows after the check
  except OSError as e:
    raise UserError(f'Cannot read {what} {shorten(path, 200)}: {e.strerror}.') from None
  if len(data) > max_bytes:
    raise UserError(f'{what} {shorten(path, 200)} is over {max_bytes:,} bytes; paxcli reads at most that.')
  try:
    return data.decode('utf-8')
  except UnicodeDecodeError as e:
    raise UserError(f'Cannot read {what} {shorten(path, 200)}: not UTF-8 text (byte {e.start}).') from None
