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

import math
import os
from typing import Any, Optional

import numpy as np

from paxcli.errors import UserError
from paxcli.inputs.base import EndOfInput, padding_like

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
  import jax
  if jax.process_count() == 1:
    return has_data
  from jax.experimental import multihost_utils
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
  """(params, batch) -> replicated sums: loss, correct, weight, examples."""
  import jax
  import jax.numpy as jnp

  from paxcli.models import lm_loss
  model = setup.model

  def step(params, batch):
    logits = model.apply({'params': params}, batch['ids'], batch.get('segment_ids'), batch.get('positions'))
    _, sums = lm_loss(logits, batch['labels'], batch['weights'])
    sums['examples'] = jnp.sum(jnp.any(batch['weights'] > 0, axis=-1))
    return sums

  replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())
  return jax.jit(step, in_shardings=(setup.state_shardings['params'], batch_sharding), out_shardings=replicated)


def lm_template(setup) -> dict:
  rows, length = setup.process_batch, setup.seq_len
  return {'ids': np.zeros((rows, length), np.int32), 'labels': np.zeros((rows, length), np.int32),
          'weights': np.zeros((rows, length), np.float32)}


def run_eval(setup, params, inp, eval_step, batch_sharding) -> dict[str, float]:
  """One eval run over `inp`; metrics are exact weighted means over all hosts."""
  from paxcli.train import to_global
  totals = {'loss_sum': 0.0, 'correct_sum': 0.0, 'weight_sum': 0.0, 'examples': 0.0}
  num_batches = 0
  for batch in EvalReader(inp, lm_template(setup)).batches():
    sums = eval_step(params, to_global(batch, batch_sharding, setup.global_batch))
    for k in totals:
      totals[k] += float(sums[k])
    num_batches += 1
  weight = max(totals['weight_sum'], 1e-12)
  loss = totals['loss_sum'] / weight
  return {'loss': loss, 'accuracy': totals['correct_sum'] / weight,
          'log_pplx': loss, 'perplexity': math.exp(min(loss, 50.0)),
          'num_examples': totals['examples'], 'num_tokens': totals['weight_sum'], 'num_batches': num_batches}


class Evaluator:
  """Eval inputs of an experiment, built once, run at any step (train's hook and `pax eval`)."""

  def __init__(self, resolved, setup, job_dir: Optional[str]):
    import jax

    from paxcli import engine, sharding
    self.setup = setup
    self.batch_sharding = sharding.batch_sharding(setup.mesh)
    self.step = make_eval_step(setup, self.batch_sharding)
    self.inputs = {}
    for cfg in resolved.eval_datasets():
      check_semantics(cfg)
      self.inputs[cfg.name] = engine.build_input(cfg, setup)
    self.job_dir = job_dir if jax.process_index() == 0 else None
    self.writers = {}

  def _writer(self, name: str):
    """Process 0's summary writer for one eval input, made at its first eval (no empty files)."""
    if self.job_dir and name not in self.writers:
      from paxcli.summaries import SummaryWriter
      self.writers[name] = SummaryWriter(os.path.join(self.job_dir, 'summaries', f'eval_{name}'),
                                         os.path.join(self.job_dir, f'eval_{name}_metrics.jsonl'))
    return self.writers.get(name)

  def run(self, step: int, params) -> dict[str, dict[str, Any]]:
    results = {}
    for name, inp in self.inputs.items():
      metrics = run_eval(self.setup, params, inp, self.step, self.batch_sharding)
      results[name] = metrics
      writer = self._writer(name)
      if writer:
        writer.scalars(step, metrics)
    return results

  def close(self) -> None:
    for writer in self.writers.values():
      writer.close()


def evaluate(resolved, job_dir: str, console, use_checkpoint: bool = True) -> dict:
  """`pax eval`: metrics of every eval dataset from the latest checkpoint (or fresh weights)."""
  from paxcli import engine
  setup = engine.build(resolved)
  if not resolved.eval_datasets():
    raise UserError(f'{resolved.name} has no eval datasets (inputs with is_training=False).')
  step = 0
  if use_checkpoint:
    from paxcli import restore
    step = restore.choose_step(job_dir, purpose='evaluate')
    flat = {k: repr(v) for k, v in resolved.flat().items()}
    restored = restore.restore(setup, job_dir, step, params_only=True, flat_now=flat, action='evaluate',
                               fallback=True, log=lambda m: console.print(m, highlight=False, markup=False))
    state, step = restored.state, restored.step  # an older step if the latest is damaged
  else:
    state = engine.init_state(setup, resolved.experiment.RANDOM_SEED)
  evaluator = Evaluator(resolved, setup, job_dir)
  try:
    results = evaluator.run(step, state['params'])
  finally:
    evaluator.close()
  return {'step': step, 'results': results}


def results_table(step: int, results: dict):
  from rich.table import Table
  table = Table(title=f'Eval at step {step}')
  for col in ('dataset', 'loss', 'accuracy', 'perplexity', 'examples', 'tokens', 'batches'):
    table.add_column(col, justify='left' if col == 'dataset' else 'right')
  for name, m in results.items():
    table.add_row(name, f"{m['loss']:.4f}", f"{m['accuracy']:.4f}", f"{m['perplexity']:.2f}",
                  f"{m['num_examples']:.0f}", f"{m['num_tokens']:.0f}", f"{m['num_batches']}")
  return table
