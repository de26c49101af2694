"""Pipeline parallelism on 8 fake CPU devices: step time and the bubble, against the formula.

  .venv/bin/python benchmarks/pipeline.py [--steps 5] [--set K=V ...]

One row per stages x microbatches (x circular repeats), and the same model unpipelined
(all 8 devices on `data`). Every pipeline iteration runs all S stages, the idle ones on
padding, so a pipelined step does the unpipelined step's work times T / (R * M) with
T = R * M + S - 1 iterations; on fake devices, which share the host's cores, that extra
work costs time as idling would on real chips. The measured bubble is
1 - unpipelined step time / pipelined step time; the formula's is (S - 1) / (R * M + S - 1).
What the measured one has above the formula is the pipeline's own overhead (shifts between
stages, the microbatch bookkeeping, smaller matmuls). The machine is shared and noisy:
compare within one run.
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
CASES = [(2, 2, 1), (2, 4, 1), (2, 8, 1), (4, 4, 1), (4, 8, 1), (4, 16, 1), (2, 4, 2), (4, 4, 2), (4, 8, 2)]


def step_seconds(overrides: list[str], steps: int) -> dict:
  from paxcli import bench, config
  row = bench.measure(config.resolve(EXP, overrides), steps=steps, warmup=1)
  return row


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--set', action='append', default=[], dest='overrides')
  parser.add_argument('--cases', default=None, help='e.g. "2x4x1,4x8x2": stages x microbatches x repeats')
  args = parser.parse_args()
  cases = CASES if not args.cases else [tuple(int(v) for v in c.split('x')) for c in args.cases.split(',')]
  import jax
  from rich.console import Console
  from rich.table import Table
  model = MODEL + args.overrides
  base = step_seconds(model + ['ICI_MESH_SHAPE=[1,8,1]'], args.steps)
  t_base = base['step_seconds_median']
  table = Table(title=f'Pipeline on {len(jax.devices())} x {jax.devices()[0].device_kind}: {EXP} '
                      f'({base["params"]:,} params, global batch {base["global_batch"]} x {base["seq_len"]})',
                caption='measured bubble = 1 - unpipelined / pipelined step time; formula (S-1)/(R*M+S-1)',
                caption_justify='left')
  for col in ('stages', 'microbatches', 'repeats', 'mesh', 'compile s', 'step ms', 'vs unpipelined',
              'bubble measured', 'bubble formula', 'memory/device (args + temp)'):
    table.add_column(col, justify='right')
  memory = lambda r: bench._bytes(r.get('memory_argument_bytes', 0) + r.get('memory_temp_bytes', 0))
  table.add_row('-', '-', '-', '[1,8,1]', f"{base['compile_seconds']:.1f}", f'{t_base * 1e3:.0f}', '1.00x', '-',
                '-', memory(base))
  for stages, micro, repeats in cases:
    mesh = f'[{stages},1,{8 // stages},1]'
    r = step_seconds(model + [f'NUM_STAGES={stages}', f'NUM_MICROBATCHES={micro}',
                              f'PIPELINE_CIRCULAR_REPEAT={repeats}', f'ICI_MESH_SHAPE={mesh}'], args.steps)
    t = r['step_seconds_median']
    table.add_row(str(stages), str(micro), str(repeats), mesh, f"{r['compile_seconds']:.1f}", f'{t * 1e3:.0f}',
                  f'{t / t_base:.2f}x', f'{1 - t_base / t:.1%}', f"{r['pipeline_bubble']:.1%}", memory(r))
    print(f'{stages}x{micro}x{repeats}: {t * 1e3:.0f} ms', file=sys.stderr, flush=True)
  Console().print(table)


if __name__ == '__main__':
  main()
