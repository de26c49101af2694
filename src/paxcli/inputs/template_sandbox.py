"""The process that renders a model's chat template (paxcli.inputs.chat_template runs this file).

A chat template is code of the model's authors that a data file drives: a loop of range(100000)
inside another, `{{ 9**(9**9) }}` or `{{ 'x' * 300000000 }}` hang or eat the memory of any
process that renders it. So it is rendered here, in a process of its own: jinja2's immutable
sandbox for what the template may reach, and bounds the template cannot get around for what it
may spend (each stops the render with a reply saying which, and the parent says it in one line):

  time     the parent waits a bounded time for each reply and kills this process after it;
  memory   this process's address space is capped (RLIMIT_AS): a MemoryError, or the process
           killed, and nothing else on the machine starved;
  output   each render counts what it produces (jinja's generate()) and stops past a bound.

It imports only jinja2 and the standard library, and is started as a script (python -I FILE), so
that nothing of paxcli's (jax, numpy) is loaded or inherited. Requests come from the parent as
length-prefixed pickles on stdin (the parent's own data); replies go back as length-prefixed
JSON, which the parent reads as data. It exits when its stdin closes or its parent is gone.
"""

import json
import os
import pickle
import resource
import struct
import sys
import threading
import time

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

_HEADER = struct.Struct('<Q')
MAX_INDENT = 64  # of tojson: a template needs a few spaces, not a gigabyte of them


class TooLong(Exception):
  """A render produced more than its bound."""


def environment() -> ImmutableSandboxedEnvironment:
  """jinja2's immutable sandbox with the options transformers renders chat templates with, and
  nothing that differs from one run to the next (lipsum's random text, the random filter)."""
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
  env.filters['tojson'] = _tojson
  env.filters.pop('random', None)
  env.globals.pop('lipsum', None)
  env.globals.update(raise_exception=_raise, dict=_dict, namespace=_Namespace)
  return env


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
  """Jinja's own tojson escapes HTML characters; chat templates expect json.dumps' text."""
  if indent is not None and (not isinstance(indent, (int, str)) or isinstance(indent, bool)
                             or (isinstance(indent, int) and not 0 <= indent <= MAX_INDENT)
                             or (isinstance(indent, str) and len(indent) > MAX_INDENT)):
    raise jinja2.TemplateError(f'tojson: indent must be at most {MAX_INDENT} (spaces or characters)')
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


class Renderer:
  """A compiled template and its bound on output; spans() is what the parent asks for."""

  def __init__(self, text: str, specials: dict, trained_role: str, max_chars: int):
    self.template = environment().from_string(text)
    self.specials, self.trained_role, self.max_chars = specials, trained_role, max_chars

  def render(self, messages: list, add_generation_prompt: bool) -> str:
    out, size = [], 0
    for chunk in self.template.generate(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                        **self.specials):
      size += len(chunk)
      if size > self.max_chars:
        raise TooLong()
      out.append(chunk)
    return ''.join(out)

  def spans(self, messages: list) -> dict:
    """The conversation's text and its assistant turns' [start, end) spans, by prefix renders: the
    text the template adds between messages[:k] with the generation prompt and messages[:k+1]."""
    text = self.render(messages, False)
    spans = []
    for k, message in enumerate(messages):
      if message.get('role') != self.trained_role:
        continue
      before = self.render(messages[:k], True)
      through = self.render(messages[:k + 1], False)
      if not (through.startswith(before) and text.startswith(through)):
        return {'kind': 'prefix', 'index': k}
      spans.append([len(before), len(before) + len(through[len(before):].rstrip())])
    return {'kind': 'ok', 'text': text, 'spans': spans}


def handle(request: dict, state: dict) -> dict:
  try:
    if request['op'] == 'init':
      try:
        state['renderer'] = Renderer(request['template'], request['specials'], request['role'], request['max_chars'])
      except jinja2.TemplateSyntaxError as e:
        return {'kind': 'syntax', 'line': e.lineno, 'message': str(e.message)}
      return {'kind': 'ok'}
    renderer = state['renderer']
    if request['op'] == 'render':
      return {'kind': 'ok', 'text': renderer.render(request['messages'], request['add_generation_prompt'])}
    return renderer.spans(request['messages'])
  except TooLong:
    return {'kind': 'too_long'}
  except MemoryError:
    return {'kind': 'memory'}
  except RecursionError:
    return {'kind': 'error', 'type': 'RecursionError', 'message': 'nested too deeply'}
  except Exception as e:  # noqa: BLE001 - anything the template's code raises, SecurityError included
    return {'kind': 'error', 'type': type(e).__name__, 'message': str(e)[:400]}


def _read_exactly(stream, n: int) -> bytes:
  data = stream.read(n)
  if len(data) != n:
    raise EOFError
  return data


def _exit_with_parent(parent: int) -> None:
  """Exits once the parent is gone, even in the middle of a render that would never end."""
  def watch():
    while os.getppid() == parent:
      time.sleep(0.5)
    os._exit(0)
  threading.Thread(target=watch, daemon=True).start()


def _cap_memory(megabytes: int) -> None:
  """Caps this process's address space at what it uses now plus `megabytes` (Linux; elsewhere
  RLIMIT_AS is not what bounds a process's memory, and the time bound still holds)."""
  if not sys.platform.startswith('linux'):
    return
  try:
    with open('/proc/self/statm', encoding='ascii') as f:
      used = int(f.read().split()[0]) * resource.getpagesize()
  except (OSError, ValueError, IndexError):
    used = 0
  limit = used + (megabytes << 20)
  soft, hard = resource.getrlimit(resource.RLIMIT_AS)
  if hard != resource.RLIM_INFINITY:
    limit = min(limit, hard)
  resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def main() -> None:
  parent = int(sys.argv[1])
  _exit_with_parent(parent)
  _cap_memory(int(sys.argv[2]))
  stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
  state: dict = {}
  while True:
    try:
      (size,) = _HEADER.unpack(_read_exactly(stdin, _HEADER.size))
      request = pickle.loads(_read_exactly(stdin, size))
    except EOFError:
      return
    try:
      reply = json.dumps(handle(request, state)).encode()
    except MemoryError:
      reply = b'{"kind": "memory"}'
    stdout.write(_HEADER.pack(len(reply)) + reply)
    stdout.flush()


if __name__ == '__main__':
  main()
