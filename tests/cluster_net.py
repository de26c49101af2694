"""Hosts on a real network for tests: each its own network, UTS and mount namespace, joined by veth links.

    net = Network.start(tmp_path, ['node1', 'node2'])   # root only; see `unavailable()`
    net.run('node1', ['hostname'])                      # a command on node1 (nsenter into its namespaces)
    net.cut('node2'); net.mend('node2')                 # the link of node2 down / up again
    net.impair('node2', loss=2, rate='20mbit')          # a lossy (nftables), slow (tc tbf) link; None: mended
    net.stop()

A hub namespace (hostname `ctl`, 10.77.0.1) holds a bridge; host i (10.77.0.(10+i)) has one end of a
veth pair, the other on the bridge. Each namespace is held by a `sleep` started by `unshare`, so the
kernel removes namespaces, links and addresses when those processes end: nothing is made in the
machine's own namespaces but processes and files under the test's directory. Each namespace has its
own /etc/hosts (a bind mount in its private mount namespace) naming every host.

Processes are entered with `nsenter --net --uts --mount`, not `ip netns exec`, which remounts /sys
(slurmd 22.05 then refuses to start).

A bad link is made with what every kernel here has: nftables' random drop for loss and tc's token bucket
(tbf) for a slow link that queues. (`tc netem` would do both, but sch_netem is often not built: this
machine's kernel has CONFIG_NET_SCH_NETEM unset.) The tools come from Debian's iproute2 and nftables
packages, installed where missing (`ensure_packages`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import shlex
import shutil
import signal
import subprocess
import time
from typing import Optional

SUBNET = '10.77.0'
HUB = 'ctl'


PACKAGES = {'unshare': 'util-linux', 'nsenter': 'util-linux', 'ip': 'iproute2', 'tc': 'iproute2', 'nft': 'nftables'}
SBIN = ('/usr/sbin', '/usr/bin', '/sbin', '/bin')


def which(name: str) -> Optional[str]:
  for d in SBIN:
    path = os.path.join(d, name)
    if os.access(path, os.X_OK):
      return path
  return shutil.which(name)


def ensure_packages(packages: dict[str, str]) -> Optional[str]:
  """Installs the Debian packages of the tools {tool: package} that are missing (as root, with apt-get); why
  it cannot (None: every tool is there). CI's machine is a clean one: nothing is installed before the tests."""
  missing = lambda: sorted({pkg for tool, pkg in packages.items() if which(tool) is None})
  if not missing():
    return None
  if os.geteuid() != 0:
    return f'needs root to install {", ".join(missing())}'
  if shutil.which('apt-get') is None:
    return f'needs {", ".join(missing())} (no apt-get here to install them)'
  env = dict(os.environ, DEBIAN_FRONTEND='noninteractive')
  with open('/tmp/paxcli-tests-apt.lock', 'w') as lock:   # one installer at a time (xdist workers)
    fcntl.flock(lock, fcntl.LOCK_EX)
    if missing():
      for argv in (['apt-get', 'update', '-qq'],
                   ['apt-get', 'install', '-y', '-qq', '--no-install-recommends', *missing()]):
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
        if done.returncode:
          return f'`{" ".join(argv)}` failed: {(done.stderr or done.stdout).strip()[-300:]}'
  return None


def unavailable() -> Optional[str]:
  """Why this machine cannot run the namespace tests (None: it can, its tools installed)."""
  if os.geteuid() != 0:
    return 'needs root (network namespaces and veth links)'
  reason = ensure_packages(PACKAGES)
  if reason:
    return reason
  probe = subprocess.run(['unshare', '--net', '--uts', '--mount', 'true'], capture_output=True, text=True)
  if probe.returncode:
    return f'cannot make namespaces here: {probe.stderr.strip()[:200]}'
  return None


def address(index: int) -> str:
  """The address of host `index` (1-based); the hub is index 0."""
  return f'{SUBNET}.{1 if index == 0 else 10 + index}'


