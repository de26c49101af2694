"""Hosts on a real network: each process in its own network namespace (tests/cluster_net.py), joined by veth
links through a bridge, as root, in the test's own namespaces only.

Two processes (one per host, 4 fake CPU devices each) train over a slow, lossy link as one process does; then the
link is cut (`ip link set down`) or drops every packet mid-run, and every process ends within --heartbeat-timeout
with one line naming the host it lost, no hang and no traceback. The bad links are nftables' random drop and tc's
token bucket: this machine's kernel has no sch_netem for `tc netem` (tests/cluster_net.py). A scheduler bringing the
job back when the link returns is in test_slurm.py (the requeue after a cut link).
"""

import os
import re
import subprocess
import time

import pytest

import cluster_net
import tiny_runs
from tiny_runs import PAX, TINY, assert_same_losses, cpu_devices, losses

pytestmark = [pytest.mark.slow, pytest.mark.alone]   # 2 jax.distributed processes on 2 cores

HOSTS = ['node1', 'node2']
TIMEOUT = 15   # --heartbeat-timeout


@pytest.fixture(scope='module')
def net(tmp_path_factory):
  reason = cluster_net.unavailable()
  if reason:
    pytest.skip(reason)
  net = cluster_net.Network.start(str(tmp_path_factory.mktemp('net')), HOSTS)
  yield net
  net.stop()


def start(net, job, port: int, extra: list[str]) -> list[subprocess.Popen]:
  """`pax train` on node1 (process 0, the coordinator) and node2, each in its own namespaces."""
  env = {k: v for k, v in cpu_devices(dict(os.environ), 4).items() if '_proxy' not in k.lower()}
  return [net.popen(host, [*PAX, 'train', *TINY, '--set', 'PERCORE_BATCH_SIZE=1', *extra,
                           '--coordinator', f'node1:{port}', '--num-processes', '2', '--process-id', str(i),
                           '--heartbeat-timeout', str(TIMEOUT), '--job-log-dir', str(job)],
                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
          for i, host in enumerate(HOSTS)]


def test_two_hosts_over_a_slow_lossy_link_train_like_one_process(net, tmp_path):
  reference = tiny_runs.one_process(tmp_path / 'one', 6)
  net.impair('node2', loss=2, rate='20mbit')
  try:
    procs = start(net, tmp_path / 'job', 12301, tiny_runs.steps(6))
    outs = [p.communicate(timeout=900) for p in procs]
  finally:
    net.impair('node2')
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, out[-2000:] + err[-3000:]
  assert 'Devices: 8 x cpu (cpu), 2 process(es)' in outs[0][0]
  assert_same_losses(losses(tmp_path / 'job'), reference, range(1, 7))


@pytest.mark.parametrize('fault', ['cut', 'drop', 'kill'])
def test_a_lost_link_or_process_ends_every_other_process_with_one_line_naming_it(net, tmp_path, fault):
  """At step 3 the link of node2 goes down, or drops every packet (the link up), or its process is killed
  (`kill -9`): process 0 (node1) names process 1 on node2, and process 1, if alive, names the coordinator on
  node1; each within the timeout and a few beats (a killed peer's reset connection: at once), exit code 124,
  no traceback."""
  port = {'cut': 12302, 'drop': 12303, 'kill': 12304}[fault]
  procs = start(net, tmp_path / 'job', port, [*tiny_runs.steps(100000), '--set', 'task.train.save_interval_steps=1000'])
  try:
    progress = ''
    while 'step 3:' not in progress:   # process 0 prints the steps
      assert procs[0].poll() is None, procs[0].communicate()
      progress += procs[0].stdout.readline()
    cut = time.monotonic()
    if fault == 'cut':
      net.cut('node2')
    elif fault == 'drop':
      net.impair('node2', loss=100)
    else:
      procs[1].kill()
    outs = [p.communicate(timeout=300) for p in procs]   # a hang guard only
    stopped = time.monotonic() - cut
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    net.mend('node2')
    net.impair('node2')
  print(f'{fault}: every process stopped {stopped:.1f} s after it (--heartbeat-timeout {TIMEOUT})')
  survivors = procs if fault != 'kill' else procs[:1]
  errors = []
  for p, (_, err) in zip(survivors, outs):
    assert p.returncode == 124, err[-3000:]
    assert 'Traceback' not in err and 'Check failure' not in err and '*** ' not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith('error:')]
    assert len(lines) == 1, err[-3000:]
    assert err.rstrip().endswith(lines[0]), err[-3000:]   # the last word: nothing after it
    errors.append(lines[0])
  assert re.fullmatch(r'error: lost process 1 on node2 \(10\.77\.0\.12\): (no heartbeat for \d+ s '
                      rf'\(--heartbeat-timeout {TIMEOUT}\)|a collective failed \([a-z ]+\)): it stopped, or its host '
                      r'is down or unreachable; stopping\.', errors[0]), errors
  if fault != 'kill':
    assert errors[1] == (f'error: cannot reach the coordinator, process 0 at node1:{port}, for {TIMEOUT} s '
                         '(--heartbeat-timeout): it stopped, or its host is down or unreachable from node2; '
                         'stopping.'), errors
