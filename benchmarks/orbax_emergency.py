"""Does orbax's emergency (multi-tier) checkpointing work off Google Cloud? A probe on CPU, 2 processes.

  .venv/bin/python benchmarks/orbax_emergency.py

Starts 2 jax.distributed processes (gloo, 4 fake CPU devices each) that save 6 steps with
`orbax.checkpoint.experimental.emergency.checkpoint_manager.CheckpointManager` (local tier every 2
steps, persistent every 5), for a mesh of 1 data-parallel replica and of 2, then restore the latest;
the second run of the 2-replica case first wipes the local directory of process 1 (a replaced host).
Prints, per case and process: the manager orbax chose, what each tier holds, and what was restored or
the error. Each case also runs once without orbax's two set-up calls (its distributed-to-device id
maps, absl flags marked parsed) to show what they are needed for. paxcli's fast tier
(paxcli/jobdir/fast_tier.py) says what it takes from this and why it does not use the manager itself.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

CHILD = r'''
import json, os, sys, traceback
import jax
jax.config.update('jax_cpu_collectives_implementation', 'gloo')
pid, port, replicas, setup_calls, wipe, root = sys.argv[1:]
pid, replicas = int(pid), int(replicas)
jax.distributed.initialize(f'127.0.0.1:{port}', 2, pid)
import numpy as np, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import orbax.checkpoint as ocp
from orbax.checkpoint.experimental.emergency import checkpoint_manager as ecm
import machine   # benchmarks/machine.py: the processor beside the table
if setup_calls == '1':
  from absl import flags
  from orbax.checkpoint._src.multihost import multihost
  flags.FLAGS.mark_as_parsed()
  multihost.initialize_runtime_to_distributed_ids()
  multihost.initialize_distributed_to_device_ids()
mesh = Mesh(np.array(jax.devices()).reshape(replicas, 8 // replicas), ('replica', 'data'))
state = {'w': jax.jit(lambda: jnp.arange(64.).reshape(8, 8), out_shardings=NamedSharding(mesh, P(None, 'data')))()}
abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
local, persistent = f'{root}/local_p{pid}', f'{root}/persistent'
os.makedirs(local, exist_ok=True); os.makedirs(persistent, exist_ok=True)
opts = ecm.CheckpointManagerOptions(local=ecm.LocalCheckpointOptions(save_interval_steps=2, max_to_keep=2),
                                    persistent=ecm.PersistentCheckpointOptions(save_interval_steps=5, max_to_keep=2))
out = {'process': pid}
try:
  manager = ecm.CheckpointManager(local, persistent, mesh, abstract, options=opts)
  out['manager'] = type(manager._checkpoint_manager).__name__
  out['saved'] = [s for s in range(1, 7) if manager.save(s, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))]
  manager.wait_until_finished()
  manager.close()
  out['local'] = sorted(os.listdir(local))
  out['persistent'] = sorted(os.listdir(persistent))
  if wipe == str(pid):
    shutil = __import__('shutil'); shutil.rmtree(local); os.makedirs(local)
  manager = ecm.CheckpointManager(local, persistent, mesh, abstract, options=opts)
  step = manager.latest_step()
  got = manager.restore(step)
  want = np.arange(64.).reshape(8, 8)
  same = all(np.array_equal(np.asarray(s.data), want[s.index]) for s in got.state['w'].addressable_shards)
  out['restored'] = f'step {step}, this process\'s shards {"as saved" if same else "DIFFERENT from what was saved"}'
except Exception as e:
  out['error'] = f'{type(e).__name__}: {str(e).splitlines()[0][:160]}'
print('RESULT ' + json.dumps(out), flush=True)
os._exit(0)
'''


def run_case(replicas: int, setup_calls: bool, wipe: int) -> list[dict]:
  root = tempfile.mkdtemp(prefix='pax-orbax-emergency-')
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=4', JAX_PLATFORMS='cpu')
  procs = [subprocess.Popen([sys.executable, '-c', CHILD, str(i), str(port), str(replicas), str(int(setup_calls)),
                             str(wipe), root], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
           for i in range(2)]
  results = []
  for p in procs:
    try:
      out, _ = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
      p.kill()
      out = ''
    line = next((l for l in out.splitlines() if l.startswith('RESULT ')), None)
    results.append(json.loads(line[7:]) if line else {'error': 'no result (hung or crashed)'})
  shutil.rmtree(root, ignore_errors=True)
  return results


def main() -> None:
  from rich.console import Console
  from rich.table import Table
  t = Table(title='orbax emergency.CheckpointManager, 2 CPU processes (gloo), local every 2 steps, persistent every 5')
  for col in ('replicas', 'set-up calls', 'local wiped', 'process', 'manager', 'saved steps', 'local tier',
              'persistent tier', 'restored / error'):
    t.add_column(col, overflow='fold')
  for replicas, calls, wipe in ((1, True, -1), (2, False, -1), (2, True, -1), (2, True, 1)):
    for r in run_case(replicas, calls, wipe):
      t.add_row(str(replicas), 'yes' if calls else 'no', f'p{wipe}' if wipe >= 0 else '-', str(r.get('process', '?')),
                r.get('manager', '-'), str(r.get('saved', '-')), str(r.get('local', '-')),
                str(r.get('persistent', '-')), r.get('restored') or r.get('error', '-'))
  Console(width=220).print(t)
  Console(width=220).print(machine.describe())


if __name__ == '__main__':
  main()
