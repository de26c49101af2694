"""The train loop: `_train` reads top to bottom; the step, and the hooks that do the rest.

`_train` builds the run (mesh, model, state shapes), opens the job directory (its paths are
named in paxcli/jobdir/layout.py), resumes from the latest good checkpoint or initialises,
registers the hooks (`_begin`; paxcli/loops/hooks.py) and runs the steps. Everything a step leads to
besides the next step is a hook: the loss check, summaries and progress, checkpoints, eval,
decode, the profiler and the graceful stop.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import os
import re
import shutil
import signal
import statistics
import sys
import threading
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax
from jax.experimental import multihost_utils
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Table

from paxcli import optim
from paxcli import values as ptypes
from paxcli.config import config_differences
from paxcli.convert import lora as convert_lora
from paxcli.errors import UserError, shorten
from paxcli.inputs import grain_input
from paxcli.jobdir import checkpoint as ckpt
from paxcli.jobdir import fast_tier
from paxcli.jobdir import format as job_format
from paxcli.jobdir import invocation
from paxcli.jobdir import layout
from paxcli.jobdir import ledger
from paxcli.jobdir import lock as joblock
from paxcli.jobdir import restore
from paxcli.jobdir import storage
from paxcli.jobdir import summaries
from paxcli.jobdir import tokenizer
from paxcli.jobdir import trackers as track
from paxcli.layers.base import AUX_LOSS, NON_TRAINABLE, RANDOM, SUMMARIES, flatten_collection
from paxcli.layers.fp8 import FP8_STATE
from paxcli.loops import accumulate
from paxcli.loops.decode.training import TrainDecoder
from paxcli.loops import goodput
from paxcli.loops import reference
from paxcli.loops import rollout
from paxcli.loops.evaluate import DATA_FIELDS, Evaluator, line_note, metrics_line
from paxcli.loops.hooks import Chrono, Hooks, StepInfo, Window
from paxcli.loops.router_watch import RouterWatch, load_note, totals
from paxcli.models import pattern
from paxcli.perf import flops
from paxcli.perf import profiling
from paxcli.perf import xla_log
from paxcli.runtime import distributed
from paxcli.runtime import engine
from paxcli.runtime import infeed
from paxcli.runtime import platform
from paxcli.runtime import sharding
from paxcli.runtime import train_state
from paxcli.runtime.sharding import to_global


class TrainingDiverged(UserError):
  exit_code = 3


# ---- The step -------------------------------------------------------------------------------------


def make_train_step(setup, batch_sharding, dropout_seed: int, compiler_options: Optional[dict] = None):
  """The jitted step: (state, batch) -> (state, metrics); state is donated.

  The model's fprop gives (loss, metrics); aux losses its layers add join the loss; with
  GRAD_ACCUM_STEPS > 1 the batch runs as that many microbatches (paxcli.loops.accumulate);
  non-trainable variables come back updated (the optimizer never sees them), and so does fp8
  scaling state; layer summaries come back in the metrics under 'summary/<layer path>/<name>', one
  per layer whether the stack is scanned or not.
  `compiler_options`: XLA options for this program only (a PGLE profile, for one).
  """
  model, tx = setup.model, setup.tx
  lr_fn = optim.learning_rate_fn(setup.train)
  has_non_trainable = 'non_trainable' in setup.state_shardings
  gradients = step_gradients(setup, dropout_seed)

  def step_fn(state, batch):
    done = gradients(state, batch)
    trainable, frozen = train_state.split_trainable(model, state['params'])
    grads = done.grads
    param_updates, opt_state = tx.update(grads, state['opt_state'], trainable)
    params = train_state.join_params(optax.apply_updates(trainable, param_updates), frozen)
    metrics = {k: v for k, (v, _) in done.metrics.items()}
    metrics.update({
        'loss': done.total,
        'grad_norm': optax.tree.norm(grads) if hasattr(optax, 'tree') else optax.global_norm(grads),
        'learning_rate': lr_fn(state['step']),
        'tokens': model.count_in(done.metrics),
    })
    if done.aux:
      metrics['model_loss'] = done.loss
      metrics.update({f'aux_loss/{k}': v for k, v in done.aux.items()})
    metrics.update({f'summary/{k}': v for k, v in done.summaries.items()})
    new_state = {'step': state['step'] + 1, 'params': params, 'opt_state': opt_state, **done.carried}
    if has_non_trainable:
      new_state['non_trainable'] = sync_non_trainable(done.carried['non_trainable'], setup)
    return new_state, metrics

  replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())
  return jax.jit(step_fn, in_shardings=(setup.state_shardings, batch_sharding),
                 out_shardings=(setup.state_shardings, replicated), donate_argnums=(0,),
                 compiler_options=compiler_options or None)


def step_gradients(setup, dropout_seed: int) -> Callable[[dict, dict], accumulate.Pass]:
  """(state, batch) -> the step's accumulate.Pass: gradients of the trainable params over the whole
  batch (GRAD_ACCUM_STEPS microbatches of it), the loss and metrics, and the state collections carried
  on (non_trainable, fp8)."""
  model = setup.model
  lm = getattr(model, 'lm_tpl', None)
  layers_per_group, prefix = pattern.period(getattr(lm, 'layer_pattern', None)), pattern.prefix_of(lm)
  deterministic = not model.has_dropout
  has_non_trainable = 'non_trainable' in setup.state_shardings
  accum_steps = getattr(setup.train, 'grad_accum_steps', 1)

  def gradients(state, batch):
    rngs = step_rngs(dropout_seed, state['step'])
    # Frozen params (LoRA's base) are closed over: no gradient is computed for them and the
    # optimizer never sees them.
    trainable, frozen = train_state.split_trainable(model, state['params'])

    def one_pass(carried, batch, rngs) -> accumulate.Pass:
      def loss_fn(trainable, fp8_state):
        variables = {'params': train_state.join_params(trainable, frozen)}
        if has_non_trainable:
          variables[NON_TRAINABLE] = carried['non_trainable']
        if fp8_state is not None:
          variables[FP8_STATE] = fp8_state
        with setup.activation_sharding():
          (loss, model_metrics), updates = model.apply(
              variables, batch, deterministic=deterministic, method='fprop', rngs=rngs,
              mutable=[NON_TRAINABLE, SUMMARIES, AUX_LOSS])
        aux = flatten_collection(updates.get(AUX_LOSS, {}))
        total = loss + sum(jnp.sum(v) for v in aux.values()) if aux else loss
        return total, (loss, model_metrics, aux, updates)

      # fp8 delayed scaling's state comes back as its own "gradient": its next value (paxcli.layers.fp8)
      (total, (loss, model_metrics, aux, updates)), (grads, fp8_next) = jax.value_and_grad(
          loss_fn, argnums=(0, 1), has_aux=True)(trainable, carried.get('fp8'))
      summaries = flatten_collection(pattern.per_layer(updates.get(SUMMARIES, {}), layers_per_group, prefix))
      nxt = {'fp8': fp8_next} if fp8_next is not None else {}
      if has_non_trainable:
        nxt['non_trainable'] = train_state.unbox(updates[NON_TRAINABLE])
      return accumulate.Pass(grads, total, loss, model_metrics, {k: jnp.sum(v) for k, v in aux.items()},
                             {k: jnp.mean(v) for k, v in summaries.items()}, nxt)  # scanned layers: the mean

    carried = {k: state[k] for k in ('non_trainable', 'fp8') if k in state}
    return accumulate.run(one_pass, carried, batch, rngs, accum_steps, setup.mesh)

  return gradients


def step_rngs(seed: int, step) -> dict:
  """The random streams of one train step: a function of the seed and the step alone, so a
  resumed run draws what an uninterrupted one would. Flax folds in each call on top."""
  rng = jax.random.fold_in(jax.random.key(seed), step)
  return {'dropout': rng, RANDOM: jax.random.fold_in(rng, 1)}


def sync_non_trainable(new_vars, setup):
  """Non-trainable variables after a step, laid out as the state holds them.

  Under jit the layers compute their updates from the global batch, so each variable
  already holds the mean over data-parallel replicas (Pax's REQUIRES_MEAN_SYNC, which
  with pmap averaged per-replica values); the sharding constraint keeps every replica's
  copy the same array.
  """
  return jax.tree.map(jax.lax.with_sharding_constraint, train_state.unbox(new_vars), setup.state_shardings['non_trainable'])


def ready_step(resolved, seed: int = 0):
  """(setup, initial state, jitted step, batch sharding, train input) without the loop.

  For benchmarks and tests that run steps directly.
  """
  setup = engine.build(resolved)
  state = engine.init_state(setup, seed)
  batch_sharding = sharding.batch_sharding(setup.mesh)
  step = make_train_step(setup, batch_sharding, seed)
  return setup, state, step, batch_sharding, infeed.build_input(resolved.train_dataset(), setup)


# ---- The hooks ------------------------------------------------------------------------------------


class TrainStep:
  """The jitted step, and the profiler around it: `profiler.before(step)` starts a trace ahead of a
  step; the `profile` hook stops it, and recompiles the step with a PGLE profile once measured."""

  def __init__(self, setup, batch_sharding, dropout_seed: int, profiler: profiling.StepProfiler,
               log: Callable[[str], None] = print):
    self._make = functools.partial(make_train_step, setup, batch_sharding, dropout_seed)
    self._profiler = profiler
    self._fn = self._make(profiler.pgle_options)
    self._log, self._compiled = log, False

  def __call__(self, state, batch):
    if self._compiled:
      return self._fn(state, batch)
    found = {}   # the first call compiles: XLA's full-rematerialization warnings become one line
    with xla_log.rematerialized(found):
      out = self._fn(state, batch)
    self._compiled = True
    note = xla_log.remat_note(found, 'pax bench mfu --json lists them')
    if note:
      self._log(note)
    return out

  def profile(self, info: StepInfo) -> None:
    """Hook, every step (a no-op outside the traced steps)."""
    recompile_with = self._profiler.after(info.step, info.metrics)
    if recompile_with:
      self._fn = self._make(recompile_with)


# A run whose first this-many steps (of one invocation) all have zero total weight stops:
# every target token is masked, so the loss is 0 and nothing trains.
ZERO_WEIGHT_STEPS_TO_STOP = 10


class LossGuard:
  """Stops a run whose finite loss jumps far above its recent median, as a NaN does.

  `recent` holds the last `window` step losses; it is saved in each checkpoint's meta, so a
  resumed run (say, with a learning rate a thousand times too big) is checked from its first step.
  The check starts once 10 losses are known. factor 0 turns it off.
  """

  MIN_HISTORY = 10

  def __init__(self, factor: float, window: int, history=()):
    self.factor = factor
    self.recent = collections.deque((float(x) for x in history or () if math.isfinite(float(x))), maxlen=window)

  def median(self) -> Optional[float]:
    return statistics.median(self.recent) if self.recent else None

  def check(self, step: int, loss: float, last_checkpoint: Optional[int]) -> None:
    median = self.median()
    if self.factor and len(self.recent) >= min(self.MIN_HISTORY, self.recent.maxlen) and median > 0 \
        and loss > self.factor * median:
      kept = f'step {last_checkpoint}' if last_checkpoint is not None else 'none yet'
      raise TrainingDiverged(
          f'The loss jumped to {loss:.4g} at step {step}, {loss / median:,.0f}x its median {median:.4g} over the '
          f'last {len(self.recent)} steps (task.train.loss_spike_factor={self.factor:g}); stopping. No checkpoint '
          f'of this state was written; the last checkpoint is {kept}. Lower the learning rate, or set '
          'task.train.loss_spike_factor=0 to turn this check off.')
    self.recent.append(loss)


class LossCheck:
  """Hook, every step: each step's metrics, read one step late (the host never waits on the step
  just dispatched), stop the run on a non-finite or runaway loss (LossGuard) and on steps whose
  every target token is masked. A summary or a save reads the latest step at once (`settle`)."""

  def __init__(self, guard: LossGuard, start_step: int, total_steps: int, checkpointer: ckpt.Checkpointer):
    self.guard, self._start, self._total, self._checkpointer = guard, start_step, total_steps, checkpointer
    self._pending = None  # (step, metrics on the device) not yet read
    self._rows: list[dict] = []  # read and checked since the last summary
    self._seen = self._zero_weight = 0

  def __call__(self, info: StepInfo) -> None:
    self.settle()
    self._pending = (info.step, info.metrics)

  def settle(self) -> None:
    if self._pending is not None:
      self._rows.append(self._check(*self._pending))
      self._pending = None

  def drain(self) -> list[dict]:
    """The rows checked since the last drain."""
    rows, self._rows = self._rows, []
    return rows

  def _check(self, step: int, metrics) -> dict:
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}   # one transfer for all
    if not math.isfinite(values['loss']):
      raise TrainingDiverged(f'The loss became {values["loss"]} at step {step}; stopping. No checkpoint of '
                             'this state was written. Lower the learning rate or check the input.')
    self.guard.check(step, values['loss'], self._checkpointer.latest_saved)
    values['step'] = step
    self._seen += 1
    self._zero_weight += values['tokens'] == 0
    if self._seen == self._zero_weight == min(ZERO_WEIGHT_STEPS_TO_STOP, self._total - self._start):
      raise UserError(f'Steps {self._start + 1}-{step} all had zero total weight: every target token of every '
                      'batch is masked (weights 0), so the loss is 0 and nothing trains. Stopping. Check the '
                      "input's weights or paddings (`pax inspect-input` shows padding per feature).")
    return values


class Summary:
  """Hook, every summary_interval_steps and at the end: the means of the steps since the last
  summary, with rates over the window's steady time, into TensorBoard and train_metrics.jsonl
  (process 0's `writer`) and the log. `last` is the latest summary (the run's return value)."""

  def __init__(self, losses: LossCheck, chrono: Chrono, reporter: Reporter, writer, mfu_of, start_step: int,
               router_watch: Optional[RouterWatch] = None):
    self._losses, self._chrono, self._reporter, self._writer, self._mfu_of = losses, chrono, reporter, writer, mfu_of
    self._router_watch = router_watch
    self.last = {'step': start_step}

  def __call__(self, info: StepInfo) -> None:
    self._losses.settle()
    rows, window = self._losses.drain(), self._chrono.window(info.step)
    if rows and not any(r['tokens'] for r in rows):
      self._reporter.log(f"warning: steps {rows[0]['step']}-{rows[-1]['step']} had zero total weight (every "
                         'target token masked): their loss 0 means nothing was trained.')
    if self._router_watch:
      self._router_watch(rows)
    self.last = _summarize(info.step, rows, window, self._mfu_of)
    self.last.update(totals(self.last))
    if self._writer:
      self._writer.scalars(info.step, {k: v for k, v in self.last.items() if k != 'step'})
    self._reporter.summary(self.last, self._chrono.eta(info.step, self.last['steps_per_sec']))

  def close(self) -> None:
    if self._writer:
      self._writer.close()


class Saver:
  """Hook, every save_interval_steps, at the end and at a stop: a checkpoint of the state (never of
  non-finite parameters) with the meta a resume reads (RunSpec, input position, recent losses).

  The same hook saves the fast tier (jobdir/fast_tier.py) every LOCAL_CHECKPOINT_EVERY steps, with
  `skip` the steps the persistent tier saves. Its time, less the wait for the step itself, is a
  checkpoint stall on the clock.
  """

  def __init__(self, checkpointer, losses: LossCheck, spec: RunSpec, start: Start, setup, train_input,
               chrono: Chrono, skip: Callable[[StepInfo], bool] = lambda info: False):
    self._checkpointer, self._losses, self._spec, self._start = checkpointer, losses, spec, start
    self._setup, self._chrono, self._skip = setup, chrono, skip
    self._input_state = getattr(train_input, 'get_state', None)  # an input that keeps its own position

  def __call__(self, info: StepInfo) -> None:
    if self._skip(info):
      return
    self._losses.settle()  # the step's loss is checked before its state is saved
    with self._chrono.phase('checkpoint'):
      self._save(info)

  def _save(self, info: StepInfo) -> None:
    if not params_finite(info.state['params']):
      raise TrainingDiverged(f'The parameters became non-finite at step {info.step} (the loss was still finite); '
                             'stopping without saving them. Lower the learning rate or clip gradients.')
    spec, guard = self._spec, self._losses.guard
    state = train_state.saved_state(self._setup, info.state)   # LoRA: the adapters, not the frozen base
    self._checkpointer.save(info.step, state, {
        'batches_consumed': self._start.batches_consumed + info.step - self._start.step, 'step': info.step,
        'global_batch': spec.global_batch, 'state_shapes': spec.shapes, 'config': spec.flat,
        'input_layout': spec.input_layout, 'recent_losses': list(guard.recent), 'loss': guard.median(),
        'checksums': train_state.checksums(state), **({'base': spec.base} if spec.base else {})},
        input_state=self._input_state() if self._input_state else None)

  def exit(self, kind, error, traceback) -> None:
    """The close of the hooks' exit stack: waits for the last save (a stall at the end of the run) and
    closes the checkpointer. After a failure (a lost peer process, a divergence) the save in flight is still
    waited for, but old checkpoints are left for the next start to remove: choosing them is a collective the
    other processes may no longer join."""
    del error, traceback
    with self._chrono.phase('checkpoint'):
      self._checkpointer.close(rotate=kind is None)


def params_finite(params) -> bool:
  return bool(_all_finite()(jax.tree.leaves(params)))


@functools.cache
def _all_finite():
  """One jitted check, so each save reuses its compilation instead of tracing a new one."""
  return jax.jit(lambda leaves: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])))


def _eval_hook(evaluator: Evaluator, reporter: Reporter, chrono: Chrono) -> Callable[[StepInfo], None]:
  """Hook, every eval_interval_steps: every eval input on the state, timed apart from the steps."""

  def run(info: StepInfo) -> None:
    with chrono.paused():
      for name, m in evaluator.run(info.step, info.state).items():
        reporter.log(metrics_line(info.step, name, m, evaluator.setup.model))
  return run


def _decode_hook(decoder: TrainDecoder, reporter: Reporter, chrono: Chrono) -> Callable[[StepInfo], None]:
  """Hook, every decode_interval_steps and at the end: greedy continuations of the decode prompts."""

  def run(info: StepInfo) -> None:
    with chrono.paused():
      for line in decoder.run(info.step, info.state['params']):
        reporter.log(line)
  return run


class GracefulStop:
  """A preemption signal (SIGTERM, or SIGUSR1: SLURM's warning before a time limit) or a first Ctrl-C asks
  the loop to save and stop after a step; the run then exits with the signal's code (143, 138, 130).

  One process: the signal stops it after the step in flight. Several processes: a signal reaches each host
  at its own moment, or only some of them, so they agree on the step through JAX's preemption sync point
  (jax.experimental.multihost_utils.reached_preemption_sync_point): JAX's runtime catches SIGTERM itself and
  tells every process; each reports its step and all stop after the same one, the step after the furthest
  process's, and save it. SIGUSR1 is handed to that same path as a SIGTERM. A signal during start-up (before
  every process set its counter to the step it resumes from) stops the first step
  (distributed.preemption_counter_from). Ctrl-C on several processes is an interrupt without a save.

  A second signal (Ctrl-C again, one process) exits at once, in one line, without waiting for a save in
  flight: orbax's temporary directory is left behind and set aside (never used) at the next start. `hook`
  ends the run once the step's checkpoint is saved (the Saver hook saves at a stop).
  """

  SIGNALS = {'SIGTERM': 143, 'SIGINT': 130, 'SIGUSR1': 138}
  AGREED = 143   # several processes: the code of a stop they agreed on, whichever signal started it

  def __init__(self, processes: int, start_step: int = 0):
    self.several = processes > 1
    self.enabled = threading.current_thread() is threading.main_thread()
    self.signal_name: Optional[str] = None
    # Several processes: JAX's counters start here; a notice during start-up stops the first step.
    self._agreed = self.several and distributed.preemption_counter_from(start_step)
    self._previous = {}

  def __enter__(self):
    if self.enabled:
      names = ('SIGUSR1',) if self.several else tuple(self.SIGNALS)   # JAX's runtime keeps SIGTERM
      for name in names:
        signum = getattr(signal, name)
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    name = signal.Signals(signum).name
    if self.several:   # JAX's preemption notifier listens for SIGTERM: the warning becomes a notice
      self.signal_name = self.signal_name or name
      sys.stderr.write(f'{name}: a preemption warning; every process saves the step they agree on and stops.\n')
      sys.stderr.flush()
      os.kill(os.getpid(), signal.SIGTERM)
      return
    if self.signal_name is not None:  # the second one: no traceback from orbax's threads over the bar
      sys.stderr.write(f'\nerror: {name} again: stopping without waiting for the save. '
                       'An unfinished checkpoint is set aside at the next start; run the same command to resume '
                       'from the last complete one.\n')
      sys.stderr.flush()
      os._exit(self.SIGNALS.get(name, 130))
    self.signal_name = name

  def __exit__(self, *exc):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    return False

  def requested(self, step: int) -> bool:
    """Whether this invocation stops after `step`. Several processes: asked at every step, of every
    process (JAX's sync point is a step: the furthest process's, plus one)."""
    if not self.several:
      return self.signal_name is not None
    if not self._agreed:
      self._agreed = multihost_utils.reached_preemption_sync_point(step)
    return self._agreed

  @property
  def exit_code(self) -> int:
    return self.AGREED if self.several else self.SIGNALS[self.signal_name]

  def hook(self, checkpointer: ckpt.Checkpointer, reporter: Reporter, log, directory: str):
    """Hook, at a stop: waits for the step's checkpoint, says so, and exits with the signal's code."""

    def stop(info: StepInfo) -> None:
      checkpointer.wait()
      reporter.close()
      why = (f'Stopped by {self.signal_name}' if not self.several else
             'Stopped for preemption: a signal reached this or another process, and all agreed to stop')
      log(f'{why} after step {info.step}; saved a checkpoint at step {info.step} in {directory}. '
          'Run the same command to resume.')
      raise SystemExit(self.exit_code)
    return stop


class Reporter:
  """Hook, every step: a rich progress bar on a terminal; plain log lines otherwise (CI, files, pipes)."""

  def __init__(self, console, total: int, start: int, enabled: bool = True, model=None):
    self.console = console
    self.model = model   # its line_metrics follow the loss in the log line
    self.total = total
    self.enabled = enabled
    self.interactive = enabled and console.is_terminal
    self._progress = None
    self._last: dict = {}
    if self.interactive:
      self._progress = Progress(
          TextColumn('[bold]train'), BarColumn(), MofNCompleteColumn(),
          TextColumn('loss {task.fields[loss]}'), TextColumn('{task.fields[tps]} tok/s'),
          TimeElapsedColumn(), TextColumn('eta'), TimeRemainingColumn(), console=console, transient=False)
      self._task = self._progress.add_task('train', total=total, completed=start, loss='-', tps='-')
      self._progress.start()

  def __call__(self, info: StepInfo) -> None:
    if self._progress is not None:
      fields = {}
      if 'loss' in self._last:
        fields['loss'] = f"{self._last['loss']:.4f}"
      if 'tokens_per_sec' in self._last:
        fields['tps'] = f"{self._last['tokens_per_sec']:,.0f}"
      self._progress.update(self._task, completed=info.step, **fields)

  def log(self, message: str) -> None:
    if self.enabled:
      self.console.print(message, highlight=False, markup=False, soft_wrap=True)

  def summary(self, record: dict, eta_seconds: Optional[float] = None) -> None:
    self._last = record
    if self.enabled and not self.interactive:
      accuracy = f"  accuracy {record['accuracy']:.4f}" if 'accuracy' in record else ''
      self.log(f"step {record['step']}: loss {record['loss']:.4f}{accuracy}{line_note(record, self.model)}"
               f"{aux_note(record)}{load_note(record)}  "
               f"lr {record['learning_rate']:.3g}  grad_norm {record['grad_norm']:.3f}  "
               f"{record['steps_per_sec']:.2f} steps/s  {record['tokens_per_sec']:,.0f} tokens/s"
               f"{mfu_note(record)}{eta_note(eta_seconds)}{window_note(record)}")

  def close(self) -> None:
    if self._progress is not None:
      self._progress.stop()
      self._progress = None


# ---- Summaries ------------------------------------------------------------------------------------


def _summarize(step: int, rows: list[dict], window: Window, mfu_of=None) -> dict:
  """Means over the steps since the last summary; layer summaries are the latest step's. Rates
  are over the window's time less compilation and evals (whose seconds are reported apart)."""
  mean = lambda k: sum(r[k] for r in rows) / max(len(rows), 1)
  out = {'step': step}
  for key in rows[-1]:
    if key in ('step', 'tokens'):
      continue
    out[key] = rows[-1][key] if key == 'learning_rate' or key.startswith('summary/') else mean(key)
  out['steps_per_sec'] = window.steps / window.steady_seconds
  out['tokens_per_sec'] = sum(r['tokens'] for r in rows) / window.steady_seconds
  out['compile_seconds'] = window.compile_seconds
  out['eval_seconds'] = window.paused_seconds
  if mfu_of:
    out.update(mfu_of(out['steps_per_sec']))
  return out


