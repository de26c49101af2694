"""GrainLmInput: packed LM batches from a prepared directory (paxcli.inputs.prepared), read with
Grain, whose position is saved in every checkpoint and restored: a resume costs the same at
step 10 and at step 10^6, and may change the number of processes.

The order. Global position g (0, 1, 2, ...) names document perm_e(g mod N) of epoch e = g // N,
where perm_e is Grain's seeded index shuffle of the N documents (a new one each epoch): a global
shuffle. The positions are dealt to `num_streams` streams, position g to stream g mod S; each
stream reads its positions in order and packs them (paxcli.inputs.packing: segment ids,
positions, first fit over `open_rows` rows) into rows of its own. Process p of P owns streams
p, p+P, p+2P, ...; its Grain worker processes share them out again (worker w of W takes every
W-th), each worker takes rows from its streams in turn and batches them, and the process takes
batches from its workers in turn (Grain's mp_prefetch). Without workers, a thread prefetches.

A mixture ({directory: weight}) shuffles and repeats each directory with its own seed and
interleaves them by Grain's MapDataset.mix, which maps a position to (directory, document) by
arithmetic in proportion to the weights: the positions, streams and state above work unchanged.

Workers: each batch is copied out of the shared memory Grain hands it over in (_own_memory), and
each worker exits once its parent is gone (_exit_with_parent), so neither an exit nor a kill -9
leaves a block or a process behind.

Seen exactly once. A stream's state is the count of positions it has read, the pieces in its
open rows and in the rows it made but has not handed out yet, each piece named (g, k): piece k
of the document at g. Saved and restored, a stream goes on with the very next token it would
have given, so every token of every document at a position a stream has read is in exactly one
row handed out, or in a row still open, never in two. The state does not grow with the step:
a count and a few dozen pieces per stream.

Saved: each process writes its own small JSON item (`input/process_<i>-of-<n>.json`, through
Grain's orbax handler): Grain's iterator state, which is the state after the last batch the
loop took (Grain's prefetch records the state of each batch it hands out). Restored with the
same processes, workers and batch, it gives the very batches an uninterrupted run would. With
another count of processes or workers, the stream states are gathered from every process's
file and dealt out again: the streams go on exactly, only the order in which they fill the
batches changes. The number of streams cannot change (it decides which stream reads which
position); a resume that changes it, the data or the seed is refused in one line. Each file is
sealed with a checksum and every field of it is checked before use (paxcli.inputs.grain_state):
an edited or damaged state is refused naming the file and field, never resumed on other documents.

PAXCLI_INPUT_TRACE=FILE (a debugging aid, used by the tests): each batch taken appends one JSON
line to FILE with the process, the batch's index and, per row, the documents and offsets of its
tokens, so two runs can be compared batch by batch.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import os
import threading
import time
from typing import Any, Optional

import grain
from absl import flags
import numpy as np

from paxcli.errors import UserError, shorten
from paxcli.inputs import file_input, grain_state, packing, prepared, tokenizers
from paxcli.inputs.base import BaseInput, EndOfInput, decode_rows
from paxcli.inputs.grain_state import STATE_VERSION, STREAMS, read_states  # noqa: F401 - the train loop reads these

TRACE_ENV = 'PAXCLI_INPUT_TRACE'
_DOC, _OFFSET = '_doc', '_offset'  # per token: the global position of its document, its index in it


# ---- One stream ----------------------------------------------------------------------------------


class _Stream:
  """The positions s, s+S, s+2S, ... read in order and packed into rows (module docstring)."""

  def __init__(self, index: int, num_streams: int, docs, end: Optional[int], seq_len: int, open_rows: int,
               state: Optional[dict] = None):
    self.index, self._step, self._docs, self._end = index, num_streams, docs, end
    self._packer = packing.Packer(seq_len, open_rows)
    self._next, self._ready, self._flushed = 0, [], False
    if state:
      self._next, self._flushed = int(state['next']), bool(state.get('flushed'))
      self._packer.reopen(state['open'], self._piece)
      self._ready = [self._packer.rebuild(tags, self._piece) for tags in state['ready']]

  def next_row(self) -> Optional[packing.Row]:
    """The next row, or None once a finite stream has given all of its."""
    while not self._ready:
      g = self.index + self._step * self._next
      if self._end is not None and g >= self._end:
        if self._flushed:
          return None
        self._ready = self._packer.flush_rows()
        self._flushed = True
        continue
      self._next += 1
      example = self._example(g)
      if example is not None:
        self._ready.extend(self._packer.add_rows(example, g))
    return self._ready.pop(0)

  def state(self) -> dict:
    return {'next': self._next, 'open': [_plain(tags) for tags in self._packer.open_tags()],
            'ready': [_plain(row.tags) for row in self._ready], 'flushed': self._flushed}

  def _example(self, g: int) -> Optional[packing.Example]:
    return prepared.example(self._docs[g], f'document at position {g}')

  def _piece(self, tag) -> packing.Example:
    g, k = int(tag[0]), int(tag[1])
    seq_len = self._packer.seq_len
    return self._example(g).cut(k * seq_len, (k + 1) * seq_len)


def _plain(tags: list) -> list:
  return [[int(g), int(k)] for g, k in tags]


def row_arrays(row: packing.Row) -> dict:
  """The row's arrays and, per token, its document's position and its index in the document."""
  seg, seq_len = row.arrays['segment_ids'], len(row.arrays['ids'])
  docs = np.asarray([-1] + [g for g, _ in row.tags], np.int64)
  first = np.asarray([0] + [k * seq_len for _, k in row.tags], np.int64)
  out = dict(row.arrays)
  out[_DOC] = docs[seg]
  out[_OFFSET] = np.where(seg > 0, first[seg] + row.arrays['positions'], -1)
  return out


# ---- Streams as a Grain dataset --------------------------------------------------------------------


class _StreamsDataset(grain.IterDataset):
  """Batches of rows from some streams, one stream after another in turn. Grain's mp_prefetch gives each
  worker a slice of the streams (set_slice), so a worker's state is its streams' states."""

  def __init__(self, docs, end: Optional[int], streams: list[int], num_streams: int, seq_len: int,
               open_rows: int, states: dict[int, dict], batch_size: int):
    super().__init__()
    self.docs, self.end, self.streams, self.num_streams = docs, end, list(streams), num_streams
    self.batch_size = batch_size
    self.seq_len, self.open_rows, self.states = seq_len, open_rows, states

  def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
    del sequential_slice
    self.streams = self.streams[sl]

  def __iter__(self) -> '_StreamsIterator':
    return _StreamsIterator(self)

  def __str__(self) -> str:
    return f'paxcli streams {self.streams} of {self.num_streams}'


class _StreamsIterator(grain.DatasetIterator):

  def __init__(self, ds: _StreamsDataset):
    super().__init__()
    self._ds = ds
    self._open({s: ds.states.get(s) for s in ds.streams}, 0)

  def _open(self, states: dict, cursor: int) -> None:
    ds = self._ds
    self._streams = [_Stream(s, ds.num_streams, ds.docs, ds.end, ds.seq_len, ds.open_rows, states.get(s))
                     for s in ds.streams]
    self._cursor = cursor

  def __next__(self) -> dict:
    """The next batch of rows (a finite input's last one filled with zero rows: zero weight)."""
    rows = []
    while len(rows) < self._ds.batch_size:
      row = self._next_row()
      if row is None:
        break
      rows.append(row_arrays(row))
    if not rows:
      raise StopIteration
    return _stack(rows, self._ds.batch_size)

  def _next_row(self) -> Optional[packing.Row]:
    for _ in range(len(self._streams)):
      stream = self._streams[self._cursor % len(self._streams)]
      self._cursor += 1
      row = stream.next_row()
      if row is not None:
        return row
    return None

  def get_state(self) -> dict:
    return {STREAMS: {str(s.index): s.state() for s in self._streams}, 'cursor': self._cursor}

  def set_state(self, state: dict) -> None:
    self._open({int(s): v for s, v in state[STREAMS].items()}, int(state['cursor']))


def stream_states(state: Any) -> dict[int, dict]:
  """Every stream's state found in a saved Grain state, however Grain nests its workers' states."""
  found: dict[int, dict] = {}
  if isinstance(state, dict):
    if STREAMS in state:
      found.update({int(s): v for s, v in state[STREAMS].items()})
    for key, value in state.items():
      if key != STREAMS:
        found.update(stream_states(value))
  elif isinstance(state, (list, tuple)):
    for value in state:
      found.update(stream_states(value))
  return found


# ---- The input ---------------------------------------------------------------------------------


@dataclasses.dataclass
class GrainLmInput(BaseInput):
  """Batches of packed rows from one split of a prepared directory (see the module docstring)."""
  data: Any = ''  # a prepared directory (prepared.json and its shards), or {directory: weight}: a mixture
  split: str = 'train'
  seq_len: int = 128
  vocab_size: int = 0  # the model's: the tokenizer must fit in it; 0: no check
  open_rows: int = 8
  num_streams: int = 16  # fixed for a run: position g goes to stream g mod num_streams
  workers: int = 0  # Grain worker processes per process (0: a prefetch thread)
  prefetch: int = 2  # batches each worker (or the thread) keeps ready

  def __post_init__(self):
    super().__post_init__()
    self._sources = _sources(self.data, self.name)
    self.manifest = self._sources[0][2]
    self.num_docs = sum(m.records(self.split) for _, _, m in self._sources)
    if not self.num_docs:
      raise UserError(f'{self.data}: the prepared data has no {self.split} document.')
    self._tokenizer_path = prepared.member(self._sources[0][0], self.manifest.tokenizer, 'tokenizer')
    note = tokenizers.check_fits(self.manifest.vocab_size, self.vocab_size, f'of {self.data}')
    self.notes = [note] if note else []   # said by the command once its checks pass
    self._docs = self._documents()
    self._end = None if self.is_training and self.repeat else self.num_docs
    self._iterator = None
    atexit.register(self.close)
    self._restored: dict[int, dict] = {}
    self._tok = None

  def _documents(self) -> grain.MapDataset:
    """Position -> record. Training: each directory shuffled and repeated (a new order each epoch), and
    a mixture's directories interleaved in proportion to their weights by Grain's mix, which maps a
    position to (directory, index) by arithmetic: random access, so a stream's count is all a resume
    needs. Eval: every document of the split once, directory after directory."""
    def shards(directory, manifest):
      return [prepared.member(directory, s.name, 'shard') for s in manifest.shards.get(self.split) or []]

    def source(directory, manifest):
      return grain.sources.ArrayRecordDataSource(shards(directory, manifest))
    if not self.is_training:
      return grain.MapDataset.source(grain.sources.ArrayRecordDataSource(
          [path for d, _, m in self._sources for path in shards(d, m)]))
    empty = [d for d, _, m in self._sources if not m.records(self.split)]
    if empty:
      raise UserError(f'{empty[0]}: the prepared data has no {self.split} document; a mixture draws from each '
                      'of its directories.')
    parts = [grain.MapDataset.source(source(d, m)).shuffle(seed=self.seed + i).repeat()
             for i, (d, _, m) in enumerate(self._sources)]
    if len(parts) == 1:
      return parts[0]
    return grain.MapDataset.mix(parts, [w for _, w, _ in self._sources])

  # ---- the contract ---------------------------------------------------------------------------

  def get_next(self) -> dict[str, np.ndarray]:
    self._start()
    batch = next(self._iterator, None)
    if batch is None:
      raise EndOfInput(self.name)
    docs, offsets = batch.pop(_DOC), batch.pop(_OFFSET)
    batch = _own_memory(batch)
    if os.environ.get(TRACE_ENV):
      self._trace(docs, offsets, batch['segment_ids'])
    self._batches_read += 1
    return batch

  def reset(self) -> None:
    super().reset()
    self.close()
    self._restored = {}

  def close(self) -> None:
    """Stops the workers and frees the batches they had ready (also at exit)."""
    if self._iterator is not None:
      self._iterator.close()
      self._iterator = None

  def _start(self) -> None:
    if self._iterator is None:
      self._iterator = iter(self._pipeline())

  def skip(self, num_batches: int) -> None:
    """Reads and drops batches: only for a checkpoint that holds no input state."""
    for _ in range(num_batches):
      self.get_next()

  def tokenizer_file(self) -> Optional[str]:
    return self._tokenizer_path

  def ids_to_strings(self, ids, lengths=None) -> list[str]:
    if self._tok is None:
      self._tok = tokenizers.load(self._tokenizer_path)
    return decode_rows(self._tok.decode, ids, lengths)

  # ---- checkpoints ----------------------------------------------------------------------------

  def get_state(self) -> bytes:
    """This process's state after the last batch taken, as sealed JSON (grain_state.seal; Grain's
    orbax handler saves it)."""
    self._start()
    return grain_state.seal({'version': STATE_VERSION, **self._layout(), 'batches': self._batches_read,
                             'grain': self._iterator.get_state()})

  def restore(self, saved: list[dict], batches: Optional[int] = None) -> None:
    """Goes on from the states every process saved (read_states), each checked first (paxcli.inputs.
    grain_state: a state that was edited or does not fit this input and its data is refused): the very
    batches when the processes, workers and batch are the same; else the streams dealt out again.
    `batches`: the count of batches consumed that the checkpoint's meta holds, checked against theirs."""
    mine = self._layout()
    grain_state.check_files(saved, batches)
    for i, state in enumerate(saved):
      for key in ('num_streams', 'num_docs', 'mixture', 'seed', 'seq_len', 'open_rows', 'split'):
        if state.get(key) != mine[key]:
          raise UserError(f'Cannot resume the input {self.name!r}: the checkpoint read {self.data} with {key} '
                          f'{shorten(repr(state.get(key)), 60)}, this run has {mine[key]!r}; the saved position means '
                          f'nothing for other data or another order. Resume with the same {key}, or start a new job '
                          f'directory. ({grain_state.where(state, i)})')
    streams = grain_state.check_streams(saved, mine)
    grain_state.check_pieces(streams, self.seq_len, *self._piece_sizes())
    self._batches_read = saved[0]['batches']
    keys = ('num_processes', 'process', 'workers', 'batch_size')
    same = [s for s in saved if all(s[k] == mine[k] for k in keys)]
    self.close()
    if len(saved) == mine['num_processes'] and same:
      self._start()
      self._iterator.set_state(grain_state.merged(self._iterator.get_state(), same[0]['grain'], self._worker_streams(),
                                                  self.workers, grain_state.where(same[0], 0)))
      return
    self._restored = streams

  def _piece_sizes(self):
    """(pieces_of(g), length(g, k)) of the documents at positions g, for checking saved pieces."""
    examples: dict[int, Optional[packing.Example]] = {}

    def example(g: int):
      if g not in examples:
        examples[g] = self._example_at(g)
      return examples[g]

    def pieces_of(g: int) -> int:
      return -(-len(example(g)) // self.seq_len) if example(g) is not None else 0

    def length(g: int, k: int) -> int:
      return min(self.seq_len, len(example(g)) - k * self.seq_len)
    return pieces_of, length

  def _example_at(self, g: int) -> Optional[packing.Example]:
    return prepared.example(self._docs[g], f'document at position {g}')

  def _worker_streams(self) -> list[list[int]]:
    """The streams of this process, dealt to its workers as Grain's mp_prefetch deals them."""
    num_hosts, host = self._host()
    streams = list(range(host, self.num_streams, num_hosts))
    return [streams[w::self.workers] for w in range(self.workers)] if self.workers else [streams]

  # ---- the pipeline ---------------------------------------------------------------------------

  def _pipeline(self):
    num_hosts, host = self._host()
    streams = list(range(host, self.num_streams, num_hosts))
    if len(streams) < max(1, self.workers):
      raise UserError(f'Input {self.name!r}: {self.num_streams} streams over {num_hosts} process(es) x '
                      f'{max(1, self.workers)} worker(s) leaves some without one; set DATA_STREAMS to at least '
                      f'{num_hosts * max(1, self.workers)} (for a new run) or fewer DATA_WORKERS.')
    ds = _StreamsDataset(self._docs, self._end, streams, self.num_streams, self.seq_len, self.open_rows,
                         self._restored, self.batch_size)
    if self.workers:
      if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags, which a `pax` process never parses
        flags.FLAGS.mark_as_parsed()
      return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.workers,
                                                         per_worker_buffer_size=self.prefetch),
                            worker_init_fn=functools.partial(_exit_with_parent, os.getpid()))
    return grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=self.prefetch)

  def _layout(self) -> dict:
    num_hosts, host = self._host()
    return {'num_streams': self.num_streams, 'num_docs': self.num_docs, 'mixture': self._mixture(),
            'seed': self.seed, 'seq_len': self.seq_len,
            'open_rows': self.open_rows, 'split': self.split, 'num_processes': num_hosts, 'process': host,
            'workers': self.workers, 'batch_size': self.batch_size}

  def _mixture(self) -> Optional[list]:
    """A mixture's [documents, weight] per directory, in order (None for one directory): a resume
    with other weights or directories would give the saved positions other documents."""
    if len(self._sources) == 1:
      return None
    return [[m.records(self.split), w] for _, w, m in self._sources]

  def _host(self) -> tuple[int, int]:
    return self.num_infeed_hosts or 1, self.infeed_host_index or 0

  def _trace(self, docs, offsets, segment_ids) -> None:
    rows = [[[int(d), int(o)] for d, o, s in zip(dr, orow, sr) if s > 0]
            for dr, orow, sr in zip(docs, offsets, segment_ids)]
    with open(os.environ[TRACE_ENV], 'a', encoding='utf-8') as f:
      f.write(json.dumps({'process': self._host()[1], 'batch': self._batches_read, 'rows': rows}) + '\n')


