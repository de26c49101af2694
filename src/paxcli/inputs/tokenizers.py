"""Tokenizers: a sentencepiece `.model` or a Hugging Face `tokenizer.json`, behind one interface.

Every reader of token ids (file inputs, `pax decode`, `pax inspect-input`, the Hugging Face
export) goes through `load(path)`, which picks the kind by the file name: `*.json` is read by
the `tokenizers` library (pure data: no code of the file's author runs), anything else by
sentencepiece. Both give `encode`, `decode`, `vocab_size` and the special ids.

A tokenizer as Hugging Face ships it has a `tokenizer_config.json` beside it (CONFIG_NAME): its
bos/eos/pad tokens name the special ids, and `add_bos_token` (or, for a tokenizer.json, its own
post-processor) says that every text starts with BOS, which `bos_first` reports. Its chat templates
are Jinja code of the model's authors, shipped where transformers reads them (`chat_templates`):
`chat_template.jinja` and `additional_chat_templates/NAME.jinja` (what transformers 5's
save_pretrained writes), else the config's `chat_template`. paxcli keeps them with the job, folded
into the copy of the config (`folded_config`), and renders them only in jinja2's sandbox, for chat
JSONL (paxcli.inputs.chat_template). `encode_rendered` reads such a rendering: special tokens
written as text stand for themselves, as in transformers.

`train_sentencepiece` is what `pax tokenizer train` and the file inputs' first-use training
call: a Unigram model with byte fallback and the ids paxcli's corpus tokenizer has (pad 0,
eos 1, unk 2, no bos), trained single-threaded from text in a fixed order so that the same
text gives a byte-identical model.
"""

from __future__ import annotations

import io
import json
import os
import re
from typing import Iterable, Iterator, NamedTuple, Optional

import numpy as np
import sentencepiece as spm
import tokenizers as hf_tokenizers

from paxcli import files
from paxcli.errors import UserError, shorten
from paxcli.files import check_regular_file, read_text

# The special tokens of common tokenizer.json files, most usual first: the first one present
# in a file's vocabulary is its end-of-text (or padding, beginning) token.
HF_EOS = ('</s>', '<|endoftext|>', '<|end_of_text|>', '<eos>', '<|im_end|>', '[SEP]')
HF_PAD = ('<pad>', '<|pad|>', '[PAD]')
HF_BOS = ('<s>', '<|begin_of_text|>', '<bos>', '[CLS]')
CONFIG_NAME = 'tokenizer_config.json'   # beside a shipped tokenizer: its special tokens, chat template
TEMPLATE_FILE = 'chat_template.jinja'          # transformers 5 writes a tokenizer's chat template here,
TEMPLATE_DIR = 'additional_chat_templates'     # and its other named templates here, as NAME.jinja
MAX_TEMPLATE_BYTES = 1 << 20   # a released chat template is a few KB (Qwen 3's: 4 KB)
MAX_TEMPLATES = 64             # named templates read beside one tokenizer
_TEMPLATE_NAME = re.compile(r'^[A-Za-z0-9_.-]{1,64}$')
# sentencepiece skips sentences longer than max_sentence_length bytes: longer lines are cut.
_MAX_LINE_CHARS = 2000
_MAX_LINE_BYTES = 4 * _MAX_LINE_CHARS
# Text a tokenizer trains on by default: about a minute of sentencepiece on one core.
MAX_CHARS = 10_000_000


def kind_of(path: str) -> str:
  """'hf' for a tokenizer.json, else 'sentencepiece'."""
  return 'hf' if path.endswith('.json') else 'sentencepiece'


def config_beside(path: str) -> Optional[str]:
  """The tokenizer_config.json in the directory of the tokenizer at `path`, or None."""
  beside = os.path.join(os.path.dirname(path), CONFIG_NAME)
  return beside if os.path.isfile(beside) else None


def shipped_config(path: str) -> dict:
  """The tokenizer_config.json beside `path`, parsed ({} when there is none); only read as data."""
  beside = config_beside(path)
  if beside is None:
    return {}
  try:
    config = json.loads(read_text(beside, 'tokenizer config', 64 << 20))
  except (ValueError, RecursionError) as e:
    raise UserError(f'{beside} is not valid JSON ({str(e)[:100]}).') from None
  if not isinstance(config, dict):
    raise UserError(f'{beside} is a JSON {type(config).__name__}, not an object.')
  return config


