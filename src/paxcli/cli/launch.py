"""`pax launch`: N local processes of one pax command, joined by jax.distributed on 127.0.0.1; or, with
--slurm, the sbatch script that runs it on N nodes of a SLURM cluster (cli/launch_slurm.py).

For testing multi-process runs on one machine (and for CPU work): each child gets
PAX_COORDINATOR / PAX_NUM_PROCESSES / PAX_PROCESS_ID, its own fake CPU devices (or its
share of the GPUs), and no proxy variables. Children's lines are streamed with a
`[pN]` prefix, except gloo's `[Gloo] Rank N is connected to ...` start-up lines (one per process
and collective group, most of a short run's output), which are counted and shown with --verbose.
When a child fails, the launcher notes it for the others (runtime/peers.py: their watch reads the note at
its next beat and ends them in one line), gives them that long to end by themselves, and stops those still
running (SIGTERM, then SIGKILL after --grace seconds) instead of waiting for JAX's heartbeat timeout (100 s);
it exits non-zero naming the process that died first. Not SIGTERM at once: JAX's runtime takes it for a
preemption notice, whose agreement would wait, frozen, for the process that is gone.

With --max-restarts N (torchrun's idea), a failure stops every process and starts them all
again, up to N times; `pax train` resumes from the newest complete checkpoint of either tier.
With --heartbeat-timeout S, a process that has done a step but then goes S seconds without
another (a hang: a stopped process, a dead collective) is a failure too: each child touches
PAX_HEARTBEAT_FILE after every step; the children watch each other with the same timeout
(PAX_HEARTBEAT_TIMEOUT: runtime/peers.py). Every start, failure and restart goes into the job's
goodput ledger (goodput/launch.jsonl; the children say which job directory is theirs).

A child that exits 143 or 138 stopped for a preemption after saving the step all of them agreed on
(loops/train.py): the others get --exit-wait seconds to finish saving it before they are stopped. The
launcher's own SIGTERM is passed to every child the same way, and is never followed by a restart.

Exit codes (what a cluster's retry policy keys on): 0 every process finished; otherwise that
of the last failure: its exit code (2: the command was refused, 3: training diverged; these two
are never restarted, they would fail again), 128+N for a process killed by signal N, 124 for a
hang, 143 after a preemption, 130 when the launcher itself was interrupted.

Nothing here imports JAX (runtime.distributed and runtime.platform do not either); the children do.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import queue
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, List, Optional

import typer

from paxcli.cli import launch_slurm
from paxcli.errors import UserError
from paxcli.jobdir import layout
from paxcli.jobdir import ledger
from paxcli.jobdir import storage
from paxcli.runtime import distributed
from paxcli.runtime import jobset
from paxcli.runtime import peers
from paxcli.runtime import topology as tpu_topology
from paxcli.runtime.platform import detect_platform

_PREFIX = '[launch]'
HUNG = 124           # the launcher's exit code after a hang
PREEMPTED = (143, 138)   # a process stopped by SIGTERM or SIGUSR1 after saving the step every process agreed on
NOT_RESTARTED = (2, 3)  # a refused command (UserError) and a diverged run fail the same way again


def launch(
    ctx: typer.Context,
    processes: Optional[int] = typer.Option(None, '--processes', '-n', metavar='N', min=1,
                                            help='How many local processes to start (not with --slurm or --k8s).'),
    devices_per_process: Optional[int] = typer.Option(
        None, '--devices-per-process', metavar='K', min=1,
        help='Devices per process. CPU: fake devices (--xla_force_host_platform_device_count); '
             'default: as XLA_FLAGS says (1 unless set). GPU: process i gets GPUs i*K..i*K+K-1; '
             'default: the GPUs split evenly.'),
    port: Optional[int] = typer.Option(None, '--port', metavar='PORT', min=1, max=65535,
                                       help='Coordinator port on 127.0.0.1. Default: a free port.'),
    grace: float = typer.Option(5.0, '--grace', metavar='SECONDS', min=0.0,
                                help='Seconds between SIGTERM and SIGKILL when stopping processes.'),
    exit_wait: float = typer.Option(120.0, '--exit-wait', metavar='SECONDS', min=0.0,
                                    help='Seconds the others may run on after one process ended (finished, or '
                                         'stopped for a preemption) before they are stopped as hung.'),
    verbose: bool = typer.Option(False, '--verbose', '-v',
                                 help="Also show gloo's `[Gloo] Rank N is connected` start-up lines."),
    max_restarts: int = typer.Option(0, '--max-restarts', metavar='N', min=0,
                                     help='When a process dies or hangs, stop them all and start them all again, '
                                          'up to N times (train resumes from its newest checkpoint); with --slurm, '
                                          'requeue the job. Exit codes 2 (refused) and 3 (diverged) are never '
                                          'restarted.'),
    heartbeat_timeout: Optional[float] = typer.Option(
        None, '--heartbeat-timeout', metavar='SECONDS', min=1.0,
        help='A process that has done a train step but then goes this long without another is hung, and so is a '
             'process whose peer died or went off the network: stop all (and restart, with --max-restarts). Above '
             'the longest pause between steps (an eval, a save, a recompilation). Default: off locally; the '
             "processes' own 100 s."),
    k8s: bool = typer.Option(False, '--k8s', rich_help_panel='Kubernetes',
                             help='Start nothing: print a Kubernetes JobSet (GKE TPU slices) that runs the command on '
                                  'every host of --topology (--max-restarts: its restarts).'),
    topology: Optional[str] = typer.Option(None, '--topology', metavar='TYPE', rich_help_panel='Kubernetes',
                                           help='With --k8s: the TPU slice, e.g. v5p-128, v4-64, v5litepod-16, v6e-256.'),
    num_slices: int = typer.Option(1, '--num-slices', metavar='N', min=1, rich_help_panel='Kubernetes',
                                   help='With --k8s: N slices over DCN.'),
    image: Optional[str] = typer.Option(None, '--image', metavar='IMAGE', rich_help_panel='Kubernetes',
                                        help='With --k8s: the container image, with paxcli[tpu] installed.'),
    name: Optional[str] = typer.Option(None, '--name', metavar='NAME', rich_help_panel='Kubernetes',
                                       help='With --k8s: the JobSet name (default pax-<experiment>).'),
    slurm: bool = typer.Option(False, '--slurm', rich_help_panel='SLURM',
                               help='Write an sbatch script running the command on --nodes nodes of a SLURM cluster '
                                    '(into <job-log-dir>/slurm/) and show it; --submit submits it.'),
    nodes: Optional[int] = typer.Option(None, '--nodes', metavar='N', min=1, rich_help_panel='SLURM',
                                        help='Nodes of the SLURM job.'),
    tasks_per_node: int = typer.Option(1, '--tasks-per-node', metavar='T', min=1, rich_help_panel='SLURM',
                                       help='Processes per node: 1 (a process per node, driving all its devices) '
                                            'or one per device.'),
    gpus_per_node: Optional[int] = typer.Option(None, '--gpus-per-node', metavar='G', min=1,
                                                rich_help_panel='SLURM', help='GPUs to allocate on each node.'),
    time_limit: Optional[str] = typer.Option(None, '--time', metavar='LIMIT', rich_help_panel='SLURM',
                                             help="SLURM's time limit (HH:MM:SS); the job saves and requeues "
                                                  '--warn-before seconds ahead of it.'),
    partition: Optional[str] = typer.Option(None, '--partition', metavar='NAME', rich_help_panel='SLURM',
                                            help="SLURM partition. Default: the cluster's."),
    account: Optional[str] = typer.Option(None, '--account', metavar='NAME', rich_help_panel='SLURM',
                                          help='SLURM account to charge.'),
    job_name: Optional[str] = typer.Option(None, '--job-name', metavar='NAME', rich_help_panel='SLURM',
                                           help='Default: pax-<command>.'),
    sbatch_options: List[str] = typer.Option([], '--sbatch-option', metavar='--OPT=VALUE', rich_help_panel='SLURM',
                                             help='Another #SBATCH line, repeatable (e.g. --qos=high).'),
    env: List[str] = typer.Option([], '--env', metavar='KEY=VALUE',
                                  help='With --slurm or --k8s: a variable exported for every process (pod), '
                                       'repeatable (e.g. LIBTPU_INIT_ARGS=...).'),
    warn_before: int = typer.Option(120, '--warn-before', metavar='SECONDS', min=1, rich_help_panel='SLURM',
                                    help='SLURM signals SIGUSR1 this long before the time limit: the processes save '
                                         'the step they agree on and the job requeues.'),
    submit: bool = typer.Option(False, '--submit', rich_help_panel='SLURM', help='Submit the script with sbatch.'),
    dry_run: bool = typer.Option(False, '--dry-run', rich_help_panel='SLURM',
                                 help='Print the script; write and submit nothing.'),
    command: Optional[List[str]] = typer.Argument(
        None, metavar='-- COMMAND', show_default=False,
        help='The pax command every process runs, after --: e.g. -- train --exp E --job-log-dir D.'),
) -> None:
  """Run one pax command as N local processes (jax.distributed on 127.0.0.1), e.g. to test multi-host runs;
  or, with --slurm, on N nodes of a SLURM cluster; with --k8s, print a JobSet that runs it on a TPU slice on
  Kubernetes instead.

  Example: pax launch --processes 2 --devices-per-process 4 -- train --exp E --job-log-dir /tmp/run

  Example: pax launch --slurm --nodes 4 --gpus-per-node 8 --time 4:00:00 --submit -- train --exp E --job-log-dir
  /shared/runs/e

  Example: pax launch --k8s --topology v5p-128 --image IMAGE -- train --exp E --job-log-dir gs://B/run > jobset.yaml
  """
  local_only = {'--processes': processes is not None, '--port': port is not None, '--grace': grace != 5.0,
                '--exit-wait': exit_wait != 120.0, '--verbose': verbose}
  slurm_only = {'--nodes': nodes is not None, '--tasks-per-node': tasks_per_node != 1, '--gpus-per-node': gpus_per_node,
                '--time': time_limit, '--partition': partition, '--account': account, '--job-name': job_name,
                '--sbatch-option': sbatch_options, '--warn-before': warn_before != 120,
                '--submit': submit, '--dry-run': dry_run}
  k8s_only = {'--topology': topology, '--image': image, '--name': name, '--num-slices': num_slices != 1}
  runnable = _multiprocess_commands(ctx.parent.command)
  if k8s:
    _refuse({**local_only, **slurm_only, '--slurm': slurm}, 'describe other launches than a Kubernetes JobSet')
    print_jobset(command or [], runnable, topology, num_slices, image, name, env, max_restarts)
    return
  given = [o for o, v in k8s_only.items() if v]
  if given:
    raise UserError(f'{", ".join(given)} describe(s) a Kubernetes job: add --k8s (or leave them out to start '
                    'local processes).')
  if slurm:
    _refuse(local_only, 'run local processes; --slurm counts --nodes x --tasks-per-node')
    if nodes is None:
      raise UserError('--slurm needs --nodes N (and --tasks-per-node T for a process per device).')
    if gpus_per_node and devices_per_process:
      raise UserError('--devices-per-process sets fake CPU devices; with --gpus-per-node each process drives its '
                      'share of the node\'s GPUs (--tasks-per-node).')
    job = launch_slurm.Job(nodes, tasks_per_node, gpus_per_node, devices_per_process, time_limit, partition, account,
                           job_name, tuple(sbatch_options), tuple(env), warn_before, max_restarts, heartbeat_timeout)
    _slurm(job, _command(command or [], runnable), submit, dry_run)
    return
  _refuse({**slurm_only, '--env': env}, 'go with --slurm (--env with --k8s too)')
  if processes is None:
    raise UserError('Give --processes N (local processes), or --slurm --nodes N for a SLURM job (--k8s for a '
                    'Kubernetes JobSet).')
  argv = [sys.executable, '-m', 'paxcli.cli.app', *_command(command or [], runnable)]
  make_envs = lambda: _child_envs(processes, devices_per_process, port or free_port(), heartbeat_timeout)
  code = run_job(argv, make_envs, grace=grace, exit_wait=exit_wait, max_restarts=max_restarts,
                 heartbeat_timeout=heartbeat_timeout, end_at_exit=True, verbose=verbose)
  if code:
    raise typer.Exit(code)


def print_jobset(command: list[str], runnable: set[str], topology: Optional[str], num_slices: int,
                 image: Optional[str], name: Optional[str], env: list[str], max_restarts: int) -> None:
  """`pax launch --k8s`: the JobSet YAML on stdout (paxcli.runtime.jobset), notes on stderr."""
  command = _command(command, runnable)   # checked as a local launch checks it
  if not topology or not image:
    raise UserError('--k8s needs --topology (the TPU slice, e.g. v5p-128) and --image (a container image with '
                    "paxcli[tpu] installed).")
  tpu = tpu_topology.parse(topology, num_slices)
  if tpu.generation not in jobset.GKE_ACCELERATOR:
    raise UserError(f'--topology {topology}: GKE has no {tpu.generation} node pools paxcli knows.')
  flags = [a for a in command if a.split('=', 1)[0] in ('--coordinator', '--num-processes', '--process-id')]
  if flags:
    raise UserError(f'{flags[0].split("=", 1)[0]} in a --k8s command: JAX reads the pods\' own environment '
                    '(TPU_WORKER_HOSTNAMES, TPU_WORKER_ID, MEGASCALE_*) on GKE; leave it out.')
  variables = {}
  for item in env:
    key, sep, value = item.partition('=')
    if not sep or not re.fullmatch(r'[A-Za-z_][A-Za-z0-9_]*', key):
      raise UserError(f'--env {item!r} is not KEY=VALUE (e.g. --env LIBTPU_INIT_ARGS=--xla_tpu_...).')
    variables[key] = value
  name = jobset.check_name(name) if name else jobset.default_name(command)
  note = jobset.job_dir_note(command)
  if note:
    print(note, file=sys.stderr)
  doc = jobset.manifest(tpu, command, image, name, max_restarts=max_restarts, env=variables)
  sys.stdout.write(jobset.to_yaml(doc, command, tpu))


def _child_argv(command: list[str], runnable: set[str]) -> list[str]:
  """`python -m paxcli.cli.app COMMAND...`, after checking that COMMAND is one of `runnable`."""
def _refuse(given: dict, why: str) -> None:
  names = [name for name, value in given.items() if value]
  if names:
    raise UserError(f'{", ".join(names)} {"does" if len(names) == 1 else "do"} not go with this launch: those options '
                    f'{why}.')


def _slurm(job: launch_slurm.Job, command: list[str], submit: bool, dry_run: bool) -> None:
  """Writes (or with dry_run prints) the sbatch script, shows it, and submits it if asked."""
  from paxcli import api   # the default job directory names the experiment: imported here, not for `pax --help`
  command, job_dir = launch_slurm.with_job_dir(command, api.default_job_dir)
  if dry_run:
    sys.stdout.write(launch_slurm.script(job, command, job_dir))
    return
  path = launch_slurm.write(job, command, job_dir)
  with open(path, encoding='utf-8') as f:
    sys.stdout.write(f.read())
  sys.stdout.write(f'\nWrote {path}\n')
  if not submit:
    sys.stdout.write(f'Submit it with: sbatch {shlex.quote(path)}   (or this command with --submit)\n')
    return
  job_id = launch_slurm.submit(path)
  out = os.path.join(os.path.dirname(path), f'{os.path.basename(path)[:-len(".sbatch")]}-{job_id}.out')
  sys.stdout.write(f'Submitted SLURM job {job_id}. Its output: {out}\n'
                   f'  squeue -j {job_id}     pax goodput {shlex.quote(job_dir)}     scancel {job_id}\n')


def _command(command: list[str], runnable: set[str]) -> list[str]:
  """COMMAND... (after `--`, without a leading `pax`), after checking that it is one of `runnable`."""
  if command[:1] == ['pax']:
    command = command[1:]
  if not command:
    raise UserError('Give the pax command to run after --, e.g. '
                    '`pax launch --processes 2 -- train --exp E --job-log-dir /tmp/run`.')
  if command[0] not in runnable:
    raise UserError(f'`pax {command[0]}` cannot run as several processes; pax launch runs: '
                    f'{", ".join(sorted(runnable))}.')
  return command


def _multiprocess_commands(group) -> set[str]:
  """The subcommands of `pax` (the click group launch runs under) that take --coordinator, so
  read PAX_COORDINATOR. Read from the running command tree: launch never imports the app."""
  return {name for name, command in group.commands.items()
          if any(param.name == 'coordinator' for param in command.params)}


def free_port() -> int:
  """A TCP port free on 127.0.0.1 right now (the coordinator binds it moments later)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _child_envs(n: int, devices_per_process: Optional[int], port: int,
                heartbeat_timeout: Optional[float] = None) -> list[dict[str, str]]:
  platform = detect_platform()
  cpu_devices, visible = devices_per_process, [None] * n
  if platform == 'tpu':
    raise UserError('pax launch starts processes on CPU or GPU. On Cloud TPU run `pax train` once per '
                    'host (JAX detects the TPU cluster), or set JAX_PLATFORMS=cpu to test on CPU.')
  if platform == 'gpu':
    per = devices_per_process or _even_gpu_share(n)
    cpu_devices, visible = None, [list(range(i * per, (i + 1) * per)) for i in range(n)]
  coordinator = f'127.0.0.1:{port}'
  return [distributed.child_environment(os.environ, coordinator, n, i, cpu_devices=cpu_devices,
                                        visible_devices=visible[i], heartbeat_timeout=heartbeat_timeout)
          for i in range(n)]


