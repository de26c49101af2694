"""Decoding speed: the KV cache against full recomputation, for the default model.

  .venv/bin/python benchmarks/decode.py [--prompt-len 64] [--new-tokens 256] [--batch-sizes 1,16]
                                        [--exp default.StdlibDocsLm] [--set K=V ...]

Greedy decoding of random prompts with fresh weights (speed does not depend on them).
"cached" is `paxcli.loops.decode.decoder.Decoder` (prefill, then one token per step reading the KV cache);
"recompute" re-runs the model on the whole prefix for every new token (the prefix padded
up to a multiple of 32 tokens, so that it compiles a few times rather than at every
length; compiles are excluded from both). MAX_SEQ_LEN is raised to prompt + new tokens.
Prints new tokens/s and the mean time of one step (the cached decoder runs its steps in one compiled
loop, so it reports the mean; recompute times its first and last steps).
Machines are shared and noisy: compare within one run.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import machine   # benchmarks/machine.py: the processor beside the table


def cached(decoder, prompts, new_tokens: int) -> dict:
  from paxcli.loops.decode.options import DecodeOptions
  opts = DecodeOptions(max_decode_steps=new_tokens, batch_size=len(prompts))
  decoder.run(prompts, opts)  # compile
  stats = {}
  start = time.perf_counter()
  records, stats = decoder.run(prompts, opts)
  elapsed = time.perf_counter() - start
  step_ms = 1e3 * stats['decode_s'] / max(1, new_tokens - 1)
  return {'tokens_per_sec': sum(r['num_decoded_tokens'] for r in records) / elapsed, 'first_ms': step_ms,
          'last_ms': step_ms}


def recompute(model, params, prompts, new_tokens: int, bucket: int = 32) -> dict:
  import jax
  import jax.numpy as jnp
  fwd = jax.jit(lambda p, x, n: jnp.argmax(model.apply({'params': p}, x)[:, n - 1], axis=-1))
  b, plen = len(prompts), len(prompts[0].ids)
  total = plen + new_tokens
  for length in range(bucket, total + bucket, bucket):  # compile every bucket first
    jax.block_until_ready(fwd(params, np.zeros((b, min(length, total)), np.int32), 1))
  ids = np.zeros((b, total), np.int32)
  ids[:, :plen] = [p.ids for p in prompts]
  times = []
  start = time.perf_counter()
  for t in range(new_tokens):
    n = plen + t
    width = min(-(-n // bucket) * bucket, total)
    ts = time.perf_counter()
    ids[:, n] = np.asarray(fwd(params, ids[:, :width], n))
    times.append(time.perf_counter() - ts)
  elapsed = time.perf_counter() - start
  return {'tokens_per_sec': b * new_tokens / elapsed, 'first_ms': 1e3 * float(np.median(times[:3])),
          'last_ms': 1e3 * float(np.median(times[-3:]))}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--exp', default='default.StdlibDocsLm')
  parser.add_argument('--prompt-len', type=int, default=64)
  parser.add_argument('--new-tokens', type=int, default=256)
  parser.add_argument('--batch-sizes', default='1,16')
  parser.add_argument('--set', action='append', default=[], dest='overrides')
  args = parser.parse_args()
  import jax
  from rich.console import Console
  from rich.table import Table

  from paxcli import config

  from paxcli.loops.decode.decoder import Decoder
  from paxcli.loops.decode.prompts import Prompt

  from paxcli.runtime import engine
  resolved = config.resolve(args.exp, args.overrides + [f'MAX_SEQ_LEN={args.prompt_len + args.new_tokens}'])
  setup = engine.build(resolved)
  params = engine.init_state(setup, 0)['params']
  decoder = Decoder(setup, params)
  table = Table(title=f'{args.exp}: greedy decoding, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, '
                      f'{len(jax.devices())} x {jax.devices()[0].device_kind}')
  for col in ('batch', 'method', 'new tokens/s', 'ms/step first', 'ms/step last', 'speed-up'):
    table.add_column(col, justify='left' if col == 'method' else 'right')
  rng = np.random.default_rng(0)
  vocab = decoder.vocab_size
  for b in [int(x) for x in args.batch_sizes.split(',')]:
    prompts = [Prompt(rng.integers(3, vocab, args.prompt_len).tolist()) for _ in range(b)]
    c = cached(decoder, prompts, args.new_tokens)
    r = recompute(decoder.model, params, prompts, args.new_tokens)
    for name, m in (('cached', c), ('recompute', r)):
      table.add_row(str(b), name, f"{m['tokens_per_sec']:,.1f}", f"{m['first_ms']:.1f}", f"{m['last_ms']:.1f}",
                    f"{m['tokens_per_sec'] / r['tokens_per_sec']:.1f}x")
  Console().print(table)
  Console().print(machine.describe())


if __name__ == '__main__':
  main()
