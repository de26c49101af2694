"""The HTTP side of `pax serve`: FastAPI routes over the engine (paxcli.loops.serve.engine).

    app = make_app(served)      # served: the engine, tokenizer, chat template, models and bounds

Routes: /v1/models, /v1/completions, /v1/chat/completions (OpenAI's API; streamed as server-sent events
with "stream": true), /health, /metrics (Prometheus text), and vLLM's /tokenizer_info, /tokenize and
/detokenize (lm-evaluation-harness' `local-completions` tokenizes with them, so it reads text exactly as
the model was trained to). A body is read up to MAX_BODY_BYTES and parsed as paxcli parses JSON it is
given (paxcli.files.parse_json: bounded depth and digits); every refusal is one line in OpenAI's error
form. A client that goes away (a closed stream, or a dropped connection while it waits) frees its rows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from paxcli import files
from paxcli.errors import UserError, did_you_mean, shorten
from paxcli.loops.serve import protocol
from paxcli.loops.serve.engine import Engine, QueueFull, Request as EngineRequest, Settings, Stopped
from paxcli.loops.serve.protocol import BadRequest
from paxcli.loops.serve.text import Continuation, TokenTexts

MAX_BODY_BYTES = 32 << 20
DISCONNECT_POLL_SECONDS = 1.0   # how often a request that waits for its answer looks whether its client left


@dataclasses.dataclass
class Served:
  """What the routes serve: the engine and what turns text into its requests and back."""
  engine: Engine
  tokenizer: Any                     # paxcli.inputs.tokenizers.Tokenizer, or None (a model trained on ids)
  template: Any                      # paxcli.inputs.chat_template.ChatTemplate, or None (paxcli's own format)
  chat_prompt: Callable              # messages -> prompt ids (the model's own chat template, or paxcli's)
  models: dict                       # served name -> adapter index (0: the base)
  default_model: str
  parents: dict                      # adapter name -> its base's name
  context: int                       # MAX_SEQ_LEN
  vocab_size: int
  max_n: int
  gauges: Callable[[], dict]         # more /metrics gauges (the cache's shape)
  created: int = dataclasses.field(default_factory=lambda: int(time.time()))

  def __post_init__(self):
    self.texts = TokenTexts(self.tokenizer)
    self.eos_ids = (self.tokenizer.eos_id,) if self.tokenizer is not None and self.tokenizer.eos_id is not None else ()
    self.template_lock = asyncio.Lock()

  def adapter(self, name: Optional[str]) -> tuple[int, str]:
    """(adapter index, name) of the model a request names (none: the default one); 404 for another."""
    name = self.default_model if name is None else name
    if name not in self.models:
      raise BadRequest(f'The model {shorten(repr(name), 80)} does not exist.{did_you_mean(name, list(self.models))} '
                       f'GET /v1/models lists them.', param='model', status=404, code='model_not_found')
    return self.models[name], name

  def encode(self, prompt) -> list[int]:
    """A prompt's ids: a text as `pax decode` reads one (after BOS where the model was trained so), ids as given."""
    if isinstance(prompt, list):
      return list(prompt)
    if self.tokenizer is None:
      raise BadRequest('This model has no tokenizer (it was trained on ids): give prompts as lists of token ids.',
                       param='prompt')
    tok = self.tokenizer
    ids = tok.encode(protocol_text(prompt))
    return ([tok.bos_id] if tok.bos_first else []) + ids


def protocol_text(text: str) -> str:
  try:
    files.check_unicode(text, 'the prompt')
  except UserError as e:
    raise BadRequest(str(e), param='prompt') from None
  return text


