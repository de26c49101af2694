"""Preference pairs as a new user writes them (issue 41, parts 1 and 3): plain text and chat messages through
the model's own chat template, weights on the completions only, the truncation knob, and every bad pair (a
missing field, an empty completion, chosen identical to rejected, a prompt longer than the row) stopped in one
line naming its file and line, before anything compiles, or skipped and counted with BAD_PAIRS=skip."""

import json

import numpy as np
import pytest

from paxcli.errors import UserError
from paxcli.inputs.preference import PreferenceInput
from paxcli.recipes import finetune, posttrain

GOOD = {'prompt': 'Q: What colour is the sky?\nA:', 'chosen': ' The sky is blue.', 'rejected': ' The sky is red.'}


@pytest.fixture(scope='module')
def tok(tmp_path_factory):
  """The fine-tuning example's tokenizer (tokenizer.json and its chat template) trained on the colour task."""
  directory = tmp_path_factory.mktemp('preference_tok')
  finetune.write_tokenizer(str(directory), [p['prompt'] + p['chosen'] + p['rejected']
                                            for p in posttrain.example_pairs(200, 0)], 384)
  return str(directory / 'tokenizer.json')


def _input(tok, path, **settings):
  settings = {'seq_len': 48, 'batch_size': 2, 'is_training': True, **settings}
  return PreferenceInput(name='train', data=str(path), tokenizer=tok, num_infeed_hosts=1, infeed_host_index=0,
                         **settings)


def _write(path, rows):
  path.write_text(''.join((r if isinstance(r, str) else json.dumps(r)) + '\n' for r in rows))
  return path


def _trained_text(inp, batch, side, row=0):
  ids = batch[f'{side}_labels'][row][batch[f'{side}_weights'][row] > 0]
  return inp._tok.decode([int(t) for t in ids], specials=True)


def test_plain_pairs_train_on_the_completion_and_eos_only(tok, tmp_path):
  inp = _input(tok, _write(tmp_path / 'prefs.jsonl', [GOOD, GOOD | {'chosen': ' Blue.', 'rejected': ' Red.'}]))
  batch = inp.get_next()
  assert set(batch) == {f'{s}_{k}' for s in ('chosen', 'rejected') for k in ('ids', 'labels', 'weights', 'segment_ids')}
  texts = {_trained_text(inp, batch, side, row) for side in ('chosen', 'rejected') for row in (0, 1)}
  assert texts == {' The sky is blue.<|end_of_text|>', ' The sky is red.<|end_of_text|>', ' Blue.<|end_of_text|>',
                   ' Red.<|end_of_text|>'}
  real = batch['chosen_segment_ids'][0] > 0
  assert np.all(batch['chosen_weights'][0][~real] == 0) and real.sum() < 48   # right-padded, padding weighs 0


def test_chat_pairs_go_through_the_models_template_and_train_on_the_last_reply_only(tok, tmp_path):
  chat = {'prompt': [{'role': 'user', 'content': 'Name a colour.'}, {'role': 'assistant', 'content': 'Green.'},
                     {'role': 'user', 'content': 'What colour is the sky?'}],
          'chosen': [{'role': 'assistant', 'content': 'Blue.'}], 'rejected': 'Red.'}
  inp = _input(tok, _write(tmp_path / 'chat.jsonl', [chat, chat]), seq_len=128)
  batch = inp.get_next()
  # what the template adds for the reply (this one writes no generation prompt: its marker is the reply's); the
  # prompt's assistant turn weighs 0
  assert _trained_text(inp, batch, 'chosen') == '<|assistant|>\nBlue.<|eot_id|>'
  assert _trained_text(inp, batch, 'rejected') == '<|assistant|>\nRed.<|eot_id|>'
  whole = inp._tok.decode([int(t) for t in batch['chosen_ids'][0][batch['chosen_segment_ids'][0] > 0]], specials=True)
  assert whole.startswith('<|begin_of_text|><|user|>\nName a colour.<|assistant|>\nGreen.<|eot_id|><|user|>')