def _even_gpu_share(n: int) -> int:
  try:
    out = subprocess.run(['nvidia-smi', '-L'], capture_output=True, text=True, timeout=30).stdout
  except (OSError, subprocess.SubprocessError):
    out = ''
  count = sum(1 for line in out.splitlines() if line.startswith('GPU '))
  if count == 0 or count % n:
    raise UserError(f'Cannot split {count or "an unknown number of"} GPUs evenly over {n} processes; '
                    'give --devices-per-process.')
  return count // n


# ---- running the children -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Failure:
  """The first process to fail in an attempt: which, its exit code (None: hung), and in words."""
  index: int
  code: Optional[int]
  reason: str
  steps: dict   # process index -> the last step its heartbeat reported

  @property
  def exit_code(self) -> int:
    if self.code is None:
      return HUNG
    return self.code if self.code > 0 else 128 - self.code


def run_children(argv: list[str], envs: list[dict[str, str]], grace: float = 5.0,
                 exit_wait: float = 120.0, verbose: bool = False) -> int:
  """Starts one child per environment, streams output, returns the launcher's exit code (no restarts)."""
  return run_job(argv, lambda: envs, grace=grace, exit_wait=exit_wait, verbose=verbose)


def run_job(argv: list[str], make_envs: Callable[[], list[dict[str, str]]], grace: float = 5.0,
            exit_wait: float = 120.0, max_restarts: int = 0, heartbeat_timeout: Optional[float] = None,
            end_at_exit: bool = False, verbose: bool = False) -> int:
  """Runs the children, and again after each failure up to `max_restarts` times; the launcher's exit code.

  end_at_exit: the ledger's `end` line is written when this process exits (`pax launch`: the job's
  wall time then ends where the launcher's does), else now. verbose: gloo's connection lines are shown."""
  lock, record = threading.RLock(), _LaunchRecord()   # re-entrant: the SIGTERM handler speaks too
  code = 0
  _PREEMPTION.clear()
  for attempt in range(max_restarts + 1):
    beats = tempfile.mkdtemp(prefix='pax-launch-')
    try:
      envs = [dict(env, **{distributed.ENV_LAUNCH: f'{record.id}:{attempt}',
                           distributed.ENV_HEARTBEAT: os.path.join(beats, f'p{i}')})
              for i, env in enumerate(make_envs())]
      record.add('attempt', attempt=attempt, processes=len(envs))
      failure = _attempt(argv, envs, grace, exit_wait, heartbeat_timeout, lock, verbose)
      record.learn_job(beats)
    except KeyboardInterrupt:
      code = 130
      break
    finally:
      shutil.rmtree(beats, ignore_errors=True)
    if failure is None:
      code = 0
      break
    code = failure.exit_code
    record.add('failure', attempt=attempt, process=failure.index, reason=failure.reason,
               steps={str(k): v for k, v in failure.steps.items()})
    if failure.code in NOT_RESTARTED:
      _say(lock, f'not restarting: exit code {failure.code} ({"refused" if failure.code == 2 else "diverged"}) '
                 'would come back the same.')
      break
    if _PREEMPTION.is_set():
      _say(lock, 'not restarting: the launcher itself was asked to stop (SIGTERM).')
      break
    if attempt < max_restarts:
      _say(lock, f'restart {attempt + 1} of {max_restarts}: starting all {len(envs)} processes again.')
    elif max_restarts:
      _say(lock, f'no restarts left (--max-restarts {max_restarts}); giving up.')
  if end_at_exit:  # as late as Python lets it
    atexit.register(record.add, 'end', code=code)
  else:
    record.add('end', code=code)
  return code


