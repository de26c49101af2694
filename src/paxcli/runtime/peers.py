"""Each process of a run watches the others: one line naming the host that went away, not a hang.

When a process of a multi-process run dies or its host drops off the network, the others block in the
next collective: gloo waits on a peer that never answers, until JAX's coordination service misses that
peer's heartbeats (100 s by default) and aborts every process with a C++ stack trace. Here each process
beats into JAX's key-value store (on the coordinator, process 0) from a thread of its own, whatever its
main thread is doing (a step, a compilation, a save):

- process 0 sees a peer whose beats stop for `timeout` seconds, and names it (process, host) to everyone;
- a process whose own beats cannot reach the coordinator for `timeout` seconds names the coordinator;
- a process that ends in failure says so on its way out (`exiting`), and the others stop at once with
  its reason instead of waiting out the timeout;
- a process killed outright (SIGKILL, the kernel's OOM killer) says nothing: where `pax launch` started it,
  the launcher writes what it saw into a note beside the heartbeat files (LAUNCHER_NOTE), and the others
  stop on it at their next beat;
- a collective that fails because its peer went away (gloo: `Connection reset by peer`) is said in one
  line naming that process and host (`collective_loss`), not a traceback.

Each then prints one `error:` line and exits with LOST (124). JAX's own heartbeat timeout is set above
this one (`jax_heartbeat_seconds`), so its abort never comes first. A scheduler (or `pax launch
--max-restarts`) then starts the job again from its newest checkpoint.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import re
import socket
import sys
import threading
import time
from typing import Optional

LOST = 124
DEFAULT_TIMEOUT = 100.0   # JAX's own heartbeat timeout, which this one replaces
# Exit codes after which the others stop too, by themselves: finished, or the agreed preemption stop.
PEERS_STOP_TOO = (0, 138, 143)
# A peer's exit code this process takes over: a refusal and a divergence would come back the same.
SAME_AGAIN = (2, 3)
FAILED_PEER_GRACE = 10.0
EXIT_SAY_SECONDS = 5.0
START_BARRIER_MS = 300_000
_PREFIX = 'paxcli/peers/'
# Beside `pax launch`'s heartbeat files (distributed.ENV_HEARTBEAT): its line on a child it saw fail.
LAUNCHER_NOTE = 'failed'
MAX_NOTE_BYTES = 500
# A collective that failed because the process at the other end went away: gloo's read or write errors
# name its address ('Gloo AllGather failed: [...pair.cc:538] Read error [10.0.0.2]:57476: Connection reset by
# peer').
_PEER_GONE = re.compile(r'(?:gloo|nccl)[^\n]*?(connection reset by peer|connection closed by peer|broken pipe|'
                        r'connection refused|remote process exited|timed out)', re.IGNORECASE)
_PEER_ADDRESS = re.compile(r'\[([0-9A-Fa-f.:]+)\]:\d+')


@dataclasses.dataclass(frozen=True)
class Verdict:
  """Why this process stops: the line it prints, its exit code, and seconds it may first end by itself."""
  message: str
  code: int = LOST
  grace: float = 0.0


def kv_get(client, key: str) -> Optional[str]:
  """The value of `key` in JAX's key-value store, None if it is not set; an unreachable store raises."""
  try:
    return client.key_value_try_get(key)
  except Exception as e:  # pylint: disable=broad-except  (XLA's errors have no common type)
    if 'NOT_FOUND' in str(e):
      return None
    raise


def _index(key: str) -> Optional[int]:
  tail = key.rsplit('/', 1)[-1]
  return int(tail) if tail.isdigit() else None


def _exit_record(value: str) -> tuple[int, str]:
  """(exit code, reason) of an `exit/<i>` value: 'CODE REASON'."""
  code, _, reason = value.partition(' ')
  return (int(code) if code.lstrip('-').isdigit() else 1), reason[:300]


def launcher_note(heartbeat_file: str) -> str:
  """Where `pax launch` notes a child it saw fail: beside that child's heartbeat file (LAUNCHER_NOTE)."""
  return os.path.join(os.path.dirname(heartbeat_file), LAUNCHER_NOTE)


