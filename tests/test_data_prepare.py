"""`pax data prepare` and `pax data show`: the records equal what the file input trains on, the output
does not depend on the number of workers, a `kill -9` resumes to the same bytes, every bad line is
reported before anything is written, and user data is never overwritten. No jax is started."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import pax_main
from paxcli import api
from paxcli.errors import UserError
from paxcli.inputs import documents, packing, prepared, tokenizers
from paxcli.inputs.file_input import train_tokenizer
from paxcli.loops.prepare import PLAN

WORDS = ('alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud light '
         'number return value create object string list table field record').split()


def _texts(n: int, seed: int = 0, longest: int = 40) -> list[str]:
  rng = np.random.default_rng(seed)
  return [f'doc{i}: ' + ' '.join(rng.choice(WORDS, size=int(rng.integers(1, longest)))) for i in range(n)]


def _jsonl(path, records) -> str:
  with open(path, 'w', encoding='utf-8') as f:
    f.write(''.join(json.dumps(r) + '\n' for r in records))
  return str(path)


@pytest.fixture(scope='module')
def data(tmp_path_factory):
  """Text, SFT and chat JSONL, a .txt of blank-line blocks, Parquet and TFRecord; a 320-piece model."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  tf = pytest.importorskip('tensorflow')
  root = tmp_path_factory.mktemp('prep')
  texts = _texts(400)
  _jsonl(root / 'a.jsonl', [{'text': t} for t in texts[:150]] + [{'text': ''}]  # '' is 1 token (EOS): dropped
         + [{'prompt': f'Q{i}: {t}', 'completion': f' A{i}.'} for i, t in enumerate(texts[150:180])]
         + [{'messages': [{'role': 'user', 'content': t}, {'role': 'assistant', 'content': 'ok ' + t}]}
            for t in texts[180:200]])
  (root / 'b.txt').write_text('\n\n'.join(texts[200:300]) + '\n', encoding='utf-8')
  pq.write_table(pa.table({'text': texts[300:350]}), root / 'c.parquet')
  with tf.io.TFRecordWriter(str(root / 'd.tfrecord')) as w:
    for t in texts[350:]:
      w.write(tf.train.Example(features=tf.train.Features(feature={
          'text': tf.train.Feature(bytes_list=tf.train.BytesList(value=[t.encode()]))})).SerializeToString())
  spm = str(root / 'spm.model')
  train_tokenizer(str(root / 'a.jsonl'), 'text', 320, spm)
  return root, spm


@pytest.fixture(scope='module')
def one_worker(data, tmp_path_factory):
  root, spm = data
  out = tmp_path_factory.mktemp('one') / 'out'
  summary = api.data_prepare([str(root / '*.jsonl'), str(root / 'b.txt'), str(root / 'c.parquet'),
                              str(root / 'd.tfrecord')], str(out), tokenizer=spm, num_shards=3, workers=1)
  return out, summary


def _records(path: str) -> list[bytes]:
  from array_record.python.array_record_module import ArrayRecordReader
  reader = ArrayRecordReader(path)
  try:
    return list(reader.read(0, reader.num_records()))
  finally:
    reader.close()


def _tree(directory) -> dict[str, bytes]:
  return {os.path.relpath(os.path.join(d, name), directory): open(os.path.join(d, name), 'rb').read()
          for d, _, names in os.walk(directory) for name in names}


