"""A stand-in for the Hugging Face Hub on 127.0.0.1: the few routes huggingface_hub's snapshot_download
calls (a repository's revision, its file tree, each file's metadata and bytes), serving local
directories as repositories. huggingface_hub itself then writes its cache (blobs, snapshots, refs), so
the tests read a cache exactly as huggingface_hub lays it out, with no network."""

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


class Hub:
  """Repositories {(repo_type, 'Org/name'): directory}; `requests` records what was asked."""

  def __init__(self, repos: dict):
    self.repos, self.requests = repos, []
    self.commits = {key: hashlib.sha1(repr(self.files(key)).encode()).hexdigest() for key in repos}
    self.server = ThreadingHTTPServer(('127.0.0.1', 0), _handler(self))
    threading.Thread(target=self.server.serve_forever, daemon=True).start()

  @property
  def endpoint(self) -> str:
    return f'http://127.0.0.1:{self.server.server_address[1]}'

  def files(self, key) -> list[str]:
    root = self.repos[key]
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root) for n in names)

  def close(self) -> None:
    self.server.shutdown()
    self.server.server_close()


def _handler(hub: Hub):
  class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
      pass

    def do_GET(self):
      self._route(head=False)

    def do_HEAD(self):
      self._route(head=True)

    def _send(self, code, body=b'', headers=None, head=False):
      self.send_response(code)
      for k, v in (headers or {}).items():
        self.send_header(k, v)
      self.send_header('Content-Length', str(len(body)))
      self.end_headers()
      if not head:
        self.wfile.write(body)

    def _route(self, head):
      hub.requests.append((self.command, self.path))
      parts = unquote(urlparse(self.path).path).strip('/').split('/')
      if parts[0] == 'api' and len(parts) >= 5:   # /api/{models,datasets}/Org/name/{revision,tree}/...
        key = (parts[1][:-1], '/'.join(parts[2:4]))
        if key not in hub.repos:
          return self._send(404, b'{"error": "Repository not found"}', {'X-Error-Code': 'RepoNotFound'})
        if parts[4] == 'revision':
          info = {'id': key[1], 'sha': hub.commits[key], 'siblings': [{'rfilename': f} for f in hub.files(key)]}
          return self._send(200, json.dumps(info).encode(), {'Content-Type': 'application/json'})
        tree = [{'type': 'file', 'path': f, 'size': os.path.getsize(os.path.join(hub.repos[key], f)),
                 'oid': hashlib.sha1(open(os.path.join(hub.repos[key], f), 'rb').read()).hexdigest()}
                for f in hub.files(key)]
        return self._send(200, json.dumps(tree).encode(), {'Content-Type': 'application/json'})
      kind = 'model'
      if parts[0] == 'datasets':
        kind, parts = 'dataset', parts[1:]
      key = (kind, '/'.join(parts[:2]))
      path = os.path.join(hub.repos.get(key, '/nonexistent'), *parts[4:])
      if key not in hub.repos or parts[2:3] != ['resolve'] or not os.path.isfile(path):
        return self._send(404, b'', {'X-Error-Code': 'EntryNotFound' if key in hub.repos else 'RepoNotFound'})
      data = open(path, 'rb').read()
      self._send(200, data, {'X-Repo-Commit': hub.commits[key], 'ETag': f'"{hashlib.sha1(data).hexdigest()}"'}, head)
  return Handler
