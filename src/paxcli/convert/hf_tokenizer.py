"""The tokenizer files of a Hugging Face export, written from the run's sentencepiece model.

`AutoTokenizer.from_pretrained(out)` must give the ids paxcli gives. Converting the
sentencepiece model is what transformers does when it finds only `tokenizer.model`, but its
converters are Llama's (no NFKC, no whitespace clean-up, a `<s>` prepended), so the same text
becomes other ids ("Create a new": 3 ids in paxcli, 6 in transformers). Written here instead:
  tokenizer.json           the same model for the `tokenizers` library (Unigram models, as
                           paxcli trains them): pieces and scores with byte fallback;
                           sentencepiece's own normalization (its precompiled NFKC map,
                           whitespace stripped and collapsed); `▁` for spaces and the dummy
                           prefix; nothing added around the text
  tokenizer_config.json    PreTrainedTokenizerFast (LlamaTokenizer for a BPE model, which
                           transformers converts itself), the special tokens of the model, no
                           BOS/EOS added (paxcli adds none)
  special_tokens_map.json  the same special tokens
  tokenizer.model          copied as it is, for sentencepiece readers
Special ids (also in config.json and generation_config.json) come from the model: paxcli's
corpus tokenizer has pad 0, eos 1, unk 2 and no bos.

A run trained with a Hugging Face tokenizer.json (the TOKENIZER knob) exports that file as it
is, beside a tokenizer_config.json and special_tokens_map.json naming its special tokens.
Either kind takes along the chat templates its tokenizer was shipped with, where transformers 5's
save_pretrained puts them (chat_template.jinja, additional_chat_templates/NAME.jinja).
"""

from __future__ import annotations

import base64
import json
import os
from typing import Optional

from paxcli import files
from paxcli.errors import UserError
from paxcli.files import member
from paxcli.inputs import tokenizers

# sentencepiece ModelProto.SentencePiece.Type
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_UNIGRAM = 1
SPACE = '\u2581'
NEVER = -1e9   # the score of pieces segmentation never yields
# The file name a tokenizer of each kind (paxcli.inputs.tokenizers.kind_of) has in an export.
EXPORT_NAMES = {'sentencepiece': 'tokenizer.model', 'hf': 'tokenizer.json'}


def find_in(directory: str) -> dict:
  """{'tokenizer': path} of a directory's tokenizer.model, else its tokenizer.json; {} if neither."""
  for name in EXPORT_NAMES.values():
    path = member(directory, name, 'tokenizer')
    if os.path.isfile(path):
      return {'tokenizer': path}
  return {}


def load_proto(path: str):
  from sentencepiece import sentencepiece_model_pb2
  proto = sentencepiece_model_pb2.ModelProto()
  try:
    with open(path, 'rb') as f:
      proto.ParseFromString(f.read())
  except Exception as e:   # noqa: BLE001 - protobuf's DecodeError and friends
    raise UserError(f'{path} is not a sentencepiece model ({type(e).__name__}).') from None
  return proto


def special_ids(proto) -> dict[str, Optional[int]]:
  """{'bos', 'eos', 'unk', 'pad'} -> id or None, as the model's trainer spec sets them."""
  spec = proto.trainer_spec
  n = len(proto.pieces)
  ids = {'bos': spec.bos_id, 'eos': spec.eos_id, 'unk': spec.unk_id, 'pad': spec.pad_id}
  return {k: (v if 0 <= v < n else None) for k, v in ids.items()}


def token_ids(path: Optional[str]) -> dict:
  """config.json's bos/eos/pad token ids for the tokenizer at `path` (None: the model has none)."""
  if not path:
    return {'bos_token_id': None, 'eos_token_id': None, 'pad_token_id': None}
  if tokenizers.kind_of(path) == 'hf':
    tok = tokenizers.HfTokenizer(path)
    return {'bos_token_id': tok.bos_id, 'eos_token_id': tok.eos_id, 'pad_token_id': tok.pad_id}
  ids = special_ids(load_proto(path))
  return {'bos_token_id': ids['bos'], 'eos_token_id': ids['eos'], 'pad_token_id': ids['pad']}


