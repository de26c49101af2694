"""`pax serve`: a real server process on 127.0.0.1, queried with the official openai client and raw HTTP.

One tiny trained job and one server for the module: the openai client (completions and chat, streamed and
not) gets `pax decode`'s tokens (greedy, and sampled with a seed); echo's prompt log-probabilities are
`pax score`'s; bad requests are one line of 4xx and the server goes on; /metrics parses with
prometheus_client's own parser; a client that leaves mid-stream frees its row; 64 clients at once are each
answered or refused with 429; SIGTERM lets a running request finish, then the process exits 0.
"""

import json
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tiny_lm import EXP, KNOBS

pytest.importorskip('fastapi')
openai = pytest.importorskip('openai')
httpx = pytest.importorskip('httpx')

# Fewer steps than tiny_lm's: the tokens are compared with pax decode's, not judged.
TRAIN = [k for k in KNOBS if not k.startswith(('NUM_TRAIN_STEPS', 'SAVE_INTERVAL'))] + [
    'NUM_TRAIN_STEPS=60', 'SAVE_INTERVAL_STEPS=60']
PROMPTS = ['Return the number of', 'If the optional argument']


class Server:
  """A `pax serve` process; its stderr collected in `lines`."""

  def __init__(self, args, cwd, timeout=600):
    self.proc = subprocess.Popen([sys.executable, '-m', 'paxcli.cli.app', 'serve', '--port', '0', *args], cwd=cwd,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    self.lines, self.url = [], None
    ready = threading.Event()

    def read():
      for line in self.proc.stderr:
        self.lines.append(line)
        found = re.search(r'Serving .* on (http://\S+/v1)', line)
        if found:
          self.url = found.group(1)
          ready.set()
      ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(timeout)
    assert self.url, ''.join(self.lines)
    self.base = self.url[:-len('/v1')]

  def client(self, **kw):
    return openai.OpenAI(base_url=self.url, api_key='unused', max_retries=0, **kw)

  def metric(self, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    for family in text_string_to_metric_families(httpx.get(f'{self.base}/metrics').text):
      for sample in family.samples:
        if sample.name == name:
          return sample.value
    raise KeyError(name)

  def stop(self):
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
      try:
        self.proc.wait(120)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope='module')
def job(tmp_path_factory):
  from paxcli.cli.app import main
  base = tmp_path_factory.mktemp('serve')
  try:
    main(['train', '--exp', EXP, *[a for k in TRAIN for a in ('--set', k)], '--job-log-dir', str(base / 'job')])
  except SystemExit as e:
    assert not e.code
  return base


@pytest.fixture(scope='module')
def server(job):
  # A relative job directory from the job's parent, as a user in that directory would type it.
  s = Server(['--job-log-dir', 'job', '--slots', '8', '--max-queue', '8', '--max-n', '4', '--steps', '4'], cwd=job)
  yield s
  s.stop()


def _decode(job, prompts, **kw):
  import paxcli
  from rich.console import Console
  return paxcli.decode(EXP, overrides=TRAIN, job_dir=str(job / 'job'), prompt=list(prompts), console=Console(quiet=True),
                       output=str(job / f'decoded_{time.monotonic_ns()}.jsonl'), **kw)


def test_the_openai_client_gets_pax_decodes_greedy_tokens(job, server):
  expected = _decode(job, PROMPTS, max_decode_steps=10)
  client = server.client()
  assert [m.id for m in client.models.list().data] == ['job']
  for prompt, record in zip(PROMPTS, expected):
    want = record['decoded']
    got = client.completions.create(model='job', prompt=prompt, max_tokens=10, temperature=0)
    assert got.choices[0].text == want and got.choices[0].finish_reason == record['stop_reason'].replace(
        'max_steps', 'length').replace('eos', 'stop')
    assert got.usage.prompt_tokens == len(record['prompt_ids'])
    assert got.usage.completion_tokens == record['num_decoded_tokens']
    streamed = client.completions.create(model='job', prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                         stream_options={'include_usage': True})
    parts = list(streamed)
    assert ''.join(c.choices[0].text for c in parts if c.choices) == want
    assert parts[-1].usage.completion_tokens == record['num_decoded_tokens']
  # The ids themselves, prompts given as ids: the same tokens as pax decode's decoded_ids.
  ids = expected[0]['prompt_ids']
  got = client.completions.create(model='job', prompt=ids, max_tokens=10, temperature=0, logprobs=0)
  assert got.usage.completion_tokens == len(expected[0]['decoded_ids'])
  lps = got.choices[0].logprobs.token_logprobs
  assert lps == pytest.approx(expected[0]['token_logprobs'], abs=1e-4)


def test_chat_is_pax_decode_of_the_chat_prompt(job, server):
  from paxcli.inputs import tokenizers
  tok = tokenizers.load(str(job / 'job' / 'tokenizer' / 'spm.model'))
  messages = [{'role': 'system', 'content': 'Docstrings.'}, {'role': 'user', 'content': 'Return the number of'}]
  # paxcli's own chat format (paxcli.inputs.sft): the tiny tokenizer ships no template.
  ids = tok.encode('<|system|>\nDocstrings.\n') + tok.encode('<|user|>\nReturn the number of\n') + tok.encode(
      '<|assistant|>\n')
  import paxcli
  from rich.console import Console
  record = paxcli.decode(EXP, overrides=TRAIN, job_dir=str(job / 'job'), prompt_ids=[','.join(map(str, ids))],
                         max_decode_steps=8, console=Console(quiet=True), output=str(job / 'chat.jsonl'))[0]
  want = tok.decode(record['decoded_ids'][:-1] if record['stop_reason'] == 'eos' else record['decoded_ids'])
  client = server.client()
  got = client.chat.completions.create(model='job', messages=messages, max_tokens=8, temperature=0)
  assert got.usage.prompt_tokens == len(ids)
  assert got.choices[0].message.content.strip() == want.strip()
  chunks = list(client.chat.completions.create(model='job', messages=messages, max_tokens=8, temperature=0,
                                               stream=True))
  assert chunks[0].choices[0].delta.role == 'assistant'
  assert ''.join(c.choices[0].delta.content or '' for c in chunks) == got.choices[0].message.content
  assert chunks[-1].choices[0].finish_reason == got.choices[0].finish_reason


def test_sampling_with_a_seed_gives_pax_decodes_samples(job, server):
  expected = _decode(job, PROMPTS[:1], max_decode_steps=8, temperature=0.9, top_p=0.95, top_k=40, seed=7,
                     num_samples=2)
  got = server.client().completions.create(model='job', prompt=PROMPTS[0], max_tokens=8, temperature=0.9,
                                           top_p=0.95, seed=7, n=2, extra_body={'top_k': 40})
  assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [r['decoded'] for r in expected]


def test_stop_strings_logprobs_and_echo(job, server):
  client = server.client()
  whole = client.completions.create(model='job', prompt=PROMPTS[1], max_tokens=12, temperature=0).choices[0].text
  stop = whole[len(whole) // 2:len(whole) // 2 + 2]   # whatever the tiny model says, its middle
  assert len(stop) == 2
  got = client.completions.create(model='job', prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=[stop])
  assert got.choices[0].text == whole[:whole.index(stop)] and got.choices[0].finish_reason == 'stop'
  streamed = ''.join(c.choices[0].text for c in client.completions.create(
      model='job', prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=stop, stream=True))
  assert streamed == got.choices[0].text
  # Echo: the prompt's own log-probabilities, as `pax score` computes them.
  import paxcli
  from rich.console import Console
  requests = job / 'score.jsonl'
  requests.write_text(json.dumps({'context': 'Return the', 'continuation': ' number of items'}) + '\n')
  scored = paxcli.score(str(requests), EXP, overrides=TRAIN, job_dir=str(job / 'job'), console=Console(quiet=True),
                        output=str(job / 'scored.jsonl'))[0]
  echo = client.completions.create(model='job', prompt='Return the number of items', max_tokens=0, echo=True,
                                   logprobs=1, temperature=0)
  lps = echo.choices[0].logprobs
  assert echo.choices[0].text == 'Return the number of items' and lps.token_logprobs[0] is None
  n = len(scored['token_logprobs'])
  assert lps.token_logprobs[-n:] == pytest.approx(scored['token_logprobs'], abs=1e-4)
  greedy = all(lp == max(top.values()) for lp, top in zip(lps.token_logprobs[-n:], lps.top_logprobs[-n:]))
  assert greedy == scored['is_greedy']


def test_bad_requests_are_one_line_of_4xx_and_the_server_goes_on(server):
  url = f'{server.url}/completions'
  cases = [(b'{"prompt": "x", "max_tokens": 4', 400, 'not valid JSON'),
           (b'[1, 2]', 400, 'JSON object'),
           (b'{"prompt": "x", "max_tokens": 4, "frobnicate": 1}', 400, "Unknown field 'frobnicate'"),
           (b'{"prompt": "x", "max_tokens": 100000000}', 400, 'maximum context length is 64'),
           (b'{"prompt": "x", "max_tokens": 4, "n": 99}', 400, 'n must be between 1 and 4'),
           (b'{"prompt": "x", "max_tokens": "4"}', 400, 'max_tokens'),
           (b'{"prompt": [1, 99999], "max_tokens": 4}', 400, 'outside the vocabulary'),
           (b'{"prompt": "x", "temperature": -1}', 400, 'temperature'),
           (b'{"prompt": "x", "model": "jbo"}', 404, "Did you mean 'job'"),
           (b'{"prompt": "x", "seed": -3}', 400, 'seed'),
           (b'{"prompt": "' + b'x ' * 200 + b'", "max_tokens": 4}', 400, 'maximum context length')]
  for body, status, words in cases:
    r = httpx.post(url, content=body, headers={'content-type': 'application/json'})
    assert r.status_code == status, (body[:80], r.text)
    message = r.json()['error']['message']
    assert words in message and '\n' not in message, message
  r = httpx.post(f'{server.url}/chat/completions', json={'messages': [{'role': 'user', 'content': 'x'}], 'tools': []})
  assert r.status_code == 400 and "Unknown field 'tools'" in r.json()['error']['message']
  with pytest.raises(openai.BadRequestError):
    server.client().completions.create(model='job', prompt='x', max_tokens=4, n=9)
  got = server.client().completions.create(model='job', prompt=PROMPTS[0], max_tokens=3, temperature=0)
  assert got.usage.completion_tokens == 3


def test_models_health_metrics_and_the_tokenizer_routes(job, server):
  from paxcli.inputs import tokenizers
  assert httpx.get(f'{server.base}/health').json() == {'status': 'ok'}
  card = httpx.get(f'{server.url}/models/job').json()
  assert card['id'] == 'job' and card['max_model_len'] == 64
  before = server.metric('pax_serve_generation_tokens_total')
  server.client().completions.create(model='job', prompt=PROMPTS[0], max_tokens=5, temperature=0)
  assert server.metric('pax_serve_generation_tokens_total') == before + 5
  assert server.metric('pax_serve_queue_depth') == 0
  assert server.metric('pax_serve_time_to_first_token_seconds_count') >= 1
  assert server.metric('pax_serve_kv_cache_max_rows') == 8
  ids = httpx.post(f'{server.base}/tokenize', json={'prompt': 'Return the', 'add_special_tokens': False}).json()
  assert httpx.post(f'{server.base}/detokenize', json={'tokens': ids['tokens']}).json()['prompt'] == 'Return the'
  info = httpx.get(f'{server.base}/tokenizer_info').json()
  eos = tokenizers.load(str(job / 'job' / 'tokenizer' / 'spm.model')).eos_id
  assert httpx.post(f'{server.base}/tokenize', json={'prompt': info['eos_token'], 'add_special_tokens': False}
                    ).json()['tokens'] == [eos]   # a special token's text is that token, as lm-eval reads its id


def _wait_for(predicate, seconds=120):
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline:
    if predicate():
      return True
    time.sleep(0.2)
  return False


def test_a_client_that_leaves_mid_stream_frees_its_row(server):
  before = _released(server)
  with httpx.stream('POST', f'{server.url}/completions', json={'prompt': PROMPTS[0], 'max_tokens': 60,
                                                              'stream': True, 'ignore_eos': True}) as r:
    for line in r.iter_lines():
      if line.startswith('data: {'):
        break   # one chunk, then the connection closes
  assert _wait_for(lambda: _released(server) == before + 1)
  assert _wait_for(lambda: server.metric('pax_serve_running_sequences') == 0)


def _released(server) -> float:
  return _count(server, 'released')


def _count(server, outcome: str) -> float:
  """pax_serve_requests_total{outcome=...}, read with prometheus_client's parser."""
  from prometheus_client.parser import text_string_to_metric_families
  for family in text_string_to_metric_families(httpx.get(f'{server.base}/metrics').text):
    for sample in family.samples:
      if sample.name == 'pax_serve_requests_total' and sample.labels.get('outcome') == outcome:
        return sample.value
  raise KeyError(outcome)


def test_64_clients_at_once_are_answered_or_refused_with_429(server):
  """8 rows and 8 places in the queue: of 64 clients at once, some wait and some are refused; every answer
  is whole."""
  expected = server.client().completions.create(model='job', prompt=PROMPTS[1], max_tokens=6, temperature=0)

  def one(_):
    r = httpx.post(f'{server.url}/completions', json={'prompt': PROMPTS[1], 'max_tokens': 6, 'temperature': 0},
                   timeout=600)
    return r.status_code, r.json()

  with ThreadPoolExecutor(64) as pool:
    results = list(pool.map(one, range(64)))
  codes = [c for c, _ in results]
  assert set(codes) <= {200, 429} and 200 in codes and 429 in codes, codes
  for code, body in results:
    if code == 200:
      assert body['choices'][0]['text'] == expected.choices[0].text
    else:
      assert 'busy' in body['error']['message']
  assert _wait_for(lambda: server.metric('pax_serve_running_sequences') == 0)
  assert _count(server, 'refused') == codes.count(429)


def test_sigterm_lets_running_requests_finish_then_exits(server):
  """Last in the module: the module's server is stopped here. A stream is read to its first chunk, SIGTERM
  sent, then the rest read: every token comes, then the process exits 0 and listens no more."""
  stream = server.client(timeout=600).completions.create(
      model='job', prompt=PROMPTS[0], max_tokens=50, temperature=0, stream=True,
      stream_options={'include_usage': True}, extra_body={'ignore_eos': True})
  chunks = iter(stream)
  first = next(chunks)
  server.proc.send_signal(signal.SIGTERM)
  rest = list(chunks)
  assert first.choices[0].text is not None and rest[-1].usage.completion_tokens == 50
  assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == 'length'
  assert server.proc.wait(120) == 0
  assert any('Stopped' in line for line in server.lines), ''.join(server.lines)
  with pytest.raises(httpx.ConnectError):
    httpx.get(f'{server.base}/health')