class _LaunchRecord:
  """The launcher's lines for the job's goodput ledger, kept until a child names its job directory."""

  def __init__(self):
    self.id = secrets.token_hex(6)
    self.job_dir: Optional[str] = None
    self._pending = [{'kind': 'launch', 'id': self.id, 't': ledger.command_started(), **ledger.whereabouts()}]

  def add(self, kind: str, **fields) -> None:
    self._pending.append({'kind': kind, 'id': self.id, 't': time.time(), **fields})
    self.flush()

  def learn_job(self, beats: str) -> None:
    """The job directory a child wrote beside its heartbeat file (Heartbeat.note_job)."""
    if self.job_dir is None:
      for name in sorted(os.listdir(beats)):
        if name.endswith('.job'):
          with open(os.path.join(beats, name), encoding='utf-8') as f:
            text = f.read(4096).strip()
          if not storage.is_local(text) or (os.path.isabs(text) and os.path.isdir(text)):
            self.job_dir = text   # as the child holds it (storage.absolute): a local path, or gs://...
            break

  def flush(self) -> None:
    if self.job_dir is not None and self._pending:
      try:
        ledger.append(layout.launch_ledger(self.job_dir), self._pending)
      except (OSError, UserError) as e:   # a full disk, an unreachable bucket: the job goes on without it
        sys.stderr.write(f'{_PREFIX} could not write the goodput ledger ({e}); going on without it.\n')
      self._pending = []


