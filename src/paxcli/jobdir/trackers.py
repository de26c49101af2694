"""Trackers beside TensorBoard: Weights & Biases and MLflow get the scalars TensorBoard gets.

    TRACKERS = ['wandb', 'mlflow']      # a knob (or --set TRACKERS="['wandb']")

The trainer (process 0) opens a `Trackers` once its state is ready; every SummaryWriter given it
(the train summaries, the in-training evals) hands each scalar to it with the name of its
TensorBoard directory in front (`train/loss`, `eval/loss`), at the same step: one place scalars
go out. Each tracker logs from a thread of its own, so a tracker that is slow or cannot connect
never holds up a step: the failure is one warning line (and one more when it works again), and
the scalars are still in TensorBoard and the metrics JSONL.

A tracker's run is the job directory's: its id is kept in `<job>/trackers/<name>.json` (layout.py),
and a resumed run continues it instead of starting another. Where a run goes (the W&B project and
entity, the MLflow store and experiment) comes only from this invocation: the knobs, else the
library's own environment variable (WANDB_PROJECT, WANDB_ENTITY, MLFLOW_TRACKING_URI,
MLFLOW_EXPERIMENT_NAME), else paxcli's defaults. A job directory is received data (it is copied,
synced, restored): its record holds the run id (checked: letters, digits, `-` and `_`, at most 64) and
a digest of the destination it was logged to, never the destination itself, so a record can only
make a resume continue a run at the place this invocation chose (the digests match), never send
metrics or the config elsewhere.
Neither library is a dependency of paxcli (`pip install 'paxcli[trackers]'`); one asked for but not
installed is one line before any compile (`check_installed`).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.util
import json
import os
import pathlib
import queue
import re
import secrets
import string
import threading
import time
from typing import Any, Callable, Mapping, Optional

from paxcli import files, version
from paxcli.errors import UserError, printable, shorten
from paxcli.jobdir import layout, storage

NAMES = ('wandb', 'mlflow')
_PACKAGES = {'wandb': 'wandb', 'mlflow': 'mlflow-skinny'}  # name -> what pip installs
_SHOWN = {'wandb': 'W&B', 'mlflow': 'MLflow'}
DEFAULT_PROJECT = 'paxcli'  # W&B project and MLflow experiment when nothing names one
CLOSE_TIMEOUT_S = 30.0      # how long the end of a run waits for a tracker still sending
QUEUE_LIMIT = 10_000        # summaries a stalled tracker may hold before new ones are dropped
_START, _CLOSE = object(), object()  # a worker's first and last jobs, queued as steps
MAX_RECORD_BYTES = 1 << 20  # a trackers/<name>.json is a few hundred bytes


@dataclasses.dataclass(frozen=True)
class Identity:
  """What a tracker's run records of the paxcli run besides its scalars."""
  job_dir: str
  experiment: str
  config: Mapping[str, str]   # the resolved config, flattened, each value as its repr()
  config_text: str            # the config as config.txt holds it
  command: str                # the command line of this invocation


def check_installed(names) -> None:
  """One line for a tracker asked for whose library is not installed (before anything is built)."""
  for name in names:
    if name not in NAMES:  # the knob's type admits only these; a config edited by hand may not
      raise UserError(f'Unknown tracker {name!r}: TRACKERS takes {list(NAMES)}.')
    if importlib.util.find_spec(name) is None:
      raise UserError(f"TRACKERS={list(names)!r} asks for {_SHOWN[name]}, but the {name} package is not installed: "
                      f"pip install 'paxcli[trackers]' (or pip install {_PACKAGES[name]}), or leave {name!r} out of "
                      'TRACKERS.')


