"""A model's own chat template (tokenizer_config.json's `chat_template`) for chat JSONL.

A model released for chat ships the Jinja template its conversations were written in. A chat
record ({"messages": [...]}) read with such a tokenizer becomes exactly the tokens transformers'
`apply_chat_template(messages, tokenize=True)` gives: the template's text, tokenized once, its
special tokens (BOS, headers, end-of-turn) as the template writes them and no BOS or EOS added
besides. Without a shipped template paxcli's own applies (paxcli.inputs.sft).

The template is code of the model's authors, so it is only ever compiled by jinja2's
ImmutableSandboxedEnvironment (no attribute of Python objects, no mutation of the messages),
with the options transformers uses (trim_blocks, lstrip_blocks, loop controls, `tojson`,
`raise_exception`, and `dict` and `namespace` that cannot reach Python's internals). `strftime_now` is left out on purpose: templates that print today's date
(Llama 3.2) then fall back to their fixed one, so a file gives the same tokens on any day and a
resumed run re-reads the batches it consumed. A template that does not compile, raises, or does
what the sandbox refuses stops with one line naming the tokenizer_config.json.

Which tokens are trained on: an assistant turn's span is found by prefix renders, the text the
template adds between rendering messages[:k] with the generation prompt (what a user's request
ends with at inference) and rendering messages[:k+1]: the assistant's content as the template
writes it (trimmed or not) and its end-of-turn token, less the whitespace after. Prefix renders
need no markup in the template (few have `{% generation %}` blocks) and follow whatever the
template does to the content; a template whose renders are not prefixes of one another (one
that rewrites earlier turns) is refused by name. A token weighs 1 when any of its characters lie
in an assistant span; everything else (system, user, headers, generation prompts) weighs 0.
"""

from __future__ import annotations

import json
from typing import Optional, Sequence

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from paxcli.errors import UserError, shorten
from paxcli.inputs import tokenizers
from paxcli.inputs.packing import Example
from paxcli.inputs.sft import TRAINED_ROLE

# The special tokens a template may name, as transformers passes them (its special_tokens_map).
SPECIAL_NAMES = ('bos_token', 'eos_token', 'unk_token', 'pad_token')


class ChatTemplate:
  """A shipped chat template, compiled in the sandbox; `source` (its tokenizer_config.json) names it
  in errors."""

  def __init__(self, text: str, source: str, special_tokens: dict[str, str]):
    self.source = source
    self.special_tokens = special_tokens
    try:
      self._template = _environment().from_string(text)
    except jinja2.TemplateSyntaxError as e:
      raise UserError(f'{source}: its chat_template does not compile (line {e.lineno}: {e.message}).') from None

  def render(self, messages: Sequence[dict], add_generation_prompt: bool, where: str) -> str:
    """The template's text of `messages`; UserError naming the data (`where`) and the template."""
    try:
      return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                   **self.special_tokens)
    except Exception as e:  # noqa: BLE001 - anything the template's code raises, SecurityError included
      raise UserError(f'{where}: the chat_template of {self.source} fails on this conversation '
                      f'({type(e).__name__}: {shorten(str(e), 200)}).') from None

  def spans(self, messages: Sequence[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """(the conversation's text, the [start, end) character spans of its assistant turns)."""
    text = self.render(messages, False, where)
    spans = []
    for k, message in enumerate(messages):
      if message['role'] != TRAINED_ROLE:
        continue
      before = self.render(messages[:k], True, where)
      through = self.render(messages[:k + 1], False, where)
      if not (through.startswith(before) and text.startswith(through)):
        raise UserError(f'{where}: the chat_template of {self.source} renders messages[{k}] (an assistant turn) '
                        'differently in a longer conversation, so paxcli cannot tell which tokens it trains on; '
                        'give the conversation as prompt/completion pairs instead.')
      spans.append((len(before), len(before) + len(through[len(before):].rstrip())))
    return text, spans

  def example(self, messages: Sequence[dict], tok: tokenizers.Tokenizer, where: str) -> Optional[Example]:
    """The training pairs of a conversation: assistant spans weigh 1 (module docstring); None when
    it is under 2 tokens."""
    text, spans = self.spans(messages, where)
    ids, offsets = tok.encode_rendered(text)
    if len(ids) < 2:
      return None
    weights = np.zeros(len(ids), np.float32)
    for i, (start, end) in enumerate(offsets):
      weights[i] = any(start < b and max(end, start + 1) > a for a, b in spans)
    tokens = np.asarray(ids, np.int32)
    return Example(tokens[:-1], tokens[1:], weights[1:])


def of_tokenizer(tok: tokenizers.Tokenizer) -> Optional[ChatTemplate]:
  """The chat template shipped beside `tok` (in its tokenizer_config.json), or None."""
  config = tokenizers.shipped_config(tok.path)
  text = config.get('chat_template')
  if text is None:
    return None
  source = tokenizers.config_beside(tok.path)
  if isinstance(text, list):  # several named templates: transformers' default is the one named so
    text = next((t.get('template') for t in text if isinstance(t, dict) and t.get('name') == 'default'), None)
  if not isinstance(text, str):
    raise UserError(f'{source}: chat_template must be a string (or a list holding one named "default").')
  return ChatTemplate(text, source, special_tokens(tok, config))


def special_tokens(tok: tokenizers.Tokenizer, config: dict) -> dict[str, str]:
  """{'bos_token': '<s>', ...}: tokenizer_config.json's names, else the tokenizer's own special tokens."""
  own = tok.special_tokens()
  out = {}
  for name in SPECIAL_NAMES:
    value = tokenizers.token_text(config.get(name)) or own.get(name)
    if value:
      out[name] = value
  return out


def _environment() -> ImmutableSandboxedEnvironment:
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
  env.filters['tojson'] = _tojson
  env.globals.update(raise_exception=_raise, dict=_dict, namespace=_Namespace)
  return env


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
  """Jinja's own tojson escapes HTML characters; chat templates expect json.dumps' text."""
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
  raise jinja2.TemplateError(message)


def _dict(*args, **kwargs) -> dict:
  """`dict(...)` in a template, without the class itself (its attributes) in the template's hands."""
  return dict(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
  """Jinja's namespace() refusing underscore names, which could reach Python's internals."""

  def __init__(*args, **kwargs):  # noqa: N805 - Namespace's own signature, so that namespace(self=1) works
    self, attrs = args[0], dict(*args[1:], **kwargs)
    for name in attrs:
      _Namespace._check(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _Namespace._check(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check(name) -> None:
    if isinstance(name, str) and name.startswith('_'):
      raise jinja2.exceptions.SecurityError(f'a namespace attribute may not start with "_": {name!r}')