def _attempt(argv: list[str], envs: list[dict[str, str]], grace: float, exit_wait: float,
             heartbeat_timeout: Optional[float], lock: threading.Lock, verbose: bool = False) -> Optional[Failure]:
  """One start of every child; None when all finished, else the first failure (all stopped by then)."""
  procs = [_spawn(argv, env) for env in envs]
  hidden = _Hidden(verbose)
  readers = [threading.Thread(target=_pump, args=(stream, out, f'[p{i}] ', lock, hidden), daemon=True)
             for i, p in enumerate(procs) for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr))]
  try:
    return _supervise(procs, readers, envs, lock, grace, exit_wait, heartbeat_timeout)
  finally:
    if hidden.count:
      _say(lock, f'{hidden.count} "[Gloo] Rank N is connected" line(s) hidden; --verbose shows them.')


class _Hidden:
  """Which children's lines the launcher leaves out (gloo's connection chatter unless verbose), counted.

  gloo's threads write their `[Gloo] Rank N is connected to K peer ranks. Expected number of connected
  peer ranks is : K` lines in pieces that interleave anywhere (`[Gloo] Rank [Gloo] Rank 12 is connected to
  is connected to 33 ...`, then a line of the rest, or an empty one): a line is chatter when it holds one of
  these pieces and nothing else.
  """
  PIECES = re.compile(r'\[Gloo\] Rank|is connected to|Expected number of connected peer ranks is ?:|peer ranks\.?|\d+|\s+')
  MARKS = ('Gloo', 'is connected', 'peer ranks')

  def __init__(self, verbose: bool):
    self.verbose, self.count = verbose, 0

  def __call__(self, line: str) -> bool:
    if self.verbose or not any(m in line for m in self.MARKS) or self.PIECES.sub('', line):
      return False
    self.count += 1
    return True


