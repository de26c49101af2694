"""Mixture-of-experts speed and memory, measured in one run (paxcli.layers.moe).

  .venv/bin/python benchmarks/moe.py [--steps 10] [--size cpu|1b] [--no-plans] [--json]

Table 1, train step: a dense Llama-style LM against the same LM with 8 experts, top-2, each expert
half the dense MLP's width (so that a token's active parameters are the dense model's, plus the
router), in both dispatch modes: dropless (sorted tokens, ragged_dot) and capacity-factor (GShard's
one-hot dispatch and combine einsums) at factors 1.25 and 2. Columns: compile seconds, steps/s,
tokens/s, the ratio to the dense row, total and active parameters, and the dropped share of token
choices in the measured steps. `--size cpu` (default) is 4 layers of 256 at sequence 128, batch 8;
`--size 1b` is bench.Llama1B's shape (about 1B active parameters; for a GPU).

Table 2, plans (skip with --no-plans): per-device memory of the real-size runs that
`pax bench mfu --compile-only` plans on fake CPU devices: bench.Mixtral8x7B on 64 devices and
bench.Qwen3Moe30BA3B on 16, against 80 GiB per device (each compile takes a minute or two).

Machines are shared and noisy: compare ratios within one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step import measure  # noqa: E402  (the same step timing as benchmarks/train_step.py)
import machine   # benchmarks/machine.py: the processor beside the table

SIZES = {
    # (experiment, overrides, dense hidden dims)
    'cpu': ('bench.LlamaTiny', ['NUM_LAYERS=4', 'MODEL_DIMS=256', 'NUM_HEADS=4', 'DIMS_PER_HEAD=64', 'MAX_SEQ_LEN=128',
                                'VOCAB_SIZE=2048', 'PERCORE_BATCH_SIZE=8', 'FPROP_DTYPE=float32'], 704),
    '1b': ('bench.Llama1B', [], 5632),
}
PLANS = [('bench.Mixtral8x7B', 64), ('bench.Qwen3Moe30BA3B', 16)]


def variants(dense_hidden: int) -> list[tuple[str, list[str]]]:
  moe = [f'HIDDEN_DIMS={dense_hidden // 2}', 'NUM_EXPERTS=8', 'EXPERTS_PER_TOKEN=2']
  return [
      (f'dense (MLP {dense_hidden})', [f'HIDDEN_DIMS={dense_hidden}']),
      (f'8 experts x {dense_hidden // 2}, top-2, dropless', moe + ["MOE_DISPATCH='dropless'"]),
      ('  capacity factor 1.25', moe + ["MOE_DISPATCH='capacity'", 'EXPERT_CAPACITY_FACTOR=1.25']),
      ('  capacity factor 2.0', moe + ["MOE_DISPATCH='capacity'", 'EXPERT_CAPACITY_FACTOR=2.0']),
  ]


def counts(exp: str, overrides: list[str]) -> tuple[int, int]:
  """(total, active) parameters, as `pax describe` counts them."""
  from paxcli import api
  summary = api.describe(exp, overrides=overrides)['summary']
  return summary['parameters'], summary.get('active_parameters') or summary['parameters']


def dropped(exp: str, overrides: list[str]) -> float:
  """The dropped share of token choices over 3 steps of a short training run (0 for dropless or dense)."""
  import io
  import tempfile

  from rich.console import Console

  import paxcli
  with tempfile.TemporaryDirectory() as job:
    result = paxcli.train(exp, overrides=overrides + ['NUM_TRAIN_STEPS=3', 'SUMMARY_INTERVAL_STEPS=3',
                                                      'SAVE_INTERVAL_STEPS=3', 'EVAL_INTERVAL_STEPS=0',
                                                      'DECODE_INTERVAL_STEPS=0'], job_dir=job,
                          console=Console(file=io.StringIO()))   # its log is not the table's
  return float(result.get('moe/dropped_fraction', 0.0)) if isinstance(result, dict) else float('nan')


def plan(exp: str, devices: int) -> dict:
  """`pax bench mfu --compile-only` of a real-size experiment on fake CPU devices, in its own process."""
  out = subprocess.run([sys.executable, '-m', 'paxcli.cli.app', 'bench', 'mfu', '--exp', exp, '--compile-only',
                        '--num-devices', str(devices), '--device-memory', '80GiB', '--json'],
                       capture_output=True, text=True, check=True)
  return json.loads(out.stdout)[0]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--size', choices=sorted(SIZES), default='cpu')
  parser.add_argument('--no-plans', action='store_true', help='Skip the real-size memory plans.')
  parser.add_argument('--json', action='store_true', help='Print the rows as JSON instead of tables.')
  args = parser.parse_args()
  from rich.console import Console
  from rich.table import Table
  import jax
  exp, base, dense_hidden = SIZES[args.size]
  steps = Table(title=f'{exp} ({args.size}): train step on {len(jax.devices())} x {jax.devices()[0].device_kind}')
  for col in ('variant', 'compile s', 'steps/s', 'tokens/s', 'vs dense', 'params', 'active', 'dropped'):
    steps.add_column(col, justify='left' if col == 'variant' else 'right')
  rows, dense = [], None
  for name, extra in variants(dense_hidden):
    overrides = base + extra
    r = measure(exp, overrides, args.steps)
    total, active = counts(exp, overrides)
    r.update(variant=name, params=total, active_params=active, dropped_fraction=dropped(exp, overrides))
    rows.append(r)
    dense = dense or r['steps_per_sec']
    steps.add_row(name, f"{r['compile_s']:.1f}", f"{r['steps_per_sec']:.2f}", f"{r['tokens_per_sec']:,.0f}",
                  f"{r['steps_per_sec'] / dense:.2f}x", f'{total:,}', f'{active:,}', f"{r['dropped_fraction']:.1%}")
  plans = []
  memory = Table(title='Planned real-size runs (pax bench mfu --compile-only), per device')
  for col in ('experiment', 'devices', 'mesh', 'params', 'args', 'temp', 'total', 'fits 80 GiB'):
    memory.add_column(col, justify='left' if col in ('experiment', 'mesh') else 'right')
  if not args.no_plans:
    for name, devices in PLANS:
      p = plan(name, devices)
      plans.append({'experiment': name, **p})
      gib = lambda key: f"{p.get(key, float('nan')) / 2**30:.1f} GiB"   # noqa: E731
      memory.add_row(name, str(devices), p['mesh'], f"{p['params'] / 1e9:.1f}B", gib('memory_argument_bytes'),
                     gib('memory_temp_bytes'), gib('memory_total_bytes'), 'yes' if p.get('fits') else 'NO')
  if args.json:
    print(json.dumps({'steps': rows, 'plans': plans}, indent=1))
    return
  console = Console(width=None if sys.stdout.isatty() else 160)
  console.print(steps)
  console.print(machine.describe())
  if plans:
    console.print(memory)
    console.print(machine.describe())


if __name__ == '__main__':
  main()
