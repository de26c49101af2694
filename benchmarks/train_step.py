"""Train-step speed of the default experiment under model variants, measured in one run.

  .venv/bin/python benchmarks/train_step.py [--steps 20] [--exp default.StdlibDocsLm] [--set K=V ...]

Prints a table: compile seconds, steps/s, tokens/s, the ratio to the first row, and XLA's own
cost analysis of the compiled step (FLOPs and bytes accessed). Machines are shared and noisy:
compare the ratios within one run, not absolute numbers across runs. The XLA columns are not
noisy: a refactoring that changes no computation must leave them exactly equal.
"""

from __future__ import annotations

import argparse
import json
import time

import machine   # benchmarks/machine.py: the processor beside the table

VARIANTS = [
    ('baseline (loop, no remat, float32)', []),
    ('scan layers', ['USE_REPEATED_LAYER=True']),
    ("scan groups of LAYER_PATTERN ('a', 'b')", ['USE_REPEATED_LAYER=True', "LAYER_PATTERN=('a', 'b')"]),
    ('remat save_nothing', ['CHECKPOINT_POLICY=save_nothing']),
    ('remat save_dot_only', ['CHECKPOINT_POLICY=save_dot_only']),
    ('bfloat16 activations', ['FPROP_DTYPE=bfloat16']),
    ('einsum attention (reference)', ['ATTENTION_IMPL=einsum']),
]


def measure(exp: str, overrides: list[str], steps: int) -> dict:
  import jax

  from paxcli import config
  from paxcli.loops.train import ready_step
  from paxcli.runtime.sharding import to_global
  setup, state, step, batch_sharding, data = ready_step(config.resolve(exp, overrides))
  batch = to_global(data.get_next(), batch_sharding, setup.global_batch)  # one batch: input cost out of the way
  cost = step.lower(state, batch).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  start = time.perf_counter()
  state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  compile_s = time.perf_counter() - start
  start = time.perf_counter()
  for _ in range(steps):
    state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  elapsed = time.perf_counter() - start
  return {'compile_s': compile_s, 'steps_per_sec': steps / elapsed,
          'tokens_per_sec': steps * setup.global_batch * setup.seq_len / elapsed,
          'xla_flops': cost.get('flops', float('nan')), 'xla_bytes': cost.get('bytes accessed', float('nan'))}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--exp', default='default.StdlibDocsLm')
  parser.add_argument('--steps', type=int, default=20)
  parser.add_argument('--set', action='append', default=[], dest='overrides')
  parser.add_argument('--json', action='store_true', help='Print the rows as JSON instead of a table.')
  args = parser.parse_args()
  from rich.console import Console
  from rich.table import Table
  import jax
  table = Table(title=f'{args.exp}: train step on {len(jax.devices())} x {jax.devices()[0].device_kind}')
  for col in ('variant', 'compile s', 'steps/s', 'tokens/s', 'vs baseline', 'XLA FLOPs', 'XLA bytes'):
    table.add_column(col, justify='left' if col == 'variant' else 'right')
  base, rows = None, []
  for name, extra in VARIANTS:
    r = measure(args.exp, args.overrides + extra, args.steps)
    rows.append({'variant': name, **r})
    base = base or r['steps_per_sec']
    table.add_row(name, f"{r['compile_s']:.1f}", f"{r['steps_per_sec']:.2f}", f"{r['tokens_per_sec']:,.0f}",
                  f"{r['steps_per_sec'] / base:.2f}x", f"{r['xla_flops']:,.0f}", f"{r['xla_bytes']:,.0f}")
  if args.json:
    print(json.dumps(rows, indent=1))
  else:
    Console().print(table)
    Console().print(machine.describe())


if __name__ == '__main__':
  main()
