"""The train loop's hooks and its one clock.

The loop holds the order; hooks hold the work (levanter's `add_hook(fn, every=N)`): eval,
decode, checkpointing, summaries, profiling, the loss check and the graceful stop are each a
function of one `StepInfo`, run after the steps they are due at. `Chrono` is the loop's single
timing object (big_vision's `chrono`): the summary window, compilation and evals timed apart,
and the time left; its `Stopwatch` puts every wall second of the process in one goodput category
(paxcli/jobdir/ledger.py), switched by the phases the loop and its hooks enter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable, Optional

from paxcli.jobdir.ledger import PROCESS_CATEGORIES
from paxcli.perf import flops


@dataclasses.dataclass(frozen=True)
class StepInfo:
  """What a hook is given after one train step."""
  step: int
  state: Any        # the train state after the step (donated to the next step: use it before returning)
  metrics: Any      # the step's metrics, still on the device (reading them waits for the step)
  last: bool        # the run's last step (num_train_steps)
  stopping: bool    # a stop was asked for (SIGTERM, Ctrl-C): this invocation ends after this step


@dataclasses.dataclass(frozen=True)
class _Hook:
  fn: Callable[[StepInfo], None]
  every: int
  at_end: bool
  on_stop: bool

  def due(self, info: StepInfo) -> bool:
    return bool(self.every and info.step % self.every == 0) or (self.at_end and info.last) or (
        self.on_stop and info.stopping)


def _closer(close: Callable[[], None]):
  """A hook's close for the ExitStack: when the loop is already failing (a bucket that stopped answering),
  a close that fails too is dropped, so that the first failure is the one line the user reads."""
  def exit_(kind, value, tb) -> bool:
    if kind is None:
      close()
    else:
      with contextlib.suppress(Exception):
        close()
    return False
  return exit_


class Hooks(contextlib.ExitStack):
  """Functions run after each step they are due at, in the order they were added.

  `every=N` runs a hook at steps N, 2N, ... (0: never by count); `at_end` also at the run's last
  step; `on_stop` also at the step a stop was asked after. A hook's `close` (and a context manager
  given to `enter_context`) runs when the `with` block ends, however it ends, the last one first.
  `before(step)` functions run ahead of each step's dispatch (a profiler starting its trace).
  """

  def __init__(self):
    super().__init__()
    self._hooks: list[_Hook] = []
    self._before: list[Callable[[int], None]] = []

  def add(self, fn: Callable[[StepInfo], None], every: int = 0, *, at_end: bool = False, on_stop: bool = False,
          close: Optional[Callable[[], None]] = None) -> None:
    self._hooks.append(_Hook(fn, every, at_end, on_stop))
    if close is not None:
      self.push(_closer(close))

  def add_before(self, fn: Callable[[int], None]) -> None:
    self._before.append(fn)

  def before(self, step: int) -> None:
    for fn in self._before:
      fn(step)

  def after(self, info: StepInfo) -> None:
    for hook in self._hooks:
      if hook.due(info):
        hook.fn(info)


@dataclasses.dataclass(frozen=True)
class Window:
  """The steps since the last summary and their wall time, with what was not stepping kept apart."""
  steps: int
  elapsed: float           # wall seconds of the window
  compile_seconds: float   # of which JAX tracing and compiling
  paused_seconds: float    # of which evals and decodes (their compilations included)

  @property
  def steady_seconds(self) -> float:
    """The window's time less compilation and evals: what its rates are over."""
    return max(self.elapsed - self.compile_seconds - self.paused_seconds, 1e-6)


STEP = 'step'  # a step's own work: productive, or recomputed, once the step is done


