"""Scoring speed: requests/s of `pax score`'s Scorer at lm-evaluation-harness-like requests.

  .venv/bin/python benchmarks/score.py [--requests 256] [--context 32,200] [--continuation 1,8]
                                       [--batch-sizes 0,1,16] [--exp default.StdlibDocsLm] [--set K=V ...]

Random (context, continuation) token pairs, lengths drawn uniformly from the ranges given (a
multiple-choice task's shape: a few hundred tokens of context, a short answer), scored with fresh
weights (speed does not depend on them). Batch size 0 is `pax score`'s default (up to 64 rows and
4,096 tokens a batch, padded to power-of-two lengths). Each row is timed after a first run that
compiles every shape, so compile seconds are apart. Machines are shared and noisy: compare within
one run.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import machine   # benchmarks/machine.py: the processor beside the table


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--exp', default='default.StdlibDocsLm')
  parser.add_argument('--requests', type=int, default=256)
  parser.add_argument('--context', default='32,200', help='min,max context tokens')
  parser.add_argument('--continuation', default='1,8', help='min,max continuation tokens')
  parser.add_argument('--batch-sizes', default='0,1,16')
  parser.add_argument('--set', action='append', default=[], dest='overrides')
  args = parser.parse_args()
  import jax
  from rich.console import Console
  from rich.table import Table

  from paxcli import config
  from paxcli.loops.score.requests import Pair
  from paxcli.loops.score.scorer import Scorer
  from paxcli.runtime import engine

  resolved = config.resolve(args.exp, args.overrides)
  setup = engine.build(resolved)
  scorer = Scorer(setup, engine.init_state(setup, 0)['params'])
  rng = np.random.default_rng(0)
  (c0, c1), (k0, k1) = ([int(x) for x in r.split(',')] for r in (args.context, args.continuation))
  pairs = []
  for i in range(args.requests):
    n_ctx, n_cont = int(rng.integers(c0, c1 + 1)), int(rng.integers(k0, k1 + 1))
    tokens = rng.integers(3, scorer.vocab_size, n_ctx + n_cont).tolist()[-(scorer.max_seq_len + 1):]
    pairs.append(Pair(i, tokens, n_cont))
  table = Table(title=f'{args.exp}: {args.requests} requests, context {args.context}, continuation '
                      f'{args.continuation} tokens, {len(jax.devices())} x {jax.devices()[0].device_kind}')
  for col in ('batch size', 'requests/s', 'tokens/s', 'compile s'):
    table.add_column(col, justify='right')
  for b in [int(x) for x in args.batch_sizes.split(',')]:
    _, first = scorer.run(pairs, batch_size=b)  # compiles every shape
    start = time.perf_counter()
    _, stats = scorer.run(pairs, batch_size=b)
    elapsed = time.perf_counter() - start
    table.add_row(str(b) if b else '0 (default)', f'{args.requests / elapsed:,.1f}',
                  f"{stats['tokens'] / elapsed:,.0f}", f"{first['compile_s']:.1f}")
  Console().print(table)
  Console().print(machine.describe())


if __name__ == '__main__':
  main()
