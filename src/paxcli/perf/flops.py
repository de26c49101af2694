"""Device peaks, MFU and compiled-program costs: where the MFU figures come from.

A model counts its own training FLOPs (`train_flops(seq_len)`, paxcli.models.flops.ModelFlops:
the count and what it leaves out are described there); this module divides them by time
and by the device's peak. MFU = model FLOPs per second per device / the device's peak.
HFU uses the FLOPs XLA reports for the compiled step (`compiled.cost_analysis()`), which
include rematerialisation and everything else the program computes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform as pyplatform
import statistics
import time
from typing import Optional

import jax
import jax.numpy as jnp

from paxcli import files
from paxcli.errors import UserError
from paxcli.inputs.corpus import cache_root
from paxcli.models.flops import ModelFlops, for_model, unknown_flops  # noqa: F401  (train and bench read them here)
from paxcli.runtime import platform
from paxcli.runtime.platform import device_memory_bytes  # noqa: F401  (bench reads it here)

# Dense peak TFLOP/s per device: (bf16, fp8 or None). Matched in order on the lower-cased
# `device_kind` (so 'tpu v5 lite' is tried before 'tpu v5').
PEAK_TFLOPS: list[tuple[str, str, float, Optional[float]]] = [
    # (substring of device_kind, name shown, bf16, fp8)
    ('tpu v4', 'TPU v4', 275.0, None),
    ('tpu v5 lite', 'TPU v5e', 197.0, None),
    ('tpu v5e', 'TPU v5e', 197.0, None),
    ('tpu v5p', 'TPU v5p', 459.0, None),
    ('tpu v5', 'TPU v5p', 459.0, None),
    ('tpu v6 lite', 'TPU v6e', 918.0, None),
    ('tpu v6e', 'TPU v6e', 918.0, None),
    ('a100', 'A100', 312.0, None),
    ('h100 pcie', 'H100 PCIe', 756.0, 1513.0),
    ('h100', 'H100 SXM', 989.0, 1979.0),
    ('gh200', 'H200', 989.0, 1979.0),
    ('h200', 'H200', 989.0, 1979.0),
    ('b200', 'B200', 2250.0, 4500.0),
]


@dataclasses.dataclass(frozen=True)
class Peak:
  tflops: float          # per device
  source: str            # where the figure comes from, for tables and logs
  measured: bool = False


def compute_dtype(model) -> str:
  """The activation dtype of a model, by name ('float32' when it does not say)."""
  return getattr(model, 'compute_dtype', None) or 'float32'


def mfu_fields(steps_per_sec: float, step_flops: float, num_devices: int, peak: Optional[float]) -> dict:
  """Model TFLOP/s per device and MFU (a fraction of `peak` TFLOP/s per device): the one MFU
  arithmetic, for the train loop's summaries and `pax bench mfu`'s rows."""
  tflops = step_flops * steps_per_sec / num_devices / 1e12
  return {'model_tflops_per_device': tflops, 'mfu': tflops / peak if peak else float('nan')}


def lookup_peak(device_kind: str, fp8: bool = False) -> Optional[Peak]:
  """The table's dense peak for a device kind, or None if it is not in the table."""
  kind = device_kind.lower()
  for pattern, name, bf16, fp8_peak in PEAK_TFLOPS:
    if pattern in kind:
      if fp8 and fp8_peak:
        return Peak(fp8_peak, f'{name} fp8 dense peak {fp8_peak:g} TFLOP/s (table)')
      return Peak(bf16, f'{name} bf16 dense peak {bf16:g} TFLOP/s (table)')
  return None


def device_peak(device=None, dtype: str = 'float32', override: Optional[float] = None,
                measure_size: int = 1024) -> Peak:
  """--peak-tflops if given, else the table by device_kind, else a measured matmul peak."""
  device = device or jax.devices()[0]
  if override:
    return Peak(float(override), f'{override:g} TFLOP/s (--peak-tflops)')
  found = lookup_peak(device.device_kind)
  if found:
    return found
  return measured_peak(dtype, len(jax.local_devices()), measure_size)


@functools.cache
def measured_peak(dtype: str = 'float32', shared_by: int = 1, size: int = 1024,
                  seconds: float = 0.6, trials: int = 12) -> Peak:
  """Peak of this host measured with a size x size matmul in `dtype`, per device.

  After a warm-up, `trials` short timings of a few matmuls each; the best is this run's figure (the
  trials that other processes slowed are the low ones) and their median its noise. A busy machine can
  slow every trial of one run, so the peak is the best any run on this machine has measured
  (PEAKS_FILE under the cache, keyed by the processor, its cores, the dtype and the size): MFU is then
  a share of one figure for the machine, and a busy run's MFU is lower because the run was slower, not
  because its peak was measured lower. Fake CPU devices share one host's cores, so the host's figure
  is divided among them.
  """
  device = jax.local_devices()[0]
  now, median = _matmul_rate(device, dtype, size, seconds, trials)
  best, runs = _remembered_best(_machine_key(device, dtype, size), now)
  per_device = best / max(shared_by, 1)
  where = f'{device.device_kind} ({jax.default_backend()})'
  share = f', shared by {shared_by} devices' if shared_by > 1 else ''
  return Peak(per_device, f'measured: {size}x{size} {dtype} matmul on {where}, the best of {runs} run(s) on this '
              f'machine {best:.3g} TFLOP/s (this run: best of {trials} trials {now:.3g}, median {median:.3g}; '
              f'kept in {_peaks_file()}){share} -> {per_device:.3g} per device', measured=True)


