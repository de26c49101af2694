"""`pax bench mfu`: compile and time an experiment's train step; MFU, HFU and memory.

One row per configuration (a sweep gives several): the step is lowered and compiled
for the current devices (compile seconds, XLA's FLOPs and per-device memory), then,
unless compile-only, run `warmup` times and timed `steps` times, each step waited for
(`block_until_ready`), on one fixed batch so the input pipeline is out of the picture.
A configuration that runs out of memory is a row that says so; the sweep goes on.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import itertools
import math
import os
import re
import statistics
import tempfile
import textwrap
import time
from typing import Callable, Optional

import fiddle as fdl
import jax

from rich.table import Table

from paxcli import config, files
from paxcli.errors import UserError
from paxcli.jobdir import storage
from paxcli.layers import fp8
from paxcli.loops.train import make_train_step
from paxcli.perf import flops
from paxcli.perf import profiling
from paxcli.perf import xla_log
from paxcli.perf.profiling import pgle_compiler_options
from paxcli.runtime import engine
from paxcli.runtime import infeed
from paxcli.runtime import platform
from paxcli.runtime import sharding
from paxcli.runtime import topology
from paxcli.runtime.sharding import to_global

GIB = 1024 ** 3


def split_values(text: str) -> list[str]:
  """'4,8,16' -> ['4', '8', '16']; commas inside brackets stay: '[1,8,1],[8,1,1]'."""
  out, depth, current = [], 0, ''
  for ch in text:
    if ch in '[({':
      depth += 1
    elif ch in '])}':
      depth -= 1
    if ch == ',' and depth == 0:
      out.append(current.strip())
      current = ''
    else:
      current += ch
  if current.strip():
    out.append(current.strip())
  return out


def sweep_combinations(sweeps: list[str]) -> list[list[tuple[str, str]]]:
  """['A=1,2', 'B=x,y'] -> every combination, each a list of (key, value)."""
  axes = []
  for item in sweeps:
    if '=' not in item:
      raise UserError(f'--sweep {item!r} is not KNOB=a,b,c (e.g. --sweep PERCORE_BATCH_SIZE=4,8,16).')
    key, values = item.split('=', 1)
    values = split_values(values)
    if not key.strip() or not values:
      raise UserError(f'--sweep {item!r} names no knob or no values.')
    axes.append([(key.strip(), v) for v in values])
  return [list(c) for c in itertools.product(*axes)] if axes else [[]]


def is_out_of_memory(error: BaseException) -> bool:
  text = str(error)
  return any(s in text for s in ('RESOURCE_EXHAUSTED', 'Out of memory', 'out of memory', 'OOM'))


def abstract_batch(setup, batch_sharding, example: dict) -> dict:
  return {k: jax.ShapeDtypeStruct((setup.global_batch,) + v.shape[1:], v.dtype, sharding=batch_sharding)
          for k, v in example.items()}


def example_batch(data_cfg, setup) -> dict:
  """One per-process batch to compile and time on: the input's first batch, or, for an input
  that declares its batches' shapes (`example_batch(cfg, batch_size)`, e.g. C4), that batch,
  so that planning a run needs none of its data."""
  declared = getattr(fdl.get_callable(data_cfg), 'example_batch', None)
  if declared is not None:
    return declared(data_cfg, setup.process_batch)
  return infeed.build_input(data_cfg, setup).get_next()


def measure(resolved, steps: int = 10, warmup: int = 2, compile_only: bool = False,
            peak_tflops: Optional[float] = None, pgle_profile: Optional[str] = None,
            on_step: Optional[Callable[[int, int], None]] = None, device_memory: Optional[int] = None,
            emulated_fp8: bool = False, target: Optional['Target'] = None) -> dict:
  """One configuration: a row of figures (see module doc). Raises on errors other than OOM. FP8 on a
  device without fp8 units is refused unless compile_only or `emulated_fp8` (benchmarks/fp8.py: a figure
  labelled emulated). `target`: compile-only devices of a TPU slice (`--topology`) instead of this
  machine's."""
  modes = fp8.modes_of(resolved.flat())
  if not (compile_only or emulated_fp8) and any(fp8.refusal(m) for m in modes):
    raise UserError(fp8.refusal(modes[0]))
  exp = resolved.experiment
  devices = target.devices if target else jax.devices()
  setup = engine.build(resolved, sharding.make_mesh(exp.ICI_MESH_SHAPE, exp.DCN_MESH_SHAPE, devices) if target else None)
  tokens = setup.global_batch * setup.seq_len
  model_flops = flops.for_model(setup.model, setup.seq_len)
  if model_flops is None:
    raise UserError(f'{resolved.name}: MFU {flops.unknown_flops(setup.model)}.')
  if compile_only and not peak_tflops and not flops.lookup_peak(devices[0].device_kind):
    peak = flops.Peak(None, 'not measured (--compile-only)')  # no step runs: no MFU to divide
  else:
    peak = flops.device_peak(devices[0], flops.compute_dtype(setup.model), peak_tflops)
  if device_memory:
    device_bytes, device_bytes_source = device_memory, '--device-memory'
  elif target:
    device_bytes, device_bytes_source = target.memory_bytes, target.memory_source
  else:
    device_bytes, device_bytes_source = flops.device_memory_bytes(devices[0])
  row = {
      'status': 'ok', 'devices': len(devices), 'device_kind': devices[0].device_kind,
      'platform': devices[0].platform, 'mesh': sharding.describe_mesh(setup.mesh),
      'compiler': target.compiler if target else f'XLA:{devices[0].platform.upper()}',
      'params': engine.param_count(setup.abstract_state), 'global_batch': setup.global_batch,
      'seq_len': setup.seq_len, 'tokens_per_step': tokens,
      'model_flops_per_step': model_flops.per_step(tokens),
      'palm_flops_per_step': model_flops.palm_per_token * tokens,
      'peak_tflops': peak.tflops, 'peak_source': peak.source, 'peak_measured': peak.measured,
      'device_memory_bytes': device_bytes, 'device_memory_source': device_bytes_source,
      'pgle': bool(pgle_profile), 'fp8': '+'.join(modes) or 'none',
      'fp8_emulated': any(fp8.emulation_note(m) for m in modes),
  }
  if setup.pipeline is not None:  # the idle share of a pipelined step, (S-1)/(R*M+S-1)
    row.update({'pipeline': setup.pipeline.describe(), 'pipeline_bubble': setup.pipeline.bubble})
  batch_sharding = sharding.batch_sharding(setup.mesh)
  host_batch = example_batch(resolved.train_dataset(), setup)
  step = make_train_step(setup, batch_sharding, resolved.experiment.RANDOM_SEED + 1)
  start = time.perf_counter()
  try:
    with xla_log.rematerialized(row):
      lowered = step.lower(setup.abstract_state, abstract_batch(setup, batch_sharding, host_batch))
      options = None
      if pgle_profile:
        options = pgle_compiler_options(pgle_profile)
      compiled = lowered.compile(options) if options else lowered.compile()
  except Exception as e:  # XLA reports memory exhaustion at compile time on some backends
    if not is_out_of_memory(e):
      raise
    return {**row, 'status': 'out of memory (compile)', 'error': _first_line(e)}
  row['compile_seconds'] = time.perf_counter() - start
  memory = flops.memory(compiled) or {}
  row.update({f'memory_{k}_bytes': v for k, v in memory.items()})
  if memory and device_bytes:
    row['fits'] = memory['total'] <= device_bytes
  row['xla_flops_per_step_per_device'] = flops.xla_flops(compiled)
  if compile_only:
    row['status'] = 'compiled' if row.get('fits', True) else 'does not fit'
    return row
  if row.get('fits') is False:
    # Not run: on an accelerator it would fail to allocate; on a CPU the host would swap or the
    # kernel's OOM killer would end the whole sweep.
    return {**row, 'status': 'out of memory',
            'error': f"needs {_bytes(memory['total'])} per device; the device has {_bytes(device_bytes)} "
                     f'({device_bytes_source})'}
  return _run(row, setup, compiled, to_global(host_batch, batch_sharding, setup.global_batch), steps, warmup,
              on_step)