def _supervise(procs, readers, envs, lock: threading.Lock, grace: float, exit_wait: float,
               heartbeat_timeout: Optional[float]) -> Optional[Failure]:
  """Waits for the children, stops them all when one fails or hangs; None when all finished, else the first
  failure."""
  events: queue.Queue = queue.Queue()
  waiters = [threading.Thread(target=lambda i=i, p=p: events.put((i, p.wait())), daemon=True)
             for i, p in enumerate(procs)]
  for t in readers + waiters:
    t.start()
  _say(lock, f'{len(procs)} processes, coordinator {envs[0].get("PAX_COORDINATOR", "?")}: ' +
       ', '.join(f'p{i} pid {p.pid}' for i, p in enumerate(procs)))
  beats = _Heartbeats([env.get(distributed.ENV_HEARTBEAT) for env in envs], heartbeat_timeout)
  previous = signal.signal(signal.SIGTERM, _forward(procs, lock)) if _main_thread() else None
  try:
    failure = _watch(procs, events, lock, exit_wait, beats)
  except KeyboardInterrupt:
    _stop(procs, grace, lock)
    _drain(readers)
    _say(lock, 'interrupted; stopped all processes.')
    raise
  finally:
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)
  if failure is None:
    _drain(readers)
    return None
  failure = dataclasses.replace(failure, steps=beats.steps())
  if failure.code is not None:   # an exit, not a hang: the others are told, and end in their own words
    _note_failure(envs, failure)
    _let_end(procs, _others_end(heartbeat_timeout))
  _stop(procs, grace, lock)
  _drain(readers)
  pid = procs[failure.index].pid
  if failure.code is None:
    _say(lock, f'process p{failure.index} (pid {pid}) {failure.reason}; stopped it and the others.')
  else:
    _say(lock, f'process p{failure.index} (pid {pid}) {failure.reason}; stopped the other processes.')
  return failure


