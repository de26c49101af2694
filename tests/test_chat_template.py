"""Chat JSONL through a model's own chat template (tokenizer_config.json), rendered in jinja2's sandbox.

The templates are the released ones, as their tokenizer_config.json files hold them
(Meta-Llama-3-8B-Instruct's and TinyLlama-1.1B-Chat-v1.0's, the Zephyr template); the tokenizers
are small ones trained here the same way (a byte-level BPE tokenizer.json with Llama 3's special
tokens; a sentencepiece tokenizer.model with Llama 2's <unk> <s> </s>), and transformers'
apply_chat_template is the reference for the tokens.
"""

import json
import os

import numpy as np
import pytest
import sentencepiece as spm
import tokenizers as hf

from conftest import pax_main
from paxcli.errors import UserError
from paxcli.inputs import chat_template, tokenizers
from paxcli.inputs.file_input import FileLmInput

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' "
    "+ message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
ZEPHYR_TEMPLATE = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
    "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")
LLAMA3_SPECIAL = ['<|begin_of_text|>', '<|end_of_text|>', '<|start_header_id|>', '<|end_header_id|>', '<|eot_id|>']
MESSAGES = [{'role': 'system', 'content': 'Answer in one short sentence.'},
            {'role': 'user', 'content': 'What colour is the sky?'},
            {'role': 'assistant', 'content': ' The sky is blue.\n'},
            {'role': 'user', 'content': 'And snow?'},
            {'role': 'assistant', 'content': 'Snow is white, café 🙂.'}]
TEXTS = [m['content'] for m in MESSAGES] * 20 + ['user assistant system header colour grass green'] * 20


def _config(directory, **fields):
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w', encoding='utf-8') as f:
    json.dump(fields, f)


@pytest.fixture(scope='module')
def llama3(tmp_path_factory):
  """A Llama-3-style tokenizer.json (BOS added by its post-processor) with the Llama 3 Instruct template."""
  directory = str(tmp_path_factory.mktemp('llama3'))
  tok = hf.Tokenizer(hf.models.BPE())
  tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = hf.decoders.ByteLevel()
  tok.train_from_iterator(TEXTS, hf.trainers.BpeTrainer(vocab_size=400, special_tokens=LLAMA3_SPECIAL,
                                                        initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet()))
  tok.post_processor = hf.processors.TemplateProcessing(single='<|begin_of_text|> $A',
                                                        special_tokens=[('<|begin_of_text|>', 0)])
  tok.save(os.path.join(directory, 'tokenizer.json'))
  _config(directory, tokenizer_class='PreTrainedTokenizerFast', bos_token='<|begin_of_text|>',
          eos_token='<|eot_id|>', chat_template=LLAMA3_TEMPLATE)
  return directory


@pytest.fixture(scope='module')
def zephyr(tmp_path_factory):
  """A TinyLlama-style sentencepiece tokenizer.model (<unk> 0, <s> 1, </s> 2) with the Zephyr template."""
  directory = str(tmp_path_factory.mktemp('zephyr'))
  spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS), model_prefix=os.path.join(directory, 'tokenizer'),
                                 vocab_size=400, model_type='bpe', byte_fallback=True, unk_id=0, bos_id=1,
                                 eos_id=2, pad_id=-1, minloglevel=2, num_threads=1,
                                 normalization_rule_name='identity', remove_extra_whitespaces=False)  # as Llama's
  _config(directory, tokenizer_class='LlamaTokenizer', bos_token='<s>', eos_token='</s>', unk_token='<unk>',
          add_bos_token=True, chat_template=ZEPHYR_TEMPLATE)
  return directory


def _trained_runs(tok, example) -> list[str]:
  """The text of each run of consecutive weight-1 labels, special tokens written out."""
  runs, run = [], []
  for label, weight in zip(example.labels.tolist() + [None], example.weights.tolist() + [0.0]):
    if weight:
      run.append(label)
    elif run:
      runs.append(tok.decode(run, specials=True))
      run = []
  return runs


def _example(directory, name, messages=MESSAGES):
  tok = tokenizers.load(os.path.join(directory, name))
  return tok, chat_template.of_tokenizer(tok).example(messages, tok, 'chat.jsonl line 1')