class Trackers:
  """The run's trackers: `scalars` hands each a copy (non-blocking); closing ends their runs.

  A context manager: leaving it with an exception marks the runs failed (KILLED for a stop by signal).
  """

  def __init__(self, workers: list[_Worker] = ()):
    self._workers = list(workers)

  def __bool__(self) -> bool:
    return bool(self._workers)

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    values = {k: float(v) for k, v in values.items()}
    for worker in self._workers:
      worker.put(step, values)

  def close(self, status: str = 'FINISHED') -> None:
    workers, self._workers = self._workers, []
    for worker in workers:
      worker.close(status)

  def __enter__(self) -> Trackers:
    return self

  def __exit__(self, exc_type, exc, tb) -> bool:
    if exc_type is None:
      self.close()
    else:
      self.close('KILLED' if issubclass(exc_type, (SystemExit, KeyboardInterrupt)) else 'FAILED')
    return False


def open_trackers(settings, identity: Identity, log: Callable[[str], None]) -> Trackers:
  """Starts (or continues) each tracker's run; `settings` is task.train.trackers (tasks.TrackersConfig).

  A run that cannot start (not logged in, a store that refuses) is a UserError naming it; the
  trackers started before it are ended first.
  """
  workers = []
  try:
    for name in settings.names:
      backend = _BACKENDS[name](settings, identity, log)
      workers.append(_Worker(name, backend, log))
  except BaseException:
    Trackers(workers).close('FAILED')
    raise
  return Trackers(workers)


def _record_path(job_dir: str, name: str) -> str:
  return layout.tracker_run(job_dir, name)


# A run id as W&B and MLflow make them (W&B: 8 letters and digits; MLflow: 32 hex digits), and nothing that
# could be a path, a URL or a query: a record's id is used only as an id.
RUN_ID = re.compile(r'[A-Za-z0-9][A-Za-z0-9_-]{0,63}')


@dataclasses.dataclass(frozen=True)
class Record:
  """What a job keeps of a tracker's run: its id, and a digest of where it was logged (`place`)."""
  run_id: str
  place: Optional[str]


def place(*parts: Optional[str]) -> str:
  """A digest of a run's destination (tracker, project or store, ...): compared, never used to reach one."""
  return hashlib.sha256('\0'.join(p or '' for p in parts).encode()).hexdigest()[:32]


def read_record(job_dir: str, name: str, log: Callable[[str], None]) -> Optional[Record]:
  """The run a tracker recorded in the job directory, or None: none yet, or a record that cannot be read
  or holds no valid run id (said in a line; a new run is started and recorded in its place). A record
  written before digests were kept names its destination: that is only compared, as a digest."""
  path = _record_path(job_dir, name)
  if not storage.exists(path):
    return None
  size = storage.regular_file_size(path)
  try:
    if size is None or size > MAX_RECORD_BYTES:
      raise UserError('not a regular file' if size is None else f'{size:,} bytes')
    record = files.parse_json(storage.read_bytes(path, MAX_RECORD_BYTES), f'the {_SHOWN[name]} run record')
  except (UserError, OSError) as e:
    record = str(e)
  run_id = record.get('run_id') if isinstance(record, dict) else None
  if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
    why = record if isinstance(record, str) else ('it names no "run_id"' if run_id is None else
                                                  f'its run_id {shorten(json.dumps(run_id), 80)} is not a run id')
    log(f'{_SHOWN[name]}: cannot continue the run recorded in {path} ({printable(shorten(why, 200))}); starting a new '
        'run.')
    return None
  digest = record.get('place')
  if not isinstance(digest, str):
    legacy = ('project', 'entity') if name == 'wandb' else ('tracking_uri', 'experiment')
    digest = place(name, *(str(record[k]) if isinstance(record.get(k), str) else None for k in legacy))
  return Record(run_id, digest)


def _write_record(job_dir: str, name: str, run_id: str, digest: str) -> None:
  storage.write_text(_record_path(job_dir, name), json.dumps({'run_id': run_id, 'place': digest}, indent=2) + '\n')


def _new_run_id() -> str:
  """A W&B run id of our own (8 lowercase letters and digits, as W&B makes them), kept in the job."""
  return ''.join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _literal(text: str) -> Any:
  """A config value back from its repr() where it is a literal (numbers stay numbers in the UI)."""
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError, MemoryError, RecursionError):
    return text
  return value if isinstance(value, (int, float, str, bool, type(None), list, tuple, dict)) else text


