"""What `pax serve` reads and writes: OpenAI's completion and chat completion requests, checked, and their answers.

The requests are OpenAI's (https://platform.openai.com/docs/api-reference), with vLLM's `top_k` and
`ignore_eos` besides. A field that is not one of them, a value of the wrong type or out of its range is
refused in one line (BadRequest: HTTP 400), as is a request the model cannot hold (prompt and
max_tokens past its context). Fields OpenAI has but paxcli does not do (penalties, logit_bias, best_of
other than n, suffix, tools) are refused when they ask for something, not ignored.
"""

from __future__ import annotations

import math
import secrets
from typing import Any, Literal, Optional, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from paxcli.errors import shorten

MAX_PROMPTS = 1024          # prompts of one completion request (each is a request of the queue)
MAX_STOP = 16               # stop strings of one request
MAX_TOP_COMPLETIONS = 5     # `logprobs` of a completion request (OpenAI's bound)
MAX_TOP_CHAT = 20           # `top_logprobs` of a chat request (OpenAI's bound)


class BadRequest(Exception):
  """A request the server refuses in one line (`status`: 400, or 404 for an unknown model)."""

  def __init__(self, message: str, param: Optional[str] = None, status: int = 400, code: Optional[str] = None):
    super().__init__(message)
    self.message, self.param, self.status, self.code = message, param, status, code

  def body(self) -> dict:
    kind = 'invalid_request_error' if self.status < 500 else 'server_error'
    return {'error': {'message': self.message, 'type': kind, 'param': self.param, 'code': self.code}}


class _Strict(BaseModel):
  model_config = ConfigDict(extra='forbid', strict=True)


class StreamOptions(_Strict):
  include_usage: bool = False


class _Sampling(_Strict):
  """The fields both kinds of request share."""
  model: Optional[str] = None
  max_tokens: Optional[int] = None
  temperature: Optional[float] = None
  top_p: Optional[float] = None
  top_k: Optional[int] = None            # vLLM's: 0 or -1 is off
  n: int = 1
  stream: bool = False
  stream_options: Optional[StreamOptions] = None
  stop: Optional[Union[str, list[str]]] = None
  seed: Optional[int] = None
  presence_penalty: Optional[float] = None
  frequency_penalty: Optional[float] = None
  logit_bias: Optional[dict] = None
  user: Optional[str] = None
  ignore_eos: bool = False               # vLLM's: end-of-sequence ids do not end a choice


class CompletionRequest(_Sampling):
  prompt: Any = Field(...)
  logprobs: Optional[int] = None
  echo: bool = False
  best_of: Optional[int] = None
  suffix: Optional[str] = None


class TextPart(_Strict):
  type: Literal['text']
  text: str


class Message(_Strict):
  role: str
  content: Optional[Union[str, list[TextPart]]] = None
  name: Optional[str] = None


class ChatRequest(_Sampling):
  messages: list[Message]
  max_completion_tokens: Optional[int] = None
  logprobs: Optional[bool] = None
  top_logprobs: Optional[int] = None


def parse(kind: type, body: Any) -> Any:
  """The request of `kind` in a JSON body (already parsed), or BadRequest naming the first faulty field."""
  if not isinstance(body, dict):
    raise BadRequest(f'The request body must be a JSON object, got {type(body).__name__}.')
  try:
    return kind.model_validate(body)
  except pydantic.ValidationError as e:
    raise BadRequest(describe(e.errors()[0]), param=_where(e.errors()[0]['loc'])) from None


def describe(error: dict) -> str:
  """One line for pydantic's first error: the field, and what is wrong with it."""
  where = _where(error['loc'])
  if error['type'] == 'extra_forbidden':
    return f'Unknown field {where!r}: this server takes OpenAI\'s fields (and vLLM\'s top_k, ignore_eos).'
  if error['type'] == 'missing':
    return f'The field {where!r} is missing.'
  got = shorten(repr(error.get('input')), 60)
  return f'{where}: {error["msg"][0].lower()}{error["msg"][1:]}, got {got}.'


def _where(loc) -> str:
  parts = [p for p in loc if not (isinstance(p, str) and ('[' in p or p in ('str', 'list', 'int')))]
  return '.'.join(str(p) for p in parts) or 'body'


# ---- checks against the model and the server's bounds ---------------------------------------------------