def jax_heartbeat_seconds(timeout: Optional[float]) -> int:
  """JAX's heartbeat timeout for a run watched with `timeout`: late enough that this watch speaks first."""
  return int(max(DEFAULT_TIMEOUT, 2 * (timeout or DEFAULT_TIMEOUT)) + 10)


def beat_every(timeout: float) -> float:
  return max(0.5, min(timeout / 5, 10.0))


class Watch:
  """See the module docstring. `client`: jax.distributed's client (its key-value store)."""

  def __init__(self, client, process: int, count: int, timeout: float, coordinator: str,
               launcher_note: Optional[str] = None):
    self.client, self.process, self.count, self.timeout = client, process, count, timeout
    self.coordinator, self.launcher_note = coordinator, launcher_note
    self.every = beat_every(timeout)
    self._stop = threading.Event()
    self._reached = time.monotonic()   # when this process last reached the coordinator
    self._hosts: dict[int, str] = {}
    self._seen: dict[int, tuple[str, float]] = {}   # process 0: peer -> (its last beat, when it changed)
    self._done: set[int] = set()
    self._verdict: Optional[Verdict] = None
    self._said = False

  def start(self) -> 'Watch':
    """Publishes this process's host and address, reads every other's (all at once: a barrier), and starts
    watching."""
    self._set(f'host/{self.process}', f'{socket.gethostname()} {_address_towards(self.coordinator)}')
    self.client.wait_at_barrier(_PREFIX + 'hosts', START_BARRIER_MS)
    for key, value in self.client.key_value_dir_get(_PREFIX + 'host/'):
      if _index(key) is not None:
        self._hosts[_index(key)] = value[:200]
    now = time.monotonic()
    self._seen = {i: ('', now) for i in range(self.count) if i != self.process}
    for target, name in ((self._beat, 'paxcli-peers-beat'), (self._watch, 'paxcli-peers-watch')):
      threading.Thread(target=target, name=name, daemon=True).start()
    atexit.register(self.stop)
    return self

  def exiting(self, code: int, reason: str = '') -> None:
    """Tells the others how this process ends (code 0, 138 and 143 do not stop them: they end the same way).
    The first call counts."""
    if self._said:
      return
    self._said = True
    self._stop.set()

    def say():
      try:
        self._set(f'exit/{self.process}', f'{int(code)} {reason}'.strip()[:500])
      except Exception:  # pylint: disable=broad-except
        pass   # the coordinator is gone: the others find out by themselves
    # An unreachable coordinator can hold the call for long: the exit does not wait on it.
    said = threading.Thread(target=say, name='paxcli-peers-exit', daemon=True)
    said.start()
    said.join(EXIT_SAY_SECONDS)

  def stop(self) -> None:
    self._stop.set()

  def collective_loss(self, error: BaseException) -> Optional[str]:
    """One line for an error of a collective whose peer went away (the process and host it names), else None."""
    found = _PEER_GONE.search(str(error))
    if found is None:
      return None
    address = next(iter(_PEER_ADDRESS.findall(found.group(0))), None)
    why = found.group(1).lower()
    there = [p for p, v in self._hosts.items() if address and v.split(' ')[-1] == address and p != self.process]
    who = (f'process {there[0]} on {self._host(there[0])}' if len(there) == 1 else
           f'the process at {address}' if address else 'a peer process')
    return f'lost {who}: a collective failed ({why}): it stopped, or its host is down or unreachable; stopping.'

  # ---- the threads ----

  def _beat(self) -> None:
    """Beats, and reads what the store says of the others; `_reached` is the time of the last success.
    A call to an unreachable coordinator may block for long: `_watch` judges the time, not this thread."""
    beat = 0
    while not self._stop.wait(self.every) and self._verdict is None:
      beat += 1
      try:
        self._set(f'beat/{self.process}', str(beat))
        self._verdict = self._judge()
        self._reached = time.monotonic()
      except Exception:  # pylint: disable=broad-except  (the coordinator unreachable: _watch times it)
        continue

  def _watch(self) -> None:
    while not self._stop.wait(self.every):
      verdict = self._verdict
      if verdict is None and time.monotonic() - self._reached > self.timeout:
        verdict = Verdict(f'cannot reach the coordinator, process 0 at {self.coordinator}, for {self.timeout:g} s '
                          '(--heartbeat-timeout): it stopped, or its host is down or unreachable from '
                          f'{socket.gethostname()}; stopping.')
      if verdict is not None:
        # A peer's failure may be this process's too (the same refusal, the same NaN): it gets the grace to
        # end by itself, in its own words.
        if self._stop.wait(verdict.grace):
          return
        self._lost(verdict)
        return

  def _judge(self) -> Optional[Verdict]:
    """What stops this process, from the key-value store: a peer that failed, or (process 0) a peer silent
    for longer than the timeout, or (the others) what process 0 found."""
    for key, value in self.client.key_value_dir_get(_PREFIX + 'exit/'):
      peer, (code, reason) = _index(key), _exit_record(value)
      if peer in (None, self.process) or peer in self._done:
        continue
      if code in PEERS_STOP_TOO:
        self._done.add(peer)
        if peer == 0:   # the coordinator ended as this process will: nothing left to watch
          self._stop.set()
          return None
        continue
      return Verdict(f'process {peer} on {self._host(peer)} failed (exit code {code}'
                     f'{": " + reason if reason else ""}); stopping.', code if code in SAME_AGAIN else LOST,
                     grace=min(self.timeout, FAILED_PEER_GRACE))
    noted = self._noted()
    if noted:
      return Verdict(f'{noted}; stopping.')
    if self.process != 0:
      found = self._get('lost')
      return Verdict(f'{found}; stopping.') if found else None
    beats = {_index(k): v for k, v in self.client.key_value_dir_get(_PREFIX + 'beat/')}
    now = time.monotonic()
    for peer, (last, since) in list(self._seen.items()):
      if peer in self._done:
        continue
      if beats.get(peer, '') != last:
        self._seen[peer] = (beats.get(peer, ''), now)
      elif now - since > self.timeout:
        found = (f'lost process {peer} on {self._host(peer)}: no heartbeat for {now - since:.0f} s '
                 f'(--heartbeat-timeout {self.timeout:g}): it stopped, or its host is down or unreachable')
        self._set('lost', found)
        time.sleep(2 * self.every)   # the others read it before the coordinator goes
        return Verdict(f'{found}; stopping.')
    return None

  def _noted(self) -> Optional[str]:
    """The launcher's line on a process it saw fail (LAUNCHER_NOTE), printable and bounded, or None."""
    if not self.launcher_note:
      return None
    try:
      with open(self.launcher_note, 'rb') as f:
        text = f.read(MAX_NOTE_BYTES).decode('utf-8', errors='replace')
    except OSError:
      return None
    return ''.join(c for c in text.strip() if c.isprintable()) or None

  def _lost(self, verdict: Verdict) -> None:
    try:
      sys.stderr.write(f'error: {verdict.message}\n')
      sys.stderr.flush()
    except (OSError, ValueError):
      pass
    os._exit(verdict.code)   # the main thread may be blocked in a collective for good

  # ---- the key-value store ----

  def _set(self, key: str, value: str) -> None:
    self.client.key_value_set(_PREFIX + key, value, allow_overwrite=True)

  def _get(self, key: str) -> Optional[str]:
    """The value of `key`, None if it is not set; an unreachable store raises."""
    return kv_get(self.client, _PREFIX + key)

  def _host(self, peer: int) -> str:
    """'node2 (10.0.0.2)': the host of process `peer`, as it published it at the start."""
    name, _, address = self._hosts.get(peer, '?').partition(' ')
    return f'{name} ({address})' if address and address != name else name


def _address_towards(coordinator: str) -> str:
  """This host's address on the way to the coordinator (no packet is sent), or its name's."""
  host, _, port = coordinator.rpartition(':')
  try:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
      s.connect((host.strip('[]'), int(port)))
      return s.getsockname()[0]
  except (OSError, ValueError):
    try:
      return socket.gethostbyname(socket.gethostname())
    except OSError:
      return '?'