class _Heartbeats:
  """The children's heartbeat files: a child whose last beat is older than the timeout is hung.

  A child is watched from its first beat on (after its first step: start-up and the first
  compilation are not timed)."""

  def __init__(self, paths: list[Optional[str]], timeout: Optional[float]):
    self.paths, self.timeout = paths, timeout

  def hung(self) -> Optional[tuple[int, float]]:
    """(index, seconds since its beat) of the child silent longest past the timeout, or None."""
    if not self.timeout:
      return None
    now, stale = time.time(), []
    for i, path in enumerate(self.paths):
      try:
        silent = now - os.stat(path).st_mtime
      except (OSError, TypeError):
        continue
      if silent > self.timeout:
        stale.append((silent, i))
    if not stale:
      return None
    silent, index = max(stale)
    return index, silent

  def steps(self) -> dict[int, int]:
    """The last step each child's heartbeat reported."""
    out = {}
    for i, path in enumerate(self.paths):
      try:
        with open(path, 'rb') as f:
          out[i] = int(f.read(64).split()[0])
      except (OSError, TypeError, ValueError, IndexError):
        continue
    return out


def _spawn(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
  return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, preexec_fn=_die_with_parent_fn())


def _die_with_parent_fn():
  """A preexec_fn that kills the child when the launcher dies, however it dies (Linux), or None.

  The signal is SIGKILL: a child blocked in a collective never runs a SIGTERM handler, and
  JAX's distributed runtime installs one (its preemption notifier), so SIGTERM left the
  children running forever after a `kill -9` of the launcher. prctl is looked up here, in
  the parent: the child, between fork and exec, only calls it, then checks that the
  launcher did not die before the call (the signal would never come).
  """
  try:
    import ctypes
    prctl = ctypes.CDLL(None, use_errno=True).prctl
  except (OSError, AttributeError):
    return None
  launcher = os.getpid()

  def die_with_parent():
    prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != launcher:
      os._exit(1)
  return die_with_parent


