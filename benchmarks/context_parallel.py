"""Context parallelism: step time and temporary memory per device against the sequence length.

  .venv/bin/python benchmarks/context_parallel.py [--lengths 8192,16384,32768] [--contexts 1,2,4,8]
                                                  [--strategies ring,all_gather] [--repeats 1] [--warmup 1]
                                                  [--compile-only] [--wide] [--json FILE]

One train step (forward, backward, AdamW update) of a small Llama-style model (2 layers x 64, 8 heads x 8,
8 KV heads, gated SiLU FFN 128, vocab 256, float32, scanned layers rematerialised with save_nothing) on one
sequence of L tokens a step, on the 8 fake CPU devices of this host (XLA_FLAGS is set here): the mesh is
context c x mdl 8/c (`[1, 1, 1, 1, c, 8/c]`), so that every row is one sequence on all 8 devices. Context 1
is the plan without context parallelism: tensor parallelism over the 8 heads with the flash kernel
(ATTENTION_IMPL='flash'; XLA's dot_product would make 8 x L x L logits). Context 2, 4, 8 by ring and by
all-gather, load-balanced. Each row: the compiled step's temporary memory per device (XLA's memory_analysis),
and the step's seconds (the median of --repeats after --warmup untimed steps).

--compile-only --wide plans a wider model (1024 wide, 8 heads x 128) whose activations, not the kernel's blocks
of logits, take the memory, without running it.

The 8 fake devices share this host's cores: a step's time is the whole mesh's work on them, so compare rows
of one run; memory per device is what the split saves.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import machine   # benchmarks/machine.py: the processor beside the table

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

EXP = 'paxcli.models.LmExperiment'
MODEL = ['NUM_LAYERS=2', 'MODEL_DIMS=64', 'HIDDEN_DIMS=128', 'NUM_HEADS=8', 'NUM_KV_HEADS=8', 'DIMS_PER_HEAD=8',
         'VOCAB_SIZE=256', 'USE_REPEATED_LAYER=True', "CHECKPOINT_POLICY='save_nothing'", "ATTENTION_IMPL='flash'",
         "ACTIVATION='silu'", 'USE_GATED_ACTIVATION=True', "NORM_TYPE='rmsnorm'", "POSITION_EMBEDDING='rotary'",
         "OPTIMIZER='adamw'", 'PERCORE_BATCH_SIZE=0.125']
MODEL_TEXT = ('2 layers x 64, 8 heads x 8 (8 KV), gated SiLU FFN 128, vocab 256, float32, rematerialised '
              '(save_nothing), AdamW; batch 1 sequence')
# --wide (with --compile-only): activations, not the kernel's blocks, take the memory, as in a real model
WIDE = ['MODEL_DIMS=1024', 'HIDDEN_DIMS=2816', 'DIMS_PER_HEAD=128']
WIDE_TEXT = '2 layers x 1024, 8 heads x 128 (8 KV), gated SiLU FFN 2816, vocab 256, float32, save_nothing, AdamW'


def one(length: int, context: int, strategy: str, repeats: int, warmup: int = 1, wide: bool = False,
        compile_only: bool = False) -> dict:
  """Temp memory per device and step seconds (None with compile_only) of one layout."""
  import jax

  from paxcli import config
  from paxcli.loops.train import make_train_step
  from paxcli.runtime import engine, sharding
  knobs = MODEL + (WIDE if wide else []) + [f'MAX_SEQ_LEN={length}', f'ICI_MESH_SHAPE=[1,1,1,1,{context},{8 // context}]',
                   f'CONTEXT_PARALLEL_STRATEGY={strategy!r}']
  setup = engine.build(config.resolve(EXP, knobs))
  state = engine.init_state(setup, 0)
  rng = jax.random.key(1)
  ids = jax.random.randint(rng, (1, length), 0, 256)
  batch = {'ids': ids, 'labels': ids, 'weights': jax.numpy.ones((1, length), 'float32')}
  batch = sharding.to_global(jax.device_get(batch), sharding.batch_sharding(setup.mesh), setup.global_batch)
  step = make_train_step(setup, sharding.batch_sharding(setup.mesh), 0)
  t0 = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  compile_s = time.perf_counter() - t0
  temp = compiled.memory_analysis().temp_size_in_bytes
  row = {'length': length, 'context': context, 'strategy': strategy if context > 1 else 'none (mdl 8)',
         'temp_bytes': temp, 'step_s': None, 'compile_s': compile_s}
  if compile_only:
    return row
  for _ in range(warmup):
    state, _ = compiled(state, batch)
    jax.block_until_ready(state)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    state, _ = compiled(state, batch)
    jax.block_until_ready(state)
    times.append(time.perf_counter() - t0)
  return {**row, 'step_s': sorted(times)[len(times) // 2]}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--lengths', default='8192,16384,32768')
  parser.add_argument('--contexts', default='1,2,4,8')
  parser.add_argument('--repeats', type=int, default=1)
  parser.add_argument('--warmup', type=int, default=1, help='untimed steps after the compile')
  parser.add_argument('--strategies', default='ring,all_gather')
  parser.add_argument('--json', default=None, help='also write the rows to this file')
  parser.add_argument('--compile-only', action='store_true', help='memory plans only, no step run')
  parser.add_argument('--wide', action='store_true', help=f'the wider model: {WIDE_TEXT}')
  args = parser.parse_args()
  import jax
  from rich.console import Console
  from rich.table import Table
  console = Console()
  console.print(f'{machine.describe()}; {jax.device_count()} fake {jax.devices()[0].platform} devices; '
                f'jax {jax.__version__}')
  rows = []
  for length in (int(x) for x in args.lengths.split(',')):
    for context in (int(x) for x in args.contexts.split(',')):
      for strategy in (args.strategies.split(',') if context > 1 else ('ring',)):
        rows.append(one(length, context, strategy, args.repeats, args.warmup, args.wide, args.compile_only))
        console.print(rows[-1])
  table = Table(title=f'One train step, {WIDE_TEXT if args.wide else MODEL_TEXT}, on 8 fake devices as context c '
                      f'x mdl 8/c' + (' (compile only)' if args.compile_only else ''))
  for col in ('L', 'context', 'attention', 'temp MiB / device', 'vs context 1', 'step s', 'compile s'):
    table.add_column(col, justify='left' if col == 'attention' else 'right')
  for r in rows:
    base = next(b for b in rows if b['length'] == r['length'] and b['context'] == min(
        x['context'] for x in rows if x['length'] == r['length']))
    table.add_row(f"{r['length']:,}", str(r['context']), r['strategy'], f"{r['temp_bytes'] / 2**20:,.1f}",
                  f"{r['temp_bytes'] / base['temp_bytes']:.2f}",
                  '-' if r['step_s'] is None else f"{r['step_s']:.2f}", f"{r['compile_s']:.1f}")
  console.print(table)
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(rows, f, indent=1)


if __name__ == '__main__':
  main()
