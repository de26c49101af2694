"""Soft caps at full speed (#27 item 4): a Gemma-2-shaped training step with and without its caps, in one run.

  .venv/bin/python benchmarks/soft_caps.py [--steps 5] [--seq 1024] [--set K=V ...]

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
Goal: 'caps 50 / 30' within 10% of 'no caps'. Machines are shared and noisy: compare ratios in one run.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_step import report  # noqa: E402


def gemma2_shape(seq: int) -> list[str]:
  from paxcli.models.gemma import GEMMA2
  knobs = {**GEMMA2.knobs, 'LAYER_KINDS': {'local': {'SLIDING_WINDOW': seq // 2}}}
  sizes = {'NUM_LAYERS': 4, 'MODEL_DIMS': 256, 'HIDDEN_DIMS': 1024, 'NUM_HEADS': 4, 'NUM_KV_HEADS': 2,
           'DIMS_PER_HEAD': 64, 'QUERY_PRE_ATTN_SCALAR': 64.0, 'MAX_SEQ_LEN': seq, 'PERCORE_BATCH_SIZE': 2,
           'VOCAB_SIZE': 2048}
  return [f'{k}={v!r}' for k, v in {**knobs, **sizes}.items()]


VARIANTS = [
    ('no caps', ['ATTEN_LOGIT_CAP=0.0', 'SOFTMAX_CAP_LOGITS=0.0']),
    ('no caps, blockwise attention', ['ATTEN_LOGIT_CAP=0.0', 'SOFTMAX_CAP_LOGITS=0.0', 'ATTENTION_IMPL=blockwise']),
    ('caps 50 / 30', []),
    ('caps, einsum attention', ['ATTENTION_IMPL=einsum']),
]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--exp', default='default.StdlibDocsLm')
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--seq', type=int, default=1024)
  parser.add_argument('--set', action='append', default=[], dest='overrides')
  parser.add_argument('--json', action='store_true', help='Print the rows as JSON instead of a table.')
  args = parser.parse_args()
  import jax
  report(f'Gemma-2-shaped train step, sequence {args.seq}, on {len(jax.devices())} x {jax.devices()[0].device_kind}',
         [(name, gemma2_shape(args.seq) + args.overrides + extra) for name, extra in VARIANTS], args.exp, args.steps,
         args.json, 'vs no caps')

if __name__ == '__main__':
  main()