@dataclasses.dataclass
class Network:
  root: str                     # the test's directory for this network's files
  hosts: list[str]
  holders: dict[str, subprocess.Popen]

  @classmethod
  def start(cls, root: str, hosts: list[str]) -> 'Network':
    os.makedirs(root, exist_ok=True)
    etc_hosts = os.path.join(root, 'hosts')
    with open(etc_hosts, 'w', encoding='utf-8') as f:
      f.write('127.0.0.1 localhost\n' + ''.join(f'{address(i)} {name}\n'
                                                for i, name in enumerate([HUB] + hosts)))
    net = cls(root, list(hosts), {})
    try:
      for name in [HUB] + hosts:
        net.holders[name] = _hold(root, name, etc_hosts)
      net.run(HUB, ['ip', 'link', 'add', 'br0', 'type', 'bridge'])
      net.run(HUB, ['ip', 'addr', 'add', f'{address(0)}/24', 'dev', 'br0'])
      net.run(HUB, ['ip', 'link', 'set', 'br0', 'up'])
      for i, name in enumerate(hosts, start=1):
        net.run(HUB, ['ip', 'link', 'add', f'v{name}', 'type', 'veth', 'peer', 'name', 'eth0', 'netns',
                      str(net.holders[name].pid)])
        net.run(HUB, ['ip', 'link', 'set', f'v{name}', 'master', 'br0', 'up'])
        net.run(name, ['ip', 'addr', 'add', f'{address(i)}/24', 'dev', 'eth0'])
        net.run(name, ['ip', 'link', 'set', 'eth0', 'up'])
    except BaseException:
      net.stop()
      raise
    return net

  def enter(self, name: str, cwd: Optional[str] = None) -> list[str]:
    """The command prefix that runs a command in host `name`'s namespaces, in `cwd` (default: ours; a
    mount namespace entered without one starts in /)."""
    return ['nsenter', '-t', str(self.holders[name].pid), '--net', '--uts', '--mount',
            f'--wd={cwd or os.getcwd()}', '--']

  def run(self, name: str, argv: list[str], check: bool = True, timeout: float = 60, cwd: Optional[str] = None,
          **kwargs):
    result = subprocess.run(self.enter(name, cwd) + argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and result.returncode:
      raise RuntimeError(f'{name}: {" ".join(argv)} failed ({result.returncode}): {result.stderr.strip()}')
    return result

  def popen(self, name: str, argv: list[str], cwd: Optional[str] = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(self.enter(name, cwd) + argv, **kwargs)

  def address(self, name: str) -> str:
    return address(([HUB] + self.hosts).index(name))

  def cut(self, name: str) -> None:
    """Takes host `name`'s link down at the bridge: its packets go nowhere, nothing is reset."""
    self.run(HUB, ['ip', 'link', 'set', f'v{name}', 'down'])

  def mend(self, name: str) -> None:
    self.run(HUB, ['ip', 'link', 'set', f'v{name}', 'up'])

  def impair(self, name: str, loss: int = 0, rate: Optional[str] = None) -> None:
    """Host `name`'s link drops `loss` percent of packets each way (nftables, on its eth0) and carries at most
    `rate` each way (tc tbf: packets queue, up to a second). impair(name) mends both."""
    self.run(name, ['nft', 'delete', 'table', 'inet', 'paxtest'], check=False)
    for where, dev in ((name, 'eth0'), (HUB, f'v{name}')):
      self.run(where, ['tc', 'qdisc', 'del', 'dev', dev, 'root'], check=False)
      if rate:
        self.run(where, ['tc', 'qdisc', 'add', 'dev', dev, 'root', 'tbf', 'rate', rate, 'burst', '32kbit',
                         'latency', '1s'])
    if loss:
      drop = 'drop' if loss >= 100 else f'numgen random mod 100 < {loss} drop'
      rules = (f'table inet paxtest {{\n'
               f'  chain in {{ type filter hook input priority 0; iifname "eth0" {drop}; }}\n'
               f'  chain out {{ type filter hook output priority 0; oifname "eth0" {drop}; }}\n'
               '}\n')
      self.run(name, ['nft', '-f', '-'], input=rules)

  def stop(self) -> None:
    for holder in self.holders.values():
      if holder.poll() is None:
        holder.send_signal(signal.SIGKILL)
      holder.wait(timeout=30)


def _hold(root: str, name: str, etc_hosts: str) -> subprocess.Popen:
  """A `sleep` in new network, UTS and mount namespaces, with hostname `name` and its own /etc/hosts."""
  ready = os.path.join(root, f'{name}.ready')
  script = (f'mount --bind {shlex.quote(etc_hosts)} /etc/hosts && hostname {shlex.quote(name)} && '
            f'ip link set lo up && touch {shlex.quote(ready)} && exec sleep infinity')
  holder = subprocess.Popen(['unshare', '--net', '--uts', '--mount', '--propagation', 'private', 'sh', '-c', script],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  deadline = time.monotonic() + 30
  while not os.path.exists(ready):
    if holder.poll() is not None:
      raise RuntimeError(f'namespace {name}: {holder.stderr.read().decode(errors="replace").strip()}')
    if time.monotonic() > deadline:
      holder.kill()
      raise RuntimeError(f'namespace {name} not ready in 30 s')
    time.sleep(0.05)
  return holder