def aux_note(record: dict) -> str:
  """'  load_balance_loss 0.0102' for each aux loss by name, summed over the layers that add it (each
  layer's stays in TensorBoard and train_metrics.jsonl as aux_loss/<layer path>/<name>)."""
  by_name: dict[str, float] = {}
  for key, value in record.items():
    if key.startswith('aux_loss/'):
      name = key.rsplit('/', 1)[-1]
      by_name[name] = by_name.get(name, 0.0) + value
  return ''.join(f'  {name} {value:.4g}' for name, value in by_name.items())


def mfu_note(record: dict) -> str:
  if 'mfu' not in record:
    return ''
  return f"  {record['model_tflops_per_device']:.3g} TFLOP/s/device  MFU {record['mfu']:.1%}"


def eta_note(seconds: Optional[float]) -> str:
  """'  eta 0:01:23' for the time left at the window's steady rate (evals and compiles not counted)."""
  if seconds is None:
    return ''
  minutes, seconds = divmod(int(round(seconds)), 60)
  hours, minutes = divmod(minutes, 60)
  return f'  eta {hours}:{minutes:02d}:{seconds:02d}'


def window_note(record: dict) -> str:
  """'' for a steady window; else which time was left out of its rates."""
  parts = [f'{record[k]:.1f} s {name}' for k, name in (('compile_seconds', 'compilation'),
                                                        ('eval_seconds', 'eval')) if record.get(k, 0) >= 0.05]
  return f'  (window had {" and ".join(parts)}, left out of the rates)' if parts else ''


