"""`pax serve` as a function: a resolved config, a job directory and options in; an HTTP server until SIGTERM.

    serve(resolved, job_dir, ServeOptions(port=8000), log=print)

Everything that can fail before serving does, in one line, before the port is announced: the model
(a DecodingModel), the checkpoint and its weights, the adapters and their base, the tokenizer and
its chat template, the port. The device pieces are then compiled for the shortest shapes with one
request through the engine, so that the first client does not wait for a compile; the line
`Serving ... on http://HOST:PORT/v1` says the server is ready. SIGTERM (or Ctrl-C) stops taking
requests (new ones get 503), lets those taken finish (at most `drain_timeout` seconds), then exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import socket
import threading
from typing import Callable, Optional

import uvicorn

from paxcli.errors import UserError, shorten
from paxcli.inputs import chat_template, packing, sft
from paxcli.jobdir import restore
from paxcli.jobdir import tokenizer as tok_lib
from paxcli.loops.serve import adapters as adapters_lib
from paxcli.loops.serve.app import Served, make_app
from paxcli.loops.serve.engine import Engine, Request, Settings
from paxcli.loops.serve.options import ServeOptions
from paxcli.loops.serve.slots import Slots
from paxcli.models.base import DecodingModel
from paxcli.runtime import engine as engine_lib


def serve(resolved, job_dir: str, opts: ServeOptions, resolve_with: Callable[[list], object],
          log: Callable[[str], None] = print, ready: Optional[Callable[[str], None]] = None) -> None:
  """Serves the job's model (and adapters) until SIGTERM; `ready(url)` once it answers (default: a line on `log`).
  resolve_with(overrides): the job's config with more --set overrides (the adapters' LoRA settings)."""
  opts.check()
  models = adapters_lib.load(resolved, job_dir, opts.name, opts.loras, opts.step, log, resolve_with)
  setup = models.setup
  if not isinstance(setup.model, DecodingModel):
    raise UserError(f"This experiment's model, a {type(setup.model).__name__}, does not generate tokens: serving "
                    'needs a paxcli.models.DecodingModel (init_cache and extend), such as the LanguageModel.')
  model = setup.model.with_fprop_dtype(opts.dtype) if opts.dtype else setup.model
  tokenizer = tok_lib.load(job_dir, resolved.train_dataset())
  template = chat_template.of_tokenizer(tokenizer) if tokenizer is not None else None
  sock = _bind(opts.host, opts.port)
  slots = Slots(dataclasses.replace(setup, model=model), models.params, max_rows=opts.slots,
                chunk=opts.prefill_chunk, max_steps=opts.steps, adapters=models.adapters,
                adapter_leads=models.leads)
  engine = Engine(slots, max_queue=opts.max_queue, log=log)
  engine.start()
  _warm_up(engine, slots)
  served = Served(engine=engine, tokenizer=tokenizer, template=template,
                  chat_prompt=chat_prompt(tokenizer, template), models=models.names, default_model=models.default,
                  parents=models.parents, context=model.max_seq_len, vocab_size=model.vocab_size,
                  max_n=min(opts.max_n, slots.max_rows), gauges=lambda: _gauges(slots))
  host, port = sock.getsockname()[:2]
  url = f'http://{_shown_host(host)}:{port}/v1'
  say = ready or (lambda u: log(f'Serving {", ".join(models.names)} (step {models.step}) on {u}: {slots.max_rows} '
                                f'rows of up to {slots.capacity:,} tokens, {opts.max_queue} requests may wait. '
                                'SIGTERM or Ctrl-C drains and stops.'))
  try:
    _run(make_app(served), sock, opts, engine, lambda: say(url))
  finally:
    engine.stop(drain=True, timeout=opts.drain_timeout)
    if template is not None:
      template.close()
  done = engine.metrics.outcomes
  log(f'Stopped: {done["done"]:,} requests answered, {done["released"]:,} ended early by their clients, '
      f'{done["refused"]:,} refused.')


def chat_prompt(tokenizer, template) -> Callable[[list[dict]], list[int]]:
  """messages -> the prompt's ids: the model's own chat template with the generation prompt (its special tokens
  as the template writes them), else paxcli's (paxcli.inputs.sft, tokenized as training tokenizes it)."""
  where = "the request's messages"

  def with_template(messages: list[dict]) -> list[int]:
    return tokenizer.encode_rendered(template.render(messages, add_generation_prompt=True, where=where))[0]

  def own(messages: list[dict]) -> list[int]:
    chunks = sft.generation_prompt(messages, where)
    bos = tokenizer.bos_id if tokenizer.bos_first else None
    tokens, _ = packing.token_weights(chunks, [tokenizer.encode(c.text) for c in chunks], tokenizer.eos_id, bos)
    return tokens.tolist()

  return with_template if template is not None else own


def _warm_up(engine: Engine, slots: Slots) -> None:
  """One short request through the engine: the pieces the first requests need compile now."""
  done = threading.Event()
  prompt = [0] * 20
  engine.submit(Request(prompt, Settings(max_tokens=2), 1, 0,
                        lambda event: done.set() if event.get('finish') or event['kind'] == 'error' else None))
  done.wait()


def _gauges(slots: Slots) -> dict:
  return {'kv_cache_rows': ('Rows the KV cache holds now (it grows and shrinks with the rows in use).', slots.rows),
          'kv_cache_max_rows': ('Rows the KV cache may hold (--slots).', slots.max_rows),
          'kv_cache_slots_per_row': ('Token slots per row of the KV cache now.', slots.length),
          'kv_cache_max_slots_per_row': ('Token slots a row may hold.', slots.capacity),
          'compile_seconds': ('Seconds spent compiling the device pieces (once per shape).', slots.compile_seconds)}


def _bind(host: str, port: int) -> socket.socket:
  """The listening socket, bound here so that a port in use is one line before anything is compiled."""
  family = socket.AF_INET6 if ':' in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((host, port))
  except OSError as e:
    sock.close()
    raise UserError(f'Cannot listen on {shorten(host, 80)} port {port}: {e.strerror or e} (--host, --port; --port 0 '
                    'takes any free port).') from None
  sock.set_inheritable(True)
  return sock


def _shown_host(host: str) -> str:
  return f'[{host}]' if ':' in host else host


def _run(app, sock: socket.socket, opts: ServeOptions, engine: Engine, on_ready: Callable[[], None]) -> None:
  """uvicorn on `sock` until SIGTERM or SIGINT; the engine refuses new requests from the signal on."""
  class Server(uvicorn.Server):
    def handle_exit(self, sig, frame):
      engine.refuse()   # new requests get 503 while uvicorn waits for the running ones
      super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
      """uvicorn's handlers, without its raising the signal again at the end: a drained server exits 0."""
      if threading.current_thread() is not threading.main_thread():
        yield
        return
      before = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
      try:
        yield
      finally:
        for sig, handler in before.items():
          signal.signal(sig, handler)

    async def startup(self, sockets=None):
      await super().startup(sockets=sockets)
      if self.started:
        on_ready()

  config = uvicorn.Config(app, log_level='warning', access_log=opts.access_log,
                          timeout_graceful_shutdown=opts.drain_timeout, lifespan='off')
  sock.listen(2048)
  Server(config).run(sockets=[sock])