class _Wandb:
  """A W&B run: started (or resumed by id) at once; log and finish from the worker thread."""

  name = 'wandb'

  def __init__(self, settings, identity: Identity, log):
    import wandb
    record = read_record(identity.job_dir, self.name, log)
    project = settings.wandb_project or os.environ.get('WANDB_PROJECT') or DEFAULT_PROJECT
    entity = settings.wandb_entity or os.environ.get('WANDB_ENTITY')
    here = place(self.name, project, entity)
    run_id = record.run_id if record and record.place == here else None
    if record and run_id is None:
      log(f'W&B: the job\'s run {record.run_id} was logged to another project or entity than this invocation\'s '
          f'({project!r}), so it starts a new run there (the job keeps only run ids: WANDB_PROJECT and '
          'WANDB_ENTITY, as knobs or environment variables, say where a run goes).')
    # W&B writes its files on this machine: in the job directory, or for a job in a bucket in ./wandb.
    directory = layout.tracker_dir(identity.job_dir) if storage.is_local(identity.job_dir) else None
    if directory:
      os.makedirs(directory, exist_ok=True)
    config = {k: _literal(v) for k, v in identity.config.items()}
    config['paxcli'] = {'job_dir': identity.job_dir, 'experiment': identity.experiment, 'version': version.current(),
                        'command': identity.command}
    try:
      self.run = wandb.init(
          project=project, entity=entity, id=run_id or _new_run_id(), resume='allow',
          name=settings.run_name or storage.basename(identity.job_dir), config=config, allow_val_change=True,
          dir=None if os.environ.get('WANDB_DIR') else directory,
          settings=wandb.Settings(console='off', silent=True))
    except Exception as e:  # wandb's errors (not logged in, no network, a refused project) are its own types
      raise UserError(f'W&B could not start a run in project {project!r}: {shorten(_first_line(e), 300)} (not logged in? '
                      '`wandb login` or WANDB_API_KEY; WANDB_MODE=offline keeps the run on disk for '
                      "`wandb sync`; or leave 'wandb' out of TRACKERS).") from None
    # W&B keeps one value per step: steps a resume repeats below the run's last one would be refused.
    self.first_step = int(getattr(self.run, 'starting_step', 0) or 0)
    self.skipped = 0
    url = None if self.run.offline else self.run.url  # (asking an offline run prints a W&B warning)
    _write_record(identity.job_dir, self.name, self.run.id, here)
    where = url or f'offline in {os.path.dirname(self.run.dir)} (`wandb sync` uploads it)'
    verb = 'continues' if run_id else 'started'
    log(f'W&B: {verb} run {self.run.id} ({self.run.name}), project {project}: {where}')

  def log(self, step: int, values: dict) -> None:
    if step < self.first_step:
      self.skipped += 1
      return
    self.run.log(values, step=step)

  def finish(self, status: str) -> None:
    self.run.finish(exit_code=0 if status == 'FINISHED' else 1)