def _run(row: dict, setup, compiled, batch, steps: int, warmup: int, on_step) -> dict:
  state = None
  try:
    state = engine.init_state(setup, 0)
    times = []
    for i in range(warmup + steps):
      start = time.perf_counter()
      state, metrics = compiled(state, batch)
      jax.block_until_ready(metrics)
      if i >= warmup:
        times.append(time.perf_counter() - start)
      if on_step:
        on_step(i + 1, warmup + steps)
  except Exception as e:
    if not is_out_of_memory(e):
      raise
    return {**row, 'status': 'out of memory', 'error': _first_line(e)}
  finally:
    del state
  median = statistics.median(times)
  devices = row['devices']
  hw = row.get('xla_flops_per_step_per_device')
  row.update({
      'step_seconds_median': median, 'step_seconds_min': min(times), 'step_seconds_max': max(times),
      'tokens_per_sec': row['tokens_per_step'] / median,
      'tokens_per_sec_per_device': row['tokens_per_step'] / median / devices,
      **flops.mfu_fields(1 / median, row['model_flops_per_step'], devices, row['peak_tflops']),
      'hfu': (hw / median / 1e12 / row['peak_tflops']) if hw else None,
      'live_peak_bytes': flops.peak_memory_in_use(),
  })
  return row


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return text[0][:300] if text else type(e).__name__


