"""Eval: Pax's eval semantics, exact metrics across hosts, and `pax eval`.

How many batches one eval run reads:

  reset_for_eval  eval_loop_num_batches  meaning
  True            None                   one full epoch from the start; input must be finite
  False           N                      the next N batches, rolling on; input must repeat
  True            N                      refused ("the first N batches each time")
  False           None                   refused (would never end)

With an epoch, hosts may hold different numbers of batches: a host that has run out
feeds batches of zero weight while any host still has data, and all hosts agree on
that with a collective each step, so every example counts exactly once.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from rich.table import Table

from paxcli.errors import UserError, shorten
from paxcli.inputs.base import EndOfInput, padding_like
from paxcli.jobdir import checkpoint as ckpt
from paxcli.jobdir import layout
from paxcli.jobdir import lock as joblock
from paxcli.jobdir import restore
from paxcli.jobdir import storage
from paxcli.jobdir.summaries import SummaryWriter
from paxcli.runtime import engine, infeed
from paxcli.runtime import sharding
from paxcli.runtime.sharding import to_global

SEMANTICS_TABLE = (
    'Eval semantics (reset_for_eval, eval_loop_num_batches): (True, None) = one epoch of a finite input '
    '(repeat=False); (False, N) = the next N batches of a repeating input. (True, N) and (False, None) '
    'are not supported.')


def check_semantics(cfg) -> None:
  """Raises UserError for an eval input whose settings have no meaning (see table above)."""
  name = getattr(cfg, 'name', '?')
  reset, n, repeat = cfg.reset_for_eval, cfg.eval_loop_num_batches, cfg.repeat
  if reset and n is not None:
    raise UserError(f'Eval input {name!r}: reset_for_eval=True with eval_loop_num_batches={n} would read the '
                    f'same first {n} batches every time. {SEMANTICS_TABLE}')
  if not reset and n is None:
    raise UserError(f'Eval input {name!r}: reset_for_eval=False needs eval_loop_num_batches (how many '
                    f'batches each eval run takes). {SEMANTICS_TABLE}')
  if reset and repeat:
    raise UserError(f'Eval input {name!r}: reset_for_eval=True reads one epoch, but the input repeats '
                    f'forever; set repeat=False. {SEMANTICS_TABLE}')
  if not reset and not repeat:
    raise UserError(f'Eval input {name!r}: reset_for_eval=False takes batches on a rolling basis and needs '
                    f'a repeating input; set repeat=True. {SEMANTICS_TABLE}')


def any_host_has_data(has_data: bool) -> bool:
  """True while any process still has real data (a collective across processes)."""
  if jax.process_count() == 1:
    return has_data
  flags = multihost_utils.process_allgather(np.array([1 if has_data else 0], np.int32))
  return bool(np.asarray(flags).sum() > 0)


class EvalReader:
  """Reads one eval run from an input, one host's view: real batches, then zero-weight padding.

  `template` gives shapes for a host that has no data at all. The caller decides with
  the other hosts when the run ends (see `batches`).
  """

  def __init__(self, inp, template: dict):
    check_semantics(inp)
    self.input = inp
    self.template = template
    self.start()

  def start(self) -> None:
    if self.input.reset_for_eval:
      self.input.reset()
    self._taken = 0
    self._last = self.template

  def next(self) -> tuple[dict, bool]:
    """(batch, has_data); after this host's data ends, padding batches with has_data False."""
    inp = self.input
    if not inp.reset_for_eval and self._taken >= inp.eval_loop_num_batches:
      return padding_like(self._last), False
    try:
      batch = inp.get_next()
    except EndOfInput:
      if not inp.reset_for_eval:
        raise UserError(f'Eval input {inp.name!r} ended, but reset_for_eval=False needs a repeating input.')
      return padding_like(self._last), False
    self._taken += 1
    self._last = batch
    return batch, True

  def batches(self, agree=any_host_has_data):
    """One eval run: batches until no host has data (agreed by a collective each step)."""
    self.start()
    while True:
      batch, has_data = self.next()
      if not agree(has_data):
        return
      yield batch


