"""Training on your own files: formats, the eval split, packing, SFT weights, tokenizers, bad input.

Most tests read small files the test writes and never start jax; the end-to-end ones run
`pax train` from a fresh shell on the default experiment at a tiny size.
"""

import gzip
import json
import os
import re
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import pax_main, run_pax
from paxcli.errors import UserError
from paxcli.inputs import documents, packing, sft, tokenizers
from paxcli.inputs.file_input import FileLmInput, _mixed, train_tokenizer

WORDS = ('alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud light '
         'number return value create object string list table field record').split()
TINY = ['--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=32', '--set', 'HIDDEN_DIMS=64', '--set', 'NUM_HEADS=2',
        '--set', 'VOCAB_SIZE=320', '--set', 'MAX_SEQ_LEN=32', '--set', 'PERCORE_BATCH_SIZE=1',
        '--set', 'ICI_MESH_SHAPE=[1,1,1]', '--set', 'DECODE_INTERVAL_STEPS=0']


def _texts(n: int, seed: int = 0) -> list[str]:
  """n distinct documents 'docN: words...' of 5 to 30 words."""
  rng = np.random.default_rng(seed)
  return [f'doc{i}: ' + ' '.join(rng.choice(WORDS, size=int(rng.integers(5, 30)))) for i in range(n)]


def _jsonl(path, records) -> str:
  with open(path, 'w', encoding='utf-8') as f:
    for r in records:
      f.write(json.dumps(r) + '\n')
  return str(path)


@pytest.fixture(scope='module')
def data(tmp_path_factory):
  """200 documents in two JSONL files, and a 320-piece sentencepiece model trained on them."""
  root = tmp_path_factory.mktemp('own')
  texts = _texts(200)
  _jsonl(root / 'a.jsonl', [{'text': t} for t in texts[:120]])
  _jsonl(root / 'b.jsonl', [{'text': t} for t in texts[120:]])
  spm = str(root / 'spm.model')
  train_tokenizer(str(root / '*.jsonl'), 'text', 320, spm)
  return root, texts, spm


def _input(glob, spm, **kw) -> FileLmInput:
  fields = dict(name='train', data=glob, tokenizer=spm, seq_len=32, batch_size=4, num_infeed_hosts=1,
                infeed_host_index=0)
  fields.update(kw)
  return FileLmInput(**fields)


def _all_batches(inp) -> list[dict]:
  out = []
  while True:
    try:
      out.append(inp.get_next())
    except Exception as e:  # EndOfInput
      assert type(e).__name__ == 'EndOfInput', e
      return out


def _documents_seen(inp, batches) -> list[int]:
  """The docN numbers of the segments that start a document (the rest of a long one has none)."""
  seen = []
  for batch in batches:
    for row in range(len(batch['ids'])):
      for seg in set(batch['segment_ids'][row].tolist()) - {0}:
        tokens = batch['ids'][row][batch['segment_ids'][row] == seg]
        match = re.match(r'doc(\d+):', inp.ids_to_strings(tokens[None])[0])
        seen += [int(match.group(1))] if match else []
  return seen


# ---- formats --------------------------------------------------------------------------------------


def test_txt_is_one_document_per_blank_line_block(tmp_path):
  (tmp_path / 'book.txt').write_text('First line\nsecond line\n\n\n  \nNext block\n\nLast', encoding='utf-8')
  docs = list(documents.read(str(tmp_path / 'book.txt'), 'text'))
  assert [d.text() for d in docs] == ['First line\nsecond line', 'Next block', 'Last']
  assert [d.where.rsplit(' ', 1)[1] for d in docs] == ['1', '6', '8']


