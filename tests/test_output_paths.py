"""Every file a command writes at a path the user names goes through one mechanism (paxcli.files:
output_path, check_output, write_output), issue 33: a FIFO, a character device or /dev/stdout is
written into and stays what it was; a directory, a user's existing file (without --force) or one of
the command's own inputs is refused in one line, with nothing written and no temporary file left.
"""

import contextlib
import json
import os
import stat
import subprocess
import sys
import threading

import pytest

from conftest import REPO, pax_main

TINY = ['VOCAB_SIZE=320', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=4', 'NUM_LAYERS=2', 'MAX_SEQ_LEN=32',
        'PERCORE_BATCH_SIZE=1']
SETS = [a for s in TINY for a in ('--set', s)]
EXP = ['--exp', 'paxcli.families.lm.LmExperiment']
TEXTS = ['The cat sat on the mat.', 'A dog ran in the park.', 'The bird sang a song.',
         'Return the number of items in the list.', 'Create a new file and write the text.'] * 40


@pytest.fixture(scope='module')
def data(tmp_path_factory):
  """(a JSONL corpus, a job directory holding a sentencepiece tokenizer trained on it)."""
  from paxcli.inputs.tokenizers import train_sentencepiece
  from paxcli.jobdir import layout
  work = tmp_path_factory.mktemp('outputs')
  corpus = work / 'corpus.jsonl'
  corpus.write_text(''.join(json.dumps({'text': t}) + '\n' for t in TEXTS))
  job = str(work / 'job')
  spm = layout.tokenizer(job, 'sentencepiece')
  os.makedirs(os.path.dirname(spm))
  train_sentencepiece(TEXTS, 300, spm)
  return str(corpus), job


@pytest.fixture
def null_device(tmp_path):
  """A character device that discards what is written: /dev/null, or as root a private node of the same
  device in tmp_path (root may replace /dev/null: a regression must not take the machine's with it)."""
  if os.geteuid() != 0:
    return '/dev/null'
  path = str(tmp_path / 'null')
  try:
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
  except OSError:
    pytest.skip('root without CAP_MKNOD: no private device node to write into')
  return path


def _is_null(path) -> bool:
  st = os.stat(path)
  return stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)


@contextlib.contextmanager
def fifo_reader(path):
  """A FIFO at `path` with a reader; yields a dict whose 'data' is what was written (b'' for nothing)."""
  os.mkfifo(path)
  got = {}

  def read():
    with open(path, 'rb') as f:
      got['data'] = f.read()

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  try:
    yield got
  finally:
    reader.join(timeout=60)
    if reader.is_alive():   # nothing opened the FIFO: let the reader see its end
      os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
      reader.join(timeout=10)


def _one_line(code, err, *phrases):
  text = ' '.join(err.split())
  assert code == 2 and 'Traceback' not in err and len(err.strip().splitlines()) == 1, err
  for phrase in phrases:
    assert phrase in text, (phrase, err)


def _no_temporary_files(directory):
  left = [n for n in os.listdir(directory) if n.startswith('.tmp') or '.tmp-' in n or n.endswith('.tmp')]
  assert not left, left


def _tokenizer(corpus, output, *more):
  return ['tokenizer', 'train', '--data', corpus, '--vocab-size', '300', '--output', str(output), *more]


# ---- pax tokenizer train ------------------------------------------------------------------------


def test_tokenizer_into_dev_null_discards_and_leaves_the_device(data, null_device, capsys):
  corpus, _ = data
  code, out, err = pax_main(_tokenizer(corpus, null_device), capsys)
  assert code == 0, err
  assert _is_null(null_device)


def test_tokenizer_into_a_fifo_and_to_stdout_is_the_model(data, tmp_path, capsys):
  corpus, _ = data
  code, _, err = pax_main(_tokenizer(corpus, tmp_path / 'spm.model'), capsys)
  assert code == 0, err
  model = (tmp_path / 'spm.model').read_bytes()
  with fifo_reader(tmp_path / 'fifo') as got:
    code, _, err = pax_main(_tokenizer(corpus, tmp_path / 'fifo'), capsys)
  assert code == 0, err
  assert got['data'] == model and stat.S_ISFIFO(os.stat(tmp_path / 'fifo').st_mode)
  # /dev/stdout: the bytes land on stdout (a pipe here), the message on stderr
  done = subprocess.run([sys.executable, '-m', 'paxcli.cli.app', *_tokenizer(corpus, '/dev/stdout')],
                        capture_output=True, timeout=300, cwd=tmp_path)
  assert done.returncode == 0, done.stderr.decode()[-2000:]
  assert done.stdout == model and b'Wrote /dev/stdout' in done.stderr


def test_tokenizer_over_a_directory_is_one_line_and_leaves_nothing(data, tmp_path, capsys):
  corpus, _ = data
  (tmp_path / 'out').mkdir()
  code, _, err = pax_main(_tokenizer(corpus, tmp_path / 'out'), capsys)
  _one_line(code, err, 'is a directory')
  assert os.listdir(tmp_path / 'out') == []
  _no_temporary_files(tmp_path)


