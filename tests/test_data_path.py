"""The prepared-data path a user runs, through the real CLI in a fresh shell with relative paths
(`pax data prepare/show`, `pax inspect-input`, `pax train` killed and resumed, `pax eval`, `pax
decode`); a shipped tokenizer_config.json kept with prepared data; mixtures of prepared directories."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import grain
import numpy as np
import pytest

import prepared_data
from paxcli import api
from paxcli.errors import UserError
from paxcli.inputs import prepared, tokenizers
from paxcli.inputs.grain_input import GrainLmInput
from paxcli.jobdir import layout
from paxcli.jobdir import tokenizer as job_tokenizer
from paxcli.models import lm_experiment as lm
from paxcli.recipes import finetune

PAX = [sys.executable, '-m', 'paxcli.cli.app']
WORDS = 'the quick brown fox jumps over a lazy dog while birds sing in tall green trees near rivers'.split()
TINY = ['--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=32', '--set', 'HIDDEN_DIMS=64', '--set', 'NUM_HEADS=2',
        '--set', 'DIMS_PER_HEAD=16', '--set', 'MAX_SEQ_LEN=32', '--set', 'PERCORE_BATCH_SIZE=4']
LEAK = 'leaked shared_memory'
# As a user's shell on a CPU host: one device (conftest gives this process 8), the tests' compile cache kept
ENV = dict(os.environ, XLA_FLAGS=' '.join(f for f in os.environ.get('XLA_FLAGS', '').split()
                                           if not f.startswith('--xla_force_host_platform_device_count')))


def pax(cwd, *args, check=True, timeout=300):
  """`pax ARGS` as a user runs it in `cwd` (a subprocess, relative paths); the finished process."""
  done = subprocess.run(PAX + list(args), cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
  if check:
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-3000:])
  assert LEAK not in done.stderr, done.stderr[-2000:]
  return done


@pytest.fixture(scope='module')
def shell(tmp_path_factory):
  """A fresh directory with data/*.jsonl, prepared by `pax data prepare 'data/*.jsonl' prepared`."""
  cwd = tmp_path_factory.mktemp('shell')
  rng = random.Random(0)
  os.makedirs(cwd / 'data')
  for f in range(3):
    with open(cwd / 'data' / f'part{f}.jsonl', 'w') as out:
      for _ in range(120):
        out.write(json.dumps({'text': ' '.join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))}) + '\n')
  pax(cwd, 'data', 'prepare', 'data/*.jsonl', 'prepared', '--vocab-size', '300', '--workers', '1')
  return cwd


def test_prepare_show_and_inspect_input_with_relative_paths(shell):
  shown = json.loads(pax(shell, 'data', 'show', 'prepared', '--json').stdout)
  assert shown['path'] == str(shell / 'prepared') and shown['totals']['train']['records'] > 300
  lines = pax(shell, 'inspect-input', '--set', 'TRAIN_DATA=prepared', '--set', 'MAX_SEQ_LEN=32',
              '--set', 'PERCORE_BATCH_SIZE=4', '--num-batches', '2', '--json').stdout.splitlines()
  batches = [json.loads(line) for line in lines if line.startswith('{') and '"features"' in line]
  assert [b['batch'] for b in batches] == [0, 1]
  for b in batches:
    shapes = {f['feature']: f['shape'] for f in b['features']}
    assert shapes == {k: [4, 32] for k in ('ids', 'labels', 'positions', 'segment_ids', 'weights')}
    for example in b['examples']:
      words = example['text'].split()   # a row may start or end within a word of a longer document
      assert len(words) > 2 and set(words[1:-1]) <= set(WORDS), example['text']
  hosts = [json.loads(line) for line in pax(shell, 'inspect-input', '--set', 'TRAIN_DATA=prepared',
                                            '--num-hosts', '2', '--host-index', '1', '--num-batches', '1',
                                            '--json').stdout.splitlines() if '"features"' in line]
  assert hosts[0]['host'] == 1 and hosts[0]['num_hosts'] == 2


def _children(pid: int) -> list[int]:
  """The processes `pid`'s threads started (Linux)."""
  out = []
  for task in os.listdir(f'/proc/{pid}/task'):
    with open(f'/proc/{pid}/task/{task}/children') as f:
      out += [int(c) for c in f.read().split()]
  return out


def _alive(pid: int) -> bool:
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().split(') ')[1][0] != 'Z'
  except FileNotFoundError:
    return False


@pytest.mark.slow
def test_train_killed_resumes_then_eval_and_decode_read_the_job(shell):
  """kill -9 once a checkpoint is saved (its Grain workers go with it), resume, eval, decode."""
  train = ['train', '--set', 'TRAIN_DATA=prepared', '--set', 'SAVE_INTERVAL_STEPS=2', '--set',
           'DECODE_INTERVAL_STEPS=0', '--set', 'DATA_WORKERS=1', '--job-log-dir', 'job', *TINY]
  proc = subprocess.Popen(PAX + train + ['--set', 'NUM_TRAIN_STEPS=1000'], cwd=shell, env=ENV, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.time() + 240
  while not os.path.isdir(shell / 'job' / 'checkpoints' / '4') and time.time() < deadline:
    time.sleep(0.2)
  workers = _children(proc.pid)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert workers, 'no Grain worker ran'
  deadline = time.time() + 10
  while any(_alive(w) for w in workers) and time.time() < deadline:
    time.sleep(0.2)
  assert not any(_alive(w) for w in workers), 'Grain workers outlived their killed trainer'
  resumed = pax(shell, *train, '--set', 'NUM_TRAIN_STEPS=8')
  assert 'Resumed from step' in resumed.stdout + resumed.stderr
  with open(shell / 'job' / 'tokenizer' / 'spm.model', 'rb') as kept, \
       open(shell / 'prepared' / 'tokenizer' / 'spm.model', 'rb') as made:
    assert kept.read() == made.read()
  evaluated = json.loads(pax(shell, 'eval', '--set', 'TRAIN_DATA=prepared', *TINY, '--job-log-dir', 'job',
                             '--json').stdout)
  assert evaluated
  bare = pax(shell, 'eval', *TINY, '--job-log-dir', 'job', '--json')   # without the trainer's --set: the job's own
  assert json.loads(bare.stdout)['results'] == evaluated['results'] and '(as trained)' in bare.stderr
  decoded = pax(shell, 'decode', '--job-log-dir', 'job', *TINY, '--prompt', 'the quick', '--max-decode-steps', '8',
                '--json').stdout
  assert 'the quick' in decoded


# ---- a shipped tokenizer_config.json ----------------------------------------------------------------


def test_prepare_keeps_the_shipped_tokenizer_config_for_the_input_and_the_job(tmp_path):
  tok_dir = tmp_path / 'tok'
  os.makedirs(tok_dir)
  records = finetune.example_records(60, seed=0)
  finetune.write_tokenizer(str(tok_dir), [r['prompt'] + r['completion'] for r in records], 300)
  with open(tmp_path / 'docs.jsonl', 'w') as f:
    for r in records:
      f.write(json.dumps({'text': r['prompt'] + r['completion']}) + '\n')
  out = str(tmp_path / 'prepared')
  api.data_prepare([str(tmp_path / 'docs.jsonl')], out, tokenizer=str(tok_dir / 'tokenizer.json'), workers=1)
  # the shipped config, its chat_template.jinja folded in: one file carries both
  expected = dict(json.load(open(tok_dir / tokenizers.CONFIG_NAME)), chat_template=finetune.CHAT_TEMPLATE)
  assert json.load(open(os.path.join(out, 'tokenizer', tokenizers.CONFIG_NAME))) == expected
  assert api.data_show(out)['tokenizer_config'] == 'tokenizer/tokenizer_config.json'
  inp = GrainLmInput(name='train', is_training=True, data=out, seq_len=64, batch_size=4, num_infeed_hosts=1,
                     infeed_host_index=0)
  source, kept = tokenizers.load(str(tok_dir / 'tokenizer.json')), tokenizers.load(inp.tokenizer_file())
  assert (kept.bos_id, kept.eos_id, kept.bos_first) == (source.bos_id, source.eos_id, True)
  shards = [os.path.join(out, s.name) for s in prepared.read_manifest(out).shards['train']]
  records = grain.sources.ArrayRecordDataSource(shards)
  assert all(prepared.decode(records[i])[0][0] == kept.bos_id for i in range(len(records)))
  assert kept.bos_id in inp.get_next()['ids']
  job = str(tmp_path / 'job')
  job_tokenizer.save_to_job_dir(inp, job)
  assert json.load(open(layout.tokenizer_config(job))) == expected
  inp.close()


# ---- mixtures ---------------------------------------------------------------------------------------


def _write(directory, tokens: range, num_docs: int, seed: int, tokenizer_vocab: int = 64) -> None:
  """A prepared directory whose documents use only `tokens` (so a batch tells which directory each came from)."""
  os.makedirs(os.path.join(directory, 'tokenizer'))
  prepared_data.write_tokenizer(os.path.join(directory, 'tokenizer', 'tokenizer.json'), tokenizer_vocab)
  rng = np.random.default_rng(seed)
  docs = [np.append(rng.integers(tokens.start, tokens.stop, size=rng.integers(3, 20)), prepared_data.EOS)
          for _ in range(num_docs)]
  name = prepared.shard_name('train', 0, 1)
  records, count = prepared.write_shard(os.path.join(directory, name), [prepared.encode(d, np.ones(len(d))) for d in docs])
  prepared.write_manifest(directory, prepared.Manifest('tokenizer/tokenizer.json', tokenizer_vocab, prepared_data.EOS,
                                                       {'train': [prepared.Shard(name, records, count)]}))


@pytest.fixture(scope='module')
def two(tmp_path_factory):
  root = tmp_path_factory.mktemp('mix')
  _write(str(root / 'a'), range(2, 33), 50, seed=1)
  _write(str(root / 'b'), range(33, 64), 40, seed=2)
  return str(root / 'a'), str(root / 'b')


def _mixture(data, workers=0):
  return GrainLmInput(name='train', is_training=True, data=data, seq_len=32, batch_size=4, num_infeed_hosts=1,
                      infeed_host_index=0, workers=workers, num_streams=4)


def test_a_mixture_draws_by_weight_and_resumes_exactly(two):
  a, b = two
  inp = _mixture({a: 3, b: 1})
  batches = [inp.get_next() for _ in range(30)]
  docs = np.concatenate([bt['ids'][(bt['positions'] == 0) & (bt['segment_ids'] > 0)] for bt in batches])
  share_a = np.mean(docs < 33)   # a document's first token says which directory it came from
  assert 0.7 < share_a < 0.8, share_a
  state = inp.get_state()
  after = [inp.get_next() for _ in range(5)]
  inp.close()
  resumed = _mixture({a: 3, b: 1}, workers=1)   # another worker count: the same streams go on
  resumed.restore([json.loads(state)])
  again = [resumed.get_next() for _ in range(5)]
  resumed.close()
  for got, want in zip(again, after):   # one worker holds every stream in the same turn: the same batches
    assert all(np.array_equal(got[k], want[k]) for k in want)
  other = _mixture({a: 1, b: 1})
  with pytest.raises(UserError, match='mixture'):
    other.restore([json.loads(state)])


def test_mixture_refusals(two, tmp_path):
  a, _ = two
  _write(str(tmp_path / 'c'), range(2, 64), 10, seed=3, tokenizer_vocab=80)
  with pytest.raises(UserError, match='different tokenizers'):
    _mixture({a: 1, str(tmp_path / 'c'): 1})
  (tmp_path / 'x.jsonl').write_text('{"text": "a b"}\n')
  with pytest.raises(UserError, match='prepared directories and files'):
    lm._prepared_data({a: 1, str(tmp_path / 'x.jsonl'): 1})
  with pytest.raises(UserError, match='positive weights'):
    _mixture({a: 0})
