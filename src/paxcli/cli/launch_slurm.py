"""`pax launch --slurm`: the sbatch script of a pax command on N nodes, shown, written, submitted if asked.

The script holds what a SLURM user otherwise gets wrong by hand:

- `srun` starts one process per task (a process per node, or per device with --tasks-per-node), so
  JAX finds the job step; paxcli picks a coordinator port of the step's own (runtime/slurm.py);
- pax runs by the interpreter paxcli is installed in, and srun passes the script's environment on
  (`--export=ALL`), so `sbatch --export=NONE` cannot lose the virtual environment's PATH;
- restarts are SLURM's own requeue: after a preemption signal (`scancel --signal=TERM`, or the
  SIGUSR1 SLURM sends --warn-before seconds ahead of the time limit) every process saves the step
  they agreed on and exits 143, and the script requeues the job; after a failure (a process killed,
  a host lost) it requeues up to --max-restarts times; exit codes 2 (refused) and 3 (diverged) are
  never requeued. Each requeue starts from the newest checkpoint, and `pax goodput` counts it;
- SLURM's output of every requeue goes to one file beside the script (--open-mode=append).

The job's files go into <job-log-dir>/slurm/ (a job directory in a bucket: ./slurm/ here).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
from typing import Callable, Optional

from paxcli import __version__
from paxcli.errors import UserError
from paxcli.jobdir import layout
from paxcli.jobdir import storage
from paxcli.runtime import distributed

NEVER_REQUEUED = (0, 2, 3, 130)   # finished, refused, diverged, interrupted by hand
PREEMPTED = (138, 143)             # saved the agreed step on SIGUSR1 / SIGTERM: always requeued
_NAME = re.compile(r'[A-Za-z0-9][A-Za-z0-9._-]{0,63}')
_TIME = re.compile(r'\d+(-\d+)?(:\d+){0,2}')


@dataclasses.dataclass(frozen=True)
class Job:
  """What the script asks SLURM for, checked (`check`) before any text is written from it."""
  nodes: int
  tasks_per_node: int = 1
  gpus_per_node: Optional[int] = None
  cpu_devices: Optional[int] = None      # fake CPU devices per process (tests, CPU clusters)
  time: Optional[str] = None
  partition: Optional[str] = None
  account: Optional[str] = None
  name: Optional[str] = None
  sbatch_options: tuple = ()
  env: tuple = ()                        # KEY=VALUE, exported for every process
  warn_before: int = 120                 # seconds: SIGUSR1 before the time limit
  max_restarts: int = 0                  # requeues after failures (preemptions are always requeued)
  heartbeat_timeout: Optional[float] = None

  def check(self) -> None:
    for option, value in (('--partition', self.partition), ('--account', self.account), ('--job-name', self.name)):
      if value is not None and not _NAME.fullmatch(value):
        raise UserError(f'{option} {value!r}: SLURM names here are letters, digits, ".", "_" and "-" (up to 64).')
    if self.time is not None and not _TIME.fullmatch(self.time):
      raise UserError(f'--time {self.time!r} is not a SLURM time limit: MINUTES, HH:MM:SS or DAYS-HH:MM:SS.')
    for option in self.sbatch_options:
      if not option.startswith('--') or not option.isprintable() or '#' in option:
        raise UserError(f'--sbatch-option {option!r}: give one sbatch option on one line, e.g. --qos=high.')
    for pair in self.env:
      key, eq, value = pair.partition('=')
      if not eq or not re.fullmatch(r'[A-Za-z_][A-Za-z0-9_]*', key) or not value.isprintable():
        raise UserError(f'--env {pair!r}: give KEY=VALUE, a variable name and a one-line value.')


def with_job_dir(command: list[str], default_job_dir: Callable[[Optional[str], list], str]) -> tuple[list[str], str]:
  """(command with its --job-log-dir absolute, that directory): the command's own --job-log-dir, else the one
  it would default to (`default_job_dir(exp, overrides)`: ./runs/<experiment>), resolved here, once."""
  rest, given, exp, overrides = [], None, None, []
  i = 0
  while i < len(command):
    arg = command[i]
    name, eq, value = arg.partition('=')
    takes = name.replace('_', '-') in ('--job-log-dir', '--exp', '-e', '--set', '-s')
    if takes and not eq:
      if i + 1 >= len(command):
        raise UserError(f'{arg} needs a value.')
      value, i = command[i + 1], i + 1
    i += 1
    key = name.replace('_', '-')
    if key == '--job-log-dir' and takes:
      given = value
      continue
    if key in ('--exp', '-e') and takes:
      exp = value
    elif key in ('--set', '-s') and takes:
      overrides.append(value)
    rest += [arg] if eq or not takes else [arg, value]
  job_dir = layout.absolute(given or default_job_dir(exp, overrides), '--job-log-dir')
  return [*rest, '--job-log-dir', job_dir], job_dir


def files_dir(job_dir: str) -> str:
  """Where the script and SLURM's output go: the job directory's slurm/, or ./slurm for a job in a bucket
  (SLURM writes its output on a node's file system)."""
  return layout.slurm(job_dir) if storage.is_local(job_dir) else os.path.abspath('slurm')


def script(job: Job, argv: list[str], job_dir: str, interpreter: str = sys.executable) -> str:
  """The sbatch script running `pax ARGV` (its --job-log-dir: `job_dir`) as `job` says."""
  job.check()
  where = files_dir(job_dir)
  name = job.name or f'pax-{argv[0]}'
  lines = ['#!/bin/bash',
           f'# Written by `pax launch --slurm` (paxcli {__version__}). Submit it with: sbatch '
           f'{shlex.quote(_path(where, name))}',
           f'# {job.nodes} node(s) x {job.tasks_per_node} process(es); each process is one `pax {argv[0]}` of the job.',
           f'#SBATCH --job-name={name}',
           f'#SBATCH --nodes={job.nodes}',
           f'#SBATCH --ntasks-per-node={job.tasks_per_node}']
  lines += [f'#SBATCH --gpus-per-node={job.gpus_per_node}'] if job.gpus_per_node else []
  lines += [f'#SBATCH --{k}={v}' for k, v in (('time', job.time), ('partition', job.partition),
                                                ('account', job.account)) if v]
  lines += [f'#SBATCH --chdir={_sbatch_path(os.getcwd())}',
            f'#SBATCH --output={_sbatch_path(where)}/%x-%j.out',
            '#SBATCH --open-mode=append',
            '#SBATCH --requeue',
            f'#SBATCH --signal=USR1@{job.warn_before}']
  lines += [f'#SBATCH {option}' for option in job.sbatch_options]
  lines += ['', 'set -u']
  env = dict(pair.partition('=')[::2] for pair in job.env)
  if job.cpu_devices:
    env['XLA_FLAGS'] = _with_device_count(env.get('XLA_FLAGS', os.environ.get('XLA_FLAGS', '')), job.cpu_devices)
  if job.heartbeat_timeout:
    env[distributed.ENV_HEARTBEAT_TIMEOUT] = f'{job.heartbeat_timeout:g}'
  lines += [f'export {k}={shlex.quote(v)}' for k, v in env.items()]
  command = shlex.join([interpreter, '-m', 'paxcli.cli.app', *argv])
  failures = shlex.quote(f'{where}/{name}') + '-$SLURM_JOB_ID.failures'
  lines += [
      'restart=${SLURM_RESTART_COUNT:-0}',
      'echo "[pax-slurm] job $SLURM_JOB_ID, start $((restart + 1)): $SLURM_JOB_NUM_NODES node(s)'
      ' ($SLURM_JOB_NODELIST)"',
      "trap 'echo \"[pax-slurm] SIGTERM: the processes save the step they agree on and stop\"' TERM",
      '# One process per task. --export=ALL: this environment (PATH or not) reaches every process. A process',
      '# killed by a signal ends the step at once; after one that exits, the others end by themselves (a',
      '# preemption: saving the same step; a failure: they stop within --heartbeat-timeout, naming it).',
      f'srun --export=ALL {command}',
      'code=$?',
      'case $code in',
      '  0) echo "[pax-slurm] finished."; exit 0 ;;',
      f'  {_cases(NEVER_REQUEUED[1:])}) echo "[pax-slurm] exit code $code: not requeued (it would end the same way)."; '
      'exit $code ;;',
      f'  {_cases(PREEMPTED)}) echo "[pax-slurm] stopped for preemption after saving (exit code $code); requeueing." ;;',
      f'  *) failed=$(( $(cat {failures} 2>/dev/null || echo 0) + 1 ))',
      f'     echo $failed > {failures}',
      f'     if [ $failed -gt {job.max_restarts} ]; then',
      f'       echo "[pax-slurm] exit code $code; failure $failed, past --max-restarts {job.max_restarts}: not '
      'requeued."',
      '       exit $code',
      '     fi',
      f'     echo "[pax-slurm] exit code $code; failure $failed of at most {job.max_restarts} requeued." ;;',
      'esac',
      'scontrol requeue "$SLURM_JOB_ID" && exit 0',
      'echo "[pax-slurm] scontrol requeue failed; the job ends here."',
      'exit $code',
      '']
  return '\n'.join(lines)


def _cases(codes) -> str:
  return '|'.join(str(c) for c in codes)


def _path(where: str, name: str) -> str:
  return os.path.join(where, f'{name}.sbatch')


def _sbatch_path(path: str) -> str:
  """A path for an #SBATCH line, which sbatch does not unquote: one without spaces or '%'."""
  if any(c.isspace() or c in '%#"\'\\' for c in path):
    raise UserError(f'{path}: SLURM output paths here cannot hold spaces, quotes or "%"; use another --job-log-dir.')
  return path


def _with_device_count(flags: str, count: int) -> str:
  kept = [f for f in flags.split() if not f.startswith('--xla_force_host_platform_device_count')]
  return ' '.join(kept + [f'--xla_force_host_platform_device_count={count}'])


def write(job: Job, argv: list[str], job_dir: str) -> str:
  """Writes the script into files_dir(job_dir) (made if missing); returns its path."""
  text = script(job, argv, job_dir)
  where = files_dir(job_dir)
  os.makedirs(where, exist_ok=True)
  path = _path(where, job.name or f'pax-{argv[0]}')
  with open(path, 'w', encoding='utf-8') as f:
    f.write(text)
  os.chmod(path, 0o755)
  return path


def submit(path: str) -> str:
  """`sbatch PATH`; the job id."""
  sbatch = shutil.which('sbatch')
  if sbatch is None:
    raise UserError(f'sbatch is not on PATH here: run `sbatch {path}` on a machine of the cluster.')
  done = subprocess.run([sbatch, '--parsable', path], capture_output=True, text=True, timeout=120)
  if done.returncode:
    said = (done.stderr or done.stdout).strip().splitlines()
    raise UserError(f'sbatch {path} failed: {said[-1] if said else f"exit code {done.returncode}"}')
  return done.stdout.strip().split(';')[0]
