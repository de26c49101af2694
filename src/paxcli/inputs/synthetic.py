"""A deterministic synthetic LM input that a model can learn.

Each global batch `i` is a function of (seed, i) alone, and host h of n takes rows
[h*b, (h+1)*b) of it, so the data (and a run's losses) do not depend on how many
processes feed the run. Each row counts up from a random start with a random stride
(mod vocab) after a prefix of 4 random tokens, so from the sixth token on the rest is
predictable and the loss falls quickly, while rows are (almost surely) all different.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paxcli.inputs.base import BaseInput, EndOfInput


@dataclasses.dataclass
class SyntheticLmInput(BaseInput):
  seq_len: int = 64
  vocab_size: int = 256
  num_batches: int = 0  # >0: a finite input of that many global batches (when repeat=False)

  def _next_batch(self, index: int) -> dict[str, np.ndarray]:
    if self.num_batches and not self.repeat and index >= self.num_batches:
      raise EndOfInput(self.name)
    if self.num_batches:
      index %= self.num_batches
    rows = self.global_batch_size
    rng = np.random.default_rng([self.seed, index])
    start = rng.integers(0, self.vocab_size, size=(rows, 1))
    stride = rng.integers(1, 4, size=(rows, 1))
    tokens = (start + stride * np.arange(self.seq_len + 1)[None]) % self.vocab_size
    prefix = min(4, self.seq_len + 1)
    tokens[:, :prefix] = rng.integers(0, self.vocab_size, size=(rows, prefix))
    tokens = tokens[self.host_rows()].astype(np.int32)
    return {
        'ids': tokens[:, :-1],
        'labels': tokens[:, 1:],
        'weights': np.ones((self.batch_size, self.seq_len), np.float32),
    }
