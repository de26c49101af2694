"""Continuous batching for `pax serve`: requests join and leave the running batch between decode steps.

    engine = Engine(slots, max_queue=256)
    engine.start()                                 # the device loop, in a thread of its own
    engine.submit(Request(prompt_ids, settings, n=1, adapter=0, emit=callback))   # from any thread
    engine.release(request)                        # a client gone, or a stop string reached: rows freed
    engine.stop(drain=True)

One thread owns the device (paxcli.loops.serve.slots: the cache's rows and the compiled pieces) and
loops: it takes the requests submitted since its last turn, frees the rows of those released, moves
the oldest waiting request into the staging row when rows are free for all its choices (`n`), feeds
one chunk of its prompt (so a long prompt never stalls the running rows for longer than a chunk),
copies it into its rows when the whole prompt is in, and runs a few decoding steps of every row.
A request that waits for rows stays in a first-come queue; one beyond `max_queue` waiting is
refused (QueueFull: HTTP 429). Rows in use are always the first ones: a row that ends takes the
last row's content (`Slots.move`), and the cache grows and shrinks with the rows in use and their
longest text (paxcli.loops.serve.slots).

What comes out goes to each request's `emit` (called on this thread; it must only hand over): a
'prompt' event with the prompt's own log-probabilities (echo), 'tokens' events (new ids, their
log-probabilities and alternatives, and `finish` once a choice ends: 'stop' at an end-of-sequence
id, 'length' at max_tokens), or 'error'. Text and stop strings are the reader's
(paxcli.loops.serve.text): it releases a choice whose text reached one.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import traceback
from typing import Callable, Optional

import jax
import numpy as np

from paxcli.loops.serve import slots as slots_lib
from paxcli.loops.serve.metrics import Metrics


@dataclasses.dataclass(frozen=True)
class Settings:
  """How a request decodes (all its choices alike)."""
  max_tokens: int
  temperature: float = 0.0       # 0: greedy
  top_p: float = 1.0
  top_k: int = 0                 # 0: off
  seed: int = 0
  top_logprobs: int = 0          # alternatives listed per new token (0: none)
  logprobs: bool = False         # the new tokens' own log-probabilities
  prompt_logprobs: bool = False  # echo: the prompt tokens' log-probabilities (and alternatives, top_logprobs)
  eos_ids: tuple = ()            # ids that end a choice (none with ignore_eos)


class QueueFull(Exception):
  """More requests wait than the engine's bound."""


class Stopped(Exception):
  """The engine is draining or stopped: it takes no new requests."""


class Request:
  """A prompt to decode `n` ways; events go to `emit(dict)` from the engine's thread."""

  def __init__(self, prompt_ids, settings: Settings, n: int, adapter: int, emit: Callable[[dict], None]):
    self.prompt_ids = [int(i) for i in prompt_ids]
    self.settings, self.n, self.adapter, self.emit = settings, n, adapter, emit
    self.sequences = [Sequence(self, i) for i in range(n)]
    self.arrived = time.monotonic()
    self.first_token_at: Optional[float] = None
    self.released = False


class Sequence:
  """One choice of a request: its row while it decodes and how far it got."""

  def __init__(self, request: Request, index: int):
    self.request, self.index = request, index
    self.row: Optional[int] = None
    self.count = 0          # new tokens chosen
    self.last = -1          # the last of them
    self.slots = 0          # cache slots its row holds (prompt padding, prompt, tokens fed)
    self.done = False
    base = jax.random.PRNGKey(request.settings.seed)
    # pax decode's key for sample `index` of prompt 0: the same seed gives the same samples
    self.key = np.asarray(jax.random.fold_in(jax.random.fold_in(base, 0), index), np.uint32)