def _pump(stream, out, prefix: str, lock: threading.Lock, hide=lambda line: False) -> None:
  """Copies a child's lines to our stdout/stderr with its prefix, except those `hide` takes (and an
  empty line right after one: the end of a line it took, cut apart)."""
  hid = False
  for raw in iter(stream.readline, b''):
    line = raw.decode('utf-8', errors='replace').rstrip('\r\n')
    with lock:
      if hide(line) or (hid and not line.strip()):
        hid = True
        continue
      hid = False
      try:
        out.write(prefix + line + '\n')
        out.flush()
      except (OSError, ValueError):  # our own output closed: keep draining the child's pipe
        pass
  stream.close()


def _watch(procs, events: queue.Queue, lock: threading.Lock, exit_wait: float,
           beats: Optional[_Heartbeats] = None) -> Optional[Failure]:
  """Waits for every child; returns the first failure (a non-zero exit or a hang), or None."""
  running = set(range(len(procs)))
  first_clean = None
  while running:
    try:
      index, code = events.get(timeout=0.25)
    except queue.Empty:
      if first_clean is not None and time.monotonic() - first_clean > exit_wait:
        hung = ', '.join(f'p{i}' for i in sorted(running))
        _say(lock, f'{hung} still running {exit_wait:g} s after another process finished; '
                   'stopping them as hung.')
        return Failure(min(running), None, f'still running {exit_wait:g} s after another finished', {})
      silent = beats.hung() if beats is not None else None
      if silent is not None and silent[0] in running:
        return Failure(silent[0], None, f'hung: no heartbeat for {silent[1]:.1f} s (--heartbeat-timeout '
                       f'{beats.timeout:g})', {})
      continue
    running.discard(index)
    if code in PREEMPTED:   # they agreed on a step and save it: the others end by themselves
      return _preempted(index, code, running, events, lock, exit_wait)
    if code != 0:
      return Failure(index, code, _describe_exit(code), {})
    first_clean = first_clean or time.monotonic()
  return None


