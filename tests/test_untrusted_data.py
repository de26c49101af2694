"""Data someone else wrote is data (issue 33, the data side): data directories, `pax data prepare`,
prepared directories, a checkpoint's Grain input state and chat templates are read bounded and
checked, never followed out of their directory; each bad case is one line naming the file (and
line or field), a non-zero exit, nothing written outside and nothing lost.
"""

import fcntl
import gzip
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import prepared_data
from conftest import pax_main, run_pax
from paxcli.errors import UserError
from paxcli.inputs import documents, grain_state, prepared, tokenizers
from paxcli.inputs.file_input import train_tokenizer
from paxcli.inputs.grain_input import GrainLmInput

WORDS = 'alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud light'.split()
SECRET = 'TOPSECRET shadow line of another user'


def _texts(n: int, seed: int = 0) -> list[str]:
  rng = np.random.default_rng(seed)
  return [f'doc{i}: ' + ' '.join(rng.choice(WORDS, size=int(rng.integers(3, 30)))) for i in range(n)]


def _jsonl(path, records) -> str:
  with open(path, 'w', encoding='utf-8') as f:
    f.write(''.join(json.dumps(r) + '\n' for r in records))
  return str(path)


def _fails(argv, capsys, *phrases, lines: int = 1) -> str:
  """Runs pax in this process: exit 2, `lines` line(s) of error, no traceback, every phrase in it."""
  code, out, err = pax_main(argv, capsys)
  assert code == 2 and 'Traceback' not in err + out, (code, out[-2000:], err[-3000:])
  assert len(err.strip().splitlines()) == lines, err
  for phrase in phrases:
    assert phrase in err, (phrase, err)
  return err


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """A JSONL file of 300 documents, a 300-piece tokenizer trained on it and a directory prepared from it."""
  root = tmp_path_factory.mktemp('corpus')
  data = _jsonl(root / 'a.jsonl', [{'text': t} for t in _texts(300)])
  spm = str(root / 'spm.model')
  train_tokenizer(data, 'text', 300, spm)
  from paxcli import api
  api.data_prepare([data], str(root / 'prepared'), tokenizer=spm, workers=1)
  return root


def _copy(corpus, tmp_path, name='prepared') -> str:
  target = str(tmp_path / name)
  shutil.copytree(corpus / 'prepared', target)
  return target


def _manifest(directory) -> dict:
  with open(os.path.join(directory, prepared.MANIFEST), encoding='utf-8') as f:
    return json.load(f)


def _write_manifest(directory, raw) -> None:
  with open(os.path.join(directory, prepared.MANIFEST), 'w', encoding='utf-8') as f:
    f.write(raw if isinstance(raw, str) else json.dumps(raw))


# ---- reads outside a received directory ---------------------------------------------------------


def test_a_symlink_out_of_a_data_directory_is_never_read(corpus, tmp_path, capsys):
  """TRAIN_DATA, `pax data prepare` and `pax tokenizer train --data` given a directory (or a glob in
  it) holding `shadow.txt -> a file outside`: refused in one line naming it, nothing written."""
  (tmp_path / 'secret.txt').write_text(SECRET + '\n', encoding='utf-8')
  data = tmp_path / 'data'
  data.mkdir()
  shutil.copy(corpus / 'a.jsonl', data / 'a.jsonl')
  os.symlink(tmp_path / 'secret.txt', data / 'shadow.txt')
  said = ("data file 'shadow.txt' (a symlink) resolves to", 'outside the directory')
  for source in (str(data), str(data / '*.txt'), str(data / '**' / '*')):
    _fails(['data', 'prepare', source, str(tmp_path / 'out'), '--vocab-size', '300'], capsys, *said)
    assert not (tmp_path / 'out').exists()
  _fails(['tokenizer', 'train', '--data', str(data), '--vocab-size', '300', '--output', str(tmp_path / 'x.model')],
         capsys, *said)
  assert not (tmp_path / 'x.model').exists()
  _fails(['inspect-input', '--set', f'TRAIN_DATA={str(data)!r}', '--set', f'TOKENIZER={str(corpus / "spm.model")!r}',
          '--set', 'VOCAB_SIZE=320', '--num-batches', '1'], capsys, *said)
  # A symlink to another file inside the directory is read; a file named whole is read wherever it is.
  os.remove(data / 'shadow.txt')
  os.symlink(data / 'a.jsonl', data / 'again.jsonl')
  assert documents.expand(str(data)) == [str(data / 'a.jsonl'), str(data / 'again.jsonl')]
  assert documents.expand(str(tmp_path / 'secret.txt')) == [str(tmp_path / 'secret.txt')]


