"""The vector instructions XLA:CPU's matrix kernels run with here, as they see them.

XLA:CPU hands matrix products to YNNPACK, which picks its kernels at run time from CPUID: 64-column
tiles on AVX-512, 16-column tiles on AVX2 (XLA's --xla_cpu_max_isa does not restrict it). How a
product's weights are best laid out for decoding follows from that (paxcli.models.lm.decoding_params).
numpy reads CPUID the same way, so a process that hides AVX-512 from CPUID (benchmarks/cpuid_avx2.c)
is read as the AVX2 machine its kernels take it for; /proc/cpuinfo is the fallback.
"""

from __future__ import annotations

import functools

import numpy as np


@functools.cache
def vector_isa() -> str:
  """'avx512', 'avx2' or 'other' (not x86, or older than AVX2)."""
  features = _numpy_features()
  if features is None:
    features = _proc_flags()
  if features.get('AVX512F'):
    return 'avx512'
  if features.get('AVX2') and features.get('FMA3'):
    return 'avx2'
  return 'other'


def _numpy_features():
  """numpy's own CPUID reading (numpy 2: numpy._core, loaded with numpy); None where it is not there."""
  core = getattr(np, '_core', None) or getattr(np, 'core', None)
  features = getattr(getattr(core, '_multiarray_umath', None), '__cpu_features__', None)
  return dict(features) if features is not None else None


def _proc_flags() -> dict:
  try:
    with open('/proc/cpuinfo') as f:
      flags = next((line.split(':', 1)[1].split() for line in f if line.startswith('flags')), [])
  except OSError:
    flags = []
  return {'AVX512F': 'avx512f' in flags, 'AVX2': 'avx2' in flags, 'FMA3': 'fma' in flags}
