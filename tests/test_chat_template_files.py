"""Chat templates where transformers 5 reads them (issue 38, item 1): a tokenizer saved by transformers'
own save_pretrained (chat_template.jinja, additional_chat_templates/NAME.jinja), read by the file input,
kept by `--from hf` in the job, written back by `--to hf` and `--to peft`; a chat on a tokenizer without
a template is one line unless CHAT_TEMPLATE names paxcli's format. transformers' apply_chat_template on
the directories is the reference for the tokens."""

import json
import os
import shutil

import pytest
import tokenizers as hf

from conftest import pax_main
from paxcli.errors import UserError
from paxcli.inputs import chat_template, tokenizers
from paxcli.inputs.file_input import FileLmInput

transformers = pytest.importorskip('transformers')

# Qwen2-0.5B-Instruct's chat template (ChatML), as its tokenizer_config.json ships it.
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
          "You are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
# A second, named template (transformers' `tool_use` name), rendered differently so that a mix-up shows.
TOOL_USE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + ' [tools]\n' + message['content'] + "
            "'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant [tools]\n' }}{% endif %}")
SPECIAL = ['<|endoftext|>', '<|im_start|>', '<|im_end|>']
MESSAGES = [{'role': 'user', 'content': 'What colour is the sky?'},
            {'role': 'assistant', 'content': 'The sky is blue.'},
            {'role': 'user', 'content': 'And snow?'},
            {'role': 'assistant', 'content': 'Snow is white.'}]
TEXTS = [m['content'] for m in MESSAGES] * 20 + ['system user assistant tools helpful colour'] * 20


def save_tokenizer(directory, templates) -> str:
  """A byte-level BPE tokenizer with Qwen's special tokens, saved by transformers' save_pretrained with
  `templates` (a string, or {name: template}) as its chat_template: transformers writes the files."""
  tok = hf.Tokenizer(hf.models.BPE())
  tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = hf.decoders.ByteLevel()
  tok.train_from_iterator(TEXTS, hf.trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
                                                        initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet()))
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token='<|im_end|>', pad_token='<|endoftext|>')
  fast.chat_template = templates
  fast.save_pretrained(str(directory))
  return str(directory)


def theirs(directory, messages=MESSAGES, **kwargs) -> list[int]:
  """transformers' ids of the conversation from the tokenizer files in `directory`."""
  tok = transformers.AutoTokenizer.from_pretrained(str(directory))
  return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)['input_ids'])


def ours(directory, name='') -> list[int]:
  tok = tokenizers.load(os.path.join(str(directory), 'tokenizer.json'))
  example = chat_template.of_tokenizer(tok, name).example(MESSAGES, tok, 'chat.jsonl line 1')
  return [int(example.ids[0])] + example.labels.tolist()


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """Two tokenizers transformers saved: one template (chat_template.jinja) and two named ones."""
  one = save_tokenizer(tmp_path_factory.mktemp('one'), CHATML)
  two = save_tokenizer(tmp_path_factory.mktemp('two'), {'default': CHATML, 'tool_use': TOOL_USE})
  return one, two


def test_transformers_writes_the_template_files_and_paxcli_reads_them_as_transformers_does(saved):
  one, two = saved
  assert os.path.isfile(os.path.join(one, 'chat_template.jinja'))
  assert 'chat_template' not in json.load(open(os.path.join(one, 'tokenizer_config.json')))
  assert os.path.isfile(os.path.join(two, 'additional_chat_templates', 'tool_use.jinja'))
  assert ours(one) == theirs(one)
  assert ours(two) == theirs(two)
  assert ours(two, 'tool_use') == theirs(two, chat_template='tool_use')
  assert ours(two, 'tool_use') != ours(two)


def test_a_template_file_wins_over_the_configs_as_in_transformers(saved, tmp_path):
  one, _ = saved
  for name in ('tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja'):
    (tmp_path / name).write_bytes(open(os.path.join(one, name), 'rb').read())
  config = json.load(open(tmp_path / 'tokenizer_config.json'))
  config['chat_template'] = TOOL_USE   # an older copy in the config: transformers reads the .jinja file
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps(config))
  assert ours(tmp_path) == theirs(tmp_path) == theirs(one)