class Template(NamedTuple):
  """A chat template as shipped: its Jinja text and the file it was read from (named in errors)."""
  text: str
  source: str


def chat_templates(path: str) -> dict[str, Template]:
  """The chat templates shipped beside the tokenizer at `path`, by name ('default': the one
  transformers' apply_chat_template uses when asked for none), read as transformers 5 reads them:
  chat_template.jinja ('default') and additional_chat_templates/NAME.jinja; only when neither is
  there, tokenizer_config.json's `chat_template` (a string: 'default'; a list of {name, template}).
  Each is read as text, bounded, from a regular file inside the tokenizer's directory; {} when none."""
  directory = os.path.dirname(path)
  found: dict[str, Template] = {}
  default = files.member(directory, TEMPLATE_FILE, 'chat template')
  if os.path.lexists(default):
    found['default'] = Template(read_text(default, 'chat template', MAX_TEMPLATE_BYTES), default)
  named = files.member(directory, TEMPLATE_DIR, 'chat templates')
  if os.path.isdir(named):
    names = sorted(n for n in os.listdir(named) if n.endswith('.jinja'))
    if len(names) > MAX_TEMPLATES:
      raise UserError(f'{named} holds {len(names)} chat templates; paxcli reads at most {MAX_TEMPLATES}.')
    for name in names:
      if not _TEMPLATE_NAME.match(name[:-len('.jinja')]):
        raise UserError(f'{named}: {shorten(name, 80)!r} is no template name (letters, digits, _ . -).')
      file = files.member(directory, f'{TEMPLATE_DIR}/{name}', 'chat template')
      found[name[:-len('.jinja')]] = Template(read_text(file, 'chat template', MAX_TEMPLATE_BYTES), file)
  if found:   # transformers: template files, where there are any, take the place of the config's
    return found
  config = shipped_config(path)
  return _config_templates(config.get('chat_template'), config_beside(path) or path)


def _config_templates(value, source: str) -> dict[str, Template]:
  """tokenizer_config.json's `chat_template` by name: a string, or a list of {"name", "template"}."""
  if value is None:
    return {}
  if isinstance(value, str):
    return {'default': Template(value, source)}
  shape = 'a string, or a list of {"name": ..., "template": ...}'
  if not isinstance(value, list) or len(value) > MAX_TEMPLATES:
    raise UserError(f'{source}: chat_template must be {shape} (at most {MAX_TEMPLATES}).')
  out = {}
  for entry in value:
    if not (isinstance(entry, dict) and isinstance(entry.get('name'), str) and isinstance(entry.get('template'), str)):
      raise UserError(f'{source}: chat_template must be {shape}; got an entry {shorten(repr(entry), 80)}.')
    if not _TEMPLATE_NAME.match(entry['name']):   # it names a file when the template is written out (--to hf)
      raise UserError(f'{source}: {shorten(entry["name"], 80)!r} is no chat template name (letters, digits, _ . -).')
    out[entry['name']] = Template(entry['template'], source)
  return out


def folded_config(path: str) -> Optional[dict]:
  """The tokenizer_config.json to keep beside a copy of the tokenizer at `path` (a job's, a prepared
  directory's): the shipped one with every shipped chat template folded into its `chat_template`
  (a string when 'default' is the only one, else transformers' list of {name, template}), so one
  file carries them; None when the tokenizer ships neither config nor template."""
  config, templates = shipped_config(path), chat_templates(path)
  if not config and not templates:
    return None
  config = {k: v for k, v in config.items() if k != 'chat_template'}
  if list(templates) == ['default']:
    config['chat_template'] = templates['default'].text
  elif templates:
    config['chat_template'] = [{'name': name, 'template': t.text} for name, t in templates.items()]
  return config


def folded_config_bytes(path: str) -> Optional[bytes]:
  """folded_config as the bytes paxcli writes (None: no config to write)."""
  config = folded_config(path)
  return None if config is None else json.dumps(config, indent=1, ensure_ascii=False).encode('utf-8')


