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

import machine   # benchmarks/machine.py: the processor beside the table
import steps     # benchmarks/steps.py: a step's plan and time

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


def memory(overrides: list[str]) -> dict:
  """Bytes of params, optimizer state and the compiled step's buffers, nothing run."""
  import jax
  import numpy as np

  from paxcli.runtime import engine
  setup, m, compile_s = steps.plan('bench.Llama1B', overrides)
  trainable = engine.split_trainable(setup.model, setup.abstract_state['params'])[0]
  return {'params': steps.nbytes(setup.abstract_state['params']),
          'trainable': int(sum(np.prod(x.shape) for x in jax.tree.leaves(trainable))),
          'opt_state': steps.nbytes(setup.abstract_state['opt_state']), 'arguments': m.argument_size_in_bytes,
          'temp': m.temp_size_in_bytes, 'compile_s': compile_s}


def step_time(overrides: list[str], count: int) -> dict:
  setup, state, seconds = steps.timed('bench.Llama1B', CPU_SIZE + overrides, count)
  return {'step_s': seconds, 'tokens_per_s': setup.global_batch * setup.seq_len / seconds,
          'params': steps.nbytes(state['params']), 'opt_state': steps.nbytes(state['opt_state'])}


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
