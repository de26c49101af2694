"""The Grain input over prepared data: its saved state round trip, every token once, resumes.

Fast tests read a real prepared directory (real ArrayRecord shards, real Grain) in this process;
the slow ones kill real `pax train` processes with SIGKILL and resume them, on 1 and 2 processes.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import prepared_data
from conftest import run_pax
from paxcli.errors import UserError
from paxcli.inputs import grain_input
from paxcli.inputs.grain_input import GrainLmInput

SEQ = 16
STREAMS = 4


@pytest.fixture(scope='module')
def data(tmp_path_factory):
  root = tmp_path_factory.mktemp('prepared')
  docs = prepared_data.make(root, num_docs=60, eval_docs=8)
  return str(root), docs


def _input(directory, hosts=1, host=0, **kw):
  fields = dict(name='train', data=directory, is_training=True, batch_size=4, seq_len=SEQ, num_infeed_hosts=hosts,
                infeed_host_index=host, num_streams=STREAMS, workers=0)
  fields.update(kw)
  return GrainLmInput(**fields)


def _traced(inp, n, trace, monkeypatch) -> list[dict]:
  """n batches of `inp`, each with the (document, offset) of its tokens from the input's trace."""
  monkeypatch.setenv(grain_input.TRACE_ENV, str(trace))
  start = len(trace.read_text().splitlines()) if trace.exists() else 0
  batches = [inp.get_next() for _ in range(n)]
  lines = [json.loads(line) for line in trace.read_text().splitlines()[start:]]
  for batch, line in zip(batches, lines):
    batch['tokens'] = [tuple(t) for row in line['rows'] for t in row]
  return batches


def _read_positions(states: dict[int, dict], num_streams: int) -> list[int]:
  return [s + num_streams * j for s, state in states.items() for j in range(state['next'])]


def _open_tokens(inp, states: dict[int, dict]) -> list[tuple]:
  """(position, offset) of the tokens waiting in the streams' open and ready rows."""
  out = []
  for state in states.values():
    for row in state['open'] + state['ready']:
      for g, k in row:
        n = _doc_pairs(inp, g)
        out += [(g, k * SEQ + i) for i in range(min(SEQ, n - k * SEQ))]
  return out


def _doc_pairs(inp, g) -> int:
  return len(inp._docs[g]) // 5 - 1  # a document of n tokens gives n - 1 training pairs


def _check_once(inp, emitted: list[tuple], states: dict[int, dict]) -> None:
  """Every token of every document read is in exactly one batch or still in an open row."""
  seen = emitted + _open_tokens(inp, states)
  assert len(seen) == len(set(seen)), 'a token was given twice'
  want = {(g, i) for g in _read_positions(states, inp.num_streams) for i in range(_doc_pairs(inp, g))}
  assert set(seen) == want


def test_state_round_trip_gives_the_same_batches(data, tmp_path, monkeypatch):
  directory, _ = data
  first = _input(directory)
  _traced(first, 7, tmp_path / 'a', monkeypatch)
  saved = json.loads(first.get_state())
  assert len(json.dumps(saved)) < 4000  # small: a count and a few pieces per stream
  straight = _traced(first, 20, tmp_path / 'a', monkeypatch)  # past the 60 documents' first epoch
  resumed = _input(directory)
  resumed.restore([saved])
  again = _traced(resumed, 20, tmp_path / 'b', monkeypatch)
  for a, b in zip(straight, again):
    assert a['tokens'] == b['tokens']
    for key in ('ids', 'labels', 'weights', 'segment_ids', 'positions'):
      np.testing.assert_array_equal(a[key], b[key])
  assert resumed.batches_read == 27