@dataclasses.dataclass(frozen=True)
class Target:
  """Compile-only devices of a TPU slice (`--topology`), the memory of each and the compiler that counts."""
  slice: topology.Slice
  devices: list
  compiler: str

  @property
  def memory_bytes(self) -> int:
    return self.slice.memory_bytes

  @property
  def memory_source(self) -> str:
    return f'TPU {self.slice.generation}: {_bytes(self.memory_bytes)} HBM per chip'


def tpu_target(tpu: topology.Slice, platform_env: dict, log: Callable[[str], None]) -> Target:
  """The slice's compile-only devices from libtpu; the experiment's LIBTPU_INIT_ARGS reach its compiler
  (libtpu reads them when it loads, here)."""
  version = topology.check_libtpu(log)
  for key, value in topology.libtpu_env(platform_env).items():
    os.environ[key] = (os.environ.get(key, '') + ' ' + value).strip()
    log(f"Set {key} for the TPU compiler (the experiment's PLATFORM_ENV).")
  devices = topology.compile_devices(tpu)
  return Target(tpu, devices, f'XLA:TPU ({version}, ahead of time for {tpu.describe()})')


def run_all(exp: Optional[str], overrides: list[str], sweeps: list[str], *, steps: int, warmup: int,
            compile_only: bool, peak_tflops: Optional[float], pgle: Optional[str] = None,
            pgle_profile: Optional[str] = None, progress=None, log: Callable[[str], None] = print,
            device_memory: Optional[int] = None, tpu: Optional[topology.Slice] = None) -> list[dict]:
  """Every sweep combination (and, with PGLE, each without and with it), one row each.

  PGLE here is the explicit workflow for both --pgle auto (into a temporary file) and
  --pgle-profile PATH: a few steps are profiled, then the step compiled with the profile.
  The first combination's PLATFORM_ENV is the caller's to apply, before jax starts a backend
  (paxcli.api.open_run). `tpu`: compile for that slice with the TPU's compiler (compile-only).
  """
  rows = []
  combos = sweep_combinations(sweeps)
  profiling.check_pgle(pgle, pgle_profile)
  if pgle == 'auto':
    jax.config.update('jax_enable_pgle', False)  # the rows without PGLE must be without it
    pgle_profile = os.path.join(tempfile.mkdtemp(prefix='paxcli-pgle-'), 'profile.pb')
  pgle_variants = [None, pgle_profile] if pgle_profile else [None]
  resolved_all = [check_combination(exp, overrides, combo, compile_only, log if i == 0 else (lambda m: None), tpu)
                  for i, combo in enumerate(combos)]  # the first's warnings stand for all
  target = tpu_target(tpu, resolved_all[0].experiment.PLATFORM_ENV, log) if tpu else None
  for combo, resolved in zip(combos, resolved_all):
    sets = [f'{k}={v}' for k, v in combo]
    for pgle in pgle_variants:
      label = ', '.join(sets) + (' [PGLE]' if pgle else '') or resolved.name
      total = 1 if compile_only else warmup + steps
      task = progress.add_task(label, total=total) if progress else None
      on_step = (lambda done, total, t=task: progress.update(t, completed=done)) if progress else None
      if pgle and not _exists(pgle):
        _record_pgle_profile(resolved, pgle, log)
      row = measure(resolved, steps, warmup, compile_only, peak_tflops, pgle, on_step, device_memory, target=target)
      row.update({'experiment': resolved.name, 'sweep': dict(combo)})
      rows.append(row)
      if progress:
        progress.update(task, completed=total)
  return rows


