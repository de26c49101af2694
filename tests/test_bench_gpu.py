"""`make bench-gpu` (benchmarks/gpu.py) on a machine without a GPU: one line saying what it needs."""

import os
import subprocess
import sys

from conftest import REPO


def test_bench_gpu_without_a_gpu_stops_in_one_line():
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  done = subprocess.run([sys.executable, str(REPO / 'benchmarks' / 'gpu.py')], capture_output=True, text=True,
                        env=env, timeout=300)
  assert done.returncode != 0 and done.stdout == ''
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and 'Traceback' not in done.stderr
  assert 'needs an NVIDIA GPU' in lines[0] and 'runs on cpu' in lines[0] and 'jax[cuda12]' in lines[0]
