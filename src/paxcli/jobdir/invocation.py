"""The command line of this invocation, and the job directory's records of them.

Every `pax train` / `pax eval` on a job directory appends one line to its
`invocations.txt` (never rewritten): the UTC time, paxcli's version and the command
line, so a run's history stays readable after resumes with other settings.

Every `pax train` start and resume also appends how the job is made to `experiment.jsonl`: the
experiment and the --set overrides, as JSON, so that the commands that read a job (eval, decode,
score, inspect-input, bench, convert) given only its directory use what it was trained with (the
last line: the latest start). The experiment is recorded by a name that means the same from any
directory (a registered name, or an absolute file path), and a --set whose value the experiment
made into an absolute path (TRAIN_DATA, INIT_FROM, BASE...) is recorded with that path.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shlex
import sys
from typing import Callable, Optional, Sequence

from paxcli import files, gencode, version
from paxcli.errors import UserError, shorten
from paxcli.jobdir import layout, storage
from paxcli.values import parse_value

MAX_RECORD_BYTES = 1 << 20   # one line of experiment.jsonl: a long list of --set values, never megabytes
MAX_RECORDS_BYTES = 64 << 20  # experiment.jsonl in a bucket, read whole: thousands of resumes

_argv: Optional[list[str]] = None  # set by the CLI's main(); else sys.argv


def set_argv(argv: list[str]) -> None:
  global _argv
  _argv = list(argv)


def command_line() -> str:
  argv = _argv if _argv is not None else sys.argv[1:]
  return shlex.join(['pax', *argv])


def record(job_dir: str) -> None:
  """Appends `<UTC time>  paxcli <version>  <command line>` to job_dir/invocations.txt."""
  storage.makedirs(job_dir)
  now = datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')
  storage.append_text(layout.invocations(job_dir), f'{now}  paxcli {version.current()}  {command_line()}\n')


@dataclasses.dataclass(frozen=True)
class Made:
  """How a job was made: its experiment and --set overrides, as the latest `pax train` gave them."""
  experiment: str
  overrides: tuple[str, ...] = ()

  def without_layout(self) -> Made:
    """The record without its mesh and pipeline settings (LAYOUT_KNOBS)."""
    return Made(self.experiment, tuple(o for o in self.overrides if key_of(o) not in LAYOUT_KNOBS))

  def replayable(self, allowed: Callable[[str], bool]) -> tuple[Made, tuple[str, ...]]:
    """(the record with only the overrides whose key `allowed` admits, the keys of those left out, once each):
    a record read back sets model and data knobs only (Experiment.replayable)."""
    kept = tuple(o for o in self.overrides if allowed(key_of(o)))
    left = tuple(dict.fromkeys(key_of(o) for o in self.overrides if not allowed(key_of(o))))
    return Made(self.experiment, kept), left

  def command(self) -> str:
    """`--exp E --set A=1 ...`: what to type to use them."""
    return shlex.join(['--exp', self.experiment, *(a for o in self.overrides for a in ('--set', o))])


# How a run is laid out on its devices, not what it computes: a checkpoint restores onto any mesh. A
# command reading a job that gives one of these lays its own run out: the job's are left out, all of them.
LAYOUT_KNOBS = ('ICI_MESH_SHAPE', 'DCN_MESH_SHAPE', 'NUM_STAGES', 'NUM_MICROBATCHES', 'MICROBATCH_SIZE',
                'PIPELINE_CIRCULAR_REPEAT', 'CONTEXT_PARALLEL_STRATEGY', 'CONTEXT_LOAD_BALANCE')


def key_of(override: str) -> str:
  """The KEY of a KEY=VALUE override."""
  return override.split('=', 1)[0].strip()


def record_made(job_dir: str, made: Made) -> None:
  """Appends one line for this start or resume to job_dir/experiment.jsonl (never rewritten). An
  experiment file that is a recipe as paxcli writes them (knobs only: `pax checkpoint convert --from hf`,
  `pax import-maxtext`) is kept beside it (layout.RECIPE_COPY), which readers of the job read as data."""
  _keep_recipe(job_dir, made.experiment)
  now = datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')
  line = json.dumps({'time': now, 'paxcli': version.current(), 'experiment': made.experiment,
                     'overrides': list(made.overrides)})
  storage.makedirs(job_dir)
  storage.append_text(layout.made(job_dir), line + '\n')   # one line, whole: a local append is one write


def _keep_recipe(job_dir: str, experiment: str) -> None:
  if ':' not in experiment:
    return
  path = experiment.rsplit(':', 1)[0]
  try:
    text = files.read_text(path, 'recipe', MAX_RECORD_BYTES)
    gencode.check_shape(text, path)
  except UserError:
    return   # a user's own experiment file: readers of the job are asked to name it with --exp
  storage.write_text(layout.recipe_copy(job_dir), text)


def read_made(job_dir: str) -> Optional[Made]:
  """The latest record of job_dir/experiment.jsonl, None without one; a malformed one is a UserError."""
  path = layout.made(job_dir)
  if not storage.exists(path):
    return None
  lines = [line for line in _tail(path).split(b'\n') if line.strip()]
  if not lines:
    return None
  record = files.parse_json(lines[-1], f'the last line of {path}')
  experiment, overrides = (record.get('experiment'), record.get('overrides')) if isinstance(record, dict) else (0, 0)
  if not (isinstance(experiment, str) and experiment and isinstance(overrides, list)
          and all(isinstance(o, str) and '=' in o for o in overrides)):
    raise UserError(f'{path}: its last line is not a job record ({{"experiment": NAME, "overrides": [KEY=VALUE, '
                    f'...]}}): {shorten(lines[-1].decode("utf-8", "replace"), 120)}. Pass --exp and --set yourself.')
  return Made(experiment, tuple(overrides))


def _tail(path: str) -> bytes:
  """The last MAX_RECORD_BYTES of the record file (its last lines), read bounded."""
  if not storage.is_local(path):
    data = storage.read_bytes(path, MAX_RECORDS_BYTES)
    if len(data) > MAX_RECORDS_BYTES:
      raise UserError(f'{path} is over {MAX_RECORDS_BYTES:,} bytes; is it the job\'s record?')
    return data[-MAX_RECORD_BYTES:]
  size = files.check_regular_file(path, 'the job record')
  with open(path, 'rb') as f:
    f.seek(max(0, size - MAX_RECORD_BYTES))
    return f.read(MAX_RECORD_BYTES)


def made_by_config(job_dir: str) -> Optional[Made]:
  """For a job without experiment.jsonl (trained by an older paxcli, or written by a conversion): the
  experiment its config.txt is headed by (`# experiment: NAME`), with no --set; None without one."""
  path = layout.config(job_dir)
  if not storage.isfile(path):
    return None
  first = storage.read_bytes(path, 4096)[:4096].split(b'\n', 1)[0].decode('utf-8', 'replace').strip()
  name = first[len('# experiment:'):].strip() if first.startswith('# experiment:') else ''
  return Made(name) if name else None


def portable_overrides(overrides: Sequence[str], resolved_values: set) -> tuple[str, ...]:
  """`overrides` as they mean the same from any directory: a knob whose value (a path, or the keys of
  a {path: weight} mixture) the experiment anchored (its absolute form is among `resolved_values`, the
  strings of the resolved config) is written with the absolute path. Other values stay as given."""
  out = []
  for item in overrides:
    key, raw = key_of(item), item.partition('=')[2]
    value = parse_value(raw)
    if key.isupper() and isinstance(value, (str, dict)):
      anchored = _anchor(value, resolved_values)
      if anchored != value:
        item = f'{key}={_raw(anchored)}'
    out.append(item)
  return tuple(out)


def _raw(value) -> str:
  """`value` as a --set takes it: a string as itself where the --set parser reads it back unchanged
  (`/data/*.jsonl`), else as a Python literal (`'None'`, `{'/a': 2}`)."""
  return value if isinstance(value, str) and parse_value(value) == value else repr(value)


def _anchor(value, known: set):
  def one(path):
    if not isinstance(path, str) or not path or '://' in path:
      return path
    absolute = os.path.abspath(os.path.expanduser(path))
    return absolute if absolute in known else path
  return {one(k): v for k, v in value.items()} if isinstance(value, dict) else one(value)


def strings_in(value, out: Optional[set] = None) -> set:
  """Every string in a nested value (dict keys included): what portable_overrides looks paths up in."""
  out = set() if out is None else out
  if isinstance(value, str):
    out.add(value)
  elif isinstance(value, dict):
    for k, v in value.items():
      strings_in(k, out)
      strings_in(v, out)
  elif isinstance(value, (list, tuple, set)):
    for v in value:
      strings_in(v, out)
  return out
