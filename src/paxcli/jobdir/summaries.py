"""TensorBoard event files and a JSONL log.

Events are written with tensorboard's record writer and protos directly: its
EventFileWriter would import all of tensorflow (seconds, and memory) to open a file. Files go
through storage.Appender: in a bucket an event file is an object rewritten whole as it grows
(TensorBoard reads gs:// log directories itself).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import socket
import sys
import time
from typing import Mapping

from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
from tensorboard.summary.writer.record_writer import RecordWriter

from paxcli.jobdir import lock as joblock
from paxcli.jobdir import storage


class _EventFile:
  """`events.out.tfevents.*` files: TFRecord-framed Event protos.

  In a bucket, where a file is rewritten whole at each flush, a new file is started once one holds
  ROTATE_BYTES (TensorBoard reads every event file of a directory, in order).
  """
  ROTATE_BYTES = 1 << 20

  def __init__(self, logdir: str):
    self.logdir = logdir
    self._open()

  def _open(self) -> None:
    self.path = os.path.join(self.logdir, f'events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.{os.getpid()}')
    self._file = storage.Appender(self.path, truncate=True)
    self._records = RecordWriter(self._file)
    self._records.write(event_pb2.Event(wall_time=time.time(), file_version='brain.Event:2').SerializeToString())

  def add_event(self, event) -> None:
    if self._file.rewritten_whole and self._file.size() >= self.ROTATE_BYTES:
      self._file.close()
      self._open()
    self._records.write(event.SerializeToString())

  def flush(self) -> None:
    self._file.flush()

  def close(self) -> None:
    self._file.close()


class SummaryWriter:
  """Scalars to `<job>/summaries/<name>` event files and, optionally, a JSON-lines file.

  one_row_per_step: the JSON-lines file keeps one row per step, in step order (eval metrics,
  which several commands may write for one step); else rows are appended (train metrics).
  trackers: W&B / MLflow (paxcli.jobdir.trackers.Trackers) get the same scalars at the same step,
  named `<writer>/<tag>` after the TensorBoard directory (`train/loss`, `eval/loss`).
  """

  def __init__(self, logdir: str, jsonl_path: str | None = None, one_row_per_step: bool = False, trackers=None):
    storage.makedirs(logdir)
    self._writer = _EventFile(logdir)
    self._trackers, self._name = trackers, storage.basename(logdir.rstrip('/'))
    self._rows_path = jsonl_path if one_row_per_step else None
    self._jsonl = storage.Appender(jsonl_path) if jsonl_path and not one_row_per_step else None

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    summary = summary_pb2.Summary(value=[
        summary_pb2.Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()])
    self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))
    record = {'step': int(step), **{k: _jsonable(v) for k, v in values.items()}}
    if self._jsonl:
      self._jsonl.write((json.dumps(record) + '\n').encode())
      self._jsonl.flush()
    elif self._rows_path:
      joblock.put_row(self._rows_path, record)
    self._writer.flush()
    if self._trackers:  # after TensorBoard and the JSONL: a tracker never comes before them
      self._trackers.scalars(step, {f'{self._name}/{tag}': v for tag, v in values.items()})

  def text(self, step: int, tag: str, text: str) -> None:
    tensor = tensor_pb2.TensorProto(dtype=7, string_val=[text.encode()],  # 7 = DT_STRING
                                    tensor_shape=tensor_shape_pb2.TensorShapeProto())
    meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name='text'))
    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=meta)])
    self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

  def flush(self) -> None:
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()
    if self._jsonl:
      self._jsonl.close()


def _jsonable(v):
  v = float(v)
  return v if math.isfinite(v) else str(v)


def tensorboard_command() -> str:
  """How to start TensorBoard from this shell: the `tensorboard` installed beside this Python (a
  virtual environment's bin/ is often not on PATH), by a path relative to here when it is below here."""
  beside = os.path.join(os.path.dirname(sys.executable), 'tensorboard')
  if os.path.isfile(beside):
    on_path = shutil.which('tensorboard')
    if on_path and os.path.realpath(on_path) == os.path.realpath(beside):
      return 'tensorboard'
    relative = os.path.relpath(beside)
    return shlex.quote(beside if relative.startswith('..') else relative)
  return f'{shlex.quote(sys.executable)} -m tensorboard.main'
