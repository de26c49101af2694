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

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import time
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from paxcli import files
from paxcli.config import config_differences
from paxcli.errors import UserError, shorten
from paxcli.jobdir import checkpoint as ckpt
from paxcli.jobdir import format as job_format
from paxcli.jobdir import layout, storage
from paxcli.runtime import distributed
from paxcli.runtime import engine, train_state
from paxcli.runtime.train_state import checksum_hex, checksum_part, checksums, path_name  # noqa: F401


@dataclasses.dataclass
class Restored:
  step: int
  state: dict                    # {'step', 'params'[, 'opt_state']} as requested
  meta: dict
  params_only_checkpoint: bool   # the checkpoint itself holds no optimizer state


def choose_step(job_dir: str, step: Optional[int] = None, purpose: str = 'evaluate') -> int:
  """The latest complete checkpoint step of job_dir, or `step` if it is one; else a UserError."""
  directory = layout.checkpoints(job_dir)
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
  tree = saved_metadata(job_dir, step)
  return set(tree.keys()) if tree is not None else set()


def saved_dtypes(tree) -> dict:
  """'path' -> dtype of every array in a saved state's metadata tree (checksums' names)."""
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, 'dtype'))[0]
  return {path_name(path): np.dtype(m.dtype)
          for path, m in leaves if getattr(m, 'dtype', None) is not None}


def saved_metadata(job_dir: str, step: int):
  """The saved state's orbax metadata tree (shapes and dtypes, no arrays read)."""
  try:
    return _saved_tree(job_dir, step)
  except (FileNotFoundError, ValueError, OSError) as e:
    raise UserError(f'The checkpoint at step {step} in {layout.checkpoints(job_dir)} cannot be read '
                    f'({type(e).__name__}: {str(e)[:200]}).') from None


def _saved_tree(job_dir: str, step: int):
  return state_metadata(layout.state_dir(layout.step_dir(job_dir, step)))


def state_metadata(path: str):
  """orbax's metadata tree of the state item in directory `path` (shapes and dtypes, no arrays read)."""
  with _no_missing_metadata_warning():
    metadata = ocp.PyTreeCheckpointer().metadata(path)
  return getattr(metadata, 'item_metadata', metadata)


def read_meta(job_dir: str, step: int) -> dict:
  """A checkpoint's metadata, checked (meta_problem, without orbax's description); a UserError if it fails."""
  path = _meta_path(job_dir, step)
  try:
    meta = _load_meta(path)
  except (OSError, ValueError) as e:
    raise UserError(f'The metadata of the checkpoint at step {step} ({path}) cannot be read: {e}') from None
  job_format.check(meta if isinstance(meta, dict) else {}, f'The checkpoint at step {step} in {job_dir}')
  problem = meta_problem(meta, step)
  if problem:
    raise UserError(f'The metadata of the checkpoint at step {step} ({path}) is not what paxcli writes: {problem}. '
                    'Is the checkpoint damaged, or replaced?')
  return meta


def _meta_path(job_dir: str, step: int) -> str:
  return layout.meta_file(layout.step_dir(job_dir, step))


# A checkpoint's metadata: its config, shapes and checksums, a few hundred bytes an array; a file of more
# than this is no metadata paxcli wrote (it is read before anything else of the checkpoint).
MAX_META_BYTES = 64 << 20


class MetaError(ValueError):
  """A checkpoint's metadata file that is not JSON paxcli could have written (too large, not strict JSON)."""


def _load_meta(path: str) -> dict:
  data = storage.read_bytes(path, MAX_META_BYTES)
  if len(data) > MAX_META_BYTES:
    raise MetaError(f'it is over {MAX_META_BYTES:,} bytes')
  try:
    return files.parse_json(data, 'meta/metadata')
  except UserError as e:
    raise MetaError(str(e)) from None


_CHECKSUM = re.compile(r'[0-9a-f]{1,128}')


