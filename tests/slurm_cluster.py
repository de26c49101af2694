"""A real SLURM cluster for tests: Debian's slurmctld and slurmd daemons, munge auth, hosts on a real network.

    cluster = Cluster.start(tmp_path, nodes=2)     # root only; see `unavailable()`
    job = cluster.sbatch(script_path)              # job id
    cluster.wait(job, lambda state: state == 'COMPLETED')
    cluster.run(['srun', '-N', '2', 'hostname'])   # a client command, on the control host
    cluster.stop()

slurmctld runs on the hub host `ctl` of a tests/cluster_net.py network, one slurmd on each node host
(`node1`, `node2`, ...), each in its own network and UTS namespace; munged runs with a key and socket of
the test's own. Jobs run as root (as the tests do). Two partitions: `debug` (the default) and `urgent`,
whose jobs preempt debug's (PreemptMode=REQUEUE: SIGTERM, 60 s of grace, then the job is requeued). A
requeued job may start again 10 s later (cred_expire; SLURM's default is 120 s). The packages come from Debian's archive
(`ensure_packages`, run as root with apt-get, as CI's clean machine needs).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import time
from typing import Callable, Optional

import cluster_net

PACKAGES = {'slurmctld': 'slurmctld', 'slurmd': 'slurmd', 'sbatch': 'slurm-client', 'munged': 'munge'}
CPUS_PER_NODE = 8   # what each slurmd says it has (config_overrides): tasks are processes, not cores
_which = cluster_net.which


def unavailable() -> Optional[str]:
  """Why this machine cannot run a SLURM cluster (None: it can, packages installed)."""
  return cluster_net.unavailable() or cluster_net.ensure_packages(PACKAGES)


@dataclasses.dataclass
class Cluster:
  root: str
  net: cluster_net.Network
  nodes: list[str]
  conf: str
  daemons: list[subprocess.Popen]

  @classmethod
  def start(cls, root: str, nodes: int = 2, extra_conf: str = '') -> 'Cluster':
    names = [f'node{i}' for i in range(1, nodes + 1)]
    os.makedirs(root, exist_ok=True)
    os.chmod(root, 0o755)
    net = cluster_net.Network.start(os.path.join(root, 'net'), names)
    cluster = cls(root, net, names, os.path.join(root, 'slurm.conf'), [])
    try:
      munge_socket = cluster._start_munge()
      cluster._write_conf(munge_socket, extra_conf)
      cluster.daemons.append(cluster._daemon(cluster_net.HUB, [_which('slurmctld'), '-D', '-c', '-f', cluster.conf],
                                             'slurmctld'))
      for name in names:
        cluster.daemons.append(cluster._daemon(name, [_which('slurmd'), '-D', '-f', cluster.conf, '-N', name],
                                               f'slurmd-{name}'))
      cluster._wait_idle()
    except BaseException:
      cluster.stop()
      raise
    return cluster

  # ---- daemons ----

  def _start_munge(self) -> str:
    d = os.path.join(self.root, 'munge')
    os.makedirs(d, mode=0o700, exist_ok=True)
    key = os.path.join(d, 'munge.key')
    with open(key, 'wb') as f:
      f.write(os.urandom(1024))
    os.chmod(key, 0o600)
    sock = os.path.join(d, 'munge.socket')
    self.daemons.append(self._daemon(None, [_which('munged'), '-F', '--force', f'--socket={sock}', f'--key-file={key}',
                                            f'--pid-file={d}/munged.pid', f'--log-file={d}/munged.log',
                                            f'--seed-file={d}/munged.seed'], 'munged'))
    _wait_for(lambda: os.path.exists(sock), 30, 'munged socket', self.daemons[-1])
    os.chmod(d, 0o755)  # slurmstepd of each node reads the socket too
    return sock

  def _write_conf(self, munge_socket: str, extra: str) -> None:
    r = self.root
    for sub in ('state', 'spool', 'log'):
      os.makedirs(os.path.join(r, sub), exist_ok=True)
    nodes = ''.join(f'NodeName={n} NodeAddr={self.net.address(n)} CPUs={CPUS_PER_NODE} State=UNKNOWN\n'
                    for n in self.nodes)
    with open(self.conf, 'w', encoding='utf-8') as f:
      f.write(f"""\
