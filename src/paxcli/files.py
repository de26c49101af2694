"""Reading the user's files safely: regular files only, with a size bound.

`open()` on a FIFO blocks until a writer comes, and `/dev/zero` never ends: a path the
user gives is checked with `os.stat` first (which neither blocks nor reads).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import re
import stat
import sys
import tempfile
from typing import Optional, Sequence

from paxcli.errors import UserError, shorten

_KINDS = ((stat.S_ISDIR, 'a directory'), (stat.S_ISFIFO, 'a FIFO (named pipe)'),
          (stat.S_ISCHR, 'a character device'), (stat.S_ISBLK, 'a block device'),
          (stat.S_ISSOCK, 'a socket'))


_URL_LIKE = re.compile(r'^(?:[A-Za-z][A-Za-z0-9+.-]*:|gs//)', re.IGNORECASE)


def path_knob(value: str) -> str:
  """A path knob's value as a config holds it (INIT_FROM, LOCAL_CHECKPOINT_DIR...): a local path made
  absolute (`~` expanded); a URL, or what may be one misspelt (`gs:/bucket/x`, `gs//bucket/x`), as written,
  for the job directory's storage to read or refuse in one line (never a local `gs:` directory)."""
  return value if _URL_LIKE.match(value) else os.path.abspath(os.path.expanduser(value))


def kind_of(mode: int) -> str:
  """'a directory', 'a FIFO (named pipe)', ... for an os.stat st_mode; 'a regular file' for one."""
  if stat.S_ISREG(mode):
    return 'a regular file'
  return next((name for test, name in _KINDS if test(mode)), 'not a regular file')


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
    raise UserError(f'{what} {shown} is {kind_of(st.st_mode)}, not a regular file.')
  if max_bytes is not None and st.st_size > max_bytes:
    raise UserError(f'{what} {shown} is {st.st_size:,} bytes; paxcli reads at most {max_bytes:,} bytes '
                    'of such a file. Is it the right file?')
  return st.st_size


def open_regular(path: str, what: str = 'file'):
  """`path` opened for reading in binary when it is a regular file (FileNotFoundError when missing; a
  UserError for a FIFO, a device, a directory): opened without waiting (a FIFO would wait for a writer
  forever), then checked on the descriptor, so that what is read is what was checked."""
  fd = os.open(path, os.O_RDONLY | getattr(os, 'O_NONBLOCK', 0) | getattr(os, 'O_CLOEXEC', 0))
  try:
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
      raise UserError(f'{what} {shorten(path, 200)} is {kind_of(mode)}, not a regular file.')
  except BaseException:
    os.close(fd)
    raise
  return os.fdopen(fd, 'rb')


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


def bounded_lines(f, max_bytes: int):
  """The lines of a binary file object, each with its newline (the last may lack one), read at most
  `max_bytes` + 1 bytes at a time: a longer line is yielded as None, read past in bounded pieces and
  never held whole (a file someone else wrote may hold one line of gigabytes)."""
  while True:
    line = f.readline(max_bytes + 1)
    if not line:
      return
    if len(line) <= max_bytes:
      yield line
      continue
    if not line.endswith(b'\n'):
      del line
      rest_of_line(f)
    yield None


def rest_of_line(f) -> None:
  """Reads past the end of the current line of a binary file object, a bounded piece at a time."""
  while True:
    part = f.readline(1 << 20)
    if not part or part.endswith(b'\n'):
      return


