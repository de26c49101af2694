"""`pax serve`'s continuous batching, turn by turn: the engine's loop driven by hand on a tiny model.

No HTTP here (tests/test_serve.py has the server): the engine of paxcli.loops.serve on the real model's cache
and compiled pieces, its turns taken one at a time so that what joins and leaves between decoding steps is
seen, not timed. A short request that arrives while a long one decodes joins the running batch, ends and
frees its row while the long one goes on; a prompt longer than a prefill chunk is fed a chunk per turn
with the running rows decoding between its chunks; every choice decoded beside others is the one it is
alone (greedy), rows that move when another ends included; a request released mid-way frees its row;
requests past the queue bound are refused.
"""

import pytest

from tiny_lm import EXP, KNOBS

CHUNK = 16


@pytest.fixture(scope='module')
def slots():
  from paxcli import config
  from paxcli.loops.serve.slots import Slots
  from paxcli.runtime import engine
  setup = engine.build(config.resolve(EXP, KNOBS))
  params = engine.init_state(setup, 0)['params']
  return Slots(setup, params, max_rows=4, chunk=CHUNK, max_steps=4)


class Asked:
  """One request and what the engine said of it."""

  def __init__(self, prompt, max_tokens, n=1):
    from paxcli.loops.serve.engine import Request, Settings
    self.tokens = [[] for _ in range(n)]
    self.finish = [None] * n
    self.request = Request(prompt, Settings(max_tokens=max_tokens), n, 0, self._emit)

  def _emit(self, event):
    assert event['kind'] == 'tokens', event
    self.tokens[event['index']] += event['ids']
    if event['finish']:
      self.finish[event['index']] = event['finish']

  @property
  def done(self):
    return all(self.finish)


def _engine(slots, max_queue=8):
  from paxcli.loops.serve.engine import Engine
  return Engine(slots, max_queue=max_queue, log=lambda line: None)   # its thread not started: turns by hand


def _turn_until(engine, predicate, limit=200):
  for _ in range(limit):
    if predicate():
      return
    engine._turn()
  raise AssertionError('the engine did not get there')


def _alone(slots, prompt, max_tokens):
  engine, asked = _engine(slots), Asked(prompt, max_tokens)
  engine.submit(asked.request)
  _turn_until(engine, lambda: asked.done)
  return asked.tokens[0]


def test_a_short_request_joins_the_running_batch_and_leaves_before_the_long_one(slots):
  engine = _engine(slots)
  long, short = Asked([5, 6, 7, 8], 40), Asked([9, 10, 11], 3)
  engine.submit(long.request)
  _turn_until(engine, lambda: len(long.tokens[0]) >= 4)
  engine.submit(short.request)
  _turn_until(engine, lambda: short.done)
  assert short.finish == ['length'] and len(short.tokens[0]) == 3
  assert not long.done and len(long.tokens[0]) < 40   # the long one is still decoding: no wait for the slowest
  _turn_until(engine, lambda: not engine._rows)
  assert engine._rows == [] and long.finish == ['length'] and len(long.tokens[0]) == 40
  # Beside each other (the short one's row joined and left), each choice is what it is alone.
  assert long.tokens[0] == _alone(slots, [5, 6, 7, 8], 40)
  assert short.tokens[0] == _alone(slots, [9, 10, 11], 3)


def test_a_long_prompt_is_fed_a_chunk_per_turn_while_the_running_rows_decode(slots):
  engine = _engine(slots)
  running, long_prompt = Asked([3, 4], 50), list(range(20, 20 + 3 * CHUNK - 4))
  engine.submit(running.request)
  _turn_until(engine, lambda: len(running.tokens[0]) >= 1)
  joining = Asked(long_prompt, 4)
  engine.submit(joining.request)
  counts = []
  _turn_until(engine, lambda: counts.append(len(running.tokens[0])) or joining.tokens[0])
  # Three chunks, three turns at least, and the running row decoded in each of them.
  assert len(counts) >= 4 and all(b > a for a, b in zip(counts[1:], counts[2:])), counts
  _turn_until(engine, lambda: running.done and joining.done)
  assert joining.tokens[0] == _alone(slots, long_prompt, 4)
  assert running.tokens[0] == _alone(slots, [3, 4], 50)


def test_rows_that_move_when_another_ends_keep_their_text(slots):
  """Four rows at once; the first ends first and the last row moves into its place, twice over."""
  engine = _engine(slots)
  asked = [Asked([7, 1 + k], t) for k, t in enumerate((2, 6, 30, 45))]
  for a in asked:
    engine.submit(a.request)
  _turn_until(engine, lambda: all(a.done for a in asked))
  assert slots.rows <= slots.max_rows
  for k, (a, t) in enumerate(zip(asked, (2, 6, 30, 45))):
    assert a.tokens[0] == _alone(slots, [7, 1 + k], t), k


def test_n_choices_take_a_row_each_and_a_released_request_frees_them(slots):
  engine = _engine(slots)
  asked = Asked([2, 3, 4], 40, n=3)
  engine.submit(asked.request)
  _turn_until(engine, lambda: all(len(t) >= 2 for t in asked.tokens))
  assert len(engine._rows) == 3
  # Greedy: the three choices are one text.
  assert asked.tokens[0][:2] == asked.tokens[1][:2] == asked.tokens[2][:2]
  engine.release(asked.request)
  engine._turn()
  assert engine._rows == [] and engine.metrics.outcomes['released'] == 1
  # A request that waits for rows (more choices than are free) waits; one past the queue's bound is refused.
  from paxcli.loops.serve.engine import QueueFull
  small = _engine(slots, max_queue=2)
  small.submit(Asked([1, 2], 5).request)
  small.submit(Asked([1, 2], 5).request)
  with pytest.raises(QueueFull):
    small.submit(Asked([1, 2], 5).request)
  assert small.metrics.outcomes['refused'] == 1