@pytest.mark.parametrize('seq', [32768, 131072])
def test_long_rows_pack_documents_and_resume_exactly(seq, tmp_path):
  """Rows of 32k and 128k tokens: documents longer than a row go on in the next, shorter ones share a row as
  segments with their own positions, and a saved state gives the same batches again (issue 43)."""
  directory = tmp_path / 'long'
  prepared_data.make(directory, num_docs=10, max_len=seq * 3 // 2, seed=1)
  long_input = lambda: _input(str(directory), batch_size=2, seq_len=seq, num_streams=2)
  first = long_input()
  for _ in range(2):
    first.get_next()
  saved = json.loads(first.get_state())
  assert len(json.dumps(saved)) < 4000   # a count and a few pieces per stream, whatever the row's length
  straight = [first.get_next() for _ in range(4)]
  resumed = long_input()
  resumed.restore([saved])
  for a, b in zip(straight, (resumed.get_next() for _ in range(4))):
    for key in ('ids', 'labels', 'weights', 'segment_ids', 'positions'):
      np.testing.assert_array_equal(a[key], b[key])
  packed = 0
  for batch in straight:
    assert batch['ids'].shape == (2, seq)
    for ids, labels, segments, positions in zip(batch['ids'], batch['labels'], batch['segment_ids'],
                                                batch['positions']):
      starts = np.flatnonzero(np.diff(segments) != 0) + 1
      for part in np.split(np.arange(seq), starts):
        if segments[part[0]]:   # a document's piece: positions count on by one, labels are the next ids
          assert (np.diff(positions[part]) == 1).all()
          assert (labels[part][:-1] == ids[part][1:]).all()
      packed += len(set(segments[segments > 0].tolist())) > 1
  assert packed   # some row holds more than one document


def test_every_token_once_across_two_processes_then_one(data, tmp_path, monkeypatch):
  """2 processes read some batches, save, and 1 process goes on from both states: no token of a
  document read is given twice or lost, in batches or in the rows still open."""
  directory, _ = data
  hosts = [_input(directory, hosts=2, host=h, batch_size=2) for h in (0, 1)]
  emitted = [t for h in hosts for b in _traced(h, 9, tmp_path / f'h{h.infeed_host_index}', monkeypatch)
             for t in b['tokens']]
  saved = [json.loads(h.get_state()) for h in hosts]
  one = _input(directory, batch_size=4)
  one.restore(saved)
  emitted += [t for b in _traced(one, 15, tmp_path / 'one', monkeypatch) for t in b['tokens']]
  states = grain_input.stream_states(json.loads(one.get_state())['grain'])
  assert sorted(states) == list(range(STREAMS))
  assert min(s['next'] for s in states.values()) * STREAMS > 60  # past the first epoch
  _check_once(one, emitted, states)
  # The first epoch's documents, each of them whole exactly once.
  epoch = [(g, i) for g, i in emitted if g < 60]
  assert len(epoch) == len(set(epoch))


def test_eval_split_is_read_once_and_padded(data, monkeypatch, tmp_path):
  directory, _ = data
  inp = _input(directory, name='eval', split='eval', is_training=False, repeat=False, batch_size=4)
  batches = []
  with pytest.raises(Exception) as end:
    while True:
      batches += _traced(inp, 1, tmp_path / 'e', monkeypatch)
  assert type(end.value).__name__ == 'EndOfInput'
  tokens = [t for b in batches for t in b['tokens']]
  want = {(g, i) for g in range(8) for i in range(_doc_pairs(inp, g))}
  assert len(tokens) == len(set(tokens)) and set(tokens) == want
  last = batches[-1]
  assert last['ids'].shape == (4, SEQ)
  assert all(not w.any() for w, seg in zip(last['weights'], last['segment_ids']) if not seg.any())


def test_resume_with_other_streams_is_refused(data):
  directory, _ = data
  first = _input(directory)
  first.get_next()
  saved = json.loads(first.get_state())
  with pytest.raises(UserError, match='num_streams 4, this run has 8'):
    _input(directory, num_streams=8).restore([saved])


def test_more_workers_than_streams_is_refused(data):
  directory, _ = data
  with pytest.raises(UserError, match='set DATA_STREAMS to at least 8'):
    _input(directory, hosts=2, workers=4).get_next()


# ---- real `pax train` processes -------------------------------------------------------------------

TINY = ['--exp', 'lm_cloud.LmCloudSpmdTest', '--set', 'NUM_LAYERS=2', '--set', 'MODEL_DIMS=32',
        '--set', 'HIDDEN_DIMS=64', '--set', 'NUM_HEADS=4', '--set', 'DIMS_PER_HEAD=8',
        '--set', f'MAX_SEQ_LEN={SEQ}', '--set', 'VOCAB_SIZE=64', '--set', 'PERCORE_BATCH_SIZE=1',
        '--set', 'task.train.summary_interval_steps=1', '--set', 'task.train.save_interval_steps=2',
        '--set', 'DATA_WORKERS=1']  # through a worker process, as a run that sets it (the default is a thread)


def _trace_lines(path) -> dict[tuple, list]:
  """(process, batch) -> its rows, the last write of each winning (a batch trained again after a
  kill replaces the one whose step was lost)."""
  out = {}
  for line in open(path, encoding='utf-8'):
    record = json.loads(line)
    out[record['process'], record['batch']] = record['rows']
  return out


def _train_args(directory, job, steps):
  return ['train', *TINY, '--set', f'TRAIN_DATA={directory}', '--set', f'task.train.num_train_steps={steps}',
          '--job-log-dir', str(job)]


@pytest.mark.slow
def test_kill_9_at_random_points_then_resume_trains_the_same_batches(data, tmp_path):
  directory, _ = data
  steps = 12
  straight = run_pax(*_train_args(directory, tmp_path / 'straight', steps),
                     env={grain_input.TRACE_ENV: str(tmp_path / 'straight.trace')}, timeout=600)
  assert straight.returncode == 0, straight.stderr[-3000:]
  job, trace = tmp_path / 'killed', tmp_path / 'killed.trace'
  rng = random.Random(0)
  for _ in range(2):  # two kills, each after a random number of batches taken
    at = rng.randint(2, steps - 2)
    before = len(_trace_lines(trace)) if trace.exists() else 0
    proc = subprocess.Popen([sys.executable, '-m', 'paxcli.cli.app', *_train_args(directory, job, steps)],
                            env={**os.environ, grain_input.TRACE_ENV: str(trace)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
      if trace.exists() and sum(1 for _ in open(trace)) >= before + at:
        break
      time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its Grain workers
    proc.wait()
  final = run_pax(*_train_args(directory, job, steps), env={grain_input.TRACE_ENV: str(trace)}, timeout=600)
  assert final.returncode == 0, final.stderr[-3000:]
  assert _trace_lines(trace) == _trace_lines(tmp_path / 'straight.trace')
  assert len(_trace_lines(trace)) == steps


@pytest.mark.slow
@pytest.mark.alone
def test_two_processes_then_one_every_token_once(data, tmp_path):
  """8 steps on 2 processes (jax.distributed, gloo), then 8 more on 1: across all 16 batches and
  the rows left open, every token of every document read is trained exactly once, the first
  epoch whole."""
  directory, _ = data
  job, trace = tmp_path / 'job', tmp_path / 'trace'
  env = {grain_input.TRACE_ENV: str(trace)}
  two = run_pax('launch', '--processes', '2', '--devices-per-process', '4', '--grace', '2', '--',
                *_train_args(directory, job, 8), '--set', 'ICI_MESH_SHAPE=[1,4,1]', '--set', 'DCN_MESH_SHAPE=[2,1,1]',
                env=env, timeout=600)
  assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
  first = _trace_lines(trace)
  assert sorted(first) == [(p, b) for p in (0, 1) for b in range(8)]
  one = run_pax(*_train_args(directory, job, 16), '--set', 'ICI_MESH_SHAPE=[1,8,1]', env=env, timeout=600)
  assert one.returncode == 0, one.stderr[-3000:]
  lines = _trace_lines(trace)
  assert sorted(k for k in lines if k not in first) == [(0, b) for b in range(8, 16)]
  emitted = [tuple(t) for rows in lines.values() for row in rows for t in row]
  saved = grain_input.read_states(str(job / 'checkpoints' / '16' / 'input'))
  states = grain_input.stream_states(saved[0]['grain'])
  _check_once(_input(directory, num_streams=16), emitted, states)  # DATA_STREAMS' default
  epoch = [(g, i) for g, i in emitted if g < 60]
  assert len(epoch) == len(set(epoch))
