"""The train loop: one function to read top to bottom, helpers for the step and reporting.

Job directory layout:
  config.txt             the resolved config of the latest invocation
  invocations.txt        one line per invocation: UTC time, paxcli version, command line
  tokenizer/spm.model    the train input's sentencepiece model (decode and conversion read it)
  checkpoints/<step>/    orbax checkpoints (state + meta)
  summaries/train/       TensorBoard events
  train_metrics.jsonl    the same numbers, one JSON object per summary step
"""

from __future__ import annotations

import functools
import math
import os
import signal
import sys
import threading
import time
from typing import Optional

from paxcli.config import config_differences
from paxcli.errors import UserError
from paxcli.runtime.sharding import to_global


class TrainingDiverged(UserError):
  exit_code = 3


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
    import collections
    self.factor = factor
    self.recent = collections.deque((float(x) for x in history or () if math.isfinite(float(x))), maxlen=window)

  def median(self) -> Optional[float]:
    import statistics
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


def make_train_step(setup, batch_sharding, dropout_seed: int, compiler_options: Optional[dict] = None):
  """The jitted step: (state, batch) -> (state, metrics); state is donated.

  The model's fprop gives (loss, metrics); aux losses its layers add join the loss;
  non-trainable variables come back updated (the optimizer never sees them); layer
  summaries come back in the metrics under 'summary/<layer path>/<name>'.
  `compiler_options`: XLA options for this program only (a PGLE profile, for one).
  """
  import jax
  import jax.numpy as jnp
  import optax

  from paxcli import optim
  from paxcli.layers.base import AUX_LOSS, NON_TRAINABLE, RANDOM, SUMMARIES, flatten_collection
  model, tx = setup.model, setup.tx
  lr_fn = optim.learning_rate_fn(setup.train)
  deterministic = getattr(model, 'dropout_prob', 0) == 0
  has_non_trainable = 'non_trainable' in setup.state_shardings

  def step_fn(state, batch):
    rngs = step_rngs(dropout_seed, state['step'])

    def loss_fn(params):
      variables = {'params': params}
      if has_non_trainable:
        variables[NON_TRAINABLE] = state['non_trainable']
      with setup.activation_sharding():
        (loss, model_metrics), updates = model.apply(
            variables, batch, deterministic=deterministic, method='fprop', rngs=rngs,
            mutable=[NON_TRAINABLE, SUMMARIES, AUX_LOSS])
      aux = flatten_collection(updates.get(AUX_LOSS, {}))
      total = loss + sum(jnp.sum(v) for v in aux.values()) if aux else loss
      return total, (loss, model_metrics, aux, updates)

    (total, (loss, model_metrics, aux, updates)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state['params'])
    param_updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
    params = optax.apply_updates(state['params'], param_updates)
    metrics = {k: v for k, (v, _) in model_metrics.items()}
    metrics.update({
        'loss': total,
        'grad_norm': optax.tree.norm(grads) if hasattr(optax, 'tree') else optax.global_norm(grads),
        'learning_rate': lr_fn(state['step']),
        'tokens': model.count_in(model_metrics),
    })
    if aux:
      metrics['model_loss'] = loss
      metrics.update({f'aux_loss/{k}': jnp.sum(v) for k, v in aux.items()})
    for name, value in flatten_collection(updates.get(SUMMARIES, {})).items():
      metrics[f'summary/{name}'] = jnp.mean(value)  # scanned layers: the mean over layers
    new_state = {'step': state['step'] + 1, 'params': params, 'opt_state': opt_state}
    if has_non_trainable:
      new_state['non_trainable'] = sync_non_trainable(updates[NON_TRAINABLE], setup)
    return new_state, metrics

  replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())
  return jax.jit(step_fn, in_shardings=(setup.state_shardings, batch_sharding),
                 out_shardings=(setup.state_shardings, replicated), donate_argnums=(0,),
                 compiler_options=compiler_options or None)


def step_rngs(seed: int, step) -> dict:
  """The random streams of one train step: a function of the seed and the step alone, so a
  resumed run draws what an uninterrupted one would. Flax folds in each call on top."""
  import jax

  from paxcli.layers.base import RANDOM
  rng = jax.random.fold_in(jax.random.key(seed), step)
  return {'dropout': rng, RANDOM: jax.random.fold_in(rng, 1)}


