"""Pipeline parallelism on 8 fake CPU devices: step time and the bubble, against the formula.

  .venv/bin/python benchmarks/pipeline.py [--steps 5] [--cases 2x4x1,4x8x2] [--set K=V ...]

One row per stages x microbatches x circular repeats (S x M x R, mesh [S, 1, 8 / S, 1]), and
the same model unpipelined (all 8 devices on `data`). Every pipeline iteration runs all S
stages, idle ones on padding, so a pipelined step is T = R * M + S - 1 equal iterations of
which S - 1 are bubble. The time of one iteration is measured, not assumed: each case runs
again with twice the microbatches of the same size (twice the global batch), which adds
exactly R * M iterations, so t_iter = (t(2M) - t(M)) / (R * M). The measured bubble is
(S - 1) * t_iter / t(M): the share of the whole step (embedding, loss and optimizer
included) spent in bubble iterations; the formula (S - 1) / (R * M + S - 1) counts the
pipeline's loop alone, so the measured share sits a little below it. Step times are the
fastest of --steps (the machine is shared and noisy): compare within one run.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

EXP = 'lm_cloud.LmCloudSpmdTest'
MODEL = ['NUM_LAYERS=8', 'MODEL_DIMS=128', 'HIDDEN_DIMS=512', 'NUM_HEADS=4', 'DIMS_PER_HEAD=32', 'VOCAB_SIZE=256',
         'MAX_SEQ_LEN=64', 'PERCORE_BATCH_SIZE=4', 'USE_REPEATED_LAYER=True']   # global batch 32
# (stages, microbatches, circular repeats); the mesh is [S, 1, 8 / S, 1].
CASES = [(2, 2, 1), (2, 4, 1), (2, 8, 1), (4, 4, 1), (4, 8, 1), (2, 4, 2), (4, 4, 2)]


def measure(overrides: list[str], steps: int) -> dict:
  from paxcli import config
  from paxcli.loops import bench
  return bench.measure(config.resolve(EXP, overrides), steps=steps, warmup=1)


def percore(overrides: list[str]) -> float:
  return float(next(o.split('=', 1)[1] for o in reversed(MODEL + overrides) if o.startswith('PERCORE_BATCH_SIZE=')))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--set', action='append', default=[], dest='overrides')
  parser.add_argument('--cases', default=None, help='e.g. "2x4x1,4x8x2": stages x microbatches x repeats')
  args = parser.parse_args()
  cases = CASES if not args.cases else [tuple(int(v) for v in c.split('x')) for c in args.cases.split(',')]
  import jax
  from rich.console import Console

  from paxcli.loops import bench
  from rich.table import Table
  model = MODEL + args.overrides
  base = measure(model + ['ICI_MESH_SHAPE=[1,8,1]'], args.steps)
  t_base = base['step_seconds_min']
  table = Table(title=f'Pipeline on {len(jax.devices())} x {jax.devices()[0].device_kind}: {EXP} '
                      f'({base["params"]:,} params, {MODEL[0]}, global batch {base["global_batch"]} x '
                      f'{base["seq_len"]})',
                caption='bubble measured: (S-1) x t_iter / step time, t_iter from the same case with 2M '
                        'microbatches; formula: (S-1)/(R*M+S-1)', caption_justify='left')
  for col in ('S', 'M', 'R', 'mesh', 'compile s', 'step ms', 'vs unpipelined', 'iteration ms',
              'bubble measured', 'bubble formula', 'memory/device'):
    table.add_column(col, justify='right')
  memory = lambda r: bench._bytes(r.get('memory_argument_bytes', 0) + r.get('memory_temp_bytes', 0))
  table.add_row('-', '-', '-', '[1,8,1]', f"{base['compile_seconds']:.1f}", f'{t_base * 1e3:.0f}', '1.00x', '-',
                '-', '-', memory(base))
  doubled = f'PERCORE_BATCH_SIZE={2 * percore(args.overrides):g}'
  for stages, micro, repeats in cases:
    mesh = f'[{stages},1,{8 // stages},1]'
    knobs = model + [f'NUM_STAGES={stages}', f'PIPELINE_CIRCULAR_REPEAT={repeats}', f'ICI_MESH_SHAPE={mesh}']
    r = measure(knobs + [f'NUM_MICROBATCHES={micro}'], args.steps)
    r2 = measure(knobs + [f'NUM_MICROBATCHES={2 * micro}', doubled], args.steps)
    t, t2 = r['step_seconds_min'], r2['step_seconds_min']
    t_iter = (t2 - t) / (repeats * micro)
    table.add_row(str(stages), str(micro), str(repeats), mesh, f"{r['compile_seconds']:.1f}", f'{t * 1e3:.0f}',
                  f'{t / t_base:.2f}x', f'{t_iter * 1e3:.1f}', f'{(stages - 1) * t_iter / t:.1%}',
                  f"{r['pipeline_bubble']:.1%}", memory(r))
    print(f'{stages}x{micro}x{repeats}: {t * 1e3:.0f} ms, with 2M {t2 * 1e3:.0f} ms', file=sys.stderr, flush=True)
  Console(width=160).print(table)


if __name__ == '__main__':
  main()