def meta_problem(meta, step: int, saved_tree=None) -> Optional[str]:
  """Why `meta` is not the metadata paxcli wrote with checkpoint `step`, or None: it names its step, records
  every array's shape (as orbax's own description of the arrays, `saved_tree`, has them) and, from format 1
  on, checksums of arrays of that record. A file swapped in for it (another step's, an unrelated
  JSON) fails here, before any array is read on its word."""
  if not isinstance(meta, dict):
    return 'it is not a JSON object'
  if 'step' in meta and meta['step'] != step:
    return f'it is the metadata of step {shorten(json.dumps(meta["step"]), 40)}'
  shapes = meta.get('state_shapes')
  if not (isinstance(shapes, dict) and shapes and all(_is_shape(v) for v in shapes.values())):
    return 'it holds no record of the arrays\' shapes (state_shapes)'
  sums = meta.get('checksums')
  if sums is None and job_format.of(meta) >= 1 and 'converted_from' not in meta:
    return 'it holds no checksums of the arrays'
  if sums is not None and not (isinstance(sums, dict) and set(sums) & set(shapes) and all(
      isinstance(v, str) and _CHECKSUM.fullmatch(v) for v in sums.values())):
    return 'its checksums are not those of its arrays'
  if saved_tree is not None:
    described = {path_name(path): list(leaf.shape) for path, leaf in jax.tree_util.tree_flatten_with_path(
        saved_tree, is_leaf=lambda x: hasattr(x, 'shape'))[0] if getattr(leaf, 'shape', None) is not None}
    wrong = sorted(n for n, shape in shapes.items() if described.get(n, shape) != shape)
    if wrong or not set(shapes) & set(described):
      which = ', '.join(wrong[:3]) or 'no array in common'
      return f'its record of the shapes differs from orbax\'s description of the arrays ({which})'
  return None


def _is_shape(value) -> bool:
  return isinstance(value, list) and len(value) <= 16 and all(
      isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**62 for d in value)


def check_shapes(meta: dict, shapes_now: dict, flat_now: dict, step: int, params_only: bool,
                 action: str) -> None:
  """Refuses a checkpoint whose saved shapes differ from this experiment's, listing them."""
  saved = meta.get('state_shapes') or {}
  # Params-only: params and step. Otherwise everything, except that a checkpoint without
  # optimizer state (params-only) is compared without it.
  with_opt = not params_only and any(k.startswith('opt_state/') for k in saved)
  keep = ((lambda k: k == 'step' or k.startswith('params/')) if params_only
          else (lambda k: with_opt or not k.startswith('opt_state/')))
  saved = {k: v for k, v in saved.items() if keep(k)}
  now = {k: v for k, v in shapes_now.items() if keep(k)}
  if not saved or saved == now:
    return
  diffs = config_differences(meta.get('config') or {}, flat_now)
  shape_diffs = [f'{k}: {saved.get(k)} -> {now.get(k)}' for k in sorted(set(saved) | set(now))
                 if saved.get(k) != now.get(k)]
  lines = '\n  '.join((diffs or ['(no knob or model field differs; the code may have changed)'])[:20])
  shapes = '\n  '.join(shape_diffs[:8] + ([f'... {len(shape_diffs) - 8} more'] if len(shape_diffs) > 8 else []))
  raise ShapeMismatch(f'Cannot {action} the checkpoint at step {step}: this configuration has other shapes than '
                      f'the one it was saved with.\nConfig differences:\n  {lines}\nShapes (checkpoint -> now):\n'
                      f'  {shapes}', diffs)


class ShapeMismatch(UserError):
  """A checkpoint whose arrays have other shapes than the configuration reading it; `differences`: the
  knobs and model fields that differ (config_differences)."""

  def __init__(self, message: str, differences: list[str]):
    super().__init__(message)
    self.differences = differences


class DamagedCheckpoint(UserError):
  """A complete-looking checkpoint whose files cannot be read back as saved (see damage_evidence)."""
  exit_code = 1

  def __init__(self, step: int, directory: str, reason: str):
    self.step, self.directory, self.reason = step, directory, reason
    super().__init__(f'The checkpoint at step {step} in {directory} is damaged: {reason}.')


class CheckpointGone(UserError):
  """The checkpoint was deleted while it was read (the trainer keeps only the latest save_max_to_keep)."""
  exit_code = 1

  def __init__(self, step: int, directory: str):
    self.step, self.directory = step, directory
    super().__init__(f'The checkpoint at step {step} in {directory} was deleted while it was being read '
                     '(the trainer keeps only the latest task.train.save_max_to_keep).')


class CheckpointReadError(UserError):
  """A restore that failed for a reason other than damage: paxcli's bug, or a setting or the machine.

  Nothing is moved or skipped for it: every checkpoint would fail the same way.
  """
  exit_code = 1

  def __init__(self, step: int, directory: str, action: str, error: str):
    self.step, self.directory = step, directory
    super().__init__(f'Could not {action} the checkpoint at step {step} in {directory}: {error}. Its files show no '
                     'damage, so it was left in place and no other checkpoint was tried: this is a problem of the '
                     'environment or settings (permissions, memory, paths), or a bug in paxcli; please report it '
                     'with this line if it is not yours.')