def test_llama3_template_gives_transformers_tokens_and_trains_only_the_assistant_turns(llama3):
  tok, example = _example(llama3, 'tokenizer.json')
  tokens = [int(example.ids[0])] + example.labels.tolist()
  transformers = pytest.importorskip('transformers')
  theirs = transformers.AutoTokenizer.from_pretrained(llama3).apply_chat_template(MESSAGES, tokenize=True,
                                                                                  return_dict=True)
  assert tokens == list(theirs['input_ids'])
  assert tokens.count(tok.bos_id) == 1 and tokens[0] == tok.bos_id   # the template's BOS, none added
  # the contents as the template writes them (trimmed), each with its end-of-turn token
  assert _trained_runs(tok, example) == ['The sky is blue.<|eot_id|>', 'Snow is white, café 🙂.<|eot_id|>']


def test_zephyr_template_on_a_sentencepiece_tokenizer_trains_content_and_eos(zephyr):
  tok, example = _example(zephyr, 'tokenizer.model')
  # </s> written by the template is the EOS token, not the characters '<', '/', 's', '>'
  assert int(np.sum(example.labels == tok.eos_id)) == 5
  # each reply and its </s> weigh 1; the newline after </s>, the <|assistant|> line and the rest weigh 0
  # (the untrimmed content, whose leading space sentencepiece's decode drops)
  assert _trained_runs(tok, example) == ['The sky is blue.\n</s>', 'Snow is white, café 🙂.</s>']
  tokens = [int(example.ids[0])] + example.labels.tolist()
  assert tok.decode(tokens, specials=True) == ('<|system|>\nAnswer in one short sentence.</s>\n<|user|>\nWhat colour '
                                               'is the sky?</s>\n<|assistant|>\n The sky is blue.\n</s>\n<|user|>\n'
                                               'And snow?</s>\n<|assistant|>\nSnow is white, café 🙂.</s>\n')


def test_file_input_reads_chat_jsonl_through_the_shipped_template(llama3, tmp_path):
  data = tmp_path / 'chat.jsonl'
  data.write_text(json.dumps({'messages': MESSAGES}) + '\n' + json.dumps({'prompt': 'Q: sky?', 'completion': ' blue'})
                  + '\n')
  inp = FileLmInput(name='train', data=str(data), tokenizer=os.path.join(llama3, 'tokenizer.json'), seq_len=128,
                    batch_size=1, num_infeed_hosts=1, infeed_host_index=0)
  batch = inp.get_next()
  tok, example = _example(llama3, 'tokenizer.json')
  n = len(example)
  assert batch['labels'][0][:n].tolist() == example.labels.tolist()
  assert batch['weights'][0][:n].tolist() == example.weights.tolist()
  # a prompt/completion record still gets BOS + EOS around it (paxcli.inputs.sft), in the next segment
  second = batch['labels'][0][batch['segment_ids'][0] == 2]
  assert tok.decode(second, specials=True) == 'Q: sky? blue<|eot_id|>'
  # what inspect-input shows: the rendered text, its special tokens written out
  shown = inp.ids_to_strings(batch['labels'][:1], [n])[0]
  assert shown == tok.decode(example.labels, specials=True)
  assert shown.startswith('<|start_header_id|>system<|end_header_id|>\n\nAnswer in one short sentence.<|eot_id|>')


def test_no_shipped_template_keeps_paxclis_own(llama3, tmp_path):
  directory = tmp_path / 'plain'
  directory.mkdir()
  (directory / 'tokenizer.json').write_bytes(open(os.path.join(llama3, 'tokenizer.json'), 'rb').read())
  assert chat_template.of_tokenizer(tokenizers.load(str(directory / 'tokenizer.json'))) is None


