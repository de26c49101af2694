"""The format version of job directories and checkpoints: what a later paxcli promises to read.

Every checkpoint's metadata carries `format_version` (and the paxcli version that wrote it), and
every job directory a command writes holds `format.json` with the newest format written into it.
Nothing before paxcli 0.2.0 wrote either: those are format 0. A paxcli reads every format up to
its own FORMAT_VERSION (the tests restore a fixture of each: tests/test_old_formats.py) and
refuses a newer one in one line, instead of misreading it.

Bump FORMAT_VERSION when a change means an older paxcli could not read what this one writes;
add a fixture of the new format (tests/fixtures/formats/make_fixtures.py) and keep the old ones.
"""

from __future__ import annotations

import json
import os

from paxcli import version
from paxcli import files
from paxcli.errors import UserError
from paxcli.jobdir import layout
from paxcli.jobdir import storage

FORMAT_VERSION = 1
KEY = 'format_version'


def stamp(meta: dict) -> dict:
  """A checkpoint's metadata with the format and paxcli version that write it."""
  return {**meta, KEY: FORMAT_VERSION, 'paxcli_version': version.current()}


def of(record: dict) -> int:
  """The format of a checkpoint's metadata or a format.json (0: written before formats had a number)."""
  value = record.get(KEY, 0)
  return value if isinstance(value, int) and not isinstance(value, bool) else -1


def check(record: dict, what: str) -> None:
  """Refuses what a newer paxcli wrote (or a format that is not a number) in one line."""
  found = of(record)
  if found < 0:
    raise UserError(f'{what} has {KEY} {record.get(KEY)!r}, not a number: it was not written by paxcli.')
  if found > FORMAT_VERSION:
    writer = record.get('paxcli_version')
    by = f' by paxcli {writer}' if isinstance(writer, str) else ''
    raise UserError(f'{what} was written{by} in format {found}; this paxcli ({version.current()}) reads formats up to '
                    f'{FORMAT_VERSION}. Upgrade paxcli to read it.')


def check_job(job_dir: str) -> None:
  """Refuses a job directory a newer paxcli wrote into (a missing format.json is format 0)."""
  path = layout.format_file(job_dir)
  what = 'The job directory\'s format file'
  if storage.is_local(path):
    if not os.path.lexists(path):
      return
    record = files.read_json(path, what, 64 * 1024)
  elif storage.exists(path):   # a bucket job: the same bounded parse of the object's bytes
    data = storage.read_bytes(path, 64 * 1024)
    if len(data) > 64 * 1024:
      raise UserError(f'{what} {path} is over 64 KiB: it was not written by paxcli.')
    record = files.parse_json(data, f'{what} {path}')
  else:
    return
  check(record if isinstance(record, dict) else {KEY: None}, path)


def write_job(job_dir: str) -> None:
  """Marks a job directory with this paxcli's format (never lowering a newer one: check_job refused that)."""
  data = json.dumps({KEY: FORMAT_VERSION, 'paxcli_version': version.current()}).encode() + b'\n'
  if storage.is_local(job_dir):
    files.atomic_write(layout.format_file(job_dir), data)
  else:
    storage.write_bytes(layout.format_file(job_dir), data)