class _Mlflow:
  """An MLflow run: created (or continued by id) at once, its parameters and config sent by the worker."""

  name = 'mlflow'
  PARAMS_PER_BATCH = 100  # MLflow's limit for one log_batch

  def __init__(self, settings, identity: Identity, log):
    record = read_record(identity.job_dir, self.name, log)
    uri = _absolute_uri(settings.mlflow_tracking_uri or os.environ.get('MLFLOW_TRACKING_URI')
                        or _mlflow_default_uri())
    experiment = settings.mlflow_experiment or os.environ.get('MLFLOW_EXPERIMENT_NAME') or DEFAULT_PROJECT
    here = place(self.name, uri, experiment)
    same_place = record is not None and record.place == here
    if record and not same_place:
      log(f'MLflow: the job\'s run {record.run_id} was logged to another store or experiment than this '
          f'invocation\'s ({experiment!r} at {uri}), so it starts a new run there (the job keeps only run ids: '
          'MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME, as knobs or environment variables, say where a run goes).')
    self.identity = identity
    try:
      self.client = _mlflow().tracking.MlflowClient(tracking_uri=uri)
      self.run_id, existing = self._run(record.run_id if same_place else None, experiment, settings, log)
    except Exception as e:  # MlflowException, and whatever its store raises (connection errors)
      raise UserError(f'MLflow could not start a run in experiment {experiment!r} at {uri}: '
                      f'{shorten(_first_line(e), 300)} (check the tracking URI: the MLFLOW_TRACKING_URI knob or '
                      "environment variable; or leave 'mlflow' out of TRACKERS).") from None
    self.params = existing
    _write_record(identity.job_dir, self.name, self.run_id, here)
    log(f'MLflow: {"continues" if existing is not None else "started"} run {self.run_id} in experiment {experiment} '
        f'at {uri}')

  def _run(self, run_id: Optional[str], experiment: str, settings, log) -> tuple[str, Optional[dict]]:
    """(run id, the parameters it already holds: None for a new run)."""
    client = self.client
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found else client.create_experiment(experiment)
    if run_id:
      try:
        run = client.get_run(run_id)
      except Exception as e:
        log(f'MLflow: the job\'s run {run_id} is not in the store ({shorten(_first_line(e), 120)}); starting a new run.')
      else:
        if run.info.experiment_id == experiment_id:
          client.update_run(run_id, status='RUNNING')
          return run_id, dict(run.data.params)
        log(f'MLflow: the job\'s run {run_id} belongs to another experiment of the store than {experiment!r}; starting '
            'a new run.')
    tags = {'paxcli.job_dir': self.identity.job_dir, 'paxcli.experiment': self.identity.experiment,
            'paxcli.version': version.current(), 'paxcli.command': self.identity.command[:5000]}
    run = client.create_run(experiment_id, run_name=settings.run_name or storage.basename(self.identity.job_dir),
                            tags=tags)
    return run.info.run_id, None

  def start(self) -> None:
    """The config: as parameters (a resumed run keeps its first values; a changed one becomes a
    `changed.<key>` tag, since MLflow refuses to change a parameter), and as the artifact config.txt."""
    entities = _mlflow().entities
    old = self.params or {}
    new = [entities.Param(k[:250], v[:6000]) for k, v in self.identity.config.items() if k[:250] not in old]
    changed = [entities.RunTag(f'changed.{k}'[:250], v[:5000]) for k, v in self.identity.config.items()
               if k[:250] in old and old[k[:250]] != v[:6000]]
    for start in range(0, len(new), self.PARAMS_PER_BATCH):
      self.client.log_batch(self.run_id, params=new[start:start + self.PARAMS_PER_BATCH])
    for start in range(0, len(changed), self.PARAMS_PER_BATCH):
      self.client.log_batch(self.run_id, tags=changed[start:start + self.PARAMS_PER_BATCH])
    self.client.log_text(self.run_id, self.identity.config_text, storage.basename(layout.config(self.identity.job_dir)))

  def log(self, step: int, values: dict) -> None:
    now = int(time.time() * 1000)
    metrics = [_mlflow().entities.Metric(_mlflow_key(k), v, now, step) for k, v in values.items()]
    for start in range(0, len(metrics), 1000):  # MLflow's limit of metrics per log_batch
      self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

  def finish(self, status: str) -> None:
    self.client.set_terminated(self.run_id, status=status)


_BACKENDS = {'wandb': _Wandb, 'mlflow': _Mlflow}


def _mlflow():
  """mlflow (its tracking client and entities), imported where an MLflow run is used: optional, and slow to import."""
  import mlflow.entities
  import mlflow.tracking
  return mlflow


def _mlflow_default_uri() -> str:
  return _mlflow().tracking.get_tracking_uri()


