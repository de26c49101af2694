"""Per-process input throughput against train-step throughput: does input ever limit training?

  .venv/bin/python benchmarks/infeed.py [--exp default.StdlibDocsLm] [--hosts 1,2,4,8] [--steps 10]

For the experiment's training input (for the default experiment: the built-in corpus) and
the synthetic input with the same shapes, measures the batches/s one process reads when
it is host 0 of n infeed hosts (per-process batch = PERCORE_BATCH_SIZE x local devices,
global batch = n x that), and compares them with the train steps/s of the experiment on
this machine's devices. `headroom` = input batches/s / train steps/s: above 1, the input
keeps up. The last table trains with the real input in the loop (read, device put, step)
next to the same step on one pre-made batch.

Machines are shared and noisy: read the ratios, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import time

import machine   # benchmarks/machine.py: the processor beside the table


def input_rate(cfg, rows: int, hosts: int, seconds: float) -> float:
  """Batches/s of host 0 of `hosts` reading `rows` rows a batch (after 2 warm-up batches)."""
  from paxcli.runtime import infeed
  inp = infeed.build_input(cfg, process_batch=rows, num_hosts=hosts, host_index=0)
  for _ in range(2):
    inp.get_next()
  count, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    inp.get_next()
    count += 1
  return count / (time.perf_counter() - start)


def train_rates(resolved, steps: int) -> dict:
  """Steps/s of the jitted step on a pre-made batch, and fed by the input in the loop."""
  import jax

  from paxcli.runtime import engine
  from paxcli.runtime import infeed

  from paxcli.runtime import sharding
  from paxcli.loops.train import make_train_step
  from paxcli.runtime.sharding import to_global
  setup = engine.build(resolved)
  state = engine.init_state(setup, 0)
  batch_sharding = sharding.batch_sharding(setup.mesh)
  step = make_train_step(setup, batch_sharding, 0)
  data = infeed.build_input(resolved.train_dataset(), setup)
  batch = to_global(data.get_next(), batch_sharding, setup.global_batch)
  state, metrics = step(state, batch)  # compile
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for _ in range(steps):
    state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  compute = steps / (time.perf_counter() - start)
  start = time.perf_counter()
  for _ in range(steps):
    state, metrics = step(state, to_global(data.get_next(), batch_sharding, setup.global_batch))
  jax.block_until_ready(metrics)
  fed = steps / (time.perf_counter() - start)
  return {'setup': setup, 'compute': compute, 'fed': fed}


def synthetic_like(cfg):
  """The synthetic input with the shapes of `cfg` (a training input config)."""
  import fiddle as fdl

  from paxcli.inputs.synthetic import SyntheticLmInput
  return fdl.Config(SyntheticLmInput, name='train', is_training=True, seq_len=cfg.seq_len,
                    vocab_size=cfg.vocab_size, seed=cfg.seed)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--exp', default='default.StdlibDocsLm')
  parser.add_argument('--set', action='append', default=[], dest='overrides')
  parser.add_argument('--hosts', default='1,2,4,8', help='numbers of infeed hosts to simulate')
  parser.add_argument('--steps', type=int, default=10, help='timed train steps')
  parser.add_argument('--seconds', type=float, default=2.0, help='time per input measurement')
  args = parser.parse_args()
  import fiddle as fdl
  import jax
  from rich.console import Console
  from rich.table import Table

  from paxcli import config
  console = Console(width=120)
  resolved = config.resolve(args.exp, args.overrides)
  train = train_rates(resolved, args.steps)
  setup = train['setup']
  rows = setup.process_batch
  cfg = resolved.train_dataset()
  inputs = [(fdl.get_callable(cfg).__name__, cfg)]
  if fdl.get_callable(cfg).__name__ != 'SyntheticLmInput':
    inputs.append(('SyntheticLmInput', synthetic_like(cfg)))
  devices = f'{len(jax.devices())} x {jax.devices()[0].device_kind}'
  table = Table(title=f'{args.exp}: one process\'s input vs the train step',
                caption=f'{devices}; {rows} rows x {setup.seq_len} tokens per process and step; '
                        'headroom = input batches/s / train steps/s')
  for col in ('input', 'infeed hosts', 'global batch', 'input batches/s', 'train steps/s', 'headroom'):
    table.add_column(col, justify='left' if col == 'input' else 'right', no_wrap=True)
  for name, input_cfg in inputs:
    for hosts in [int(h) for h in args.hosts.split(',')]:
      rate = input_rate(input_cfg, rows, hosts, args.seconds)
      table.add_row(name, str(hosts), str(rows * hosts), f'{rate:,.1f}', f'{train["compute"]:.2f}',
                    f'{rate / train["compute"]:,.0f}x')
  console.print(table)
  console.print(machine.describe())
  fed = Table(title='Train loop with the input in it (this process, all its devices)')
  for col in ('step on one pre-made batch', 'step fed by the input', 'fed / pre-made'):
    fed.add_column(col, justify='right')
  fed.add_row(f'{train["compute"]:.2f} steps/s', f'{train["fed"]:.2f} steps/s',
              f'{train["fed"] / train["compute"]:.2f}')
  console.print(fed)
  console.print(machine.describe())


if __name__ == '__main__':
  main()