def test_every_format_gives_the_same_documents(tmp_path):
  tf = pytest.importorskip('tensorflow')
  from array_record.python.array_record_module import ArrayRecordWriter
  import pyarrow as pa
  import pyarrow.parquet as pq
  texts = _texts(12)
  _jsonl(tmp_path / 'd.jsonl', [{'text': t, 'id': i} for i, t in enumerate(texts)])
  with gzip.open(tmp_path / 'd.jsonl.gz', 'wt', encoding='utf-8') as f:
    f.write(''.join(json.dumps({'text': t}) + '\n' for t in texts))
  pq.write_table(pa.table({'text': texts, 'id': list(range(12))}), tmp_path / 'd.parquet')
  examples = [tf.train.Example(features=tf.train.Features(feature={
      'text': tf.train.Feature(bytes_list=tf.train.BytesList(value=[t.encode()]))})).SerializeToString()
      for t in texts]
  with tf.io.TFRecordWriter(str(tmp_path / 'd.tfrecord-00000-of-00001')) as w:
    for e in examples:
      w.write(e)
  writer = ArrayRecordWriter(str(tmp_path / 'd.array_record'), 'group_size:1')
  for e in examples:
    writer.write(e)
  writer.close()
  files = documents.expand(str(tmp_path / 'd.*'))
  assert len(files) == 5
  for path in files:
    assert [d.text() for d in documents.read(path, 'text')] == texts, path
  # A path with a scheme (gs://...) is globbed and read through tf.io.gfile; file:// takes that path here.
  remote = documents.expand(f'file://{tmp_path}/d.*')
  assert len(remote) == 5 and all(p.startswith('file://') for p in remote)
  for path in remote:
    if path.endswith('.array_record'):
      with pytest.raises(UserError, match='read from local disks only'):
        list(documents.read(path, 'text'))
    else:
      assert [d.text() for d in documents.read(path, 'text')] == texts, path


def test_a_directory_reads_the_files_it_holds(tmp_path):
  (tmp_path / 'sub').mkdir()
  (tmp_path / 'sub' / 'x.txt').write_text('one\n\ntwo', encoding='utf-8')
  (tmp_path / 'README.md').write_text('not data', encoding='utf-8')
  assert documents.expand(str(tmp_path)) == [str(tmp_path / 'sub' / 'x.txt')]


# ---- eval split and sharding -----------------------------------------------------------------------


def test_eval_split_is_a_hash_of_the_text(data):
  root, texts, _ = data
  path = str(root / 'a.jsonl')
  train = [d.text() for d in documents.read_split(path, 'text', 'train')]
  evals = [d.text() for d in documents.read_split(path, 'text', 'eval')]
  assert not set(train) & set(evals) and sorted(train + evals) == sorted(texts[:120])
  assert 1 <= len(evals) <= 20  # 1 in 20 expected
  assert evals == [t for t in texts[:120] if documents.in_eval_split(documents.Document(sft.text_document(t), ''))]


@pytest.mark.parametrize('files', ['*.jsonl', 'a.jsonl'])  # whole files per host; every 2nd document
def test_two_hosts_read_disjoint_documents_that_cover_the_split(data, files):
  root, _, spm = data
  seen = []
  for host in range(2):
    inp = _input(str(root / files), spm, split='train', is_training=False, repeat=False, num_infeed_hosts=2,
                 infeed_host_index=host)
    seen.append(_documents_seen(inp, _all_batches(inp)))
  whole = _input(str(root / files), spm, split='train', is_training=False, repeat=False)
  everything = _documents_seen(whole, _all_batches(whole))
  assert seen[0] and seen[1] and not set(seen[0]) & set(seen[1])
  assert sorted(seen[0] + seen[1]) == sorted(everything)


# ---- packing -------------------------------------------------------------------------------------


def test_packing_keeps_documents_apart_and_puts_eos_between():
  eos = 1
  docs = [[10, 11, 12], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]]
  examples = [packing.tokenize(sft.text_document('x'), [d], eos) for d in docs]
  rows = list(packing.pack(examples, seq_len=8, open_rows=2))
  # The 10-pair document is cut into 8 + 2 pairs; the short ones share rows without attending across.
  pairs = {(int(i), int(l)) for r in rows for i, l, w in zip(r['ids'], r['labels'], r['weights']) if w}
  expected = {(a, b) for d in docs for a, b in zip(d + [eos], (d + [eos])[1:])}
  assert pairs == expected
  for r in rows:
    for seg in set(r['segment_ids'].tolist()) - {0}:
      where = r['segment_ids'] == seg
      np.testing.assert_array_equal(r['positions'][where], np.arange(where.sum()))
  # doc 3's first 8 pairs fill a row of their own, which leaves first; docs 1 and 2 and doc 3's
  # last 2 pairs share the other row.
  assert rows[0]['ids'].tolist() == docs[2][:8]
  assert rows[1]['segment_ids'].tolist() == [1, 1, 1, 2, 2, 3, 3, 0]
  assert rows[1]['labels'].tolist() == [11, 12, eos, 21, eos, 39, eos, 0]


