"""Teacher-forced scoring: each token's log-probability under the model, and whether it is the argmax.

    scorer = Scorer(setup, params)
    results, stats = scorer.run(pairs)      # per pair: (token logprobs, every token greedy?)

The scorer knows the model only through paxcli.models.DecodingModel, as the decoder does: one
`extend` over a fresh cache is the forward pass (the decoder's prefill), so a score equals the
`token_logprobs` `pax decode` reports for the same tokens. Pairs are sorted by length, longest
first, and batched; each batch is LEFT-PADDED to a length bucket (a power of two, at most
MAX_SEQ_LEN, so that a file compiles a handful of shapes) with positions 0.. for each row's own
tokens and -1 at padding, which is never attended to: a pair scores the same in any batch as
alone. Rows are split over the mesh's (replica, data) axes as in decode.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from paxcli.errors import UserError
from paxcli.loops.score.requests import Pair
from paxcli.models.base import DecodingModel
from paxcli.runtime import sharding

MAX_ROWS = 64              # rows per batch by default ...
TOKENS_PER_BATCH = 4096    # ... and at most this many tokens


def bucket(length: int, max_len: int) -> int:
  """The padded length of a batch whose longest row has `length` tokens: a power of two (at least 8)."""
  return min(max_len, max(8, 1 << (length - 1).bit_length()))


class Scorer:
  """One jitted forward pass per (rows, length) on the setup's mesh; `run` scores pairs."""

  def __init__(self, setup, params, dtype: Optional[str] = None):
    model = setup.model
    if not isinstance(model, DecodingModel):
      raise UserError(f"This experiment's model, a {type(model).__name__}, does not predict tokens: scoring needs a "
                      'paxcli.models.DecodingModel (init_cache and extend), such as the LanguageModel.')
    self.setup = setup
    self.mesh = setup.mesh
    self.model = model.with_fprop_dtype(dtype) if dtype else model
    self.params = params
    self.max_seq_len = model.max_seq_len
    self.vocab_size = model.vocab_size
    self._fns = {}
    self.compile_seconds = 0.0

  def _compiled(self, rows: int, length: int):
    if (rows, length) in self._fns:
      return self._fns[(rows, length)]
    model = self.model
    sds = jax.ShapeDtypeStruct
    params_abs = jax.tree.map(lambda x: sds(x.shape, x.dtype), self.params)
    batch_sh = sharding.batch_sharding(self.mesh)
    rep = NamedSharding(self.mesh, PartitionSpec())

    def score(params, ids_BxL, pos_BxL, targets_BxL):
      cache = nn.meta.unbox(model.init_cache(params, rows, length))
      if hasattr(model, 'extend_scores'):   # the logits made a chunk at a time (LOSS_CHUNK_TOKENS)
        return model.extend_scores(params, cache, ids_BxL, pos_BxL, targets_BxL)[:2]
      logits_BxLxV, _ = model.extend(params, cache, ids_BxL, pos_BxL)
      # log_softmax at the target only: no second [rows, length, vocab] array
      target_BxL = jnp.take_along_axis(logits_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
      logp_BxL = target_BxL - jax.nn.logsumexp(logits_BxLxV, axis=-1)
      return logp_BxL, jnp.argmax(logits_BxLxV, axis=-1) == targets_BxL

    start = time.perf_counter()
    ids_abs = sds((rows, length), jnp.int32)
    fn = jax.jit(score, in_shardings=(self.setup.state_shardings['params'], batch_sh, batch_sh, batch_sh),
                 out_shardings=(rep, rep)).lower(params_abs, ids_abs, ids_abs, ids_abs).compile()
    self.compile_seconds += time.perf_counter() - start
    self._fns[(rows, length)] = fn
    return fn

  def batch_shape(self, length: int, batch_size: int, left: int) -> tuple[int, int]:
    """(pairs, rows) of a batch of `length` tokens with `left` pairs to go: `batch_size` pairs, or by
    default up to MAX_ROWS within TOKENS_PER_BATCH and no more than the power of two that holds
    `left` (a short file computes no empty rows); rows a multiple of the data-parallel size (the
    rows past the pairs repeat the first)."""
    want = batch_size or min(max(1, min(MAX_ROWS, TOKENS_PER_BATCH // length)), 1 << (left - 1).bit_length())
    dp = sharding.data_parallel_size(self.mesh)
    return want, -(-want // dp) * dp

  def run(self, pairs: Sequence[Pair], batch_size: int = 0,
          progress: Optional[Callable[[int], None]] = None) -> tuple[list[tuple[list, bool]], dict]:
    """(token logprobs of each pair's scored tokens, whether each is the argmax) in pair order; stats."""
    order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i].tokens))
    results: list = [None] * len(pairs)
    stats = {'tokens': 0, 'scored_tokens': 0, 'seconds': 0.0}
    compiled_before = self.compile_seconds
    batch_sh = sharding.batch_sharding(self.mesh)
    start = 0
    while start < len(order):
      length = bucket(len(pairs[order[start]].tokens) - 1, self.max_seq_len)
      take, rows = self.batch_shape(length, batch_size, len(order) - start)
      chunk = order[start:start + take]
      fn = self._compiled(rows, length)
      ids, pos, targets = _batch([pairs[i] for i in chunk], rows, length)
      t0 = time.perf_counter()
      logp, greedy = fn(self.params, *(sharding.from_host(x, batch_sh) for x in (ids, pos, targets)))
      logp, greedy = sharding.to_host(logp), sharding.to_host(greedy)
      stats['seconds'] += time.perf_counter() - t0
      for r, i in enumerate(chunk):
        n = pairs[i].scored
        results[i] = ([float(x) for x in logp[r, length - n:]], bool(greedy[r, length - n:].all()))
        stats['tokens'] += len(pairs[i].tokens) - 1
        stats['scored_tokens'] += n
      if progress:
        progress(len(chunk))
      start += len(chunk)
    stats['compile_s'] = self.compile_seconds - compiled_before
    return results, stats


def _batch(pairs: Sequence[Pair], rows: int, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Left-padded inputs (tokens[:-1]), positions (-1 at padding) and targets (tokens[1:]); rows past
  the pairs repeat the first pair (their results are dropped)."""
  ids = np.zeros((rows, length), np.int32)
  pos = np.full((rows, length), -1, np.int32)
  targets = np.zeros((rows, length), np.int32)
  for r in range(rows):
    tokens = pairs[r if r < len(pairs) else 0].tokens
    n = len(tokens) - 1
    ids[r, length - n:] = tokens[:-1]
    targets[r, length - n:] = tokens[1:]
    pos[r, length - n:] = np.arange(n)
  return ids, pos, targets
