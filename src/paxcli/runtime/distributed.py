"""Several processes: JAX's own distributed runtime, started from flags, environment or cluster.

Pax runs one process per host (a TPU VM, a GPU node). Every process runs the same
command; `jax.distributed.initialize` connects them through a coordinator (process 0)
before any backend starts, after which `jax.devices()` lists the devices of every
process and one jitted step runs over all of them.

Where the settings come from, first match wins:
  1. `--coordinator`, `--num-processes`, `--process-id` (or PAX_COORDINATOR,
     PAX_NUM_PROCESSES, PAX_PROCESS_ID; `pax launch` sets these for its children);
  2. a cluster JAX recognises (Cloud TPU, SLURM, Open MPI, Kubernetes): JAX detects
     the three values itself (in a SLURM job step paxcli picks the coordinator's port and each
     task's devices: runtime/slurm.py);
  3. otherwise one process, and nothing is started; a cluster's environment found only in part
     (a shell of a SLURM allocation, an sbatch script without srun) says so in one line, or is
     refused where it asked for several processes (PARTIAL_ENVIRONMENTS).
`--num-processes 1` always means one process, even on a cluster.

With several processes, each watches the others (runtime/peers.py): a process that dies or a host that
drops off the network ends every other process with one line naming it, within --heartbeat-timeout.

On CPU the processes exchange data with gloo collectives; without them a jitted step
over devices of several CPU processes cannot run.

Inputs and process counts: an input that defines each *global* batch as a function of
(seed, batch index) and gives host i of n its block of rows (the synthetic input and the
built-in stdlib-docstrings corpus) feeds a run the same data however many processes feed
it, so the losses do not depend on the process count. Inputs that split their *sources*
between hosts (files or shards read by host i of n, as TFRecord and SeqIO inputs do)
cannot have that property: which examples meet in one step depends on n.

jax is imported inside the functions that use it: `pax launch` reads child_environment
from here in a launcher that never starts JAX (its children do).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
import warnings
from typing import Callable, Mapping, Optional

from paxcli.errors import UserError
from paxcli.runtime import platform as platform_mod
from paxcli.runtime import peers
from paxcli.runtime import slurm
from paxcli.runtime.platform import detect_platform

ENV_COORDINATOR = 'PAX_COORDINATOR'
ENV_NUM_PROCESSES = 'PAX_NUM_PROCESSES'
ENV_PROCESS_ID = 'PAX_PROCESS_ID'
ENV_HEARTBEAT_TIMEOUT = 'PAX_HEARTBEAT_TIMEOUT'
# Set by `pax launch` for its children: which launch and attempt (0, then one per restart) a process
# belongs to (its goodput ledger records them), and the file it touches after each step for the
# launcher's hang detection (--heartbeat-timeout).
ENV_LAUNCH = 'PAX_LAUNCH'
ENV_HEARTBEAT = 'PAX_HEARTBEAT_FILE'


@dataclasses.dataclass(frozen=True)
class Settings:
  """What the user asked for; None where neither a flag nor the environment says."""
  coordinator: Optional[str] = None
  num_processes: Optional[int] = None
  process_id: Optional[int] = None
  heartbeat_timeout: Optional[float] = None   # seconds (runtime/peers.py); None: peers.DEFAULT_TIMEOUT

  @property
  def given(self) -> bool:
    return any(v is not None for v in (self.coordinator, self.num_processes, self.process_id))

  @property
  def single(self) -> bool:
    """True when the user said one process (which skips cluster detection)."""
    return self.num_processes == 1 and self.coordinator is None


def settings_from(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
                  process_id: Optional[int] = None, heartbeat_timeout: Optional[float] = None,
                  environ: Optional[Mapping[str, str]] = None) -> Settings:
  """Flags win over PAX_* environment variables; values are checked here, not deep in JAX."""
  environ = os.environ if environ is None else environ
  heartbeat_timeout = _as_seconds(heartbeat_timeout, environ.get(ENV_HEARTBEAT_TIMEOUT))
  coordinator = coordinator or environ.get(ENV_COORDINATOR) or None
  num_processes = _as_int(num_processes, environ.get(ENV_NUM_PROCESSES), '--num-processes', ENV_NUM_PROCESSES)
  process_id = _as_int(process_id, environ.get(ENV_PROCESS_ID), '--process-id', ENV_PROCESS_ID)
  if num_processes is not None and num_processes < 1:
    raise UserError(f'--num-processes must be at least 1, got {num_processes}.')
  if process_id is not None and process_id < 0:
    raise UserError(f'--process-id must be 0 or more, got {process_id}.')
  if None not in (num_processes, process_id) and process_id >= num_processes:
    raise UserError(f'--process-id {process_id} is out of range for --num-processes {num_processes} '
                    f'(ids run from 0 to {num_processes - 1}).')
  if coordinator is not None and (':' not in coordinator or not coordinator.rsplit(':', 1)[1].isdigit()):
    raise UserError(f'--coordinator {coordinator!r} must be HOST:PORT, e.g. 10.0.0.1:1234 '
                    '(the address of process 0 and a free port there).')
  return Settings(coordinator, num_processes, process_id, heartbeat_timeout)


def _as_seconds(flag_value, env_value) -> Optional[float]:
  value = flag_value
  if value is None and env_value not in (None, ''):
    try:
      value = float(env_value)
    except ValueError:
      raise UserError(f'{ENV_HEARTBEAT_TIMEOUT}={env_value!r} is not a number of seconds '
                      '(it sets --heartbeat-timeout).') from None
  if value is not None and not 1 <= value < 1e6:
    raise UserError(f'--heartbeat-timeout must be between 1 and 1e6 seconds, got {value:g}.')
  return value


def _as_int(flag_value, env_value, flag: str, env: str) -> Optional[int]:
  if flag_value is not None:
    return int(flag_value)
  if env_value in (None, ''):
    return None
  try:
    return int(env_value)
  except ValueError:
    raise UserError(f'{env}={env_value!r} is not a whole number (it sets {flag}).') from None


def _jax():
  """jax, imported where a function needs it: this module runs before JAX is configured (pax --help, the
  platform's environment) and imports no JAX itself. With it, its multihost utilities and its distributed
  client's state (jax._src.distributed: the key-value store, which no public module hands out)."""
  import jax, jax._src.distributed, jax.experimental.multihost_utils  # noqa: E401 - one import, three modules
  return jax


def first_process() -> bool:
  """Whether this is process 0 of the run (the one that writes the job's records)."""
  return _jax().process_index() == 0


def detected_cluster() -> Optional[str]:
  """The name of a cluster environment JAX can configure itself from, or None.

  Uses JAX's own detectors (no network unless on a Cloud TPU VM, where JAX asks the
  metadata server). The opt-in mpi4py detector is skipped, as JAX itself does.
  """
  try:
    from jax._src.clusters import ClusterEnv  # JAX's detectors; no public list exists
  except ImportError:
    return None
  for env in ClusterEnv._cluster_types:  # pylint: disable=protected-access
    if getattr(env, 'opt_in_only_method', False):
      continue
    try:
      with warnings.catch_warnings():  # e.g. 'Kubernetes detected but no kubernetes package'
        warnings.simplefilter('ignore')
        if env.is_env_present():
          return env.__name__
    except Exception:  # a detector that cannot run here (missing package, no metadata)
      continue
  return None


# The environment JAX reads on a TPU pod beside the VM's metadata (jax._src.clusters.cloud_tpu_cluster): GKE
# gives every pod of a slice the slice's hosts and its own index; across slices (multislice) every process
# also needs the slice count, its slice and the address of slice 0's first host.
TPU_HOSTS_VARS = ('TPU_PROCESS_ADDRESSES', 'TPU_WORKER_HOSTNAMES')   # JAX reads the first one set
MEGASCALE_VARS = ('MEGASCALE_COORDINATOR_ADDRESS', 'MEGASCALE_NUM_SLICES', 'MEGASCALE_SLICE_ID')


def check_tpu_environment(environ: Optional[Mapping[str, str]] = None, on_tpu: Optional[bool] = None,
                          log: Callable[[str], None] = print) -> None:
  """A TPU pod's environment that is partial, said in one line before JAX reads it.

  Refused (UserError) where it names several hosts or slices but not this process's place among them
  (JAX would fail on it, or every slice would take id 0 and wait for the others forever); a line on
  `log` where this machine has no TPU, so JAX reads none of it and the command runs as one process.
  `on_tpu`: JAX's own test (libtpu and a TPU attached; platform.tpu_vm()) unless given.
  """
  environ = os.environ if environ is None else environ
  set_here = [k for k in (*TPU_HOSTS_VARS, 'TPU_WORKER_ID', *MEGASCALE_VARS) if environ.get(k)]
  if not set_here:
    return
  if not (platform_mod.tpu_vm() if on_tpu is None else on_tpu):
    one = len(set_here) == 1
    log(f'Note: {", ".join(set_here)} {"is" if one else "are"} set, but this machine has no TPU, so JAX does not '
        f'read {"it" if one else "them"}: running as one process (several processes on CPU or GPU: --coordinator, '
        '--num-processes and --process-id, or pax launch).')
    return
  hosts_var = next((k for k in TPU_HOSTS_VARS if environ.get(k)), None)
  if hosts_var:   # GKE: the pod's environment is all JAX has
    hosts = environ[hosts_var].split(',')
    _check_index(environ, 'TPU_WORKER_ID', len(hosts), f'{hosts_var} lists {len(hosts)} host(s)',
                 'GKE sets both for every pod of a TPU slice')
  slices = _whole(environ, 'MEGASCALE_NUM_SLICES')
  if slices is not None and slices < 1:
    raise UserError(f'MEGASCALE_NUM_SLICES={environ["MEGASCALE_NUM_SLICES"]!r} must be 1 or more.')
  if hosts_var and any(environ.get(k) for k in MEGASCALE_VARS):   # on a TPU VM the metadata holds the rest
    if slices is None:
      raise UserError(f'{", ".join(k for k in MEGASCALE_VARS if environ.get(k))} set without MEGASCALE_NUM_SLICES: '
                      'JAX would count one slice. Set all three MEGASCALE_* variables for a multislice job.')
    if slices > 1:
      _check_index(environ, 'MEGASCALE_SLICE_ID', slices, f'MEGASCALE_NUM_SLICES is {slices}',
                   'without it every slice takes id 0 and waits for the others')
      if not environ.get('MEGASCALE_COORDINATOR_ADDRESS'):
        raise UserError(f'MEGASCALE_NUM_SLICES is {slices} but MEGASCALE_COORDINATOR_ADDRESS is not set: each slice '
                        "would start its own coordinator and wait for the others' processes forever. Set it to "
                        "slice 0's first host on every host.")
  elif slices is not None and environ.get('MEGASCALE_SLICE_ID'):
    _check_index(environ, 'MEGASCALE_SLICE_ID', slices, f'MEGASCALE_NUM_SLICES is {slices}', '')


def _whole(environ: Mapping[str, str], key: str) -> Optional[int]:
  value = environ.get(key)
  if not value:
    return None
  try:
    return int(value)
  except ValueError:
    raise UserError(f'{key}={value!r} is not a whole number.') from None


def _check_index(environ: Mapping[str, str], key: str, count: int, because: str, why: str) -> None:
  """`key` names this process's place among `count`: set, whole, 0 to count - 1."""
  index = _whole(environ, key)
  if index is None:
    raise UserError(f'{because} but {key} is not set, so this process cannot tell which one it is'
                    f'{f" ({why})" if why else ""}: set {key} (0 to {count - 1}) on every host.')
  if not 0 <= index < count:
    raise UserError(f'{key}={index} is out of range: {because}, so it runs from 0 to {count - 1}.')


def start(settings: Settings, log: Callable[[str], None] = print,
          platform: Optional[str] = None, command: str = 'pax') -> bool:
  """Starts jax.distributed when several processes are asked for or a cluster is found.

  Must run before anything starts a JAX backend (jax.devices(), any computation).
  Returns True when the distributed runtime is (now) running. `command`: the command line, for the
  srun line of a refused partial SLURM environment.
  """
  jax = _jax()
  if jax.distributed.is_initialized():
    return True  # e.g. a second command in the same Python process
  if settings.single:
    return False
  cluster, coordinator, local_ids = None, settings.coordinator, None
  if not settings.given:
    check_tpu_environment(log=log)
    cluster = detected_cluster()
    if cluster is None:
      note_partial_environment(os.environ, command, log)
      return False
    if cluster == 'SlurmCluster':   # a port of the step's own, and the devices each task should drive
      coordinator, local_ids = slurm.coordinator(os.environ), slurm.local_device_ids(os.environ)
  _check_backend_not_started()
  if (platform or detect_platform()) == 'cpu':
    # Cross-process collectives on CPU need an implementation; gloo ships with jaxlib.
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  try:
    jax.distributed.initialize(coordinator, settings.num_processes, settings.process_id, local_device_ids=local_ids,
                               heartbeat_timeout_seconds=peers.jax_heartbeat_seconds(settings.heartbeat_timeout))
  except (ValueError, TypeError) as e:
    where = f'the {cluster} environment' if cluster else 'the flags/environment given'
    raise UserError(f'Cannot start {settings.num_processes or "several"} processes from {where}: {e}. '
                    'Give all three of --coordinator HOST:PORT, --num-processes N and --process-id I '
                    f'(or {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}), or --num-processes 1 '
                    'for a single process.') from None
  except Exception as e:  # XLA's runtime errors (timeouts, refused connections) have no common type
    raise UserError(f'Connecting to the coordinator {coordinator or "(detected)"} failed: '
                    f'{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}. '
                    'Check that every process was started with the same --coordinator and '
                    '--num-processes, and that process 0 is running.' + _pod_hint(cluster)) from None
  if cluster:
    log(f'Detected a {cluster} cluster; started JAX distributed'
        + (f' (coordinator {coordinator}).' if coordinator else '.'))
  _watch_peers(settings.heartbeat_timeout)
  return True


def _pod_hint(cluster: Optional[str]) -> str:
  """For a TPU pod JAX detected: the hosts wait for each other, so a command started on one worker only
  (a plain `ssh` to it) waits until JAX's timeout."""
  if not cluster or 'Tpu' not in cluster:
    return ''
  return (' On a TPU pod every host runs the same command at once: gcloud compute tpus tpu-vm ssh NAME '
          "--worker=all --command='pax train ...' (and for several slices, on every slice).")
# Cluster environments found only in part: each check takes (environment, command line) and returns a line
# saying why this runs as one process, or None; it raises UserError where it must refuse.
PARTIAL_ENVIRONMENTS: tuple[Callable[[Mapping[str, str], str], Optional[str]], ...] = (slurm.partial_step,)


def note_partial_environment(environ: Mapping[str, str], command: str, log: Callable[[str], None]) -> None:
  """Where no cluster was detected: one line for each environment found in part (or its refusal)."""
  for check in PARTIAL_ENVIRONMENTS:
    line = check(environ, command)
    if line:
      log(line)


_watch: Optional[peers.Watch] = None


def _watch_peers(timeout: Optional[float]) -> None:
  """Starts this process's watch of the others (runtime/peers.py) when there are others."""
  global _watch
  jax_distributed = _jax()._src.distributed   # its client: the key-value store
  state = jax_distributed.global_state   # not jax.process_count(): that would start the backend here
  if state.num_processes > 1 and _watch is None:
    beat = os.environ.get(ENV_HEARTBEAT)   # started by `pax launch`: its note on a child it saw fail
    note = peers.launcher_note(beat) if beat else None
    _watch = peers.Watch(state.client, state.process_id, state.num_processes, timeout or peers.DEFAULT_TIMEOUT,
                         state.coordinator_address or '?', launcher_note=note).start()


def watch() -> Optional[peers.Watch]:
  """This process's watch of the others, if it runs one."""
  return _watch


def say_exit(code: int, reason: str = '') -> None:
  """Tells the other processes how this one ends (the first call counts); a no-op without a watch."""
  if _watch is not None:
    _watch.exiting(code, reason)


def end_command(code: int, error: Optional[BaseException] = None) -> None:
  """The end of a command of a multi-process run (a no-op in one process): the others are told how it ends.
  After a failure this process ends here and now (os._exit): JAX's shutdown at exit would wait at a barrier
  for every process, and the others stop because of this one. `error`, an exception not yet shown: a
  collective whose peer went away is said in one line naming it (exit code 124), anything else as its
  traceback."""
  if _watch is None:
    return
  if error is not None:
    lost = _watch.collective_loss(error)
    code = peers.LOST if lost else 1
    if lost:
      sys.stderr.write(f'error: {lost}\n')
    else:
      traceback.print_exception(type(error), error, error.__traceback__)
    say_exit(code, lost or f'{type(error).__name__}: {_first_line(error)}')
  say_exit(code)
  if code not in peers.PEERS_STOP_TOO:
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except (OSError, ValueError):
        pass
    os._exit(code)


def _first_line(error: BaseException) -> str:
  text = str(error).strip()
  return text.splitlines()[0][:300] if text else ''


def _check_backend_not_started() -> None:
  if _jax()._src.xla_bridge.backends_are_initialized():
    raise UserError('JAX already started its backend in this Python process, so it cannot join '
                    'several processes any more; run the command in a fresh process.')


def topology_line() -> str:
  """'process i of n: L local of G devices (platform)': what each process logs once."""
  jax = _jax()
  devices = jax.devices()
  return (f'Process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local '
          f'of {len(devices)} {jax.default_backend()} devices ({devices[0].device_kind}).')


def log_topology(log: Callable[[str], None]) -> None:
  """Logs the topology line from every process of a multi-process run (one line each)."""
  jax = _jax()
  if jax.process_count() > 1:
    log(topology_line())


def barrier(name: str) -> None:
  """Waits until every process gets here (no-op for one process)."""
  jax = _jax()
  if jax.process_count() > 1:
    jax.experimental.multihost_utils.sync_global_devices(name)


def agreed(value):
  """Process 0's `value` (anything JSON holds), returned on every process: for a decision every process must
  take alike, such as which checkpoint steps to delete, where each one looking for itself (listing a
  directory process 0 is changing) could decide otherwise. A collective with several processes (all call
  it; the others' `value` is ignored); `value` itself with one."""
  jax = _jax()
  if jax.process_count() == 1:
    return value
  import numpy as np
  multihost_utils = jax.experimental.multihost_utils
  data = np.frombuffer(json.dumps(value).encode(), np.uint8) if jax.process_index() == 0 else np.zeros(0, np.uint8)
  size = int(multihost_utils.broadcast_one_to_all(np.array(data.size, np.int32)))
  # Sent padded to a power of two: each size is its own compilation of the broadcast, so only a few are made.
  padded = np.zeros(max(256, 1 << (size - 1).bit_length()), np.uint8)
  padded[:data.size] = data
  got = np.asarray(multihost_utils.broadcast_one_to_all(padded))
  return json.loads(bytes(got[:size]).decode())


# Where JAX's runtime posts a preemption notice (xla/tsl preemption_sync_manager.cc, kPreemptionNoticeKey).
PREEMPTION_NOTICE_KEY = 'RECEIVED_PREEMPTION_NOTICE'


def preemption_counter_from(step: int) -> bool:
  """Several processes: sets JAX's preemption counter of every process to `step` (where this invocation
  starts: JAX's sync point is the furthest counter plus one, and orbax counts global steps too), and says
  whether a preemption notice came before that, while start-up ran: JAX then set its sync point from
  counters below `step`, never reached. The same answer on every process (process 0 looks, after all set
  their counters). False where JAX's preemption service is off."""
  jax = _jax()
  jax_distributed = jax._src.distributed
  try:
    jax.experimental.multihost_utils.reached_preemption_sync_point(step)
  except RuntimeError:   # jax_enable_preemption_service is off
    return False
  barrier('paxcli:preemption-counter-set')
  client, key = jax_distributed.global_state.client, 'paxcli/preempted-during-start'
  if jax_distributed.global_state.process_id == 0:
    client.key_value_set(key, '1' if peers.kv_get(client, PREEMPTION_NOTICE_KEY) is not None else '0')
  return client.blocking_key_value_get(key, 300_000) == '1'


def launch_attempt(environ: Optional[Mapping[str, str]] = None) -> Optional[tuple[str, int]]:
  """(launch id, attempt) of a process `pax launch` started, else None."""
  value = (os.environ if environ is None else environ).get(ENV_LAUNCH, '')
  lid, _, attempt = value.partition(':')
  return (lid, int(attempt)) if lid.isalnum() and attempt.isdigit() else None


class Heartbeat:
  """The file `pax launch` watches for this process (PAX_HEARTBEAT_FILE); a no-op without it.

  `beat(step)` rewrites it with the step just done (a few bytes, on the launcher's local temporary
  directory): its modification time is the launcher's sign of life, and the step tells it how far
  the process got when it failed. The first beat (after the first step, compilation included)
  arms the launcher's timeout. `note_job(job_dir)` tells the launcher whose ledger to write to.
  """

  def __init__(self, path: Optional[str] = None):
    self.path = path if path is not None else os.environ.get(ENV_HEARTBEAT) or None
    self._fd: Optional[int] = None

  def note_job(self, job_dir: str) -> None:
    if self.path:
      with open(self.path + '.job', 'w', encoding='utf-8') as f:
        f.write(job_dir)

  def beat(self, step: int) -> None:
    if not self.path:
      return
    if self._fd is None:
      self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
    data = f'{int(step):<20d}\n'.encode()  # fixed width: rewritten in place, never half a number
    os.pwrite(self._fd, data, 0)

  def close(self) -> None:
    """No more beats: the file goes, and the launcher stops timing this process (its loop is over; the
    last save and its exit may take long)."""
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None
    if self.path:
      try:
        os.remove(self.path)
      except FileNotFoundError:
        pass


def child_environment(base: Mapping[str, str], coordinator: str, num_processes: int, process_id: int,
                      cpu_devices: Optional[int] = None, visible_devices: Optional[list[int]] = None,
                      heartbeat_timeout: Optional[float] = None) -> dict[str, str]:
  """The environment of one local process started by `pax launch` (`heartbeat_timeout`: each watches the
  others with it, as the launcher watches them).

  Proxy variables are dropped: processes talk over 127.0.0.1, and a proxy setting can
  make `jax.distributed.initialize` hang (JAX warns about any *_proxy variable).
  """
  env = {k: v for k, v in base.items() if '_proxy' not in k.lower() and k not in (ENV_LAUNCH, ENV_HEARTBEAT)}
  env[ENV_COORDINATOR] = coordinator
  env[ENV_NUM_PROCESSES] = str(num_processes)
  env[ENV_PROCESS_ID] = str(process_id)
  env['PYTHONUNBUFFERED'] = '1'  # lines reach the launcher as they are printed
  if cpu_devices is not None:
    flags = [f for f in env.get('XLA_FLAGS', '').split()
             if not f.startswith('--xla_force_host_platform_device_count')]
    env['XLA_FLAGS'] = ' '.join(flags + [f'--xla_force_host_platform_device_count={cpu_devices}'])
  if visible_devices is not None:
    env['JAX_LOCAL_DEVICE_IDS'] = ','.join(str(i) for i in visible_devices)  # read by initialize()
  if heartbeat_timeout is not None:
    env[ENV_HEARTBEAT_TIMEOUT] = f'{heartbeat_timeout:g}'
  return env
