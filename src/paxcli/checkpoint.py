"""Checkpoints with orbax: save every N steps and at the end, keep K, resume from the latest.

A checkpoint step holds two items: `state` (params, optimizer state, step; sharded
arrays written by every process) and `meta` (JSON written by process 0: the global
count of input batches consumed, and the config the run was started with).

A save interrupted by a kill leaves either orbax's temporary directory (ignored by
orbax) or, on file systems without atomic rename, a step directory without orbax's
commit marker. Such an unfinished step is moved aside to `checkpoints_unfinished/`
(never deleted) and resume uses the last complete one.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from typing import Any, Optional

import jax

from paxcli.errors import UserError

_MARKERS = ('commit_success.txt', '_CHECKPOINT_METADATA')
_TMP_RE = re.compile(r'^(\d+)\.orbax-checkpoint-tmp')
ITEMS = ('state', 'meta')


def _is_complete(step_dir: str) -> bool:
  import orbax.checkpoint as ocp
  if not all(os.path.exists(os.path.join(step_dir, m)) for m in _MARKERS):
    return False
  if not all(os.path.isdir(os.path.join(step_dir, item)) for item in ITEMS):
    return False
  return ocp.step.is_path_finalized(step_dir) if hasattr(ocp.step, 'is_path_finalized') else True


def step_dirs(directory: str) -> dict[int, str]:
  """Step number -> directory for every numeric entry (complete or not)."""
  if not os.path.isdir(directory):
    return {}
  return {int(name): os.path.join(directory, name) for name in os.listdir(directory) if name.isdigit()}


def complete_steps(directory: str) -> list[int]:
  return sorted(s for s, d in step_dirs(directory).items() if _is_complete(d))


def _unfinished(directory: str) -> list[tuple[int, str]]:
  """(step, path) of step directories without orbax's markers and of orbax's tmp directories."""
  found = [(step, path) for step, path in step_dirs(directory).items() if not _is_complete(path)]
  if os.path.isdir(directory):
    for name in os.listdir(directory):
      match = _TMP_RE.match(name)
      if match:
        found.append((int(match.group(1)), os.path.join(directory, name)))
  return sorted(found)


def set_aside_unfinished(directory: str, log=print) -> list[int]:
  """Moves unfinished saves out of `directory` (process 0 only); returns their steps.

  They go to `checkpoints_unfinished/` beside it, never deleted: orbax itself would
  delete its temporary directory when it saves that step again.
  """
  moved = []
  if jax.process_index() != 0:
    return moved
  aside = os.path.join(os.path.dirname(os.path.abspath(directory)), 'checkpoints_unfinished')
  for step, path in _unfinished(directory):
    os.makedirs(aside, exist_ok=True)
    target = os.path.join(aside, f'{os.path.basename(path)}-{int(time.time())}')
    shutil.move(path, target)
    log(f'Checkpoint at step {step} is unfinished (a save was interrupted); moved it to {target} '
        'and resuming from the last complete one.')
    moved.append(step)
  return moved


class Checkpointer:
  """A thin wrapper over orbax's CheckpointManager with our items and completeness rules."""

  def __init__(self, directory: str, max_to_keep: int, async_save: bool = True):
    import orbax.checkpoint as ocp
    self.directory = os.path.abspath(directory)
    self._ocp = ocp
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep or None, create=True,
                                           enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

  def latest_step(self) -> Optional[int]:
    steps = complete_steps(self.directory)
    return steps[-1] if steps else None

  def save(self, step: int, state: Any, meta: dict) -> None:
    ocp = self._ocp
    self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     meta=ocp.args.JsonSave(meta)), force=True)

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
