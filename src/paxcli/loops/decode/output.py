"""Where decodes are written: JSONL files under <job dir>/decoder_out/<dataset|prompts>/, and the
trainer's TensorBoard text under <job dir>/summaries/decode."""

from __future__ import annotations

import json
import math
from typing import Optional, Sequence

from paxcli import files
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


def check_output(path: str, force: bool = False, inputs: Sequence[str] = ()) -> None:
  """UserError now, before any decoding or scoring, if `path` is no place for the JSONL: a local path as
  files.check_output says, a bucket object as storage.check_new_file does; an existing one only with force."""
  if storage.is_local(path):
    files.check_output(path, '--output', force=force, inputs=inputs)
    return
  storage.check_new_file(path, '--output')
  if not force and storage.exists(path):
    raise UserError(f'--output {shorten(path, 200)} exists; pass --force to replace it, or give another path.')


def write_jsonl(path: str, records: Sequence[dict]) -> None:
  """Process 0 writes the whole file at once (files.write_output, storage for a bucket: a reader never
  sees half of it)."""
  text = ''.join(json_line(r) for r in records)
  if storage.is_local(path):
    files.write_output(path, text, 'the results')
    return
  try:
    storage.write_text(path, text)
  except OSError as e:
    raise UserError(f'Cannot write {shorten(path, 200)}: {e.strerror}.') from None


def json_line(record: dict) -> str:
  """One JSON line; a float JSON cannot hold (NaN, infinity) is written as null, as finite_or_none does."""
  try:
    return json.dumps(record, allow_nan=False) + '\n'
  except ValueError:
    return json.dumps(_finite(record), allow_nan=False) + '\n'


def _finite(value):
  if isinstance(value, float):
    return finite_or_none(value)
  if isinstance(value, dict):
    return {k: _finite(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_finite(v) for v in value]
  return value


def finite_or_none(x: float) -> Optional[float]:
  """JSON has no NaN or Infinity: a non-finite figure is written as null."""
  return x if math.isfinite(x) else None