def test_every_record_is_what_the_file_input_trains_on(data, one_worker):
  """Each split's records, in order, equal packing.tokenize of the same documents read by the file
  input's stages (documents.read_split, the tokenizer, EOS and SFT weights): the same split too."""
  root, spm = data
  out, summary = one_worker
  manifest = prepared.read_manifest(str(out))
  tok = tokenizers.load(str(out / manifest.tokenizer))
  assert open(str(out / manifest.tokenizer), 'rb').read() == open(spm, 'rb').read()
  for split in ('train', 'eval'):
    expected = []
    for path in manifest.sources:
      for doc in documents.read_split(path, 'text', split):
        example = packing.tokenize(doc.chunks, tok.encode_many([c.text for c in doc.chunks]), tok.eos_id,
                                   tok.bos_id if tok.bos_first else None)
        if example is not None:
          expected.append(example)
    got = [prepared.example(r) for shard in manifest.shards[split] for r in _records(str(out / shard.name))]
    assert len(got) == len(expected) == summary['records'][split] > 0
    for g, e in zip(got, expected):
      np.testing.assert_array_equal(g.ids, e.ids)
      np.testing.assert_array_equal(g.labels, e.labels)
      np.testing.assert_array_equal(g.weights, e.weights)
  assert summary['documents']['train'] + summary['documents']['eval'] == 401  # the empty one counted, not written
  assert summary['records']['train'] + summary['records']['eval'] == 400
  assert any(0 < e.weights.sum() < len(e.weights) for e in got)  # SFT: prompts weigh 0
  assert len(manifest.shards['train']) == 3 and summary['shards'] == {'train': 3, 'eval': 1}


def test_the_output_does_not_depend_on_the_number_of_workers(data, one_worker, tmp_path):
  root, spm = data
  out, summary = one_worker
  two = tmp_path / 'two'
  summary2 = api.data_prepare([str(root / '*.jsonl'), str(root / 'b.txt'), str(root / 'c.parquet'),
                               str(root / 'd.tfrecord')], str(two), tokenizer=spm, num_shards=3, workers=2)
  assert summary2['workers'] == 2 and summary2['tokens'] == summary['tokens']
  assert _tree(two) == _tree(out)


def test_kill_9_mid_run_resumes_to_the_same_bytes(data, tmp_path):
  """A real `pax data prepare` killed (SIGKILL, the whole process group) once its first shard is
  written; run again, it keeps the finished shards, redoes the unfinished one and ends byte for byte
  equal to a run never interrupted."""
  _, spm = data
  big = _jsonl(tmp_path / 'big.jsonl', [{'text': t} for t in _texts(30000, seed=1, longest=60)])
  args = [sys.executable, '-m', 'paxcli.cli.app', 'data', 'prepare', big, '--tokenizer', spm, '--num-shards', '16',
          '--workers', '1']
  proc = subprocess.Popen(args + [str(tmp_path / 'killed')], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          start_new_session=True)
  first = tmp_path / 'killed' / prepared.shard_name('train', 0, 16)
  deadline = time.time() + 120
  while not first.exists() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.01)
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  assert first.exists(), proc.stderr.read().decode()[-2000:]
  assert not prepared.is_prepared(str(tmp_path / 'killed')), 'the run ended before the kill: make the data bigger'
  kept = {name: (tmp_path / 'killed' / name).stat().st_mtime_ns for name in os.listdir(tmp_path / 'killed')
          if name.endswith('.array_record')}
  resumed = subprocess.run(args + [str(tmp_path / 'killed'), '--json'], capture_output=True, text=True, timeout=300)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert f'Resuming: {len(kept)} finished shard(s) kept' in resumed.stderr
  assert json.loads(resumed.stdout)['tokenized_documents'] < 30000
  assert all((tmp_path / 'killed' / name).stat().st_mtime_ns == t for name, t in kept.items())
  straight = subprocess.run(args + [str(tmp_path / 'straight')], capture_output=True, text=True, timeout=300)
  assert straight.returncode == 0, straight.stderr[-2000:]
  assert _tree(tmp_path / 'killed') == _tree(tmp_path / 'straight')


