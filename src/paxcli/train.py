"""The train loop: one function to read top to bottom, helpers for the step and reporting.

Job directory layout:
  config.txt             the resolved config of the latest invocation
  checkpoints/<step>/    orbax checkpoints (state + meta)
  summaries/train/       TensorBoard events
  train_metrics.jsonl    the same numbers, one JSON object per summary step
"""

from __future__ import annotations

import functools
import math
import os
import signal
import threading
import time
from typing import Optional

from paxcli.errors import UserError


class TrainingDiverged(UserError):
  exit_code = 3


def make_train_step(setup, batch_sharding, dropout_seed: int, compiler_options: Optional[dict] = None):
  """The jitted step: (state, batch) -> (state, metrics); state is donated.

  `compiler_options`: XLA options for this program only (a PGLE profile, for one).
  """
  import jax
  import jax.numpy as jnp
  import optax

  from paxcli import optim
  from paxcli.models import fused_lm_loss
  model, tx = setup.model, setup.tx
  lr_fn = optim.learning_rate_fn(setup.train)
  deterministic = model.dropout_prob == 0

  def step_fn(state, batch):
    rng = jax.random.fold_in(jax.random.key(dropout_seed), state['step'])

    def loss_fn(params):
      logits = model.apply({'params': params}, batch['ids'], batch.get('segment_ids'),
                           batch.get('positions'), deterministic=deterministic, rngs={'dropout': rng})
      return fused_lm_loss(logits, batch['labels'], batch['weights'])

    (loss, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
    updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
    params = optax.apply_updates(state['params'], updates)
    metrics = {
        'loss': loss,
        'accuracy': sums['correct_sum'] / jnp.maximum(sums['weight_sum'], 1e-8),
        'grad_norm': optax.tree.norm(grads) if hasattr(optax, 'tree') else optax.global_norm(grads),
        'learning_rate': lr_fn(state['step']),
        'tokens': sums['weight_sum'],
    }
    return {'step': state['step'] + 1, 'params': params, 'opt_state': opt_state}, metrics

  replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())
  return jax.jit(step_fn, in_shardings=(setup.state_shardings, batch_sharding),
                 out_shardings=(setup.state_shardings, replicated), donate_argnums=(0,),
                 compiler_options=compiler_options or None)


def ready_step(resolved, seed: int = 0):
  """(setup, initial state, jitted step, batch sharding, train input) without the loop.

  For benchmarks and tests that run steps directly.
  """
  from paxcli import engine, sharding
  setup = engine.build(resolved)
  state = engine.init_state(setup, seed)
  batch_sharding = sharding.batch_sharding(setup.mesh)
  step = make_train_step(setup, batch_sharding, seed)
  return setup, state, step, batch_sharding, engine.build_input(resolved.train_dataset(), setup)


def to_global(batch: dict, sharding, global_batch: int) -> dict:
  """Per-process numpy batch -> global jax arrays sharded over (replica, data)."""
  import jax
  return {k: jax.make_array_from_process_local_data(sharding, v, (global_batch,) + v.shape[1:])
          for k, v in batch.items()}


def _config_differences(saved: dict, current: dict, prefixes=('knobs.', 'task.model.', 'task.train.optimizer.')) -> list[str]:
  keys = sorted(k for k in set(saved) | set(current) if k.startswith(prefixes))
  return [f'{k}: checkpoint {saved.get(k, "<absent>")} -> now {current.get(k, "<absent>")}'
          for k in keys if saved.get(k) != current.get(k)]


def check_resume_compatible(meta: dict, shapes_now: dict, flat_now: dict, step: int) -> None:
  saved_shapes = meta.get('state_shapes') or {}
  if saved_shapes == shapes_now:
    return
  diffs = _config_differences(meta.get('config') or {}, flat_now)
  shape_diffs = [f'{k}: {saved_shapes.get(k)} -> {shapes_now.get(k)}'
                 for k in sorted(set(saved_shapes) | set(shapes_now)) if saved_shapes.get(k) != shapes_now.get(k)]
  lines = '\n  '.join((diffs or ['(no knob or model field differs; the code may have changed)'])[:20])
  shapes = '\n  '.join(shape_diffs[:8] + ([f'... {len(shape_diffs) - 8} more'] if len(shape_diffs) > 8 else []))
  raise UserError(f'Cannot resume from the checkpoint at step {step}: this configuration changes the '
                  f'shapes of the train state.\nConfig differences:\n  {lines}\nState shapes:\n  {shapes}\n'
                  'Use another --job-log-dir for a new run, or drop the overrides that change shapes.')


