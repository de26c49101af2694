"""GRPO's rollouts: the train input of a model that samples its own batches (paxcli.models.grpo.GrpoLm).

Every NUM_ITERATIONS steps, `get_next(state)` takes the next P = global batch / NUM_GENERATIONS prompts
(paxcli.inputs.rollout_prompts), samples NUM_GENERATIONS completions of each with paxcli's own decoder on the
training mesh at the current parameters (paxcli.loops.decode.decoder: TEMPERATURE, TOP_P, TOP_K,
MAX_COMPLETION_LENGTH, STOP and the tokenizer's EOS), scores them with the experiment's reward functions
(paxcli.models.rewards: Python functions the experiment names), turns the rewards into group-normalised
advantages (grpo.group_advantages) and lays the rows out as GrpoLm reads them; with NUM_ITERATIONS > 1 the
sampling policy's log-probabilities (old_logps), with BETA > 0 the reference's (ref_logps), computed by the same
forward pass the loss uses. The steps in between reuse that batch.

Reproducible: the key of sample s of the prompt taken k-th (over the whole run) at token t is
fold_in(fold_in(fold_in(key(RANDOM_SEED), k), s), t) (the decoder's), the prompts' order is a function of the
seed, and the parameters are the state's: a run resumed at any step samples what an uninterrupted one would.
A resume inside a rollout batch's NUM_ITERATIONS steps needs that batch: `get_state` saves it with each
checkpoint (this process's rows, as sealed JSON beside Grain's input states), and `restore` checks it before
use (a checkpoint is received data).

The reference (BETA > 0): with LoRA, the same parameters with every adapter zeroed, which is the base exactly
(no second copy of the weights); else the weights the run started from (INIT_FROM's, or the seed's
initialisation), kept beside the trained ones, as TRL keeps its ref_model.

A reward function that raises, returns a NaN or infinite value, a non-number or the wrong count stops the run in
one line naming the function and the prompt (its index among the prompts taken, and file:line); the last
checkpoint is kept as it was.
"""

from __future__ import annotations

import math
import traceback
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from paxcli.errors import UserError, shorten
from paxcli.inputs import grain_state
from paxcli.jobdir import checkpoint as ckpt
from paxcli.jobdir import layout
from paxcli.jobdir import restore
from paxcli.layers import lora
from paxcli.loops.decode.decoder import Decoder
from paxcli.loops.decode.options import DecodeOptions
from paxcli.loops.decode.output import write_jsonl
from paxcli.loops.decode.prompts import Prompt
from paxcli.models import grpo
from paxcli.models import rewards as reward_lib
from paxcli.runtime import engine
from paxcli.runtime import sharding
from paxcli.runtime import train_state

STATE_KIND = 'paxcli_grpo_rollouts'
CALL_ARGUMENTS = ('prompts', 'completions', 'completion_ids', 'step')
ROLLOUTS = 'rollouts'   # LOG_COMPLETIONS: the rollout batches' records, under decoder_out/rollouts/
STATE_VERSION = 1
_DTYPES = ('int32', 'float32')


class RewardFailed(UserError):
  """A reward function failed on a rollout: the run stops, its checkpoints as they were."""


