"""The built docs site in a real browser: pages render, navigation and search work.

  .venv/bin/python benchmarks/docs_site.py [--site DIR] [--out DIR]

Builds the site (`mkdocs build --strict`, unless --site names a built one), serves it on 127.0.0.1,
and opens it in headless Chromium (Debian's `chromium` package: `apt-get install chromium`). Prints
a table of checks and writes screenshots into --out (default build/docs-check/): front.png (the front
page), search.png (the results of typing 'fine-tune' into the search box), install.png. Exits 1 if a check
fails, 2 if Chromium is missing. tests/test_docs_browser.py runs it (slow; skipped without Chromium).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ['--headless', '--no-sandbox', '--disable-gpu', '--no-first-run', '--disable-background-networking',
         '--disable-component-update', '--disable-sync', '--disable-quic', '--hide-scrollbars']
# The newcomer's questions and the pages that answer them, each linked from the front page.
# Pages with long command lines and comments, checked for code that would hide past the page's width.
WIDE_PAGES = ('tutorials/fine-tune/', 'guides/model-families/', 'guides/checkpoints/', 'tutorials/own-data/')
ANSWERS = {'install/': 'Install', 'tutorials/own-data/': 'Your own data',
           'tutorials/fine-tune/': 'Fine-tune a released model', 'reference/job-directory/': 'Job directory'}


def chromium() -> str | None:
  return shutil.which('chromium') or shutil.which('chromium-browser')


class Browser:
  """Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe: JSON
  messages ending in NUL on fds 3 and 4), so a check waits in real time for what a page's scripts
  do (the search index loads in a worker) and clicks as a user would."""

  def __init__(self, binary: str):
    self._profile = tempfile.TemporaryDirectory()
    to_child, self._out = os.pipe()
    self._in, from_child = os.pipe()

    def fds():  # the child's fd 3 reads what we send, fd 4 carries its answers (copies first: no clobbering)
      read, write = os.dup(to_child), os.dup(from_child)
      os.dup2(read, 3)
      os.dup2(write, 4)

    # pass_fds keeps 3 and 4 open in the child: subprocess closes the others after preexec_fn.
    self._proc = subprocess.Popen([binary, *FLAGS, f'--user-data-dir={self._profile.name}', '--remote-debugging-pipe',
                                   '--window-size=1280,900', 'about:blank'], preexec_fn=fds,
                                  pass_fds=(3, 4), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(to_child)
    os.close(from_child)
    self._buffer, self._id = b'', 0
    target = self._call('Target.createTarget', url='about:blank')['targetId']
    self._session = self._call('Target.attachToTarget', targetId=target, flatten=True)['sessionId']
    self._call('Page.enable', session=True)

  def _call(self, method: str, session: bool = False, **params):
    self._id += 1
    message = {'id': self._id, 'method': method, 'params': params}
    if session:
      message['sessionId'] = self._session
    os.write(self._out, json.dumps(message).encode() + b'\0')
    while True:
      while b'\0' not in self._buffer:
        chunk = os.read(self._in, 1 << 16)
        if not chunk:
          raise RuntimeError(f'chromium closed the pipe during {method}')
        self._buffer += chunk
      raw, self._buffer = self._buffer.split(b'\0', 1)
      reply = json.loads(raw)
      if reply.get('id') == self._id:
        if 'error' in reply:
          raise RuntimeError(f'{method}: {reply["error"]}')
        return reply.get('result', {})

  def evaluate(self, expression: str):
    result = self._call('Runtime.evaluate', session=True, expression=expression, returnByValue=True,
                        awaitPromise=True)
    if 'exceptionDetails' in result:
      raise RuntimeError(f'{expression}: {result["exceptionDetails"]}')
    return result['result'].get('value')

  def wait_for(self, expression: str, timeout: float = 60.0):
    """Polls a JavaScript expression until it is truthy (real time); returns its value, or None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      try:
        value = self.evaluate(expression)
      except RuntimeError as e:   # asked while the page navigates (a click just landed): ask again
        if 'navigated or closed' not in str(e):
          raise
        value = None
      if value:
        return value
      time.sleep(0.25)
    return None

  def open(self, url: str) -> None:
    self._call('Page.navigate', session=True, url=url)
    self.wait_for('document.readyState === "complete" && location.href !== "about:blank"')

  def h1(self) -> str:
    return self.evaluate('(document.querySelector("article h1") || {}).textContent || ""').replace('¶', '').strip()

  def screenshot(self, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(self._call('Page.captureScreenshot', session=True, format='png')['data']))

  def close(self) -> None:
    with contextlib.suppress(Exception):
      self._call('Browser.close')
    with contextlib.suppress(Exception):
      self._proc.wait(timeout=20)
    if self._proc.poll() is None:
      self._proc.kill()
    os.close(self._out)
    os.close(self._in)
    self._profile.cleanup()


