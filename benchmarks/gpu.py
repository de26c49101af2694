"""The GPU table in one command: `make bench-gpu` (or .venv/bin/python benchmarks/gpu.py).

Needs an NVIDIA GPU and CUDA JAX (`.venv/bin/pip install -U "jax[cuda12]"`); without them it
stops with one line saying so. On the first GPU it prints:
  - bench.Llama1B at PERCORE_BATCH_SIZE 8 and 16 (`pax bench mfu`: step time, tokens/s, MFU, memory);
  - lm_cloud.LmCloudSpmd2B's shape on one device (its mesh set to [1, 1, 1]);
  - the seconds from launching `pax train --exp bench.Llama1B` to its first step (start-up,
    init and compilation: what a user waits for);
  - the async-save stall of that 1B run: a save every SAVE_EVERY steps, summaries every step;
    the stall is the time of the step after a save (which includes the loop's share of the
    save: the finite check, checksums, orbax's save() and any wait for the previous save)
    less the median time of the other steps.
Every figure comes from a `pax` process of its own, so each starts with the GPU to itself.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from rich.console import Console
from rich.table import Table

TRAIN_EXP = 'bench.Llama1B'
TRAIN_STEPS = 16
SAVE_EVERY = 5
PAX = [sys.executable, '-m', 'paxcli.cli.app']


def device() -> str:
  """'NVIDIA H100 80GB HBM3' for the first GPU; exits in one line when jax has no GPU."""
  probe = 'import jax; d = jax.devices()[0]; print(jax.default_backend(), d.device_kind, sep="|")'
  done = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True)
  backend, _, kind = done.stdout.strip().rpartition('\n')[-1].partition('|')
  if done.returncode or backend not in ('gpu', 'cuda', 'rocm'):
    found = f'{backend} ({kind})' if backend else f'nothing ({done.stderr.strip().splitlines()[-1:]})'
    sys.exit(f'make bench-gpu needs an NVIDIA GPU with CUDA JAX; jax here runs on {found}. On a GPU machine: '
             '.venv/bin/pip install -U "jax[cuda12]", then make bench-gpu.')
  return kind


def mfu_rows(exp: str, *args: str) -> list[dict]:
  done = subprocess.run([*PAX, 'bench', 'mfu', '--exp', exp, '--json', *args], capture_output=True, text=True)
  if done.returncode:
    sys.exit(f'pax bench mfu --exp {exp} {" ".join(args)} failed:\n{done.stderr[-3000:]}')
  return json.loads(done.stdout)


def train_run(job_dir: str) -> dict:
  """Launch-to-first-step seconds and the save stall of a short bench.Llama1B run."""
  cmd = [*PAX, 'train', '--exp', TRAIN_EXP, '--job-log-dir', job_dir, '--set', f'NUM_TRAIN_STEPS={TRAIN_STEPS}',
         '--set', f'SAVE_INTERVAL_STEPS={SAVE_EVERY}', '--set', 'SUMMARY_INTERVAL_STEPS=1']
  start = time.perf_counter()
  first_step, lines = None, []
  with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
    for line in proc.stdout:
      lines.append(line)
      if first_step is None and re.match(r'step \d+:', line):
        first_step = time.perf_counter() - start
  if proc.returncode or first_step is None:
    sys.exit(f'{" ".join(cmd)} failed:\n{"".join(lines)[-3000:]}')
  with open(os.path.join(job_dir, 'train_metrics.jsonl')) as f:
    seconds = {r['step']: 1 / r['steps_per_sec'] for r in map(json.loads, f)}
  after_save = [s for s in seconds if s > SAVE_EVERY and (s - 1) % SAVE_EVERY == 0]
  steady = statistics.median(t for s, t in seconds.items() if s > 2 and s not in after_save)
  return {'first_step_seconds': first_step, 'step_seconds': steady,
          'stalls': [seconds[s] - steady for s in after_save]}


def main() -> None:
  kind = device()
  table = Table(title=f'paxcli on one {kind}', caption_justify='left',
                caption='MFU: model FLOPs (paxcli.perf.flops) / step time / peak; memory: XLA\'s per-device plan')
  for col in ('what', 'step ms', 'tokens/s', 'MFU', 'memory', 'status / figure'):
    table.add_column(col, justify='right')
  for r in mfu_rows('bench.Llama1B', '--sweep', 'PERCORE_BATCH_SIZE=8,16') + mfu_rows(
      'lm_cloud.LmCloudSpmd2B', '--set', 'ICI_MESH_SHAPE=[1,1,1]'):
    ok = 'step_seconds_median' in r
    what = r['experiment'] + (f" batch {r['sweep']['PERCORE_BATCH_SIZE']}" if r.get('sweep') else ' on 1 device')
    table.add_row(what, f"{r['step_seconds_median'] * 1e3:.0f}" if ok else '-',
                  f"{r['tokens_per_sec']:,.0f}" if ok else '-', f"{r['mfu']:.1%}" if ok else '-',
                  f"{r.get('memory_total_bytes', 0) / 2 ** 30:.1f} GiB", r['status'])
  job_dir = tempfile.mkdtemp(prefix='paxcli-bench-gpu-')
  try:
    run = train_run(job_dir)
  finally:
    shutil.rmtree(job_dir, ignore_errors=True)
  table.add_row('pax train bench.Llama1B: launch to first step', '-', '-', '-', '-',
                f"{run['first_step_seconds']:.1f} s")
  stalls = ', '.join(f'{s:.2f}' for s in run['stalls'])
  table.add_row(f'async-save stall per save (every {SAVE_EVERY} steps)', f"{run['step_seconds'] * 1e3:.0f}", '-', '-',
                '-', f'{stalls} s')
  Console(width=160).print(table)


if __name__ == '__main__':
  main()