# ---- The loop -------------------------------------------------------------------------------------


def train(resolved, job_dir: str, console, verbose: bool = False, profile_steps=None, pgle: Optional[str] = None,
          pgle_profile: Optional[str] = None, made: Optional[invocation.Made] = None,
          force_resume: bool = False) -> dict:
  """Trains (or resumes) the resolved experiment in job_dir. Returns the last summary.

  The job directory is checked first and locked for the run (`paxcli/jobdir/lock.py`): a
  second trainer on it is refused. profile_steps: (A, B) to trace steps A..B with
  jax.profiler; pgle/pgle_profile: see paxcli.perf.profiling. The experiment's PLATFORM_ENV is
  applied before this, by the command's `api.open_run`, ahead of JAX's backend start. `made`:
  how the job is made (experiment and --set), recorded for the commands that read it. A resume
  whose data, tokenizer or model shape differ from the checkpoint's is refused unless force_resume
  (shapes always: no weights fit them). A start refused before its first step leaves no directory
  it made.
  """
  platform.check_supported(resolved.experiment)  # refusals first: a refused run leaves no job directory
  engine.validate(resolved)                       # the settings, as `pax describe` checks them
  profiling.check_pgle(pgle, pgle_profile)
  made_here = _missing_ancestor(job_dir)
  joblock.check_writable(job_dir)  # makes the directory
  lock = joblock.lock_run(job_dir, _printer(console) if jax.process_index() == 0 else _silent)
  accounting, status, refused = None, 1, False
  try:
    accounting = goodput.Goodput(job_dir, is_main=jax.process_index() == 0)
    result = _train(resolved, job_dir, console, accounting, verbose, profile_steps, pgle_profile, lock, made,
                    force_resume)
    status = 0
    return result
  except SystemExit as e:
    status = e.code if isinstance(e.code, int) else 1
    raise
  except UserError as e:
    status = e.exit_code
    # A start refused before training leaves no directory; a run that failed while training keeps its record.
    refused = made_here is not None and jax.process_index() == 0 and not (accounting and accounting.began)
    raise
  except KeyboardInterrupt:
    status = 130
    raise
  finally:
    if accounting is not None:
      accounting.close(status)
    if lock is not None:
      lock.release()
    if refused:
      _remove_refused(job_dir, made_here)