ClusterName=paxtest
SlurmctldHost={cluster_net.HUB}({self.net.address(cluster_net.HUB)})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire=10
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=600
InactiveLimit=0
SchedulerParameters=sched_interval=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=60
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10
{extra}""")

  def _daemon(self, host: Optional[str], argv: list[str], name: str) -> subprocess.Popen:
    log = open(os.path.join(self.root, f'{name}.out'), 'wb')
    prefix = self.net.enter(host) if host else []
    return subprocess.Popen(prefix + argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            env=self.env())

  def _wait_idle(self, timeout: float = 120) -> None:
    def idle():
      for daemon in self.daemons:
        if daemon.poll() is not None:
          raise RuntimeError(f'a SLURM daemon exited ({daemon.args}); logs in {self.root}')
      out = self.run(['sinfo', '-h', '-N', '-o', '%N %T'], check=False).stdout.split()
      states = dict(zip(out[::2], out[1::2]))
      return all(states.get(n) == 'idle' for n in self.nodes)
    _wait_for(idle, timeout, f'nodes idle (logs in {self.root}/log)')

  def stop(self) -> None:
    """Stops the daemons and every job step (slurmstepd runs in the nodes' namespaces), then the network."""
    for daemon in reversed(self.daemons):
      if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
    for daemon in self.daemons:
      try:
        daemon.wait(timeout=20)
      except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait(timeout=10)
    for name in self.nodes:   # tasks and slurmstepd left in a node's namespaces: killed, by their ids
      for pid in pids_on(self, name):
        try:
          os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
    self.net.stop()

  # ---- clients ----

  def env(self, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith('SLURM_')}
    env.update(SLURM_CONF=self.conf, **extra)
    return env

  def run(self, argv: list[str], check: bool = True, timeout: float = 120, env: Optional[dict] = None,
          host: str = cluster_net.HUB, cwd: Optional[str] = None, **kwargs):
    """A client command (sbatch, srun, squeue, scontrol ...) on `host` (the control host by default), in `cwd`."""
    result = subprocess.run(self.net.enter(host, cwd) + argv, capture_output=True, text=True, timeout=timeout,
                            env=env or self.env(), **kwargs)
    if check and result.returncode:
      raise RuntimeError(f'{" ".join(argv)} failed ({result.returncode}): {result.stderr.strip()[-2000:]}')
    return result

  def sbatch(self, args: list[str], env: Optional[dict] = None, cwd: Optional[str] = None) -> int:
    out = self.run(['sbatch', '--parsable', *args], env=env, cwd=cwd).stdout.strip()
    return int(out.split(';')[0])

  def job(self, job_id: int) -> dict:
    """scontrol's fields of a job (JobState, RestartCnt, ExitCode, NodeList, ...)."""
    out = self.run(['scontrol', '-o', 'show', 'job', str(job_id)], check=False).stdout
    return dict(re.findall(r'(\w+)=(\S*)', out))

  def wait(self, job_id: int, until: Callable[[dict], bool], timeout: float = 600) -> dict:
    got = {}

    def done():
      got.update(self.job(job_id))
      return until(got)
    _wait_for(done, timeout, f'job {job_id} (last seen {got.get("JobState")})')
    return got

  def log(self, name: str) -> str:
    path = os.path.join(self.root, 'log', name)
    return open(path, encoding='utf-8', errors='replace').read() if os.path.exists(path) else ''


def _wait_for(ready: Callable[[], bool], timeout: float, what: str, process: Optional[subprocess.Popen] = None):
  deadline = time.monotonic() + timeout
  while not ready():
    if process is not None and process.poll() is not None:
      raise RuntimeError(f'{what}: the process exited ({process.returncode})')
    if time.monotonic() > deadline:
      raise TimeoutError(f'waited {timeout:g} s for {what}')
    time.sleep(0.3)


def pids_on(cluster: Cluster, node: str) -> list[int]:
  """The processes running on `node` (in its network namespace), but the one holding it."""
  holder = cluster.net.holders.get(node)
  try:
    target = os.readlink(f'/proc/{holder.pid}/ns/net')
  except (AttributeError, OSError):
    return []
  pids = []
  for entry in os.listdir('/proc'):
    if entry.isdigit() and int(entry) != holder.pid:
      try:
        if os.readlink(f'/proc/{entry}/ns/net') == target:
          pids.append(int(entry))
      except OSError:
        continue
  return pids
