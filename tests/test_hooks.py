"""The train loop's hook registry and its clock (paxcli/loops/hooks.py), without a model."""

import time

import pytest

from paxcli.loops.hooks import Chrono, Hooks, StepInfo


def _info(step, last=False, stopping=False):
  return StepInfo(step, state=None, metrics=None, last=last, stopping=stopping)


def test_hooks_run_when_due_in_the_order_added_and_close_last_first():
  calls, closed = [], []
  with Hooks() as hooks:
    hooks.add_before(lambda step: calls.append(('before', step)) if step == 1 else None)
    hooks.add(lambda i: calls.append(('every 2', i.step)), every=2, close=lambda: closed.append('every 2'))
    hooks.add(lambda i: calls.append(('every 3, at end', i.step)), every=3, at_end=True,
              close=lambda: closed.append('every 3'))
    hooks.add(lambda i: calls.append(('on stop', i.step)), on_stop=True)
    for step in range(1, 6):
      hooks.before(step)
      hooks.after(_info(step, last=step == 5, stopping=step == 4))
  assert calls == [('before', 1), ('every 2', 2), ('every 3, at end', 3), ('every 2', 4), ('on stop', 4),
                   ('every 3, at end', 5)]
  assert closed == ['every 3', 'every 2']


def test_every_hook_is_closed_when_a_hook_raises():
  closed = []

  def diverged(info):
    raise RuntimeError(f'diverged at {info.step}')
  with pytest.raises(RuntimeError, match='diverged at 2'):
    with Hooks() as hooks:
      hooks.add(lambda i: None, every=1, close=lambda: closed.append('first'))
      hooks.add(diverged, every=2, close=lambda: closed.append('second'))
      for step in range(1, 4):
        hooks.after(_info(step))
  assert closed == ['second', 'first']


def test_chrono_keeps_paused_time_out_of_the_window_rate_and_gives_the_time_left():
  chrono = Chrono(first_step=10, total_steps=20)
  with chrono:
    with chrono.paused():
      time.sleep(0.05)
    window = chrono.window(14)
    assert window.steps == 4 and window.paused_seconds >= 0.05
    assert window.steady_seconds == pytest.approx(max(window.elapsed - window.paused_seconds
                                                      - window.compile_seconds, 1e-6))
    assert chrono.window(15).steps == 1 and chrono.window(15).paused_seconds == 0  # each window starts afresh
  assert chrono.eta(15, 2.0) == 2.5
  assert chrono.eta(20, 2.0) is None and chrono.eta(15, 0.0) is None and chrono.eta(15, float('nan')) is None