class Engine:
  """The device loop over a Slots (see the module docstring)."""

  def __init__(self, slots: slots_lib.Slots, max_queue: int = 256, metrics: Optional[Metrics] = None,
               log: Callable[[str], None] = print):
    self.slots, self.max_queue, self.log = slots, max_queue, log
    self.metrics = metrics or Metrics()
    self._cv = threading.Condition()
    self._incoming: list[Request] = []
    self._released: list[tuple[Request, Optional[int]]] = []
    self._waiting: collections.deque[Request] = collections.deque()
    self._queued = 0                       # submitted, not yet staged (under _cv)
    self._staged: Optional[_Staging] = None
    self._rows: list[Sequence] = []
    self._accepting, self._running = True, True
    self._thread = threading.Thread(target=self._loop, name='pax-serve-engine', daemon=True)

  # ---- any thread ------------------------------------------------------------------------------------

  def start(self) -> None:
    self._thread.start()

  def submit(self, request: Request) -> None:
    with self._cv:
      if not self._accepting:
        raise Stopped()
      if self._queued >= self.max_queue:
        self.metrics.refused()
        raise QueueFull()
      self._queued += 1
      self._incoming.append(request)
      self.metrics.queued(self._queued)
      self._cv.notify()

  def release(self, request: Request, index: Optional[int] = None) -> None:
    """Ends a request (index None: all its choices) wherever it is: its rows are freed at the next turn."""
    with self._cv:
      self._released.append((request, index))
      self._cv.notify()

  def refuse(self) -> None:
    """Takes no new requests from now on (Stopped); those taken go on."""
    with self._cv:
      self._accepting = False

  def stop(self, drain: bool = True, timeout: Optional[float] = None) -> None:
    """Takes no new requests; with `drain`, returns once those taken have ended (or `timeout` passed),
    then stops the loop."""
    with self._cv:
      self._accepting = False
      self._cv.notify()
    if drain:
      deadline = None if timeout is None else time.monotonic() + timeout
      with self._cv:
        while self._busy() and self._thread.is_alive():
          left = None if deadline is None else deadline - time.monotonic()
          if left is not None and left <= 0:
            break
          self._cv.wait(left if left is not None else 1.0)
    with self._cv:
      self._running = False
      self._cv.notify()
    if self._thread.is_alive() and threading.current_thread() is not self._thread:
      self._thread.join(timeout=60)

  @property
  def accepting(self) -> bool:
    return self._accepting

  def _busy(self) -> bool:
    return bool(self._incoming or self._waiting or self._staged or self._rows)

  # ---- the engine's thread ---------------------------------------------------------------------------

  def _loop(self) -> None:
    try:
      while self._turn():
        pass
    except Exception as e:  # noqa: BLE001 - every request waiting must hear of it, not hang
      self.log(f'pax serve: the engine stopped: {type(e).__name__}: {e}\n{traceback.format_exc()}')
      self._fail_all(f'the server\'s engine failed ({type(e).__name__}: {str(e)[:200]})')
    finally:
      with self._cv:
        self._accepting = self._running = False
        self._cv.notify_all()

  def _turn(self) -> bool:
    """One turn of the loop; False once it should end."""
    with self._cv:
      while self._running and not (self._incoming or self._released or self._waiting or self._staged
                                   or self._rows):
        self._cv.notify_all()   # a drain waiting for the engine to be idle
        self._cv.wait()
      if not self._running:
        return False
      self._waiting.extend(self._incoming)
      self._incoming.clear()
      released, self._released = self._released, []
    for request, index in released:
      self._release(request, index)
    self._stage()
    if self._staged is not None:
      self._prefill_chunk()
    if self._rows:
      self._decode()
    self.metrics.running(len(self._rows), self._queued)
    return True

  def _stage(self) -> None:
    """Moves the oldest waiting request into the staging row once rows are free for all its choices."""
    while self._staged is None and self._waiting:
      request = self._waiting[0]
      if request.released:
        self._waiting.popleft()
        self._dequeued()
        continue
      if len(self._rows) + request.n > self.slots.max_rows:
        return
      self._waiting.popleft()
      self._dequeued()
      self._staged = _Staging(request, self.slots.chunk)
      self.slots.start_staging(self._staged.prompt_slots)

  def _dequeued(self) -> None:
    with self._cv:
      self._queued -= 1

  def _prefill_chunk(self) -> None:
    staged = self._staged
    request = staged.request
    if staged.chunks:
      ids, pos, targets = staged.chunks.pop(0)
      scores = self.slots.prefill(ids, pos, targets, request.adapter, request.settings.prompt_logprobs)
      if scores is not None:
        staged.add_scores(scores, pos)
      self.metrics.prompt_tokens(int((pos >= 0).sum()))
      if staged.chunks:
        return
    self._staged = None
    if request.released:
      return
    if request.settings.prompt_logprobs:
      request.emit({'kind': 'prompt', **staged.scores()})
    if request.settings.max_tokens == 0:   # echo only: the prompt's log-probabilities were all it asked
      for seq in request.sequences:
        seq.done = True
        request.emit({'kind': 'tokens', 'index': seq.index, 'ids': [], 'lps': [], 'top': None, 'finish': 'length'})
      self.metrics.finished('done')
      return
    rows, _ = self.slots.row_need(len(self._rows) + request.n, 1)
    self.slots.resize(max(rows, self.slots.rows), self.slots.length)
    for seq in request.sequences:
      seq.row, seq.slots = len(self._rows), staged.prompt_slots
      self.slots.insert(seq.row)
      self._rows.append(seq)

  def _decode(self) -> None:
    """A few steps of every row: one while a new row waits for its first token or requests wait for rows
    (their time to first token), more otherwise."""
    fresh = any(s.count == 0 for s in self._rows)
    steps = 1 if fresh or self._staged or self._can_stage() else self.slots.max_steps
    need = max(s.slots + min(steps, s.request.settings.max_tokens - s.count) for s in self._rows)
    rows, length = self.slots.row_need(len(self._rows), need)
    # Grown at once; shrunk (a copy) only once a quarter of it is in use, so that it does not flap.
    cur_rows, cur_length = self.slots.rows, self.slots.length
    self.slots.resize(rows if rows > cur_rows or len(self._rows) * 4 <= cur_rows else cur_rows,
                      length if length > cur_length or need * 4 <= cur_length else cur_length)
    state = self._state()
    top = any(s.request.settings.top_logprobs for s in self._rows)
    begin = time.perf_counter()
    out = self.slots.decode(state, steps, top)
    seconds = time.perf_counter() - begin
    ended, new_tokens = [], 0
    for seq in self._rows:
      r = seq.row
      n = int(out['count'][r]) - seq.count
      new_tokens += n
      seq.slots += n
      finish = {1: 'stop', 2: 'length'}.get(int(out['stopped'][r])) if n or out['stopped'][r] else None
      if seq.count == 0 and n and seq.request.first_token_at is None:
        seq.request.first_token_at = time.monotonic()
        self.metrics.first_token(seq.request.first_token_at - seq.request.arrived)
      seq.count += n
      if n:
        seq.last = int(out['ids'][r, n - 1])
      top_pairs = None
      if top and seq.request.settings.top_logprobs:
        k = seq.request.settings.top_logprobs
        top_pairs = [list(zip(out['top_ids'][r, i, :k].tolist(), out['top_lps'][r, i, :k].tolist()))
                     for i in range(n)]
      seq.request.emit({'kind': 'tokens', 'index': seq.index, 'ids': out['ids'][r, :n].tolist(),
                        'lps': out['lps'][r, :n].tolist(), 'top': top_pairs, 'finish': finish})
      if finish:
        ended.append(seq)
    self.metrics.decoded(new_tokens, seconds)
    for seq in ended:
      self._end(seq)

  def _state(self) -> dict:
    """The host's per-row arrays for Slots.decode (rows past those in use: not live)."""
    R, eos_n = self.slots.rows, slots_lib.EOS_IDS
    state = {'tok': np.zeros(R, np.int32), 'pos': np.zeros(R, np.int32), 'live': np.zeros(R, bool),
             'count': np.zeros(R, np.int32), 'budget': np.zeros(R, np.int32), 'min_tokens': np.zeros(R, np.int32),
             'key': np.zeros((R, 2), np.uint32), 'temperature': np.zeros(R, np.float32),
             'top_p': np.ones(R, np.float32), 'top_k': np.zeros(R, np.int32), 'adapter': np.zeros(R, np.int32),
             'eos': np.full((R, eos_n), -1, np.int32)}
    for seq in self._rows:
      r, s, req = seq.row, seq.request.settings, seq.request
      last = req.prompt_ids[-1] if seq.count == 0 else seq.last
      state['tok'][r], state['pos'][r] = last, len(req.prompt_ids) - 1 + seq.count
      state['live'][r], state['count'][r], state['budget'][r] = True, seq.count, s.max_tokens
      state['key'][r], state['temperature'][r], state['top_p'][r] = seq.key, s.temperature, s.top_p
      state['top_k'][r], state['adapter'][r] = s.top_k, req.adapter
      state['eos'][r, :len(s.eos_ids)] = s.eos_ids[:eos_n]
    return state

  def _can_stage(self) -> bool:
    """Whether the oldest waiting request would find rows for its choices now."""
    return bool(self._waiting) and len(self._rows) + self._waiting[0].n <= self.slots.max_rows

  def _release(self, request: Request, index: Optional[int]) -> None:
    if index is None:
      request.released = True
      if request in self._waiting:
        self._waiting.remove(request)
        self._dequeued()
        self.metrics.finished('released')
      if self._staged is not None and self._staged.request is request:
        self._staged = None
        self.metrics.finished('released')
    for seq in list(self._rows):
      if seq.request is request and (index is None or seq.index == index):
        self._end(seq)

  def _end(self, seq: Sequence) -> None:
    """Frees the row of a choice that ended: the last row in use moves into it."""
    if seq.done or seq.row is None:
      seq.done = True
      return
    seq.done = True
    r, last = seq.row, len(self._rows) - 1
    if r != last:
      self.slots.move(last, r)
      self._rows[r] = self._rows[last]
      self._rows[r].row = r
    self._rows.pop()
    seq.row = None
    if all(s.done for s in seq.request.sequences):
      self.metrics.finished('released' if seq.request.released else 'done')

  def _fail_all(self, message: str) -> None:
    with self._cv:
      self._accepting = False
      requests = list(self._incoming) + list(self._waiting)
    requests += [s.request for s in self._rows] + ([self._staged.request] if self._staged else [])
    for request in {id(r): r for r in requests}.values():
      request.emit({'kind': 'error', 'message': message})


