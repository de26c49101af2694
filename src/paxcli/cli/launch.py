"""`pax launch`: N local processes of one pax command, joined by jax.distributed on 127.0.0.1.

For testing multi-process runs on one machine (and for CPU work): each child gets
PAX_COORDINATOR / PAX_NUM_PROCESSES / PAX_PROCESS_ID, its own fake CPU devices (or its
share of the GPUs), and no proxy variables. Children's lines are streamed with a
`[pN]` prefix, except gloo's `[Gloo] Rank N is connected to ...` start-up lines (one per process
and collective group, most of a short run's output), which are counted and shown with --verbose.
When a child fails, the others are stopped (SIGTERM, then SIGKILL after
--grace seconds) instead of waiting for JAX's heartbeat timeout (100 s), and the
launcher exits non-zero naming the process that died first.

Nothing here imports JAX (runtime.distributed and runtime.platform do not either); the children do.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import List, Optional

import typer

from paxcli.errors import UserError
from paxcli.runtime import distributed
from paxcli.runtime.platform import detect_platform

_PREFIX = '[launch]'


def launch(
    ctx: typer.Context,
    processes: int = typer.Option(..., '--processes', '-n', metavar='N', min=1, help='How many local processes to start.'),
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
                                    help='Seconds the others may run on after one process finished '
                                         'cleanly before they are stopped as hung.'),
    verbose: bool = typer.Option(False, '--verbose', '-v',
                                 help="Also show gloo's `[Gloo] Rank N is connected` start-up lines."),
    command: Optional[List[str]] = typer.Argument(
        None, metavar='-- COMMAND', show_default=False,
        help='The pax command every process runs, after --: e.g. -- train --exp E --job-log-dir D.'),
) -> None:
  """Run one pax command as N local processes (jax.distributed on 127.0.0.1), e.g. to test multi-host runs.

  Example: pax launch --processes 2 --devices-per-process 4 -- train --exp E --job-log-dir /tmp/run
  """
  argv = _child_argv(command or [], _multiprocess_commands(ctx.parent.command))
  envs = _child_envs(processes, devices_per_process, port or free_port())
  code = run_children(argv, envs, grace=grace, exit_wait=exit_wait, verbose=verbose)
  if code:
    raise typer.Exit(code)


def _child_argv(command: list[str], runnable: set[str]) -> list[str]:
  """`python -m paxcli.cli.app COMMAND...`, after checking that COMMAND is one of `runnable`."""
  if command[:1] == ['pax']:
    command = command[1:]
  if not command:
    raise UserError('Give the pax command to run after --, e.g. '
                    '`pax launch --processes 2 -- train --exp E --job-log-dir /tmp/run`.')
  if command[0] not in runnable:
    raise UserError(f'`pax {command[0]}` cannot run as several processes; pax launch runs: '
                    f'{", ".join(sorted(runnable))}.')
  return [sys.executable, '-m', 'paxcli.cli.app', *command]


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


def _child_envs(n: int, devices_per_process: Optional[int], port: int) -> list[dict[str, str]]:
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
                                        visible_devices=visible[i]) for i in range(n)]


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


def run_children(argv: list[str], envs: list[dict[str, str]], grace: float = 5.0,
                 exit_wait: float = 120.0, verbose: bool = False) -> int:
  """Starts one child per environment, streams output, returns the launcher's exit code."""
  procs = [_spawn(argv, env) for env in envs]
  lock = threading.Lock()
  hidden = _Hidden(verbose)
  readers = [threading.Thread(target=_pump, args=(stream, out, f'[p{i}] ', lock, hidden), daemon=True)
             for i, p in enumerate(procs) for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr))]
  try:
    return _supervise(procs, readers, envs, lock, grace, exit_wait)
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


def _supervise(procs, readers, envs, lock: threading.Lock, grace: float, exit_wait: float) -> int:
  """Waits for the children, stops them all when one fails or hangs; returns the launcher's exit code."""
  events: queue.Queue = queue.Queue()
  waiters = [threading.Thread(target=lambda i=i, p=p: events.put((i, p.wait())), daemon=True)
             for i, p in enumerate(procs)]
  for t in readers + waiters:
    t.start()
  _say(lock, f'{len(procs)} processes, coordinator {envs[0].get("PAX_COORDINATOR", "?")}: ' +
       ', '.join(f'p{i} pid {p.pid}' for i, p in enumerate(procs)))
  previous = signal.signal(signal.SIGTERM, _raise_interrupt) if _main_thread() else None
  try:
    failure = _watch(procs, events, lock, exit_wait)
  except KeyboardInterrupt:
    _stop(procs, grace, lock)
    _drain(readers)
    _say(lock, 'interrupted; stopped all processes.')
    return 130
  finally:
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)
  if failure is None:
    _drain(readers)
    return 0
  index, code = failure
  _stop(procs, grace, lock)
  _drain(readers)
  if code is None:
    _say(lock, f'process p{index} (pid {procs[index].pid}) hung; stopped it and the others.')
    return 1
  _say(lock, f'process p{index} (pid {procs[index].pid}) {_describe_exit(code)}; stopped the other processes.')
  return code if code > 0 else 128 - code


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


def _watch(procs, events: queue.Queue, lock: threading.Lock, exit_wait: float):
  """Waits for every child; returns (index, code) of the first failure (code None: hung), or None."""
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
        return min(running), None
      continue
    running.discard(index)
    if code != 0:
      return index, code
    first_clean = first_clean or time.monotonic()
  return None


def _stop(procs, grace: float, lock: threading.Lock) -> None:
  """SIGTERM to every running child, SIGKILL to those still running after `grace` seconds."""
  alive = [p for p in procs if p.poll() is None]
  for p in alive:
    _signal(p, signal.SIGTERM)
  deadline = time.monotonic() + grace
  for p in alive:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      pass
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


def _raise_interrupt(signum, frame):
  raise KeyboardInterrupt


def _main_thread() -> bool:
  return threading.current_thread() is threading.main_thread()


def register(app: typer.Typer) -> None:
  # Unknown options after the command name belong to it: `launch -n 2 train --exp E` works without `--`.
  app.command('launch', no_args_is_help=True, short_help='Run a pax command as N local processes.',
              context_settings={'allow_interspersed_args': False, 'ignore_unknown_options': True})(launch)
