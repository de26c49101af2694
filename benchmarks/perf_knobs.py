"""The throughput and memory knobs of #34 measured in one run, one table each:

  .venv/bin/python benchmarks/perf_knobs.py [accum] [loss] [fp8] [--exp E] [--set K=V ...] [--steps N] [--json]

  accum  GRAD_ACCUM_STEPS 1, 2, 4, 8 at a fixed global batch: step time, tokens/s (of the global batch),
         and XLA's per-device memory plan (what `pax bench mfu --compile-only` prints).
  loss   the LM loss alone, chunked (LOSS_CHUNK_TOKENS=2048) against whole logits, at vocab 32k
         and 256k for bench.Llama1B's 8 x 2,048 tokens per device: XLA's temporary memory for the loss's
         value and gradients (compile only), and the step time of both at a size this CPU runs
         (2 x 512 tokens); then the whole bench.Llama1B step and a 256k-vocabulary one, compile only,
         with LOSS_CHUNK_TOKENS=0 (before, the default) and 2048 (after).
  fp8    FP8 none / current / delayed: step time and memory plan. On a device without fp8 units the fp8
         rows are emulated (XLA converts to fp8 and back around float32 products): the column says so,
         and the ratio is the emulation's cost, not fp8's speed; on an H100 it is the real figure.

Default experiment: the built-in default.StdlibDocsLm (4 layers, d256, 16 x 128 tokens). Shared
machines are noisy: compare the ratios within one run, not absolute times across runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

import machine   # benchmarks/machine.py: the processor beside the table

LLAMA1B_TOKENS = (8, 2048)   # bench.Llama1B's rows x length per device
VOCABS = (32768, 262144)
CHUNK_TOKENS = 2048   # LOSS_CHUNK_TOKENS measured (the knob is off, 0, by default)


def _gib(n) -> str:
  return '-' if n is None else f'{n / 2 ** 30:,.2f} GiB' if n >= 2 ** 30 / 10 else f'{n / 2 ** 20:,.1f} MiB'


def _ms(seconds) -> str:
  return '-' if seconds is None else f'{seconds * 1e3:,.0f}'


def _row(exp: str, overrides: list[str], steps: int, compile_only: bool = False) -> dict:
  from paxcli import config
  from paxcli.loops import bench
  return bench.measure(config.resolve(exp, overrides), steps=steps, warmup=1, compile_only=compile_only,
                       emulated_fp8=True)


def accumulation(exp: str, overrides: list[str], steps: int) -> tuple[Table, list[dict]]:
  table = Table(title=f'Gradient accumulation at a fixed global batch: {exp}', caption_justify='left',
                caption='memory: XLA\'s per-device plan of the compiled step (temporaries: activations and '
                        'gradients in flight); tokens/s counts the global batch')
  for col in ('GRAD_ACCUM_STEPS', 'rows / microbatch', 'step ms', 'tokens/s', 'vs 1', 'temp memory', 'total memory'):
    table.add_column(col, justify='right')
  rows = []
  for n in (1, 2, 4, 8):
    r = _row(exp, overrides + [f'GRAD_ACCUM_STEPS={n}'], steps)
    r['grad_accum_steps'] = n
    rows.append(r)
    base = rows[0].get('step_seconds_median')
    time = r.get('step_seconds_median')
    table.add_row(str(n), str(r['global_batch'] // n), _ms(time), f"{r['tokens_per_sec']:,.0f}" if time else '-',
                  f'{time / base:.2f}x' if time and base else '-', _gib(r.get('memory_temp_bytes')),
                  _gib(r.get('memory_total_bytes')))
  return table, rows


def _loss_temp(vocab: int, rows: int, length: int, chunk_tokens: int, dims: int = 2048) -> int:
  """XLA's temporary bytes for the loss's value and gradients (features and head in bfloat16)."""
  import jax
  import jax.numpy as jnp

  from paxcli.models.losses import Head, head_lm_loss
  x = jax.ShapeDtypeStruct((rows, length, dims), jnp.bfloat16)
  head = Head(jax.ShapeDtypeStruct((vocab, dims), jnp.float32), None, tied=True, dtype=jnp.bfloat16,
              table_dtype=jnp.bfloat16)
  labels = jax.ShapeDtypeStruct((rows, length), jnp.int32)
  weights = jax.ShapeDtypeStruct((rows, length), jnp.float32)
  fn = jax.value_and_grad(lambda x, h, y, w: head_lm_loss(x, h, y, w, chunk_tokens)[0], argnums=(0, 1))
  return jax.jit(fn).lower(x, head, labels, weights).compile().memory_analysis().temp_size_in_bytes


def _loss_seconds(vocab: int, rows: int, length: int, chunk_tokens: int, steps: int, dims: int = 512) -> float:
  import statistics
  import time

  import jax
  import jax.numpy as jnp

  from paxcli.models.losses import Head, head_lm_loss
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (rows, length, dims), jnp.bfloat16)
  head = Head(jax.random.normal(keys[1], (vocab, dims)) * dims ** -0.5, None, tied=True, dtype=jnp.bfloat16,
              table_dtype=jnp.bfloat16)
  labels = jax.random.randint(keys[2], (rows, length), 0, vocab)
  weights = jnp.ones((rows, length))
  fn = jax.jit(jax.value_and_grad(lambda x, h: head_lm_loss(x, h, labels, weights, chunk_tokens)[0], argnums=(0, 1)))
  jax.block_until_ready(fn(x, head))
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(fn(x, head))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def loss_memory(steps: int, models: bool) -> tuple[list[Table], list[dict]]:
  default = CHUNK_TOKENS
  table = Table(title=f'The loss alone, whole logits vs chunked (LOSS_CHUNK_TOKENS={default})',
                caption_justify='left',
                caption='temp: XLA\'s temporaries for value + gradients at 8 x 2,048 tokens, d2048 (compile only); '
                        'ms: value + gradients at 2 x 512 tokens, d512, chunks of 256 tokens (32k), median')
  for col in ('vocab', 'temp whole', 'temp chunked', 'ratio', 'ms whole', 'ms chunked', 'time ratio'):
    table.add_column(col, justify='right')
  rows = []
  for vocab in VOCABS:
    whole, chunked = (_loss_temp(vocab, *LLAMA1B_TOKENS, c) for c in (0, default))
    small = min(default, 256)   # at 2 x 512 tokens the default would make one chunk: chunk as at full size
    t_whole, t_chunked = (_loss_seconds(vocab, 2, 512, c, steps) for c in (0, small))
    rows.append({'vocab': vocab, 'temp_whole_bytes': whole, 'temp_chunked_bytes': chunked,
                 'seconds_whole': t_whole, 'seconds_chunked': t_chunked})
    table.add_row(f'{vocab:,}', _gib(whole), _gib(chunked), f'{chunked / whole:.3f}', _ms(t_whole), _ms(t_chunked),
                  f'{t_chunked / t_whole:.2f}x')
  tables = [table]
  if models:
    model_table = Table(title='The whole train step, --compile-only on this host (1 device)', caption_justify='left',
                        caption='before: LOSS_CHUNK_TOKENS=0 (the logits whole, the default); after: 2048')
    for col in ('experiment', 'temp before', 'temp after', 'total before', 'total after'):
      model_table.add_column(col, justify='right')
    for name, extra in (('bench.Llama1B', []), ('bench.Llama1B, vocab 256k', ['VOCAB_SIZE=262144'])):
      before, after = (_row('bench.Llama1B', extra + [f'LOSS_CHUNK_TOKENS={c}'], 0, compile_only=True)
                       for c in (0, default))
      rows.append({'experiment': name, 'before': before, 'after': after})
      model_table.add_row(name, _gib(before.get('memory_temp_bytes')), _gib(after.get('memory_temp_bytes')),
                          _gib(before.get('memory_total_bytes')), _gib(after.get('memory_total_bytes')))
    tables.append(model_table)
  return tables, rows


def fp8_speed(exp: str, overrides: list[str], steps: int) -> tuple[Table, list[dict]]:
  import jax

  from paxcli.layers import fp8
  device = jax.devices()[0]
  emulated = not fp8.has_fp8_units(device)
  label = 'EMULATED (no fp8 units)' if emulated else 'fp8 units'
  table = Table(title=f'FP8 vs bf16 step time: {exp} on {device.device_kind}, {label}', caption_justify='left',
                caption=('emulated: XLA rounds to fp8 around wider products; the ratio is the cost of emulation, '
                         'not fp8\'s speed (goal on an H100: >= 1.3x bf16 tokens/s)') if emulated else '')
  for col in ('FP8', 'step ms', 'tokens/s', 'vs bf16', 'temp memory', 'fp8'):
    table.add_column(col, justify='right')
  rows = []
  for mode in ('none', 'current', 'delayed'):
    r = _row(exp, overrides + ['FPROP_DTYPE=bfloat16', f'FP8={mode}'], steps)
    r['fp8_mode'] = mode
    rows.append(r)
    base = rows[0]['step_seconds_median']
    table.add_row(mode if mode != 'none' else 'none (bf16)', _ms(r['step_seconds_median']),
                  f"{r['tokens_per_sec']:,.0f}", f"{base / r['step_seconds_median']:.2f}x tokens/s",
                  _gib(r.get('memory_temp_bytes')), 'emulated' if r['fp8_emulated'] else ('-' if mode == 'none'
                                                                                          else 'hardware'))
  return table, rows


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('parts', nargs='*', metavar='accum|loss|fp8', help='the tables to make (default: all)')
  parser.add_argument('--exp', default='default.StdlibDocsLm')
  parser.add_argument('--set', action='append', default=[], dest='overrides')
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--no-models', action='store_true', help='loss: skip the two bench.Llama1B compiles')
  parser.add_argument('--json', action='store_true', help='print the rows as JSON after the tables')
  args = parser.parse_args(argv)
  parts = args.parts or ['accum', 'loss', 'fp8']
  if set(parts) - {'accum', 'loss', 'fp8'}:
    parser.error(f'unknown table {sorted(set(parts) - {"accum", "loss", "fp8"})}: choose from accum, loss, fp8')
  console, out = Console(width=150), {}
  if 'accum' in parts:
    table, out['accum'] = accumulation(args.exp, args.overrides, args.steps)
    console.print(table)
    console.print(machine.describe())
  if 'loss' in parts:
    tables, out['loss'] = loss_memory(args.steps, not args.no_models)
    for table in tables:
      console.print(table)
      console.print(machine.describe())
  if 'fp8' in parts:
    table, out['fp8'] = fp8_speed(args.exp, args.overrides, args.steps)
    console.print(table)
    console.print(machine.describe())
  if args.json:
    json.dump(out, sys.stdout, default=str)
    print()


if __name__ == '__main__':
  main()