def check_combination(exp: Optional[str], overrides: list[str], combo: list, compile_only: bool, log,
                      tpu: Optional[topology.Slice] = None):
  """The resolved config of one sweep combination, or a UserError naming it: every combination is
  checked (knobs, allowed values, model settings, mesh, batch) before the first row runs, against
  the TPU slice `tpu` where one is planned for."""
  sets = [f'{k}={v}' for k, v in combo]
  where = f' (--sweep combination {", ".join(sets)})' if sets else ''
  try:
    resolved = config.resolve(exp, list(overrides) + sets)
    exp_obj = resolved.experiment
    unsupported = getattr(exp_obj, 'UNSUPPORTED_FEATURES', None) or {}
    if unsupported and compile_only:
      # A compile trains nothing: say what differs from the original, and compile paxcli's model.
      log('WARNING: ' + f'{type(exp_obj).__name__} needs features paxcli cannot honour ('
          + '; '.join(f'{k}: {v}' for k, v in unsupported.items())
          + '); compiling paxcli\'s closest model, whose memory and FLOPs differ from the original\'s.')
    else:
      platform.check_supported(exp_obj)
    task = engine.build_task(resolved.task)
    engine.validate_model(task.model)
    engine.validate_mesh(task.model, exp_obj.ICI_MESH_SHAPE, exp_obj.DCN_MESH_SHAPE)
    engine.validate_train(task.train)
    num_devices = tpu.num_devices if tpu else len(jax.devices())
    if tpu:
      topology.check_mesh(tpu, exp_obj.ICI_MESH_SHAPE, exp_obj.DCN_MESH_SHAPE)
    sharding.mesh_shape(exp_obj.ICI_MESH_SHAPE, exp_obj.DCN_MESH_SHAPE, num_devices)
    infeed.global_batch_size(exp_obj.PERCORE_BATCH_SIZE, num_devices)
  except UserError as e:
    raise UserError(f'{e}{where}') from None
  return resolved


def _exists(path: str) -> bool:
  return storage.exists(path)


def _record_pgle_profile(resolved, path: str, log) -> None:
  """Profiles a few steps with jax.profiler and writes their instruction latencies to `path`."""
  setup = engine.build(resolved)
  batch_sharding = sharding.batch_sharding(setup.mesh)
  step = make_train_step(setup, batch_sharding, 0)
  batch = to_global(infeed.build_input(resolved.train_dataset(), setup).get_next(), batch_sharding,
                    setup.global_batch)
  state = engine.init_state(setup, 0)
  first = profiling.PGLE_WARMUP_STEPS + 1
  profiler = profiling.StepProfiler('', log, None, path, 0)
  for i in range(1, first + profiling.PGLE_PROFILE_STEPS):
    profiler.before(i)
    state, metrics = step(state, batch)
    profiler.after(i, metrics)
  jax.block_until_ready(state)
  profiler.close()


# ---- Output ----------------------------------------------------------------------------------

def _bytes(v) -> str:
  if v is None:
    return '-'
  for unit, size in (('GiB', GIB), ('MiB', 1024 ** 2), ('KiB', 1024)):
    if v >= size:
      return f'{v / size:.3g} {unit}'
  return f'{v} B'


def _count(n: int) -> str:
  for unit, size in (('B', 1e9), ('M', 1e6), ('K', 1e3)):
    if n >= size:
      return f'{n / size:.3g}{unit}'
  return str(n)


def _pct(v) -> str:
  return '-' if v is None or (isinstance(v, float) and math.isnan(v)) else f'{v:.1%}'