def sync_non_trainable(new_vars, setup):
  """Non-trainable variables after a step, laid out as the state holds them.

  Under jit the layers compute their updates from the global batch, so each variable
  already holds the mean over data-parallel replicas (Pax's REQUIRES_MEAN_SYNC, which
  with pmap averaged per-replica values); the sharding constraint keeps every replica's
  copy the same array.
  """
  import jax

  from paxcli.runtime.engine import unbox
  return jax.tree.map(jax.lax.with_sharding_constraint, unbox(new_vars), setup.state_shardings['non_trainable'])


def ready_step(resolved, seed: int = 0):
  """(setup, initial state, jitted step, batch sharding, train input) without the loop.

  For benchmarks and tests that run steps directly.
  """
  from paxcli.runtime import engine
  from paxcli.runtime import sharding
  setup = engine.build(resolved)
  state = engine.init_state(setup, seed)
  batch_sharding = sharding.batch_sharding(setup.mesh)
  step = make_train_step(setup, batch_sharding, seed)
  return setup, state, step, batch_sharding, engine.build_input(resolved.train_dataset(), setup)


class GracefulStop:
  """SIGTERM (preemption) or a first Ctrl-C asks the loop to save and stop after the step.

  Only with one process: several processes must agree on the step to save at, which a
  signal to one of them cannot give. A second signal (Ctrl-C again) exits at once, in
  one line, without waiting for a save in flight: orbax's temporary directory is left
  behind and set aside (never used) at the next start.
  """

  SIGNALS = {'SIGTERM': 143, 'SIGINT': 130}

  def __init__(self, enabled: bool):
    self.enabled = enabled and threading.current_thread() is threading.main_thread()
    self.signal_name: Optional[str] = None
    self._previous = {}

  def __enter__(self):
    if self.enabled:
      for name in self.SIGNALS:
        signum = getattr(signal, name)
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    if self.signal_name is not None:  # the second one: no traceback from orbax's threads over the bar
      sys.stderr.write(f'\nerror: {signal.Signals(signum).name} again: stopping without waiting for the save. '
                       'An unfinished checkpoint is set aside at the next start; run the same command to resume '
                       'from the last complete one.\n')
      sys.stderr.flush()
      os._exit(self.SIGNALS.get(signal.Signals(signum).name, 130))
    self.signal_name = signal.Signals(signum).name

  def __exit__(self, *exc):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    return False

  @property
  def requested(self) -> bool:
    return self.signal_name is not None


def params_finite(params) -> bool:
  import jax
  return bool(_all_finite()(jax.tree.leaves(params)))


@functools.cache
def _all_finite():
  """One jitted check, so each save reuses its compilation instead of tracing a new one."""
  import jax
  import jax.numpy as jnp
  return jax.jit(lambda leaves: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])))


class Reporter:
  """A rich progress bar on a terminal; plain log lines otherwise (CI, files, pipes)."""

  def __init__(self, console, total: int, start: int, enabled: bool = True):
    self.console = console
    self.total = total
    self.enabled = enabled
    self.interactive = enabled and console.is_terminal
    self._progress = None
    if self.interactive:
      from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                 TimeRemainingColumn)
      self._progress = Progress(
          TextColumn('[bold]train'), BarColumn(), MofNCompleteColumn(),
          TextColumn('loss {task.fields[loss]}'), TextColumn('{task.fields[tps]} tok/s'),
          TimeElapsedColumn(), TextColumn('eta'), TimeRemainingColumn(), console=console, transient=False)
      self._task = self._progress.add_task('train', total=total, completed=start, loss='-', tps='-')
      self._progress.start()

  def step(self, step: int, loss: Optional[float], tokens_per_sec: Optional[float]) -> None:
    if self._progress is not None:
      fields = {}
      if loss is not None:
        fields['loss'] = f'{loss:.4f}'
      if tokens_per_sec is not None:
        fields['tps'] = f'{tokens_per_sec:,.0f}'
      self._progress.update(self._task, completed=step, **fields)

  def log(self, message: str) -> None:
    if self.enabled:
      self.console.print(message, highlight=False, markup=False, soft_wrap=True)

  def summary(self, record: dict) -> None:
    if self.enabled and not self.interactive:
      accuracy = f"  accuracy {record['accuracy']:.4f}" if 'accuracy' in record else ''
      aux = ''.join(f"  {k} {v:.4g}" for k, v in record.items() if k.startswith('aux_loss/'))
      self.log(f"step {record['step']}: loss {record['loss']:.4f}{accuracy}{aux}  "
               f"lr {record['learning_rate']:.3g}  grad_norm {record['grad_norm']:.3f}  "
               f"{record['steps_per_sec']:.2f} steps/s  {record['tokens_per_sec']:,.0f} tokens/s"
               f"{mfu_note(record)}{eta_note(record, self.total)}{window_note(record)}")

  def close(self) -> None:
    if self._progress is not None:
      self._progress.stop()
      self._progress = None