def member(directory: str, name: str, what: str = 'file') -> str:
  """The resolved path of `name`, a file of the model or checkpoint directory `directory`.

  The files of a directory someone gives you stay in it: an absolute name, a name that climbs
  out (`../x`) or a symlink that resolves outside the directory (`tokenizer.model ->
  /etc/shadow`) is a UserError. A symlink to another file inside the directory is fine, and so is a
  link of a Hugging Face cache snapshot into its repository's blobs/ (huggingface_hub's layout). The
  path returned may not exist (the caller checks); it is the resolved one, so that what is
  opened is what was checked (in a Hub snapshot, the link's own path: its blob's name says nothing).
  """
  base = os.path.realpath(directory)
  shown = shorten(name, 200)
  if not name or os.path.isabs(name) or '\0' in name:
    raise UserError(f'{shorten(directory, 200)}: {what} {shown!r} is not a file name inside the directory.')
  path = os.path.realpath(os.path.join(base, name))
  hub = _hub_repository(base)   # a Hub cache snapshot's files link into its repository's blobs/
  inside, named = hub or base, os.path.normpath(os.path.join(base, name))
  if os.path.commonpath([inside, path]) != inside or path == base or os.path.commonpath([base, named]) != base:
    raise UserError(f'{shorten(directory, 200)}: {what} {shown!r}{_link_in(base, name)} resolves to '
                    f'{shorten(path, 200)}, outside the directory; paxcli reads and writes only files inside it.')
  return named if hub else path   # a blob's name says nothing (tokenizer.json's kind, what lies beside it)


def _hub_repository(directory: str) -> Optional[str]:
  """The repository's directory of the Hugging Face cache (`.../models--Org--name`) when `directory` is one
  of its snapshots (`snapshots/<commit>`) or inside one: huggingface_hub writes a snapshot's files as links
  into the repository's `blobs/`. Else None."""
  at = directory
  while os.path.dirname(at) != at:
    parent = os.path.dirname(at)
    root = os.path.dirname(parent)
    if os.path.basename(parent) == 'snapshots' and os.path.basename(root).startswith(('models--', 'datasets--')):
      return root
    at = parent
  return None


def _link_in(base: str, name: str) -> str:
  """' (a symlink)' when `name` itself is one, ' (through the symlink a/b)' when a directory on its way is."""
  parts = os.path.normpath(name).split(os.sep)
  for i in range(len(parts), 0, -1):
    if os.path.islink(os.path.join(base, *parts[:i])):
      return ' (a symlink)' if i == len(parts) else f" (through the symlink {shorten(os.path.join(*parts[:i]), 120)!r})"
  return ''


def check_tree(directory: str, root: str, what: str) -> None:
  """UserError when a symlink under `directory` resolves outside `root` (which holds it): for a tree a
  library reads by itself (orbax reads a checkpoint's files), the member check of every file in it."""
  base = os.path.realpath(root)
  for parent, dirs, names in os.walk(os.path.realpath(directory)):  # links to directories are not entered
    for name in dirs + names:
      path = os.path.join(parent, name)
      if os.path.islink(path):
        member(base, os.path.relpath(path, base), what)


def copy_member(path: str, dest: str) -> None:
  """Copies a regular file (a member, already resolved) to `dest`, atomically, never more open
  than the source (no execute bits, no group/other bits the source lacks)."""
  st = os.stat(path)
  if not stat.S_ISREG(st.st_mode):
    raise UserError(f'{shorten(path, 200)} is not a regular file; not copied.')
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


