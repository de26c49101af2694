"""Cost of paxcli's checkpoint checksums against the orbax save and restore they protect.

  .venv/bin/python benchmarks/checkpoint_checksums.py [--gib 1.0] [--arrays 16] [--devices 8]

Builds a float32 state of about --gib GiB in --arrays arrays sharded over --devices fake CPU
devices, then times: the checksum pass (`paxcli.jobdir.restore.checksums`, what each save and each
restore adds), an orbax save of that state, and an orbax restore. Prints a table. Machines
are shared and noisy: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import machine   # benchmarks/machine.py: the processor beside the table


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--gib', type=float, default=1.0)
  parser.add_argument('--arrays', type=int, default=16)
  parser.add_argument('--devices', type=int, default=8)
  args = parser.parse_args()
  os.environ['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={args.devices}'
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  import jax
  import jax.numpy as jnp
  import numpy as np
  import orbax.checkpoint as ocp
  from rich.console import Console
  from rich.table import Table

  from paxcli.jobdir import restore
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('data',))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
  rows = int(args.gib * (1 << 30) / 4 / args.arrays / 1024) // args.devices * args.devices
  make = jax.jit(lambda k: jax.random.normal(k, (rows, 1024), jnp.float32), out_shardings=sharding)
  state = {f'w{i}': make(jax.random.key(i)) for i in range(args.arrays)}
  jax.block_until_ready(state)
  nbytes = sum(x.nbytes for x in state.values())

  def timed(fn, repeat=3):
    best = float('inf')
    for _ in range(repeat):
      start = time.perf_counter()
      fn()
      best = min(best, time.perf_counter() - start)
    return best

  restore.checksums(state)  # compile
  t_sum = timed(lambda: restore.checksums(state))
  directory = tempfile.mkdtemp(prefix='pax-bench-ckpt-')
  try:
    checkpointer = ocp.StandardCheckpointer()
    path = os.path.join(directory, 'a')

    def save():
      shutil.rmtree(path, ignore_errors=True)
      checkpointer.save(path, state)
      checkpointer.wait_until_finished()
    t_save = timed(save, repeat=2)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    t_restore = timed(lambda: jax.block_until_ready(checkpointer.restore(path, abstract)), repeat=2)
  finally:
    shutil.rmtree(directory, ignore_errors=True)
  table = Table(title=f'Checksums of a {nbytes / (1 << 30):.2f} GiB state ({args.arrays} float32 arrays over '
                      f'{args.devices} {jax.default_backend()} devices)')
  for col in ('what', 'seconds', 'GiB/s', 'checksum cost'):
    table.add_column(col)
  gib = nbytes / (1 << 30)
  table.add_row('checksum pass (added to each save and restore)', f'{t_sum:.3f}', f'{gib / t_sum:.2f}', '')
  table.add_row('orbax save (to local disk, waited)', f'{t_save:.3f}', f'{gib / t_save:.2f}',
                f'+{100 * t_sum / t_save:.0f}%')
  table.add_row('orbax restore', f'{t_restore:.3f}', f'{gib / t_restore:.2f}', f'+{100 * t_sum / t_restore:.0f}%')
  Console().print(table)
  Console().print(machine.describe())


if __name__ == '__main__':
  main()