def _absolute_uri(uri: str) -> str:
  """A file: or sqlite: URI with a relative path made absolute now: a resume from another directory
  finds the same store, and the job's record names one place."""
  if uri.startswith('sqlite:///'):
    path = uri[len('sqlite:///'):]  # sqlite:///rel/path, sqlite:////abs/path
    return uri if os.path.isabs(path) else 'sqlite:///' + os.path.abspath(path)
  if uri.startswith('file:'):
    path = uri[len('file:'):]
    return uri if path.startswith('//') else pathlib.Path(os.path.abspath(path)).as_uri()  # file://host, file:///
  if '://' not in uri and not uri.startswith(('databricks', 'uc')):  # a bare path is a file store
    return pathlib.Path(os.path.abspath(uri)).as_uri()
  return uri


def _mlflow_key(key: str) -> str:
  """A metric name MLflow accepts (letters, digits, _ - . / and spaces)."""
  return ''.join(c if c.isalnum() or c in '_-./ ' else '_' for c in key)


def _first_line(e: BaseException) -> str:
  text = str(e).strip() or type(e).__name__
  return f'{type(e).__name__}: {text.splitlines()[0]}'


class _Worker:
  """One tracker's thread: sends what `put` queued, in order; failures become warning lines.

  The first failure of a streak is a line (the step, the error); the first success after one says
  how many summaries were lost; nothing it does stops or slows the trainer.
  """

  def __init__(self, name: str, backend, log):
    self.name, self.backend, self._log = name, backend, log
    self._queue: queue.Queue = queue.Queue(QUEUE_LIMIT)
    self.sent = self.failed = self.dropped = 0
    self._failing = 0
    if hasattr(backend, 'start'):
      self._queue.put((_START, None))
    self._thread = threading.Thread(target=self._run, name=f'paxcli-tracker-{name}', daemon=True)
    self._thread.start()

  def put(self, step: int, values: dict) -> None:
    try:
      self._queue.put_nowait((step, values))
    except queue.Full:
      self.dropped += 1

  def _run(self) -> None:
    while True:
      step, values = self._queue.get()
      if step is _CLOSE:
        return
      try:
        if step is _START:
          self.backend.start()
        else:
          self.backend.log(step, values)
      except Exception as e:  # whatever the library or its transport raises: the trainer goes on
        self._failed(step, e)
      else:
        self._recovered(step)

  def _failed(self, step, e: Exception) -> None:
    self.failed += 1
    self._failing += 1
    if self._failing == 1:
      what = 'the run\'s config' if step is _START else f'step {step}'
      self._log(f'warning: {_SHOWN[self.name]} could not log {what} ({shorten(_first_line(e), 200)}); training goes '
                'on, and the scalars are in TensorBoard and the metrics JSONL.')

  def _recovered(self, step) -> None:
    if step is _START:
      return
    self.sent += 1
    if self._failing:
      self._log(f'{_SHOWN[self.name]} logs again from step {step} ({self._failing} summaries before it were not '
                'logged).')
      self._failing = 0

  def close(self, status: str) -> None:
    """Sends what is queued (at most CLOSE_TIMEOUT_S), then ends the tracker's run with `status`."""
    shown = _SHOWN[self.name]
    deadline = time.monotonic() + CLOSE_TIMEOUT_S
    try:
      self._queue.put((_CLOSE, None), timeout=CLOSE_TIMEOUT_S)
    except queue.Full:
      pass
    self._thread.join(max(0.0, deadline - time.monotonic()))
    if self._thread.is_alive():
      self._log(f'warning: {shown} did not take the last summaries within {CLOSE_TIMEOUT_S:.0f} s; leaving them '
                '(they are in TensorBoard and the metrics JSONL).')
      return
    lost = self.failed + self.dropped
    if lost:
      self._log(f'warning: {shown}: {lost} summaries were not logged; TensorBoard and the metrics JSONL have them.')
    skipped = getattr(self.backend, 'skipped', 0)
    if skipped:
      self._log(f'{shown}: {skipped} summaries of steps the run already held (repeated after the resume) were not '
                'sent again.')
    try:
      self.backend.finish(status)
    except Exception as e:
      self._log(f'warning: {shown} could not end its run ({shorten(_first_line(e), 200)}).')
