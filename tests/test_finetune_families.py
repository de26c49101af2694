"""The fine-tune tutorial's commands for every family (issue 38, item 4): the tiny example of each family
(`python -m paxcli.recipes.finetune DIR --family NAME`), imported and certified against transformers,
fine-tuned on chats by `finetune.TinySft` with the family's own chat template (transformers' rendering of
the same conversation is the reference), exported back, and read by transformers' AutoTokenizer and
apply_chat_template from the export. The same commands, only the family's name changes."""

import json

import pytest

from conftest import pax_main_ok, pax_ok, printed_commands
from paxcli.recipes import finetune

pytestmark = pytest.mark.slow   # an import, a short fine-tune and an export per family: about a minute each

MESSAGES = [{'role': 'user', 'content': 'What colour is the snow?'}, {'role': 'assistant', 'content': 'The snow is white.'}]


def _transformers(directory) -> list:
  """transformers' rendering of MESSAGES by the tokenizer and chat template in `directory`: text, then ids."""
  from transformers import AutoTokenizer
  tok = AutoTokenizer.from_pretrained(str(directory))
  return [tok.apply_chat_template(MESSAGES, tokenize=False),
          list(tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=True)['input_ids'])]


@pytest.mark.parametrize('family', list(finetune.FAMILY_STYLE))
def test_the_same_commands_fine_tune_every_family_on_its_own_chat_template(family, tmp_path, capsys, monkeypatch):
  commands = printed_commands('finetune', tmp_path, '--family', family)
  assert commands[0] == ['pax', 'checkpoint', 'convert', '--from', 'hf', 'ex/hf', f'ex/{family}']
  imported = pax_ok(tmp_path, *commands[0][1:])   # certified against transformers' own class of the family
  said = imported.stdout + imported.stderr
  assert ': ok' in said and f'pax train --exp finetune.Sft --set BASE=ex/{family} ' in said.splitlines()[-1]
  assert (tmp_path / 'ex' / family / 'recipe.py').is_file() and not list((tmp_path / 'ex').glob('*.py'))
  chat = ['--exp', 'finetune.TinySft', '--set', f'BASE=ex/{family}', '--set', 'TRAIN_DATA=ex/chat.jsonl']
  (tmp_path / 'one.jsonl').write_text(json.dumps({'messages': MESSAGES}) + '\n')   # a row that starts with it
  one = [*chat[:-1], 'TRAIN_DATA=one.jsonl', '--set', 'EVAL_DATA=one.jsonl']
  monkeypatch.chdir(tmp_path)   # the check of the input in this process; the tutorial's commands in fresh ones
  shown = json.loads(pax_main_ok(['inspect-input', *one, '--num-batches', '1', '--json'], capsys)[0].splitlines()[0])
  text, ids = _transformers(tmp_path / 'ex' / 'hf')
  first = shown['examples'][0]
  assert first['ids'][:len(ids) - 1] == ids[:-1]   # the first chat's tokens: transformers' (its last is a label)
  assert first['text'].startswith(text[:len(text) // 2])
  pax_ok(tmp_path, 'train', *chat, '--set', 'NUM_TRAIN_STEPS=4', '--set', 'EVAL_INTERVAL_STEPS=0', '--set',
         'SAVE_INTERVAL_STEPS=4', '--job-log-dir', 'ex/sft')
  pax_ok(tmp_path, 'checkpoint', 'convert', 'ex/sft', 'ex/sft_hf', '--to', 'hf', '--no-verify')
  assert _transformers(tmp_path / 'ex' / 'sft_hf') == [text, ids]
  config = json.load(open(tmp_path / 'ex' / 'sft_hf' / 'config.json'))
  assert config['architectures'] == json.load(open(tmp_path / 'ex' / 'hf' / 'config.json'))['architectures']