def atomic_write(path: str, data: bytes, mode: Optional[int] = None) -> None:
  """Writes `data` through a temporary file in `path`'s directory (made if missing), then renames
  it onto `path`: a reader, or a process writing the same file beside this one, never sees half of it.
  `mode`: the file's permission bits (default the temporary file's, 0o600)."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix='.tmp-')
  try:
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
    if mode is not None:
      os.chmod(tmp, mode)
    os.replace(tmp, path)
  except BaseException:  # a full disk, an interrupt: no half-written temporary file is left
    if os.path.lexists(tmp):
      os.remove(tmp)
    raise


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
  except json.JSONDecodeError as e:  # one line of a JSONL file is named by `what`: its column is enough
    one_line = (b'\n' if isinstance(text, bytes) else '\n') not in text.rstrip()
    at = f'column {e.colno}' if one_line else f'line {e.lineno}, column {e.colno}'
    raise UserError(f'{what}: not valid JSON ({at}: {e.msg}).') from None
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


def check_unicode(text: str, what: str) -> str:
  """`text` if it is Unicode a tokenizer can take, else UserError naming `what`: a lone surrogate
  (JSON's "\\ud800" escape, or bytes that were not UTF-8 on a command line) encodes to no UTF-8."""
  try:
    text.encode('utf-8')
  except UnicodeEncodeError as e:
    raise UserError(f'{what} holds a lone surrogate {text[e.start]!r} at character {e.start}, which is no '
                    'Unicode text (a "\\ud800"-style escape with no pair); write the character itself.') from None
  return text


def read_json(path: str, what: str, max_bytes: int, max_depth: int = MAX_JSON_DEPTH):
  """The JSON value of a regular file of at most `max_bytes` bytes (see parse_json), or UserError."""
  return parse_json(read_text(path, what, max_bytes), f'{what} {shorten(path, 200)}', max_depth)


# ---- outputs ------------------------------------------------------------------------------------
# Every file a command writes at a path the user gives goes through output_path, check_output and
# write_output: a new path or a regular file is written through a temporary file renamed onto it (a
# reader never sees half of it, a failure leaves nothing); a FIFO, a character device (/dev/null) or
# a descriptor name (/dev/stdout) is written into, never renamed over; anything else is refused.

# Names of this process's own descriptors: /dev/stdout resolves to /proc/<pid>/fd/pipe:[...] (no path
# at all) when stdout is a pipe, and to the file itself when it is redirected to one.
_DESCRIPTOR = re.compile(r'/dev/(?P<std>stdout|stderr)|/dev/fd/(?P<fd>\d+)|/proc/(?P<pid>self|thread-self|\d+)/fd/'
                         r'(?P<pfd>\d+)')


def output_path(path: str) -> str:
  """`path` as a command writes it: absolute with symlinks resolved (as every path a command is given),
  except a FIFO, a character device or a descriptor name, kept as given: it is written into."""
  full = os.path.abspath(path)
  if _DESCRIPTOR.fullmatch(full) or _stream_kind(full):
    return full
  return os.path.realpath(full)


def _stream_kind(path: str) -> Optional[str]:
  """'a FIFO (named pipe)' or 'a character device' for what is written into rather than replaced, else None."""
  try:
    mode = os.stat(path).st_mode
  except OSError:
    return None
  return kind_of(mode) if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) else None


def is_stream(path: str) -> bool:
  """True when writing `path` means writing into it: a FIFO, a character device, /dev/stdout and the like."""
  return bool(_DESCRIPTOR.fullmatch(os.path.abspath(path)) or _stream_kind(path))


def check_output(path: str, what: str, *, force: bool = False, inputs: Sequence[str] = (),
                 streams: bool = True) -> None:
  """UserError now, before any work, when `path` is no place to write `what` (e.g. '--output'):

  a directory, a block device or a socket; an existing regular file without `force` (a user's file is
  never replaced unasked); the same file as one of `inputs` (compared with symlinks resolved, and by
  inode); a new path whose nearest existing directory is not writable. A FIFO, a character device or
  /dev/stdout is written into (refused with `streams=False`, where the file is read back).
  """
  shown = shorten(path, 200)
  if is_stream(path):
    if not streams:
      kind = _stream_kind(path) or 'a file descriptor'
      raise UserError(f'{what} {shown} is {kind}; this output is read back later, so it must be a regular file.')
    return
  _check_not_input(path, what, inputs)
  try:
    st = os.stat(path)
  except (FileNotFoundError, NotADirectoryError):  # a new path (a file on its way is found below)
    st = None
  except OSError as e:
    raise UserError(f'Cannot write {what} {shown}: {e.strerror}.') from None
  if st is not None:
    if not stat.S_ISREG(st.st_mode):
      hint = '; give a file name' if stat.S_ISDIR(st.st_mode) else ''
      raise UserError(f'{what} {shown} is {kind_of(st.st_mode)}{hint}. paxcli writes regular files (or into a '
                      'FIFO or a character device such as /dev/null), nothing else.')
    if not force:
      raise UserError(f'{what} {shown} exists; pass --force to replace it, or give another path.')
  _check_directory_writable(path, what)