def _stack(rows: list[dict], batch_size: int) -> dict:
  """Rows stacked into a batch; missing rows are zeros (zero weight). Batching here rather than
  with Grain's batch keeps each worker's state its streams' (and off shared memory, which Grain's
  prefetch leaves behind at exit)."""
  out = {}
  for k in rows[0]:
    column = np.stack([row[k] for row in rows])
    out[k] = np.concatenate([column, np.zeros((batch_size - len(rows),) + column.shape[1:], column.dtype)])
  return out


def _sources(data: Any, name: str) -> list[tuple[str, float, prepared.Manifest]]:
  """[(directory, weight, manifest)] of a prepared directory or a {directory: weight} mixture; the
  directories of a mixture must share one tokenizer (their ids mean the same tokens)."""
  out = [(d, w, prepared.read_manifest(d)) for d, w in file_input.sources(
      data, name, ('prepared directory', 'prepared directories'))]
  prepared.check_one_tokenizer([(d, m) for d, _, m in out], f'Input {name!r}')
  return out


def _own_memory(batch: dict) -> dict:
  """The batch in arrays of its own. From worker processes Grain hands each array over in a shared
  memory block that it unlinks when the array is garbage collected, on a thread pool. jax on CPU
  keeps the host buffer it is given (no copy) for as long as its device array lives, and the last
  batch's lives until the interpreter exits, after that pool has stopped: its blocks were never
  unlinked (Python's resource tracker warned of ~5 leaked shared_memory objects at every exit).
  A copy (a few hundred KB a step) lets each block go here, while Grain's pool runs."""
  return {k: v if type(v) is np.ndarray else np.array(v) for k, v in batch.items()}


def _exit_with_parent(parent: int, worker: int, num_workers: int) -> None:
  """Run in each Grain worker at its start: exits the worker once `parent` (the process that started
  it) is gone. A `pax train` killed with -9 (a preemption) cannot stop its workers, and a worker
  blocked on its full queue would otherwise wait forever, holding its shared memory."""
  del worker, num_workers
  def watch():
    while os.getppid() == parent:
      time.sleep(1)
    os._exit(0)
  threading.Thread(target=watch, name='paxcli-exit-with-parent', daemon=True).start()
