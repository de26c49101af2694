"""`pax decode` of text prompts with the real sentencepiece tokenizer of a trained default-experiment
job: prompts encoded, rows stopped at the tokenizer's EOS, `--stop`, `--eos-id` and `--dtype`.

One tiny training of the built-in default experiment (its stdlib-docstring corpus and 2048-piece
tokenizer) per module. The tokenizer is read here with the sentencepiece library itself, not with
paxcli's wrapper. Rows are sampled with a fixed seed: sample s of prompt i depends on (seed, i, s)
only, so a run whose rows stop early reproduces the prefixes of a run where they do not; that is
the reference each stopping rule is judged against.
"""

import json
import os

import pytest

SETS = ['NUM_LAYERS=1', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=2', 'MAX_SEQ_LEN=32',
        'PERCORE_BATCH_SIZE=1', 'NUM_TRAIN_STEPS=40', 'SAVE_INTERVAL_STEPS=40', 'LR_WARMUP_STEPS=5',
        'EVAL_INTERVAL_STEPS=0', 'DECODE_INTERVAL_STEPS=0']
PROMPTS = ['Return the number of items.', 'Create a new', 'If the optional argument', 'Raise ValueError if']
EOS = 1  # the default corpus' sentencepiece model: pad 0, eos 1, unk 2
# 4 prompts x 16 samples x 24 steps among the 40 likeliest tokens: EOS is the corpus' 7th most common
# token (1.5%), so some rows end at it; pad (id 0, never a target) is never among the 40.
SAMPLED = ['--temperature', '1.0', '--top-k', '40', '--num-samples', '16', '--seed', '3', '--max-decode-steps', '24']


def _sets():
  return [a for s in SETS for a in ('--set', s)]


# Slow (CI runs it in make test-slow): the default suite's test_main_path decodes text with a
# trained job's tokenizer and stops at its EOS; this module adds --eos-id, --stop and bfloat16.
pytestmark = pytest.mark.slow

@pytest.fixture(scope='module')
def job(tmp_path_factory):
  path = str(tmp_path_factory.mktemp('decode_text') / 'job')
  from paxcli.cli.app import main
  try:
    main(['train', *_sets(), '--job-log-dir', path])
  except SystemExit as e:
    assert not e.code
  return path


@pytest.fixture(scope='module')
def sp(job):
  import sentencepiece as spm
  model = spm.SentencePieceProcessor(model_file=os.path.join(job, 'tokenizer', 'spm.model'))
  assert model.eos_id() == EOS and model.get_piece_size() == 2048
  return model


def _decode(job, *extra):
  """`pax decode` of PROMPTS; its JSONL output, keyed by (prompt index, sample index)."""
  from paxcli.cli.app import main
  out = os.path.join(job, f'decoded-{len(os.listdir(job))}.jsonl')
  try:
    main(['decode', *_sets(), '--job-log-dir', job, *[a for p in PROMPTS for a in ('--prompt', p)], '-o', out,
          *extra])
  except SystemExit as e:
    assert not e.code
  rows = [json.loads(line) for line in open(out, encoding='utf-8')]
  return {(r['prompt_index'], r['sample_index']): r for r in rows}


@pytest.fixture(scope='module')
def unstopped(job):
  """The reference: the same sampled rows, with only pad (never in the corpus) as the end id."""
  return _decode(job, *SAMPLED, '--eos-id', '0')


def _text(sp, prompt_ids, ids):
  """The text `ids` add after the prompt: prompt and continuation decoded together, the prompt's text
  cut off (sentencepiece drops the word-boundary space of a text's first piece when decoded alone)."""
  head, whole = sp.decode(list(prompt_ids)), sp.decode(list(prompt_ids) + list(ids))
  assert whole.startswith(head)
  return whole[len(head):]


def _cut(ids, *ends):
  """The ids up to and including the first of `ends`; (ids, None) if none occurs."""
  for i, t in enumerate(ids):
    if t in ends:
      return ids[:i + 1], t
  return ids, None


