"""Save stall and restore time of a checkpoint in a bucket against local disk (prints a table).

  .venv/bin/python benchmarks/bucket.py [--gib 1] [--arrays 8] [--repeats 2]

Builds a float32 state of about --gib GiB (--arrays arrays) and saves it with
`paxcli.jobdir.checkpoint.Checkpointer` (orbax, async: what `pax train` does) to a local temporary
directory and to an emulated bucket: fake-gcs-server on 127.0.0.1 (tests/gcs_server.py), its
objects on the same local disk, reached through tensorstore's gcs driver and gcsfs over HTTP.
Per target: the stall (the seconds `save()` holds the loop), the background write until orbax's
commit marker is in place, and a full restore onto the same sharding, best of --repeats. The
emulator adds HTTP and a second copy on one disk, and has no network in between: the bucket
column is what the GCS protocol path costs here, not a real bucket's speed. Compare within one
run: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import machine   # benchmarks/machine.py: the processor beside the table

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'tests'))


def _state(gib: float, arrays: int):
  import jax
  import jax.numpy as jnp
  rows = int(gib * (1 << 30) / 4 / arrays / 1024)
  make = jax.jit(lambda k: jax.random.normal(k, (rows, 1024), jnp.float32))
  state = {'step': jnp.int32(7), 'params': {f'w{i}': make(jax.random.key(i)) for i in range(arrays)}}
  jax.block_until_ready(state)
  return state


def _time_one(directory: str, state, step: int) -> tuple[float, float, float]:
  """(stall, background write, restore) seconds of one save and restore of `state` under `directory`."""
  import jax
  import orbax.checkpoint as ocp
  from paxcli.jobdir import checkpoint as ckpt
  from paxcli.jobdir import layout
  checkpointer = ckpt.Checkpointer(directory, max_to_keep=0)
  t = time.perf_counter()
  checkpointer.save(step, state, {'step': step})
  stall = time.perf_counter() - t
  t = time.perf_counter()
  checkpointer.close()
  write = time.perf_counter() - t
  assert step in ckpt.complete_steps(directory)
  args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype), state)
  t = time.perf_counter()
  got = ocp.PyTreeCheckpointer().restore(layout.state_dir(os.path.join(directory, str(step))),
                                         args=ocp.args.PyTreeRestore(item=state, restore_args=args))
  jax.block_until_ready(got)
  restore = time.perf_counter() - t
  del got
  return stall, write, restore


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--gib', type=float, default=1.0)
  parser.add_argument('--arrays', type=int, default=8)
  parser.add_argument('--repeats', type=int, default=2)
  args = parser.parse_args()
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  import jax
  from rich.console import Console
  from rich.table import Table

  import gcs_server
  from paxcli.jobdir import storage

  state = _state(args.gib, args.arrays)
  gib = sum(x.nbytes for x in jax.tree.leaves(state)) / (1 << 30)
  work = tempfile.mkdtemp(prefix='pax-bucket-bench-')
  results = {}
  try:
    local = os.path.join(work, 'local')
    results['local disk'] = [_time_one(os.path.join(local, str(r)), state, 1) for r in range(args.repeats)]
    with gcs_server.running(os.path.join(work, 'bucket')) as server:
      bucket = server.make_bucket('pax-bench')
      results['emulated bucket (gs://)'] = [_time_one(f'{bucket}/run{r}/checkpoints', state, 1)
                                            for r in range(args.repeats)]
      storage.rmtree(bucket + '/')
  finally:
    shutil.rmtree(work, ignore_errors=True)
  table = Table(title=f'Checkpoint of a {gib:.2f} GiB state ({args.arrays} float32 arrays, {jax.device_count()} '
                      f'{jax.default_backend()} device(s)), best of {args.repeats}')
  for col in ('target', 'save stall s', 'background write s', 'write GiB/s', 'restore s', 'restore GiB/s',
              'stall vs local', 'restore vs local'):
    table.add_column(col, justify='right')
  best = {k: tuple(min(r[i] for r in v) for i in range(3)) for k, v in results.items()}
  base = best['local disk']
  for name, (stall, write, restore) in best.items():
    table.add_row(name, f'{stall:.2f}', f'{write:.2f}', f'{gib / (stall + write):.2f}', f'{restore:.2f}',
                  f'{gib / restore:.2f}', f'{stall / base[0]:.2f}x', f'{restore / base[2]:.2f}x')
  Console(width=200).print(table)
  Console(width=200).print(machine.describe())


if __name__ == '__main__':
  main()