@contextlib.contextmanager
def serve(directory: Path):
  """The site over HTTP on 127.0.0.1 (search loads its index with fetch, which file:// refuses)."""
  handler = functools.partial(_Quiet, directory=str(directory))
  server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    yield f'http://127.0.0.1:{server.server_address[1]}/'
  finally:
    server.shutdown()
    server.server_close()


class _Quiet(http.server.SimpleHTTPRequestHandler):
  def log_message(self, *args):
    pass


def build(site: Path) -> None:
  env = {**os.environ, 'NO_MKDOCS_2_WARNING': '1'}
  subprocess.run([sys.executable, '-m', 'mkdocs', 'build', '--strict', '-q', '-d', str(site)], cwd=ROOT, env=env,
                 check=True)


def check(site: Path, out: Path, browser: Browser) -> list[tuple[str, bool, str]]:
  """(check, passed, detail) for each check, as a user clicks and types; screenshots into `out`."""
  rows = []
  with serve(site) as url:
    browser.open(url)
    tabs = browser.evaluate('[...document.querySelectorAll(".md-nav__link")].map(a => a.textContent.trim())')
    rows.append(('front page renders with its navigation', browser.h1() == 'paxcli' and 'Tutorials' in tabs,
                 f'h1 {browser.h1()!r}, {len(tabs)} navigation links'))
    browser.screenshot(out / 'front.png')
    for href, title in ANSWERS.items():   # one click from the front page's content
      browser.open(url)
      clicked = browser.evaluate(f'(a => a ? (a.click(), true) : false)(document.querySelector("article a[href=\'{href}\']"))')
      landed = clicked and browser.wait_for(f'location.pathname === "/{href}" && document.readyState === "complete"')
      rows.append((f'click from the front page -> {href}', bool(landed) and browser.h1() == title, f'h1 {browser.h1()!r}'))
      if href == 'install/':
        gpu = browser.evaluate('!!document.getElementById("nvidia-gpu")')
        rows.append(('install page has the NVIDIA GPU section', gpu, ''))
        browser.screenshot(out / 'install.png')
    browser.open(url + 'reference/knobs/')
    knobs = browser.evaluate('[...document.querySelectorAll("article td code")].map(c => c.textContent)')
    rows.append(('knob reference (generated) lists NUM_LAYERS', 'NUM_LAYERS' in knobs, f'{len(knobs)} code cells'))
    broken = browser.evaluate('[...document.querySelectorAll("article td:first-child code")]'
                              '.filter(c => c.getClientRects().length > 1).map(c => c.textContent)')
    rows.append(('knob names stay on one line at 1280 px', not broken, ', '.join(broken[:5])))
    for page in WIDE_PAGES:   # a code line wider than the page wraps: nothing hides behind a scroll bar
      browser.open(url + page)
      hidden = browser.evaluate('[...document.querySelectorAll("article pre > code")]'
                                '.filter(c => c.scrollWidth > c.clientWidth + 1).length')
      rows.append((f'code blocks of {page} fit 1280 px', hidden == 0, f'{hidden} blocks scroll'))
    browser.open(url)
    browser.evaluate('(i => { i.focus(); i.value = "fine-tune"; i.dispatchEvent(new Event("input", {bubbles: true})); })'
                     '(document.querySelector("input.md-search__input"))')
    hits = browser.wait_for('(l => l.length ? l : null)([...document.querySelectorAll(".md-search-result__link")]'
                            '.map(a => a.getAttribute("href")))', timeout=90) or []
    rows.append(('search: typing "fine-tune" finds the tutorial', any('tutorials/fine-tune/' in h for h in hits),
                 f'{len(hits)} results'))
    browser.screenshot(out / 'search.png')
  return rows


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--site', type=Path, help='a built site (default: build one)')
  parser.add_argument('--out', type=Path, default=ROOT / 'build' / 'docs-check', help='where screenshots go')
  args = parser.parse_args()
  binary = chromium()
  if binary is None:
    print('chromium not found: apt-get install chromium', file=sys.stderr)
    return 2
  with tempfile.TemporaryDirectory() as tmp:
    site = args.site or Path(tmp) / 'site'
    if args.site is None:
      build(site)
    browser = Browser(binary)
    try:
      rows = check(site, args.out, browser)
    finally:
      browser.close()
  width = max(len(r[0]) for r in rows)
  print(f'{"check":<{width}}  result  detail')
  for name, ok, detail in rows:
    print(f'{name:<{width}}  {"ok" if ok else "FAIL":<6}  {detail}')
  print(f'screenshots: {args.out}/front.png, search.png, install.png')
  return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == '__main__':
  sys.exit(main())