@pytest.mark.parametrize('member', ['tokenizer/tokenizer_config.json', 'tokenizer/spm.model', 'prepared.json',
                                    'train-00000-of-00001.array_record'])
def test_a_prepared_directory_member_linking_out_is_refused(corpus, tmp_path, capsys, member):
  directory = _copy(corpus, tmp_path)
  outside = tmp_path / 'outside'
  os.rename(os.path.join(directory, member) if os.path.exists(os.path.join(directory, member))
            else _write(tmp_path / 'made.json', json.dumps({'chat_template': '{{ 1 }}'})), outside)
  os.symlink(outside, os.path.join(directory, member))
  said = (f"{member!r} (a symlink) resolves to {outside}", 'outside the directory')
  _fails(['data', 'show', directory], capsys, *said)
  _fails(['inspect-input', '--set', f'TRAIN_DATA={directory!r}', '--set', 'VOCAB_SIZE=320', '--num-batches', '1'],
         capsys, *said)


def _write(path, text) -> str:
  path.write_text(text, encoding='utf-8')
  return str(path)


# ---- edited or damaged prepared directories -------------------------------------------------------


def _edit_count(raw, directory, value):
  raw['shards']['eval'][0]['records'] = value


def _null_name(raw, directory):
  raw['shards']['train'][0]['name'] = None


def _delete_shard(raw, directory):
  os.remove(os.path.join(directory, raw['shards']['train'][0]['name']))


