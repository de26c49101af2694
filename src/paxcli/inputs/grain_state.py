"""The Grain input's saved state (paxcli.inputs.grain_input), checked before a resume uses it.

A checkpoint's `input/process_<i>-of-<n>.json` is a file a user can edit, copy or receive: a
stream's count set to -5, the state of 3 of 16 streams, a piece (10**12, 10**9), `[]`, a missing
key or a wrong type must stop the resume in one line naming the file and the field, never resume
on other documents. So each file is

  sealed     with the SHA-256 of its content (`checksum`, as the arrays beside it carry theirs in
             the checkpoint's meta): any edit that does not also forge it is refused;
  read       with files.read_json (size, depth and number bounds);
  checked    field by field against the experiment (its layout: streams, documents, seed, ...),
             against the other processes' files (every process once, every stream once) and
             against the prepared data (each piece is a piece of its document; each row fits).

State version 1 (before the seal) is still read, and checked the same way.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from typing import Any, Callable, Optional

from paxcli import files
from paxcli.errors import UserError, shorten

STATE_VERSION = 2  # 2: sealed with a checksum; 1: not (still read)
STREAMS = 'paxcli_streams'  # the key under which a worker's state holds its streams' states
CHECKSUM = 'checksum'
FILE = '_file'  # where read_states found a state (for messages); not part of the state
# A state is a count and a few dozen pieces per stream: kilobytes. This bounds a damaged one.
MAX_STATE_BYTES = 64 << 20
# No count in a state comes near this; a larger one is an edit, and would overflow int64 downstream.
MAX_INT = 1 << 62
_NAME = re.compile(r'^process_(\d+)-of-(\d+)\.json$')
# The layout fields every state holds: (name, type, lowest value).
_LAYOUT = (('num_streams', int, 1), ('num_docs', int, 1), ('seed', int, None), ('seq_len', int, 1),
           ('open_rows', int, 1), ('split', str, None), ('num_processes', int, 1), ('process', int, 0),
           ('workers', int, 0), ('batch_size', int, 1), ('batches', int, 0))


def seal(state: dict) -> bytes:
  """The JSON bytes of `state` with its checksum: what the checkpoint's input item holds."""
  return json.dumps({**state, CHECKSUM: checksum(state)}).encode()


def checksum(state: dict) -> str:
  body = {k: v for k, v in state.items() if k not in (CHECKSUM, FILE)}
  return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(',', ':')).encode()).hexdigest()


def read_states(directory: str) -> list[dict]:
  """The input states every process saved in a checkpoint's input item ([] when it has none), each
  a JSON object (its file's name kept under FILE for messages); `check` does the rest."""
  out = []
  for path in sorted(glob.glob(os.path.join(glob.escape(directory), 'process_*-of-*.json'))):
    files.member(directory, os.path.basename(path), 'input state')   # a link out of the checkpoint is refused
    state = files.read_json(path, 'input state', MAX_STATE_BYTES)
    if not isinstance(state, dict):
      raise UserError(f'input state {shorten(path, 200)}: a JSON object is needed, got a {type(state).__name__}; '
                      'the file was edited or damaged.')
    out.append({**state, FILE: path})
  return out


def where(state: Any, index: int) -> str:
  return shorten(state.get(FILE), 200) if isinstance(state, dict) and state.get(FILE) else f'input state {index}'


def check_files(saved: list, batches: Optional[int] = None) -> None:
  """Each saved state's own fields (version, checksum, types), and the states against one another:
  every process once, one count of batches (`batches`, the count the checkpoint's meta holds, when
  given). UserError naming the file and field otherwise."""
  if not saved:
    raise UserError('input state: the checkpoint\'s input item holds no process\'s state.')
  for i, state in enumerate(saved):
    _check_file(state, where(state, i))
  first = saved[0]
  count = first['num_processes']
  for i, state in enumerate(saved):
    if state['num_processes'] != count or state['batches'] != first['batches']:
      key = 'num_processes' if state['num_processes'] != count else 'batches'
      raise UserError(f'{where(state, i)}: {key} {state[key]} differs from {where(first, 0)}\'s {first[key]}; the '
                      'input states of one checkpoint were mixed or edited.')
  processes = sorted(state['process'] for state in saved)
  if processes != list(range(count)):
    raise UserError(f'{where(first, 0)}: the checkpoint holds the input state of process(es) {shorten(processes, 80)} '
                    f'of {count}: a process\'s file is missing, doubled or edited; cannot resume its input.')
  if batches is not None and first['batches'] != batches:
    raise UserError(f'{where(first, 0)}: batches {first["batches"]} differs from the {batches} its checkpoint\'s meta '
                    'says were consumed; the input state was edited or comes from another checkpoint.')


