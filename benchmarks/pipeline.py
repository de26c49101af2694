"""Pipeline parallelism on 8 fake CPU devices: step time and the bubble, against the formula;
with --plans, Pax's four C4 runs planned at full size, by XLA:CPU and by the TPU's own compiler.

  .venv/bin/python benchmarks/pipeline.py [--steps 5] [--cases 2x4x1,4x8x2] [--set K=V ...]
  .venv/bin/python benchmarks/pipeline.py --plans [--device-memory 32GB] [--compilers cpu,tpu]

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

--plans compiles the train step of each of recipes/c4.py's four runs for its real device count,
weights abstract, twice: on fake CPU devices (`pax bench mfu --compile-only --num-devices N`, one
process each: the device count is fixed when jax starts), counted by XLA:CPU, and for the TPU v4
slice Pax ran it on (`--topology v4-N [--num-slices 2]`), counted by XLA:TPU (libtpu, the tpu
extra); it prints compile seconds and each compiler's per-device memory against TPU v4's 32 GiB.
For a run that does not fit by the TPU's count as Pax configured it, the largest PERCORE_BATCH_SIZE
tried that does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import machine   # benchmarks/machine.py: the processor beside the table

ENVIRON = dict(os.environ)  # for the plans' own processes, before the 8 fake devices below
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

EXP = 'lm_cloud.LmCloudSpmdTest'
MODEL = ['NUM_LAYERS=8', 'MODEL_DIMS=128', 'HIDDEN_DIMS=512', 'NUM_HEADS=4', 'DIMS_PER_HEAD=32', 'VOCAB_SIZE=256',
         'MAX_SEQ_LEN=64', 'PERCORE_BATCH_SIZE=4', 'USE_REPEATED_LAYER=True']   # global batch 32
# (stages, microbatches, circular repeats); the mesh is [S, 1, 8 / S, 1].
CASES = [(2, 2, 1), (2, 4, 1), (2, 8, 1), (4, 4, 1), (4, 8, 1), (2, 4, 2), (4, 4, 2)]
# Pax's four C4 runs at their real device counts, the TPU v4 slices Pax ran them on (type, slices), and
# the per-chip batches tried when one does not fit.
PLANS = [('c4.C4Spmd1BAdam4Replicas', 4, ('v4-8', 1)), ('c4.C4Spmd16BAdam32Replicas', 32, ('v4-64', 1)),
         ('c4.C4SpmdPipelineGpt3SmallAdam64Replicas', 64, ('v4-128', 1)),
         ('c4.C4Spmd22BAdam2xv4_128', 128, ('v4-128', 2))]
SMALLER_BATCHES = (12, 8, 4)


def measure(overrides: list[str], steps: int) -> dict:
  from paxcli import config
  from paxcli.loops import bench
  return bench.measure(config.resolve(EXP, overrides), steps=steps, warmup=1)


def percore(overrides: list[str]) -> float:
  return float(next(o.split('=', 1)[1] for o in reversed(MODEL + overrides) if o.startswith('PERCORE_BATCH_SIZE=')))


def plan(exp: str, devices: int, device_memory: str, overrides: list[str] = (), topology=None) -> dict:
  """One compile-only row of `pax bench mfu` for `exp`, in its own process: on `devices` fake CPU
  devices, or with topology=(type, slices) for that TPU slice by the TPU's compiler."""
  sets = [a for o in overrides for a in ('--set', o)]
  where = (['--topology', topology[0], '--num-slices', str(topology[1])] if topology
           else ['--num-devices', str(devices)])
  cmd = [sys.executable, '-m', 'paxcli.cli.app', 'bench', 'mfu', '--exp', exp, '--compile-only', *where,
         '--device-memory', device_memory, '--json', *sets]
  done = subprocess.run(cmd, capture_output=True, text=True, env=ENVIRON)
  if done.returncode:
    raise SystemExit(f'{" ".join(cmd)} failed:\n{done.stderr[-3000:]}')
  return json.loads(done.stdout)[0]


def plans(device_memory: str, compilers: list[str]) -> None:
  from rich.console import Console
  from rich.table import Table

  from paxcli.loops import bench
  table = Table(title=f"Pax's C4 runs at full size: compile-only, {device_memory} per device",
                caption='memory: the compiler\'s buffer assignment for one device; total = arguments + temporaries '
                        '+ outputs not aliased to arguments + code. XLA:CPU on fake CPU devices; XLA:TPU from libtpu '
                        'for the TPU v4 slice (no TPU used)', caption_justify='left')
  for col in ('experiment', 'devices', 'mesh', 'params', 'global batch', 'compiler', 'compile s', 'args', 'temp',
              'total', 'fits'):
    table.add_column(col, justify='right')
  for exp, devices, topology in PLANS:
    runs = [({}, c, plan(exp, devices, device_memory, topology=topology if c == 'tpu' else None)) for c in compilers]
    deciding = runs[-1][2]   # the TPU's count where it was asked for
    for percore in SMALLER_BATCHES if not deciding.get('fits') else ():
      sets = {'PERCORE_BATCH_SIZE': percore}
      smaller = plan(exp, devices, device_memory, [f'PERCORE_BATCH_SIZE={percore}'],
                     topology if compilers[-1] == 'tpu' else None)
      runs.append((sets, compilers[-1], smaller))
      if smaller.get('fits'):
        break
    for sets, _, r in runs:
      name = exp + ''.join(f' {k}={v}' for k, v in sets.items())
      table.add_row(name, str(r['devices']), r['mesh'], bench._count(r['params']), f"{r['global_batch']:,}",
                    r['compiler'].split(' (')[0], f"{r['compile_seconds']:.1f}",
                    bench._bytes(r.get('memory_argument_bytes')), bench._bytes(r.get('memory_temp_bytes')),
                    bench._bytes(r.get('memory_total_bytes')), 'yes' if r.get('fits') else 'NO')
      print(f'{name} by {r["compiler"]}: {r["status"]}, {bench._bytes(r.get("memory_total_bytes"))}',
            file=sys.stderr, flush=True)
  Console(width=220).print(table)
  Console(width=220).print(machine.describe())


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--set', action='append', default=[], dest='overrides')
  parser.add_argument('--cases', default=None, help='e.g. "2x4x1,4x8x2": stages x microbatches x repeats')
  parser.add_argument('--plans', action='store_true', help="Pax's four C4 runs at full size instead")
  parser.add_argument('--device-memory', default='32GB', help='memory per device for --plans (TPU v4: 32GB)')
  parser.add_argument('--compilers', default='cpu,tpu', help='--plans: cpu (fake CPU devices), tpu (libtpu for '
                      'the v4 slice) or both, in that order')
  args = parser.parse_args()
  if args.plans:
    plans(args.device_memory, [c.strip() for c in args.compilers.split(',') if c.strip()])
    return
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
  Console(width=160).print(machine.describe())


if __name__ == '__main__':
  main()
