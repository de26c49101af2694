"""What a run on your own data used to choose silently (issue 38, item 10): a tokenizer with far fewer
tokens than VOCAB_SIZE is said in one line (the model keeps VOCAB_SIZE), and decoding while training
decodes prompts of your data, not the recipe's stdlib prompts."""

import json
import re

import pytest

from conftest import pax_main, run_pax
from paxcli import config
from paxcli.inputs import documents
from paxcli.inputs.tokenizers import train_sentencepiece

PAIRS = [{'prompt': f'Q: What is {i} plus one?\nA:', 'completion': f' {i + 1}.'} for i in range(60)]
TINY = ['--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=32', '--set', 'HIDDEN_DIMS=64', '--set', 'NUM_HEADS=2',
        '--set', 'MAX_SEQ_LEN=32', '--set', 'PERCORE_BATCH_SIZE=1', '--set', 'ICI_MESH_SHAPE=[1,1,1]']


def _pairs(tmp_path):
  path = tmp_path / 'pairs.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in PAIRS))
  return path


def test_a_tokenizer_far_smaller_than_vocab_size_is_said_once(tmp_path, capsys):
  data = _pairs(tmp_path)
  spm = str(tmp_path / 'spm.model')
  pieces = train_sentencepiece([r['prompt'] + r['completion'] for r in PAIRS] * 4, 300, spm)
  args = ['inspect-input', '--set', f'TRAIN_DATA={str(data)!r}', '--set', f'TOKENIZER={spm!r}', *TINY,
          '--num-batches', '1', '--json']
  code, _, err = pax_main([*args, '--set', 'VOCAB_SIZE=1024'], capsys)
  assert code == 0, err
  said = [line for line in err.splitlines() if 'VOCAB_SIZE is 1,024' in line]
  assert said == [f'The tokenizer {spm} has {pieces:,} tokens and VOCAB_SIZE is 1,024: {1024 - pieces:,} ids are '
                  'no token (their embedding rows and logits only learn not to be chosen). Set '
                  f'VOCAB_SIZE={pieces} to fit it, or {-(-pieces // 128) * 128} (a multiple of 128, faster on '
                  'accelerators).']   # once, though the train and the eval input both read it
  code, _, err = pax_main([*args, '--set', f'VOCAB_SIZE={pieces + 8}'], capsys)   # padding: nothing to say
  assert code == 0 and 'VOCAB_SIZE is' not in err, err
  code, _, err = pax_main([*args, '--set', f'VOCAB_SIZE={pieces - 1}'], capsys)
  assert code == 2 and f'has {pieces} tokens, more than the model\'s {pieces - 1}' in err


def test_own_data_decodes_its_own_held_out_prompts_unless_decode_prompts_is_set(tmp_path):
  data = _pairs(tmp_path)
  held_out = {doc.chunks[0].text for doc in documents.read_split(str(data), 'text', 'eval')}   # 1 in 20
  prompts = list(config.resolve('default.StdlibDocsLm', [f'TRAIN_DATA={str(data)!r}']).flat()['task.train.decode_prompts'])
  assert 1 <= len(prompts) <= 4 and set(prompts) <= held_out, prompts
  texts = tmp_path / 'texts.jsonl'
  texts.write_text(''.join(json.dumps({'text': f'document {i} says a great many words about nothing at all'}) + '\n'
                           for i in range(60)))
  firsts = config.resolve('default.StdlibDocsLm', [f'TRAIN_DATA={str(texts)!r}']).flat()['task.train.decode_prompts']
  assert firsts and all(re.fullmatch(r'document \d+ says a great many', p) for p in firsts), firsts   # 6 words
  flat = config.resolve('default.StdlibDocsLm', [f'TRAIN_DATA={str(data)!r}', "DECODE_PROMPTS=['Create a new']"]).flat()
  assert list(flat['task.train.decode_prompts']) == ['Create a new']   # asked for: kept
  assert list(config.resolve('default.StdlibDocsLm', []).flat()['task.train.decode_prompts'])[0] == 'Return the number of'


@pytest.mark.slow   # a training run from a fresh shell
def test_decoding_while_training_on_own_data_decodes_its_held_out_prompts(tmp_path):
  data = _pairs(tmp_path)
  done = run_pax('train', '--set', f'TRAIN_DATA={data}', *TINY, '--set', 'VOCAB_SIZE=320', '--set',
                 'NUM_TRAIN_STEPS=2', '--set', 'DECODE_INTERVAL_STEPS=2', '--set', 'DECODE_MAX_STEPS=2',
                 '--job-log-dir', 'job', cwd=tmp_path, env={'XLA_FLAGS': '--xla_force_host_platform_device_count=1'})
  assert done.returncode == 0, done.stderr[-3000:]
  decoded = [json.loads(line) for f in sorted((tmp_path / 'job' / 'decoder_out').rglob('*.jsonl'))
             for line in f.read_text().splitlines()]
  prompts = [d['prompt'] for d in decoded]
  held_out = {r['prompt'] for r in PAIRS}
  assert prompts and all(p in held_out for p in prompts), prompts   # the data's, not 'Return the number of'
