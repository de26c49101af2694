"""`pax checkpoint convert --to hf` writes the tokenizer as transformers reads it (issue 17, 4).

The special ids in config.json and generation_config.json are the tokenizer's (paxcli's
corpus tokenizer: pad 0, eos 1, unk 2, no bos), and tokenizer.json/tokenizer_config.json make
`AutoTokenizer.from_pretrained(out)` give the ids paxcli gives.
"""

import inspect
import json
import os

import pytest

from conftest import pax_main
from test_untrusted_files import CONFIG, llama_weights, make_hf

VOCAB = 640   # 256 byte pieces, 3 special, the rest learned

TEXTS = ['Create a new', ' Create  a new\tthing', 'Hello, world!\n\nx', 'ﬁ café ½ 日本語 \u00a0x', '  leading',
         'x  ', '', 'Return the value.</s> <unk> <0x41>', 'def f(x):\n    return x ** 2  # squared']


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
  """A sentencepiece model trained as paxcli's corpus tokenizer is (inputs/corpus.py), a tiny Llama
  imported with it into a job, and that job exported to HF."""
  import sentencepiece as spm
  base = tmp_path_factory.mktemp('hftok')
  lines = [line for m in (json, os, inspect, pytest) for obj in vars(m).values()
           for line in (getattr(obj, '__doc__', None) or '').split('\n') if line.strip()]
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(lines), model_prefix=str(base / 'spm'), vocab_size=VOCAB, model_type='unigram',
      character_coverage=1.0, byte_fallback=True, minloglevel=2, pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
  cfg = {**CONFIG, 'vocab_size': VOCAB}
  src = make_hf(base / 'hf', cfg, llama_weights(cfg))
  os.rename(base / 'spm.model', base / 'hf' / 'tokenizer.model')
  from paxcli.cli.app import main
  for argv in (['checkpoint', 'convert', src, str(base / 'job'), '--from', 'hf', '--no-verify'],
               ['checkpoint', 'convert', str(base / 'job'), str(base / 'out'), '--to', 'hf']):
    try:
      main(argv)
    except SystemExit as e:
      assert not e.code
  return base


def _json(path):
  with open(path) as f:
    return json.load(f)


def test_special_ids_and_tokens_come_from_the_tokenizer(exported):
  from paxcli.inputs.tokenizers import SentencePieceTokenizer
  out = exported / 'out'
  tok = SentencePieceTokenizer(str(exported / 'job' / 'tokenizer' / 'spm.model'))
  assert (tok.eos_id, tok.pad_id, tok.bos_id) == (1, 0, None)
  cfg = _json(out / 'config.json')
  assert (cfg['bos_token_id'], cfg['eos_token_id'], cfg['pad_token_id']) == (None, 1, 0)
  assert _json(out / 'generation_config.json') == {'eos_token_id': 1, 'pad_token_id': 0}
  tc = _json(out / 'tokenizer_config.json')
  sp = tok._sp
  assert tc['eos_token'] == sp.id_to_piece(1) == '</s>' and tc['pad_token'] == sp.id_to_piece(0) == '<pad>'
  assert tc['unk_token'] == sp.id_to_piece(sp.unk_id()) == '<unk>' and tc['bos_token'] is None
  assert tc['add_bos_token'] is False and tc['add_eos_token'] is False
  assert _json(out / 'special_tokens_map.json') == {'eos_token': '</s>', 'unk_token': '<unk>', 'pad_token': '<pad>'}
  with open(out / 'tokenizer.model', 'rb') as a, open(exported / 'hf' / 'tokenizer.model', 'rb') as b:
    assert a.read() == b.read()
  tj = _json(out / 'tokenizer.json')
  assert [p for p, _ in tj['model']['vocab']] == [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
  assert tj['post_processor'] is None   # nothing added around the text, as paxcli


def test_tokenizers_reads_the_same_ids_as_paxcli(exported):
  tokenizers = pytest.importorskip('tokenizers')
  from paxcli.inputs.tokenizers import SentencePieceTokenizer
  ours = SentencePieceTokenizer(str(exported / 'job' / 'tokenizer' / 'spm.model'))
  theirs = tokenizers.Tokenizer.from_file(str(exported / 'out' / 'tokenizer.json'))
  theirs.encode_special_tokens = True   # what tokenizer_config's split_special_tokens sets
  for text in TEXTS + [inspect.__doc__, json.__doc__]:
    assert theirs.encode(text, add_special_tokens=False).ids == ours.encode(text), text


def test_transformers_autotokenizer_gives_paxcli_ids(exported):
  transformers = pytest.importorskip('transformers')
  from paxcli.inputs.tokenizers import SentencePieceTokenizer
  ours = SentencePieceTokenizer(str(exported / 'job' / 'tokenizer' / 'spm.model'))
  theirs = transformers.AutoTokenizer.from_pretrained(str(exported / 'out'))
  assert len(ours.encode('Create a new')) == len(theirs('Create a new')['input_ids'])
  for text in TEXTS + [inspect.__doc__, json.__doc__]:
    ids = theirs(text)['input_ids']
    assert ids == ours.encode(text), text
    assert theirs.decode(ids) == ours.decode(ids), text
  assert (theirs.eos_token_id, theirs.pad_token_id, theirs.bos_token_id) == (1, 0, None)
  config = transformers.AutoConfig.from_pretrained(str(exported / 'out'))
  assert config.eos_token_id == 1 and config.bos_token_id is None