def token_text(value) -> Optional[str]:
  """A special token of tokenizer_config.json: a string, or an AddedToken's {"content": ...}."""
  if isinstance(value, dict):
    value = value.get('content')
  return value if isinstance(value, str) and value else None


class SentencePieceTokenizer:
  """A sentencepiece model: text <-> ids, and its special ids."""

  def __init__(self, path: str):
    self.path = path
    try:
      self._sp = spm.SentencePieceProcessor(model_file=path)
    except (OSError, RuntimeError) as e:
      raise UserError(f'{path} is not a sentencepiece model: {e}') from None
    # Llama's shipped tokenizer.model says so in its tokenizer_config.json (LlamaTokenizer's default: yes)
    self.bos_first = bool(shipped_config(path).get('add_bos_token', False)) and self.bos_id is not None

  @property
  def vocab_size(self) -> int:
    return int(self._sp.get_piece_size())

  @property
  def eos_id(self) -> Optional[int]:
    return _id_or_none(self._sp.eos_id())

  @property
  def bos_id(self) -> Optional[int]:
    return _id_or_none(self._sp.bos_id())

  @property
  def pad_id(self) -> Optional[int]:
    return _id_or_none(self._sp.pad_id())

  def special_tokens(self) -> dict[str, Optional[str]]:
    """{'bos_token', 'eos_token', 'pad_token', 'unk_token'} -> the piece's text, or None."""
    return {f'{k}_token': (self._sp.id_to_piece(i) if i is not None else None)
            for k, i in (('bos', self.bos_id), ('eos', self.eos_id), ('pad', self.pad_id),
                         ('unk', _id_or_none(self._sp.unk_id())))}

  def trained_here(self) -> bool:
    """Whether train_sentencepiece made this model (its trainer's settings are in the model: Unigram with
    byte fallback, pad 0, eos 1, unk 2, no BOS, one thread, lines in order): a tokenizer whose only chat
    format is paxcli's own, whoever names it (TOKENIZER, a job's kept copy)."""
    from sentencepiece import sentencepiece_model_pb2   # protobuf's classes: only when a chat asks
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(self._sp.serialized_model_proto())
    spec = proto.trainer_spec
    return ((spec.model_type, spec.byte_fallback, spec.hard_vocab_limit, spec.num_threads, spec.shuffle_input_sentence,
             spec.max_sentence_length, spec.pad_id, spec.eos_id, spec.unk_id, spec.bos_id)
            == (1, True, False, 1, False, _MAX_LINE_BYTES, 0, 1, 2, -1))

  def encode(self, text: str) -> list[int]:
    return list(self._sp.encode(utf8_text(text)))

  def encode_rendered(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """(ids, each one's [start, end) characters) of a rendered chat template: the special tokens'
    texts (`</s>`) are those tokens, as transformers' LlamaTokenizer reads them; sentencepiece
    alone would spell them out. The text between them is encoded piece by piece."""
    text = utf8_text(text)
    specials = {t: self._sp.piece_to_id(t) for t in self.special_tokens().values() if t}
    ids, offsets, at = [], [], 0
    for part in _split_at(text, specials):
      if part in specials:
        ids.append(specials[part])
        offsets.append((at, at + len(part)))
      elif part:
        encoded = self._sp.encode(part, return_type='offset_mapping')   # character offsets
        ids += encoded['ids']
        offsets += [(at + start, at + end) for start, end in encoded['offsets']]
      at += len(part)
    return ids, offsets

  def encode_many(self, texts: list[str]) -> list[np.ndarray]:
    """The ids of each text (int32); a long one in pieces (encode_long)."""
    return _encode_many(texts, lambda batch: self._sp.encode(batch), self.encode)

  def decode(self, ids, specials: bool = False) -> str:
    """The text of `ids`, special tokens written out when `specials` (what `pax inspect-input`
    shows); ids past the model's pieces are left out, as the tokenizers library does: a model's
    vocabulary is often padded beyond its tokenizer's (VOCAB_SIZE 32128 for T5's 32100 pieces; an
    own-data tokenizer with fewer pieces than asked), and it may pick such an id."""
    size = self.vocab_size
    ids = [int(i) for i in ids if 0 <= int(i) < size]
    if not specials:
      return self._sp.decode(ids)
    parts, run = [], []
    for i in ids + [None]:
      if i is None or self._sp.is_control(i) or self._sp.is_unknown(i):
        parts.append(self._sp.decode(run))
        parts.append('' if i is None else self._sp.id_to_piece(i))
        run = []
      else:
        run.append(i)
    return ''.join(parts)


class HfTokenizer:
  """A Hugging Face `tokenizer.json` (the `tokenizers` library), without added special tokens.

  Special ids are the bos/eos/pad tokens of the tokenizer_config.json beside the file where it
  names them, else found by the usual token names (HF_EOS, HF_PAD, HF_BOS): tokenizer.json itself
  does not say which token ends a text. `bos_first`: the file's post-processor starts every
  text with the BOS token (Llama 3's does), as transformers' tokenizer would.
  """

  def __init__(self, path: str):
    self.path = path
    try:
      self._tok = hf_tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the library raises bare Exceptions for bad files
      raise UserError(f'{path} is not a Hugging Face tokenizer.json: {str(e).splitlines()[0][:200]}') from None
    vocab = self._tok.get_vocab(with_added_tokens=True)
    config = shipped_config(path)
    self.eos_id, self.pad_id, self.bos_id = (
        vocab.get(token_text(config.get(f'{kind}_token')), next((vocab[t] for t in names if t in vocab), None))
        for kind, names in (('eos', HF_EOS), ('pad', HF_PAD), ('bos', HF_BOS)))
    added = self._tok.encode('', add_special_tokens=True).ids
    self.bos_first = self.bos_id is not None and added[:1] == [self.bos_id]

  @property
  def vocab_size(self) -> int:
    return int(self._tok.get_vocab_size(with_added_tokens=True))

  def special_tokens(self) -> dict[str, Optional[str]]:
    """{'bos_token', 'eos_token', 'pad_token'} -> the token's text, or None."""
    return {f'{k}_token': (self._tok.id_to_token(i) if i is not None else None)
            for k, i in (('bos', self.bos_id), ('eos', self.eos_id), ('pad', self.pad_id))}

  def trained_here(self) -> bool:
    """paxcli trains sentencepiece models only."""
    return False

  def encode(self, text: str) -> list[int]:
    return list(self._tok.encode(utf8_text(text), add_special_tokens=False).ids)

  def encode_rendered(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """(ids, each one's [start, end) characters) of a rendered chat template: added tokens written
    as text are those tokens, as in every tokenizers encode; no BOS is added (the template writes it)."""
    encoding = self._tok.encode(utf8_text(text), add_special_tokens=False)
    return list(encoding.ids), [tuple(o) for o in encoding.offsets]

  def encode_many(self, texts: list[str]) -> list[np.ndarray]:
    """The ids of each text (int32); a long one in pieces (encode_long)."""
    return _encode_many(texts, lambda batch: [e.ids for e in self._tok.encode_batch(batch, add_special_tokens=False)],
                        self.encode)

  def decode(self, ids, specials: bool = False) -> str:
    """The text of `ids`, special tokens written out when `specials` (what `pax inspect-input` shows)."""
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=not specials)


Tokenizer = SentencePieceTokenizer | HfTokenizer


def load(path: str) -> Tokenizer:
  """The tokenizer at `path`: a tokenizer.json (by its name) or a sentencepiece model."""
  check_regular_file(path, 'tokenizer')
  return HfTokenizer(path) if kind_of(path) == 'hf' else SentencePieceTokenizer(path)


# A model's vocabulary padded past its tokenizer (Qwen 2.5's 151,936 rows for 151,665 tokens, T5's 32,128 for
# 32,100: a multiple of 64 or 128 runs faster) is deliberate; past this share unused it is a mismatch.
UNUSED_SHARE_SAID = 0.1


def check_fits(pieces: int, vocab_size: int, what: str) -> Optional[str]:
  """UserError when a tokenizer of `pieces` tokens (`what`: its file) has more than the model's VOCAB_SIZE;
  a note to print (one line) when a tenth or more of the model's ids are no token of it: the model keeps
  VOCAB_SIZE (its shape is the knob's, as checkpoints and conversions read it), and the line says what it
  costs and how to fit it. None when there is nothing to say."""
  if not vocab_size:
    return None
  if pieces > vocab_size:
    raise UserError(f'The tokenizer {what} has {pieces} tokens, more than the model\'s {vocab_size}: set '
                    f'VOCAB_SIZE={pieces} (or more).')
  unused = vocab_size - pieces
  if unused < UNUSED_SHARE_SAID * vocab_size:
    return None
  fit = -(-pieces // 128) * 128
  return (f'The tokenizer {what} has {pieces:,} tokens and VOCAB_SIZE is {vocab_size:,}: {unused:,} ids are no token '
          f'(their embedding rows and logits only learn not to be chosen). Set VOCAB_SIZE={pieces} to fit it, or '
          f'{fit} (a multiple of 128, faster on accelerators).')


def load_for_documents(path: str) -> Tokenizer:
  """The tokenizer at `path` for packing documents, which needs its end-of-text token: paxcli puts
  one after each document (the file input and `pax data prepare` alike)."""
  tok = load(path)
  if tok.eos_id is None:
    raise UserError(f'The tokenizer {tok.path} has no end-of-text token (one of {", ".join(HF_EOS)}); '
                    'paxcli puts one after each document.')
  return tok


_SURROGATE = re.compile('[\ud800-\udfff]')


def utf8_text(text: str) -> str:
  """`text` with each lone surrogate (U+D800..U+DFFF: JSON's "\\ud800" alone, which no UTF-8 text can
  hold and no tokenizer encodes) replaced by U+FFFD, the replacement character; one character for
  one, so character offsets are unchanged."""
  return _SURROGATE.sub('\ufffd', text) if _SURROGATE.search(text) else text


# A text longer than 2 * LONG_TEXT characters (a 100 MB JSONL line) is tokenized in pieces of about
# LONG_TEXT: a tokenizer given it whole holds tens of bytes per character at once (sentencepiece's
# lattice, Python's list of ids), pieces hold a few bytes per token.
LONG_TEXT = 1 << 20
_SEAM = 256  # characters on each side of a cut that its check tokenizes
_CUTS_TRIED = 64  # cuts tried near each place before the piece is made longer


def _encode_many(texts: list[str], encode_batch, encode_one) -> list[np.ndarray]:
  texts = [utf8_text(t) for t in texts]
  out: list = [None] * len(texts)
  short = [i for i, t in enumerate(texts) if len(t) <= 2 * LONG_TEXT]
  for i, ids in zip(short, encode_batch([texts[i] for i in short])):
    out[i] = np.asarray(ids, np.int32)
  for i, text in enumerate(texts):
    if out[i] is None:
      out[i] = encode_long(text, encode_one)
  return out


def encode_long(text: str, encode) -> np.ndarray:
  """The ids of a long text, tokenized in pieces of about LONG_TEXT characters.

  Each cut is one the tokenizer itself does not straddle: at a space (or, in text without one,
  anywhere) where the characters around it give the same ids tokenized together as tokenized on
  either side of it. Where no such cut is found near a place, the piece grows to the next; a
  tokenizer that gives no such cut at all tokenizes the text whole. `encode`: text -> ids.
  """
  parts, start, target = [], 0, LONG_TEXT
  while len(text) - start > 2 * LONG_TEXT and target < len(text) - LONG_TEXT:
    cut = _cut(text, start + target, encode)
    if cut is None:
      target += LONG_TEXT
      continue
    parts.append(np.asarray(encode(text[start:cut]), np.int32))
    start, target = cut, LONG_TEXT
  parts.append(np.asarray(encode(text[start:]), np.int32))
  return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _cut(text: str, near: int, encode) -> Optional[int]:
  """A place at or after `near` where tokenizing the text on either side gives the ids of tokenizing
  it whole, as far as _SEAM characters on each side tell; None when none of the places tried does."""
  spaces, at = [], near
  while len(spaces) < _CUTS_TRIED // 2:
    at = text.find(' ', at, near + 16 * _SEAM)
    if at < 0:
      break
    spaces.append(at)
    at += 1
  for cut in spaces + list(range(near, near + _CUTS_TRIED // 2)):
    left, right = text[cut - _SEAM:cut], text[cut:cut + _SEAM]
    if list(encode(left + right)) == list(encode(left)) + list(encode(right)):
      return cut
  return None


def _split_at(text: str, tokens) -> list[str]:
  """`text` cut before and after each occurrence of one of `tokens` (longest first), those kept."""
  if not tokens:
    return [text]
  return re.split('(' + '|'.join(map(re.escape, sorted(tokens, key=len, reverse=True))) + ')', text)


def _id_or_none(i: int) -> Optional[int]:
  return int(i) if i >= 0 else None


def training_lines(texts: Iterable[str], max_chars: int) -> Iterator[str]:
  """The non-empty lines of `texts` (stripped, lone surrogates replaced: utf8_text), cut to pieces
  sentencepiece does not skip as too long, up to `max_chars` characters in all. A line is copied only
  as far as it is used: a text of one 100 MB line costs no copy of it."""
  left = max_chars
  for text in texts:
    for line in _stripped_lines(text, left):
      line = utf8_text(line)
      for start in range(0, len(line), _MAX_LINE_CHARS):
        yield line[start:start + _MAX_LINE_CHARS]
      left -= len(line)
      if left <= 0:
        return


def _stripped_lines(text: str, most: int) -> Iterator[str]:
  """line.strip()[:most] of each line of `text`, without copying more than that of any line."""
  start = 0
  while start <= len(text):
    end = text.find('\n', start)
    end = len(text) if end < 0 else end
    first = start
    while first < end and text[first].isspace():
      first += 1
    last = rest = min(end, first + most)
    while rest < end and text[rest].isspace():
      rest += 1
    if rest == end:  # nothing but spaces after the part kept: strip them off it
      while last > first and text[last - 1].isspace():
        last -= 1
    yield text[first:last]
    start = end + 1


def train_sentencepiece(texts: Iterable[str], vocab_size: int, output: str, max_chars: int = MAX_CHARS) -> int:
  """Trains a Unigram model on the first `max_chars` characters of `texts`; writes it atomically
  to `output`; returns its size, below `vocab_size` when the text holds fewer pieces.

  One thread and no sampling (the lines in order): the model depends on the text alone; with
  more threads sentencepiece sums its statistics in another order and the model changes.
  """
  if vocab_size < 260:
    raise UserError(f'A tokenizer needs at least 260 pieces (256 bytes and the special tokens); got {vocab_size}.')
  failures: list[UserError] = []
  lines = _stop_on_user_error(training_lines(texts, max_chars), failures)
  first = next(lines, None)
  if failures:
    raise failures[0]
  if first is None:
    raise UserError('No text to train a tokenizer on: the documents are empty.')
  model = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=_prepend(first, lines), model_writer=model, vocab_size=vocab_size,
        model_type='unigram', character_coverage=0.9995, byte_fallback=True, hard_vocab_limit=False,
        shuffle_input_sentence=False, max_sentence_length=_MAX_LINE_BYTES,
        num_threads=1, minloglevel=2, pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
  except RuntimeError as e:
    if not failures:
      raise UserError(f'Training the tokenizer failed: {e}') from None
  if failures:  # bad input met while sentencepiece read the text: the one line that names it
    raise failures[0]
  files.write_output(output, model.getvalue(), 'the tokenizer')  # /dev/null or a FIFO: written into
  return int(spm.SentencePieceProcessor(model_proto=model.getvalue()).get_piece_size())


def _stop_on_user_error(lines: Iterator[str], failures: list) -> Iterator[str]:
  """`lines` until one raises UserError, which is kept in `failures`: sentencepiece would turn it
  into a RuntimeError with a C++ trace."""
  try:
    yield from lines
  except UserError as e:
    failures.append(e)


def _prepend(first: str, rest: Iterator[str]) -> Iterator[str]:
  yield first
  yield from rest
