"""What a failure costs, with and without the fast checkpoint tier, and what each tier's saves stall.

  .venv/bin/python benchmarks/goodput.py [--exp default.StdlibDocsLm] [--kill-at 23] [--local-every 5]
      [--save-every 40] [--processes 1] [--state-gib 0.5] [--no-llama]

1. Restarts, measured: `pax launch --max-restarts 1 -- train --exp EXP` is run twice, without and with
   the fast tier (LOCAL_CHECKPOINT_EVERY=--local-every beside SAVE_INTERVAL_STEPS=--save-every); the
   last process is killed (`kill -9`) when process 0 reports step --kill-at. Rows: the steps lost (the
   furthest step reached, from the heartbeat, less the step resumed from), the seconds from the kill to
   the restarted run's "Resumed" line and to its first step, and the restart's goodput figures.
2. Save stall and restore, measured: a state of about --state-gib GiB (an LM's params and Adam moments)
   saved four times to each tier exactly as the train loop's Saver does (finite check, checksums, the
   tier's save, the wait for the previous save), then restored from each.
3. bench.Llama1B on this CPU, compile-only: its train state's size (eval_shape, nothing allocated) and the
   compilation of its train step; its restore time per tier is the measured throughput of (2) times its
   size (an estimate, said so), and the kill-to-first-step is (1)'s start-up plus those.

The machine is shared and noisy: compare rows within one run. Both tiers write to this machine's disk
here; on a cluster the persistent tier is a network file system or a bucket, slower than this.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import machine   # benchmarks/machine.py: the processor beside the table


def restart_row(exp: str, fast: bool, args, work: str) -> dict:
  """One `pax launch --max-restarts 1` run with a kill at --kill-at; the figures of its restart."""
  job = os.path.join(work, f'job-{"fast" if fast else "persistent"}')
  sets = ['--set', f'task.train.num_train_steps={args.kill_at + 6}', '--set', 'task.train.summary_interval_steps=1',
          '--set', f'task.train.save_interval_steps={args.save_every}', *sum((['--set', s] for s in args.set), [])]
  if fast:
    sets += ['--set', f'LOCAL_CHECKPOINT_DIR={job}-local', '--set', f'LOCAL_CHECKPOINT_EVERY={args.local_every}']
  cmd = [sys.executable, '-m', 'paxcli.cli.app', 'launch', '-n', str(args.processes), '--grace', '2',
         '--max-restarts', '1', '--', 'train', '--exp', exp, *sets, '--job-log-dir', job]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  times, pids, killed = {}, {}, None
  for line in proc.stdout:
    now = time.monotonic()
    found = re.findall(r'p(\d+) pid (\d+)', line)
    if found and 'coordinator' in line:
      pids = {int(i): int(p) for i, p in found}
    step = re.match(r'\[p0\] step (\d+):', line)
    if killed is None and step and int(step.group(1)) >= args.kill_at:
      os.kill(pids[args.processes - 1], signal.SIGKILL)
      killed = now
    elif killed is not None and 'restart 1 of 1' in line:
      times['restarted'] = now - killed
    elif 'restarted' in times and 'Resumed from step' in line and 'resumed' not in times:
      times['resumed'] = now - killed
    elif 'restarted' in times and step and 'first' not in times:
      times['first'] = now - killed
  proc.wait()
  if proc.returncode:
    raise SystemExit(f'{" ".join(cmd)} failed ({proc.returncode})')
  from paxcli.jobdir import ledger
  account = ledger.summarize(job)
  (restart,) = account['restarts']
  second = ledger.read(job)[0][0][-1]
  return {'tier': 'fast + persistent' if fast else 'persistent only', 'reached': restart['reached_step'],
          'resumed': f"{restart['resumed_step']} ({restart['tier'] or 'a fresh start'})",
          'lost': restart['redone_steps'],
          'to_restart': times.get('restarted'), 'to_resumed': times.get('resumed'), 'to_first_step': times.get('first'),
          'gap': restart['gap_seconds'],
          'startup': second.closed.get('startup', 0.0), 'compile': second.closed.get('compile', 0.0),
          'goodput': account['goodput']}


def tier_rows(gib: float, work: str) -> tuple[list[dict], dict]:
  """Save stall and restore seconds of each tier for an LM state of about `gib` GiB on one process."""
  import jax
  from paxcli import config
  from paxcli.jobdir import checkpoint as ckpt
  from paxcli.jobdir import fast_tier, layout, restore
  from paxcli.loops import train
  from paxcli.runtime import engine
  dims, vocab = 1024, 8192
  per_layer = 4 * dims * dims + 2 * dims * 4 * dims
  layers = max(1, round((gib * (1 << 30) / 12 - 2 * vocab * dims) / per_layer))
  resolved = config.resolve('lm_cloud.LmCloudSpmdTest', [
      f'NUM_LAYERS={layers}', f'MODEL_DIMS={dims}', f'HIDDEN_DIMS={4 * dims}', 'NUM_HEADS=8', 'DIMS_PER_HEAD=128',
      f'VOCAB_SIZE={vocab}', 'MAX_SEQ_LEN=16', 'ICI_MESH_SHAPE=[1,1,1]'])
  setup = engine.build(resolved)
  state = engine.init_state(setup, 0)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  job = os.path.join(work, 'tiers')
  persistent = ckpt.Checkpointer(layout.checkpoints(job), max_to_keep=2)
  fast = fast_tier.open_tier(fast_tier.Settings(os.path.join(work, 'tiers-local'), 1, 2), job, 'bench', setup,
                             log=lambda m: None)
  train.params_finite(state['params'])
  restore.checksums(state)   # compiled before timing
  rows = []
  shapes = engine.shape_signature(setup.abstract_state)
  for name, tier in (('persistent', persistent), ('fast', fast)):
    stalls, checks, saves = [], [], []
    for step in range(1, 5):
      t = time.perf_counter()
      train.params_finite(state['params'])
      sums = restore.checksums(state)
      checked = time.perf_counter()
      tier.save(step, state, {'step': step, 'state_shapes': shapes, 'checksums': sums})
      done = time.perf_counter()
      stalls.append(done - t)
      checks.append(checked - t)
      saves.append(done - checked)
    t = time.perf_counter()
    tier.wait()
    write = time.perf_counter() - t
    t = time.perf_counter()
    got = (restore.restore(setup, job, 4) if name == 'persistent' else fast.restore(4, {})).state
    jax.block_until_ready(got)
    restored = time.perf_counter() - t
    del got
    rows.append({'tier': name, 'stall': sorted(stalls)[1:-1], 'checks': sorted(checks)[1:-1],
                 'save_call': sorted(saves)[1:-1], 'last_write': write, 'restore': restored,
                 'restore_gib_s': nbytes / (1 << 30) / restored})
  persistent.close()
  fast.close()
  return rows, {'bytes': nbytes, 'layers': layers}


def llama_figures() -> dict:
  """bench.Llama1B on this CPU, compile-only: the train state's bytes and the step's compilation."""
  import jax
  from paxcli import config
  from paxcli.loops import bench
  from paxcli.runtime import engine
  resolved = config.resolve('bench.Llama1B', [])
  setup = engine.build(resolved)
  nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(setup.abstract_state))
  row = bench.measure(resolved, compile_only=True)
  return {'bytes': nbytes, 'compile': row.get('compile_seconds'), 'status': row['status'],
          'save_interval': resolved.experiment.SAVE_INTERVAL_STEPS}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--exp', default='default.StdlibDocsLm')
  parser.add_argument('--set', action='append', default=[], help='more overrides for the restart runs')
  parser.add_argument('--kill-at', type=int, default=23)
  parser.add_argument('--local-every', type=int, default=5)
  parser.add_argument('--save-every', type=int, default=40)
  parser.add_argument('--processes', type=int, default=1)
  parser.add_argument('--state-gib', type=float, default=0.5)
  parser.add_argument('--no-llama', action='store_true', help='skip the Llama1B compile-only figures')
  args = parser.parse_args()
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  from rich.console import Console
  from rich.table import Table
  console = Console(width=200)
  work = tempfile.mkdtemp(prefix='pax-goodput-bench-')
  try:
    restarts = [restart_row(args.exp, fast, args, work) for fast in (False, True)]
    t = Table(title=f'A kill -9 at step {args.kill_at}: {args.exp}, {args.processes} process(es); persistent every '
                    f'{args.save_every} steps, fast tier every {args.local_every}')
    for col in ('checkpoints', 'reached', 'resumed from', 'steps lost', 'kill -> restart s', 'kill -> resumed s',
                'kill -> first step s', 'restart gap s', 'start-up s', 'compile s', 'goodput'):
      t.add_column(col, justify='left' if col in ('checkpoints', 'resumed from') else 'right')
    for r in restarts:
      t.add_row(r['tier'], str(r['reached']), r['resumed'], str(r['lost']), _s(r['to_restart']), _s(r['to_resumed']),
                _s(r['to_first_step']), _s(r['gap']), _s(r['startup']), _s(r['compile']), f"{r['goodput']:.1%}")
    console.print(t)
    console.print(machine.describe())
    tiers, size = tier_rows(args.state_gib, work)
    t = Table(title=f'Save stall and restore, {size["bytes"] / (1 << 30):.2f} GiB state (LM of {size["layers"]} '
                    'layers x 1024, Adam), one CPU process, both tiers on this disk')
    for col in ('tier', 'stall per save s (2 middle of 4)', 'of which finite check + checksums s',
                'of which the tier\'s save() s', 'last write s', 'restore s', 'restore GiB/s'):
      t.add_column(col, justify='left' if col == 'tier' else 'right')
    for r in tiers:
      t.add_row(r['tier'], *(' '.join(f'{x:.3f}' for x in r[k]) for k in ('stall', 'checks', 'save_call')),
                _s(r['last_write']), _s(r['restore']), f"{r['restore_gib_s']:.2f}")
    console.print(t)
    console.print(machine.describe())
    if not args.no_llama:
      llama = llama_figures()
      gib = llama['bytes'] / (1 << 30)
      fast_row = restarts[1]
      t = Table(title=f'bench.Llama1B on this CPU, compile-only: {gib:.1f} GiB of train state; train step '
                      f'compiled in {_s(llama["compile"])} s ({llama["status"]}); estimates from the rows above')
      for col in ('checkpoints', 'steps lost per failure', 'restore s (size / measured GiB/s)',
                  'kill -> first step s (start-up + restore + compile; the step itself not run)'):
        t.add_column(col, justify='left' if col == 'checkpoints' else 'right')
      base = (fast_row['gap'] or 0) + (fast_row['startup'] or 0) + (llama['compile'] or 0)
      for r, lost in zip(tiers, (f"<= {llama['save_interval']} (SAVE_INTERVAL_STEPS; {llama['save_interval'] // 2} "
                                 'on average)', f'<= {args.local_every} (+ a save in flight; '
                                 f'{args.local_every / 2:g} on average)')):
        restore_s = gib / r['restore_gib_s']
        t.add_row('persistent only' if r['tier'] == 'persistent' else 'fast + persistent', lost, f'{restore_s:.1f}',
                  f'{base + restore_s:.1f}')
      console.print(t)
      console.print(machine.describe())
    print(json.dumps({'restarts': restarts, 'tiers': tiers, 'state': size}, default=str))
  finally:
    shutil.rmtree(work, ignore_errors=True)


def _s(x) -> str:
  return '-' if x is None else f'{x:.2f}'


if __name__ == '__main__':
  main()