def train(resolved, job_dir: str, console, verbose: bool = False, profile_steps=None, pgle: Optional[str] = None,
          pgle_profile: Optional[str] = None) -> dict:
  """Trains (or resumes) the resolved experiment in job_dir. Returns the last summary.

  The job directory is checked first and locked for the run (`paxcli/jobdir/lock.py`): a
  second trainer on it is refused. profile_steps: (A, B) to trace steps A..B with
  jax.profiler; pgle/pgle_profile: see paxcli.perf.profiling.
  """
  from paxcli.runtime import engine
  from paxcli.jobdir import lock as joblock
  engine.check_supported(resolved.experiment)  # refusals first: a refused run leaves no job directory
  engine.apply_platform_env(resolved.experiment.PLATFORM_ENV, log=lambda m: console.print(m))
  import jax  # after PLATFORM_ENV: it may set XLA_FLAGS

  from paxcli.perf import profiling
  profiling.check_pgle(pgle, pgle_profile)
  joblock.check_writable(job_dir)  # makes the directory
  log = (lambda m: console.print(m, highlight=False, markup=False, soft_wrap=True))
  lock = joblock.lock_run(job_dir, log if jax.process_index() == 0 else (lambda m: None))
  try:
    return _train(resolved, job_dir, console, verbose, profile_steps, pgle_profile)
  finally:
    if lock is not None:
      lock.release()


