"""Sliding-window attention: what a window saves in training and in decoding.

  .venv/bin/python benchmarks/window.py [--length 8192] [--window 1024] [--heads 4] [--repeats 3]
                                        [--skip-attention] [--skip-decode]

1. Attention at sequence --length with window --window against full causal attention (batch 1,
   --heads heads x 64, float32): forward and forward + backward time (mean of --repeats after one
   compile) and the compiled function's temporary memory (memory_analysis). Rows: full attention
   (XLA's dot_product, what ATTENTION_IMPL=auto runs on a CPU), the window by masking the full L x L
   logits (XLA's local_window_size), and paxcli's blockwise window kernel (what auto runs for a window).
2. Decoding: the KV cache of a rolling window against a full one. Bytes of mistral.Mistral7B's cache
   (bfloat16, batch 1; shapes only, nothing allocated) at several text lengths, and the time of one
   decode step of a small model (2 layers x 256, window --window) after --length tokens, which reads
   every slot of the full cache and only the window's slots of the rolling one.

The machine may be shared: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import time

import machine   # benchmarks/machine.py: the processor beside the table


def _timed(fn, args, repeats: int) -> float:
  import jax
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  for _ in range(repeats):
    jax.block_until_ready(fn(*args))
  return (time.perf_counter() - t0) / repeats


def attention_rows(length: int, window: int, heads: int, repeats: int) -> list[dict]:
  import jax
  import jax.numpy as jnp

  from paxcli.layers import attention_ops
  kernels = [
      ('full causal (XLA dot_product)', lambda q, k, v: attention_ops.attention(q, k, v, None, 'auto')),
      (f'window {window}, masked L x L (XLA local_window_size)',
       lambda q, k, v: attention_ops.dot_product_attention(q, k, v, None, window=window)),
      (f'window {window}, blockwise (paxcli)', lambda q, k, v: attention_ops.attention(q, k, v, None, 'auto',
                                                                                          window=window)),
  ]
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (1, length, heads, 64), jnp.float32) for key in keys)
  rows = []
  for name, fn in kernels:
    forward = jax.jit(fn)
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2), argnums=(0, 1, 2)))
    row = {'kernel': name}
    for label, f in (('fwd', forward), ('fwd_bwd', grads)):
      row[label + '_temp'] = f.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
      row[label + '_s'] = _timed(f, (q, k, v), repeats)
    rows.append(row)
  return rows


def cache_bytes(window: int, length: int) -> int:
  """Bytes of mistral.Mistral7B's KV cache (bfloat16, batch 1) for `length` tokens; window 0: full attention."""
  import jax

  from paxcli import config
  from paxcli.layers.base import instantiate
  resolved = config.resolve('mistral.Mistral7B', [f'SLIDING_WINDOW={window}'])
  model = instantiate(resolved.task.model).with_fprop_dtype('bfloat16')
  ids = jax.ShapeDtypeStruct((1, 8), 'int32')
  params = jax.eval_shape(lambda r: model.init(r, ids)['params'], jax.random.key(0))
  cache = jax.eval_shape(lambda p: model.init_cache(p, 1, length), params)
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))


def decode_step(window: int, length: int, repeats: int) -> dict:
  """Seconds of one decode step (batch 1; the median) after `length` tokens, and the cache's bytes, of a small
  model whose step is mostly attention (2 layers x 256, 8 heads x 64)."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  from paxcli.layers.base import instantiate
  from paxcli.models import lm_config
  model = instantiate(lm_config(vocab_size=1024, num_layers=2, model_dims=256, hidden_dims=512, num_heads=8,
                                num_kv_heads=8, dims_per_head=64, max_seq_len=length + 1, norm_type='rmsnorm',
                                position_embedding='rotary', sliding_window=window))
  params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))['params']
  cache = jax.tree.map(jnp.asarray, nn.meta.unbox(model.init_cache(params, 1, length + 1)))
  step = jax.jit(model.extend, donate_argnums=1)   # the cache is updated in place, as a decode loop does
  # fill the cache: one prompt of `length` tokens
  ids = jax.random.randint(jax.random.key(1), (1, length), 0, 1024)
  _, cache = step(params, cache, ids, jnp.arange(length)[None])
  size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
  one, at = ids[:, :1], jnp.full((1, 1), length)
  logits, cache = step(params, cache, one, at)   # compiles the one-token step
  jax.block_until_ready(logits)
  times = []
  for _ in range(repeats):   # the same position again: the step's work, not the text's
    t0 = time.perf_counter()
    logits, cache = step(params, cache, one, at)
    jax.block_until_ready(logits)
    times.append(time.perf_counter() - t0)
  return {'s': sorted(times)[len(times) // 2], 'bytes': size}   # the median: a shared machine has outliers


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--length', type=int, default=8192)
  parser.add_argument('--window', type=int, default=1024)
  parser.add_argument('--heads', type=int, default=4)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--skip-attention', action='store_true')
  parser.add_argument('--skip-decode', action='store_true')
  args = parser.parse_args()
  import jax
  from rich.console import Console
  from rich.table import Table
  console = Console()
  mib = lambda n: f'{n / 2**20:,.0f}'
  console.print(f'{jax.devices()[0].device_kind}, {jax.device_count()} device(s); jax {jax.__version__}')
  if not args.skip_attention:
    rows = attention_rows(args.length, args.window, args.heads, args.repeats)
    table = Table(title=f'Attention, L = {args.length:,}, batch 1, {args.heads} heads x 64, float32 '
                        f'(mean of {args.repeats})')
    for col in ('kernel', 'fwd s', 'fwd temp MiB', 'fwd+bwd s', 'fwd+bwd temp MiB', 'fwd+bwd vs full'):
      table.add_column(col, justify='left' if col == 'kernel' else 'right')
    for r in rows:
      table.add_row(r['kernel'], f"{r['fwd_s']:.3f}", mib(r['fwd_temp']), f"{r['fwd_bwd_s']:.3f}",
                    mib(r['fwd_bwd_temp']), f"{rows[0]['fwd_bwd_s'] / r['fwd_bwd_s']:.2f}x")
    console.print(table)
    console.print(machine.describe())
  if not args.skip_decode:
    table = Table(title='KV cache of mistral.Mistral7B, bfloat16, batch 1 (MiB; shapes only)')
    for col in ('tokens', 'full cache', 'rolling, window 4096', 'ratio'):
      table.add_column(col, justify='right')
    for length in (8192, 32768, 131072):
      full, rolling = cache_bytes(0, length), cache_bytes(4096, length)
      table.add_row(f'{length:,}', mib(full), mib(rolling), f'{full / rolling:.0f}x')
    console.print(table)
    console.print(machine.describe())
    table = Table(title=f'One decode step after {args.length:,} tokens: 2 layers x 256, 8 heads x 64, float32, '
                        f'batch 1 (median of {max(args.repeats, 20)})')
    for col in ('cache', 'cache MiB', 'ms/step', 'vs full'):
      table.add_column(col, justify='left' if col == 'cache' else 'right')
    full = decode_step(0, args.length, max(args.repeats, 20))
    rolling = decode_step(args.window, args.length, max(args.repeats, 20))
    table.add_row('full', mib(full['bytes']), f"{full['s'] * 1e3:.2f}", '1.00x')
    table.add_row(f'rolling, window {args.window}', mib(rolling['bytes']), f"{rolling['s'] * 1e3:.2f}",
                  f"{full['s'] / rolling['s']:.2f}x")
    console.print(table)
    console.print(machine.describe())


if __name__ == '__main__':
  main()