# tensorstore reports errors as ValueError('CODE: message'). Which codes are evidence that a file
# of the checkpoint is missing, cut short or garbled (what truncating, deleting or overwriting a
# file of a real checkpoint gives), and which need their message to say so too.
_DAMAGE_CODES = ('NOT_FOUND', 'DATA_LOSS', 'OUT_OF_RANGE')
_DAMAGE_WORDS = ('truncat', 'decompress', 'decod', 'corrupt', 'checksum', 'unexpected end', 'no such file',
                 'input/output error')


def damage_evidence(error: BaseException) -> Optional[str]:
  """A short reason if `error` (or what caused it) shows a damaged file, else None.

  Evidence: a missing file or directory (FileNotFoundError, tensorstore NOT_FOUND), a file cut
  short (OUT_OF_RANGE, a truncated stream), garbled bytes (DATA_LOSS, a failed decompression),
  undecodable metadata (JSON or UTF-8 errors), an I/O error of the disk. Anything else (a
  relative path, permission denied, out of memory, a programming error) is not damage.
  """
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    text = _first_line(error)
    if isinstance(error, (FileNotFoundError, NotADirectoryError, IsADirectoryError, EOFError,
                          json.JSONDecodeError, UnicodeDecodeError, MetaError)):
      return f'{type(error).__name__}: {text}'
    if isinstance(error, OSError) and error.errno == errno.EIO:
      return f'{type(error).__name__}: {text}'
    if type(error).__module__.split('.')[0] == 'msgpack':
      return f'undecodable metadata ({type(error).__name__}: {text})'
    match = re.match(r'([A-Z_]+): ', str(error).strip())
    if match and (match.group(1) in _DAMAGE_CODES or
                  match.group(1) in ('FAILED_PRECONDITION', 'INVALID_ARGUMENT', 'UNKNOWN') and
                  any(w in str(error).lower() for w in _DAMAGE_WORDS)):
      return text
    error = error.__cause__ or error.__context__
  return None


def _gone(directory: str, step: int) -> bool:
  """True once checkpoint `step` is no longer a complete step of `directory` (deleted, or being deleted)."""
  return not storage.isdir(layout.entry(directory, str(step))) or step not in ckpt.complete_steps(directory)


def _failure(error: BaseException, step: int, directory: str, what: str, action: str) -> UserError:
  """What reading `what` of checkpoint `step` raising `error` means: deleted, damaged, or neither."""
  if _gone(directory, step):
    return CheckpointGone(step, directory)
  reason = damage_evidence(error)
  if reason:
    return DamagedCheckpoint(step, directory, f'{what} cannot be read ({reason})')
  return CheckpointReadError(step, directory, action, f'reading {what} failed ({type(error).__name__}: '
                             f'{_first_line(error)})')


def restore(setup, job_dir: str, step: int, params_only: bool = False, flat_now: Optional[dict] = None,
            action: str = 'restore', fallback: bool = False, set_aside: bool = False,
            log=print, join_base: bool = True) -> Restored:
  """Restores checkpoint `step` of job_dir onto setup's shardings, verified against its checksums.

  params_only: restore {'step', 'params'} and never read the optimizer state. Otherwise
  the full train state; from a params-only checkpoint the optimizer state is initialised
  fresh (fine-tuning) and `params_only_checkpoint` says so.

  A damaged checkpoint (evidence in its files: one missing or cut short, undecodable
  metadata, an array that differs from the checksum saved with it; see damage_evidence)
  raises DamagedCheckpoint naming it; one deleted while it was read raises CheckpointGone.
  With fallback=True the next older complete checkpoints are tried instead, with a loud
  line for each; set_aside=True (train) also moves each damaged one to
  `checkpoints_damaged/` (never deleted), once an older one has restored, so that the run
  goes on from the newest intact one. Any other failure raises CheckpointReadError at once:
  it is not the checkpoint's fault, and nothing is moved or skipped.

  A model with frozen params (LoRA) has checkpoints of its trainable params only, naming their
  base; join_base restores the base's params beside them (see base_params), verified to be the one
  named. join_base=False restores setup's abstract state as it is (the base itself).
  """
  older = [s for s in ckpt.complete_steps(layout.checkpoints(job_dir)) if s < step]
  damaged = []
  while True:
    try:
      restored = _restore_step(setup, job_dir, step, params_only, flat_now, action, join_base)
      break
    except CheckpointGone as e:
      if not fallback or not older:
        raise
      log(f'Note: {e} Falling back to the checkpoint at step {older[-1]}.')
    except DamagedCheckpoint as e:
      if not fallback:
        raise
      if not older:  # nothing to fall back to: leave it in place for the user to look at
        raise DamagedCheckpoint(e.step, e.directory, f'{e.reason}; no older complete checkpoint to fall '
                                'back to. Move it aside to start afresh, or restore it from a copy') from None
      where = 'moving it to checkpoints_damaged/ once that one restores' if set_aside else 'left it in place'
      log(f'WARNING: {e} Falling back to the checkpoint at step {older[-1]}; {where}.')
      damaged.append(step)
    step = older.pop()
  for bad in damaged if set_aside else ():
    moved = _set_aside_damaged(job_dir, bad, log)
    if moved:
      log(f'Moved the damaged checkpoint at step {bad} to {moved}.')
  return restored