def _train(resolved, job_dir: str, console, verbose: bool = False, profile_steps=None,
           pgle_profile: Optional[str] = None) -> dict:
  from paxcli.runtime import engine
  import jax

  from paxcli.jobdir import checkpoint as ckpt
  from paxcli.perf import flops
  from paxcli.perf import profiling
  from paxcli.jobdir import restore
  from paxcli.runtime import sharding
  from paxcli.jobdir import summaries
  from paxcli.jobdir.summaries import SummaryWriter
  is_main = jax.process_index() == 0
  reporter_log = (lambda m: console.print(m, highlight=False, markup=False, soft_wrap=True)) if is_main else (lambda m: None)
  from paxcli.runtime import distributed
  distributed.log_topology(lambda m: console.print(m, highlight=False, markup=False, soft_wrap=True))

  # ---- Mesh, model, state shapes ------------------------------------------------------
  setup = engine.build(resolved)
  train_cfg = setup.train
  flat = {k: repr(v) for k, v in resolved.flat().items()}
  shapes_now = engine.shape_signature(setup.abstract_state)
  devices = jax.devices()
  reporter_log(f'Experiment {resolved.name} -> {os.path.abspath(job_dir)}')
  reporter_log(f'Devices: {len(devices)} x {devices[0].device_kind} ({jax.default_backend()}), '
               f'{jax.process_count()} process(es); mesh {sharding.describe_mesh(setup.mesh)}')
  reporter_log(f'Parameters: {engine.param_count(setup.abstract_state):,}; global batch '
               f'{setup.infeed.describe()} x {setup.seq_len} tokens')
  if verbose and is_main:
    _print_weights(console, setup)
  # Before any state is made: an input whose data is missing stops the run at once.
  train_input = engine.build_input(resolved.train_dataset(), setup)

  # ---- Checkpoint: resume or start -------------------------------------------------------
  ckpt_dir = os.path.join(job_dir, 'checkpoints')
  os.makedirs(job_dir, exist_ok=True)
  if is_main:
    from paxcli.jobdir import invocation
    invocation.record(job_dir)
  ckpt.set_aside_unfinished(ckpt_dir, log=reporter_log)
  distributed.barrier('paxcli:unfinished-checkpoints-set-aside')  # all processes then see the same steps
  checkpointer = ckpt.Checkpointer(ckpt_dir, train_cfg.save_max_to_keep)
  latest = checkpointer.latest_step()
  batches_consumed = 0
  layout = engine.input_layout(resolved, setup)
  if latest is not None:
    if latest >= train_cfg.num_train_steps:
      restore.check_shapes(restore.read_meta(job_dir, latest), shapes_now, flat, latest, False, 'resume from')
      reporter_log(f'Run already finished: checkpoint at step {latest} >= num_train_steps '
                   f'{train_cfg.num_train_steps}. Nothing to do.')
      checkpointer.close()
      return {'step': latest, 'finished': True}
    restored = restore.restore(setup, job_dir, latest, flat_now=flat, action='resume from', fallback=True,
                               set_aside=True, log=reporter_log)
    state, meta = restored.state, restored.meta
    if restored.step != latest:  # a damaged checkpoint was set aside
      latest = restored.step
      checkpointer.reload()
    if restored.params_only_checkpoint:
      reporter_log(f'The checkpoint at step {latest} holds parameters only: the optimizer state starts fresh.')
    batches_consumed = int(meta.get('batches_consumed', latest))
    if int(meta.get('global_batch', setup.global_batch)) != setup.global_batch:
      reporter_log(f'Note: the global batch changed ({meta.get("global_batch")} -> {setup.global_batch}); '
                   'the data order from here differs from an uninterrupted run.')
    layout_note = engine.layout_change_note(meta.get('input_layout'), layout)
    if layout_note:
      reporter_log(layout_note)
    reporter_log(f'Resumed from step {latest} ({batches_consumed} batches consumed).')
    changed = config_differences(meta.get('config') or {}, flat, prefixes=('',))
    if changed:
      reporter_log(f'Note: {len(changed)} setting(s) differ from the checkpoint\'s config (the run goes on '
                   'with the new ones):\n  ' + '\n  '.join(changed))
  else:
    state = engine.init_state(setup, resolved.experiment.RANDOM_SEED)
  if is_main:
    with open(os.path.join(job_dir, 'config.txt'), 'w', encoding='utf-8') as f:
      f.write(resolved.as_text())
    _trim_replayed_metrics(job_dir, int(latest or 0), reporter_log)

  # ---- Input -------------------------------------------------------------------------------
  if is_main:
    from paxcli.jobdir import tokenizer
    tokenizer.save_to_job_dir(train_input, job_dir)
  train_input.skip(batches_consumed)
  batch_sharding = sharding.batch_sharding(setup.mesh)
  profiler = profiling.StepProfiler(job_dir, reporter_log, profile_steps, pgle_profile, int(latest or 0))
  train_step = make_train_step(setup, batch_sharding, resolved.experiment.RANDOM_SEED + 1, profiler.pgle_options)
  if profiler.pgle_options:
    reporter_log(f'PGLE: compiling the train step with the profile {pgle_profile}.')
  # MFU: model FLOPs per step (paxcli.perf.flops) over the device's peak.
  model_flops = flops.for_model(setup.model, setup.seq_len)
  mfu_of = None
  if model_flops is None:
    reporter_log('MFU: not reported; paxcli.perf.flops has no FLOPs model for this model.')
  else:
    step_flops = model_flops.per_step(setup.global_batch * setup.seq_len)
    peak = flops.device_peak(devices[0], flops.compute_dtype(setup.model), measure_size=512)
    mfu_of = functools.partial(mfu_fields, step_flops=step_flops, num_devices=len(devices), peak=peak.tflops)
    reporter_log(f'MFU: {step_flops / 1e12:.4g} model TFLOP per step over {len(devices)} device(s); '
                 f'peak {peak.source}.')
  evaluator = None
  if train_cfg.eval_interval_steps and resolved.eval_datasets():
    from paxcli.loops.evaluate import Evaluator, metrics_line
    evaluator = Evaluator(resolved, setup, job_dir)
  train_decoder = None
  if getattr(train_cfg, 'decode_interval_steps', 0) and train_cfg.decode_prompts:
    from paxcli.loops.decode import TrainDecoder
    train_decoder = TrainDecoder(resolved, setup, job_dir, train_cfg)

  # ---- Loop ------------------------------------------------------------------------------------
  writer = SummaryWriter(os.path.join(job_dir, 'summaries', 'train'),
                         os.path.join(job_dir, 'train_metrics.jsonl')) if is_main else None
  start_step = int(latest or 0)
  reporter = Reporter(console, train_cfg.num_train_steps, start_step, enabled=is_main)
  window: list[dict] = []
  guard = LossGuard(train_cfg.loss_spike_factor, train_cfg.loss_spike_window,
                    meta.get('recent_losses') if latest is not None else ())
  last = {'step': start_step}
  t_window = time.perf_counter()
  steps_in_window = 0
  pending = None  # metrics of the previous step, checked one step late to keep dispatch async
  stop = GracefulStop(enabled=jax.process_count() == 1)
  compile_timer = flops.CompileTimer()  # compilation and evals are timed apart from steps
  eval_seconds = 0.0

  def save(step: int) -> None:
    if not params_finite(state['params']):
      raise TrainingDiverged(f'The parameters became non-finite at step {step} (the loss was still finite); '
                             'stopping without saving them. Lower the learning rate or clip gradients.')
    checkpointer.save(step, state, {'batches_consumed': batches_consumed, 'step': step,
                                    'global_batch': setup.global_batch, 'state_shapes': shapes_now,
                                    'config': flat, 'input_layout': layout,
                                    'recent_losses': list(guard.recent), 'loss': guard.median(),
                                    'checksums': restore.checksums(state)})

  zero_weight = {'steps': 0, 'seen': 0}

  def take(step: int, metrics) -> dict:
    """One step's metrics as floats, after the finite-loss and zero-weight checks."""
    values = _check_finite(step, metrics, guard=guard, saved=checkpointer.latest_saved)
    zero_weight['seen'] += 1
    zero_weight['steps'] += values['tokens'] == 0
    if zero_weight['seen'] == zero_weight['steps'] == min(ZERO_WEIGHT_STEPS_TO_STOP, train_cfg.num_train_steps - start_step):
      raise UserError(f'Steps {start_step + 1}-{step} all had zero total weight: every target token of every '
                      'batch is masked (weights 0), so the loss is 0 and nothing trains. Stopping. Check the '
                      "input's weights or paddings (`pax inspect-input` shows padding per feature).")
    return values

  try:
    stop.__enter__()
    compile_timer.__enter__()
    for step in range(start_step + 1, train_cfg.num_train_steps + 1):
      batch = to_global(train_input.get_next(), batch_sharding, setup.global_batch)
      profiler.before(step)
      state, metrics = train_step(state, batch)
      recompile_with = profiler.after(step, metrics)
      if recompile_with:
        train_step = make_train_step(setup, batch_sharding, resolved.experiment.RANDOM_SEED + 1, recompile_with)
      batches_consumed += 1
      steps_in_window += 1
      if pending is not None:
        window.append(take(*pending))
      pending = (step, metrics)
      stopping = stop.requested  # read once: a signal may land at any moment
      is_last = step == train_cfg.num_train_steps
      summarize = is_last or step % train_cfg.summary_interval_steps == 0
      save_now = is_last or stopping or step % train_cfg.save_interval_steps == 0
      if summarize or save_now:
        window.append(take(*pending))
        pending = None
      if summarize:
        now = time.perf_counter()
        if window and not any(w['tokens'] for w in window):
          reporter.log(f"warning: steps {window[0]['step']}-{window[-1]['step']} had zero total weight (every "
                       'target token masked): their loss 0 means nothing was trained.')
        last = _summarize(step, window, steps_in_window, max(now - t_window, 1e-9),
                          compile_timer.take(), eval_seconds, mfu_of)
        eval_seconds = 0.0
        if writer:
          writer.scalars(step, {k: v for k, v in last.items() if k != 'step'})
        reporter.summary(last)
        window, steps_in_window, t_window = [], 0, now
      if save_now:
        save(step)
      if evaluator and step % train_cfg.eval_interval_steps == 0:
        t_eval, compile_timer.ignoring = time.perf_counter(), True
        for name, m in evaluator.run(step, state).items():
          reporter.log(metrics_line(step, name, m))
        compile_timer.ignoring = False
        eval_seconds += time.perf_counter() - t_eval
      if train_decoder and (step % train_cfg.decode_interval_steps == 0 or is_last):
        t_eval, compile_timer.ignoring = time.perf_counter(), True
        for line in train_decoder.run(step, state['params']):
          reporter.log(line)
        compile_timer.ignoring = False
        eval_seconds += time.perf_counter() - t_eval
      reporter.step(step, last.get('loss'), last.get('tokens_per_sec'))
      if stopping:
        checkpointer.wait()
        reporter.close()
        reporter_log(f'Stopped by {stop.signal_name} after step {step}; saved a checkpoint at step {step} in '
                     f'{ckpt_dir}. Run the same command to resume.')
        raise SystemExit(GracefulStop.SIGNALS[stop.signal_name])
  finally:
    stop.__exit__(None, None, None)
    compile_timer.__exit__(None, None, None)
    profiler.close()
    reporter.close()
    checkpointer.close()
    if evaluator:
      evaluator.close()
    if train_decoder:
      train_decoder.close()
    if writer:
      writer.close()
  keep = train_cfg.save_max_to_keep
  kept = f'the latest {keep} kept, and the one of lowest loss' if keep else 'all kept'
  reporter_log(f"Done: step {last['step']}, loss {last.get('loss', float('nan')):.4f}.\n"
               f"  checkpoints: {ckpt_dir} ({kept}; task.train.save_max_to_keep)\n"
               f"  metrics:     {os.path.join(job_dir, 'train_metrics.jsonl')}\n"
               f"  TensorBoard: {summaries.tensorboard_command()} --logdir {os.path.join(job_dir, 'summaries')}")
  return last