def test_text_prompts_are_encoded_by_the_jobs_tokenizer(job, sp, unstopped):
  assert len(unstopped) == len(PROMPTS) * 16
  for (i, _), r in unstopped.items():
    assert r['prompt'] == PROMPTS[i] and r['prompt_ids'] == sp.encode(PROMPTS[i])
    assert r['decoded'] == _text(sp, r['prompt_ids'], r['decoded_ids']) and r['stop_reason'] == 'max_steps'
    assert 0 not in r['decoded_ids']  # pad never ends these rows: they are the full 24 tokens
    assert len(r['decoded_ids']) == 24


def test_rows_stop_at_the_tokenizers_eos_without_showing_it(job, sp, unstopped):
  """No --eos-id: each row ends at its first EOS (the tokenizer's), the text is what came before it."""
  stopped = _decode(job, *SAMPLED)
  assert stopped.keys() == unstopped.keys()
  ended = 0
  for key, ref in unstopped.items():
    want, end = _cut(ref['decoded_ids'], EOS)
    r = stopped[key]
    assert r['decoded_ids'] == want, key
    if end is None:
      assert r['stop_reason'] == 'max_steps' and r['decoded'] == ref['decoded']
    else:
      ended += 1
      assert r['stop_reason'] == 'eos' and r['decoded'] == _text(sp, ref['prompt_ids'], want[:-1]), key
      assert r['num_decoded_tokens'] == len(want)
  assert ended >= 3, 'too few rows sampled the EOS to judge stopping at it'


def test_stop_strings_and_eos_ids_end_rows_where_the_reference_reaches_them(job, sp, unstopped):
  """--eos-id replaces the tokenizer's EOS; --stop ends a row once its text holds the string and
  cuts the text before it; a row ends at whichever comes first."""
  first = unstopped[(0, 0)]['decoded_ids']
  end_id = first[5]
  stop = sp.decode(unstopped[(1, 0)]['decoded_ids'][8:10]).strip()[:3]
  assert stop and end_id != EOS
  got = _decode(job, *SAMPLED, '--eos-id', str(end_id), '--stop', stop)
  by_stop = by_eos = 0
  for key, ref in unstopped.items():
    ids = ref['decoded_ids']
    # the first prefix whose text holds the stop string
    at_stop = next((j for j in range(1, len(ids) + 1) if stop in _text(sp, ref['prompt_ids'], ids[:j])), None)
    at_eos = ids.index(end_id) + 1 if end_id in ids else None
    r = got[key]
    if at_eos and (at_stop is None or at_eos <= at_stop):
      by_eos += 1
      assert r['stop_reason'] == 'eos' and r['decoded_ids'] == ids[:at_eos], key
      assert r['decoded'] == _text(sp, ref['prompt_ids'], ids[:at_eos - 1])
    elif at_stop:
      by_stop += 1
      text = _text(sp, ref['prompt_ids'], ids[:at_stop])
      assert r['stop_reason'] == 'stop_string' and r['decoded_ids'] == ids[:at_stop], key
      assert r['decoded'] == text[:text.find(stop)] and stop not in r['decoded']
    else:
      assert r['stop_reason'] == 'max_steps' and r['decoded_ids'] == ids  # EOS (1) no longer ends a row
  assert by_stop >= 1 and by_eos >= 1


def test_bfloat16_decoding_follows_the_float32_model(job):
  """--dtype bfloat16: the same greedy first tokens as float32, log-probabilities within 0.05 nats
  of float32's for them (bfloat16 keeps 8 bits of mantissa), and not bit-identical (it did run in
  bfloat16)."""
  f32 = _decode(job, '--max-decode-steps', '1')
  bf16 = _decode(job, '--max-decode-steps', '1', '--dtype', 'bfloat16')
  assert f32.keys() == bf16.keys() == {(i, 0) for i in range(len(PROMPTS))}
  for key, a in f32.items():
    b = bf16[key]
    assert b['prompt_ids'] == a['prompt_ids'] and b['decoded_ids'] == a['decoded_ids'], key
    assert b['logprob'] == pytest.approx(a['logprob'], abs=0.05)
  assert any(bf16[k]['logprob'] != f32[k]['logprob'] for k in f32)