class Rollouts:
  """The train input of a GrpoLm (module docstring): `get_next(state)` gives this process's rows."""

  reads_state = True   # the train loop hands get_next the state (loops/train.py, _next_batch)

  def __init__(self, resolved, setup, job_dir: str, prompts):
    self.setup, self.model, self.job_dir, self.prompts = setup, setup.model, job_dir, prompts
    if not hasattr(prompts, 'take'):
      raise UserError(f'GRPO samples completions of prompts, but the train input is a {type(prompts).__name__}: give '
                      'TRAIN_DATA, JSONL prompt records (paxcli.inputs.rollout_prompts).')
    self.notes = getattr(prompts, 'notes', [])
    model, exp = self.model, resolved.experiment
    if setup.global_batch % model.num_generations:
      raise UserError(f'The global batch of {setup.global_batch} completions (PERCORE_BATCH_SIZE x devices) is not '
                      f'a whole number of groups of NUM_GENERATIONS={model.num_generations}; make it a multiple.')
    if setup.infeed.padding:
      raise UserError('GRPO feeds every process rows of its rollouts: PERCORE_BATCH_SIZE below 1 (processes '
                      'feeding padding) is not supported; raise it.')
    self.per_rollout = setup.global_batch // model.num_generations
    self.functions = list(exp.reward_functions())
    check_reward_functions(self.functions)
    self.names = [reward_lib.name_of(f) for f in self.functions]
    self.weights = _weights(getattr(exp, 'REWARD_WEIGHTS', None), len(self.functions))
    self.seed = int(exp.RANDOM_SEED)
    self.log_completions = bool(getattr(exp, 'LOG_COMPLETIONS', False)) and jax.process_index() == 0
    self.base = restore.base_ref(setup.train.init_from) if setup.train.init_from else None
    tok = prompts.tok
    self.opts = DecodeOptions(max_decode_steps=model.max_completion_length, temperature=model.temperature,
                              top_p=model.top_p, top_k=model.top_k or None, num_samples=model.num_generations,
                              seed=self.seed, eos_ids=(tok.eos_id,), stop=tuple(model.stop),
                              batch_size=setup.global_batch)
    self.opts.check(model.vocab_size)
    self.decoder = Decoder(setup, None)
    self._logps = _scorer(setup)
    self._reference = None
    self._steps = self._started_at = 0
    self._buffer: Optional[dict] = None
    self.last_stats: dict = {}

  # ---- the input contract the loop uses ------------------------------------------------------------

  def tokenizer_file(self) -> Optional[str]:
    return self.prompts.tokenizer_file()

  def get_next(self, state: dict) -> dict:
    """This process's rows for the next step: a new rollout at the current params every NUM_ITERATIONS steps."""
    if self._steps % self.model.num_iterations == 0:
      self._buffer = self._rollout(state['params'], self._steps + 1)
    self._steps += 1
    return self._buffer

  def skip(self, steps: int) -> None:
    """Goes on after `steps` steps of a checkpoint that holds no rollout state: possible between rollout batches."""
    if steps % self.model.num_iterations:
      raise UserError(f'The checkpoint at step {steps} holds no rollout batch, and it falls inside one (every '
                      f'NUM_ITERATIONS={self.model.num_iterations} steps): resume from another checkpoint.')
    self._at(steps)

  def _at(self, steps: int) -> None:
    self._steps = self._started_at = steps
    self.prompts.position = -(-steps // self.model.num_iterations) * self.per_rollout

  def get_state(self) -> bytes:
    """The position and, inside a rollout batch's steps, this process's rows of it, as sealed JSON."""
    inside = self._steps % self.model.num_iterations != 0
    return grain_state.seal({'kind': STATE_KIND, 'version': STATE_VERSION, 'steps': self._steps,
                             'buffer': _encode(self._buffer) if inside else None})

  def restore(self, saved: list[dict], batches: Optional[int] = None) -> None:
    """Goes on from the states the processes saved, each checked (sealed, this kind, the meta's step count); inside
    a rollout batch, this process's rows of it (the shapes this run feeds; as many processes as saved them)."""
    for state in saved:
      where = state.get(grain_state.FILE, 'the input state')
      if state.get(grain_state.CHECKSUM) != grain_state.checksum(state) or state.get('kind') != STATE_KIND:
        raise UserError(f'{where}: not a GRPO rollout state this paxcli wrote (edited, or another input\'s); resume '
                        'from another checkpoint or start a new job directory.')
      if not isinstance(state.get('steps'), int) or (batches is not None and state['steps'] != batches):
        raise UserError(f'{where}: the rollout state is at step {shorten(repr(state.get("steps")), 40)}, the '
                        f'checkpoint at {batches}; resume from another checkpoint.')
    steps = saved[0]['steps']
    self._at(steps)
    if steps % self.model.num_iterations:
      if len(saved) != jax.process_count():
        raise UserError(f'The checkpoint at step {steps} falls inside a rollout batch, which {len(saved)} process(es) '
                        f'fed: resume on {len(saved)}, or from a checkpoint where a rollout batch starts (a multiple '
                        f'of NUM_ITERATIONS={self.model.num_iterations}).')
      mine = _own_state(saved)
      self._buffer = _decode(mine.get('buffer'), self._feature_shapes(), mine.get(grain_state.FILE, 'the input state'))

  def _feature_shapes(self) -> dict:
    rows, length = self.setup.process_batch, self.setup.seq_len
    shapes = {k: (v.shape, str(v.dtype)) for k, v in self.model.dummy_batch(rows, length).items()}
    shapes.update({grpo.STAT + k: ((rows,), 'float32') for k in self._stat_names()})
    return shapes

  # ---- one rollout -------------------------------------------------------------------------------

  def _rollout(self, params, step: int) -> dict:
    taken = self.prompts.take(self.per_rollout)
    prompts = [Prompt(row.ids, row.text) for _, row in taken]
    self.decoder.params = params
    records, stats = self.decoder.run(prompts, self.opts, self.prompts.tok, prompt_offset=taken[0][0])
    self.last_stats = stats
    rewards, per_function = self._rewards(taken, records, step)
    advantages, zero_std = grpo.group_advantages(rewards, self.model.num_generations, self.model.scale_rewards)
    batch = layout_rows([r['prompt_ids'] for r in records], [r['decoded_ids'] for r in records], self.setup.seq_len)
    batch['advantages'] = advantages
    if self.model.uses_old_logps:
      batch['old_logps'] = self._logps(params, batch)
    if self.model.beta:
      batch['ref_logps'] = self._logps(self._reference_params(params), batch)
    batch.update(self._stats(records, rewards, per_function, zero_std))
    if self.log_completions:
      self._write(step, taken, records, per_function, rewards, advantages)
    return self._mine(batch)

  def _write(self, step: int, taken, records, per_function, rewards, advantages) -> None:
    """LOG_COMPLETIONS: the rollout batch, a completion a line, into decoder_out/rollouts/decode_step<k>.jsonl."""
    g = self.model.num_generations
    write_jsonl(layout.train_decodes(self.job_dir, ROLLOUTS, step), [
        {'step': step, 'prompt_index': taken[r // g][0], 'sample_index': r % g, 'prompt': rec['prompt'],
         'completion': rec['decoded'], 'completion_ids': rec['decoded_ids'], 'stop_reason': rec['stop_reason'],
         'rewards': {name: float(per_function[r, f]) for f, name in enumerate(self.names)},
         'reward': float(rewards[r]), 'advantage': float(advantages[r])} for r, rec in enumerate(records)])

  def _rewards(self, taken, records: list[dict], step: int) -> tuple[np.ndarray, np.ndarray]:
    """(the weighted sum of the functions' rewards per completion, NaN where none scored it; each function's
    rewards [N, F]) or RewardFailed."""
    g = self.model.num_generations
    rows = [taken[r // g] for r in range(len(records))]
    texts = [row.text for _, row in rows]
    completions = [rec['decoded'] or '' for rec in records]
    ids = [list(rec['decoded_ids']) for rec in records]
    columns: dict = {}
    for _, row in rows:
      for key in row.record:
        if key not in CALL_ARGUMENTS:   # a record's own 'step' or 'completions' cannot shadow ours
          columns.setdefault(key, None)
    columns = {k: [row.record.get(k) for _, row in rows] for k in columns}
    columns['step'] = step
    table = np.full((len(records), len(self.functions)), np.nan, np.float32)
    for f, (fn, name) in enumerate(zip(self.functions, self.names)):
      table[:, f] = self._call(fn, name, rows, texts, completions, ids, columns, step)
    scored = ~np.isnan(table).all(axis=1)
    total = np.nansum(table * self.weights[None, :], axis=1).astype(np.float32)
    total[~scored] = np.nan
    return total, table

  def _call(self, fn, name: str, rows, texts, completions, ids, columns, step) -> np.ndarray:
    try:
      out = fn(prompts=texts, completions=completions, completion_ids=ids, **columns)
    except Exception as e:   # user code: any failure is the user's to see, in one line
      at = self._failing_row(fn, texts, completions, ids, columns)
      raise RewardFailed(self._where(name, rows, at, step) + f' raised {_described(e)}. ' + self._kept()) from None
    values = self._values(out, name, rows, step, len(texts))
    return values

  def _values(self, out, name: str, rows, step: int, n: int) -> np.ndarray:
    if isinstance(out, (str, bytes)) or not hasattr(out, '__len__') or len(out) != n:
      count = len(out) if hasattr(out, '__len__') and not isinstance(out, (str, bytes)) else type(out).__name__
      raise RewardFailed(f'The reward function {name!r} returned {count} values for the {n} completions of the '
                         f'rollout of step {step}; it must return one number (or None) per completion. '
                         + self._kept())
    values = np.full((n,), np.nan, np.float32)
    for r, v in enumerate(out):
      if v is None:
        continue
      ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
      if not ok or not math.isfinite(float(v)):
        raise RewardFailed(self._where(name, rows, r, step) + f' returned {shorten(repr(v), 40)}, not a finite '
                           'number (None: not scored). ' + self._kept())
      values[r] = float(v)
    return values

  def _failing_row(self, fn, texts, completions, ids, columns) -> Optional[int]:
    """The first completion the function fails on alone (None when it fails only on the whole batch)."""
    for r in range(len(texts)):
      one = {k: (v[r:r + 1] if isinstance(v, list) else v) for k, v in columns.items()}
      try:
        fn(prompts=texts[r:r + 1], completions=completions[r:r + 1], completion_ids=ids[r:r + 1], **one)
      except Exception:   # pylint: disable=broad-except
        return r
    return None

  def _where(self, name: str, rows, r: Optional[int], step: int) -> str:
    if r is None:
      return f'The reward function {name!r}, on the rollout of step {step} (no single completion fails alone),'
    index, row = rows[r]
    return (f'The reward function {name!r}, on prompt {index} ({row.where}), completion '
            f'{r % self.model.num_generations} of the rollout of step {step},')

  def _kept(self) -> str:
    """Which checkpoint a stop now leaves: the newest on disk, or the one the loop is still writing (its save
    interval's; the loop waits for that save before it exits)."""
    every = self.setup.train.save_interval_steps
    saving = (self._steps // every) * every if every else 0
    steps = ckpt.complete_steps(layout.checkpoints(self.job_dir)) + [self._started_at, saving]
    last = max(steps)
    last = f'step {last}, kept as it was' if last else 'none yet'
    return f'Stopping; the last checkpoint is {last}. Fix the function and run the same command to resume.'

  def _stat_names(self) -> list[str]:
    names = ['reward', 'reward_std', 'frac_reward_zero_std', 'completions/mean_length', 'completions/min_length',
             'completions/max_length', 'completions/clipped_ratio']
    for name in self.names:
      names += [f'rewards/{name}/mean', f'rewards/{name}/std']
    return names

  def _stats(self, records, rewards, per_function, zero_std) -> dict:
    """TRL's rollout metrics, each a constant row feature (the loss reports its mean)."""
    lengths = np.array([len(r['decoded_ids']) for r in records], np.float32)
    values = {'reward': grpo.nanmean(rewards), 'reward_std': grpo.nanstd(rewards),
              'frac_reward_zero_std': float(np.mean(zero_std)), 'completions/mean_length': float(lengths.mean()),
              'completions/min_length': float(lengths.min()), 'completions/max_length': float(lengths.max()),
              'completions/clipped_ratio': float(np.mean([r['stop_reason'] == 'max_steps' for r in records]))}
    for f, name in enumerate(self.names):
      values[f'rewards/{name}/mean'] = grpo.nanmean(per_function[:, f])
      values[f'rewards/{name}/std'] = grpo.nanstd(per_function[:, f])
    n = len(records)
    return {grpo.STAT + k: np.full((n,), np.nan_to_num(float(v)), np.float32) for k, v in values.items()}

  def _mine(self, batch: dict) -> dict:
    """This process's rows of the global batch (every process holds all of it)."""
    rows = self.setup.process_batch
    start = self.setup.infeed.host_index * rows
    return {k: np.ascontiguousarray(v[start:start + rows]) for k, v in batch.items()}

  def _reference_params(self, params):
    """LoRA: `params` with every adapter zeroed (the base exactly); else the starting weights, kept."""
    if train_state.has_frozen(self.setup):
      return jax.tree_util.tree_map_with_path(
          lambda path, x: jnp.zeros_like(x) if lora.is_adapter(str(getattr(path[-1], 'key', path[-1]))) else x, params)
    if self._reference is None:
      if self.base:
        self._reference = restore.base_params(self.setup, self.base, frozen_only=False)
      else:
        self._reference = engine.init_state(self.setup, self.seed)['params']
    return self._reference


def layout_rows(prompt_ids: Sequence, completion_ids: Sequence, length: int) -> dict:
  """GrpoLm's rows [N, length]: each prompt then its completion from position 0, segment 1 on every real token,
  weights 1 where the label (the next token) is a completion token."""
  n = len(prompt_ids)
  ids = np.zeros((n, length), np.int32)
  labels = np.zeros((n, length), np.int32)
  weights = np.zeros((n, length), np.float32)
  segments = np.zeros((n, length), np.int32)
  for r, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
    seq = list(prompt) + list(completion)
    p, end = len(prompt), len(seq)
    ids[r, :end] = seq
    labels[r, :end - 1] = seq[1:]
    weights[r, p - 1:end - 1] = 1.0
    segments[r, :end] = 1
  return {'ids': ids, 'labels': labels, 'weights': weights, 'segment_ids': segments}


def _scorer(setup):
  """(params, host batch) -> per-token log-probabilities [B, L] on the host: GrpoLm's own forward pass, jitted on
  the training mesh, every process holding the whole batch."""
  model = setup.model
  batch_sh = sharding.batch_sharding(setup.mesh)
  replicated = NamedSharding(setup.mesh, PartitionSpec())

  def logps(params, batch):
    with setup.activation_sharding():
      return model.apply({'params': params}, batch, method='compute_predictions')['logp']

  fn = jax.jit(logps, in_shardings=(setup.state_shardings['params'], batch_sh), out_shardings=replicated)

  def run(params, host: dict) -> np.ndarray:
    feats = {k: sharding.from_host(host[k], batch_sh) for k in ('ids', 'labels', 'segment_ids')}
    return np.asarray(sharding.to_host(fn(params, feats)), np.float32)
  return run


def _own_state(saved: list[dict]) -> dict:
  """This process's saved state: the one its file names (process_<i>-of-<n>.json), else the i-th."""
  name = f'process_{jax.process_index()}-of-{jax.process_count()}.json'
  named = [s for s in saved if str(s.get(grain_state.FILE, '')).endswith('/' + name)]
  return named[0] if named else saved[jax.process_index()]


def _weights(weights, count: int) -> np.ndarray:
  if not weights:
    return np.ones((count,), np.float32)
  if len(weights) != count:
    raise UserError(f'REWARD_WEIGHTS has {len(weights)} weights for {count} reward functions; give one each.')
  return np.asarray(weights, np.float32)


def _described(e: BaseException) -> str:
  """'ValueError: bad value (my_rewards.py:12)': the exception and the line of the user's code that raised it."""
  frames = traceback.extract_tb(e.__traceback__)
  at = f' ({frames[-1].filename.rsplit("/", 1)[-1]}:{frames[-1].lineno})' if frames else ''
  return f'{type(e).__name__}: {shorten(str(e), 160)}{at}'


def _encode(batch: Optional[dict]) -> Optional[dict]:
  if batch is None:
    return None
  return {k: {'dtype': str(v.dtype), 'shape': list(v.shape), 'data': v.ravel().tolist()} for k, v in batch.items()}


def _decode(saved, shapes: dict, where: str) -> dict:
  """The saved rollout batch, each feature checked against the shape and dtype this run feeds."""
  if not isinstance(saved, dict) or set(saved) != set(shapes):
    got = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
    raise UserError(f'{where}: the saved rollout batch holds {shorten(repr(got), 120)}, this run feeds '
                    f'{shorten(repr(sorted(shapes)), 120)}; resume with the same settings or from another checkpoint.')
  out = {}
  for key, (shape, dtype) in shapes.items():
    item = saved[key]
    ok = (isinstance(item, dict) and item.get('dtype') == dtype and item.get('dtype') in _DTYPES
          and item.get('shape') == list(shape) and isinstance(item.get('data'), list)
          and len(item['data']) == int(np.prod(shape)))
    if ok:
      try:
        out[key] = np.asarray(item['data'], dtype).reshape(shape)
      except (TypeError, ValueError):
        ok = False
    if not ok:
      raise UserError(f'{where}: the saved rollout batch\'s {key!r} is not {dtype} of shape {list(shape)}; resume '
                      'from another checkpoint.')
  return out


def check_reward_functions(functions: Sequence) -> None:
  """UserError for a reward list that cannot run (empty, or holding what is not callable)."""
  if not functions:
    raise UserError('GRPO needs at least one reward function: reward_functions() of the experiment returned none.')
  for f in functions:
    if not callable(f):
      raise UserError(f'reward_functions() returned {shorten(repr(f), 60)}, which is not a function.')