def test_training_rows_carry_segments_and_documents_end_with_eos(data):
  root, _, spm = data
  inp = _input(str(root / '*.jsonl'), spm, is_training=True, split='train')
  batch = inp.get_next()
  assert set(batch) == set(packing.ROW_KEYS) and batch['ids'].shape == (4, 32)
  assert batch['segment_ids'].max() >= 2  # documents of 5-30 words: several per 32-token row
  for row in range(4):  # each segment is a document, ending in EOS, or a row-long piece of a longer one
    for seg in set(batch['segment_ids'][row].tolist()) - {0}:
      labels = batch['labels'][row][batch['segment_ids'][row] == seg]
      assert labels[-1] == inp.eos_id or len(labels) == 32
  assert inp.get_next()['ids'].tobytes() != batch['ids'].tobytes()
  inp.reset()
  np.testing.assert_array_equal(inp.get_next()['ids'], batch['ids'])  # deterministic from the seed


# ---- supervised fine-tuning -------------------------------------------------------------------------


def test_sft_weights_are_on_the_completion_only(data, tmp_path):
  _, _, spm = data
  path = _jsonl(tmp_path / 'sft.jsonl', [{'prompt': 'alpha beta gamma', 'completion': 'omega river'}])
  inp = _input(path, spm, split='all', is_training=False, repeat=False, batch_size=1)
  batch = inp.get_next()
  tok = tokenizers.load(spm)
  n_prompt, n_completion = len(tok.encode('alpha beta gamma')), len(tok.encode('omega river'))
  weights = batch['weights'][0]
  # pairs: prompt tokens 2..n (weight 0), then the completion's tokens and EOS (weight 1)
  assert weights.tolist()[:n_prompt - 1] == [0.0] * (n_prompt - 1)
  assert weights.tolist()[n_prompt - 1:n_prompt + n_completion] == [1.0] * (n_completion + 1)
  assert weights.sum() == n_completion + 1
  assert batch['labels'][0][n_prompt + n_completion - 1] == tok.eos_id


def test_chat_template_trains_the_assistant_turns():
  chunks = sft.from_record({'messages': [{'role': 'system', 'content': 'Be brief.'},
                                         {'role': 'user', 'content': 'Hi'},
                                         {'role': 'assistant', 'content': 'Hello.'},
                                         {'role': 'user', 'content': 'Bye'},
                                         {'role': 'assistant', 'content': 'Bye.'}]}, 'text', 'x line 1')
  assert [c.text for c in chunks if c.trained] == ['Hello.', 'Bye.']
  assert all(c.eos for c in chunks if c.trained)
  assert ''.join(c.text for c in chunks) == ('<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello.'
                                             '<|user|>\nBye\n<|assistant|>\nBye.')


def test_mixture_draws_sources_by_weight():
  streams = [iter(lambda: 'a', None), iter(lambda: 'b', None)]
  drawn = [next(g) for g in [_mixed(streams, [3, 1], np.random.default_rng(0))] for _ in range(4000)]
  assert abs(drawn.count('a') / 4000 - 0.75) < 0.03


# ---- tokenizers -----------------------------------------------------------------------------------


def test_tokenizer_training_is_deterministic(data, tmp_path, capsys):
  root, _, _ = data
  outputs = [tmp_path / f'{i}.model' for i in range(2)]
  for out in outputs:
    code, stdout, err = pax_main(['tokenizer', 'train', '--data', str(root / '*.jsonl'), '--vocab-size', '300',
                                  '--output', str(out)], capsys)
    assert code == 0, err
    assert 'pieces' in stdout
  assert outputs[0].read_bytes() == outputs[1].read_bytes()
  assert tokenizers.load(str(outputs[0])).vocab_size == 300