def make_app(served: Served) -> FastAPI:
  app = FastAPI(title='pax serve', docs_url=None, redoc_url=None, openapi_url=None)

  @app.exception_handler(BadRequest)
  async def bad_request(request: Request, e: BadRequest):
    headers = {'Retry-After': '1'} if e.status in (429, 503) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)

  @app.exception_handler(Exception)
  async def internal(request: Request, e: Exception):
    served.engine.log(f'pax serve: {request.url.path}: {type(e).__name__}: {e}')
    return JSONResponse(BadRequest(f'Internal error: {type(e).__name__}: {shorten(str(e), 200)}', status=500).body(),
                        status_code=500)

  @app.get('/health')
  async def health():
    ok = served.engine.accepting
    return JSONResponse({'status': 'ok' if ok else 'unavailable'}, status_code=200 if ok else 503)

  @app.get('/metrics')
  async def metrics():
    return PlainTextResponse(served.engine.metrics.render(served.gauges()),
                             media_type='text/plain; version=0.0.4; charset=utf-8')

  @app.get('/v1/models')
  async def models():
    return {'object': 'list', 'data': [_model_card(served, name) for name in served.models]}

  @app.get('/v1/models/{name:path}')
  async def model(name: str):
    served.adapter(name)
    return _model_card(served, name)

  @app.post('/v1/completions')
  async def completions(request: Request):
    req = protocol.parse(protocol.CompletionRequest, await _json(request))
    return await _complete(served, request, req)

  @app.post('/v1/chat/completions')
  async def chat(request: Request):
    req = protocol.parse(protocol.ChatRequest, await _json(request))
    return await _chat(served, request, req)

  @app.get('/tokenizer_info')
  async def tokenizer_info():
    tok = _tokenizer(served)
    return {**tok.special_tokens(), 'model_max_length': served.context, 'vocab_size': served.vocab_size,
            'add_bos_token': bool(tok.bos_first)}

  @app.post('/tokenize')
  async def tokenize(request: Request):
    body = await _json(request)
    if not isinstance(body, dict) or not isinstance(body.get('prompt'), str):
      raise BadRequest('/tokenize takes {"prompt": TEXT, "add_special_tokens": true|false}.', param='prompt')
    unknown = set(body) - {'prompt', 'add_special_tokens', 'model'}
    if unknown:
      raise BadRequest(f'Unknown field {sorted(unknown)[0]!r} for /tokenize.')
    tok = _tokenizer(served)
    ids = tok.encode_rendered(protocol_text(body['prompt']))[0]   # special tokens' texts are those tokens
    if body.get('add_special_tokens', True) and tok.bos_first:
      ids = [tok.bos_id] + ids
    return {'tokens': ids, 'count': len(ids), 'max_model_len': served.context}

  @app.post('/detokenize')
  async def detokenize(request: Request):
    body = await _json(request)
    tokens = body.get('tokens') if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(protocol._is_int(t) and 0 <= t < served.vocab_size for t in tokens):
      raise BadRequest(f'/detokenize takes {{"tokens": [ids from 0 to {served.vocab_size - 1}]}}.', param='tokens')
    return {'prompt': _tokenizer(served).decode(tokens)}

  return app


def _tokenizer(served: Served):
  if served.tokenizer is None:
    raise BadRequest('This model has no tokenizer (it was trained on ids).', status=404)
  return served.tokenizer


def _model_card(served: Served, name: str) -> dict:
  return {'id': name, 'object': 'model', 'created': served.created, 'owned_by': 'paxcli',
          'parent': served.parents.get(name), 'max_model_len': served.context}


async def _json(request: Request) -> Any:
  """The request's body as JSON, read up to MAX_BODY_BYTES and parsed with paxcli's bounds."""
  size = request.headers.get('content-length')
  if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
    raise BadRequest(f'The request body has {int(size):,} bytes, more than this server reads '
                     f'({MAX_BODY_BYTES:,}).', status=413)
  body = bytearray()
  async for part in request.stream():
    body += part
    if len(body) > MAX_BODY_BYTES:
      raise BadRequest(f'The request body is larger than this server reads ({MAX_BODY_BYTES:,} bytes).', status=413)
  try:
    return files.parse_json(bytes(body), 'the request body')
  except UserError as e:
    raise BadRequest(str(e)) from None


# ---- the calls: engine requests and their choices' text ---------------------------------------------------


@dataclasses.dataclass
class _Choice:
  text: Continuation
  ids: list = dataclasses.field(default_factory=list)
  lps: list = dataclasses.field(default_factory=list)
  top: list = dataclasses.field(default_factory=list)
  finish: Optional[str] = None
  started: bool = False   # its first update was sent (with the prompt, for echo)


@dataclasses.dataclass
class _Update:
  """What a choice gained: its index among the call's choices, text, tokens (ids, lps, top) and finish."""
  index: int
  text: str
  ids: list
  lps: list
  top: Optional[list]
  finish: Optional[str]