def check_sampling(req: _Sampling, vocab_size: int, max_n: int) -> dict:
  """The sampling settings of a request, checked: temperature, top_p, top_k, n, stop, seed."""
  for name in ('presence_penalty', 'frequency_penalty'):
    if getattr(req, name):
      raise BadRequest(f'{name} is not supported by this server (only 0).', param=name)
  if req.logit_bias:
    raise BadRequest('logit_bias is not supported by this server.', param='logit_bias')
  temperature = 1.0 if req.temperature is None else req.temperature
  if not (math.isfinite(temperature) and 0 <= temperature <= 2):
    raise BadRequest(f'temperature must be between 0 and 2, got {temperature}.', param='temperature')
  top_p = 1.0 if req.top_p is None else req.top_p
  if not (math.isfinite(top_p) and 0 < top_p <= 1):
    raise BadRequest(f'top_p must be in (0, 1], got {top_p}.', param='top_p')
  top_k = 0 if req.top_k in (None, -1) else req.top_k
  if not 0 <= top_k <= vocab_size:
    raise BadRequest(f'top_k must be -1 or 0 (off), or 1 to the vocabulary size {vocab_size}, got {top_k}.',
                     param='top_k')
  if not 1 <= req.n <= max_n:
    raise BadRequest(f'n must be between 1 and {max_n} (this server\'s bound, --max-n), got {req.n}.', param='n')
  stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
  if len(stop) > MAX_STOP or any(not s for s in stop):
    raise BadRequest(f'stop takes at most {MAX_STOP} non-empty strings.', param='stop')
  if req.seed is not None and not 0 <= req.seed < 2 ** 32:
    raise BadRequest(f'seed must be between 0 and {2 ** 32 - 1} (JAX keeps 32 bits of a seed), got '
                     f'{shorten(req.seed, 40)}.', param='seed')
  seed = secrets.randbits(32) if req.seed is None else req.seed
  return {'temperature': float(temperature), 'top_p': float(top_p), 'top_k': int(top_k), 'seed': int(seed),
          'stop': tuple(stop), 'n': req.n}


def prompts_of(req: CompletionRequest, vocab_size: int) -> list[Union[str, list[int]]]:
  """A completion request's prompts: a string, a list of strings, a list of ids or a list of lists of ids."""
  prompt = req.prompt
  if isinstance(prompt, str):
    prompts = [prompt]
  elif isinstance(prompt, list) and prompt and all(_is_int(i) for i in prompt):
    prompts = [prompt]
  elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
    prompts = list(prompt)
  elif isinstance(prompt, list) and prompt and all(isinstance(p, list) and all(_is_int(i) for i in p)
                                                   for p in prompt):
    prompts = list(prompt)
  else:
    raise BadRequest('prompt must be a string, a list of strings, a list of token ids or a list of lists of '
                     'token ids (none empty).', param='prompt')
  if len(prompts) > MAX_PROMPTS:
    raise BadRequest(f'A request takes at most {MAX_PROMPTS} prompts, got {len(prompts)}.', param='prompt')
  for p in prompts:
    if isinstance(p, list):
      if not p:
        raise BadRequest('A prompt of token ids is empty.', param='prompt')
      bad = next((i for i in p if not 0 <= i < vocab_size), None)
      if bad is not None:
        raise BadRequest(f'Token id {bad} is outside the vocabulary (0 to {vocab_size - 1}).', param='prompt')
  return prompts


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def check_unsupported(req: CompletionRequest) -> None:
  if req.suffix:
    raise BadRequest('suffix is not supported by this server.', param='suffix')
  if req.best_of is not None and req.best_of != req.n:
    raise BadRequest('best_of other than n is not supported by this server.', param='best_of')
  if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_COMPLETIONS:
    raise BadRequest(f'logprobs must be between 0 and {MAX_TOP_COMPLETIONS}, got {req.logprobs}.', param='logprobs')


def max_tokens(asked: Optional[int], default: Optional[int], prompt_len: int, context: int, param: str) -> int:
  """The new tokens a choice may have: as asked (else `default`, else what the context leaves), checked
  against the model's context length (OpenAI's message)."""
  if asked is not None and asked < 0:
    raise BadRequest(f'{param} must be at least 0, got {asked}.', param=param)
  wanted = asked if asked is not None else default
  if wanted is None:
    wanted = context - prompt_len
  if prompt_len + wanted > context:
    raise BadRequest(f"This model's maximum context length is {context} tokens. However, you requested "
                     f'{prompt_len + wanted} tokens ({prompt_len} in the prompt, {wanted} in the completion). Please '
                     'reduce the length of the prompt or of the completion.', param=param, code='context_length_exceeded')
  return wanted


def chat_messages(req: ChatRequest) -> list[dict]:
  """The messages as a chat template reads them: {'role', 'content'} with text content."""
  if not req.messages:
    raise BadRequest('messages must hold at least one message.', param='messages')
  out = []
  for n, m in enumerate(req.messages):
    content = m.content if isinstance(m.content, str) or m.content is None else ''.join(p.text for p in m.content)
    message = {'role': m.role, 'content': content or ''}
    if m.name is not None:
      message['name'] = m.name
    out.append(message)
  return out


def check_chat_logprobs(req: ChatRequest) -> int:
  """How many alternatives each token's logprobs list (0 without top_logprobs)."""
  top = req.top_logprobs or 0
  if not 0 <= top <= MAX_TOP_CHAT:
    raise BadRequest(f'top_logprobs must be between 0 and {MAX_TOP_CHAT}, got {top}.', param='top_logprobs')
  if top and not req.logprobs:
    raise BadRequest('top_logprobs needs logprobs: true.', param='top_logprobs')
  return top