def _check_not_input(path: str, what: str, inputs: Sequence[str]) -> None:
  out = os.path.realpath(path)
  try:
    out_id = os.stat(out)
  except OSError:
    out_id = None
  for source in inputs:
    if not source or is_stream(source):
      continue
    same = os.path.realpath(source) == out
    if not same and out_id is not None:
      try:
        same = os.path.samestat(out_id, os.stat(source))
      except OSError:
        pass
    if same:
      raise UserError(f'{what} {shorten(path, 200)} is the input {shorten(source, 200)} (compared with symlinks '
                      'resolved); an input is never overwritten. Give another path.')


def _check_directory_writable(path: str, what: str) -> None:
  """The nearest existing ancestor of `path` is a directory this process can create files in."""
  probe = os.path.dirname(os.path.abspath(path))
  while not os.path.lexists(probe):  # the directories in between are made when the file is written
    probe = os.path.dirname(probe)
  if not os.path.isdir(probe):
    raise UserError(f'Cannot write {what} {shorten(path, 200)}: {probe} is not a directory.')
  try:
    with tempfile.TemporaryFile(dir=probe):
      pass
  except OSError as e:
    raise UserError(f'Cannot write {what} {shorten(path, 200)}: {probe} is not writable ({e.strerror}).') from None


def write_output(path: str, data: bytes | str, what: str) -> None:
  """Writes `data` to `path` as check_output allows: into a FIFO, a character device or one of this
  process's descriptors; else through a temporary file renamed onto `path` (its directories made),
  which a failure removes. UserError on an OSError (a full disk, /dev/full)."""
  if isinstance(data, str):
    data = data.encode('utf-8')
  try:
    if is_stream(path):
      _write_into(path, data)
    else:  # a replaced file keeps its permissions; a new one is readable by others, as open() would make it
      mode = stat.S_IMODE(os.stat(path).st_mode) if os.path.isfile(path) else 0o644
      atomic_write(path, data, mode)
  except OSError as e:
    raise UserError(f'Cannot write {what} {shorten(path, 200)}: {e.strerror}.') from None


def _write_into(path: str, data: bytes) -> None:
  """Writes through this process's own descriptor when `path` names one (/dev/stdout: the bytes land
  where stdout goes, after what was printed), else opens `path` for writing, never creating it."""
  fd = _own_descriptor(path)
  if fd is not None:
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except (AttributeError, OSError, ValueError):
        pass
    _write_all(fd, data)
    return
  fd = os.open(path, os.O_WRONLY | os.O_APPEND | getattr(os, 'O_CLOEXEC', 0))
  try:
    _write_all(fd, data)
  finally:
    os.close(fd)


def _own_descriptor(path: str) -> Optional[int]:
  """The descriptor of this process that `path` names (/dev/stdout: 1), or None (another process's)."""
  m = _DESCRIPTOR.fullmatch(os.path.abspath(path))
  if not m or m['pid'] not in (None, 'self', 'thread-self', str(os.getpid())):
    return None
  fd = {'stdout': 1, 'stderr': 2}[m['std']] if m['std'] else int(m['fd'] or m['pfd'])
  try:
    os.fstat(fd)
  except OSError:
    return None
  return fd


def _write_all(fd: int, data: bytes) -> None:
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view):]


@contextlib.contextmanager
def held_stderr():
  """File descriptor 2 sent to a temporary file for the block (what C++ libraries log there, which no
  Python setting reaches); yields a function returning its text, for the caller to show if it matters."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile(mode='w+b') as tmp:
    os.dup2(tmp.fileno(), 2)
    try:
      yield lambda: (tmp.seek(0), tmp.read().decode('utf-8', 'replace'))[1]
    finally:
      os.dup2(saved, 2)
      os.close(saved)