class _Call:
  """One HTTP request's engine requests (one per prompt, `n` choices each) and the text of their choices."""

  def __init__(self, served: Served, prompts: list[list[int]], settings: list[Settings], n: int, adapter: int,
               stop: tuple):
    self.served, self.n = served, n
    self.queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    self.requests, self.choices, self.prompt_scores = [], [], [None] * len(prompts)
    for k, (ids, s) in enumerate(zip(prompts, settings)):
      emit = (lambda k: lambda event: loop.call_soon_threadsafe(self.queue.put_nowait, (k, event)))(k)
      self.requests.append(EngineRequest(ids, s, n, adapter, emit))
      eos = () if not s.eos_ids else s.eos_ids
      self.choices += [_Choice(Continuation(served.tokenizer, ids, stop, eos)) for _ in range(n)]

  def submit(self) -> None:
    try:
      for r in self.requests:
        self.served.engine.submit(r)
    except QueueFull:
      self.release()
      raise BadRequest(f'The server is busy: {self.served.engine.max_queue} requests wait already (--max-queue); '
                       'retry later.', status=429, code='queue_full') from None
    except Stopped:
      self.release()
      raise BadRequest('The server is shutting down; it takes no new requests.', status=503) from None

  def release(self) -> None:
    for r in self.requests:
      self.served.engine.release(r)

  @property
  def done(self) -> bool:
    return all(c.finish for c in self.choices)

  async def updates(self, request: Optional[Request] = None) -> AsyncIterator[_Update]:
    """The choices' progress until all have finished; with `request`, stops (releasing the rows) once its
    client has gone."""
    while not self.done:
      try:
        k, event = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_SECONDS if request else None)
      except asyncio.TimeoutError:
        if await request.is_disconnected():
          self.release()
          return
        continue
      update = self._take(k, event)
      if update is not None:
        yield update

  def _take(self, k: int, event: dict) -> Optional[_Update]:
    if event['kind'] == 'error':
      self.release()
      raise BadRequest(event['message'], status=500)
    if event['kind'] == 'prompt':
      self.prompt_scores[k] = event
      return None
    index = k * self.n + event['index']
    choice = self.choices[index]
    if choice.finish:   # tokens of a step past a stop string
      return None
    ids, lps, top, finish = event['ids'], event['lps'], event['top'], event['finish']
    delta, kept = choice.text.add(ids, final=finish is not None)
    ids, lps, top = ids[:kept], lps[:kept], top[:kept] if top is not None else None
    if choice.text.stopped:
      if finish is None:
        self.served.engine.release(self.requests[k], event['index'])
      finish = 'stop'
    choice.ids += ids
    choice.lps += lps
    choice.top += top or []
    choice.finish = finish
    return _Update(index, delta, ids, lps, top, finish)

  def usage(self) -> dict:
    prompt = sum(len(r.prompt_ids) for r in self.requests)
    completion = sum(len(c.ids) for c in self.choices)
    return {'prompt_tokens': prompt, 'completion_tokens': completion, 'total_tokens': prompt + completion}


def _settings(served: Served, sampling: dict, budget: int, top: int, logprobs: bool, echo: bool, ignore_eos: bool):
  return Settings(max_tokens=budget, temperature=sampling['temperature'], top_p=sampling['top_p'],
                  top_k=sampling['top_k'], seed=sampling['seed'], top_logprobs=top, logprobs=logprobs,
                  prompt_logprobs=echo and logprobs, eos_ids=() if ignore_eos else served.eos_ids)


async def _respond(call: _Call, request: Request, stream: bool, include_usage: bool, chunks: Callable,
                   whole: Callable):
  """The streamed answer (server-sent events: `chunks(update)` per update) or, when every choice has finished,
  `whole()`; the engine's rows are freed when the client goes away."""
  call.submit()
  if not stream:
    try:
      async for _ in call.updates(request):
        pass
    except BaseException:
      call.release()
      raise
    return whole() if call.done else JSONResponse({}, status_code=499)

  async def events() -> AsyncIterator[str]:
    try:
      head = chunks(None)
      if head is not None:
        yield _sse(head)
      async for update in call.updates():
        yield _sse(chunks(update))
      if include_usage:
        yield _sse(chunks('usage'))
      yield 'data: [DONE]\n\n'
    except BadRequest as e:
      yield _sse(e.body())
    finally:   # the client went away (the stream was cancelled) or the answer is complete
      call.release()

  return StreamingResponse(events(), media_type='text/event-stream', headers={'Cache-Control': 'no-cache'})