def _preempted(index: int, code: int, running: set, events: queue.Queue, lock: threading.Lock,
               exit_wait: float) -> Failure:
  """A process stopped for a preemption after saving: the others stopped at the same step and are saving
  it too, so they get up to `exit_wait` seconds to end by themselves before they are stopped."""
  _say(lock, f'p{index} stopped for preemption (exit code {code}); waiting for the other processes to save '
             'the same step and end.')
  deadline = time.monotonic() + exit_wait
  while running and time.monotonic() < deadline:
    try:
      other, _ = events.get(timeout=0.25)
    except queue.Empty:
      continue
    running.discard(other)
  return Failure(index, code, f'stopped for preemption (exit code {code})', {})


def _note_failure(envs, failure: Failure) -> None:
  """Writes the failed child's line where the others' watch reads it (peers.LAUNCHER_NOTE): a child killed
  outright could not say it itself."""
  beat = envs[0].get(distributed.ENV_HEARTBEAT)
  if not beat:
    return
  path = peers.launcher_note(beat)
  line = f'lost process {failure.index} on {socket.gethostname()}: pax launch saw it {failure.reason}'
  try:
    with open(path + '.tmp', 'w', encoding='utf-8') as f:
      f.write(line[:peers.MAX_NOTE_BYTES])
    os.replace(path + '.tmp', path)
  except OSError:
    pass   # the others still find out by their own watch, within its timeout


def _others_end(heartbeat_timeout: Optional[float]) -> float:
  """How long the others get to end by themselves after a child failed, before SIGTERM: their watch reads the
  launcher's note at its next beat, and ends them in one line. A SIGTERM first would be taken by JAX's runtime as
  a preemption notice, whose agreement waits (holding Python's lock: nothing else in that process runs) for the
  process that is gone."""
  return peers.beat_every(heartbeat_timeout or peers.DEFAULT_TIMEOUT) + 10.0


def _let_end(procs, seconds: float) -> None:
  """Waits up to `seconds` for the running children to end by themselves."""
  deadline = time.monotonic() + seconds
  for p in procs:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      return


def _stop(procs, grace: float, lock: threading.Lock) -> None:
  """SIGTERM to every running child, SIGKILL to those still running after `grace` seconds."""
  alive = [p for p in procs if p.poll() is None]
  for p in alive:
    _signal(p, signal.SIGTERM)
  _let_end(alive, grace)
  for p in alive:
    if p.poll() is None:
      _signal(p, signal.SIGKILL)
      _say(lock, f'pid {p.pid} did not stop within {grace:g} s of SIGTERM; killed it.')
  for p in alive:
    try:
      p.wait(timeout=10)
    except subprocess.TimeoutExpired:  # unkillable (e.g. stuck in the kernel): do not hang on it
      _say(lock, f'pid {p.pid} survived SIGKILL for 10 s; leaving it.')


def _signal(proc: subprocess.Popen, sig: int) -> None:
  try:
    proc.send_signal(sig)
  except ProcessLookupError:
    pass


def _drain(readers, timeout: float = 5.0) -> None:
  deadline = time.monotonic() + timeout
  for t in readers:
    t.join(max(0.0, deadline - time.monotonic()))


def _describe_exit(code: int) -> str:
  if code < 0:
    try:
      name = signal.Signals(-code).name
    except ValueError:
      name = f'signal {-code}'
    return f'was killed by {name} (exit code {code})'
  return f'exited with code {code}'


def _say(lock: threading.Lock, message: str) -> None:
  with lock:
    sys.stderr.write(f'{_PREFIX} {message}\n')
    sys.stderr.flush()


# Set when the launcher got SIGTERM (a preemption of the machine it runs on): no restart after it.
_PREEMPTION = threading.Event()


def _forward(procs, lock: threading.Lock):
  """The launcher's SIGTERM handler: a preemption of the job, handed to every process (they agree on a step,
  save it and exit 143; the launcher waits for them as for any preemption, then exits the same)."""

  def handle(signum, frame):
    del frame
    _PREEMPTION.set()
    for p in procs:
      if p.poll() is None:
        _signal(p, signum)
    _say(lock, 'SIGTERM: passed to every process, to save and stop.')
  return handle


def _main_thread() -> bool:
  return threading.current_thread() is threading.main_thread()


def register(app: typer.Typer) -> None:
  # Unknown options after the command name belong to it: `launch -n 2 train --exp E` works without `--`.
  app.command('launch', no_args_is_help=True, short_help='Run a pax command as N local processes.',
              context_settings={'allow_interspersed_args': False, 'ignore_unknown_options': True})(launch)
