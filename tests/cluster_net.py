"""Hosts on a real network for tests: each its own network, UTS and mount namespace, joined by veth links.

    net = Network.start(tmp_path, ['node1', 'node2'])   # root only; see `unavailable()`
    net.run('node1', ['hostname'])                      # a command on node1 (nsenter into its namespaces)
    net.cut('node2'); net.mend('node2')                 # the link of node2 down / up again
    net.netem('node2', 'delay 200ms loss 20%')          # a slow, lossy link (tc netem)
    net.stop()

A hub namespace (hostname `ctl`, 10.77.0.1) holds a bridge; host i (10.77.0.(10+i)) has one end of a
veth pair, the other on the bridge. Each namespace is held by a `sleep` started by `unshare`, so the
kernel removes namespaces, links and addresses when those processes end: nothing is made in the
machine's own namespaces but processes and files under the test's directory. Each namespace has its
own /etc/hosts (a bind mount in its private mount namespace) naming every host.

Processes are entered with `nsenter --net --uts --mount`, not `ip netns exec`, which remounts /sys
(slurmd 22.05 then refuses to start).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import time
from typing import Optional

SUBNET = '10.77.0'
HUB = 'ctl'


def unavailable() -> Optional[str]:
  """Why this machine cannot run the namespace tests (None: it can)."""
  if os.geteuid() != 0:
    return 'needs root (network namespaces and veth links)'
  for tool in ('unshare', 'nsenter', 'ip', 'tc'):
    if shutil.which(tool) is None:
      return f'needs `{tool}` (util-linux, iproute2)'
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

  def netem(self, name: str, spec: Optional[str]) -> None:
    """tc netem on host `name`'s link (both ends: delay and loss each way); None removes it."""
    for where, dev in ((name, 'eth0'), (HUB, f'v{name}')):
      self.run(where, ['tc', 'qdisc', 'del', 'dev', dev, 'root'], check=False)
      if spec:
        self.run(where, ['tc', 'qdisc', 'add', 'dev', dev, 'root', 'netem', *spec.split()])

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