def make_eval_step(setup, batch_sharding):
  """(variables, batch) -> replicated sums: value x weight and weight of each metric, examples."""
  model = setup.model

  def step(variables, batch):
    with setup.activation_sharding():
      _, metrics = model.apply(variables, batch, method='fprop')
    sums = {}
    for name, (value, weight) in metrics.items():
      weight = jnp.asarray(weight, jnp.float32)
      sums[f'{name}/sum'] = jnp.asarray(value, jnp.float32) * weight
      sums[f'{name}/weight'] = weight
    sums['examples'] = model.examples_in(batch)
    return sums

  replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())
  return jax.jit(step, in_shardings=(eval_variable_shardings(setup), batch_sharding), out_shardings=replicated)


def eval_variable_shardings(setup) -> dict:
  out = {'params': setup.state_shardings['params']}
  if 'non_trainable' in setup.state_shardings:
    out['non_trainable'] = setup.state_shardings['non_trainable']
  return out


def eval_variables(state) -> dict:
  """The model variables of a train state ({'params', 'non_trainable'?})."""
  out = {'params': state['params']}
  if 'non_trainable' in state:
    out['non_trainable'] = state['non_trainable']
  return out


def lm_template(setup) -> dict:
  """Zero batch of this process's shape: what a host with no eval data at all feeds."""
  return setup.model.dummy_batch(setup.process_batch, setup.seq_len)


def run_eval(setup, variables, inp, eval_step, batch_sharding) -> dict[str, float]:
  """One eval run over `inp`; metrics are exact weighted means over all hosts."""
  totals: dict[str, float] = {}
  num_batches = 0
  for batch in EvalReader(inp, lm_template(setup)).batches():
    sums = eval_step(variables, to_global(batch, batch_sharding, setup.global_batch))
    for k, v in sums.items():
      totals[k] = totals.get(k, 0.0) + float(v)
    num_batches += 1
  names = [k[:-len('/sum')] for k in totals if k.endswith('/sum')]
  weights = {n: totals[f'{n}/weight'] for n in names}
  means = {n: totals[f'{n}/sum'] / max(weights[n], 1e-12) for n in names}
  results = setup.model.eval_summary(means, weights)
  results['num_examples'] = totals.get('examples', 0.0)
  results['num_batches'] = num_batches
  return results


def eval_label(name: str) -> str:
  """How a log line names an eval input: `eval` for the usual one, else `eval on N`."""
  return 'eval' if name == 'eval' else f'eval on {name}'


def metrics_line(step: int, name: str, m: dict, model=None) -> str:
  accuracy = f"  accuracy {m['accuracy']:.4f}" if 'accuracy' in m else ''
  return (f"step {step}: {eval_label(name)}: loss {m['loss']:.4f}{accuracy}{line_note(m, model)}  "
          f"({m['num_examples']:.0f} examples)")


def line_note(record: dict, model) -> str:
  """'  rewards/margins 0.1234 ...' for the metrics a model names in `line_metrics` (the log lines show the loss
  and accuracy of every model, and these after them; every metric goes to TensorBoard and the trackers)."""
  names = getattr(model, 'line_metrics', ())
  return ''.join(f'  {k} {record[k]:.4g}' for k in names if k in record)