def test_tokenizer_never_replaces_a_file_unasked_nor_its_own_data(data, tmp_path, capsys):
  corpus, _ = data
  mine = tmp_path / 'mine.model'
  mine.write_text('my notes')
  code, _, err = pax_main(_tokenizer(corpus, mine), capsys)
  _one_line(code, err, 'exists; pass --force')
  assert mine.read_text() == 'my notes'
  code, _, err = pax_main(_tokenizer(corpus, mine, '--force'), capsys)
  assert code == 0 and mine.read_bytes()[:1] != b'm', err
  before = open(corpus, 'rb').read()
  os.symlink(corpus, tmp_path / 'link.jsonl')
  for output in (corpus, tmp_path / 'link.jsonl'):
    code, _, err = pax_main(_tokenizer(corpus, output, '--force'), capsys)
    _one_line(code, err, 'is the input')
  assert open(corpus, 'rb').read() == before
  _no_temporary_files(tmp_path)


# ---- pax score, pax decode ----------------------------------------------------------------------


def _score(job, requests, output, *more):
  return ['score', *EXP, *SETS, '--job-log-dir', job, '--no-checkpoint', str(requests), '--output', str(output),
          *more]


def _decode(job, output, *more):
  return ['decode', *EXP, *SETS, '--job-log-dir', job, '--no-checkpoint', '--prompt-ids', '5,6,7',
          '--max-decode-steps', '3', '--output', str(output), *more]


def test_score_and_decode_write_into_a_fifo_and_dev_null(data, null_device, tmp_path, capsys):
  _, job = data
  requests = tmp_path / 'requests.jsonl'
  requests.write_text('{"context_ids": [5, 6], "continuation_ids": [7], "id": "a"}\n')
  with fifo_reader(tmp_path / 'scores') as got:
    code, _, err = pax_main(_score(job, requests, tmp_path / 'scores'), capsys)
  assert code == 0, err
  record = json.loads(got['data'])
  assert record['id'] == 'a' and record['num_tokens'] == 1 and stat.S_ISFIFO(os.stat(tmp_path / 'scores').st_mode)
  code, _, err = pax_main(_decode(job, null_device), capsys)
  assert code == 0, err
  assert _is_null(null_device)
  _no_temporary_files(tmp_path)


def test_score_and_decode_refuse_a_users_file_and_their_input(data, tmp_path, capsys):
  _, job = data
  requests = tmp_path / 'requests.jsonl'
  line = '{"context_ids": [5, 6], "continuation_ids": [7]}\n'
  requests.write_text(line)
  mine = tmp_path / 'mine.jsonl'
  mine.write_text('keep me\n')
  for argv in (_score(job, requests, mine), _decode(job, mine)):
    code, _, err = pax_main(argv, capsys)
    _one_line(code, err, 'exists; pass --force')
  code, _, err = pax_main(_score(job, requests, requests, '--force'), capsys)
  _one_line(code, err, 'is the input')
  prompts = tmp_path / 'prompts.jsonl'
  prompts.write_text('{"prompt_ids": [5, 6]}\n')
  code, _, err = pax_main(['decode', *EXP, *SETS, '--job-log-dir', job, '--no-checkpoint', '--prompts-file',
                           str(prompts), '--output', str(prompts), '--force'], capsys)
  _one_line(code, err, 'is the input')
  assert mine.read_text() == 'keep me\n' and requests.read_text() == line
  assert prompts.read_text() == '{"prompt_ids": [5, 6]}\n'
  code, _, err = pax_main(_score(job, requests, mine, '--force'), capsys)
  assert code == 0 and json.loads(mine.read_text())['num_tokens'] == 1, err
  _no_temporary_files(tmp_path)


# ---- pax import-maxtext, pax checkpoint convert ---------------------------------------------------


SCRIPT = str(REPO / 'tests' / 'fixtures' / 'maxtext' / '2xv4-128.sh')


def test_import_maxtext_writes_into_a_fifo_and_refuses_a_directory(tmp_path, capsys):
  with fifo_reader(tmp_path / 'recipe') as got:
    code, _, err = pax_main(['import-maxtext', SCRIPT, '-o', str(tmp_path / 'recipe')], capsys)
  assert code == 0, err
  assert b'class ' in got['data'] and stat.S_ISFIFO(os.stat(tmp_path / 'recipe').st_mode)
  (tmp_path / 'dir').mkdir()
  code, _, err = pax_main(['import-maxtext', SCRIPT, '-o', str(tmp_path / 'dir'), '--force'], capsys)
  _one_line(code, err, 'is a directory')
  code, _, err = pax_main(['import-maxtext', SCRIPT, '-o', SCRIPT, '--force'], capsys)
  _one_line(code, err, 'is the input')


def test_convert_replaces_no_device_fifo_file_or_folder_of_the_user(null_device, tmp_path, capsys):
  source = str(REPO / 'tests' / 'fixtures' / 'old_lm' / 'plain')
  os.mkfifo(tmp_path / 'fifo')
  (tmp_path / 'afile').write_text('mine')
  (tmp_path / 'folder').mkdir()
  (tmp_path / 'folder' / 'notes.txt').write_text('mine')
  for output, phrase in ((null_device, 'is a character device'), (tmp_path / 'fifo', 'is a FIFO'),
                         (tmp_path / 'afile', 'is a regular file'), (tmp_path / 'folder', 'holds files no conversion')):
    code, _, err = pax_main(['checkpoint', 'convert', source, str(output), '--force'], capsys)
    _one_line(code, err, phrase)
  assert _is_null(null_device) and stat.S_ISFIFO(os.stat(tmp_path / 'fifo').st_mode)
  assert (tmp_path / 'afile').read_text() == 'mine' and (tmp_path / 'folder' / 'notes.txt').read_text() == 'mine'
  assert not [n for n in os.listdir(tmp_path) if n.startswith(('fifo.', 'afile.', 'folder.', 'null.'))]