def _missing_ancestor(path: str) -> Optional[str]:
  """The outermost directory of a local `path` (itself included) that does not exist yet, else None (a
  bucket has no directories to leave behind)."""
  if not storage.is_local(path):
    return None
  missing = None
  while not os.path.lexists(path):
    missing, path = path, os.path.dirname(path)
  return missing


def _remove_refused(job_dir: str, top: str) -> None:
  """Removes what a start refused before its first checkpoint made: `top`, the outermost directory of
  job_dir that this command created (it did not exist when the command started), with the lock and
  goodput ledger it wrote."""
  checkpoints = layout.checkpoints(job_dir)
  if os.path.isdir(checkpoints) and os.listdir(checkpoints):
    return   # never the case before the first step; kept should it be
  shutil.rmtree(top, ignore_errors=True)


def _train(resolved, job_dir: str, console, accounting: goodput.Goodput, verbose: bool = False, profile_steps=None,
           pgle_profile: Optional[str] = None, lock=None, made: Optional[invocation.Made] = None,
           force_resume: bool = False) -> dict:
  is_main = jax.process_index() == 0
  log = _printer(console) if is_main else _silent
  distributed.log_topology(_printer(console))

  # ---- Mesh, model, state shapes, input: every refusal before the job directory is written ---------------
  setup = engine.build(resolved)
  total = setup.train.num_train_steps
  spec, base = _check_start(resolved, setup, job_dir, force_resume)
  _log_run(resolved, setup, job_dir, log)
  if verbose and is_main:
    _print_weights(console, setup)
  train_input = _train_input(resolved, setup, job_dir)  # before any state: missing data stops at once
  for note in getattr(train_input, 'notes', ()):   # what the input chose that the user should hear (VOCAB_SIZE)
    log(note)

  # ---- Job directory: resume or start -------------------------------------------------------------
  checkpointer = _open_job_dir(job_dir, setup.train, lock, log, is_main)
  latest = checkpointer.latest_step()
  if latest is not None and latest >= total:
    return _already_finished(job_dir, latest, spec, total, checkpointer, log)
  fast = _open_fast_tier(setup.train, job_dir, setup, log)
  state, start = _start_state(setup, job_dir, latest, spec, base, checkpointer, fast, resolved.experiment.RANDOM_SEED,
                              log)
  accounting.resumed(start.step, start.tier)
  if is_main:
    storage.write_text(layout.config(job_dir), resolved.as_text())
    _trim_replayed_metrics(job_dir, start.step, log)
    tokenizer.save_to_job_dir(train_input, job_dir)
  reference.prepare(resolved, setup, state['params'], train_input, job_dir, start.step == 0, log)  # when asked
  _position_input(train_input, job_dir, start, fast, log)

  # ---- The step, and the hooks that do the rest ---------------------------------------------------------
  batch_sharding = sharding.batch_sharding(setup.mesh)
  profiler = profiling.StepProfiler(job_dir, log, profile_steps, pgle_profile, start.step)
  train_step = TrainStep(setup, batch_sharding, resolved.experiment.RANDOM_SEED + 1, profiler, log)
  if profiler.pgle_options:
    log(f'PGLE: compiling the train step with the profile {pgle_profile}.')
  run = _Run(resolved, setup, job_dir, console, log, spec, start, train_input, checkpointer, fast, accounting)
  with Hooks() as hooks:
    summary, chrono, stop = _begin(hooks, run, train_step, profiler, made)

    # ---- Loop -------------------------------------------------------------------------------------
    for step in range(start.step + 1, total + 1):
      with chrono.phase('data'):
        batch = to_global(_next_batch(train_input, state), batch_sharding, setup.global_batch)
      hooks.before(step)
      state, metrics = train_step(state, batch)
      with _naming_the_step(step, checkpointer):
        hooks.after(StepInfo(step, state, metrics, last=step == total, stopping=stop.requested(step)))
  _finish(run, summary.last)
  return summary.last