class _Staging:
  """A prompt's way into the staging row: its chunks (all but the prompt's last token, which the first
  decoding step feeds) and, for echo, the log-probabilities they give of the tokens after them."""

  def __init__(self, request: Request, chunk: int):
    self.request = request
    ids = request.prompt_ids
    fed = ids[:-1]
    sizes = chunk_sizes(len(fed), chunk)
    self.prompt_slots = sum(sizes)
    self.chunks, at = [], 0
    pad = self.prompt_slots - len(fed)   # the first chunk's left padding
    for n, size in enumerate(sizes):
      real = size - (pad if n == 0 else 0)
      chunk_ids = np.zeros((1, size), np.int32)
      pos = np.full((1, size), -1, np.int32)
      targets = np.zeros((1, size), np.int32)
      chunk_ids[0, size - real:] = fed[at:at + real]
      pos[0, size - real:] = np.arange(at, at + real)
      targets[0, size - real:] = ids[at + 1:at + real + 1]
      self.chunks.append((chunk_ids, pos, targets))
      at += real
    self._lps, self._top = [], []

  def add_scores(self, scores: dict, pos: np.ndarray) -> None:
    real = pos[0] >= 0
    self._lps += scores['lp'][0][real].tolist()
    self._top += [list(zip(i.tolist(), v.tolist())) for i, v in zip(scores['top_ids'][0][real],
                                                                    scores['top_lps'][0][real])]

  def scores(self) -> dict:
    """The prompt's tokens' log-probabilities (None for the first) and their alternatives."""
    return {'lps': [None] + self._lps, 'top': [None] + self._top}


def chunk_sizes(n: int, chunk: int) -> list[int]:
  """The prefill chunks of `n` prompt tokens: powers of two from MIN_CHUNK up to `chunk`, the first left-padded,
  so that a prompt of any length needs a few compiled shapes: the rest after whole chunks in one chunk when
  that pads it by at most a quarter (or MIN_CHUNK - 1 slots), else in halving chunks (MIN_CHUNK - 1 at most)."""
  if n == 0:
    return []
  sizes, left = [], n
  while left >= chunk:
    sizes.append(chunk)
    left -= chunk
  if left and slots_lib.pow2(left) - left <= max(slots_lib.MIN_CHUNK - 1, left // 4):
    return [max(slots_lib.MIN_CHUNK, slots_lib.pow2(left))] + sizes   # one chunk, a little padding
  size = chunk // 2
  while left >= slots_lib.MIN_CHUNK and size >= slots_lib.MIN_CHUNK:
    if left >= size:
      sizes.append(size)
      left -= size
    size //= 2
  if left:
    sizes.append(slots_lib.MIN_CHUNK)
  return sorted(sizes)   # the padded (shortest) one first