def _set_aside_damaged(job_dir: str, step: int, log) -> Optional[str]:
  """Moves a damaged step to checkpoints_damaged/ (process 0), never deleting it; returns the target."""
  target = layout.entry(layout.damaged(job_dir), f'{step}-{int(time.time())}')
  if jax.process_index() == 0:
    storage.makedirs(os.path.dirname(target))
    try:
      storage.move_tree(layout.step_dir(job_dir, step), target)
    except (OSError, UserError) as e:
      log(f'Could not move the damaged checkpoint at step {step} aside ({getattr(e, "strerror", None) or e}).')
      target = None
  distributed.barrier(f'paxcli:damaged-checkpoint-{step}-set-aside')
  return target


_KINDS = (type(None), DamagedCheckpoint, CheckpointGone, CheckpointReadError)  # worse to the right


def _agree(error: Optional[UserError], step: int, directory: str, action: str) -> None:
  """Raises the worst failure of any process (a collective with several processes), so all go on or stop together."""
  kind = _KINDS.index(type(error))
  if jax.process_count() > 1:
    kind = int(np.asarray(multihost_utils.process_allgather(np.array([kind], np.int32))).max())
  if kind == 0:
    return
  if isinstance(error, _KINDS[kind]):
    raise error
  other = 'another process could not read its part of the arrays'
  raise (DamagedCheckpoint(step, directory, other) if kind == 1 else CheckpointGone(step, directory) if kind == 2
         else CheckpointReadError(step, directory, action, other))


def check_links(job_dir: str, step: int) -> None:
  """Refuses a checkpoint holding a symlink that leads out of its job directory: orbax reads the files of
  a step by itself, so they get the member check every file of a job gets (layout) here, all at once."""
  if storage.is_local(job_dir):
    files.check_tree(layout.step_dir(job_dir, step), job_dir, 'checkpoint file')


def _restore_step(setup, job_dir: str, step: int, params_only: bool, flat_now: Optional[dict],
                  action: str, join_base: bool = True) -> Restored:
  directory = layout.checkpoints(job_dir)
  check_links(job_dir, step)
  damaged = lambda reason: DamagedCheckpoint(step, directory, reason)
  if not storage.isfile(layout.entry(layout.state_dir(layout.step_dir(job_dir, step)), '_METADATA')):
    if _gone(directory, step):
      raise CheckpointGone(step, directory)
    raise damaged("state/_METADATA (orbax's description of the arrays) is missing")
  try:
    meta = _load_meta(_meta_path(job_dir, step))
  except Exception as e:
    raise _failure(e, step, directory, 'its metadata (meta/metadata)', action) from None
  if not isinstance(meta, dict):
    raise damaged('its metadata (meta/metadata) is not a JSON object')
  job_format.check(meta, f'The checkpoint at step {step} in {directory}')
  try:
    saved_tree = _saved_tree(job_dir, step)
  except Exception as e:
    raise _failure(e, step, directory, "orbax's description of its arrays", action) from None
  problem = meta_problem(meta, step, saved_tree)
  if problem:
    raise damaged(f'its metadata (meta/metadata) is not what paxcli wrote with it: {problem}')
  keys = set(saved_tree.keys()) if saved_tree is not None else set()
  has_opt = 'opt_state' in keys
  with_base = join_base and train_state.has_frozen(setup)
  abstract = train_state.saved_state(setup, setup.abstract_state) if with_base else setup.abstract_state
  check_shapes(meta, train_state.shape_signature(abstract), flat_now or {}, step, params_only or not has_opt, action)
  base = checked_base(setup, meta) if with_base else None   # a wrong base refuses before any array is read
  engine.check_fits(setup, params_only=params_only or not has_opt)
  wanted = {k: v for k, v in abstract.items() if k != 'opt_state' or (has_opt and not params_only)}
  restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape,
                                                             dtype=a.dtype), wanted)
  path = layout.state_dir(layout.step_dir(job_dir, step))
  state, error = None, None
  try:
    with _no_missing_metadata_warning():
      state = ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(
          item=wanted, restore_args=restore_args, partial_restore=set(wanted) != keys))
  except Exception as e:
    error = _failure(e, step, directory, 'its arrays', action)
  _agree(error, step, directory, action)  # every process goes on, falls back or stops together
  state = dict(state)
  bad = checksum_mismatches(state, meta, saved_tree)
  if bad:
    raise damaged(bad)
  if base is not None:
    state['params'] = train_state.join_params(state['params'], base_params(setup, base, frozen_only=True))
  if not params_only and not has_opt:
    state['opt_state'] = init_opt_state(setup, state['params'])
  return Restored(step, state, meta, params_only_checkpoint=not has_opt)


