"""The Qwen families beyond what tests/test_hf_families.py holds for every family: the recipes at released
sizes count the released parameters (transformers' own count of the released config.json), config.json
settings paxcli cannot express are refused by name, and Qwen's tokenizer as shipped (byte-level BPE that
adds no BOS, ChatML chat template) stays with the job and gives transformers' ids."""

import json
import os

import pytest

import hf_models
from conftest import pax_main

pytest.importorskip('transformers')

# huggingface.co/Qwen/Qwen2.5-7B/config.json and /Qwen/Qwen3-8B/config.json
QWEN25_7B = dict(hf_models.QWEN25_05B, hidden_size=3584, intermediate_size=18944, max_position_embeddings=131072,
                 max_window_layers=28, num_attention_heads=28, num_hidden_layers=28, num_key_value_heads=4,
                 sliding_window=131072, tie_word_embeddings=False, vocab_size=152064)
QWEN3_8B = dict(hf_models.QWEN3_06B, hidden_size=4096, intermediate_size=12288, max_window_layers=36,
                num_attention_heads=32, num_hidden_layers=36, num_key_value_heads=8, tie_word_embeddings=False)


def _ok(argv, capsys):
  code, out, err = pax_main(argv, capsys)
  assert code == 0, err
  return out


def _refused(argv, capsys):
  code, out, err = pax_main(argv, capsys)
  assert code == 2 and 'Traceback' not in err and len(err.strip().splitlines()) == 1, err
  return ' '.join(err.split())


@pytest.mark.parametrize('exp, released, count', [
    ('qwen.Qwen25_05B', hf_models.QWEN25_05B, 494_032_768),
    ('qwen.Qwen25_7B', QWEN25_7B, 7_615_616_512),
    ('qwen.Qwen3_8B', QWEN3_8B, 8_190_735_360),
])
def test_the_released_size_recipes_count_the_released_parameters(exp, released, count, capsys):
  described = json.loads(_ok(['describe', '--exp', exp, '--json'], capsys))
  assert described['summary.parameters'] == hf_models.parameter_count(released) == count
  assert described['summary.family'] == released['model_type']


@pytest.mark.parametrize('family, changes, named, unnamed', [
    ('qwen2', {'use_sliding_window': True, 'attn_logit_softcapping': 50.0, 'use_cache': False},
     ['use_sliding_window true with sliding_window', 'attn_logit_softcapping (unknown to paxcli'],
     ['use_cache']),
    ('qwen2', {'layer_types': ['full_attention', 'sliding_attention']},
     ['layer_types ["full_attention", "sliding_attention"]'], []),
    ('qwen3', {'attention_bias': True, 'use_mrope': True, 'hidden_act': 'gelu'},
     ['attention_bias true (paxcli\'s Qwen3: false)', 'use_mrope true', 'hidden_act "gelu"'], ['rope_theta']),
])
def test_a_qwen_config_paxcli_cannot_express_is_refused_by_name(hf_reference, tmp_path, capsys, family, changes,
                                                                 named, unnamed):
  source = hf_models.with_config(hf_reference(family), tmp_path / 'hf', **changes)
  err = _refused(['checkpoint', 'convert', '--from', 'hf', source, str(tmp_path / 'job')], capsys)
  assert f'this {family.capitalize()} config cannot be expressed in paxcli' in err
  for name in named:
    assert name in err, (name, err)
  for name in unnamed:
    assert name not in err, (name, err)
  assert sorted(os.listdir(tmp_path)) == ['hf']   # nothing written


# Qwen2-7B-Instruct's chat template (ChatML with a default system turn), as its tokenizer_config.json ships it.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL = ('<|endoftext|>', '<|im_start|>', '<|im_end|>')
MESSAGES = [{'role': 'user', 'content': 'What colour is the sky?'}, {'role': 'assistant', 'content': 'Blue, café 🙂.'}]
TEXTS = ['Q: What colour is the sky?\nA: The sky is blue.', 'naïve café 東京 🙂 <|im_end|> tabs\tand  spaces', '']


def write_qwen_tokenizer(directory: str, vocab_size: int) -> None:
  """A Qwen-style tokenizer.json (byte-level BPE, nothing added around a text: no BOS) and Qwen's
  tokenizer_config.json beside it (bos_token null, <|endoftext|> ends a text and pads, the chat template)."""
  import tokenizers as hf
  tok = hf.Tokenizer(hf.models.BPE())
  tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = hf.decoders.ByteLevel()
  texts = [t * 3 for t in TEXTS] + [m['content'] for m in MESSAGES] * 5
  tok.train_from_iterator(texts, hf.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL),
                                                        initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet()))
  tok.save(os.path.join(directory, 'tokenizer.json'))
  config = {'add_prefix_space': False, 'bos_token': None, 'chat_template': QWEN_CHAT_TEMPLATE,
            'clean_up_tokenization_spaces': False, 'eos_token': '<|endoftext|>', 'errors': 'replace',
            'model_max_length': 32768, 'pad_token': '<|endoftext|>', 'split_special_tokens': False,
            'tokenizer_class': 'Qwen2Tokenizer', 'unk_token': None}
  json.dump(config, open(os.path.join(directory, 'tokenizer_config.json'), 'w'))


def test_qwens_tokenizer_and_chat_template_stay_with_the_job_and_give_transformers_ids(tmp_path, capsys):
  import transformers

  from paxcli.inputs import chat_template, tokenizers
  from paxcli.jobdir import layout
  hf_dir = str(tmp_path / 'hf')
  hf_models.save(hf_models.build(dict(hf_models.QWEN25_05B, **dict(hf_models.TINY, vocab_size=320))), hf_dir)
  write_qwen_tokenizer(hf_dir, 300)
  job, back = str(tmp_path / 'job'), str(tmp_path / 'back')
  _ok(['checkpoint', 'convert', '--from', 'hf', hf_dir, job, '--recipe', str(tmp_path / 'r.py'), '--no-verify'],
      capsys)
  assert open(layout.tokenizer(job), 'rb').read() == open(os.path.join(hf_dir, 'tokenizer.json'), 'rb').read()
  assert json.load(open(layout.tokenizer_config(job)))['chat_template'] == QWEN_CHAT_TEMPLATE
  ours = tokenizers.load(layout.tokenizer(job))
  theirs = transformers.AutoTokenizer.from_pretrained(hf_dir)
  assert (ours.bos_id, ours.bos_first, ours.eos_id) == (None, False, theirs.convert_tokens_to_ids('<|endoftext|>'))
  for text in TEXTS:
    assert ours.encode(text) == theirs(text)['input_ids']   # Qwen adds no BOS, and neither does paxcli
  example = chat_template.of_tokenizer(ours).example(MESSAGES, ours, 'chat.jsonl line 1')
  rendered = theirs.apply_chat_template(MESSAGES, tokenize=True, return_dict=True)['input_ids']
  assert [int(example.ids[0])] + example.labels.tolist() == list(rendered)
  # and out again: the export carries tokenizer.json and the chat template for transformers
  _ok(['checkpoint', 'convert', job, back, '--to', 'hf', '--no-verify'], capsys)
  again = transformers.AutoTokenizer.from_pretrained(back)
  assert again.chat_template == QWEN_CHAT_TEMPLATE
  assert again.apply_chat_template(MESSAGES, tokenize=True, return_dict=True)['input_ids'] == rendered
