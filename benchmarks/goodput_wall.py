"""The goodput ledger's wall time against a clock outside `pax launch`.

  .venv/bin/python benchmarks/goodput_wall.py [--runs 3] [--steps 6] [--exp lm_cloud.LmCloudSpmdTest]

Each run is `pax launch -n 1 -- train` of a tiny model in a fresh job directory, timed from just
before the launcher is started to just after it has exited; `pax goodput --json` then gives the
ledger's wall time (from the launcher's process start, read from the kernel, to its last line, written
at its exit). The ledger's own consistency (its parts add up to the span its records cover) is a test
(tests/test_goodput.py); how much of the outside time it misses is measured here: the interpreter
start before the kernel's start time and the exit after the launcher's last line. A loaded machine
makes the exit slower (seconds at a load of 20), so compare runs within one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import machine   # benchmarks/machine.py: the processor beside the table

TINY = ['--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=32', '--set', 'HIDDEN_DIMS=64', '--set', 'NUM_HEADS=2',
        '--set', 'DIMS_PER_HEAD=16', '--set', 'VOCAB_SIZE=64', '--set', 'MAX_SEQ_LEN=16',
        '--set', 'PERCORE_BATCH_SIZE=1']


def one_run(exp: str, steps: int, work: str, index: int) -> dict:
  job = os.path.join(work, f'job{index}')
  cmd = [sys.executable, '-m', 'paxcli.cli.app', 'launch', '-n', '1', '--', 'train', '--exp', exp, *TINY,
         '--set', f'task.train.num_train_steps={steps}',
         '--set', f'task.train.save_interval_steps={max(steps // 2, 1)}',
         '--job-log-dir', job]
  began = time.time()
  done = subprocess.run(cmd, capture_output=True, text=True)
  outside = time.time() - began
  if done.returncode:
    raise SystemExit(f'{" ".join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}')
  got = subprocess.run([sys.executable, '-m', 'paxcli.cli.app', 'goodput', job, '--json'], capture_output=True,
                       text=True, check=True)
  account = json.loads(got.stdout)
  return {'outside': outside, 'ledger': account['wall_seconds'], 'startup': account['seconds']['startup'],
          'shutdown': account['seconds']['shutdown']}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--exp', default='lm_cloud.LmCloudSpmdTest')
  parser.add_argument('--runs', type=int, default=3)
  parser.add_argument('--steps', type=int, default=6)
  args = parser.parse_args()
  from rich.console import Console
  from rich.table import Table
  work = tempfile.mkdtemp(prefix='pax-goodput-wall-')
  try:
    rows = [one_run(args.exp, args.steps, work, i) for i in range(args.runs)]
  finally:
    shutil.rmtree(work, ignore_errors=True)
  load = os.getloadavg()[0] if hasattr(os, 'getloadavg') else float('nan')
  t = Table(title=f'Goodput ledger against an outside clock: pax launch -n 1 -- train {args.exp}, {args.steps} steps; '
                  f'{machine.processor()}, {os.cpu_count()} cores, load {load:.1f}')
  for col in ('run', 'outside s', 'ledger s', 'missed s', 'missed share', 'start-up s', 'shut-down s'):
    t.add_column(col, justify='right')
  for i, r in enumerate(rows, 1):
    missed = r['outside'] - r['ledger']
    t.add_row(str(i), f"{r['outside']:.2f}", f"{r['ledger']:.2f}", f'{missed:.2f}', f"{missed / r['outside']:.1%}",
              f"{r['startup']:.2f}", f"{r['shutdown']:.2f}")
  Console(width=160).print(t)
  Console(width=160).print(machine.describe())


if __name__ == '__main__':
  main()