def checksum_mismatches(state: dict, meta: dict, saved_tree) -> Optional[str]:
  """Why restored `state` is not what was saved (its arrays against the checksums in `meta`), or None."""
  saved_sums = meta.get('checksums')
  if not saved_sums:
    return None
  saved_sums = dict(saved_sums)
  now = checksums(_as_saved_dtypes(state, saved_dtypes(saved_tree), saved_sums))
  bad = sorted(k for k, v in now.items() if k in saved_sums and saved_sums[k] != v)
  if not bad:
    return None
  more = f' and {len(bad) - 3} more' if len(bad) > 3 else ''
  return f'{len(bad)} array(s) differ from the checksums saved with it ({", ".join(bad[:3])}{more})'


def weights(setup, resolved, job_dir: str, step: Optional[int], action: str, fallback: bool, log=print) -> tuple:
  """(params, step) for a command that only reads weights (decode, score): checkpoint `step`'s, or
  fresh ones (step 0) when it is None.

  The latest checkpoint, if damaged, falls back to the newest intact one (fallback=True: named in
  a WARNING line, nothing moved); a --step that is damaged is refused, naming it.
  """
  if step is None:
    return engine.init_state(setup, resolved.experiment.RANDOM_SEED)['params'], 0
  flat = {k: repr(v) for k, v in resolved.flat().items()}
  got = restore(setup, job_dir, step, params_only=True, flat_now=flat, action=action, fallback=fallback, log=log)
  return got.state['params'], got.step


# ---- Base weights: INIT_FROM, and the base a LoRA checkpoint's adapters apply to ------------------


@dataclasses.dataclass(frozen=True)
class BaseRef:
  """A checkpoint whose params a run starts from, and a digest of their content (their checksums)."""
  job_dir: str
  step: int
  digest: str

  def describe(self) -> str:
    return f'{self.job_dir} step {self.step} (content {self.digest[:12]})'

  def to_meta(self) -> dict:
    return dataclasses.asdict(self)


def base_ref(path: str, what: str = 'INIT_FROM') -> BaseRef:
  """The checkpoint `path` names (a job directory: its latest complete step; or a step directory)."""
  job_dir, step = layout.split(path)
  steps = ckpt.complete_steps(layout.checkpoints(job_dir))
  if not steps or (step is not None and step not in steps):
    raise UserError(f'{what}={path}: no complete paxcli checkpoint there. Name a job directory or one of its '
                    'checkpoint steps; convert a Hugging Face model first with `pax checkpoint convert HF_DIR OUT '
                    '--from hf`.')
  step = steps[-1] if step is None else step
  sums = read_meta(job_dir, step).get('checksums') or {}
  params = {k: v for k, v in sums.items() if k.startswith('params/')}
  if not params:
    raise UserError(f'{what}={path}: the checkpoint at step {step} has no checksums to identify its weights '
                    'by; convert it once (`pax checkpoint convert`) to write them.')
  digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()
  return BaseRef(job_dir, step, digest)