@dataclasses.dataclass(frozen=True)
class _Run:
  """What one invocation's hooks are made of."""
  resolved: object
  setup: object
  job_dir: str
  console: object
  log: Callable[[str], None]
  spec: RunSpec
  start: Start
  train_input: object
  checkpointer: ckpt.Checkpointer
  fast: Optional[fast_tier.FastTier]
  accounting: goodput.Goodput

  @property
  def is_main(self) -> bool:
    return jax.process_index() == 0


def _check_start(resolved, setup, job_dir: str, force_resume: bool) -> tuple[RunSpec, Optional[restore.BaseRef]]:
  """What a start checks before it reads data or writes anything: the state fits a device, the trackers are
  installed, LoRA has its base, and the job directory holds no other run. (The RunSpec, the LoRA base.)"""
  engine.check_fits(setup)   # a state no device can hold is one line before any input is read
  track.check_installed(setup.train.trackers.names)  # before anything is compiled
  if train_state.quantized(setup) and not train_state.has_frozen(setup):
    raise UserError('WEIGHT_QUANT holds the projections as frozen codes: train adapters on them with LORA_RANK > 0 '
                    "and INIT_FROM the base (QLoRA), or multiply float weights in int8 with AQT='int8'. Decode and "
                    'score read any checkpoint with WEIGHT_QUANT.')
  base = restore.base_ref(setup.train.init_from) if setup.train.init_from else None
  if base is None and train_state.has_frozen(setup):
    raise UserError('LORA_RANK > 0 trains adapters on frozen base weights: set INIT_FROM to the base checkpoint '
                    '(a job directory or checkpoint step; `pax checkpoint convert HF_DIR OUT --from hf` makes one).')
  spec = RunSpec.of(resolved, setup, base)
  _check_same_run(job_dir, spec, resolved.train_dataset().name, force_resume)   # before any data is read
  return spec, base


def _train_input(resolved, setup, job_dir: str):
  """The train input, its tokenizer checked against the one the job keeps and its base's; for a model that samples
  its own batches (GRPO), its rollouts over that input's prompts (paxcli.loops.rollout)."""
  train_input = infeed.build_input(resolved.train_dataset(), setup)
  if getattr(setup.model, 'samples_own_batches', False):
    train_input = rollout.Rollouts(resolved, setup, job_dir, train_input)
  tokenizer.check_kept(train_input, job_dir)
  tokenizer.check_base(train_input, setup.train.init_from)
  return train_input