@pytest.mark.parametrize('template, expected', [
    ("{{ messages.__class__.__mro__ }}", r'chat\.jsonl line 1: the chat_template of .*tokenizer_config\.json fails.*'
                                         r'SecurityError'),
    ("{{ messages.append(1) }}", r'fails.*SecurityError'),
    ("{% set ns = namespace(_x=1) %}", r'SecurityError'),
    ("{{ raise_exception('Conversation roles must alternate') }}", r'Conversation roles must alternate'),
    ("{% for m in messages %}\n{{ m['content'] }\n", r'tokenizer_config\.json: its chat_template does not compile '
                                                       r'\(line 2'),
    ("{% for m in messages %}{{ m['content'] }}{% if loop.last %}{{ 'LAST' }}{% endif %}{% endfor %}",
     r'renders messages\[2\].*differently'),
])
def test_a_bad_or_hostile_template_is_one_line_naming_the_file(tmp_path, template, expected):
  directory = tmp_path / 'tok'
  directory.mkdir()
  hf.Tokenizer(hf.models.WordLevel({'</s>': 0, '<unk>': 1}, unk_token='<unk>')).save(str(directory / 'tokenizer.json'))
  _config(str(directory), eos_token='</s>', chat_template=template)
  with pytest.raises(UserError, match=expected) as e:
    _example(str(directory), 'tokenizer.json', MESSAGES[:3])
  assert '\n' not in str(e.value)


def test_inspect_input_shows_the_rendered_chat_and_a_bad_template_is_one_line(llama3, tmp_path, capsys):
  data = tmp_path / 'chat.jsonl'
  data.write_text(''.join(json.dumps({'messages': MESSAGES}) + '\n' for _ in range(3)))
  args = ['inspect-input', '--set', f'TRAIN_DATA={str(data)!r}', '--set', 'VOCAB_SIZE=352', '--set', 'MAX_SEQ_LEN=64',
          '--set', 'PERCORE_BATCH_SIZE=1', '--set', 'ICI_MESH_SHAPE=[1,1,1]', '--num-batches', '1', '--json']
  code, out, err = pax_main([*args, '--set', f'TOKENIZER={os.path.join(llama3, "tokenizer.json")!r}'], capsys)
  assert code == 0, err
  text = json.loads(out.splitlines()[0])['examples'][0]['text']
  assert '<|start_header_id|>user<|end_header_id|>\n\nWhat colour is the sky?<|eot_id|>' in text
  bad = tmp_path / 'bad'
  bad.mkdir()
  (bad / 'tokenizer.json').write_bytes(open(os.path.join(llama3, 'tokenizer.json'), 'rb').read())
  _config(str(bad), eos_token='<|eot_id|>', chat_template="{{ ''.__class__.__subclasses__() }}")
  code, out, err = pax_main([*args, '--set', f'TOKENIZER={str(bad / "tokenizer.json")!r}'], capsys)
  assert code == 2 and 'Traceback' not in err and len(err.strip().splitlines()) == 1, err
  assert 'chat.jsonl line 1' in err and str(bad / 'tokenizer_config.json') in err


def test_data_prepare_writes_a_chat_through_the_shipped_template(llama3, tmp_path):
  """`pax data prepare` with a tokenizer that ships a template: the chat's record gives the pairs the
  file input trains on (template tokens, only the assistant turns weighted), with 2 workers too."""
  from array_record.python.array_record_module import ArrayRecordReader
  from paxcli import api
  from paxcli.inputs import prepared
  data = tmp_path / 'chat.jsonl'
  data.write_text(json.dumps({'messages': MESSAGES}) + '\n' + json.dumps({'prompt': 'Q: sky?', 'completion': ' blue'})
                  + '\n')
  tok, expected = _example(llama3, 'tokenizer.json')
  for workers in (1, 2):
    out = tmp_path / f'prepared{workers}'
    api.data_prepare([str(data)], str(out), tokenizer=os.path.join(llama3, 'tokenizer.json'), eval_split=False,
                     workers=workers)
    manifest = prepared.read_manifest(str(out))
    reader = ArrayRecordReader(str(out / manifest.shards['train'][0].name))
    chat, plain = [prepared.example(r) for r in reader.read(list(range(reader.num_records())))]
    reader.close()
    for field in ('ids', 'labels', 'weights'):
      np.testing.assert_array_equal(getattr(chat, field), getattr(expected, field))
    assert tok.decode(plain.labels, specials=True) == 'Q: sky? blue<|eot_id|>'