def test_a_named_template_it_does_not_ship_and_a_link_out_are_one_line(saved, tmp_path):
  _, two = saved
  tok = tokenizers.load(os.path.join(two, 'tokenizer.json'))
  with pytest.raises(UserError, match=r"CHAT_TEMPLATE='tool_us'.*default, tool_use.*Did you mean 'tool_use'"):
    chat_template.of_tokenizer(tok, 'tool_us')
  (tmp_path / 'tokenizer.json').write_bytes(open(os.path.join(two, 'tokenizer.json'), 'rb').read())
  os.symlink('/etc/passwd', tmp_path / 'chat_template.jinja')
  with pytest.raises(UserError, match='outside the directory'):
    tokenizers.chat_templates(str(tmp_path / 'tokenizer.json'))


def test_a_named_template_whose_name_climbs_out_is_refused_before_it_names_a_file(saved, tmp_path):
  one, _ = saved
  (tmp_path / 'tokenizer.json').write_bytes(open(os.path.join(one, 'tokenizer.json'), 'rb').read())
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps(
      {'chat_template': [{'name': 'default', 'template': CHATML}, {'name': '../../evil', 'template': '{{ 1 }}'}]}))
  with pytest.raises(UserError, match=r"'\.\./\.\./evil' is no chat template name"):
    tokenizers.chat_templates(str(tmp_path / 'tokenizer.json'))


def _chat_file(tmp_path):
  data = tmp_path / 'chat.jsonl'
  data.write_text(''.join(json.dumps({'messages': MESSAGES}) + '\n' for _ in range(4)))
  return str(data)


def test_a_chat_without_a_template_is_one_line_unless_chat_template_names_paxclis(saved, tmp_path, capsys):
  one, _ = saved
  bare = tmp_path / 'bare'
  bare.mkdir()
  (bare / 'tokenizer.json').write_bytes(open(os.path.join(one, 'tokenizer.json'), 'rb').read())
  args = ['inspect-input', '--set', f'TRAIN_DATA={_chat_file(tmp_path)!r}', '--set', 'VOCAB_SIZE=352',
          '--set', 'MAX_SEQ_LEN=64', '--set', 'PERCORE_BATCH_SIZE=1', '--set', 'ICI_MESH_SHAPE=[1,1,1]',
          '--set', f'TOKENIZER={str(bare / "tokenizer.json")!r}', '--num-batches', '1', '--json']
  code, out, err = pax_main(args, capsys)
  assert code == 2 and 'Traceback' not in err and len(err.strip().splitlines()) == 1, err
  assert 'chat.jsonl line 1: a chat record, but the tokenizer' in err and 'CHAT_TEMPLATE=paxcli' in err
  code, out, err = pax_main([*args, '--set', "CHAT_TEMPLATE='paxcli'"], capsys)
  assert code == 0, err
  assert json.loads(out.splitlines()[0])['examples'][0]['text'].startswith('<|user|>\nWhat colour is the sky?\n')
  # the template the tokenizer ships, by name, through the knob
  named = [a.replace(str(bare), one) for a in args]
  code, out, err = pax_main([*named, '--set', "CHAT_TEMPLATE='default'"], capsys)
  assert code == 0, err
  assert '<|im_start|>user\nWhat colour is the sky?<|im_end|>' in json.loads(out.splitlines()[0])['examples'][0]['text']


def test_a_tokenizer_trained_on_the_data_reads_chats_in_paxclis_format(tmp_path):
  inp = FileLmInput(name='train', data=_chat_file(tmp_path), seq_len=64, vocab_size=400, batch_size=1,
                    num_infeed_hosts=1, infeed_host_index=0)
  assert inp.ids_to_strings(inp.get_next()['ids'][:1])[0].startswith('<|user|> What colour is the sky? <|assistant|>')


def test_data_prepare_refuses_a_chat_without_a_template_in_one_line(saved, tmp_path, capsys):
  one, _ = saved
  bare = tmp_path / 'bare'
  bare.mkdir()
  (bare / 'tokenizer.json').write_bytes(open(os.path.join(one, 'tokenizer.json'), 'rb').read())
  code, _, err = pax_main(['data', 'prepare', _chat_file(tmp_path), str(tmp_path / 'out'), '--tokenizer',
                           str(bare / 'tokenizer.json'), '--no-eval-split', '--workers', '1'], capsys)
  assert code == 2 and len(err.strip().splitlines()) == 1 and '--chat-template paxcli' in err, err
  code, _, err = pax_main(['data', 'prepare', _chat_file(tmp_path), str(tmp_path / 'out2'), '--tokenizer',
                           os.path.join(one, 'tokenizer.json'), '--no-eval-split', '--workers', '1'], capsys)
  assert code == 0, err
  config = json.load(open(tmp_path / 'out2' / 'tokenizer' / 'tokenizer_config.json'))
  assert config['chat_template'] == CHATML   # chat_template.jinja, kept in the copy's config