def test_every_bad_line_is_reported_before_anything_is_written(tmp_path, capsys):
  (tmp_path / 'x.jsonl').write_bytes(b'{"text": "fine"}\nnot json\n{"text": "fine too"}\n{"body": "b"}\n')
  (tmp_path / 'y.txt').write_bytes(b'ok\n\ncaf\xe9\n')
  code, _, err = pax_main(['data', 'prepare', str(tmp_path / 'x.jsonl'), str(tmp_path / 'y.txt'),
                           str(tmp_path / 'out'), '--vocab-size', '300'], capsys)
  assert code == 2 and 'Traceback' not in err, err
  assert '3 bad input(s); nothing written' in err
  assert f'{tmp_path / "x.jsonl"} line 2: not JSON' in err
  assert f'{tmp_path / "x.jsonl"} line 4: no \'text\' field' in err
  assert f'{tmp_path / "y.txt"} line 3: not UTF-8 text' in err
  assert not (tmp_path / 'out').exists()


def test_user_data_is_never_overwritten(data, one_worker, tmp_path, capsys):
  root, spm = data
  out, _ = one_worker
  mine = tmp_path / 'mine'
  mine.mkdir()
  (mine / 'notes.txt').write_text('keep me', encoding='utf-8')
  with pytest.raises(UserError, match='not empty and was not written by `pax data prepare`'):
    api.data_prepare([str(root / 'a.jsonl')], str(mine), tokenizer=spm)
  assert os.listdir(mine) == ['notes.txt']
  before = _tree(out)
  sources = [str(root / '*.jsonl'), str(root / 'b.txt'), str(root / 'c.parquet'), str(root / 'd.tfrecord')]
  with pytest.raises(UserError, match=r'other files or settings \(num_shards differ'):
    api.data_prepare(sources, str(out), tokenizer=spm, num_shards=4)
  with pytest.raises(UserError, match=r'other files or settings \(files differ'):
    api.data_prepare(sources[:1], str(out), tokenizer=spm, num_shards=3)
  again = api.data_prepare(sources, str(out), tokenizer=spm, num_shards=3, workers=1)  # finished: nothing to do
  assert again['tokenized_documents'] == 0 and _tree(out) == before


def test_no_eval_split_and_a_trained_tokenizer(data, tmp_path):
  """--no-eval-split puts every document in train; without --tokenizer the one trained is the
  auto tokenizer of `pax train` on the same files (the same bytes)."""
  root, _ = data
  out = tmp_path / 'out'
  summary = api.data_prepare([str(root / 'a.jsonl')], str(out), eval_split=False, vocab_size=300, workers=1)
  assert summary['shards'] == {'train': 1} and summary['documents'] == {'train': 201}
  expected = tmp_path / 'expected.model'
  train_tokenizer(str(root / 'a.jsonl'), 'text', 300, str(expected))
  assert (out / 'tokenizer' / 'spm.model').read_bytes() == expected.read_bytes()


def test_cli_prepare_json_and_show(data, one_worker, capsys):
  out, summary = one_worker
  code, stdout, err = pax_main(['data', 'show', str(out)], capsys)
  assert code == 0, err
  assert 'train-00002-of-00003.array_record' in stdout and 'tokenizer/spm.model' in stdout
  assert f'{summary["tokens"]["train"]:,}' in stdout
  code, stdout, _ = pax_main(['data', 'show', str(out), '--json'], capsys)
  shown = json.loads(stdout)
  assert shown['totals']['eval']['records'] == summary['records']['eval']
  code, _, err = pax_main(['data', 'show', str(out.parent)], capsys)
  assert code == 2 and 'no prepared.json' in err


# ---- #20's loose ends: TRAIN_DATA reaches every LM experiment; a resume keeps the job's tokenizer ----