class Stopwatch:
  """Every wall second of one process since `started`, in exactly one category at a time.

  The process starts in 'startup'; `switch` closes the open interval and opens another, `phase` opens
  one for a block and goes back. Compilation that ends inside an interval (JAX's monitoring spans,
  flops.CompileTimer) moves from it to 'compile', except in 'eval', which keeps its own. The work of
  step k (the STEP intervals since the step before) becomes 'recomputed' when k is at or below
  `furthest_before`, the furthest step an earlier run of the job reached, else 'productive'.
  `snapshot` (from any thread) gives the closed seconds and the open interval for the ledger.
  """

  def __init__(self, started: Optional[float] = None, furthest_before: int = 0, now: Callable[[], float] = time.time):
    self._now = now
    self._lock = threading.Lock()
    self._compile = flops.CompileTimer()
    self.closed = dict.fromkeys(PROCESS_CATEGORIES, 0.0)
    self.current, self.since = 'startup', now() if started is None else started
    self.started = self.since
    self.furthest_before = furthest_before
    self.step: Optional[int] = None   # the last step done
    self.steps = {'productive': 0, 'recomputed': 0}
    self._step_work = 0.0              # STEP seconds since the last step done

  def __enter__(self) -> Stopwatch:
    self._compile.__enter__()
    return self

  def __exit__(self, *exc) -> bool:
    return self._compile.__exit__(*exc)

  def switch(self, category: str) -> str:
    """Closes the open interval and opens one of `category`; returns the category it closed."""
    if category != STEP and category not in PROCESS_CATEGORIES:
      raise ValueError(f'unknown goodput category {category!r}')
    with self._lock:
      previous = self._close(self._now())
      self.current, self._compile.ignoring = category, category == 'eval'
    return previous

  @contextlib.contextmanager
  def phase(self, category: str):
    previous = self.switch(category)
    try:
      yield
    finally:
      self.switch(previous)

  def step_done(self, step: int) -> None:
    """Step `step` and its hooks are done: its work is productive or recomputed."""
    with self._lock:
      self._close(self._now())
      kind = self._kind(step)
      self.closed[kind] += self._step_work
      self.steps[kind] += 1
      self._step_work, self.step = 0.0, step

  def _kind(self, step: int) -> str:
    return 'recomputed' if step <= self.furthest_before else 'productive'

  def _close(self, now: float) -> str:
    seconds = max(now - self.since, 0.0)
    compiled = min(self._compile.take(), seconds)
    self.closed['compile'] += compiled
    if self.current == STEP:
      self._step_work += seconds - compiled
    else:
      self.closed[self.current] += seconds - compiled
    self.since = now
    return self.current

  def snapshot(self) -> dict:
    """{'t', 'closed', 'open': [category, since], 'step', 'steps'}: the ledger's progress line. The work
    of the step in flight counts as that step's; the open interval's seconds are not in `closed`."""
    with self._lock:
      return self._snapshot(self._now())

  def _snapshot(self, now: float) -> dict:
    closed = dict(self.closed)
    upcoming = self._kind((self.step or 0) + 1)
    closed[upcoming] += self._step_work
    current = upcoming if self.current == STEP else self.current
    return {'t': now, 'closed': closed, 'open': [current, self.since], 'step': self.step, 'steps': dict(self.steps)}

  def finish(self) -> dict:
    """Closes the open interval: the snapshot's `closed` then adds up to its `t` - started."""
    with self._lock:
      now = self._now()
      self._close(now)
      return self._snapshot(now)


class Chrono:
  """The loop's clock: summary windows, compilation and evals timed apart, and the time left.

  Compilation is read from JAX's own monitoring spans (flops.CompileTimer) while the clock is
  entered; `paused()` times an eval or decode (and what it compiles) apart from the steps. Entering
  the clock ends the process's start-up on its `stopwatch`; `phase` times data waits and saves there.
  """

  def __init__(self, first_step: int, total_steps: int, stopwatch: Optional[Stopwatch] = None):
    self.total_steps = total_steps
    self.stopwatch = stopwatch or Stopwatch()
    self._compile = flops.CompileTimer()
    self._start, self._step, self._paused = time.perf_counter(), first_step, 0.0

  def __enter__(self) -> Chrono:
    self._compile.__enter__()
    self.stopwatch.switch(STEP)
    return self

  def __exit__(self, *exc) -> bool:
    self.stopwatch.switch('shutdown')
    return self._compile.__exit__(*exc)

  def phase(self, category: str):
    """A block of the loop timed as `category` ('data', 'checkpoint') for goodput."""
    return self.stopwatch.phase(category)

  @contextlib.contextmanager
  def paused(self):
    start, self._compile.ignoring = time.perf_counter(), True
    try:
      with self.stopwatch.phase('eval'):
        yield
    finally:
      self._compile.ignoring = False
      self._paused += time.perf_counter() - start

  def window(self, step: int) -> Window:
    """The window ending at `step`, since the last one (or the start); the next one starts now."""
    now = time.perf_counter()
    window = Window(step - self._step, max(now - self._start, 1e-9), self._compile.take(), self._paused)
    self._start, self._step, self._paused = now, step, 0.0
    return window

  def eta(self, step: int, steps_per_sec: float) -> Optional[float]:
    """Seconds left to the last step at `steps_per_sec`; None when done or the rate is unknown."""
    left = self.total_steps - step
    return left / steps_per_sec if left > 0 and steps_per_sec > 0 else None
