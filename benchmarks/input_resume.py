"""Time to the first batch after a resume, and Grain's tokens/s per process (prints rich tables).

  .venv/bin/python benchmarks/input_resume.py [--docs 200000] [--skip-limit 120]

Table 1: a resume at step 10, 10^3 and 10^5 of the default experiment's batch (16 rows x 128
tokens on one device): the file input (TRAIN_DATA of JSONL, today's resume: re-read and drop the
batches consumed) against the Grain input over the same documents prepared (restore the saved
state, read the first batch). The file input's skip is run while it takes under --skip-limit
seconds and extrapolated from its rate beyond. Grain's state at step 10^5 is its state at step
10^3 with every stream's count moved on to where 10^5 steps would leave it, its open rows kept
(the restore reads only the open rows' documents, whatever the count: that is the point). Grain is timed with one
worker process (its start included) and with none (DATA_WORKERS' default: a prefetch thread).

Table 2: Grain's tokens/s in one process at bench.Llama1B's batch (8 rows x 2048 tokens), against
the 56.8k tokens/s one H100 consumes for it; the issue asks for at least 5x.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'tests'))
import prepared_data  # noqa: E402  (the tests' prepared-directory writer)

from paxcli.inputs import prepared  # noqa: E402
from paxcli.inputs.file_input import FileLmInput  # noqa: E402
from paxcli.inputs.grain_input import GrainLmInput, stream_states  # noqa: E402
import machine   # benchmarks/machine.py: the processor beside the table

VOCAB = 2048
H100_TOKENS_PER_SEC = 56_800
STEPS = (10, 1_000, 100_000)


def make_data(root: str, num_docs: int) -> tuple[str, str, str]:
  """The same random documents as JSONL (for the file input) and prepared (for Grain)."""
  rng = np.random.default_rng(0)
  lengths = rng.integers(50, 800, size=num_docs)
  docs = [np.append(rng.integers(2, VOCAB, size=n), prepared_data.EOS) for n in lengths]
  tok = os.path.join(root, 'tokenizer.json')
  prepared_data.write_tokenizer(tok, VOCAB)
  jsonl = os.path.join(root, 'docs.jsonl')
  with open(jsonl, 'w') as f:
    for d in docs:
      f.write(json.dumps({'text': ' '.join(f'w{t}' for t in d[:-1])}) + '\n')
  out = os.path.join(root, 'prepared')
  os.makedirs(os.path.join(out, 'tokenizer'))
  prepared_data.write_tokenizer(os.path.join(out, 'tokenizer', 'tokenizer.json'), VOCAB)
  shards, per = [], (num_docs + 7) // 8
  for i in range(8):
    name = prepared.shard_name('train', i, 8)
    records, tokens = prepared.write_shard(os.path.join(out, name), [
        prepared.encode(d, np.ones(len(d))) for d in docs[i * per:(i + 1) * per]])
    shards.append(prepared.Shard(name, records, tokens))
  prepared.write_manifest(out, prepared.Manifest('tokenizer/tokenizer.json', VOCAB, prepared_data.EOS,
                                                 {'train': shards}))
  return jsonl, tok, out


def file_resume(jsonl: str, tok: str, step: int, limit: float) -> tuple[float, bool]:
  """Seconds to the first batch after skipping `step` batches; (estimate, True) past `limit`."""
  inp = FileLmInput(name='train', is_training=True, data=jsonl, split='all', tokenizer=tok, seq_len=128,
                    batch_size=16, num_infeed_hosts=1, infeed_host_index=0)
  start = time.perf_counter()
  batches = inp._batches()
  for i in range(step + 1):
    next(batches)
    if time.perf_counter() - start > limit:
      return (time.perf_counter() - start) / (i + 1) * (step + 1), True
  return time.perf_counter() - start, False


def grain_input(directory: str, workers: int, batch: int = 16, seq_len: int = 128) -> GrainLmInput:
  return GrainLmInput(name='train', is_training=True, data=directory, seq_len=seq_len, batch_size=batch,
                      num_infeed_hosts=1, infeed_host_index=0, workers=workers)


def grain_states(directory: str) -> dict[int, dict]:
  """Real saved states at steps 10 and 10^3, and 10^3's moved on to 10^5 (module docstring)."""
  inp = grain_input(directory, 0)
  states = {}
  for step in STEPS[:2]:
    while inp.batches_read < step:
      inp.get_next()
    states[step] = json.loads(inp.get_state())
  inp.close()
  moved = json.loads(json.dumps(states[STEPS[1]]))
  scale = STEPS[2] / STEPS[1]
  for st in moved['grain']['paxcli_streams'].values():
    st['next'] = int(st['next'] * scale)  # the open rows keep their (real) pieces: the same reads
  moved['batches'] = STEPS[2]
  states[STEPS[2]] = moved
  assert len(stream_states(moved['grain'])) == moved['num_streams']
  return states


def grain_resume(directory: str, state: dict, workers: int) -> float:
  start = time.perf_counter()
  inp = grain_input(directory, workers)
  inp.restore([state])
  inp.get_next()
  seconds = time.perf_counter() - start
  inp.close()
  return seconds


def grain_rate(directory: str, workers: int, seconds: float = 20.0) -> float:
  inp = grain_input(directory, workers, batch=8, seq_len=2048)
  inp.get_next()  # workers started
  start, tokens = time.perf_counter(), 0
  while time.perf_counter() - start < seconds:
    tokens += int(inp.get_next()['segment_ids'].astype(bool).sum())
  rate = tokens / (time.perf_counter() - start)
  inp.close()
  return rate


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--docs', type=int, default=200_000)
  parser.add_argument('--skip-limit', type=float, default=120.0)
  args = parser.parse_args()
  console = Console()
  with tempfile.TemporaryDirectory() as root:
    t = time.perf_counter()
    jsonl, tok, directory = make_data(root, args.docs)
    console.print(f'{args.docs:,} documents written in {time.perf_counter() - t:.0f} s')
    states = grain_states(directory)
    table = Table(title='Time to the first batch after a resume (16 x 128 tokens a batch, 1 process)')
    for col in ('step', 'file input: skip (s)', 'Grain: restore, 1 worker (s)', 'Grain: restore, no worker (s)',
                'Grain state (bytes)'):
      table.add_column(col, justify='right')
    for step in STEPS:
      skip, estimated = file_resume(jsonl, tok, step, args.skip_limit)
      table.add_row(f'{step:,}', f'{skip:,.2f}{" (extrapolated)" if estimated else ""}',
                    f'{grain_resume(directory, states[step], 1):.2f}',
                    f'{grain_resume(directory, states[step], 0):.3f}', f'{len(json.dumps(states[step])):,}')
    console.print(table)
    console.print(machine.describe())
    rates = Table(title='Grain tokens/s in one process at bench.Llama1B\'s batch (8 x 2048)')
    for col in ('workers', 'tokens/s', 'x one H100 (56.8k tokens/s)'):
      rates.add_column(col, justify='right')
    for workers in (0, 1, 2):
      rate = grain_rate(directory, workers)
      rates.add_row(str(workers), f'{rate:,.0f}', f'{rate / H100_TOKENS_PER_SEC:.1f}x')
    console.print(rates)
    console.print(machine.describe())


if __name__ == '__main__':
  main()