@pytest.fixture(scope='module')
def qwen(tmp_path_factory, saved):
  """A tiny Qwen2 built and saved by transformers, with the two-template tokenizer beside it, imported."""
  import hf_models
  _, two = saved
  directory = tmp_path_factory.mktemp('qwen')
  hf_models.save(hf_models.build(dict(hf_models.REFERENCES['qwen2'].config, vocab_size=400)), str(directory / 'hf'))
  for name in ('tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja'):
    shutil.copy(os.path.join(two, name), directory / 'hf')
  shutil.copytree(os.path.join(two, 'additional_chat_templates'), directory / 'hf' / 'additional_chat_templates')
  return directory


def test_from_hf_keeps_every_template_in_the_job_and_to_hf_writes_them_back(qwen, capsys):
  code, _, err = pax_main(['checkpoint', 'convert', '--from', 'hf', str(qwen / 'hf'), str(qwen / 'job'),
                           '--no-verify'], capsys)
  assert code == 0, err
  kept = tokenizers.chat_templates(str(qwen / 'job' / 'tokenizer' / 'tokenizer.json'))
  assert {k: v.text for k, v in kept.items()} == {'default': CHATML, 'tool_use': TOOL_USE}
  code, _, err = pax_main(['checkpoint', 'convert', str(qwen / 'job'), str(qwen / 'out'), '--to', 'hf',
                           '--no-verify'], capsys)
  assert code == 0, err
  assert open(qwen / 'out' / 'chat_template.jinja').read() == CHATML
  assert theirs(qwen / 'out') == theirs(qwen / 'hf')
  assert theirs(qwen / 'out', chat_template='tool_use') == theirs(qwen / 'hf', chat_template='tool_use')


@pytest.mark.slow
def test_a_chat_fine_tune_of_the_import_trains_chatml_and_its_peft_adapter_carries_the_template(qwen, tmp_path):
  """The issue's path: a Qwen2 chat SFT from the import renders ChatML (not paxcli's <|user|>), and the
  LoRA run's adapter directory (PEFT's) and its --to hf export give transformers the model's templates."""
  from conftest import run_pax
  job = str(qwen / 'job')
  if not os.path.isdir(job):
    assert run_pax('checkpoint', 'convert', '--from', 'hf', str(qwen / 'hf'), job, '--no-verify').returncode == 0
  data = _chat_file(tmp_path)
  common = ['--exp', 'finetune.TinyLlamaSft', '--set', f'BASE={job}', '--set', f'TRAIN_DATA={data}']
  shown = run_pax('inspect-input', *common, '--num-batches', '1', '--json')
  assert shown.returncode == 0, shown.stderr[-2000:]
  text = json.loads(shown.stdout.splitlines()[0])['examples'][0]['text']
  rendered = transformers.AutoTokenizer.from_pretrained(str(qwen / 'hf')).apply_chat_template(MESSAGES, tokenize=False)
  assert rendered.startswith('<|im_start|>system\n') and rendered.startswith(text) and len(text) > len(rendered) - 3
  trained = run_pax('train', *common, '--set', 'LORA_RANK=2', '--set', 'NUM_TRAIN_STEPS=2', '--set',
                    'EVAL_INTERVAL_STEPS=0', '--job-log-dir', str(tmp_path / 'lora'))
  assert trained.returncode == 0, trained.stderr[-2000:]
  for target, out in (('peft', 'adapter'), ('hf', 'merged')):
    done = run_pax('checkpoint', 'convert', str(tmp_path / 'lora'), str(tmp_path / out), '--to', target,
                   '--no-verify', *(['--base-model', str(qwen / 'hf')] if target == 'peft' else []))
    assert done.returncode == 0, done.stderr[-2000:]
    assert theirs(tmp_path / out) == theirs(qwen / 'hf')
    assert theirs(tmp_path / out, chat_template='tool_use') == theirs(qwen / 'hf', chat_template='tool_use')