def _sse(obj: dict) -> str:
  return f'data: {json.dumps(obj, ensure_ascii=False)}\n\n'


# ---- completions --------------------------------------------------------------------------------------


async def _complete(served: Served, request: Request, req: protocol.CompletionRequest):
  adapter, name = served.adapter(req.model)
  sampling = protocol.check_sampling(req, served.vocab_size, served.max_n)
  protocol.check_unsupported(req)
  if sampling['stop'] and served.tokenizer is None:
    raise BadRequest('stop needs a tokenizer to see text; this model has none.', param='stop')
  prompts = protocol.prompts_of(req, served.vocab_size)
  ids = [served.encode(p) for p in prompts]
  texts = [p if isinstance(p, str) else _decode(served, p) for p in prompts]
  top = req.logprobs or 0
  logprobs = req.logprobs is not None
  budgets = [protocol.max_tokens(req.max_tokens, 16, len(i), served.context, 'max_tokens') for i in ids]
  if any(b == 0 for b in budgets) and not req.echo:
    raise BadRequest('max_tokens 0 asks for nothing (it is for echo: the prompt\'s log-probabilities).',
                     param='max_tokens')
  settings = [_settings(served, sampling, b, top, logprobs, req.echo, req.ignore_eos) for b in budgets]
  call = _Call(served, ids, settings, sampling['n'], adapter, sampling['stop'])
  rid, created = f'cmpl-{uuid.uuid4().hex}', int(time.time())
  head = {'id': rid, 'object': 'text_completion', 'created': created, 'model': name}
  # where each choice's next token text starts (logprobs' text_offset): after the prompt, which echo writes first
  offsets = [0 if req.echo else len(texts[i // call.n]) for i in range(len(call.choices))]

  def prefix(index: int) -> tuple[str, Optional[dict]]:
    """Echo: the prompt's text and its tokens' logprobs, before the choice's own."""
    k = index // call.n
    if not req.echo:
      return '', None
    scores = call.prompt_scores[k]
    return texts[k], (_completion_logprobs(served, call.requests[k].prompt_ids, scores['lps'], scores['top'], top,
                                           None, offsets, index) if logprobs else None)

  def chunks(update):
    if update is None:
      return None
    if update == 'usage':
      return {**head, 'choices': [], 'usage': call.usage()}
    text, lp = '', None
    choice = call.choices[update.index]
    if not choice.started:
      choice.started = True
      text, lp = prefix(update.index)
    if logprobs:
      before = call.requests[update.index // call.n].prompt_ids[-1:] + choice.ids[:len(choice.ids) - len(update.ids)]
      more = _completion_logprobs(served, update.ids, update.lps, update.top, top, before[-1], offsets, update.index)
      lp = _join_logprobs(lp, more)
    return {**head, 'choices': [{'index': update.index, 'text': text + update.text, 'logprobs': lp,
                                 'finish_reason': update.finish}]}

  def whole():
    choices = []
    for i, c in enumerate(call.choices):
      text, lp = prefix(i)
      if logprobs:
        before = call.requests[i // call.n].prompt_ids[-1]
        lp = _join_logprobs(lp, _completion_logprobs(served, c.ids, c.lps, c.top, top, before, offsets, i))
      choices.append({'index': i, 'text': text + c.text.text, 'logprobs': lp, 'finish_reason': c.finish})
    return {**head, 'choices': choices, 'usage': call.usage()}

  include_usage = bool(req.stream_options and req.stream_options.include_usage)
  return await _respond(call, request, req.stream, include_usage, chunks, whole)


def _decode(served: Served, ids: list[int]) -> str:
  return served.tokenizer.decode(ids) if served.tokenizer is not None else ''


def _completion_logprobs(served: Served, ids, lps, top, k: int, before: Optional[int], offsets: list,
                         index: int) -> dict:
  """OpenAI's completion logprobs of tokens: their texts, log-probabilities, the k best alternatives (with the
  token itself, as vLLM lists them) and where each token's text starts."""
  out = {'tokens': [], 'token_logprobs': [], 'top_logprobs': [], 'text_offset': []}
  for n, (token, lp) in enumerate(zip(ids, lps)):
    text = served.texts.text(token, before)
    out['tokens'].append(text)
    out['token_logprobs'].append(lp)
    alternatives = top[n] if top is not None and n < len(top) else None
    if alternatives is None:
      out['top_logprobs'].append(None)
    else:
      best = {served.texts.text(t, before): v for t, v in alternatives[:k]}
      best.setdefault(text, lp)
      out['top_logprobs'].append(best)
    out['text_offset'].append(offsets[index])
    offsets[index] += len(text)
    before = token
  return out


def _join_logprobs(a: Optional[dict], b: dict) -> dict:
  return b if a is None else {key: a[key] + b[key] for key in b}


# ---- chat completions ---------------------------------------------------------------------------------


async def _chat(served: Served, request: Request, req: protocol.ChatRequest):
  adapter, name = served.adapter(req.model)
  sampling = protocol.check_sampling(req, served.vocab_size, served.max_n)
  top = protocol.check_chat_logprobs(req)
  if served.tokenizer is None:
    raise BadRequest('Chat needs a tokenizer; this model was trained on ids: use /v1/completions with token ids.')
  messages = protocol.chat_messages(req)
  async with served.template_lock:   # the template's process answers one request at a time
    ids = await run_in_threadpool(served.chat_prompt, messages)
  asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
  param = 'max_completion_tokens' if req.max_completion_tokens is not None else 'max_tokens'
  budget = protocol.max_tokens(asked, None, len(ids), served.context, param)
  if budget == 0:
    raise BadRequest(f'{param} must be at least 1.', param=param)
  logprobs = bool(req.logprobs)
  call = _Call(served, [ids], [_settings(served, sampling, budget, top, logprobs, False, req.ignore_eos)],
               sampling['n'], adapter, sampling['stop'])
  head = {'id': f'chatcmpl-{uuid.uuid4().hex}', 'object': 'chat.completion.chunk', 'created': int(time.time()),
          'model': name}

  def chunks(update):
    if update is None:
      return {**head, 'choices': [{'index': i, 'delta': {'role': 'assistant', 'content': ''}, 'logprobs': None,
                                   'finish_reason': None} for i in range(len(call.choices))]}
    if update == 'usage':
      return {**head, 'choices': [], 'usage': call.usage()}
    choice = call.choices[update.index]
    before = (ids + choice.ids[:len(choice.ids) - len(update.ids)])[-1]
    lp = {'content': _chat_logprobs(served, update.ids, update.lps, update.top, top, before)} if logprobs else None
    delta = {'content': update.text} if update.text or not update.finish else {}
    return {**head, 'choices': [{'index': update.index, 'delta': delta, 'logprobs': lp,
                                 'finish_reason': update.finish}]}

  def whole():
    choices = [{'index': i, 'message': {'role': 'assistant', 'content': c.text.text},
                'logprobs': {'content': _chat_logprobs(served, c.ids, c.lps, c.top, top, ids[-1])} if logprobs else None,
                'finish_reason': c.finish} for i, c in enumerate(call.choices)]
    return {**head, 'object': 'chat.completion', 'choices': choices, 'usage': call.usage()}

  include_usage = bool(req.stream_options and req.stream_options.include_usage)
  return await _respond(call, request, req.stream, include_usage, chunks, whole)


def _chat_logprobs(served: Served, ids, lps, top, k: int, before: Optional[int]) -> list[dict]:
  out = []
  for n, (token, lp) in enumerate(zip(ids, lps)):
    text = served.texts.text(token, before)
    alternatives = top[n] if top is not None and n < len(top) else []
    out.append({'token': text, 'logprob': lp, 'bytes': list(text.encode('utf-8')),
                'top_logprobs': [{'token': served.texts.text(t, before), 'logprob': v,
                                  'bytes': list(served.texts.text(t, before).encode('utf-8'))}
                                 for t, v in alternatives[:k]]})
    before = token
  return out
