"""How long an async checkpoint save stalls the training loop, and where the time goes.

  .venv/bin/python benchmarks/save_stall.py [--gib 2 4] [--devices 1] [--steps 12] [--save-every 4]

For each state size, builds a float32 train state of about that many GiB (params plus Adam's
mu and nu: a third each) on --devices fake CPU devices and runs a loop of jitted steps that
touch every array (like an optimizer update, donated), saving every --save-every steps exactly
as `pax train` does: the finite-parameters check, the checksum pass, and
`paxcli.jobdir.checkpoint.Checkpointer.save` (orbax, async). Prints, per save, the seconds the loop
was held by each part, the wait for the previous save to finish (zero when the disk keeps up),
and the step time around it. The stall is what the loop loses per save; the write itself runs
in the background. Machines are shared and noisy: compare within one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import machine   # benchmarks/machine.py: the processor beside the table


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--gib', type=float, nargs='+', default=[1.0, 3.0])
  parser.add_argument('--devices', type=int, default=1)
  parser.add_argument('--steps', type=int, default=12)
  parser.add_argument('--save-every', type=int, default=4)
  parser.add_argument('--arrays', type=int, default=8, help='params arrays (mu and nu mirror them)')
  parser.add_argument('--dir', default=None, help='where checkpoints go (default: a temporary directory)')
  args = parser.parse_args()
  os.environ['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={args.devices}'
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  import jax
  import jax.numpy as jnp
  import numpy as np
  from rich.console import Console
  from rich.table import Table

  from paxcli.jobdir import checkpoint as ckpt
  from paxcli.jobdir import restore
  from paxcli.loops import train

  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('data',))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
  table = Table(title=f'Async save stall per save ({args.devices} {jax.default_backend()} device(s); '
                      f'save every {args.save_every} steps)')
  for col in ('state GiB', 'step s', 'finite check s', 'checksums s', 'orbax save() s', 'wait for previous s',
              'stall s', 'stall / GiB', 'write GiB/s (background)'):
    table.add_column(col, justify='right')
  for gib in args.gib:
    rows = int(gib * (1 << 30) / 4 / 3 / args.arrays / 1024) // args.devices * args.devices
    make = jax.jit(lambda k: jax.random.normal(k, (rows, 1024), jnp.float32), out_shardings=sharding)
    params = {f'w{i}': make(jax.random.key(i)) for i in range(args.arrays)}
    state = {'step': jnp.int32(0), 'params': params,
             'opt_state': {'mu': jax.tree.map(jnp.zeros_like, params), 'nu': jax.tree.map(jnp.zeros_like, params)}}
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))

    @jax.jit
    def step_fn(s):
      p = jax.tree.map(lambda w, m: w - 1e-3 * m, s['params'], s['opt_state']['mu'])
      mu = jax.tree.map(lambda m, w: 0.9 * m + 0.1 * w, s['opt_state']['mu'], s['params'])
      nu = jax.tree.map(lambda v, w: 0.99 * v + 0.01 * w * w, s['opt_state']['nu'], s['params'])
      return {'step': s['step'] + 1, 'params': p, 'opt_state': {'mu': mu, 'nu': nu}}
    step_fn = jax.jit(step_fn, donate_argnums=0)
    directory = args.dir or tempfile.mkdtemp(prefix='pax-save-stall-')
    checkpointer = ckpt.Checkpointer(os.path.join(directory, f'{gib:g}'), max_to_keep=2)
    state = step_fn(state)
    jax.block_until_ready(state)
    train.params_finite(state['params'])
    restore.checksums(state)   # compile both passes before timing
    step_times, saves = [], []
    try:
      for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        state = step_fn(state)
        jax.block_until_ready(state)
        step_times.append(time.perf_counter() - t0)
        if step % args.save_every == 0:
          parts = {}
          t = time.perf_counter()
          train.params_finite(state['params'])
          parts['finite'] = time.perf_counter() - t
          t = time.perf_counter()
          sums = restore.checksums(state)
          parts['checksums'] = time.perf_counter() - t
          t = time.perf_counter()
          checkpointer._finish()   # Checkpointer.save does this first: time it on its own
          parts['wait'] = time.perf_counter() - t
          t = time.perf_counter()
          checkpointer.save(step, state, {'step': step, 'checksums': sums})
          parts['save'] = time.perf_counter() - t
          saves.append(parts)
      t = time.perf_counter()
      checkpointer.close()
      last_write = time.perf_counter() - t
    finally:
      if not args.dir:
        shutil.rmtree(directory, ignore_errors=True)
    step_s = statistics.median(step_times)
    g = nbytes / (1 << 30)
    for i, parts in enumerate(saves):
      stall = parts['finite'] + parts['checksums'] + parts['save'] + parts['wait']
      tail = f'{g / (parts["save"] + last_write):.2f}' if i == len(saves) - 1 else ''
      table.add_row(f'{g:.2f}', f'{step_s:.3f}', f'{parts["finite"]:.3f}', f'{parts["checksums"]:.3f}',
                    f'{parts["save"]:.3f}', f'{parts["wait"]:.3f}', f'{stall:.2f}', f'{stall / g:.2f}', tail)
    del state
  Console(width=200).print(table)
  Console(width=200).print(machine.describe())


if __name__ == '__main__':
  main()