def test_a_tokenizer_json_is_read_by_the_tokenizers_library(data, tmp_path):
  hf = pytest.importorskip('tokenizers')
  root, texts, _ = data
  tok = hf.Tokenizer(hf.models.WordLevel({'<pad>': 0, '</s>': 1, '<unk>': 2, **{w: i + 3 for i, w in
                                                                                  enumerate(WORDS)}},
                                         unk_token='<unk>'))
  tok.pre_tokenizer = hf.pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / 'tokenizer.json'))
  loaded = tokenizers.load(str(tmp_path / 'tokenizer.json'))
  assert (loaded.eos_id, loaded.pad_id, loaded.bos_id) == (1, 0, None)
  assert loaded.encode('alpha beta') == [3, 4]
  inp = _input(str(root / 'a.jsonl'), str(tmp_path / 'tokenizer.json'), is_training=True, split='train', vocab_size=64)
  assert inp.get_next()['ids'].max() < loaded.vocab_size


# ---- bad input: one line naming the file and line ------------------------------------------------------


@pytest.mark.parametrize('name, content, expected', [
    ('bad.jsonl', b'{"text": "fine"}\n{"text": oops}\n', r'bad\.jsonl line 2: not JSON'),
    ('missing.jsonl', b'{"text": "fine"}\n{"body": "x"}\n', r'missing\.jsonl line 2: no \'text\' field'),
    ('latin1.txt', 'ok\n\ncaf\xe9\n'.encode('latin-1'), r'latin1\.txt line 3: not UTF-8 text'),
    ('latin1.jsonl', b'{"text": "caf\xe9"}\n', r'latin1\.jsonl line 1: not UTF-8 text'),
    ('list.jsonl', b'["a", "b"]\n', r'list\.jsonl line 1: a JSON object'),
    ('chat.jsonl', b'{"messages": [{"role": "user"}]}\n', r'chat\.jsonl line 1: messages\[0\] must be'),
    ('notes.docx', b'x', r'notes\.docx: paxcli reads \.txt'),
])
def test_bad_input_is_one_line_naming_the_file_and_line(tmp_path, capsys, name, content, expected):
  (tmp_path / name).write_bytes(content)
  code, _, err = pax_main(['tokenizer', 'train', '--data', str(tmp_path / name), '--vocab-size', '300',
                           '--output', str(tmp_path / 'x.model')], capsys)
  assert code == 2
  assert len(err.strip().splitlines()) == 1 and 'Traceback' not in err, err
  assert re.search(expected, err), err


def test_an_empty_glob_and_an_empty_eval_split_are_one_line(tmp_path, capsys, data):
  code, _, err = pax_main(['tokenizer', 'train', '--data', str(tmp_path / 'none*.jsonl'), '--vocab-size', '300',
                           '--output', str(tmp_path / 'x.model')], capsys)
  assert code == 2 and 'No file matches' in err and len(err.strip().splitlines()) == 1
  _, _, spm = data
  one = _jsonl(tmp_path / 'one.jsonl', [{'text': 'doc1: alpha beta'}])
  with pytest.raises(UserError, match='no document .* on the eval side'):
    _input(one, spm, split='eval', is_training=False, repeat=False)


# ---- end to end -----------------------------------------------------------------------------------