def _next_batch(train_input, state: dict) -> dict:
  """The next batch; an input that samples from the model being trained (GRPO's rollouts) reads the state."""
  return train_input.get_next(state) if getattr(train_input, 'reads_state', False) else train_input.get_next()


def _open_job_dir(job_dir: str, train_cfg, lock, log, is_main: bool) -> ckpt.Checkpointer:
  """The job directory, checked (a newer paxcli's is refused before anything is written) and marked as this
  run's, with unfinished checkpoints set aside: its checkpointer."""
  job_format.check_job(job_dir)
  if is_main:
    invocation.record(job_dir)
    job_format.write_job(job_dir)
  ckpt.set_aside_unfinished(layout.checkpoints(job_dir), log=log)
  distributed.barrier('paxcli:unfinished-checkpoints-set-aside')  # all processes then see the same steps
  return ckpt.Checkpointer(layout.checkpoints(job_dir), train_cfg.save_max_to_keep,
                           before_save=getattr(lock, 'check', None))  # a bucket lock may be lost


def _start_state(setup, job_dir: str, latest: Optional[int], spec: RunSpec, base, checkpointer, fast, seed: int,
                 log):
  """(state, Start): the fast tier's newest step past the persistent tier's, else the latest good checkpoint,
  else a fresh state (from the base's weights with INIT_FROM); the fast tier then holds nothing newer."""
  state, start = _resume_fast(fast, spec, latest, job_dir, log)
  if state is None:
    state, start = (_resume(setup, job_dir, latest, spec, checkpointer, log) if latest is not None
                    else (_fresh_state(setup, base, seed, log), Start(0)))
  if fast is not None:
    fast.discard_after(start.step)
  return state, start


def _begin(hooks: Hooks, run: _Run, train_step: TrainStep, profiler, made) -> tuple[Summary, Chrono, GracefulStop]:
  """Builds what the hooks need (evals, decodes, MFU, trackers: refusals still leave no directory), says the run
  has begun, and registers every hook in the order they run after a step (and close, the last first)."""
  setup, train_cfg, start, log = run.setup, run.setup.train, run.start, run.log
  mfu_of = _mfu(setup, log)
  evaluator = (Evaluator(run.resolved, setup, run.job_dir)
               if train_cfg.eval_interval_steps and run.resolved.eval_datasets() else None)
  decoder = (TrainDecoder(run.resolved, setup, run.job_dir, train_cfg)
             if getattr(train_cfg, 'decode_interval_steps', 0) and train_cfg.decode_prompts else None)
  if run.is_main and made is not None:  # the run starts: how it is made, for its readers (a follower waits for it)
    invocation.record_made(run.job_dir, made)
  run.accounting.begin()
  tracked = hooks.enter_context(  # entered first, so ended last: after the writers' final summaries
      _open_trackers(run.resolved, run.job_dir, train_cfg, run.spec, log) if run.is_main else track.Trackers())
  writer = summaries.SummaryWriter(layout.summaries(run.job_dir, 'train'), layout.train_metrics(run.job_dir),
                                   trackers=tracked) if run.is_main else None
  reporter = Reporter(run.console, train_cfg.num_train_steps, start.step, enabled=run.is_main, model=setup.model)
  losses = LossCheck(LossGuard(train_cfg.loss_spike_factor, train_cfg.loss_spike_window, start.recent_losses),
                     start.step, train_cfg.num_train_steps, run.checkpointer)
  chrono = Chrono(start.step, train_cfg.num_train_steps, run.accounting.stopwatch)
  summary = Summary(losses, chrono, reporter, writer, mfu_of, start.step,
                    RouterWatch(train_cfg.router_collapse_fraction, train_cfg.router_collapse_steps, log))
  stop = GracefulStop(jax.process_count(), start.step)
  saver = Saver(run.checkpointer, losses, run.spec, start, setup, run.train_input, chrono)
  hooks.add_before(profiler.before)
  hooks.add(train_step.profile, every=1, close=profiler.close)
  hooks.add(losses, every=1)
  hooks.add(summary, every=train_cfg.summary_interval_steps, at_end=True, close=summary.close)
  hooks.add(run.accounting.summary_hook, every=train_cfg.summary_interval_steps, at_end=True)
  hooks.add(saver, every=train_cfg.save_interval_steps, at_end=True, on_stop=True)
  hooks.push(saver.exit)
  if run.fast is not None:
    hooks.add(Saver(run.fast, losses, run.spec, start, setup, run.train_input, chrono, skip=saver_due(train_cfg)),
              every=run.fast.settings.every, close=run.fast.close)
  if evaluator:  # and at the end: a run of 40 steps, evaluated every 100, still reports its held-out loss
    evaluator.trackers = tracked  # eval scalars go to the trackers too
    hooks.add(_eval_hook(evaluator, reporter, chrono), every=train_cfg.eval_interval_steps, at_end=True,
              close=evaluator.close)
  if decoder:
    hooks.add(_decode_hook(decoder, reporter, chrono), every=train_cfg.decode_interval_steps, at_end=True,
              close=decoder.close)
  hooks.add(reporter, every=1, close=reporter.close)
  hooks.add(run.accounting.step_hook, every=1)
  hooks.add(stop.hook(run.checkpointer, reporter, log, layout.checkpoints(run.job_dir)), on_stop=True)
  hooks.enter_context(stop)
  hooks.enter_context(chrono)
  hooks.callback(run.accounting.heartbeat.close)  # the loop is over (closed first): no hang timeout for what follows
  return summary, chrono, stop


def _finish(run: _Run, last: dict) -> None:
  """The run reached its last step: the fast tier is superseded by its last persistent checkpoint; what was kept,
  and the job's goodput, said."""
  if run.fast is not None:
    run.fast.clear()
  _log_done(run.job_dir, last, run.setup.train.save_max_to_keep, run.log)
  if run.is_main:
    run.log(run.accounting.line() + f' `pax goodput {run.job_dir}` has the table.')


def _open_trackers(resolved, job_dir: str, train_cfg, spec: RunSpec, log) -> track.Trackers:
  """W&B / MLflow (TRACKERS), started or continued: their runs get the config and the run's identity."""
  identity = track.Identity(job_dir, resolved.name, spec.flat, resolved.as_text(), invocation.command_line())
  return track.open_trackers(train_cfg.trackers, identity, log)


def _printer(console) -> Callable[[str], None]:
  return lambda m: console.print(m, highlight=False, markup=False, soft_wrap=True)


def _silent(message: str) -> None:
  del message


def _log_run(resolved, setup, job_dir: str, log) -> None:
  devices = jax.devices()
  log(f'Experiment {resolved.name} -> {job_dir}')
  log(f'Devices: {len(devices)} x {devices[0].device_kind} ({jax.default_backend()}), '
      f'{jax.process_count()} process(es); mesh {sharding.describe_mesh(setup.mesh)}')
  total = train_state.param_count(setup.abstract_state)
  frozen = train_state.has_frozen(setup)
  trainable = train_state.param_count(train_state.saved_state(setup, setup.abstract_state)) if frozen else total
  counts = f'{trainable:,} trainable (LoRA adapters) of {total:,}' if frozen else f'{total:,}'
  log(f'Parameters: {counts}; global batch {setup.infeed.describe()} x {setup.seq_len} tokens')