def check_streams(saved: list, mine: dict) -> dict[int, dict]:
  """Every stream's state in the saved states (checked by check_files, of `mine`'s layout), each
  stream exactly once and each of its fields in range: {stream: state}."""
  first = saved[0]
  count = first['num_processes']
  rows_out = first['batches'] * first['batch_size'] * count
  streams: dict[int, dict] = {}
  for i, state in enumerate(saved):
    for s, stream in _stream_dicts(state['grain'], where(state, i), mine['num_streams']):
      if s in streams:
        raise UserError(f'{where(state, i)}: stream {s} is saved twice; the input state was edited.')
      streams[s] = _check_stream(stream, s, mine, rows_out, f'{where(state, i)}: stream {s}')
  missing = sorted(set(range(mine['num_streams'])) - set(streams))
  if missing:
    raise UserError(f'{where(first, 0)}: the checkpoint holds the state of {len(streams)} of its {mine["num_streams"]} '
                    f'streams (missing: {shorten(missing, 60)}); a process\'s input file is missing or was edited.')
  return streams


def _check_file(state: Any, at: str) -> None:
  """One file's own fields: version, checksum, layout types."""
  if not isinstance(state, dict):
    raise UserError(f'{at}: an input state is a JSON object, got a {type(state).__name__}.')
  version = state.get('version')
  if version not in (1, STATE_VERSION) or isinstance(version, bool):
    raise UserError(f'{at}: input state version {shorten(repr(version), 40)}; this paxcli reads versions 1 and '
                    f'{STATE_VERSION}.')
  if version >= 2 and state.get(CHECKSUM) != checksum(state):
    raise UserError(f'{at}: the input state does not match its checksum: the file was edited or damaged. Resume from '
                    'another checkpoint (move this step aside), or start a new job directory.')
  for key, kind, low in _LAYOUT:
    _typed(state, key, kind, at, low)
  if state['process'] >= state['num_processes']:
    raise UserError(f'{at}: process {state["process"]} of {state["num_processes"]} processes.')
  if state.get('mixture') is not None and not isinstance(state.get('mixture'), list):
    raise UserError(f'{at}: mixture must be a list or null.')
  _typed(state, 'grain', dict, at)
  name = _NAME.match(os.path.basename(state.get(FILE) or ''))
  if name and (int(name.group(1)), int(name.group(2))) != (state['process'], state['num_processes']):
    raise UserError(f'{at}: the file of process {name.group(1)} of {name.group(2)} holds the state of process '
                    f'{state["process"]} of {state["num_processes"]}; the input states were renamed or mixed.')


def _typed(d: dict, key: str, kind: type, at: str, low: Optional[int] = None, name: Optional[str] = None):
  name = name or key
  if key not in d:
    raise UserError(f'{at}: no {name!r} field; the input state was edited or damaged.')
  value = d[key]
  if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
    raise UserError(f'{at}: {name} must be a {_KINDS[kind]}, got {shorten(repr(value), 60)}.')
  if kind is int and ((low is not None and value < low) or value > MAX_INT):
    raise UserError(f'{at}: {name} {shorten(value, 40)} is out of range'
                    f'{f" (at least {low})" if low is not None else ""}; the input state was edited.')
  return value


_KINDS = {int: 'whole number', str: 'string', dict: 'JSON object', list: 'list', bool: 'true or false'}


def _stream_dicts(state: Any, at: str, num_streams: int):
  """(stream, its state) of every stream found in a Grain state, however Grain nests its workers'."""
  if isinstance(state, dict):
    if STREAMS in state:
      streams = _typed(state, STREAMS, dict, at)
      for key, value in streams.items():
        if not key.isdigit() or int(key) >= num_streams:
          raise UserError(f'{at}: {STREAMS} names stream {shorten(repr(key), 40)}; this input has streams 0 to '
                          f'{num_streams - 1}.')
        yield int(key), value
    for key, value in state.items():
      if key != STREAMS:
        yield from _stream_dicts(value, at, num_streams)
  elif isinstance(state, list):
    for value in state:
      yield from _stream_dicts(value, at, num_streams)


