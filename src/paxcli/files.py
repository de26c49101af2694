"""Reading the user's files safely: regular files only, with a size bound.

`open()` on a FIFO blocks until a writer comes, and `/dev/zero` never ends: a path the
user gives is checked with `os.stat` first (which neither blocks nor reads).
"""

from __future__ import annotations

import json
import os
import stat
import tempfile

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


def member(directory: str, name: str, what: str = 'file') -> str:
  """The resolved path of `name`, a file of the model or checkpoint directory `directory`.

  The files of a directory someone gives you stay in it: an absolute name, a name that climbs
  out (`../x`) or a symlink that resolves outside the directory (`tokenizer.model ->
  /etc/shadow`) is a UserError. A symlink to another file inside the directory is fine. The
  path returned may not exist (the caller checks); it is the resolved one, so that what is
  opened is what was checked.
  """
  base = os.path.realpath(directory)
  shown = shorten(name, 200)
  if not name or os.path.isabs(name) or '\0' in name:
    raise UserError(f'{shorten(directory, 200)}: {what} {shown!r} is not a file name inside the directory.')
  path = os.path.realpath(os.path.join(base, name))
  if os.path.commonpath([base, path]) != base or path == base:
    link = ' (a symlink)' if os.path.islink(os.path.join(base, name)) else ''
    raise UserError(f'{shorten(directory, 200)}: {what} {shown!r}{link} resolves to {shorten(path, 200)}, outside '
                    'the directory; paxcli reads only files inside it.')
  return path


def copy_member(path: str, dest: str) -> None:
  """Copies a regular file (a member, already resolved) to `dest`, atomically, never more open
  than the source (no execute bits, no group/other bits the source lacks)."""
  st = os.stat(path)
  if not stat.S_ISREG(st.st_mode):
    raise UserError(f'{shorten(path, 200)} is not a regular file; not copied.')
  import shutil
  tmp = f'{dest}.tmp-{os.getpid()}'
  shutil.copyfile(path, tmp)
  os.chmod(tmp, stat.S_IMODE(st.st_mode) & 0o644)
  os.replace(tmp, dest)


def probe_writable(directory: str) -> None:
  """Makes `directory` (if missing) and writes and removes a small file in it; OSError when it cannot."""
  os.makedirs(directory, exist_ok=True)
  probe = os.path.join(directory, f'.pax-write-test-{os.getpid()}')
  with open(probe, 'w') as f:
    f.write('ok')
  os.remove(probe)


def atomic_write(path: str, data: bytes) -> None:
  """Writes `data` through a temporary file in `path`'s directory (made if missing), then renames
  it onto `path`: a reader, or a process writing the same file beside this one, never sees half of it."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix='.tmp-')
  with os.fdopen(fd, 'wb') as f:
    f.write(data)
  os.replace(tmp, path)


# Deeper JSON than this is no configuration, manifest or record paxcli writes or reads; a walk of a
# value that deep (checking, printing, converting) would meet Python's recursion limit.
MAX_JSON_DEPTH = 64
# No count, size, id or seed paxcli reads needs more digits than this (2**64 has 20).
MAX_JSON_DIGITS = 40


def parse_json(text: str | bytes, what: str, max_depth: int = MAX_JSON_DEPTH):
  """The value of JSON text someone gave us, or UserError naming `what` (a file, a file:line).

  Bounded and strict where Python's json is not: nesting deeper than `max_depth` (json itself
  recurses until RecursionError), integers of more than MAX_JSON_DIGITS digits, NaN and Infinity (not JSON; json accepts them)
  and numbers that overflow to infinity are refused in one line, never a traceback.
  """
  def no_constant(name):
    raise ValueError(f'{name} is not a JSON number')

  def finite_float(literal):
    value = float(literal)
    if value in (float('inf'), float('-inf')):
      raise ValueError(f'the number {shorten(literal, 40)} is too large')
    return value

  def short_int(literal):
    if len(literal) > MAX_JSON_DIGITS:
      raise ValueError(f'an integer of {len(literal):,} digits; paxcli reads at most {MAX_JSON_DIGITS}')
    return int(literal)

  try:
    value = json.loads(text, parse_constant=no_constant, parse_float=finite_float, parse_int=short_int)
  except json.JSONDecodeError as e:
    raise UserError(f'{what}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}).') from None
  except RecursionError:
    raise UserError(f'{what}: JSON nested too deeply; paxcli reads at most {max_depth} levels.') from None
  except ValueError as e:
    raise UserError(f'{what}: {shorten(e, 200)}.') from None
  if _json_depth_over(value, max_depth):
    raise UserError(f'{what}: JSON nested deeper than {max_depth} levels; paxcli reads at most that.')
  return value


def _json_depth_over(value, max_depth: int) -> bool:
  stack = [(value, 1)]
  while stack:
    node, depth = stack.pop()
    if isinstance(node, (dict, list)):
      if depth > max_depth:
        return True
      stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
  return False


def read_json(path: str, what: str, max_bytes: int, max_depth: int = MAX_JSON_DEPTH):
  """The JSON value of a regular file of at most `max_bytes` bytes (see parse_json), or UserError."""
  return parse_json(read_text(path, what, max_bytes), f'{what} {shorten(path, 200)}', max_depth)