def test_truncation_cuts_the_completion_or_refuses_the_pair(tok, tmp_path):
  long = GOOD | {'chosen': ' The sky is blue' + ' and blue' * 40 + '.'}
  path = _write(tmp_path / 'long.jsonl', [long, GOOD])
  batch = _input(tok, path, is_training=False).get_next()
  assert (batch['chosen_segment_ids'][0] > 0).sum() == 48 and batch['chosen_weights'][0][-1] == 1   # cut to the row
  with pytest.raises(UserError, match=r'long\.jsonl line 1: the chosen side is \d+ tokens, more than a row of 49 '
                                      r'holds \(MAX_SEQ_LEN \+ 1\); TRUNCATION=completion cuts'):
    _input(tok, path, truncation='none')


BAD = [
    ({'prompt': 'Q:', 'chosen': ' A.'}, "line 2: no 'rejected' field; a preference pair has"),
    (GOOD | {'rejected': '  '}, 'line 2: the rejected completion is empty'),
    (GOOD | {'rejected': GOOD['chosen']}, 'line 2: chosen and rejected are identical: the pair prefers nothing'),
    (GOOD | {'prompt': 'Q: what colour is the sky? ' * 30}, 'line 2: the prompt takes \\d+ tokens, leaving no room in '
                                                              'a row of 48 \\(MAX_SEQ_LEN\\)'),
    (GOOD | {'chosen': ['Blue.']}, "line 2: 'chosen' must be a string \\(as \"prompt\" is a string\\)"),
]


@pytest.mark.parametrize('row, message', BAD, ids=['missing', 'empty', 'identical', 'prompt_too_long', 'malformed'])
def test_a_bad_pair_is_one_line_naming_its_file_and_line(tok, tmp_path, row, message):
  path = _write(tmp_path / 'bad.jsonl', [GOOD, row, GOOD])
  with pytest.raises(UserError, match=f'bad\\.jsonl {message}') as e:
    _input(tok, path)
  assert '\n' not in str(e.value) and 'BAD_PAIRS=skip' in str(e.value)


def test_bad_pairs_skip_counts_them_by_reason(tok, tmp_path):
  rows = [GOOD] + [row for row, _ in BAD] + [GOOD | {'rejected': GOOD['chosen']}]
  inp = _input(tok, _write(tmp_path / 'bad.jsonl', rows), bad_pairs='skip')
  assert inp.notes[-1] == ("Input 'train': skipped 6 bad preference pair(s) (BAD_PAIRS=skip): 2 identical, "
                           '1 missing field, 1 empty completion, 1 prompt too long, 1 malformed field.')
  assert inp.notes[-2].startswith("Input 'train': 1 preference pair(s) read and checked (")
  assert inp.get_next()['chosen_weights'].shape == (2, 48)


def test_without_train_data_the_recipe_reads_synthetic_pairs_and_says_so():
  """For plans and benchmarks (`pax bench mfu --exp posttrain.Dpo --compile-only`): pairs of a shared prompt."""
  import fiddle as fdl
  exp = posttrain.TinyDpo()
  train = fdl.build(exp.datasets()[0])
  train.batch_size, train.num_infeed_hosts, train.infeed_host_index = 2, 1, 0
  batch = train.get_next()
  assert 'synthetic preference pairs (no TRAIN_DATA given' in train.notes[0]
  half = exp.MAX_SEQ_LEN // 2
  assert np.array_equal(batch['chosen_ids'][:, :half], batch['rejected_ids'][:, :half])
  assert not np.array_equal(batch['chosen_labels'][:, half:], batch['rejected_labels'][:, half:])
  assert batch['chosen_weights'][:, :half - 1].sum() == 0 and batch['chosen_weights'][:, half:].all()