def table(rows: list[dict], compile_only: bool):
  """A rich Table with one row per configuration."""
  keys = list(dict.fromkeys(k for r in rows for k in r.get('sweep', {})))
  title = f"{rows[0]['experiment']}: {rows[0]['devices']} x {rows[0]['device_kind']} ({rows[0]['platform']})"
  t = Table(title=title, caption=_caption(rows, compile_only), caption_justify='left')
  bubbles = any('pipeline_bubble' in r for r in rows)
  for k in keys + ['params', 'tokens/step', 'compile s'] + (['bubble'] if bubbles else []):
    t.add_column(k, justify='right')
  if not compile_only:
    for k in ('step ms median (min-max)', 'tokens/s', 'tokens/s/device', 'TFLOP/s/device', 'MFU', 'HFU'):
      t.add_column(k, justify='right')
  for k in ('memory/device: args, out, temp', 'total', 'of device', 'fits'):
    t.add_column(k, justify='right')
  if not compile_only:
    t.add_column('live peak', justify='right')
  t.add_column('status')
  for r in rows:
    cells = [str(r.get('sweep', {}).get(k, '')) for k in keys]
    cells += [_count(r['params']), f"{r['tokens_per_step']:,}",
              f"{r['compile_seconds']:.1f}" if 'compile_seconds' in r else '-']
    if bubbles:
      cells.append(_pct(r.get('pipeline_bubble')))
    if not compile_only:
      ok = 'step_seconds_median' in r
      cells += ([f"{r['step_seconds_median'] * 1e3:.1f} ({r['step_seconds_min'] * 1e3:.1f}-"
                 f"{r['step_seconds_max'] * 1e3:.1f})", f"{r['tokens_per_sec']:,.0f}",
                 f"{r['tokens_per_sec_per_device']:,.0f}", f"{r['model_tflops_per_device']:.3g}",
                 _pct(r['mfu']), _pct(r['hfu'])] if ok else ['-'] * 6)
    fits = r.get('fits')
    cells += [', '.join(_bytes(r.get(f'memory_{k}_bytes')) for k in ('argument', 'output', 'temp')),
              _bytes(r.get('memory_total_bytes')), _bytes(r.get('device_memory_bytes')),
              '-' if fits is None else ('yes' if fits else 'NO')]
    if not compile_only:
      cells.append(_bytes(r.get('live_peak_bytes')))
    cells.append(r['status'] + (' (PGLE)' if r.get('pgle') else ''))
    t.add_row(*cells)
  return t


def _caption(rows: list[dict], compile_only: bool) -> str:
  r = rows[0]
  lines = [f"mesh {r['mesh']}; device memory: {r['device_memory_source']}; memory and XLA FLOPs counted by "
           f"{r['compiler']}"]
  if r.get('pipeline'):
    lines.append(f"pipeline: {r['pipeline']} (MFU counts the model's FLOPs only: the bubble is lost time)")
  for row in rows:
    note = xla_log.remat_note(row)
    if note:
      label = ', '.join(f'{k}={v}' for k, v in row.get('sweep', {}).items())
      lines.append(note if len(rows) == 1 else f'{label}: {note}')
  if not compile_only:
    lines.append(f"MFU = model FLOPs (paxcli.perf.flops, causal attention halved) / step time / devices / peak; "
                 f"HFU uses XLA's cost analysis. Peak: {r['peak_source']}")
  return '\n'.join(lines)


def _number(text) -> Optional[float]:
  try:
    value = float(text)
  except (TypeError, ValueError):
    return None
  return value if math.isfinite(value) else None


def _wrap(label: str, width: int = 16) -> str:
  """A tick label on lines of about `width` characters, broken after '_' or ',' (never inside a word)."""
  lines, current = [], ''
  for part in re.findall(r'[^_,]*[_,]?', label):
    if current and len(current) + len(part) > width:
      lines.append(current)
      current = ''
    current += part
  return '\n'.join(lines + [current] if current else lines)


def plot_axes(rows: list[dict]) -> tuple[Optional[str], list[str]]:
  """(the knob on the x axis, the other swept knobs): the first knob whose values are all numbers
  (else the first knob, as categories); each combination of the others is one line."""
  keys = list(dict.fromkeys(k for r in rows for k in r.get('sweep', {})))
  if not keys:
    return None, []
  numeric = [k for k in keys if all(_number(r['sweep'].get(k)) is not None for r in rows)]
  x_key = numeric[0] if numeric else keys[0]
  return x_key, [k for k in keys if k != x_key]


