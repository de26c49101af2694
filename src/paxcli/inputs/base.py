"""The input contract, as Pax users know it.

An input yields per-process batches: dicts of numpy arrays whose leading dimension is
`batch_size` (examples this process feeds per step). With several processes, process i
builds its input with `infeed_host_index=i` and `num_infeed_hosts=n`; the engine joins
the pieces into one global array. LM batches carry `ids`, `labels`, `weights` (0 for
padding) and optionally `segment_ids` and `positions` (packing).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

import numpy as np


class EndOfInput(Exception):
  """Raised by get_next() when a finite input is exhausted (Pax: tf.errors.OutOfRangeError)."""


@dataclasses.dataclass
class BaseInput:
  """Subclass and implement `_next_batch()`; override `get_next()` to post-process.

  Fields the engine fills in when left None: batch_size (the rows this process feeds),
  num_infeed_hosts and infeed_host_index (from which rows of the global batch each
  process's devices hold; see runtime.infeed.build_input).
  """
  name: str = 'train'
  is_training: bool = False
  batch_size: Optional[int] = None
  num_infeed_hosts: Optional[int] = None
  infeed_host_index: Optional[int] = None
  seed: int = 1234
  repeat: bool = True
  reset_for_eval: bool = False
  eval_loop_num_batches: Optional[int] = None

  def __post_init__(self):
    self._batches_read = 0

  # ---- the contract -----------------------------------------------------------------

  def get_next(self) -> dict[str, np.ndarray]:
    """The next per-process batch. Raises EndOfInput at the end of a finite input."""
    batch = self._next_batch(self._batches_read)
    self._batches_read += 1
    return batch

  def reset(self) -> None:
    """Back to the first batch (used by eval runs with reset_for_eval=True)."""
    self._batches_read = 0

  def skip(self, num_batches: int) -> None:
    """Moves the position forward by `num_batches` (used on resume)."""
    self._batches_read += num_batches

  @property
  def batches_read(self) -> int:
    return self._batches_read

  def ids_to_strings(self, ids: np.ndarray, lengths: Optional[np.ndarray] = None) -> list[str]:
    """Decodes token ids to text; inputs without a vocabulary show the ids."""
    return decode_rows(lambda tokens: ' '.join(map(str, tokens)), ids, lengths)

  def tokenizer_file(self) -> Optional[str]:
    """Path of the sentencepiece model this input's ids come from, or None (no tokenizer).

    `pax train` copies it into the job directory, where decode and conversion find it.
    """
    return None

  # ---- for subclasses ---------------------------------------------------------------

  def _next_batch(self, index: int) -> dict[str, np.ndarray]:
    raise NotImplementedError

  @property
  def global_batch_size(self) -> int:
    return self.batch_size * self.num_infeed_hosts

  def host_rows(self) -> slice:
    """This host's rows of a global batch (host i of n gets the i-th block)."""
    start = self.infeed_host_index * self.batch_size
    return slice(start, start + self.batch_size)


@dataclasses.dataclass
class StreamInput(BaseInput):
  """An input read as one stream of batches: `_open(start)` starts the stream at batch `start`
  (a reset or a resume opens it anew at the new position) and `_finish(batch)` shapes each batch."""

  def __post_init__(self):
    super().__post_init__()
    self._iterator: Optional[Iterator[dict]] = None

  def _open(self, start: int) -> Iterator[dict]:
    raise NotImplementedError

  def _finish(self, batch: dict) -> dict[str, np.ndarray]:
    return batch

  def get_next(self) -> dict[str, np.ndarray]:
    if self._iterator is None:
      self._iterator = self._open(self._batches_read)
    batch = next(self._iterator, None)
    if batch is None:
      raise EndOfInput(self.name)
    self._batches_read += 1
    return self._finish(batch)

  def reset(self) -> None:
    super().reset()
    self._iterator = None

  def skip(self, num_batches: int) -> None:
    super().skip(num_batches)
    self._iterator = None


def decode_rows(decode, ids, lengths=None) -> list[str]:
  """`decode(list of int)` applied to each row, cut at its length (default: the whole row)."""
  rows = np.asarray(ids)
  lengths = lengths if lengths is not None else [rows.shape[-1]] * rows.shape[0]
  return [decode([int(t) for t in row[:n]]) for row, n in zip(rows, lengths)]


def padding_like(batch: dict) -> dict:
  """A batch of the same shapes and dtypes, all zeros: zero weight, so it counts for nothing."""
  return {k: np.zeros_like(v) for k, v in batch.items()}