class Evaluator:
  """Eval inputs of an experiment, built once, run at any step (train's hook and `pax eval`)."""

  def __init__(self, resolved, setup, job_dir: Optional[str], trackers=None):
    self.setup = setup
    self.trackers = trackers  # the trainer's W&B / MLflow (paxcli.jobdir.trackers): eval scalars go there too,
                              # from the writers made after it is set
    self.batch_sharding = sharding.batch_sharding(setup.mesh)
    self.step = make_eval_step(setup, self.batch_sharding)
    self.inputs = {}
    for cfg in resolved.eval_datasets():
      check_semantics(cfg)
      self.inputs[cfg.name] = infeed.build_input(cfg, setup)
    self.job_dir = job_dir if jax.process_index() == 0 else None
    self.writers = {}

  def _writer(self, name: str):
    """Process 0's summary writer for one eval input, made at its first eval (no empty files)."""
    if self.job_dir and name not in self.writers:
      self.writers[name] = SummaryWriter(*layout.eval_paths(self.job_dir, name), one_row_per_step=True,
                                         trackers=self.trackers)
    return self.writers.get(name)

  def run(self, step: int, state) -> dict[str, dict[str, Any]]:
    """Metrics of every eval input for a train state (or a bare params tree)."""
    variables = eval_variables(state) if {'step', 'params'} <= set(state) else {'params': state}
    results = {}
    for name, inp in self.inputs.items():
      metrics = run_eval(self.setup, variables, inp, self.step, self.batch_sharding)
      results[name] = metrics
      writer = self._writer(name)
      if writer:
        writer.scalars(step, metrics)
    return results

  def close(self) -> None:
    for writer in self.writers.values():
      writer.close()


def evaluate(resolved, job_dir: str, console, use_checkpoint: bool = True, step: Optional[int] = None) -> dict:
  """`pax eval`: metrics of every eval dataset from the latest checkpoint, checkpoint `step`, or fresh weights."""
  setup = engine.build(resolved)
  if not resolved.eval_datasets():
    raise UserError(f'{resolved.name} has no eval datasets (inputs with is_training=False).')
  evaluator = Evaluator(resolved, setup, job_dir)
  try:
    if use_checkpoint:
      latest = step is None  # the latest: a damaged one falls back to the newest intact one
      step = restore.choose_step(job_dir, step=step, purpose='evaluate')
      step, results = _evaluate_step(resolved, setup, evaluator, job_dir, step, fallback=latest,
                                     log=lambda m: console.print(m, highlight=False, markup=False, soft_wrap=True))
    else:
      step = 0
      results = evaluator.run(step, engine.init_state(setup, resolved.experiment.RANDOM_SEED))
  finally:
    evaluator.close()
  return {'step': step, 'results': results}


STOP, WAIT = -1, -2  # what a follower does next, besides evaluating a step
TRAINER_START_GRACE_S = 120.0  # --follow without --timeout and no trainer seen yet: how long to wait for one


def _evaluate_step(resolved, setup, evaluator, job_dir: str, step: int, fallback: bool = False,
                   log=print) -> tuple[int, dict]:
  """Restores checkpoint `step` (parameters only), evaluates it and records it in eval_done.jsonl.

  Returns (the step evaluated, metrics): with fallback, an older step when `step` is damaged
  (named in a WARNING line; nothing is moved: eval only reads).
  """
  flat = {k: repr(v) for k, v in resolved.flat().items()}
  restored = restore.restore(setup, job_dir, step, params_only=True, flat_now=flat, action='evaluate',
                             fallback=fallback, log=log)
  step = restored.step
  data_note = _data_note(restored.meta, flat)
  if data_note:
    log(data_note)
  results = evaluator.run(step, restored.state)
  if jax.process_index() == 0:
    joblock.append_line(layout.eval_done(job_dir),
                       json.dumps({'step': step, 'datasets': sorted(results), 'time': time.time()}))
  return step, results


# The fields of an input config that name its data (a glob, a TFRecord pattern, a SeqIO mixture, a TFDS
# name, ...): what a run trains and evaluates on, as the resolved config holds it (paths made absolute).
DATA_FIELDS = ('__fn_or_cls__', 'data', 'split', 'text_field', 'file_pattern', 'lm_feature', 'mixture_name',
               'mixture_or_task', 'split_name', 'tfds_name', 'data_dir')