def tokenizer_json(proto) -> dict:
  """The `tokenizers` library's form of a sentencepiece model (tokenizer.json)."""
  spec, norm = proto.trainer_spec, proto.normalizer_spec
  if spec.model_type != _UNIGRAM:
    raise UserError(f'The tokenizer is a sentencepiece model of type {spec.model_type} (BPE, word or char); '
                    'the Hugging Face export writes the tokenizer files of Unigram models only.')
  added = [{'id': i, 'content': p.piece, 'single_word': False, 'lstrip': False, 'rstrip': False,
            'normalized': False, 'special': p.type != _USER_DEFINED}
           for i, p in enumerate(proto.pieces) if p.type in (_UNKNOWN, _CONTROL, _USER_DEFINED)]
  # sentencepiece never matches text against control, unknown, unused or byte pieces (`</s>` or
  # `<0x41>` typed in a prompt is text); the Unigram of `tokenizers` matches every piece, so these
  # get a score no segmentation picks. Byte fallback still finds the byte pieces by name.
  never = {_UNKNOWN, _CONTROL, _UNUSED, _BYTE}
  model = {'type': 'Unigram', 'unk_id': special_ids(proto)['unk'], 'byte_fallback': bool(spec.byte_fallback),
           'vocab': [[p.piece, NEVER if p.type in never else float(p.score)] for p in proto.pieces]}
  steps = []
  if norm.precompiled_charsmap:
    steps.append({'type': 'Precompiled', 'precompiled_charsmap':
                  base64.b64encode(norm.precompiled_charsmap).decode('ascii')})
  if norm.remove_extra_whitespaces:
    steps += [{'type': 'Strip', 'strip_left': True, 'strip_right': True},
              {'type': 'Replace', 'pattern': {'Regex': ' {2,}'}, 'content': ' '}]
  prepend = 'always' if norm.add_dummy_prefix else 'never'
  decoders = [{'type': 'Replace', 'pattern': {'String': SPACE}, 'content': ' '}, {'type': 'ByteFallback'},
              {'type': 'Fuse'}]
  if norm.add_dummy_prefix:
    decoders.append({'type': 'Strip', 'content': ' ', 'start': 1, 'stop': 0})
  return {
      'version': '1.0', 'truncation': None, 'padding': None, 'added_tokens': added,
      'normalizer': {'type': 'Sequence', 'normalizers': steps} if steps else None,
      'pre_tokenizer': {'type': 'Metaspace', 'replacement': SPACE, 'prepend_scheme': prepend,
                        'split': bool(spec.split_by_whitespace)},
      'post_processor': None,
      'decoder': {'type': 'Sequence', 'decoders': decoders},
      'model': model,
  }


def tokenizer_config(proto, max_len: int) -> tuple[dict, dict]:
  """(tokenizer_config.json, special_tokens_map.json) naming the model's special tokens.

  A Unigram model is read from tokenizer.json (PreTrainedTokenizerFast); any other (Llama's own
  BPE models) by transformers' Llama converter from tokenizer.model (LlamaTokenizer)."""
  ids = special_ids(proto)
  tokens = {f'{k}_token': (proto.pieces[v].piece if v is not None else None) for k, v in ids.items()}
  cls = 'PreTrainedTokenizerFast' if proto.trainer_spec.model_type == _UNIGRAM else 'LlamaTokenizer'
  config = {'tokenizer_class': cls, **tokens, 'add_bos_token': False,
            'add_eos_token': False, 'clean_up_tokenization_spaces': False, 'model_max_length': max_len,
            'legacy': False, 'split_special_tokens': True}
  return config, {k: v for k, v in tokens.items() if v is not None}


def hf_tokenizer_config(path: str, max_len: int) -> tuple[dict, dict]:
  """tokenizer_config.json and special_tokens_map.json of a tokenizer.json (exported as it is)."""
  tokens = tokenizers.HfTokenizer(path).special_tokens()
  config = {'tokenizer_class': 'PreTrainedTokenizerFast', **tokens, 'add_bos_token': False,
            'add_eos_token': False, 'clean_up_tokenization_spaces': False, 'model_max_length': max_len}
  return config, {k: v for k, v in tokens.items() if v is not None}


def write_templates(directory: str, path: str) -> list[str]:
  """The chat templates the tokenizer at `path` was shipped with (tokenizers.chat_templates), written
  as transformers 5's save_pretrained writes them: 'default' to chat_template.jinja, any other to
  additional_chat_templates/NAME.jinja; the names of the files written."""
  written = []
  for name, template in tokenizers.chat_templates(path).items():
    rel = tokenizers.TEMPLATE_FILE if name == 'default' else f'{tokenizers.TEMPLATE_DIR}/{name}.jinja'
    os.makedirs(os.path.dirname(os.path.join(directory, rel)), exist_ok=True)
    with open(os.path.join(directory, rel), 'w', encoding='utf-8') as f:
      f.write(template.text)
    written.append(rel)
  return written


def export(directory: str, path: str, max_len: int) -> None:
  """The tokenizer at `path` under its Hugging Face name in `directory`, with the files `write` adds:
  what AutoTokenizer.from_pretrained(directory) reads, chat templates included."""
  files.copy_member(path, os.path.join(directory, EXPORT_NAMES[tokenizers.kind_of(path)]))
  write(directory, path, max_len)


def write(directory: str, path: str, max_len: int) -> None:
  """tokenizer_config.json, special_tokens_map.json and (Unigram models) tokenizer.json for the
  sentencepiece model at `path`; the first two only for a tokenizer.json, which is copied as it is;
  and the chat templates it was shipped with (write_templates), either kind."""
  if tokenizers.kind_of(path) == 'hf':
    written = list(zip(('tokenizer_config.json', 'special_tokens_map.json'), hf_tokenizer_config(path, max_len)))
  else:
    proto = load_proto(path)
    config, special = tokenizer_config(proto, max_len)
    written = [('tokenizer_config.json', config), ('special_tokens_map.json', special)]
    if proto.trainer_spec.model_type == _UNIGRAM:
      written.append(('tokenizer.json', tokenizer_json(proto)))
  for name, data in written:
    with open(os.path.join(directory, name), 'w', encoding='utf-8') as f:
      json.dump(data, f, indent=1 if name != 'tokenizer.json' else None, ensure_ascii=False)
  write_templates(directory, path)
