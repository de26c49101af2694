"""Where decodes are written: JSONL files under <job dir>/decoder_out/<dataset|prompts>/, and the
trainer's TensorBoard text under <job dir>/summaries/decode."""

from __future__ import annotations

import json
import math
from typing import Optional, Sequence

from paxcli.errors import UserError, shorten
from paxcli.jobdir import layout, storage


def output_path(job_dir: str, dataset: Optional[str], step: int) -> str:
  """Where the trainer writes its decodes at `step` (decode_interval_steps)."""
  return layout.train_decodes(job_dir, dataset, step)


def summaries_dir(job_dir: str) -> str:
  """The trainer's decodes as TensorBoard text."""
  return layout.summaries(job_dir, 'decode')


def cli_output_path(job_dir: str, dataset: Optional[str], step: int) -> str:
  """`pax decode`'s default output: pax_decode_step<k>_<n>.jsonl with the first unused n, beside the
  trainer's decode_step<k>.jsonl and never replacing it or an earlier `pax decode`."""
  return layout.first_unused(lambda n: layout.cli_decodes(job_dir, dataset, step, n))


def check_output(path: str) -> None:
  """UserError now, before any decoding, if `path` cannot be written (its directory may be made later)."""
  storage.check_new_file(path, '--output')


def write_jsonl(path: str, records: Sequence[dict]) -> None:
  """Process 0 writes the whole file atomically (a reader never sees half of it)."""
  try:
    storage.write_text(path, ''.join(json.dumps(r, allow_nan=False) + '\n' for r in records))
  except OSError as e:
    raise UserError(f'Cannot write {shorten(path, 200)}: {e.strerror}.') from None


def finite_or_none(x: float) -> Optional[float]:
  """JSON has no NaN or Infinity: a non-finite figure is written as null."""
  return x if math.isfinite(x) else None