def _trim_replayed_metrics(job_dir: str, step: int, log) -> None:
  """Drops metric rows past the step we resume from: the steps run again write them anew."""
  from paxcli.jobdir import lock as joblock
  dropped = joblock.trim_metrics(job_dir, step)
  if dropped:
    log(f'Dropped {dropped} metric row(s) past step {step} from the *_metrics.jsonl files (steps after the '
        'last checkpoint, which this run repeats).')


def _check_finite(step: int, metrics, guard: Optional[LossGuard] = None, saved: Optional[int] = None) -> dict:
  values = {k: float(v) for k, v in metrics.items()}
  if not math.isfinite(values['loss']):
    raise TrainingDiverged(f'The loss became {values["loss"]} at step {step}; stopping. No checkpoint of '
                           'this state was written. Lower the learning rate or check the input.')
  if guard is not None:
    guard.check(step, values['loss'], saved)
  values['step'] = step
  return values


def _summarize(step: int, window: list[dict], steps: int, elapsed: float, compile_seconds: float = 0.0,
               eval_seconds: float = 0.0, mfu_of=None) -> dict:
  """Means over the steps since the last summary; layer summaries are the latest step's. Rates
  are over the window's time less compilation and evals (whose seconds are reported apart)."""
  n = max(len(window), 1)
  mean = lambda k: sum(w[k] for w in window) / n
  tokens = sum(w['tokens'] for w in window)
  steady = max(elapsed - compile_seconds - eval_seconds, 1e-6)
  out = {'step': step}
  for key in window[-1]:
    if key in ('step', 'tokens'):
      continue
    out[key] = window[-1][key] if key == 'learning_rate' or key.startswith('summary/') else mean(key)
  out['steps_per_sec'] = steps / steady
  out['tokens_per_sec'] = tokens / steady
  out['compile_seconds'] = compile_seconds
  out['eval_seconds'] = eval_seconds
  if mfu_of:
    out.update(mfu_of(steps / steady))
  return out


