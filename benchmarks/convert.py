"""Benchmark `pax checkpoint convert` on a >= 1B-parameter float32 checkpoint (streamed conversion).

    .venv/bin/python benchmarks/convert.py [--layers 20] [--dims 2048] [--hidden 8192] [--dir /tmp/pax_convert_bench]

Makes a scanned (USE_REPEATED_LAYER) LM checkpoint by a fresh init and one save (params
only: the full Adam state of 1B params would not fit beside it in 24 GB), then converts it
in fresh processes, --no-verify (verification loads both models; it is not streaming):
  1. to bfloat16 params-only (orbax)   2. to safetensors   3. to unrolled layers (orbax)
and prints seconds, GB/s against the disk's write speed measured in the same run, and
each process's peak RSS as a multiple of the largest array (after the RSS of a process
that only reads the checkpoint's metadata, `pax checkpoint inspect`: the constant).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXP = 'lm_cloud.LmCloudSpmdTest'


def knobs(layers: int, dims: int, hidden: int, vocab: int = 32000, scanned: bool = True) -> list[str]:
  return [f'NUM_LAYERS={layers}', f'MODEL_DIMS={dims}', f'HIDDEN_DIMS={hidden}', f'NUM_HEADS={dims // 128}',
          'DIMS_PER_HEAD=128', f'VOCAB_SIZE={vocab}', 'MAX_SEQ_LEN=64', 'PERCORE_BATCH_SIZE=1',
          f'USE_REPEATED_LAYER={scanned}', 'ICI_MESH_SHAPE=[1,1,1]', 'CHECKPOINT_POLICY=\'none\'']


def make_checkpoint(job_dir: str, overrides: list[str], exp: str = EXP) -> dict:
  """A params-only checkpoint at step 0 of a fresh init, saved like `pax train` saves."""
  import jax
  import numpy as np

  from paxcli.jobdir import checkpoint as ckpt
  from paxcli import config
  from paxcli.convert import core
  resolved = config.resolve(exp, overrides)
  model = core.build_model(resolved)
  from paxcli.runtime import engine
  init = jax.jit(lambda r: engine.unbox(engine.init_variables(model.module.model, r, 8)['params']))
  params = init(jax.random.key(0))
  shapes = {n: list(x.shape) for n, x in model.abstract.items() if n == 'step' or n.startswith('params/')}
  meta = {'step': 0, 'batches_consumed': 0, 'state_shapes': shapes, 'experiment': resolved.name,
          'config': {k: repr(v) for k, v in resolved.flat().items()}}
  writer = ckpt.Checkpointer(os.path.join(job_dir, 'checkpoints'), max_to_keep=0, async_save=False)
  state = {'step': np.int32(0), 'params': params}
  from paxcli.runtime import train_state
  writer.save(0, state, {**meta, 'checksums': train_state.checksums(state)})
  writer.close()
  with open(os.path.join(job_dir, 'config.txt'), 'w', encoding='utf-8') as f:
    f.write(resolved.as_text())
  sizes = [x.size * 4 for x in jax.tree.leaves(params)]
  return {'parameters': sum(sizes) // 4, 'bytes': sum(sizes), 'largest': max(sizes)}


# The peak RSS of the pax process itself: VmHWM read at its exit. (getrusage/wait4 would report at
# least the parent's RSS at fork time, which Linux keeps in the child's high-water mark across exec.)
_WRAP = ('import atexit, sys\n'
         'def hwm():\n'
         '  line = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0]\n'
         '  sys.stderr.write("\\nPEAK_RSS_KB " + line.split()[1] + "\\n")\n'
         'atexit.register(hwm)\n'
         'from paxcli.cli.app import main\n'
         'main(sys.argv[1:])\n')


def run_measured(argv: list[str]) -> tuple[float, float]:
  """(seconds, peak RSS in bytes) of a fresh `pax` process."""
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, '-c', _WRAP, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                        text=True)
  if proc.returncode:
    raise SystemExit(f'pax {" ".join(argv)} failed:\n{proc.stderr[-2000:]}')
  peak = [l for l in proc.stderr.splitlines() if l.startswith('PEAK_RSS_KB ')][-1]
  return time.perf_counter() - t0, int(peak.split()[1]) * 1024


def disk_write_speed(directory: str, nbytes: int = 1 << 30) -> float:
  path = os.path.join(directory, 'ddtest')
  block = os.urandom(1 << 24)
  t0 = time.perf_counter()
  with open(path, 'wb') as f:
    for _ in range(nbytes // len(block)):
      f.write(block)
    f.flush()
    os.fsync(f.fileno())
  dt = time.perf_counter() - t0
  os.remove(path)
  return nbytes / dt


def main() -> None:
  import machine   # benchmarks/machine.py (this file is also loaded by tests, from elsewhere)
  p = argparse.ArgumentParser()
  p.add_argument('--layers', type=int, default=20)
  p.add_argument('--dims', type=int, default=2048)
  p.add_argument('--hidden', type=int, default=8192)
  p.add_argument('--dir', default='/tmp/pax_convert_bench')
  p.add_argument('--reuse', action='store_true', help='Reuse the checkpoint made by an earlier run in --dir.')
  args = p.parse_args()
  src = os.path.join(args.dir, 'src')
  sets = knobs(args.layers, args.dims, args.hidden)
  t0 = time.perf_counter()
  made_file = os.path.join(args.dir, 'made.json')
  if args.reuse and os.path.exists(made_file):
    with open(made_file, encoding='utf-8') as f:
      made = json.load(f)
  else:
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    made = make_checkpoint(src, sets)
    with open(made_file, 'w', encoding='utf-8') as f:
      json.dump(made, f)
  print(f'checkpoint: {made["parameters"] / 1e9:.2f}B float32 params, {made["bytes"] / 2**30:.2f} GiB, largest '
        f'array {made["largest"] / 2**30:.2f} GiB; made in {time.perf_counter() - t0:.0f}s', flush=True)
  disk = disk_write_speed(args.dir)
  _, base_rss = run_measured(['checkpoint', 'inspect', src, '--json'])
  print(f'disk write speed: {disk / 1e9:.2f} GB/s; RSS of a metadata-only process: {base_rss / 2**30:.2f} GiB',
        flush=True)
  from rich.console import Console
  from rich.table import Table
  table = Table(title=f'pax checkpoint convert, {made["parameters"] / 1e9:.2f}B params (2 shared cores)')
  for col in ('conversion', 'written GiB', 'seconds', 'GB/s', 'vs disk', 'peak RSS GiB',
              '(RSS - const) / largest'):
    table.add_column(col, justify='right')
  runs = [('bf16 params-only', 'bf16', ['--params-only', '--dtype', 'bfloat16'], made['bytes'] / 2),
          ('safetensors', 'st', ['--to', 'safetensors'], made['bytes']),
          ('unrolled layers', 'unrolled', ['--set', 'USE_REPEATED_LAYER=False'], made['bytes'])]
  for label, out, extra, written in runs:
    seconds, rss = run_measured(['checkpoint', 'convert', src, os.path.join(args.dir, out), '--no-verify', *extra])
    rate = written / seconds
    row = (label, f'{written / 2**30:.2f}', f'{seconds:.1f}', f'{rate / 1e9:.2f}', f'{rate / disk:.0%}',
           f'{rss / 2**30:.2f}', f'{(rss - base_rss) / made["largest"]:.2f}')
    table.add_row(*row)
    print('  '.join(row), flush=True)
    shutil.rmtree(os.path.join(args.dir, out), ignore_errors=True)
  Console(width=160).print(table)
  Console(width=160).print(machine.describe())


if __name__ == '__main__':
  main()
