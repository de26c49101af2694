"""The train loop's hooks and its one clock.

The loop holds the order; hooks hold the work (levanter's `add_hook(fn, every=N)`): eval,
decode, checkpointing, summaries, profiling, the loss check and the graceful stop are each a
function of one `StepInfo`, run after the steps they are due at. `Chrono` is the loop's single
timing object (big_vision's `chrono`): the summary window, compilation and evals timed apart,
and the time left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Optional

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
      self.callback(close)

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


class Chrono:
  """The loop's clock: summary windows, compilation and evals timed apart, and the time left.

  Compilation is read from JAX's own monitoring spans (flops.CompileTimer) while the clock is
  entered; `paused()` times an eval or decode (and what it compiles) apart from the steps.
  """

  def __init__(self, first_step: int, total_steps: int):
    self.total_steps = total_steps
    self._compile = flops.CompileTimer()
    self._start, self._step, self._paused = time.perf_counter(), first_step, 0.0

  def __enter__(self) -> Chrono:
    self._compile.__enter__()
    return self

  def __exit__(self, *exc) -> bool:
    return self._compile.__exit__(*exc)

  @contextlib.contextmanager
  def paused(self):
    start, self._compile.ignoring = time.perf_counter(), True
    try:
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