def _data_note(meta: dict, flat_now: dict) -> Optional[str]:
  """A note when the inputs read other data than the checkpoint's config names: `pax eval` of a job
  with --exp and without the trainer's `--set TRAIN_DATA=...` evaluates the experiment's own inputs,
  and its numbers mean nothing for the run (the shapes match, so nothing else says so)."""
  saved = meta.get('config') or {}
  keys = sorted(k for k in set(saved) & set(flat_now)
                if k.startswith('datasets.') and k.rsplit('.', 1)[1] in DATA_FIELDS and saved[k] != flat_now[k])
  if not keys:
    return None
  changed = [f'{k}: checkpoint {shorten(saved[k], 80)} -> now {shorten(flat_now[k], 80)}' for k in keys[:3]]
  return ('Note: this eval reads other data than the checkpoint was trained on (' + '; '.join(changed) +
          '); for the run\'s own eval data leave out --exp (the job\'s own experiment and --set apply).')


def evaluated_steps(job_dir: str, names) -> set[int]:
  """Checkpoint steps whose every eval input in `names` was evaluated (eval_done.jsonl)."""
  done: dict[int, set[str]] = {}
  try:
    text = storage.read_text(layout.eval_done(job_dir))
  except FileNotFoundError:
    text = ''
  for line in text.splitlines():
    try:
      record = json.loads(line)
      done.setdefault(int(record['step']), set()).update(record.get('datasets', []))
    except (ValueError, TypeError, KeyError, AttributeError):  # a line cut by a kill: evaluated again
      continue
  return {step for step, got in done.items() if set(names) <= got}


def _agree(value: int) -> int:
  """Process 0's value on every process (the checkpoint listing may differ for a moment)."""
  if jax.process_count() == 1:
    return value
  return int(multihost_utils.broadcast_one_to_all(np.asarray(value, np.int64)))


class _Trainer:
  """Whether a trainer may still write checkpoints into the job directory (its train.lock)."""

  def __init__(self, job_dir: str, grace: Optional[float]):
    self.job_dir, self.grace, self.seen, self.started = job_dir, grace, False, time.monotonic()
    self.why = ''

  def gone(self) -> bool:
    """True when no trainer runs and none is expected: the lock names a dead process, or it was
    released (by a trainer seen here, or none came for `grace` seconds; None: wait)."""
    owner = joblock.read_owner(self.job_dir)
    state = joblock.trainer_state(owner)
    lock = layout.lock(self.job_dir)
    if state == 'running':
      self.seen = True
      return False
    if state == 'dead':
      self.why = f'the trainer named in {lock} (pid {owner.get("pid")}) is no longer running'
      return True
    if self.seen:
      self.why = f'the trainer has finished or stopped (it released {lock})'
      return True
    if self.grace is not None and time.monotonic() - self.started >= self.grace:
      self.why = f'no trainer has held {lock} for {self.grace:g} s'
      return True
    return False


