"""A model's own chat template (chat_template.jinja, additional_chat_templates/, tokenizer_config.json's
`chat_template`: paxcli.inputs.tokenizers.chat_templates) for chat JSONL.

A model released for chat ships the Jinja template its conversations were written in. A chat
record ({"messages": [...]}) read with such a tokenizer becomes exactly the tokens transformers'
`apply_chat_template(messages, tokenize=True)` gives: the template's text, tokenized once, its
special tokens (BOS, headers, end-of-turn) as the template writes them and no BOS or EOS added
besides. CHAT_TEMPLATE names another of the templates the tokenizer ships, or OWN, paxcli's own
format (paxcli.inputs.sft), which is also what a tokenizer paxcli trained reads chats with
(tokenizers.SentencePieceTokenizer.trained_here: on the data at first use, `pax tokenizer train`, a
job's copy of either). A chat met with any other tokenizer that ships no template stops with one line
(`no_template`): training a released model on a format it never saw is no silent default.

The template is code of the model's authors, so it is only ever compiled by jinja2's
ImmutableSandboxedEnvironment (no attribute of Python objects, no mutation of the messages),
with the options transformers uses (trim_blocks, lstrip_blocks, loop controls, `tojson`,
`raise_exception`, and `dict` and `namespace` that cannot reach Python's internals), in a process
of its own (paxcli.inputs.template_sandbox) whose time, memory and output are bounded
(paxcli.inputs.bounds: PAXCLI_TEMPLATE_SECONDS, _MEMORY_MB, _MAX_CHARS). Nothing that changes from
run to run is in the sandbox: `strftime_now` is left out on purpose (templates that print today's
date, Llama 3.2's, then fall back to their fixed one), and so are jinja's `lipsum` and `random`, so
a file gives the same tokens on any day and a resumed run re-reads the batches it consumed. A
template that does not compile, raises, does what the sandbox refuses or runs past a bound stops
with one line naming the tokenizer_config.json.

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

import os
import pickle
import select
import struct
import subprocess
import sys
import time
import weakref
from typing import Optional, Sequence

import numpy as np

from paxcli import files
from paxcli.errors import UserError, did_you_mean, shorten
from paxcli.inputs import bounds, tokenizers
from paxcli.inputs.packing import Example
from paxcli.inputs.sft import TRAINED_ROLE

# The special tokens a template may name, as transformers passes them (its special_tokens_map).
OWN = 'paxcli'   # CHAT_TEMPLATE's name for paxcli's own format (paxcli.inputs.sft), which no tokenizer ships
WHERE_SHIPPED = ('no chat_template.jinja, additional_chat_templates/ or chat_template in tokenizer_config.json '
                 'beside it')
SPECIAL_NAMES = ('bos_token', 'eos_token', 'unk_token', 'pad_token')


class ChatTemplate:
  """A shipped chat template, compiled in the sandbox process; `source` (its tokenizer_config.json)
  names it in errors."""

  def __init__(self, text: str, source: str, special_tokens: dict[str, str]):
    self.source = source
    self.special_tokens = special_tokens
    self._sandbox = _Sandbox(source, {'op': 'init', 'template': text, 'specials': special_tokens,
                                      'role': TRAINED_ROLE, 'max_chars': bounds.template_max_chars()})
    reply = self._sandbox.start(None)
    if reply['kind'] == 'syntax':
      raise UserError(f'{source}: its chat_template does not compile (line {reply.get("line")}: '
                      f'{shorten(reply.get("message"), 200)}).')
    self._check(reply, None)

  def render(self, messages: Sequence[dict], add_generation_prompt: bool, where: str) -> str:
    """The template's text of `messages`; UserError naming the data (`where`) and the template."""
    reply = self._sandbox.ask({'op': 'render', 'messages': list(messages),
                               'add_generation_prompt': add_generation_prompt}, where)
    self._check(reply, where)
    return reply['text']

  def spans(self, messages: Sequence[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """(the conversation's text, the [start, end) character spans of its assistant turns)."""
    reply = self._sandbox.ask({'op': 'spans', 'messages': list(messages)}, where)
    if reply.get('kind') == 'prefix':
      raise UserError(f'{where}: the chat_template of {self.source} renders messages[{reply.get("index")}] (an '
                      'assistant turn) differently in a longer conversation, so paxcli cannot tell which tokens it '
                      'trains on; give the conversation as prompt/completion pairs instead.')
    self._check(reply, where)
    return reply['text'], [(int(a), int(b)) for a, b in reply['spans']]

  def close(self) -> None:
    """Ends the template's process now (else it ends when this object goes, or at exit)."""
    self._sandbox.close()

  def _check(self, reply: dict, where: Optional[str]) -> None:
    """UserError for a reply that is not 'ok': the template raised, or crossed a bound (`where`: the
    conversation's file and line; None while compiling)."""
    kind, subject, on = reply.get('kind'), _subject(where, self.source), _on(where)
    if kind == 'ok':
      return
    if kind == 'error':
      raise UserError(f'{subject} fails {on} ({shorten(reply.get("type"), 40)}: {shorten(reply.get("message"), 200)}).')
    if kind == 'too_long':
      raise UserError(f'{subject} renders more than {bounds.template_max_chars():,} characters {on}; stopped '
                      '(PAXCLI_TEMPLATE_MAX_CHARS raises the bound).')
    if kind == 'memory':
      raise UserError(f'{subject} needs more than {bounds.template_memory_mb():,} MB {on}; stopped '
                      '(PAXCLI_TEMPLATE_MEMORY_MB raises the bound).')
    raise UserError(f'{subject}: unexpected reply {on} {shorten(repr(reply), 80)}.')

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


def of_tokenizer(tok: tokenizers.Tokenizer, name: str = '') -> Optional[ChatTemplate]:
  """The chat template the tokenizer ships (tokenizers.chat_templates) under `name`: '' its default,
  as transformers' apply_chat_template picks it; OWN (or a tokenizer that ships none): None, which
  is paxcli's own format (paxcli.inputs.sft). A name it does not ship is a UserError."""
  if name == OWN:
    return None
  templates = tokenizers.chat_templates(tok.path)
  if not templates:
    if name:
      raise UserError(f'CHAT_TEMPLATE={name!r}, but the tokenizer {tok.path} ships no chat template '
                      f'({WHERE_SHIPPED}); set CHAT_TEMPLATE={OWN} for paxcli\'s own format.')
    return None
  chosen = templates.get(name or 'default')
  if chosen is None:
    names = ', '.join(sorted(templates))
    if not name:   # transformers refuses the same: several templates and none named "default"
      raise UserError(f'The tokenizer {tok.path} ships chat templates named {names} and none named "default"; set '
                      'CHAT_TEMPLATE to the one to train with.')
    raise UserError(f'CHAT_TEMPLATE={name!r}: the tokenizer {tok.path} ships the chat templates {names} ({OWN} '
                    f'names paxcli\'s own format).{did_you_mean(name, [*templates, OWN])}')
  return ChatTemplate(chosen.text, chosen.source, special_tokens(tok, tokenizers.shipped_config(tok.path)))


def no_template(where: str, tok: tokenizers.Tokenizer, knob: str) -> UserError:
  """The error of a chat record met with a tokenizer that ships no template: paxcli's own format
  would train the model on a format it was never shown, silently; `knob` says how to choose it."""
  return UserError(f'{where}: a chat record, but the tokenizer {tok.path} ships no chat template ({WHERE_SHIPPED}), '
                   f'so the model\'s own chat format is unknown: set {knob} to train on paxcli\'s own '
                   '<|user|>/<|assistant|> format, or use a tokenizer that ships its template.')


def special_tokens(tok: tokenizers.Tokenizer, config: dict) -> dict[str, str]:
  """{'bos_token': '<s>', ...}: tokenizer_config.json's names, else the tokenizer's own special tokens."""
  own = tok.special_tokens()
  out = {}
  for name in SPECIAL_NAMES:
    value = tokenizers.token_text(config.get(name)) or own.get(name)
    if value:
      out[name] = value
  return out


_HEADER = struct.Struct('<Q')
_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'template_sandbox.py')


class _Sandbox:
  """The template's process (paxcli.inputs.template_sandbox): one request at a time, each answered
  within PAXCLI_TEMPLATE_SECONDS or the process is killed (and started again for the next request)."""

  def __init__(self, source: str, init: dict):
    self.source, self._init = source, init
    self._proc: Optional[subprocess.Popen] = None

  def start(self, where: Optional[str]) -> dict:
    self._proc = subprocess.Popen(
        [sys.executable, '-I', _SCRIPT, str(os.getpid()), str(bounds.template_memory_mb())],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
    weakref.finalize(self, _stop, self._proc)
    return self._exchange(self._init, where)

  def ask(self, request: dict, where: str) -> dict:
    if self._proc is None or self._proc.poll() is not None:
      reply = self.start(where)
      if reply.get('kind') != 'ok':
        return reply
    return self._exchange(request, where)

  def _exchange(self, request: dict, where: Optional[str]) -> dict:
    seconds = bounds.template_seconds()
    data = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
    try:
      self._proc.stdin.write(_HEADER.pack(len(data)) + data)
      self._proc.stdin.flush()
      deadline = time.monotonic() + seconds
      (size,) = _HEADER.unpack(self._read(_HEADER.size, deadline))
      return files.parse_json(self._read(size, deadline), f'{self.source}: its renderer\'s reply')
    except TimeoutError:
      self._kill()
      raise UserError(f'{_subject(where, self.source)} ran past {seconds:g} s {_on(where)}; stopped '
                      '(PAXCLI_TEMPLATE_SECONDS raises the bound).') from None
    except (BrokenPipeError, EOFError):
      code = self._kill()
      raise UserError(f'{_subject(where, self.source)} stopped its process {_on(where)} (exit code {code}), e.g. '
                      f'past its {bounds.template_memory_mb():,} MB of memory (PAXCLI_TEMPLATE_MEMORY_MB raises the '
                      'bound).') from None

  def _read(self, n: int, deadline: float) -> bytes:
    fd, parts = self._proc.stdout.fileno(), []
    while n:
      left = deadline - time.monotonic()
      if left <= 0 or not select.select([fd], [], [], left)[0]:
        raise TimeoutError
      part = os.read(fd, min(n, 1 << 20))
      if not part:
        raise EOFError
      parts.append(part)
      n -= len(part)
    return b''.join(parts)

  def close(self) -> None:
    if self._proc is not None:
      proc, self._proc = self._proc, None
      _stop(proc)

  def _kill(self) -> Optional[int]:
    proc, self._proc = self._proc, None
    _stop(proc, wait=0)
    return proc.returncode


def _subject(where: Optional[str], source: str) -> str:
  """'FILE line N: the chat_template of CONFIG' (where: the conversation's), or 'CONFIG: its chat_template'."""
  return f'{source}: its chat_template' if where is None else f'{where}: the chat_template of {source}'


def _on(where: Optional[str]) -> str:
  return 'while compiling' if where is None else 'on this conversation'


def _stop(proc: subprocess.Popen, wait: float = 2) -> None:
  """Ends the template's process: its stdin closed (it exits), killed if it does not within `wait`."""
  try:
    proc.stdin.close()
  except OSError:
    pass
  try:
    proc.wait(wait)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
  proc.stdout.close()