def test_train_data_replaces_the_inputs_of_every_lm_experiment(data):
  """Every registered LM experiment, those overriding datasets() (seqio_stdlib, c4, default) too,
  trains and evaluates on TRAIN_DATA when it is set; a user's subclass the same way."""
  import fiddle as fdl

  from paxcli import experiment
  from paxcli.models import LmExperiment
  from paxcli.inputs.file_input import FileLmInput
  root, spm = data
  glob = str(root / 'a.jsonl')
  lm = {name: cls for name, cls in experiment.import_all_recipes().items() if issubclass(cls, LmExperiment)}
  assert {'seqio_stdlib.StdlibDocsSeqIOLm', 'default.StdlibDocsLm', 'c4.C4Spmd1BAdam4Replicas'} <= set(lm)

  class Mine(LmExperiment):
    def datasets(self) -> list:
      return ['never reached when TRAIN_DATA is set']

  for name, cls in [*lm.items(), ('Mine', Mine)]:
    exp = cls()
    exp.TRAIN_DATA, exp.TOKENIZER = glob, spm
    inputs = exp.datasets()
    if name.startswith('grpo.'):   # GRPO samples completions of TRAIN_DATA's prompts: one input, over them
      assert [(fdl.get_callable(c).__name__, c.data) for c in inputs] == [('RolloutPromptsInput', glob)], name
      continue
    assert all(issubclass(fdl.get_callable(c), FileLmInput) for c in inputs) and len(inputs) == 2, name
    assert [(c.data, c.split) for c in inputs] == [(glob, 'train'), (glob, 'eval')], name
  assert Mine().datasets() == ['never reached when TRAIN_DATA is set']


@pytest.mark.slow  # three `pax train` processes: about 40 s on 2 cores
def test_a_resume_keeps_the_tokenizer_its_checkpoint_was_trained_with(data, tmp_path):
  """`pax train` without TOKENIZER, the data changed, resumed: the job's tokenizer is used, not a new
  one trained on the changed files, and never replaced; another TOKENIZER is refused in one line."""
  from conftest import run_pax
  root, spm = data
  (tmp_path / 'my').mkdir()
  _jsonl(tmp_path / 'my' / 'a.jsonl', [{'text': t} for t in _texts(120, seed=3)])
  tiny = ['--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=16', '--set', 'HIDDEN_DIMS=32', '--set', 'NUM_HEADS=2',
          '--set', 'VOCAB_SIZE=320', '--set', 'MAX_SEQ_LEN=16', '--set', 'PERCORE_BATCH_SIZE=1',
          '--set', 'ICI_MESH_SHAPE=[1,1,1]', '--set', 'DECODE_INTERVAL_STEPS=0', '--set', 'EVAL_INTERVAL_STEPS=0',
          '--set', 'TRAIN_DATA=my/*.jsonl', '--job-log-dir', 'job']
  env = {'XLA_FLAGS': '--xla_force_host_platform_device_count=1'}
  first = run_pax('train', *tiny, '--set', 'NUM_TRAIN_STEPS=2', cwd=tmp_path, env=env, timeout=300)
  assert first.returncode == 0, first.stderr[-3000:]
  kept = (tmp_path / 'job' / 'tokenizer' / 'spm.model').read_bytes()
  with open(tmp_path / 'my' / 'a.jsonl', 'a', encoding='utf-8') as f:  # new files' stamps: a new auto tokenizer
    f.write(''.join(json.dumps({'text': t + ' river'}) + '\n' for t in _texts(60, seed=4)))
  resumed = run_pax('train', *tiny, '--set', 'NUM_TRAIN_STEPS=3', cwd=tmp_path, env=env, timeout=300)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert 'Training a 320-piece' not in resumed.stderr and 'Done: step 3' in resumed.stdout
  assert (tmp_path / 'job' / 'tokenizer' / 'spm.model').read_bytes() == kept
  assert f"datasets.train.tokenizer = '{tmp_path / 'job' / 'tokenizer' / 'spm.model'}'" in (
      tmp_path / 'job' / 'config.txt').read_text()
  other = run_pax('train', *tiny, '--set', 'NUM_TRAIN_STEPS=4', '--set', f'TOKENIZER={spm}', cwd=tmp_path, env=env,
                  timeout=300)
  assert other.returncode == 2 and 'Traceback' not in other.stderr, other.stderr[-3000:]
  assert 'was trained with the tokenizer' in other.stderr and 'give a new --job-log-dir' in other.stderr
  assert (tmp_path / 'job' / 'tokenizer' / 'spm.model').read_bytes() == kept