def follow(resolved, job_dir: str, console, timeout: Optional[float] = None, poll_seconds: float = 10.0,
           on_result=None, on_first=None) -> list[dict]:
  """`pax eval --follow`: evaluate each new checkpoint of job_dir once, beside a running trainer.

  Steps already in job_dir/eval_done.jsonl (for every current eval input) are skipped, also
  after a restart; a step is claimed while it is evaluated (joblock.StepClaim), so several
  followers share the work. Stops once this config's last step (num_train_steps, with the
  user's --set) is evaluated; when no trainer runs on the job directory any more (train.lock
  released, or naming a dead process; without `timeout`, also when none has come for
  TRAINER_START_GRACE_S) and every checkpoint is evaluated; or after `timeout` seconds.
  on_first() is called (process 0) before the first evaluation: the job directory exists by
  then (a follower never creates it).
  """
  setup = engine.build(resolved)
  if not resolved.eval_datasets():
    raise UserError(f'{resolved.name} has no eval datasets (inputs with is_training=False).')
  names = [cfg.name for cfg in resolved.eval_datasets()]
  directory = layout.checkpoints(job_dir)
  last_step = int(resolved.task.train.num_train_steps)
  log = lambda m: console.print(m, highlight=False, markup=False, soft_wrap=True)
  done = evaluated_steps(job_dir, names)
  log(f'Following {directory}: evaluating each new checkpoint on {", ".join(names)} up to step {last_step}'
      + (f'; {len(done)} already evaluated (in {os.path.basename(layout.eval_done(job_dir))})' if done else '')
      + ('' if timeout is None else f'; giving up after {timeout:g} s') + '.')
  evaluator = Evaluator(resolved, setup, job_dir)
  trainer = _Trainer(job_dir, TRAINER_START_GRACE_S if timeout is None else None)
  deadline = None if timeout is None else time.monotonic() + timeout
  out = []
  try:
    while True:
      claim, action = None, WAIT
      if jax.process_index() == 0:
        claim, action = _next_step(job_dir, names, done, trainer, last_step, log)
        if action == WAIT and deadline is not None and time.monotonic() >= deadline:
          action = STOP
          log(f'Stopping after --timeout {timeout:g} s: step {last_step} has not been written yet.')
      action = _agree(action)
      if action == STOP:
        break
      if action == WAIT:
        time.sleep(poll_seconds)
        continue
      step = action
      try:
        if on_first:
          on_first()
          on_first = None
        _, results = _evaluate_step(resolved, setup, evaluator, job_dir, step)
      except restore.CheckpointGone:
        log(f'Note: the checkpoint at step {step} was deleted before it could be evaluated (the trainer keeps '
            'only the latest task.train.save_max_to_keep); skipping it.')
        done.add(step)
        continue
      except restore.DamagedCheckpoint as e:
        log(f'WARNING: {e} Skipping it.')
        done.add(step)
        continue
      finally:
        if claim is not None:
          claim.release()
      done.add(step)
      for name, m in results.items():
        log(metrics_line(step, name, m, setup.model))
      record = {'step': step, 'results': results}
      out.append(record)
      if on_result:
        on_result(record)
  finally:
    evaluator.close()
  return out



def _next_step(job_dir: str, names, done: set, trainer: _Trainer, last_step: int, log):
  """Process 0 of a follower: (claim, step to evaluate), or (None, STOP or WAIT)."""
  directory = layout.checkpoints(job_dir)
  gone = trainer.gone()  # before listing: a trainer that is gone has written its last checkpoint
  done |= evaluated_steps(job_dir, names)  # also other followers' work
  todo = [s for s in ckpt.complete_steps(directory) if s not in done]
  for step in todo:
    claim = joblock.StepClaim(layout.step_dir(job_dir, step))
    if not claim.acquire():
      continue  # another follower evaluates it
    if step in evaluated_steps(job_dir, names):  # another follower finished it meanwhile
      claim.release()
      done.add(step)
      continue
    return claim, step
  if todo:
    return None, WAIT
  evaluated = max(done, default=None)
  if evaluated is not None and evaluated >= last_step:
    return None, STOP
  if gone:
    log(f'Stopping: {trainer.why}, and no new checkpoint came; evaluated up to step '
        f'{"none" if evaluated is None else evaluated} of the {last_step} this config trains to.')
    return None, STOP
  return None, WAIT


def results_table(step: int, results: dict):
  table = Table(title=f'Eval at step {step}')
  first = next(iter(results.values()), {})
  counts = [('num_examples', 'examples'), ('num_tokens', 'tokens'), ('num_batches', 'batches')]
  metrics = [k for k in first if k not in dict(counts) and k != 'log_pplx']
  columns = ['dataset'] + metrics + [label for key, label in counts if key in first]
  for col in columns:
    table.add_column(col, justify='left' if col == 'dataset' else 'right')
  for name, m in results.items():
    cells = [f'{m[k]:.2f}' if k == 'perplexity' else f'{m[k]:.4f}' for k in metrics]
    table.add_row(name, *cells, *(f'{m[key]:.0f}' for key, _ in counts if key in m))
  return table
