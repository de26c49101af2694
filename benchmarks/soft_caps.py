"""Soft caps at full speed (#27 item 4): a Gemma-2-shaped training step with and without its caps, in one run.

  .venv/bin/python benchmarks/soft_caps.py [--rounds 5] [--seq 1024] [--set K=V ...]

The model is Gemma 2's layer (paxcli.models.gemma presets: four (1 + w) norms, gated tanh-GELU, sqrt(d)
embeddings, local layers of window seq/2 alternating with global ones: Gemma-2's 4096 of 8192) at a
CPU size. Rows:
  no caps                 ATTEN_LOGIT_CAP=0, SOFTMAX_CAP_LOGITS=0: the baseline (global layers on
                          jax.nn.dot_product_attention, XLA's on a CPU)
  no caps, blockwise      the same on the blockwise kernel: what the caps themselves cost is the
                          next row against this one
  caps 50 / 30            Gemma 2's caps as paxcli runs them: attention capped in the blockwise kernel
                          (global layers) and the window kernel (local ones); the final cap inside
                          the loss, whose logits are made a chunk at a time (paxcli.models.losses)
  caps, einsum attention  the same caps on the float32 einsum reference, materialising L x L logits
                          (what a capped model ran on before)
Goal: 'caps 50 / 30' within 10% of 'no caps'.

Every variant is compiled first; then each round times one step of every variant in turn, and the table
shows the median of the rounds: a shared machine's load then falls on all variants alike. Still, compare
ratios within one run, not numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import machine   # benchmarks/machine.py: the processor beside the table

VARIANTS = [
    ('no caps', ['ATTEN_LOGIT_CAP=0.0', 'SOFTMAX_CAP_LOGITS=0.0']),
    ('no caps, blockwise attention', ['ATTEN_LOGIT_CAP=0.0', 'SOFTMAX_CAP_LOGITS=0.0', 'ATTENTION_IMPL=blockwise']),
    ('caps 50 / 30', []),
    ('caps, einsum attention', ['ATTENTION_IMPL=einsum']),
]


def gemma2_shape(seq: int) -> list[str]:
  from paxcli.models.gemma import GEMMA2
  knobs = {**GEMMA2.knobs, 'LAYER_KINDS': {'local': {'SLIDING_WINDOW': seq // 2}}}
  sizes = {'NUM_LAYERS': 4, 'MODEL_DIMS': 256, 'HIDDEN_DIMS': 1024, 'NUM_HEADS': 4, 'NUM_KV_HEADS': 2,
           'DIMS_PER_HEAD': 64, 'QUERY_PRE_ATTN_SCALAR': 64.0, 'MAX_SEQ_LEN': seq, 'PERCORE_BATCH_SIZE': 1,
           'VOCAB_SIZE': 2048}
  return [f'{k}={v!r}' for k, v in {**knobs, **sizes}.items()]


def compiled(exp: str, overrides: list[str]):
  """(run one step and wait: seconds, tokens a step, XLA's FLOPs) of the experiment's train step."""
  import jax

  from paxcli import config
  from paxcli.loops.train import ready_step
  from paxcli.runtime.sharding import to_global
  setup, state, step, batch_sharding, data = ready_step(config.resolve(exp, overrides))
  batch = to_global(data.get_next(), batch_sharding, setup.global_batch)
  cost = step.lower(state, batch).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  held = {'state': state}

  def run() -> float:
    start = time.perf_counter()
    held['state'], metrics = step(held['state'], batch)
    jax.block_until_ready(metrics)
    return time.perf_counter() - start
  return run, setup.global_batch * setup.seq_len, cost.get('flops', float('nan'))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--exp', default='default.StdlibDocsLm')
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--seq', type=int, default=1024)
  parser.add_argument('--set', action='append', default=[], dest='overrides')
  parser.add_argument('--json', action='store_true', help='Print the rows as JSON instead of a table.')
  args = parser.parse_args()
  import jax
  from rich.console import Console
  from rich.table import Table
  steps = []
  for name, extra in VARIANTS:
    run, tokens, flops = compiled(args.exp, gemma2_shape(args.seq) + args.overrides + extra)
    steps.append((name, run, tokens, flops, [run()]))   # the first call compiles
  for _ in range(args.rounds):
    for _, run, _, _, times in steps:
      times.append(run())
  table = Table(title=f'Gemma-2-shaped train step, sequence {args.seq}, median of {args.rounds} interleaved rounds, '
                      f'on {len(jax.devices())} x {jax.devices()[0].device_kind}')
  for col in ('variant', 'compile s', 'step s (median)', 'tokens/s', 'vs no caps', 'XLA FLOPs'):
    table.add_column(col, justify='left' if col == 'variant' else 'right')
  rows, base = [], None
  for name, _, tokens, flops, times in steps:
    median = statistics.median(times[1:])
    base = base or median
    rows.append({'variant': name, 'compile_s': times[0], 'step_s': median, 'step_s_all': times[1:],
                 'tokens_per_sec': tokens / median, 'vs_no_caps': base / median, 'xla_flops': flops})
    table.add_row(name, f'{times[0]:.1f}', f'{median:.3f}', f'{tokens / median:,.0f}', f'{base / median:.2f}x',
                  f'{flops:,.0f}')
  if args.json:
    print(json.dumps(rows, indent=1))
  else:
    Console(width=140).print(table)
    Console(width=140).print(machine.describe())


if __name__ == '__main__':
  main()
