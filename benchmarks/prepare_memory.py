"""Peak memory of `pax data prepare` on one huge line, and on a gzip bomb (prints a rich table).

  .venv/bin/python benchmarks/prepare_memory.py [--mb 100] [--workers 1 2]

Each row is a real `pax data prepare` process; its peak is the largest sum of the resident memory of
it and its children (tokenizing workers, the tokenizer trainer), sampled every 20 ms from /proc. The
inputs, written to a temporary directory:

  small      20 ordinary lines: the command's own footprint (Python, the tokenizer, rich)
  line       one JSONL line of --mb MB of text (Python's standard library sources), 20 ordinary lines
  bomb.gz    the same kind of line, of one repeated word, gzipped: ~1000x smaller on disk

Each is prepared with the 2,048-piece tokenizer `pax data prepare` trains by default (on the data,
as a user gets it) and with a given --tokenizer of 512 pieces (a small vocabulary: about one token per
byte, the worst case for the tokens' arrays). `x line` is (peak - small's peak) / the line's bytes:
what the line itself costs: about 2 bytes per byte of the line and ~10 per token (the record's
5 bytes, held as an array and as the bytes ArrayRecord takes). Before issue #33 a 98 MB line took
6.5 GB (65x, a 300-piece tokenizer, this machine); a line over PAXCLI_MAX_LINE_BYTES (128 MiB by
default) is refused in one line naming it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from rich.console import Console
from rich.table import Table

import machine   # benchmarks/machine.py: the processor beside the table

PAX = [sys.executable, '-m', 'paxcli.cli.app']


def _corpus(chars: int) -> str:
  """`chars` characters of real text: Python's standard library sources (code, docstrings and
  comments), repeated as needed. Random words would tokenize like no real data does."""
  root = os.path.dirname(os.__file__)
  parts, size = [], 0
  for name in sorted(os.listdir(root)):
    if name.endswith('.py'):
      with open(os.path.join(root, name), encoding='utf-8', errors='replace') as f:
        parts.append(f.read())
      size += len(parts[-1])
    if size > 20 * 10 ** 6:
      break
  text = ''.join(parts)
  return (text * (chars // len(text) + 1))[:chars]


def make_inputs(root: str, megabytes: int) -> dict[str, str]:
  corpus = _corpus(10 ** 6)
  small = [json.dumps({'text': corpus[i * 400:(i + 1) * 400]}) + '\n' for i in range(20)]
  paths = {'small': os.path.join(root, 'small.jsonl'), 'line': os.path.join(root, 'line.jsonl'),
           'bomb.gz': os.path.join(root, 'bomb.jsonl.gz')}
  with open(paths['small'], 'w', encoding='utf-8') as f:
    f.writelines(small)
  big = json.dumps({'text': _corpus(megabytes * 10 ** 6)}, ensure_ascii=False)
  with open(paths['line'], 'w', encoding='utf-8') as f:
    f.write(big[:megabytes * 10 ** 6 - 3] + '"}\n')  # cut to the size asked (the text's end may lose a bit)
    f.writelines(small)
  del big
  with gzip.open(paths['bomb.gz'], 'wt', encoding='utf-8', compresslevel=9) as f:
    f.write(json.dumps({'text': ('river ' * (megabytes * 10 ** 6 // 6))[:megabytes * 10 ** 6 - 12]}) + '\n')
    f.writelines(small)
  return paths


def _tree_rss(pid: int) -> int:
  """Resident bytes of `pid` and all its descendants."""
  children: dict[int, list[int]] = {}
  rss: dict[int, int] = {}
  for name in os.listdir('/proc'):
    if not name.isdigit():
      continue
    try:
      with open(f'/proc/{name}/stat', 'rb') as f:
        fields = f.read().rsplit(b')', 1)[1].split()
      children.setdefault(int(fields[1]), []).append(int(name))
      rss[int(name)] = int(fields[21]) * os.sysconf('SC_PAGE_SIZE')
    except (OSError, IndexError, ValueError):
      continue
  total, todo = 0, [pid]
  while todo:
    p = todo.pop()
    total += rss.get(p, 0)
    todo += children.get(p, [])
  return total


def run(args: list[str], cwd: str) -> tuple[int, float, int, str]:
  """(exit code, seconds, peak bytes of the process tree, last line of stderr) of one pax command."""
  env = dict(os.environ, PAXCLI_CACHE=os.path.join(cwd, 'cache'))
  start = time.perf_counter()
  proc = subprocess.Popen(PAX + args, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  peak = [0]

  def sample():
    while proc.poll() is None:
      peak[0] = max(peak[0], _tree_rss(proc.pid))
      time.sleep(0.02)
  watcher = threading.Thread(target=sample, daemon=True)
  watcher.start()
  err = proc.stderr.read().decode(errors='replace')
  proc.wait()
  watcher.join()
  lines = [line for line in err.splitlines() if line.strip()]
  return proc.returncode, time.perf_counter() - start, peak[0], lines[-1] if lines else ''


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--mb', type=int, default=100, help='Size of the huge line, in MB.')
  parser.add_argument('--workers', type=int, nargs='+', default=[1, 2])
  opts = parser.parse_args()
  console = Console(width=160)
  with tempfile.TemporaryDirectory() as root:
    paths = make_inputs(root, opts.mb)
    tokenizer = os.path.join(root, 'spm512.model')
    subprocess.run(PAX + ['tokenizer', 'train', '--data', paths['small'], '--vocab-size', '512', '--output',
                          tokenizer], check=True, capture_output=True)
    table = Table(title=f'pax data prepare: peak memory (this machine, {os.cpu_count()} CPUs)')
    for col in ('input', 'on disk', 'line', 'tokenizer', 'workers', 'exit', 'seconds', 'peak RSS', 'x line'):
      table.add_column(col, justify='left' if col in ('input', 'tokenizer') else 'right')
    base: dict[tuple, int] = {}
    for name in ('small', 'line', 'bomb.gz'):
      for tok in ('trained 2048', 'given 512'):
        for workers in opts.workers:
          out = os.path.join(root, f'out-{name}-{tok[:5]}-{workers}')
          args = ['data', 'prepare', paths[name], out, '--workers', str(workers)]
          args += ['--tokenizer', tokenizer] if tok == 'given 512' else ['--vocab-size', '2048']
          code, seconds, peak, last = run(args, root)
          line = 0 if name == 'small' else opts.mb * 10 ** 6
          if name == 'small':
            base[tok, workers] = peak
          ratio = f'{(peak - base[tok, workers]) / line:.1f}' if line else ''
          table.add_row(name, f'{os.path.getsize(paths[name]) / 1e6:,.1f} MB', f'{line / 1e6:,.0f} MB',
                        tok, str(workers), str(code), f'{seconds:.1f}', f'{peak / 2 ** 20:,.0f} MiB', ratio)
          if code:
            console.print(f'{name}, {tok}, {workers} worker(s): {last}', style='red', markup=False)
    console.print(table)
    console.print(machine.describe())


if __name__ == '__main__':
  main()