class GracefulStop:
  """SIGTERM (preemption) or a first Ctrl-C asks the loop to save and stop after the step.

  Only with one process: several processes must agree on the step to save at, which a
  signal to one of them cannot give. A second Ctrl-C interrupts at once.
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
    self.signal_name = signal.Signals(signum).name
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops at once

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
      self.log(f"step {record['step']}: loss {record['loss']:.4f}  accuracy {record['accuracy']:.4f}  "
               f"lr {record['learning_rate']:.3g}  grad_norm {record['grad_norm']:.3f}  "
               f"{record['steps_per_sec']:.2f} steps/s  {record['tokens_per_sec']:,.0f} tokens/s  "
               f"{record['model_tflops_per_device']:.3g} TFLOP/s/device  MFU {record['mfu']:.1%}"
               f"{window_note(record)}")

  def close(self) -> None:
    if self._progress is not None:
      self._progress.stop()
      self._progress = None


def train(resolved, job_dir: str, console, verbose: bool = False, profile_steps=None, pgle: Optional[str] = None,
          pgle_profile: Optional[str] = None) -> dict:
  """Trains (or resumes) the resolved experiment in job_dir. Returns the last summary.

  profile_steps: (A, B) to trace steps A..B with jax.profiler; pgle/pgle_profile: see
  paxcli.profiling.
  """
  from paxcli import engine
  engine.check_supported(resolved.experiment)
  engine.apply_platform_env(resolved.experiment.PLATFORM_ENV, log=lambda m: console.print(m))
  import jax

  from paxcli import checkpoint as ckpt
  from paxcli import flops, profiling, sharding
  from paxcli.summaries import SummaryWriter
  profiling.check_pgle(pgle, pgle_profile)
  is_main = jax.process_index() == 0
  reporter_log = (lambda m: console.print(m, highlight=False, markup=False, soft_wrap=True)) if is_main else (lambda m: None)
  from paxcli import distributed
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

  # ---- Checkpoint: resume or start -------------------------------------------------------
  ckpt_dir = os.path.join(job_dir, 'checkpoints')
  os.makedirs(job_dir, exist_ok=True)
  ckpt.set_aside_unfinished(ckpt_dir, log=reporter_log)
  distributed.barrier('paxcli:unfinished-checkpoints-set-aside')  # all processes then see the same steps
  checkpointer = ckpt.Checkpointer(ckpt_dir, train_cfg.save_max_to_keep)
  latest = checkpointer.latest_step()
  batches_consumed = 0
  layout = engine.input_layout(resolved, setup)
  if latest is not None:
    meta = checkpointer.read_meta(latest)
    check_resume_compatible(meta, shapes_now, flat, latest)
    if latest >= train_cfg.num_train_steps:
      reporter_log(f'Run already finished: checkpoint at step {latest} >= num_train_steps '
                   f'{train_cfg.num_train_steps}. Nothing to do.')
      checkpointer.close()
      return {'step': latest, 'finished': True}
    state, meta = checkpointer.restore(latest, setup.abstract_state)
    batches_consumed = int(meta.get('batches_consumed', latest))
    if int(meta.get('global_batch', setup.global_batch)) != setup.global_batch:
      reporter_log(f'Note: the global batch changed ({meta.get("global_batch")} -> {setup.global_batch}); '
                   'the data order from here differs from an uninterrupted run.')
    layout_note = engine.layout_change_note(meta.get('input_layout'), layout)
    if layout_note:
      reporter_log(layout_note)
    reporter_log(f'Resumed from step {latest} ({batches_consumed} batches consumed).')
  else:
    state = engine.init_state(setup, resolved.experiment.RANDOM_SEED)
  if is_main:
    with open(os.path.join(job_dir, 'config.txt'), 'w', encoding='utf-8') as f:
      f.write(resolved.as_text())

  # ---- Input -------------------------------------------------------------------------------
  train_input = engine.build_input(resolved.train_dataset(), setup)
  train_input.skip(batches_consumed)
  batch_sharding = sharding.batch_sharding(setup.mesh)
  profiler = profiling.StepProfiler(job_dir, reporter_log, profile_steps, pgle_profile, int(latest or 0))
  train_step = make_train_step(setup, batch_sharding, resolved.experiment.RANDOM_SEED + 1, profiler.pgle_options)
  if profiler.pgle_options:
    reporter_log(f'PGLE: compiling the train step with the profile {pgle_profile}.')
  # MFU: model FLOPs per step (paxcli.flops) over the device's peak.
  step_flops = flops.lm_flops(setup.model, setup.seq_len).per_step(setup.global_batch * setup.seq_len)
  peak = flops.device_peak(devices[0], setup.model.fprop_dtype, measure_size=512)
  mfu_of = functools.partial(mfu_fields, step_flops=step_flops, num_devices=len(devices), peak=peak.tflops)
  reporter_log(f'MFU: {step_flops / 1e12:.4g} model TFLOP per step over {len(devices)} device(s); '
               f'peak {peak.source}.')
  evaluator = None
  if train_cfg.eval_interval_steps and resolved.eval_datasets():
    from paxcli.evaluate import Evaluator
    evaluator = Evaluator(resolved, setup, job_dir)

  # ---- Loop ------------------------------------------------------------------------------------
  writer = SummaryWriter(os.path.join(job_dir, 'summaries', 'train'),
                         os.path.join(job_dir, 'train_metrics.jsonl')) if is_main else None
  start_step = int(latest or 0)
  reporter = Reporter(console, train_cfg.num_train_steps, start_step, enabled=is_main)
  window: list[dict] = []
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
                                    'config': flat, 'input_layout': layout})

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
        window.append(_check_finite(*pending))
      pending = (step, metrics)
      stopping = stop.requested  # read once: a signal may land at any moment
      is_last = step == train_cfg.num_train_steps
      summarize = is_last or step % train_cfg.summary_interval_steps == 0
      save_now = is_last or stopping or step % train_cfg.save_interval_steps == 0
      if summarize or save_now:
        window.append(_check_finite(*pending))
        pending = None
      if summarize:
        now = time.perf_counter()
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
        for name, m in evaluator.run(step, state['params']).items():
          reporter.log(f"step {step}: eval {name}: loss {m['loss']:.4f}  accuracy {m['accuracy']:.4f}  "
                       f"({m['num_examples']:.0f} examples)")
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
    if writer:
      writer.close()
  reporter_log(f"Done: step {last['step']}, loss {last.get('loss', float('nan')):.4f}. "
               f"Checkpoints in {ckpt_dir}.")
  return last


def _check_finite(step: int, metrics) -> dict:
  values = {k: float(v) for k, v in metrics.items()}
  if not math.isfinite(values['loss']):
    raise TrainingDiverged(f'The loss became {values["loss"]} at step {step}; stopping. No checkpoint of '
                           'this state was written. Lower the learning rate or check the input.')
  values['step'] = step
  return values


def _summarize(step: int, window: list[dict], steps: int, elapsed: float, compile_seconds: float = 0.0,
               eval_seconds: float = 0.0, mfu_of=None) -> dict:
  """Means over the window; rates over its time less compilation and evals (reported apart)."""
  n = max(len(window), 1)
  mean = lambda k: sum(w[k] for w in window) / n
  tokens = sum(w['tokens'] for w in window)
  steady = max(elapsed - compile_seconds - eval_seconds, 1e-6)
  record = {
      'step': step,
      'loss': mean('loss'),
      'accuracy': mean('accuracy'),
      'learning_rate': window[-1]['learning_rate'],
      'grad_norm': mean('grad_norm'),
      'steps_per_sec': steps / steady,
      'tokens_per_sec': tokens / steady,
      'compile_seconds': compile_seconds,
      'eval_seconds': eval_seconds,
  }
  if mfu_of:
    record.update(mfu_of(steps / steady))
  return record


def mfu_fields(steps_per_sec: float, step_flops: float, num_devices: int, peak: float) -> dict:
  """Model TFLOP/s per device and MFU (a fraction of `peak` TFLOP/s per device)."""
  tflops = step_flops * steps_per_sec / num_devices / 1e12
  return {'model_tflops_per_device': tflops, 'mfu': tflops / peak if peak else float('nan')}


def window_note(record: dict) -> str:
  """'' for a steady window; else which time was left out of its rates."""
  parts = [f'{record[k]:.1f} s {name}' for k, name in (('compile_seconds', 'compilation'),
                                                        ('eval_seconds', 'eval')) if record.get(k, 0) >= 0.05]
  return f'  (window had {" and ".join(parts)}, left out of the rates)' if parts else ''


def _print_weights(console, setup) -> None:
  from rich.table import Table

  from paxcli import engine
  table = Table(title='Weights', show_lines=False)
  table.add_column('weight', overflow='fold')
  for col in ('shape', 'dtype', 'logical axes', 'mesh axes'):
    table.add_column(col)
  for row in engine.weights_table(setup):
    table.add_row(*row)
  console.print(table)