def mfu_fields(steps_per_sec: float, step_flops: float, num_devices: int, peak: float) -> dict:
  """Model TFLOP/s per device and MFU (a fraction of `peak` TFLOP/s per device)."""
  tflops = step_flops * steps_per_sec / num_devices / 1e12
  return {'model_tflops_per_device': tflops, 'mfu': tflops / peak if peak else float('nan')}


def mfu_note(record: dict) -> str:
  if 'mfu' not in record:
    return ''
  return f"  {record['model_tflops_per_device']:.3g} TFLOP/s/device  MFU {record['mfu']:.1%}"


def eta_note(record: dict, total: int) -> str:
  """'  eta 0:01:23' for the steps left at the window's steady rate (evals and compiles not counted)."""
  left, rate = total - record['step'], record.get('steps_per_sec') or 0
  if left <= 0 or not rate > 0:
    return ''
  minutes, seconds = divmod(int(round(left / rate)), 60)
  hours, minutes = divmod(minutes, 60)
  return f'  eta {hours}:{minutes:02d}:{seconds:02d}'


def window_note(record: dict) -> str:
  """'' for a steady window; else which time was left out of its rates."""
  parts = [f'{record[k]:.1f} s {name}' for k, name in (('compile_seconds', 'compilation'),
                                                        ('eval_seconds', 'eval')) if record.get(k, 0) >= 0.05]
  return f'  (window had {" and ".join(parts)}, left out of the rates)' if parts else ''


def _print_weights(console, setup) -> None:
  from rich.table import Table

  from paxcli.runtime import engine
  table = Table(title='Weights', show_lines=False)
  table.add_column('weight', overflow='fold')
  for col in ('shape', 'dtype', 'logical axes', 'mesh axes'):
    table.add_column(col)
  for row in engine.weights_table(setup):
    table.add_row(*row)
  console.print(table)
