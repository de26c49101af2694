"""Where decodes are written: JSONL files under <job dir>/decoder_out/<dataset|prompts>/, and the
trainer's TensorBoard text under <job dir>/summaries/decode."""

from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Optional, Sequence

from paxcli.errors import UserError, shorten
from paxcli.jobdir import layout


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
  shown = shorten(path, 200)
  full = os.path.abspath(path)
  if os.path.isdir(full):
    raise UserError(f'--output {shown} is a directory; give a file name.')
  probe = os.path.dirname(full)
  while not os.path.lexists(probe):  # the nearest existing ancestor: its directories are made at the end
    probe = os.path.dirname(probe)
  if not os.path.isdir(probe):
    raise UserError(f'Cannot write {shown}: {probe} is not a directory.')
  try:
    with tempfile.TemporaryFile(dir=probe):
      pass
  except OSError as e:
    raise UserError(f'Cannot write {shown}: {probe} is not writable ({e.strerror}).') from None


def write_jsonl(path: str, records: Sequence[dict]) -> None:
  """Process 0 writes the whole file atomically (a reader never sees half of it)."""
  try:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + '.tmp'
    with open(tmp, 'w', encoding='utf-8') as f:
      for r in records:
        f.write(json.dumps(r, allow_nan=False) + '\n')
    os.replace(tmp, path)
  except OSError as e:
    raise UserError(f'Cannot write {shorten(path, 200)}: {e.strerror}.') from None


def finite_or_none(x: float) -> Optional[float]:
  """JSON has no NaN or Infinity: a non-finite figure is written as null."""
  return x if math.isfinite(x) else None