def _log_done(job_dir: str, last: dict, keep: int, log) -> None:
  kept = f'the latest {keep} kept, and the one of lowest loss' if keep else 'all kept'
  log(f"Done: step {last['step']}, loss {last.get('loss', float('nan')):.4f}.\n"
      f"  checkpoints: {layout.checkpoints(job_dir)} ({kept}; task.train.save_max_to_keep)\n"
      f"  metrics:     {layout.train_metrics(job_dir)}\n"
      f"  TensorBoard: {summaries.tensorboard_command()} --logdir {layout.summaries(job_dir)}")


# ---- Resume or start ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """What each checkpoint's meta records of the run, and what a resume compares with it."""
  flat: dict            # the resolved config, flattened, each value as its repr()
  shapes: dict          # the train state's shapes (train_state.shape_signature)
  input_layout: dict    # what decides which data each step sees (infeed.input_layout)
  global_batch: int
  base: Optional[dict] = None  # LoRA: the frozen base the adapters apply to (restore.BaseRef.to_meta)

  @classmethod
  def of(cls, resolved, setup, base: Optional[restore.BaseRef] = None) -> RunSpec:
    saved = train_state.saved_state(setup, setup.abstract_state)
    frozen = base is not None and train_state.has_frozen(setup)
    return cls({k: repr(v) for k, v in resolved.flat().items()}, train_state.shape_signature(saved),
               infeed.input_layout(resolved, setup), setup.global_batch, base.to_meta() if frozen else None)


@dataclasses.dataclass(frozen=True)
class Start:
  """Where this invocation begins: the step it resumes from (0: a fresh run), the input batches
  already consumed, the recent losses the loss guard goes on from, and the checkpoint tier the
  state came from ('fast', 'persistent'; None: a fresh run)."""
  step: int
  batches_consumed: int = 0
  recent_losses: tuple = ()
  tier: Optional[str] = None


def _fresh_state(setup, base: Optional[restore.BaseRef], seed: int, log) -> dict:
  """A new train state: initialised from the seed, then the base's params where INIT_FROM names one."""
  lora_init = getattr(setup.train, 'lora_init', None)
  if lora_init and train_state.has_frozen(setup):
    convert_lora.check_peft(lora_init, setup.model)   # a wrong adapter is one line before any state is made
  state = engine.init_state(setup, seed)
  if base is None:
    return state
  log(f'Starting from the weights of {base.describe()} (INIT_FROM)'
      + ('; they stay frozen and LoRA adapters train.' if train_state.has_frozen(setup) else '; fresh optimizer state.'))
  state = restore.start_from_base(setup, state, base)
  if lora_init and train_state.has_frozen(setup):
    adapters = convert_lora.read_peft(lora_init, setup.model, setup.abstract_state['params'])
    shardings = train_state.split_trainable(setup.model, setup.state_shardings['params'])[0]
    adapters = jax.tree.map(lambda x, s: jax.device_put(x, s), adapters, shardings)
    state = dict(state, params=train_state.join_params(state['params'], adapters))
    log(f'LoRA adapters from {lora_init}.')
  return state


def _already_finished(job_dir: str, step: int, spec: RunSpec, total: int, checkpointer, log) -> dict:
  """A run whose latest checkpoint is at or past num_train_steps: nothing to do (its shapes still checked)."""
  restore.check_shapes(restore.read_meta(job_dir, step), spec.shapes, spec.flat, step, False, 'resume from')
  log(f'Run already finished: checkpoint at step {step} >= num_train_steps {total}. Nothing to do.')
  checkpointer.close()
  return {'step': step, 'finished': True}


def _resume(setup, job_dir: str, step: int, spec: RunSpec, checkpointer, log) -> tuple[dict, Start]:
  """The state of the newest intact checkpoint from `step` down (a damaged one is set aside) and where
  it stands, with a note for each setting that differs from the one it was saved with."""
  restored = restore.restore(setup, job_dir, step, flat_now=spec.flat, action='resume from', fallback=True,
                             set_aside=True, log=log)
  meta = restored.meta
  if restored.step != step:  # a damaged checkpoint was set aside
    step = restored.step
    checkpointer.reload()
  if restored.params_only_checkpoint:
    log(f'The checkpoint at step {step} holds parameters only: the optimizer state starts fresh.')
  batches_consumed = int(meta.get('batches_consumed', step))
  if int(meta.get('global_batch', spec.global_batch)) != spec.global_batch:
    log(f'Note: the global batch changed ({meta.get("global_batch")} -> {spec.global_batch}); '
        'the data order from here differs from an uninterrupted run.')
  layout_note = infeed.layout_change_note(meta.get('input_layout'), spec.input_layout)
  if layout_note:
    log(layout_note)
  log(f'Resumed from step {step} ({batches_consumed} batches consumed).')
  _note_changes(meta, spec, job_dir, log)
  return restored.state, Start(step, batches_consumed, meta.get('recent_losses') or (), 'persistent')


def _note_changes(meta: dict, spec: RunSpec, job_dir: str, log) -> None:
  changed = config_differences(meta.get('config') or {}, spec.flat, prefixes=('',))
  changed = [c for c in changed if not _kept_tokenizer(c, job_dir)]
  if changed:
    log(f'Note: {len(changed)} setting(s) differ from the checkpoint\'s config (the run goes on '
        'with the new ones):\n  ' + '\n  '.join(changed))


def _kept_tokenizer(difference: str, job_dir: str) -> bool:
  """Whether a config difference is only an own-data input reading the job's kept tokenizer (None in
  the run that trained it, its copy in the job directory since: jobdir.tokenizer.keep_trained)."""
  return difference.split(':', 1)[0].endswith('.tokenizer') and difference.endswith(
      f'checkpoint None -> now {repr(tokenizer.kept(job_dir))}')


# What a run trains on, in its resolved config: the data and tokenizer knobs, and the fields of the
# train input that name its data (evaluate.DATA_FIELDS) and its tokenizer.
TRAINS_ON_KNOBS = ('TRAIN_DATA', 'TOKENIZER', 'TEXT_FIELD')
TRAINS_ON_FIELDS = DATA_FIELDS + ('tokenizer', 'spm_model')