def checked_base(setup, meta: dict) -> BaseRef:
  """The base of a checkpoint with frozen params left out: INIT_FROM if set, else the one its meta
  names; refused in one line when its content is not the base the adapters were trained on."""
  named = meta.get('base')
  if not named:
    raise UserError('This checkpoint holds no base reference, but the experiment freezes weights (LORA_RANK > 0): '
                    'it was not written by a LoRA run. Set LORA_RANK=0 to read it.')
  init_from = getattr(setup.train, 'init_from', None)
  named_dir = layout.step_dir(named['job_dir'], named['step'])
  ref = base_ref(init_from) if init_from else base_ref(named_dir, 'the base named in the checkpoint')
  if ref.digest != named['digest']:
    raise UserError(f'The adapters were trained on the base {BaseRef(**named).describe()}, but INIT_FROM names '
                    f'{ref.describe()}, whose weights differ; set INIT_FROM={named_dir}.')
  return ref


def base_params(setup, ref: BaseRef, frozen_only: bool) -> dict:
  """The params of checkpoint `ref` onto setup's shardings and dtypes (the frozen ones only, or all),
  verified against its checksums."""
  params = setup.abstract_state['params']
  if frozen_only:
    params = train_state.split_trainable(setup.model, params)[1]
  sub = dataclasses.replace(setup, abstract_state={'step': setup.abstract_state['step'], 'params': params})
  try:
    got = restore(sub, ref.job_dir, ref.step, params_only=True, action='load the base weights from', join_base=False)
  except (DamagedCheckpoint, CheckpointGone, CheckpointReadError) as e:
    raise BaseUnreadable(ref, e) from None
  return got.state['params']


class BaseUnreadable(UserError):
  """The base a run's adapters apply to (or its INIT_FROM) cannot be read.

  Not a DamagedCheckpoint of the run itself: restore's fallback to the run's older checkpoints
  (and train's setting aside of damaged ones) must not act on it, since every one of them names
  the same base; the user repairs or replaces the base instead.
  """
  exit_code = 1

  def __init__(self, ref: 'BaseRef', error: UserError):
    super().__init__(f'The base weights {ref.describe()} cannot be read: {error} The checkpoints of this run were '
                     'left as they are; restore the base from a copy (or convert it again).')


def start_from_base(setup, state: dict, ref: BaseRef) -> dict:
  """A fresh train state with the base's params: all of them (a full fine-tune), or the frozen ones
  beside freshly initialised adapters (LoRA; B = 0, so the model starts as the base)."""
  if train_state.has_frozen(setup):
    trainable = train_state.split_trainable(setup.model, state['params'])[0]
    return dict(state, params=train_state.join_params(trainable, base_params(setup, ref, frozen_only=True)))
  return dict(state, params=base_params(setup, ref, frozen_only=False))


def _as_saved_dtypes(state, dtypes: dict, saved_sums: dict):
  """The restored arrays in the dtypes they were saved in, for comparing checksums.

  A restore casts to the experiment's dtypes (bfloat16 params restored as float32). Casting
  back to the narrower saved dtype is exact, so those arrays still verify bit for bit; an
  array saved wider than it is restored cannot be, and is left out of the comparison.
  """
  def one(path, x):
    name = path_name(path)
    want = dtypes.get(name)
    if want is None or want == x.dtype:
      return x
    if want.itemsize > x.dtype.itemsize:
      saved_sums.pop(name, None)
      return x
    return jax.jit(lambda a: a.astype(want))(x)
  return jax.tree_util.tree_map_with_path(one, state)


def _first_line(e: BaseException) -> str:
  text = str(e).strip().split(' See full TensorStore details')[0]
  return (text.splitlines()[0] if text else '')[:300]


def init_opt_state(setup, params) -> Any:
  """Fresh optimizer state for `params`, created on its shardings."""
  init = lambda p: setup.tx.init(train_state.split_trainable(setup.model, p)[0])
  return jax.jit(init, out_shardings=setup.state_shardings['opt_state'])(params)


class _OnlyOtherRecords:
  """A logging filter dropping orbax's "Metadata file does not exist" warning.

  A step's `state` item is read on its own, without the step-level metadata file orbax looks
  for beside it; the warning says nothing wrong and would print at every restore.
  """

  def filter(self, record) -> bool:
    return 'Metadata file does not exist' not in record.getMessage()


@contextlib.contextmanager
def _no_missing_metadata_warning():
  logger, quiet = logging.getLogger('absl'), _OnlyOtherRecords()
  logger.addFilter(quiet)
  try:
    yield
  finally:
    logger.removeFilter(quiet)
