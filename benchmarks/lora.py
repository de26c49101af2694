"""Full fine-tuning against LoRA: memory of params + optimizer state, and train-step time.

  .venv/bin/python benchmarks/lora.py [--steps 10] [--skip-memory] [--skip-time]

Memory: bench.Llama1B's train step compiled for one device without running it
(`jit(step).lower(...).compile().memory_analysis()`), beside the bytes of params and optimizer
state counted from the abstract state. Time: the same structure at a CPU size (--set below),
steps/s after one compile. LoRA adapts all projections (query, key, value, output, mlp). The
machine is shared: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import time

import machine   # benchmarks/machine.py: the processor beside the table

TARGETS = 'LORA_TARGETS=("query","key","value","output","mlp")'
VARIANTS = [
    ('full fine-tune', []),
    ('LoRA r=8', ['LORA_RANK=8', TARGETS]),
    ('LoRA r=64', ['LORA_RANK=64', TARGETS]),
    ('LoRA r=8, bf16 base', ['LORA_RANK=8', TARGETS, 'LORA_BASE_DTYPE="bfloat16"']),
]
# Llama1B's structure at a size a CPU steps through in about a second.
CPU_SIZE = ['NUM_LAYERS=4', 'MODEL_DIMS=512', 'HIDDEN_DIMS=1408', 'NUM_HEADS=8', 'DIMS_PER_HEAD=64',
            'VOCAB_SIZE=8192', 'MAX_SEQ_LEN=256', 'PERCORE_BATCH_SIZE=4']


def _bytes(tree) -> int:
  import jax
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def memory(overrides: list[str]) -> dict:
  """Bytes of params, optimizer state and the compiled step's buffers, nothing run."""
  import jax
  import numpy as np

  from paxcli import config
  from paxcli.loops.train import make_train_step
  from paxcli.runtime import engine, sharding
  setup = engine.build(config.resolve('bench.Llama1B', overrides))
  batch_sharding = sharding.batch_sharding(setup.mesh)
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding)
           for k, v in setup.model.dummy_batch(setup.global_batch, setup.seq_len).items()}
  t0 = time.perf_counter()
  compiled = make_train_step(setup, batch_sharding, 0).lower(setup.abstract_state, batch).compile()
  m = compiled.memory_analysis()
  trainable = engine.split_trainable(setup.model, setup.abstract_state['params'])[0]
  return {'params': _bytes(setup.abstract_state['params']), 'trainable': int(sum(np.prod(x.shape) for x in
                                                                                  jax.tree.leaves(trainable))),
          'opt_state': _bytes(setup.abstract_state['opt_state']), 'arguments': m.argument_size_in_bytes,
          'temp': m.temp_size_in_bytes, 'compile_s': time.perf_counter() - t0}


def step_time(overrides: list[str], steps: int) -> dict:
  import jax

  from paxcli import config
  from paxcli.loops.train import ready_step
  from paxcli.runtime.sharding import to_global
  setup, state, step, batch_sharding, data = ready_step(config.resolve('bench.Llama1B', CPU_SIZE + overrides))
  batch = to_global(data.get_next(), batch_sharding, setup.global_batch)
  state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  t0 = time.perf_counter()
  for _ in range(steps):
    state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  seconds = (time.perf_counter() - t0) / steps
  return {'step_s': seconds, 'tokens_per_s': setup.global_batch * setup.seq_len / seconds,
          'params': _bytes(state['params']), 'opt_state': _bytes(state['opt_state'])}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--skip-memory', action='store_true')
  parser.add_argument('--skip-time', action='store_true')
  args = parser.parse_args()
  from rich.console import Console
  from rich.table import Table
  gib = lambda n: f'{n / 2**30:.2f}'
  console = Console()
  if not args.skip_memory:
    table = Table(title='bench.Llama1B train step, compiled for 1 device (GiB; nothing run)')
    for col in ('variant', 'trainable params', 'params', 'opt state', 'params + opt', 'step arguments',
                'step temp', 'compile s'):
      table.add_column(col, justify='left' if col == 'variant' else 'right')
    for name, sets in VARIANTS:
      r = memory(sets)
      table.add_row(name, f"{r['trainable']:,}", gib(r['params']), gib(r['opt_state']),
                    gib(r['params'] + r['opt_state']), gib(r['arguments']), gib(r['temp']), f"{r['compile_s']:.0f}")
    console.print(table)
    console.print(machine.describe())
  if not args.skip_time:
    table = Table(title=f'Step time at a CPU size ({" ".join(CPU_SIZE)}), mean of {args.steps} steps')
    for col in ('variant', 'params MiB', 'opt state MiB', 's/step', 'tokens/s', 'vs full'):
      table.add_column(col, justify='left' if col == 'variant' else 'right')
    first = None
    for name, sets in VARIANTS:
      r = step_time(sets, args.steps)
      first = first or r['step_s']
      table.add_row(name, f"{r['params'] / 2**20:.1f}", f"{r['opt_state'] / 2**20:.1f}", f"{r['step_s']:.3f}",
                    f"{r['tokens_per_s']:,.0f}", f"{first / r['step_s']:.2f}x")
    console.print(table)
    console.print(machine.describe())


if __name__ == '__main__':
  main()