def test_pax_train_on_own_jsonl_from_a_fresh_shell(data, tmp_path):
  """The README's command: a glob relative to the shell's directory, a relative job dir, no TOKENIZER."""
  root, _, _ = data
  (tmp_path / 'my').mkdir()
  for name in ('a.jsonl', 'b.jsonl'):
    (tmp_path / 'my' / name).write_bytes((root / name).read_bytes())
  result = run_pax('train', '--set', 'TRAIN_DATA=my/*.jsonl', *TINY, '--set', 'NUM_TRAIN_STEPS=3',
                   '--set', 'EVAL_INTERVAL_STEPS=3', '--job-log-dir', 'runs/mine', cwd=tmp_path,
                   env={'XLA_FLAGS': '--xla_force_host_platform_device_count=1'}, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Training a 320-piece sentencepiece tokenizer' in result.stderr
  assert 'step 3: eval: loss' in result.stdout and 'Done: step 3' in result.stdout
  job = tmp_path / 'runs' / 'mine'
  assert (job / 'tokenizer' / 'spm.model').is_file()
  assert 'FileLmInput' in (job / 'config.txt').read_text()


def test_two_real_processes_read_disjoint_documents(data, tmp_path):
  """Two jax.distributed processes build the train input as `pax train` does (~15 s)."""
  root, _, spm = data
  script = tmp_path / 'read.py'
  script.write_text(textwrap.dedent(f'''
      import json, re, sys
      from paxcli import config
      from paxcli.runtime import distributed, infeed
      distributed.start(distributed.settings_from(sys.argv[1], 2, int(sys.argv[2])), log=lambda s: None)
      resolved = config.resolve('default.StdlibDocsLm', ['TRAIN_DATA={root / "*.jsonl"}', 'TOKENIZER={spm}',
                                                        'MAX_SEQ_LEN=32', 'VOCAB_SIZE=320'])
      inp = infeed.build_input(resolved.train_dataset(), process_batch=4)
      seen = set()
      for _ in range(40):
        batch = inp.get_next()
        for text in inp.ids_to_strings(batch['ids']):
          seen.update(int(n) for n in re.findall(r'doc(\\d+):', text))
      json.dump(sorted(seen), open(sys.argv[3], 'w'))
  '''))
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=1', JAX_PLATFORMS='cpu')
  procs = [subprocess.Popen([sys.executable, str(script), f'127.0.0.1:{port}', str(i), str(tmp_path / f'{i}.json')],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outs = [p.communicate(timeout=300)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs
  seen = [set(json.loads((tmp_path / f'{i}.json').read_text())) for i in range(2)]
  train_side = {int(re.match(r'doc(\d+):', d.text()).group(1)) for f in ('a.jsonl', 'b.jsonl')
                for d in documents.read_split(str(root / f), 'text', 'train')}
  assert seen[0] and seen[1] and not seen[0] & seen[1]
  assert seen[0] | seen[1] <= train_side


def test_data_paths_are_made_absolute_where_the_command_starts(tmp_path, monkeypatch):
  """A relative TRAIN_DATA, EVAL_DATA or TOKENIZER names files relative to where the command ran:
  the resolved config holds them absolute, so a resume from another directory reads the same files;
  URLs are left as they are."""
  from paxcli import config
  monkeypatch.chdir(tmp_path)
  resolved = config.resolve('default.StdlibDocsLm', ['TRAIN_DATA={"web/*.jsonl": 3, "gs://b/c/*.jsonl": 1}',
                                                     'EVAL_DATA=held/*.txt', 'TOKENIZER=~/spm.model'])
  train = resolved.train_dataset()
  assert train.data == {str(tmp_path / 'web' / '*.jsonl'): 3, 'gs://b/c/*.jsonl': 1}
  assert train.tokenizer == os.path.join(os.path.expanduser('~'), 'spm.model')
  evals = [c for c in resolved.datasets.values() if not c.is_training]
  assert [c.data for c in evals] == [str(tmp_path / 'held' / '*.txt')]


def test_ids_past_the_tokenizer_decode_to_nothing_as_in_the_tokenizers_library(data):
  """A model's vocabulary is often larger than its tokenizer's (padded, or an own-data tokenizer with
  fewer pieces than VOCAB_SIZE asked), and decoding may pick such an id: its text is left out, for a
  sentencepiece model as for a tokenizer.json, instead of failing the decode (or the train loop's)."""
  _, texts, spm = data
  tok = tokenizers.load(spm)
  ids = tok.encode(texts[0])
  assert tok.decode(ids + [tok.vocab_size, tok.vocab_size + 100]) == tok.decode(ids) == texts[0]