def _truncate_shard(raw, directory):
  path = os.path.join(directory, raw['shards']['train'][0]['name'])
  data = open(path, 'rb').read()
  open(path, 'wb').write(data[:len(data) // 2])


def _random_shard(raw, directory):
  with open(os.path.join(directory, raw['shards']['train'][0]['name']), 'wb') as f:
    f.write(np.random.default_rng(0).bytes(70000))


@pytest.mark.parametrize('edit, phrases', [
    (lambda raw, d: _edit_count(raw, d, 3), ('shards.eval[0]', 'the manifest says 3')),
    (lambda raw, d: _edit_count(raw, d, 100000), ('shards.eval[0]', 'the manifest says 100,000')),
    (lambda raw, d: _edit_count(raw, d, -1), ('shards.eval[0].records must be at least 0',)),
    (lambda raw, d: _edit_count(raw, d, '30'), ('shards.eval[0].records must be a whole number',)),
    (_null_name, ('shards.train[0].name must be a string, got None',)),
    (_delete_shard, ('train-00000-of-00001.array_record: no such file',)),
    (_truncate_shard, ('train-00000-of-00001.array_record: not an ArrayRecord file, or a truncated',)),
    (_random_shard, ('train-00000-of-00001.array_record: not an ArrayRecord file',)),
    (lambda raw, d: raw.pop('vocab_size'), ("no 'vocab_size' field",)),
    (lambda raw, d: raw.update(shards=[]), ('shards must be a JSON object',)),
    (lambda raw, d: raw.update(eos_id=10 ** 6), ('eos_id must be between 0 and',)),
], ids=['count-3', 'count-100000', 'count-negative', 'count-string', 'null-name', 'deleted', 'truncated', 'random',
        'no-vocab', 'shards-list', 'eos-out-of-range'])
def test_an_edited_or_damaged_prepared_directory_is_one_line(corpus, tmp_path, capsys, edit, phrases):
  """`pax data show` and the Grain input (what `pax train` and `pax eval` read) refuse it, naming the
  manifest or the shard and the field; the edited eval count never evaluates 3 documents, nor loops."""
  directory = _copy(corpus, tmp_path)
  raw = _manifest(directory)
  edit(raw, directory)
  _write_manifest(directory, raw)
  _fails(['data', 'show', directory], capsys, *phrases)
  with pytest.raises(UserError) as e:
    GrainLmInput(name='eval', data=directory, split='eval', is_training=False, repeat=False, batch_size=2, seq_len=16)
  assert all(p in str(e.value) for p in phrases) and '\n' not in str(e.value)


def test_a_deeply_nested_manifest_is_one_line(corpus, tmp_path, capsys):
  directory = _copy(corpus, tmp_path)
  _write_manifest(directory, '[' * 100_000 + ']' * 100_000)
  _fails(['data', 'show', directory], capsys, 'prepared.json', 'nested too deeply')


def test_a_shard_name_with_rich_markup_is_shown_as_written(corpus, tmp_path, capsys):
  directory = _copy(corpus, tmp_path)
  raw = _manifest(directory)
  name = '[/bold]x[red].array_record'  # a shard in the directory '[' (a name may hold a slash)
  os.mkdir(os.path.join(directory, '['))
  os.rename(os.path.join(directory, raw['shards']['train'][0]['name']), os.path.join(directory, name))
  raw['shards']['train'][0]['name'] = name
  _write_manifest(directory, raw)
  code, out, err = pax_main(['data', 'show', directory], capsys)
  assert code == 0 and 'Traceback' not in err, err
  assert name in out.replace('\n', '')


def test_eval_data_of_another_tokenizer_than_train_is_refused(corpus, tmp_path, capsys):
  """EVAL_DATA prepared with another tokenizer than TRAIN_DATA: its ids mean other tokens."""
  other_spm = str(tmp_path / 'other.model')
  train_tokenizer(str(corpus / 'a.jsonl'), 'text', 320, other_spm)
  from paxcli import api
  other = str(tmp_path / 'other')
  api.data_prepare([str(corpus / 'a.jsonl')], other, tokenizer=other_spm, workers=1, eval_split=False)
  same = str(tmp_path / 'same')
  api.data_prepare([str(corpus / 'a.jsonl')], same, tokenizer=str(corpus / 'spm.model'), workers=1, eval_split=False)
  args = ['inspect-input', '--set', f'TRAIN_DATA={str(corpus / "prepared")!r}', '--set', 'VOCAB_SIZE=320',
          '--set', 'MAX_SEQ_LEN=16', '--split', 'eval', '--num-batches', '1']
  _fails([*args, '--set', f'EVAL_DATA={other!r}'], capsys, 'TRAIN_DATA and EVAL_DATA', 'different tokenizers')
  code, _, err = pax_main([*args, '--set', f'EVAL_DATA={same!r}'], capsys)
  assert code == 0, err


# ---- pax data prepare: one writer, its own output never an input ------------------------------------


def test_a_prepare_into_a_directory_another_prepare_writes_is_refused(corpus, tmp_path, capsys):
  """Two `pax data prepare` of different files into one new directory: the second is refused by the
  first's lock (held here as a running prepare holds it), and the directory is the first's alone."""
  out = tmp_path / 'out'
  out.mkdir()
  other = _jsonl(tmp_path / 'other.jsonl', [{'text': t} for t in _texts(50, seed=5)])
  with open(out / '.prepare.lock', 'w') as held:
    fcntl.flock(held, fcntl.LOCK_EX)
    _fails(['data', 'prepare', other, str(out), '--tokenizer', str(corpus / 'spm.model')], capsys,
           'Another `pax data prepare` is writing', 'nothing written')
    assert sorted(os.listdir(out)) == ['.prepare.lock']
  code, _, err = pax_main(['data', 'prepare', other, str(out), '--tokenizer', str(corpus / 'spm.model')], capsys)
  assert code == 0, err
  assert prepared.read_manifest(str(out)).sources == [other] and not (out / '.prepare.lock').exists()


def test_two_real_prepares_into_one_new_directory(corpus, tmp_path):
  """The same with two real processes started together: one writes the directory, the other is refused."""
  files = [_jsonl(tmp_path / f'{k}.jsonl', [{'text': t} for t in _texts(6000, seed=k)]) for k in range(2)]
  args = ['data', 'prepare', '--tokenizer', str(corpus / 'spm.model'), '--workers', '1']
  procs = [subprocess.Popen([sys.executable, '-m', 'paxcli.cli.app', *args, f, str(tmp_path / 'out')],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for f in files]
  results = [(p.wait(300), p.stderr.read()) for p in procs]
  codes = sorted(code for code, _ in results)
  assert codes == [0, 2], results
  winner = next(f for f, (code, _) in zip(files, results) if code == 0)
  refused = next(err for code, err in results if code == 2)
  assert 'Another `pax data prepare` is writing' in refused or 'holds a `pax data prepare` of other files' in refused
  assert prepared.read_manifest(str(tmp_path / 'out')).sources == [winner]


def test_a_prepare_inside_its_input_directory_leaves_its_own_output_out(corpus, tmp_path, capsys):
  data = tmp_path / 'data'
  data.mkdir()
  shutil.copy(corpus / 'a.jsonl', data / 'a.jsonl')
  args = ['data', 'prepare', str(data), str(data / 'prepared'), '--tokenizer', str(corpus / 'spm.model'), '--json']
  code, out, err = pax_main(args, capsys)
  assert code == 0, err
  first = json.loads(out)
  code, out, err = pax_main(args, capsys)   # run again: it finds its own work done, its shards are no input
  assert code == 0 and 'nothing to do' in err, err
  assert json.loads(out)['records'] == first['records']
  assert prepared.read_manifest(str(data / 'prepared')).sources == [str(data / 'a.jsonl')]


# ---- bounded reads of data files ----------------------------------------------------------------------


def _gzip(path, text: str) -> str:
  with gzip.open(path, 'wt', encoding='utf-8') as f:
    f.write(text)
  return str(path)


@pytest.mark.parametrize('name, content, phrase', [
    ('deep.jsonl', '{"text": "fine"}\n{"text": ' + '[' * 100_000 + ']' * 100_000 + '}\n',
     'deep.jsonl line 2: JSON nested too deeply'),
    ('digits.jsonl', '{"text": "fine"}\n{"text": "x", "id": ' + '9' * 5001 + '}\n',
     'digits.jsonl line 2: an integer of 5,001 digits'),
    ('nan.jsonl', '{"text": "fine", "score": NaN}\n', 'nan.jsonl line 1: NaN is not a JSON number'),
    ('long.jsonl', '{"text": "fine"}\n{"text": "' + 'x' * 5000 + '"}\n{"text": "after"}\n',
     'long.jsonl line 2: a line of more than 4,096 bytes; paxcli reads lines of at most that '
     '(PAXCLI_MAX_LINE_BYTES raises the bound)'),
    ('bomb.jsonl.gz', None, 'bomb.jsonl.gz line 1: a line of more than 4,096 bytes (after gunzip)'),
    ('block.txt', 'a\n\n' + ('y' * 100 + '\n') * 50 + '\nz\n', 'block.txt line 3: a block of text'),
    ('random.array_record', None, 'random.array_record: not an ArrayRecord file'),
])
def test_a_bad_data_file_is_one_line_naming_file_and_line(tmp_path, capsys, monkeypatch, name, content, phrase):
  if 'PAXCLI_MAX_LINE_BYTES' in phrase or name in ('bomb.jsonl.gz', 'block.txt'):
    monkeypatch.setenv('PAXCLI_MAX_LINE_BYTES', '4096')
  path = tmp_path / name
  if name.endswith('.gz'):
    _gzip(path, '{"text": "' + 'a' * 10_000_000 + '"}\n')  # ~10 KB on disk
  elif name.endswith('.array_record'):
    path.write_bytes(np.random.default_rng(0).bytes(70000))
  else:
    path.write_text(content, encoding='utf-8')
  _fails(['tokenizer', 'train', '--data', str(path), '--vocab-size', '300', '--output', str(tmp_path / 'x.model')],
         capsys, phrase)
  _fails(['data', 'prepare', str(path), str(tmp_path / 'out'), '--vocab-size', '300'], capsys, phrase, lines=2)
  assert not (tmp_path / 'out').exists() and not (tmp_path / 'x.model').exists()


def test_a_long_line_within_the_bound_is_read_and_tokenized_in_checked_pieces(corpus, tmp_path, monkeypatch):
  """A document of several LONG_TEXT pieces gives the ids of tokenizing it whole, for paxcli's own
  sentencepiece models and for a byte-level tokenizer.json."""
  monkeypatch.setattr(tokenizers, 'LONG_TEXT', 2000)
  text = ' '.join(_texts(400, seed=3))
  assert len(text) > 6 * 2000
  for path in (str(corpus / 'spm.model'), _hf_tokenizer(tmp_path)):
    tok = tokenizers.load(path)
    pieces = tok.encode_many([text])[0]
    whole = np.asarray(tok._sp.encode(text) if hasattr(tok, '_sp') else tok._tok.encode(text).ids)
    np.testing.assert_array_equal(pieces, whole)


def _hf_tokenizer(tmp_path) -> str:
  import tokenizers as hf
  tok = hf.Tokenizer(hf.models.BPE())
  tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.train_from_iterator(_texts(300), hf.trainers.BpeTrainer(vocab_size=400,
                                                              initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet()))
  path = str(tmp_path / 'tokenizer.json')
  tok.save(path)
  return path


def test_a_lone_surrogate_is_read_as_the_replacement_character(corpus, tmp_path, capsys):
  """JSON's "\\ud800" alone (no UTF-8 text holds it): U+FFFD is tokenized in its place (documented)."""
  data = tmp_path / 'lone.jsonl'
  data.write_text('{"text": "river \\ud800 stone"}\n' + ''.join(json.dumps({'text': t}) + '\n' for t in _texts(40)),
                  encoding='utf-8')
  code, _, err = pax_main(['data', 'prepare', str(data), str(tmp_path / 'out'), '--tokenizer',
                           str(corpus / 'spm.model'), '--no-eval-split'], capsys)
  assert code == 0, err
  manifest = prepared.read_manifest(str(tmp_path / 'out'))
  with prepared.array_records(str(tmp_path / 'out' / manifest.shards['train'][0].name)) as reader:
    first = prepared.decode(reader.read([0])[0])[0]
  tok = tokenizers.load(str(corpus / 'spm.model'))
  np.testing.assert_array_equal(first, tok.encode('river \ufffd stone') + [tok.eos_id])
  code, _, err = pax_main(['tokenizer', 'train', '--data', str(data), '--vocab-size', '300', '--output',
                           str(tmp_path / 'x.model')], capsys)
  assert code == 0, err


# ---- chat templates: bounded in time, memory and output ------------------------------------------------


@pytest.fixture(scope='module')
def chat(tmp_path_factory):
  root = tmp_path_factory.mktemp('chat')
  messages = [{'role': 'user', 'content': 'w2 w3'}, {'role': 'assistant', 'content': 'w4 w5'}]
  _jsonl(root / 'chat.jsonl', [{'messages': messages}] * 3)
  return root


def _template_tokenizer(directory, template) -> str:
  os.makedirs(directory)
  prepared_data.write_tokenizer(os.path.join(directory, 'tokenizer.json'), 64)
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w', encoding='utf-8') as f:
    json.dump({'eos_token': '</s>', 'chat_template': template}, f)
  return os.path.join(directory, 'tokenizer.json')


CONTENT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.mark.parametrize('template, env, phrase', [
    ('{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}' + CONTENT, {},
     'chat.jsonl line 1: the chat_template of {config} ran past 2 s on this conversation; stopped '
     '(PAXCLI_TEMPLATE_SECONDS raises the bound)'),
    ("{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}" + CONTENT, {},
     'ran past 2 s'),
    ('{{ 9**(9**9) }}' + CONTENT, {}, '{config}: its chat_template ran past 2 s while compiling'),
    ("{{ 'x' * 300000000 }}" + CONTENT, {'PAXCLI_TEMPLATE_MEMORY_MB': '200'},
     '{config} needs more than 200 MB on this conversation; stopped (PAXCLI_TEMPLATE_MEMORY_MB'),
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}" + CONTENT, {'PAXCLI_TEMPLATE_MAX_CHARS': '1000000'},
     'renders more than 1,000,000 characters on this conversation; stopped (PAXCLI_TEMPLATE_MAX_CHARS'),
    ('{{ messages | tojson(indent=1000000000) }}', {}, 'tojson: indent must be at most 64'),
    ('{{ lipsum() }}' + CONTENT, {}, "'lipsum' is undefined"),
    ('{{ [1, 2, 3] | random }}' + CONTENT, {}, "No filter named 'random'"),
], ids=['nested-range', 'nested-string', 'power', 'repeat', 'output', 'tojson-indent', 'lipsum', 'random'])
def test_a_chat_template_past_its_bound_stops_in_one_line(chat, tmp_path, capsys, monkeypatch, template, env, phrase):
  """`pax data prepare` of chat JSONL with a tokenizer whose template loops, computes or renders
  without end: stopped at its bound (2 s here), one line naming the tokenizer_config.json; the
  template's process is gone."""
  monkeypatch.setenv('PAXCLI_TEMPLATE_SECONDS', '2')
  for key, value in env.items():
    monkeypatch.setenv(key, value)
  tok = _template_tokenizer(str(tmp_path / 'tok'), template)
  config = str(tmp_path / 'tok' / 'tokenizer_config.json')
  before = _children()
  _fails(['data', 'prepare', str(chat / 'chat.jsonl'), str(tmp_path / 'out'), '--tokenizer', tok, '--workers', '1'],
         capsys, phrase.format(config=config))
  assert _children() <= before
  assert not any(name.endswith('.partial') for name in os.listdir(tmp_path / 'out'))


def _children() -> set:
  """The pids of this process's live children (ps itself left out)."""
  out = subprocess.run(['ps', '-o', 'pid=,comm=', '--ppid', str(os.getpid())], capture_output=True, text=True).stdout
  return {int(line.split()[0]) for line in out.splitlines() if line.split()[1:] != ['ps']}


def test_a_template_renders_the_same_bytes_on_every_run(chat, tmp_path, capsys):
  """No randomness reaches a template (lipsum and random are gone): two prepares, the same bytes."""
  tok = _template_tokenizer(str(tmp_path / 'tok'), "{% for m in messages %}{{ m['content'] }} {% endfor %}")
  shards = []
  for k in range(2):
    out = tmp_path / f'out{k}'
    code, _, err = pax_main(['data', 'prepare', str(chat / 'chat.jsonl'), str(out), '--tokenizer', tok,
                             '--no-eval-split', '--workers', '1'], capsys)
    assert code == 0, err
    shards.append((out / 'train-00000-of-00001.array_record').read_bytes())
  assert shards[0] == shards[1]


# ---- the Grain input's saved state ----------------------------------------------------------------------


@pytest.fixture(scope='module')
def grain_data(tmp_path_factory):
  root = tmp_path_factory.mktemp('grain')
  prepared_data.make(root, num_docs=60)
  return str(root)


def _grain(directory, **kw):
  fields = dict(name='train', data=directory, is_training=True, batch_size=2, seq_len=16, num_streams=4, workers=0)
  fields.update(kw)
  return GrainLmInput(**fields)


def _saved_state(directory, steps=5) -> dict:
  inp = _grain(directory)
  for _ in range(steps):
    inp.get_next()
  state = json.loads(inp.get_state())
  inp.close()
  return state


def _reseal(state) -> dict:
  return json.loads(grain_state.seal({k: v for k, v in state.items() if k != 'checksum'}))


def _streams(state) -> dict:
  return state['grain']['paxcli_streams']


STATE_EDITS = {
    'next-negative': (lambda s: _streams(s)['1'].update(next=-5), 'stream 1: next -5 is out of range'),
    'three-of-four': (lambda s: _streams(s).pop('2'), 'holds the state of 3 of its 4 streams'),
    'huge-piece': (lambda s: _streams(s)['0']['open'].append([[10 ** 12, 10 ** 9]]), 'is not one this stream has read'),
    'piece-past-doc': (lambda s: _streams(s)['0']['open'].append([[0, 50]]), 'piece 50 of the document at position 0'),
    'huge-next': (lambda s: _streams(s)['3'].update(next=10 ** 9), 'next 1000000000 is more documents than'),
    'no-grain': (lambda s: s.pop('grain'), "no 'grain' field"),
    'batches-string': (lambda s: s.update(batches='5'), 'batches must be a whole number'),
    'list': (lambda s: [], 'an input state is a JSON object, got a list'),
    'empty': (lambda s: s.clear(), 'input state version None'),
    'two-rows-one-piece': (lambda s: _streams(s)['0']['open'].extend([[[0, 0]], [[0, 0]]]), 'is in two rows'),
    'cursor': (lambda s: s['grain'].update(cursor=-1), 'grain.cursor -1 is out of range'),
}


@pytest.mark.parametrize('name', list(STATE_EDITS))
def test_an_edited_input_state_is_refused_naming_the_field(grain_data, name):
  """Each edit, resealed with a valid checksum (what the checksum cannot catch), is refused by the
  checks of every field; unsealed, by the checksum."""
  edit, phrase = STATE_EDITS[name]
  state = _saved_state(grain_data)
  state = _edited(state, edit)
  if state:  # an edit that leaves the file a JSON object with a version: its checksum no longer matches
    with pytest.raises(UserError, match='does not match its checksum'):
      _grain(grain_data).restore([state], batches=5)
    state = _reseal(state)
  with pytest.raises(UserError) as e:
    _grain(grain_data).restore([state], batches=5)
  assert phrase in str(e.value) and '\n' not in str(e.value), str(e.value)


def _edited(state: dict, edit):
  """The state after `edit`, which changes it in place or returns a list to stand for it."""
  out = edit(state)
  return out if isinstance(out, list) else state


def test_an_unedited_state_restores_and_other_batches_are_refused(grain_data):
  state = _saved_state(grain_data)
  _grain(grain_data).restore([state], batches=5)
  with pytest.raises(UserError, match='batches 5 differs from the 6 its checkpoint'):
    _grain(grain_data).restore([state], batches=6)
  old = {k: v for k, v in state.items() if k != 'checksum'}   # version 1 (before the checksum): still read
  old['version'] = 1
  _grain(grain_data).restore([old], batches=5)


TINY = ['--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=16', '--set', 'HIDDEN_DIMS=32', '--set', 'NUM_HEADS=2',
        '--set', 'VOCAB_SIZE=64', '--set', 'MAX_SEQ_LEN=16', '--set', 'PERCORE_BATCH_SIZE=1',
        '--set', 'ICI_MESH_SHAPE=[1,1,1]', '--set', 'DECODE_INTERVAL_STEPS=0', '--set', 'EVAL_INTERVAL_STEPS=0',
        '--set', 'DATA_STREAMS=4', '--set', 'task.train.save_interval_steps=2']


@pytest.mark.slow  # a `pax train` and one resume per edit: about a minute on 2 cores
def test_pax_train_refuses_to_resume_from_an_edited_input_state(grain_data, tmp_path):
  """A real checkpoint's input item edited (sealed again or not): `pax train` stops in one line naming
  the file and field, the checkpoint intact; the unedited one resumes."""
  env = {'XLA_FLAGS': '--xla_force_host_platform_device_count=1'}
  args = ['train', *TINY, '--set', f'TRAIN_DATA={grain_data!r}', '--job-log-dir', 'job']
  first = run_pax(*args, '--set', 'NUM_TRAIN_STEPS=2', cwd=tmp_path, env=env, timeout=600)
  assert first.returncode == 0, first.stderr[-3000:]
  state_file = tmp_path / 'job' / 'checkpoints' / '2' / 'input' / 'process_0-of-1.json'
  original = state_file.read_text()
  for name in ('three-of-four', 'huge-piece', 'next-negative'):
    edit, phrase = STATE_EDITS[name]
    for sealed in (False, True):
      state = _edited(json.loads(original), edit)
      state_file.write_text(json.dumps(_reseal(state) if sealed else state))
      resumed = run_pax(*args, '--set', 'NUM_TRAIN_STEPS=4', cwd=tmp_path, env=env, timeout=600)
      said = phrase if sealed else 'does not match its checksum'
      assert resumed.returncode == 2 and 'Traceback' not in resumed.stderr, resumed.stderr[-3000:]
      assert str(state_file) in resumed.stderr and said in resumed.stderr, resumed.stderr[-3000:]
      assert sorted(os.listdir(tmp_path / 'job' / 'checkpoints')) == ['2']
  state_file.write_text('[' * 100_000 + ']' * 100_000)
  resumed = run_pax(*args, '--set', 'NUM_TRAIN_STEPS=4', cwd=tmp_path, env=env, timeout=600)
  assert resumed.returncode == 2 and 'nested too deeply' in resumed.stderr, resumed.stderr[-3000:]
  state_file.write_text(original)
  resumed = run_pax(*args, '--set', 'NUM_TRAIN_STEPS=4', cwd=tmp_path, env=env, timeout=600)
  assert resumed.returncode == 0 and 'Resumed from step 2' in resumed.stderr + resumed.stdout, resumed.stderr[-3000:]