def check_plot_path(path: str, force: bool = False) -> None:
  """Before any row runs: matplotlib is there and the PNG can be written (files.check_output)."""
  if importlib.util.find_spec('matplotlib') is None:   # optional: only --plot needs it
    raise UserError('--plot needs matplotlib: pip install matplotlib')
  files.check_output(path, '--plot', force=force)


def plot(rows: list[dict], path: str) -> None:
  """MFU and tokens/s (or, compile-only, memory per device) against the swept knob, one line per
  combination of the other knobs, in stacked panels (matplotlib, no display needed)."""
  try:
    import matplotlib
  except ImportError:
    raise UserError('--plot needs matplotlib: pip install matplotlib') from None
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  x_key, others = plot_axes(rows)
  numeric_x = x_key is not None and all(_number(r['sweep'].get(x_key)) is not None for r in rows)
  if x_key is None:
    categories = [r['experiment'] for r in rows]
  else:
    categories = list(dict.fromkeys(str(r['sweep'].get(x_key)) for r in rows))

  def x_of(r):
    if numeric_x:
      return _number(r['sweep'][x_key])
    return categories.index(str(r['sweep'].get(x_key)) if x_key else r['experiment'])

  timed = any(r.get('mfu') is not None for r in rows)
  panels = ([('MFU (%)', lambda r: 100 * r['mfu'] if r.get('mfu') is not None else None),
             ('tokens/s', lambda r: r.get('tokens_per_sec'))] if timed else
            [('memory per device (GiB)', lambda r: r['memory_total_bytes'] / GIB
              if r.get('memory_total_bytes') is not None else None)])
  groups: dict[str, list[dict]] = {}
  for r in rows:
    label = (str(r['sweep'].get(others[0])) if len(others) == 1 else  # the legend's title names the knob
             ', '.join(f'{k}={r["sweep"].get(k)}' for k in others) or None)
    groups.setdefault(label, []).append(r)
  fig, axes = plt.subplots(len(panels), 1, sharex=True, figsize=(7, 2.6 * len(panels) + 0.8), squeeze=False)
  for ax, (name, value) in zip(axes[:, 0], panels):
    for label, members in groups.items():
      members = sorted(members, key=x_of)
      points = [(x_of(r), value(r)) for r in members if value(r) is not None]
      style = 'o-' if numeric_x else 'o'  # categories are not joined by lines
      if points:
        ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
      for r in members:
        if value(r) is None and r['status'] not in ('ok', 'compiled'):
          ax.plot([x_of(r)], [0], 'x', color='tab:red')
          ax.annotate(r['status'], (x_of(r), 0), textcoords='offset points', xytext=(4, 4), fontsize=8,
                      color='tab:red')
    ax.set_ylabel(name)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
  if len(groups) > 1:
    axes[0, 0].legend(fontsize=8, title=', '.join(others), title_fontsize=8, loc='best')
  bottom = axes[-1, 0]
  if numeric_x:
    xs = sorted({x_of(r) for r in rows})
    bottom.set_xticks(xs)
    bottom.set_xticklabels([f'{x:g}' for x in xs])
    if len(xs) > 2 and xs[0] > 0 and xs[-1] / xs[0] >= 16:
      bottom.set_xscale('log', base=2)
      bottom.set_xticks(xs)
      bottom.set_xticklabels([f'{x:g}' for x in xs])
      bottom.minorticks_off()
  else:
    bottom.set_xticks(range(len(categories)))
    bottom.set_xticklabels([_wrap(c) for c in categories], fontsize=8)
    bottom.set_xlim(-0.5, len(categories) - 0.5)
  bottom.set_xlabel(x_key or 'experiment')
  r0 = rows[0]
  fig.suptitle(textwrap.fill(f"{r0['experiment']} on {r0['devices']} x {r0['device_kind']}", 70), fontsize=10)
  fig.tight_layout()
  png = io.BytesIO()
  try:
    fig.savefig(png, format='png', dpi=100)
  finally:
    plt.close(fig)
  files.write_output(path, png.getvalue(), 'the plot')
