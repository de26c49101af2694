"""The first hour after `make train` (issue 32, items 2 and 5): what a new user sees of inputs, errors,
settings and recipes, each through the CLI."""

import json
import os


import prepared_data
from conftest import pax_main


def _inspect(capsys, *args):
  code, out, err = pax_main(['inspect-input', '--num-batches', '1', '--num-examples', '4', '--json',
                             '--set', 'MAX_SEQ_LEN=32', '--set', 'VOCAB_SIZE=64', *args], capsys)
  assert code == 0, err
  return json.loads(out.splitlines()[0])['examples']


def test_inspect_input_shows_the_ids_with_each_documents_first_token(tmp_path, capsys):
  """`ids:` are the ids the model reads (the first token of each document included), not the labels, on
  files and on prepared directories alike."""
  tok = str(tmp_path / 'tokenizer.json')
  prepared_data.write_tokenizer(tok, 64)   # word-level: the text 'w7' is id 7
  docs = [[(i * 7 + j) % 60 + 2 for j in range(5)] for i in range(40)]
  with open(tmp_path / 'docs.jsonl', 'w') as f:
    f.writelines(json.dumps({'text': ' '.join(f'w{t}' for t in doc)}) + '\n' for doc in docs)
  for example in _inspect(capsys, '--set', f'TRAIN_DATA={str(tmp_path / "docs.jsonl")!r}', '--set', f'TOKENIZER={tok!r}'):
    ids = example['ids']   # whole documents of 5 words (their EOS is the last label, never an id)
    assert len(ids) == 30 and all(ids[i:i + 5] in docs for i in range(0, 30, 5)), ids
    assert example['text'].split() == [f'w{t}' for t in ids]
  doc = prepared_data.make(tmp_path / 'prepared', num_docs=1, shards=1, max_len=9)[0].tolist()
  for example in _inspect(capsys, '--set', f'TRAIN_DATA={str(tmp_path / "prepared")!r}'):
    assert example['ids'][:len(doc) - 1] == doc[:-1], (example['ids'], doc)


def test_a_refused_start_leaves_no_job_directory(tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  code, _, err = pax_main(['train', '--set', 'ICI_MESH_SHAPE=[1,2,1]', '--set', 'NUM_LAYERS=1'], capsys)
  assert code == 2 and 'needs 2 devices' in err, err
  assert os.listdir(tmp_path) == []   # neither runs/default.StdlibDocsLm nor runs/


def test_every_error_has_one_prefix(capsys):
  """Usage errors (click's) and paxcli's own say `error:`, never `Error:`."""
  for argv in (['train', '--bogus'], ['eval', '--step', 'x'], ['describe', '--exp', 'NoSuchExperiment']):
    code, _, err = pax_main(argv, capsys)
    assert code == 2 and 'Error:' not in err and err.splitlines()[-1].startswith('error: '), err


def test_maxtext_spellings_name_the_knob(capsys):
  code, _, err = pax_main(['describe', '--set', 'steps=10'], capsys)
  assert code == 2 and "MaxText's steps is NUM_TRAIN_STEPS in paxcli: --set NUM_TRAIN_STEPS=10" in err, err
  code, _, err = pax_main(['describe', '--set', 'per_device_batch_size=4'], capsys)
  assert code == 2 and '--set PERCORE_BATCH_SIZE=4' in err, err


def test_import_maxtext_ends_with_the_recipes_cpu_check(tmp_path, capsys, monkeypatch):
  from conftest import REPO
  monkeypatch.chdir(tmp_path)
  code, out, err = pax_main(['import-maxtext', str(REPO / 'tests' / 'fixtures' / 'maxtext' / '2xv4-128.sh')], capsys)
  assert code == 0, err
  check = next(line for line in out.splitlines() if line.strip().startswith('pax train'))
  assert '--set NUM_LAYERS=2' in check and '--set NUM_TRAIN_STEPS=2' in check and '--job-log-dir runs/' in check
  assert 'Check it on this CPU first' in out and out.strip().splitlines()[-1].startswith('then the full run: pax train')


def test_inspect_input_takes_the_experiment_first_and_the_old_call_still_works(tmp_path):
  import pytest
  import paxcli
  tf = pytest.importorskip('tensorflow')
  path = str(tmp_path / 'data.tfrecord')
  with tf.io.TFRecordWriter(path) as w:
    w.write(tf.train.Example(features=tf.train.Features(feature={
        'ids': tf.train.Feature(int64_list=tf.train.Int64List(value=[1, 2, 3]))})).SerializeToString())
  with pytest.warns(DeprecationWarning, match='path=PATH'):
    old = paxcli.inspect_input(path)
  assert old['records_scanned'] == 1 == paxcli.inspect_input(path=path)['records_scanned']
  report = paxcli.inspect_input('lm_cloud.LmCloudSpmdTest', overrides=['MAX_SEQ_LEN=16'], num_batches=1)
  assert report['batches'][0]['features'][0]['shape'][1] == 16


def test_the_finetune_example_has_its_own_arguments_and_says_what_to_run(tmp_path):
  """`python -m paxcli.recipes.finetune --help` makes no directory, an existing directory is refused, and
  the output names the commands that use the job by its directory, quoted for a shell."""
  import subprocess
  import sys

  def example(*args):
    return subprocess.run([sys.executable, '-m', 'paxcli.recipes.finetune', *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
  r = example('--help')
  assert r.returncode == 0 and 'DIR' in r.stdout and os.listdir(tmp_path) == []
  r = example('ex')
  assert r.returncode == 0, r.stderr
  lines = r.stdout.splitlines()
  assert lines[0] == 'Wrote the tiny example into ex:' and '"\'' not in r.stdout
  commands = [line.strip() for line in lines if line.strip().startswith('pax ')]
  assert commands[:2] == ['pax checkpoint convert --from hf ex/hf ex/llama',
                          'pax train --exp finetune.TinySft --set BASE=ex/llama --set TRAIN_DATA=ex/sft.jsonl '
                          '--set EVAL_DATA=ex/sft_eval.jsonl --job-log-dir ex/sft']
  assert 'pax eval --job-log-dir ex/sft' in commands
  (tmp_path / 'ex' / 'mine.txt').write_text('keep me')
  before = (tmp_path / 'ex' / 'sft.jsonl').read_bytes()
  r = example('ex')
  assert r.returncode == 2 and r.stderr.startswith('error: ex holds files already') and '--force' in r.stderr
  assert (tmp_path / 'ex' / 'mine.txt').read_text() == 'keep me' and (tmp_path / 'ex' / 'sft.jsonl').read_bytes() == before
