"""SLURM's environment, read where JAX's own detection falls short.

JAX recognises a SLURM job step (srun) and starts one process per task from SLURM_* variables. Three
things it does not do, which this module does:

- A shell of an allocation (`salloc -n 2`) or an sbatch script that runs `pax train` without srun carries
  SLURM_JOB_ID and SLURM_NTASKS but no job step (SLURM_STEP_NODELIST): JAX sees no cluster and one
  process trains on the first node while the rest of the allocation idles. `partial_step` says so in one
  line, or refuses with the srun line to use when more than one task was asked for.
- JAX derives the coordinator port from the job id alone, so two steps of one allocation (a trainer and
  `pax eval --follow`, two experiments side by side) pick the same port and the second joins the first's
  coordinator. `coordinator_port` adds the step id (or takes SLURM's reserved port of the step).
- JAX makes a task see only the device of its SLURM_LOCALID: right for a process per GPU, wrong for a
  process per node (it would see one GPU of eight) and for tasks SLURM binds to their own GPUs
  (`--gpus-per-task`: the one GPU a task sees is its device 0). `local_device_ids` chooses per case.

Nothing here imports JAX: `pax launch --slurm` reads it on a login node.
"""

from __future__ import annotations

import re
import socket
from typing import Mapping, Optional

from paxcli.errors import UserError

# What JAX's SlurmCluster requires: a job step.
STEP_VARIABLES = ('SLURM_JOB_ID', 'SLURM_STEP_NODELIST', 'SLURM_NTASKS', 'SLURM_PROCID', 'SLURM_LOCALID')
# JAX's port range for SLURM (outside Linux's default ephemeral range, 32768-60999).
PORT_BASE, PORT_SPAN = 61440, 4096
STEPS_PER_JOB = 16   # steps of one job that get distinct ports for sure (more wrap around)


def in_step(environ: Mapping[str, str]) -> bool:
  return all(k in environ for k in STEP_VARIABLES)


def _int(environ: Mapping[str, str], key: str) -> Optional[int]:
  value = environ.get(key, '').strip()
  return int(value) if value.isdigit() else None


def coordinator_port(environ: Mapping[str, str]) -> int:
  """The coordinator's port for this job step: JAX_COORDINATOR_PORT if set; else the first port SLURM
  reserved for the step (SLURM_STEP_RESV_PORTS, with MpiParams=ports or --resv-ports); else one derived
  from the job id and the step id, so that concurrent steps of a job differ."""
  given = _int(environ, 'JAX_COORDINATOR_PORT')
  if given is not None:
    return given
  reserved = re.match(r'(\d+)', environ.get('SLURM_STEP_RESV_PORTS', ''))
  if reserved:
    return int(reserved.group(1))
  job = _int(environ, 'SLURM_JOB_ID') or 0
  step = _int(environ, 'SLURM_STEP_ID') or _int(environ, 'SLURM_STEPID') or 0
  return PORT_BASE + (job * STEPS_PER_JOB + step) % PORT_SPAN


def first_node(nodelist: str) -> str:
  """The first host of a SLURM node list: 'node[3-5,9],gpu1' -> 'node3'."""
  match = re.match(r'([^,\[]*)(?:\[([^\],-]+))?', nodelist.strip())
  prefix, first = match.group(1), match.group(2)
  return prefix + (first or '')


def coordinator(environ: Mapping[str, str]) -> str:
  """HOST:PORT of process 0 of this step: the step's first node (as JAX takes it) and coordinator_port."""
  return f'{first_node(environ["SLURM_STEP_NODELIST"])}:{coordinator_port(environ)}'


def tasks_per_node(spec: str, node_index: int) -> Optional[int]:
  """Tasks on node `node_index` of a SLURM_STEP_TASKS_PER_NODE value such as '4(x2),3'."""
  counts: list[int] = []
  for part in spec.split(','):
    match = re.fullmatch(r'(\d+)(?:\(x(\d+)\))?', part.strip())
    if not match:
      return None
    counts += [int(match.group(1))] * int(match.group(2) or 1)
  return counts[node_index] if 0 <= node_index < len(counts) else None


def local_device_ids(environ: Mapping[str, str]) -> Optional[list[int]]:
  """The accelerators this task drives, as jax.distributed.initialize takes them: [] for every device the
  task sees, a list of ids, or None for JAX's choice ([SLURM_LOCALID]).

  - one task on this node (a process per node): every device;
  - tasks bound to their own GPUs by SLURM (--gpus-per-task: CUDA_VISIBLE_DEVICES is the task's own):
    every device it sees;
  - K GPUs visible to each of T tasks with K a multiple of T: task i gets its K/T, i*K/T onwards.
  """
  here = tasks_per_node(environ.get('SLURM_STEP_TASKS_PER_NODE', ''), _int(environ, 'SLURM_NODEID') or 0)
  if here == 1:
    return []
  if environ.get('SLURM_GPUS_PER_TASK'):
    return []
  visible = [d for d in environ.get('CUDA_VISIBLE_DEVICES', '').split(',') if d.strip()]
  local = _int(environ, 'SLURM_LOCALID')
  if here and visible and local is not None and len(visible) % here == 0 and len(visible) > here:
    share = len(visible) // here
    return list(range(local * share, (local + 1) * share))
  return None


def partial_step(environ: Mapping[str, str], command: str) -> Optional[str]:
  """One line for a SLURM job seen from outside a job step (an salloc shell, an sbatch script without
  srun): why this runs as one process. Refuses (UserError, with the srun line for `command`) when the
  job asked for more than one task. None inside a step or outside SLURM."""
  job = environ.get('SLURM_JOB_ID')
  if not job or in_step(environ):
    return None
  tasks = _int(environ, 'SLURM_NTASKS') or _int(environ, 'SLURM_NPROCS')
  nodes = environ.get('SLURM_JOB_NUM_NODES') or environ.get('SLURM_NNODES') or '?'
  where = (f"the batch script of SLURM job {job}" if 'SLURM_PROCID' in environ
           else f'a shell in SLURM job {job} (salloc)')
  if tasks and tasks > 1:
    raise UserError(f'This is {where}, not a job step: SLURM_NTASKS={tasks} on {nodes} node(s), but without srun '
                    f'`pax` would run as one process on {socket.gethostname()} while the other tasks idle. Start '
                    f'one process per task with: srun {command}  (or give --num-processes 1 to run one process '
                    'here on purpose).')
  return (f'Note: {where} has {tasks or 1} task and no job step (no SLURM_STEP_NODELIST): running as one '
          'process; srun starts one per task.')