def _matmul_rate(device, dtype: str, size: int, seconds: float, trials: int) -> tuple[float, float]:
  """(best, median) TFLOP/s of `trials` timings of a size x size matmul on `device`."""
  a = jax.device_put(jnp.ones((size, size), dtype), device)
  matmul = jax.jit(lambda x, y: x @ y)
  jax.block_until_ready([matmul(a, a) for _ in range(2)])  # compile, then warm caches and threads
  rates = []
  for _ in range(trials):
    count, start = 0, time.perf_counter()
    while True:
      jax.block_until_ready([matmul(a, a) for _ in range(2)])
      count += 2
      elapsed = time.perf_counter() - start
      if elapsed >= seconds / trials:
        break
    rates.append(2.0 * size ** 3 * count / elapsed / 1e12)
  return max(rates), statistics.median(rates)


PEAKS_FILE = 'measured_peaks.json'


def _peaks_file() -> str:
  return os.path.join(cache_root(), PEAKS_FILE)   # the cache paxcli's tokenizers and corpus live in too


def _machine_key(device, dtype: str, size: int) -> str:
  """What a measured peak is a peak of: the backend and device, the host's processor and the cores this
  process may use, the dtype and the matrix size."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  return f'{jax.default_backend()}|{device.device_kind}|{_processor()}|{cores} cores|{dtype}|{size}'


def _processor() -> str:
  try:
    with open('/proc/cpuinfo', encoding='utf-8', errors='replace') as f:
      for line in f.read(1 << 20).splitlines():
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return pyplatform.processor() or pyplatform.machine()


def _remembered_best(key: str, now: float) -> tuple[float, int]:
  """(the best TFLOP/s measured for `key` so far, this run's included; how many runs measured it), kept in
  the peaks file. A cache that cannot be read or written costs the memory, never the run."""
  path = _peaks_file()
  try:
    known = files.read_json(path, 'measured peaks', 1 << 20) if os.path.exists(path) else {}
  except UserError:   # a damaged cache file: start it again
    known = {}
  entry = known.get(key) if isinstance(known, dict) else None
  if not (isinstance(entry, dict) and isinstance(entry.get('tflops'), (int, float)) and entry['tflops'] > 0
          and isinstance(entry.get('runs'), int)):
    entry = {'tflops': 0.0, 'runs': 0}
  entry = {'tflops': max(float(entry['tflops']), now), 'runs': entry['runs'] + 1}
  known = {**(known if isinstance(known, dict) else {}), key: entry}
  try:
    files.atomic_write(path, json.dumps(known, indent=1).encode())
  except OSError:
    pass
  return entry['tflops'], entry['runs']


def xla_flops(compiled) -> Optional[float]:
  """FLOPs of a compiled program per device, from XLA's cost analysis (None if absent)."""
  try:
    cost = compiled.cost_analysis()
  except Exception:  # some backends do not implement it
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if not cost or 'flops' not in cost:
    return None
  return float(cost['flops'])


def memory(compiled) -> Optional[dict]:
  """Per-device bytes of a compiled program: arguments, outputs, temporaries, aliased, total."""
  try:
    stats = compiled.memory_analysis()
  except Exception:
    return None
  if stats is None:
    return None
  out = {k: int(getattr(stats, f'{k}_size_in_bytes', 0) or 0)
         for k in ('argument', 'output', 'temp', 'alias', 'generated_code')}
  # Donated arguments alias outputs: count those bytes once.
  out['total'] = out['argument'] + out['output'] - out['alias'] + out['temp'] + out['generated_code']
  return out


def peak_memory_in_use(device=None) -> Optional[int]:
  device = device or jax.devices()[0]
  try:
    stats = device.memory_stats() or {}
  except Exception:
    return None
  value = stats.get('peak_bytes_in_use')
  return int(value) if value is not None else None


class CompileTimer:
  """Wall seconds JAX spends tracing, lowering and compiling, from jax.monitoring spans.

  Nested spans (a jitted function traced inside another) are merged, so each second
  counts once. Spans that end while `ignoring` is set (an eval, timed on its own) are
  dropped. `take()` returns the seconds since the last take.
  """

  EVENTS = ('/jax/core/compile/jaxpr_trace_duration', '/jax/core/compile/jaxpr_to_mlir_module_duration',
            '/jax/core/compile/backend_compile_duration')

  def __init__(self):
    self.spans: list[tuple[float, float]] = []
    self.ignoring = False
    self._registered = False

  def _on_span(self, event: str, start: float, end: float, **kwargs) -> None:
    del kwargs
    if event in self.EVENTS and not self.ignoring:
      self.spans.append((start, end))

  def __enter__(self):
    jax.monitoring.register_event_time_span_listener(self._on_span)
    self._registered = True
    return self

  def __exit__(self, *exc):
    if self._registered:
      try:
        jax.monitoring.unregister_event_time_span_listener(self._on_span)
      except (AssertionError, ValueError):
        pass
      self._registered = False
    return False

  def take(self) -> float:
    spans, self.spans = sorted(self.spans), []
    total, end = 0.0, float('-inf')
    for s, e in spans:
      if e <= end:
        continue
      total += e - max(s, end)
      end = e
    return total
