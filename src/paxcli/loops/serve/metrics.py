"""`pax serve`'s /metrics: counters and gauges of the engine in Prometheus' text format (version 0.0.4).

    metrics = Metrics()            # the engine counts into it from its thread
    text = metrics.render(extra)   # what GET /metrics answers

Queue depth and running sequences are gauges of the engine's last turn; tokens/s is the new tokens of
the last WINDOW seconds over those seconds; time to first token (from a request's arrival to its
first new token) is a histogram, with its p50 and p99 over the last requests as gauges besides.
"""

from __future__ import annotations

import bisect
import collections
import threading
import time
from typing import Optional

PREFIX = 'pax_serve_'
WINDOW = 10.0                                            # seconds of tokens/s
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)
RECENT = 1000                                            # requests the TTFT quantiles are taken over


class Metrics:
  """What the engine counts, safe to update from its thread and read from the server's."""

  def __init__(self):
    self._lock = threading.Lock()
    self.started = time.monotonic()
    self.outcomes = collections.Counter()      # requests by how they ended: done, released, refused, error
    self.prompt = self.generated = 0
    self.decode_seconds = 0.0
    self.queue = self.rows = 0
    self._recent_tokens: collections.deque = collections.deque()   # (time, tokens)
    self._ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
    self._ttft_sum, self._ttft_recent = 0.0, collections.deque(maxlen=RECENT)

  def queued(self, waiting: int) -> None:
    with self._lock:
      self.queue = waiting

  def running(self, rows: int, waiting: int) -> None:
    with self._lock:
      self.rows, self.queue = rows, waiting

  def refused(self) -> None:
    with self._lock:
      self.outcomes['refused'] += 1

  def failed(self) -> None:
    with self._lock:
      self.outcomes['error'] += 1

  def prompt_tokens(self, n: int) -> None:
    with self._lock:
      self.prompt += n

  def decoded(self, tokens: int, seconds: float) -> None:
    now = time.monotonic()
    with self._lock:
      self.generated += tokens
      self.decode_seconds += seconds
      self._recent_tokens.append((now, tokens))
      while self._recent_tokens and self._recent_tokens[0][0] < now - WINDOW:
        self._recent_tokens.popleft()

  def first_token(self, seconds: float) -> None:
    with self._lock:
      self._ttft_counts[bisect.bisect_left(TTFT_BUCKETS, seconds)] += 1
      self._ttft_sum += seconds
      self._ttft_recent.append(seconds)

  def finished(self, outcome: str) -> None:
    with self._lock:
      self.outcomes[outcome] += 1

  def tokens_per_second(self) -> float:
    now = time.monotonic()
    with self._lock:
      tokens = sum(n for t, n in self._recent_tokens if t >= now - WINDOW)
    return tokens / max(1e-9, min(WINDOW, now - self.started))

  def ttft_quantile(self, q: float) -> Optional[float]:
    with self._lock:
      recent = sorted(self._ttft_recent)
    return recent[min(len(recent) - 1, int(q * len(recent)))] if recent else None

  def render(self, gauges: Optional[dict] = None) -> str:
    """The Prometheus text of every metric; `gauges`: more (name -> (help, value)), e.g. the cache's shape."""
    lines = []

    def metric(name, kind, help_text, samples):
      lines.append(f'# HELP {PREFIX}{name} {help_text}')
      lines.append(f'# TYPE {PREFIX}{name} {kind}')
      for suffix, labels, value in samples:
        label = '{' + ','.join(f'{k}="{v}"' for k, v in labels.items()) + '}' if labels else ''
        lines.append(f'{PREFIX}{name}{suffix}{label} {_number(value)}')

    tokens_per_second = self.tokens_per_second()
    p50, p99 = self.ttft_quantile(0.5), self.ttft_quantile(0.99)
    with self._lock:
      metric('queue_depth', 'gauge', 'Requests waiting for a row of the KV cache.', [('', {}, self.queue)])
      metric('running_sequences', 'gauge', 'Choices decoding now (rows of the KV cache in use).',
             [('', {}, self.rows)])
      metric('generation_tokens_per_second', 'gauge', f'New tokens per second over the last {WINDOW:g} s.',
             [('', {}, tokens_per_second)])
      metric('prompt_tokens', 'counter', 'Prompt tokens prefilled.', [('_total', {}, self.prompt)])
      metric('generation_tokens', 'counter', 'New tokens chosen.', [('_total', {}, self.generated)])
      metric('decode_seconds', 'counter', 'Seconds the device spent decoding.', [('_total', {}, self.decode_seconds)])
      metric('requests', 'counter', 'Requests by how they ended: done, released (the client left or a stop '
             'string was reached), refused (the queue was full), error.',
             [('_total', {'outcome': k}, self.outcomes[k]) for k in ('done', 'released', 'refused', 'error')])
      cumulative, samples = 0, []
      for bound, count in zip(TTFT_BUCKETS + (float('inf'),), self._ttft_counts):
        cumulative += count
        samples.append(('_bucket', {'le': _number(bound)}, cumulative))
      samples += [('_sum', {}, self._ttft_sum), ('_count', {}, cumulative)]
      metric('time_to_first_token_seconds', 'histogram', 'From a request\'s arrival to its first new token.',
             samples)
    for name, q in (('p50', p50), ('p99', p99)):
      metric(f'time_to_first_token_seconds_{name}', 'gauge', f'The {name} of the time to first token over the '
             f'last {RECENT} requests (NaN before the first).', [('', {}, float('nan') if q is None else q)])
    for name, (help_text, value) in (gauges or {}).items():
      metric(name, 'gauge', help_text, [('', {}, value)])
    return '\n'.join(lines) + '\n'


def _number(value) -> str:
  if isinstance(value, float):
    if value != value:
      return 'NaN'
    if value in (float('inf'), float('-inf')):
      return '+Inf' if value > 0 else '-Inf'
    return repr(value)
  return str(value)