def _check_same_run(job_dir: str, spec: RunSpec, train_name: str, force_resume: bool) -> None:
  """One line, before any data is read, when job_dir's latest checkpoint was trained on other data or
  another tokenizer than this command gives (unless force_resume), or has other shapes: this is
  another run, and belongs in a directory of its own."""
  steps = ckpt.complete_steps(layout.checkpoints(job_dir))
  try:
    meta = restore.read_meta(job_dir, steps[-1]) if steps else None
  except UserError:
    return  # the resume says what is wrong with it, and falls back to an older one
  if not meta:
    return
  try:
    restore.check_shapes(meta, spec.shapes, spec.flat, steps[-1], False, 'resume from')
  except restore.ShapeMismatch as e:
    raise UserError(f'{job_dir} holds a run whose train state has other shapes than this one\'s '
                    f'({"; ".join(e.differences[:3]) or "the code changed"}): give this run a new --job-log-dir.') from None
  saved = meta.get('config') or {}
  keys = [f'knobs.{k}' for k in TRAINS_ON_KNOBS] + [f'datasets.{train_name}.{f}' for f in TRAINS_ON_FIELDS]
  changed = [f'{k.split(".", 1)[1] if k.startswith("knobs.") else k}: {_shown(saved[k])} -> {_shown(spec.flat[k])}'
             for k in keys
             if k in saved and k in spec.flat and saved[k] != spec.flat[k]
             and not _kept_tokenizer(f'{k}: checkpoint {saved[k]} -> now {spec.flat[k]}', job_dir)]
  for k in keys:   # another tokenizer changes every id: refused in its own words, --force-resume or not
    if k.rsplit('.', 1)[1] in ('TOKENIZER', 'tokenizer', 'spm_model') and saved.get(k) != spec.flat.get(k):
      named = ptypes.saved_literal(spec.flat.get(k))
      tokenizer.check_named(named if isinstance(named, str) and storage.isfile(named) else None, job_dir)
  if changed and not force_resume:
    raise UserError(f'{job_dir} holds a run trained on other data than this command gives ({"; ".join(changed[:3])}'
                    f'): give this run a new --job-log-dir, or pass --force-resume to go on training that one on '
                    'these settings.')


def _shown(saved: str) -> str:
  """A saved config value for a one-line message: a class by its name, anything long shortened."""
  match = re.fullmatch(r"<class '(?:[\w.]+\.)?(\w+)'>", saved)
  return match.group(1) if match else shorten(saved, 80)


def _open_fast_tier(train_cfg, job_dir: str, setup, log) -> Optional[fast_tier.FastTier]:
  """The fast checkpoint tier when LOCAL_CHECKPOINT_DIR/EVERY are set: checked (writable, this job's,
  room on its disk) before any training, every process alike."""
  settings = fast_tier.Settings.of(train_cfg)
  if settings is None:
    return None
  if jax.process_index() == 0:   # the others read it only past the barrier: never while it is being written
    ledger.job_id(job_dir, create=True)
  distributed.barrier('paxcli:job-identity')
  tier = fast_tier.open_tier(settings, job_dir, ledger.job_id(job_dir, create=False), setup, log)
  log(f'Fast checkpoint tier: every {settings.every} steps to {tier.directory} on each host '
      f'(the newest {settings.keep} kept; LOCAL_CHECKPOINT_*).')
  return tier


def _resume_fast(fast: Optional[fast_tier.FastTier], spec: RunSpec, persistent: Optional[int], job_dir: str, log):
  """(state, Start) from the newest fast step complete on every process and newer than the persistent
  tier's latest, trying older ones after a damaged one; (None, None) when there is none."""
  for step in fast_tier.choose(fast, persistent, log):
    try:
      restored = fast.restore(step, spec.flat)
    except (restore.DamagedCheckpoint, restore.CheckpointGone, restore.CheckpointReadError) as e:
      log(f'WARNING: {e} Trying an older checkpoint.')
      continue
    meta = restored.meta
    batches = int(meta.get('batches_consumed', step))
    against = f'the persistent tier has step {persistent}' if persistent is not None else 'no persistent one yet'
    log(f'Resumed from step {step} of the fast checkpoint tier ({fast.directory}; {against}; '
        f'{batches} batches consumed).')
    _note_changes(meta, spec, job_dir, log)
    return restored.state, Start(step, batches, tuple(meta.get('recent_losses') or ()), 'fast')
  return None, None


@contextlib.contextmanager
def _naming_the_step(step: int, checkpointer: ckpt.Checkpointer):
  """A bucket that stops answering while step `step`'s hooks write there (metrics, summaries): one line
  naming the step and the checkpoint the next start resumes from (a failed save names them itself)."""
  try:
    yield
  except ckpt.BucketSaveError:
    raise
  except storage.BucketError as e:
    storage.give_up(checkpointer.directory)
    last = checkpointer.last_complete
    raise storage.BucketError(f'{str(e).rstrip(".")}, at step {step}. The last complete checkpoint is '
                              + (f'step {last}' if last is not None else 'none yet') + '; the trainer stops here. '
                              'Run the same command to resume from it once the bucket answers.') from None


def saver_due(train_cfg) -> Callable[[StepInfo], bool]:
  """Whether the persistent Saver saves after this step (then the fast tier need not)."""
  return lambda info: info.step % train_cfg.save_interval_steps == 0 or info.last or info.stopping


def _position_input(train_input, job_dir: str, start: Start, fast: Optional[fast_tier.FastTier], log) -> None:
  """Puts the train input where the checkpoint left it: the input's own saved position when it
  keeps one (Grain: a read of a few documents, whatever the step), else by skipping the batches
  consumed (a re-read that grows with the step)."""
  if not start.step:
    return
  if hasattr(train_input, 'restore'):
    saved = (fast.input_states(start.step) if start.tier == 'fast' else
             grain_input.read_states(storage.local_tree(layout.input_dir(layout.step_dir(job_dir, start.step)))))
    if saved:
      train_input.restore(saved, batches=start.batches_consumed)  # checked against the meta's count
      return
    log(f'Note: the checkpoint at step {start.step} holds no input position; skipping '
        f'{start.batches_consumed} batches to find it.')
  train_input.skip(start.batches_consumed)


def _trim_replayed_metrics(job_dir: str, step: int, log) -> None:
  """Drops metric rows past the step we resume from: the steps run again write them anew."""
  dropped = joblock.trim_metrics(job_dir, step)
  if dropped:
    log(f'Dropped {dropped} metric row(s) past step {step} from the *_metrics.jsonl files (steps after the '
        'last checkpoint, which this run repeats).')


def _mfu(setup, log) -> Optional[Callable[[float], dict]]:
  """MFU: model FLOPs per step (the model's train_flops) over the device's peak (paxcli.perf.flops);
  None without a FLOPs method."""
  model_flops = flops.for_model(setup.model, setup.seq_len)
  if model_flops is None:
    log(f'MFU: {flops.unknown_flops(setup.model)}.')
    return None
  devices = jax.devices()
  step_flops = model_flops.per_step(setup.global_batch * setup.seq_len)
  peak = flops.device_peak(devices[0], flops.compute_dtype(setup.model), measure_size=512)
  log(f'MFU: {step_flops / 1e12:.4g} model TFLOP per step over {len(devices)} device(s); peak {peak.source}.')
  return functools.partial(flops.mfu_fields, step_flops=step_flops, num_devices=len(devices), peak=peak.tflops)


def _print_weights(console, setup) -> None:
  table = Table(title='Weights', show_lines=False)
  table.add_column('weight', overflow='fold')
  for col in ('shape', 'dtype', 'logical axes', 'mesh axes'):
    table.add_column(col)
  for row in engine.weights_table(setup):
    table.add_row(*row)
  console.print(table)