def _check_stream(stream: Any, s: int, mine: dict, rows_out: int, at: str) -> dict:
  """A stream's count, rows and pieces: each piece (g, k) at a position this stream has read
  (g = s + S*j, j < next). A stream reads no more documents than it has put tokens into rows
  (a document gives at least one), so `next` is at most the rows it can have made times seq_len."""
  if not isinstance(stream, dict):
    raise UserError(f'{at}: a stream\'s state is a JSON object, got {shorten(repr(stream), 60)}.')
  num_streams = mine['num_streams']
  count = _typed(stream, 'next', int, at, 0)
  _typed(stream, 'flushed', bool, at)
  rows = [(key, k, _typed_row(row, f'{at} {key}[{k}]')) for key in ('open', 'ready')
          for k, row in enumerate(_typed(stream, key, list, at))]
  if len(stream['open']) > mine['open_rows']:
    raise UserError(f'{at}: {len(stream["open"])} open rows; the input packs at most {mine["open_rows"]} at once.')
  if count > (rows_out + len(rows)) * mine['seq_len']:
    raise UserError(f'{at}: next {count} is more documents than {rows_out} rows could hold; the input state was '
                    'edited.')
  for key, k, row in rows:
    for g, piece in row:
      if g % num_streams != s or not 0 <= g < s + num_streams * count or piece < 0 or piece > MAX_INT:
        raise UserError(f'{at} {key}[{k}]: the piece {shorten([g, piece], 60)} is not one this stream has read '
                        f'(positions {s}, {s + num_streams}, ... below {s + num_streams * count}); the input state '
                        'was edited.')
  return stream


def _typed_row(row: Any, at: str) -> list:
  if (not isinstance(row, list) or not row
      or not all(isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p) for p in row)):
    raise UserError(f'{at}: a row is a list of [position, piece] pairs of whole numbers, got {shorten(repr(row), 80)}.')
  return row


def check_pieces(streams: dict[int, dict], seq_len: int, pieces_of: Callable[[int], int], length: Callable) -> None:
  """Every piece names a piece of its document (k below the document's count of pieces), no piece is
  in two rows, and each row's pieces fit in it. pieces_of(g): the pieces of the document at g;
  length(g, k): the tokens of piece k."""
  seen = set()
  for s, stream in sorted(streams.items()):
    for key in ('open', 'ready'):
      for k, row in enumerate(stream[key]):
        used = 0
        for g, piece in row:
          at = f'stream {s} {key}[{k}]'
          if piece >= pieces_of(g):
            raise UserError(f'input state: {at}: piece {piece} of the document at position {g}, which has '
                            f'{pieces_of(g)} piece(s) of {seq_len} tokens; the input state was edited.')
          if (g, piece) in seen:
            raise UserError(f'input state: {at}: the piece {[g, piece]} is in two rows; the input state was edited.')
          seen.add((g, piece))
          used += length(g, piece)
        if used > seq_len:
          raise UserError(f'input state: {at}: its pieces hold {used} tokens, more than a row\'s {seq_len}; the '
                          'input state was edited.')


def merged(fresh: Any, saved: Any, expected: list[list[int]], workers: int, at: str) -> Any:
  """The Grain state to restore the very batches of an unchanged run: the state a fresh pipeline
  gives (`fresh`, Grain's own structure) with the checked values of `saved` in it: the streams'
  states and cursors, and which worker gives the next batch. Anything else that differs from the
  fresh state, and streams dealt otherwise than `expected` (each worker's streams, in order), is a
  UserError: Grain is never handed a value paxcli has not checked."""
  found: list[list[int]] = []

  def walk(f, s, path):
    if isinstance(f, dict):
      if not isinstance(s, dict) or set(s) != set(f):
        raise UserError(f'{at}: grain{path} is not the state this input saves; the input state was edited.')
      out = {}
      for key in f:
        if key == STREAMS:
          found.append(sorted(int(x) for x in s[key]))
          out[key] = s[key]
        elif key == 'cursor':  # the next stream to take a row from, modulo the worker's streams
          out[key] = _typed(s, key, int, at, 0, f'grain{path}.cursor')
        elif key == 'next_index_in_cycle':  # the next worker to take a batch from
          out[key] = _typed(s, key, int, at, 0, f'grain{path}.{key}')
          if out[key] >= max(1, workers):
            raise UserError(f'{at}: grain{path}.{key} {out[key]} names no worker of {workers}; the input state was '
                            'edited.')
        else:
          out[key] = walk(f[key], s[key], f'{path}.{key}')
      return out
    if isinstance(f, list):
      if not isinstance(s, list) or len(s) != len(f):
        raise UserError(f'{at}: grain{path} is not the state this input saves; the input state was edited.')
      return [walk(a, b, f'{path}[{i}]') for i, (a, b) in enumerate(zip(f, s))]
    if type(s) is not type(f) or s != f:
      raise UserError(f'{at}: grain{path} is {shorten(repr(s), 40)}, not {shorten(repr(f), 40)}; the input state '
                      'was edited.')
    return s

  out = walk(fresh, saved, '')
  if found != [sorted(e) for e in expected]:
    raise UserError(f'{at}: its workers hold streams {shorten(found, 80)}, not {shorten(expected, 80)}; the input '
                    'state was edited.')
  return out
