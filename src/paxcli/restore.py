"""The one way back from a job directory, shared by train, eval, decode and conversion.

    step = restore.choose_step(job_dir, step=None, purpose='decode')     # latest complete, or --step N
    got = restore.restore(setup, job_dir, step, params_only=True)         # arrays on setup's shardings
    got.state['params'], got.meta, got.params_only_checkpoint

A checkpoint holds `state` ({'step', 'params'[, 'opt_state']}; a params-only checkpoint
has no 'opt_state') and `meta` (JSON). Arrays are restored straight onto the shardings of
the experiment's mesh: orbax reads each shard where it lives, so a checkpoint written on
another mesh or process count restores here (resharding), and params-only restores never
read the optimizer state from disk.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from paxcli.errors import UserError


@dataclasses.dataclass
class Restored:
  step: int
  state: dict                    # {'step', 'params'[, 'opt_state']} as requested
  meta: dict
  params_only_checkpoint: bool   # the checkpoint itself holds no optimizer state


def checkpoints_dir(job_dir: str) -> str:
  return os.path.join(job_dir, 'checkpoints')


def choose_step(job_dir: str, step: Optional[int] = None, purpose: str = 'evaluate') -> int:
  """The latest complete checkpoint step of job_dir, or `step` if it is one; else a UserError."""
  from paxcli import checkpoint as ckpt
  directory = checkpoints_dir(job_dir)
  steps = ckpt.complete_steps(directory)
  if not steps:
    raise UserError(f'No complete checkpoint in {directory}. Train first (`pax train --exp E --job-log-dir '
                    f'{job_dir}`), pass the job directory of a trained run with --job-log-dir, or use '
                    f'--no-checkpoint to {purpose} freshly initialised weights.')
  if step is None:
    return steps[-1]
  if step not in steps:
    shown = ', '.join(map(str, steps[-10:]))
    raise UserError(f'No complete checkpoint at step {step} in {directory}; complete steps: {shown}.')
  return step


def saved_state_keys(job_dir: str, step: int) -> set[str]:
  """Top-level keys of the saved state ('step', 'params', 'opt_state'), from metadata alone."""
  import orbax.checkpoint as ocp
  path = os.path.join(checkpoints_dir(job_dir), str(step), 'state')
  try:
    metadata = ocp.PyTreeCheckpointer().metadata(path)
  except (FileNotFoundError, ValueError, OSError) as e:
    raise UserError(f'The checkpoint at step {step} in {checkpoints_dir(job_dir)} cannot be read '
                    f'({type(e).__name__}: {str(e)[:200]}).') from None
  tree = getattr(metadata, 'item_metadata', metadata)
  return set(tree.keys()) if tree is not None else set()


def read_meta(job_dir: str, step: int) -> dict:
  import json
  path = os.path.join(checkpoints_dir(job_dir), str(step), 'meta', 'metadata')
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise UserError(f'The metadata of the checkpoint at step {step} ({path}) cannot be read: {e}') from None


def check_shapes(meta: dict, shapes_now: dict, flat_now: dict, step: int, params_only: bool,
                 action: str) -> None:
  """Refuses a checkpoint whose saved shapes differ from this experiment's, listing them."""
  saved = meta.get('state_shapes') or {}
  keep = (lambda k: k.startswith('params/') or k == 'step') if params_only else (lambda k: True)
  saved = {k: v for k, v in saved.items() if keep(k)}
  now = {k: v for k, v in shapes_now.items() if keep(k)}
  if params_only or 'opt_state/' not in ''.join(saved):
    # a params-only checkpoint is compared on params alone
    saved = {k: v for k, v in saved.items() if not k.startswith('opt_state/')}
    now = {k: v for k, v in now.items() if not k.startswith('opt_state/')}
  if not saved or saved == now:
    return
  from paxcli.train import config_differences
  diffs = config_differences(meta.get('config') or {}, flat_now)
  shape_diffs = [f'{k}: {saved.get(k)} -> {now.get(k)}' for k in sorted(set(saved) | set(now))
                 if saved.get(k) != now.get(k)]
  lines = '\n  '.join((diffs or ['(no knob or model field differs; the code may have changed)'])[:20])
  shapes = '\n  '.join(shape_diffs[:8] + ([f'... {len(shape_diffs) - 8} more'] if len(shape_diffs) > 8 else []))
  raise UserError(f'Cannot {action} the checkpoint at step {step}: this configuration has other shapes than '
                  f'the one it was saved with.\nConfig differences:\n  {lines}\nShapes (checkpoint -> now):\n'
                  f'  {shapes}')


def restore(setup, job_dir: str, step: int, params_only: bool = False, flat_now: Optional[dict] = None,
            action: str = 'restore') -> Restored:
  """Restores checkpoint `step` of job_dir onto setup's shardings.

  params_only: restore {'step', 'params'} and never read the optimizer state. Otherwise
  the full train state; from a params-only checkpoint the optimizer state is initialised
  fresh (fine-tuning) and `params_only_checkpoint` says so.
  """
  import jax
  import orbax.checkpoint as ocp

  from paxcli import engine
  meta = read_meta(job_dir, step)
  keys = saved_state_keys(job_dir, step)
  has_opt = 'opt_state' in keys
  check_shapes(meta, engine.shape_signature(setup.abstract_state), flat_now or {}, step,
               params_only or not has_opt, action)
  wanted = {k: v for k, v in setup.abstract_state.items() if k != 'opt_state' or (has_opt and not params_only)}
  restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape,
                                                             dtype=a.dtype), wanted)
  path = os.path.join(checkpoints_dir(job_dir), str(step), 'state')
  try:
    state = ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(
        item=wanted, restore_args=restore_args, partial_restore=set(wanted) != keys))
  except (ValueError, KeyError) as e:
    raise UserError(f'Cannot {action} the checkpoint at step {step} in {checkpoints_dir(job_dir)}: '
                    f'{str(e)[:500]}') from None
  state = dict(state)
  if not params_only and not has_opt:
    state['opt_state'] = init_opt_state(setup, state['params'])
  return Restored(step, state, meta, params_only_checkpoint=not has_opt)


def init_opt_state(setup, params) -> Any:
  """Fresh optimizer state for `params`, created on its shardings."""
  import jax
  return jax.jit(setup.tx.init, out_shardings=setup.state_shardings['opt_state'])(params)
