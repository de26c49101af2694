"""`pax serve` against `transformers serve` (continuous batching on) and `pax decode`'s batches, side by side.

  .venv/bin/python benchmarks/serve.py [--work /tmp/paxcli-serve-bench] [--concurrency 1,8,32]
                                       [--requests-per-client 2] [--prompt-tokens 64] [--max-tokens 64]
                                       [--rounds 2] [--slots 32] [--threads 2]

One Llama (12 layers, d768, GQA 12/4, MLP 2048, tied embeddings; about 100M parameters) with random
weights and a byte-level BPE tokenizer trained on the standard library's docstrings (vocabulary 24,576:
the tokenizer's 23,709 ids, padded), written once in Hugging Face's layout (`--work`/hf) and converted
with `pax checkpoint convert --from hf` (`--work`/pax). Both servers run at once on 127.0.0.1, each
warmed up by a few requests (its compilations are not timed); each level of concurrency then runs against
one server and the other in turn, `--rounds` times, the order alternating: C clients each send
`--requests-per-client` streamed completions one after another (greedy, `--max-tokens` new tokens, prompts
of about `--prompt-tokens` tokens cut from docstrings, a different one each). Output tokens/s is all
the new tokens over the wall time of the level; time to first token (TTFT) is from a request's send to
its first streamed text, p50 and p99 over its requests. `pax decode` (batch mode, the same prompts, C
per batch, compilation excluded) reports tokens/s over its prefill and decode time, and as a prompt's
TTFT the time until its batch's first token (the batches before it, then its own prefill).

Every process is pinned to the same `--threads` CPUs. Machines are shared and noisy: compare within one
run; the table gives each round's best. The last column is pax serve over transformers serve.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np

import machine   # benchmarks/machine.py: the processor beside the table

CONFIG = {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'vocab_size': 24576, 'hidden_size': 768,
          'intermediate_size': 2048, 'num_hidden_layers': 12, 'num_attention_heads': 12, 'num_key_value_heads': 4,
          'head_dim': 64, 'max_position_embeddings': 512, 'rms_norm_eps': 1e-6, 'rope_theta': 10000.0,
          'tie_word_embeddings': True, 'hidden_act': 'silu', 'attention_bias': False, 'mlp_bias': False,
          'attention_dropout': 0.0, 'torch_dtype': 'float32', 'bos_token_id': 0, 'eos_token_id': 1}
PAX = [sys.executable, '-m', 'paxcli.cli.app']


def prepare(work: str) -> tuple[str, str, list[str]]:
  """(HF directory, paxcli job directory, docstrings), made once under `work`."""
  from paxcli.inputs import corpus
  from paxcli.recipes import finetune
  texts = [t for _, t in corpus.stdlib_docstrings()]
  hf, pax = os.path.join(work, 'hf'), os.path.join(work, 'pax')
  if not os.path.isfile(os.path.join(hf, 'model.safetensors')):
    os.makedirs(hf, exist_ok=True)
    finetune.write_tokenizer(hf, texts, 32000)
    finetune.write_tiny_llama(hf, 0, CONFIG)
  if not os.path.isdir(os.path.join(pax, 'checkpoints')):
    subprocess.run(PAX + ['checkpoint', 'convert', '--from', 'hf', hf, pax], check=True)
  return hf, pax, texts


def prompts(texts: list[str], tokens: int, n: int, hf: str) -> list[str]:
  """`n` different prompts of about `tokens` tokens (whole words), cut from the docstrings."""
  import tokenizers
  tok = tokenizers.Tokenizer.from_file(os.path.join(hf, 'tokenizer.json'))
  joined = ' '.join(' '.join(t.split()) for t in texts)
  out, at = [], 0
  while len(out) < n:
    words = joined[at:at + tokens * 8].split(' ')[1:]
    ids = tok.encode(' '.join(words), add_special_tokens=False).ids[:tokens]
    out.append(tok.decode(ids).strip())
    at += tokens * 8
  return out


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def start_pax(job: str, slots: int, log: str) -> tuple[subprocess.Popen, str]:
  out = open(log, 'w')
  proc = subprocess.Popen(PAX + ['serve', '--job-log-dir', job, '--port', '0', '--slots', str(slots), '--max-queue',
                                 '1024'], stdout=out, stderr=subprocess.STDOUT)
  while True:
    text = open(log).read()
    found = re.search(r'on (http://\S+)/v1', text)
    if found:
      return proc, found.group(1)
    if proc.poll() is not None:
      raise SystemExit(f'pax serve stopped:\n{text}')
    time.sleep(1)


def start_transformers(hf: str, log: str) -> tuple[subprocess.Popen, str]:
  """`transformers serve` from this venv's transformers (its console script may name another Python)."""
  port = free_port()
  code = 'import sys; from transformers.cli.transformers import main; sys.argv = ["transformers", *sys.argv[1:]]; main()'
  proc = subprocess.Popen([sys.executable, '-c', code, 'serve', hf, '--continuous-batching', '--device', 'cpu',
                           '--dtype', 'float32', '--port', str(port), '--host', '127.0.0.1'],
                          stdout=open(log, 'w'), stderr=subprocess.STDOUT)
  import httpx
  url = f'http://127.0.0.1:{port}'
  while True:
    try:
      if httpx.get(f'{url}/health', timeout=5).status_code == 200:
        return proc, url
    except httpx.HTTPError:
      pass
    if proc.poll() is not None:
      raise SystemExit(f'transformers serve stopped:\n{open(log).read()}')
    time.sleep(2)


async def one_request(client, url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
  """(seconds to the first streamed text, seconds in all, new tokens) of one streamed completion."""
  body = {'model': model, 'prompt': prompt, 'max_tokens': max_tokens, 'temperature': 0, 'stream': True,
          'stream_options': {'include_usage': True}}
  start, first, tokens, chunks = time.perf_counter(), None, None, 0
  async with client.stream('POST', f'{url}/v1/completions', json=body, timeout=3600) as r:
    r.raise_for_status()
    async for line in r.aiter_lines():
      if not line.startswith('data: {'):
        continue
      event = json.loads(line[len('data: '):])
      if event.get('usage'):
        tokens = event['usage']['completion_tokens']
      for choice in event.get('choices') or []:
        if choice.get('text'):
          chunks += 1
          if first is None:
            first = time.perf_counter() - start
  return first or 0.0, time.perf_counter() - start, tokens if tokens is not None else chunks


async def load(url: str, model: str, clients: int, texts: list[str], max_tokens: int) -> dict:
  """`clients` clients at once, each sending its share of `texts` one after another."""
  import httpx
  per = [texts[i::clients] for i in range(clients)]
  async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 4)) as client:
    async def run(mine):
      return [await one_request(client, url, model, p, max_tokens) for p in mine]

    start = time.perf_counter()
    results = [r for rs in await asyncio.gather(*(run(m) for m in per)) for r in rs]
    wall = time.perf_counter() - start
  ttft = [r[0] for r in results]
  return {'tokens_per_s': sum(r[2] for r in results) / wall, 'ttft_p50': percentile(ttft, 50),
          'ttft_p99': percentile(ttft, 99), 'tokens': sum(r[2] for r in results)}


def compile_seconds(url: str) -> float:
  """pax serve's compilation time so far (its /metrics): a level that compiles is not measuring serving."""
  import httpx
  for line in httpx.get(f'{url}/metrics', timeout=30).text.splitlines():
    if line.startswith('pax_serve_compile_seconds '):
      return float(line.split()[1])
  return float('nan')


def percentile(xs, q):
  return float(np.percentile(np.asarray(xs), q)) if xs else float('nan')


DECODE = '''
import json, sys, time
import paxcli
from rich.console import Console
texts, batch, steps, job, out = json.load(open(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
paxcli.decode(job_dir=job, prompt=texts[:batch], max_decode_steps=steps, batch_size=batch, ignore_eos=True,
              console=Console(quiet=True), output=out, force=True)   # compiles
d = paxcli.decode(job_dir=job, prompt=texts, max_decode_steps=steps, batch_size=batch, ignore_eos=True,
                  console=Console(quiet=True), output=out, force=True)
print(json.dumps(d.stats))
'''


def pax_decode(job: str, texts: list[str], batch: int, max_tokens: int, work: str) -> dict:
  """pax decode's batches of the same prompts (compilation excluded): tokens/s over prefill and decode, and each
  prompt's wait for its batch's first token."""
  path = os.path.join(work, 'prompts.json')
  json.dump(texts, open(path, 'w'))
  out = subprocess.run([sys.executable, '-c', DECODE, path, str(batch), str(max_tokens), job,
                        os.path.join(work, 'decoded.jsonl')], capture_output=True, text=True, check=True)
  stats = json.loads(out.stdout.strip().splitlines()[-1])
  batches = -(-len(texts) // batch)
  per_batch = (stats['prefill_s'] + stats['decode_s']) / batches
  prefill = stats['prefill_s'] / batches
  ttft = [k * per_batch + prefill for k in range(batches) for _ in range(min(batch, len(texts) - k * batch))]
  return {'tokens_per_s': stats['decode_tokens'] / (stats['prefill_s'] + stats['decode_s']),
          'ttft_p50': percentile(ttft, 50), 'ttft_p99': percentile(ttft, 99), 'tokens': stats['decode_tokens']}


def best(runs: list[dict]) -> dict:
  return max(runs, key=lambda r: r['tokens_per_s'])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--work', default='/tmp/paxcli-serve-bench')
  parser.add_argument('--concurrency', default='1,8,32')
  parser.add_argument('--requests-per-client', type=int, default=2)
  parser.add_argument('--prompt-tokens', type=int, default=64)
  parser.add_argument('--max-tokens', type=int, default=64)
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--slots', type=int, default=32)
  parser.add_argument('--threads', type=int, default=2)
  parser.add_argument('--skip-decode', action='store_true', help='Leave pax decode out.')
  args = parser.parse_args()
  os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.threads])   # the servers inherit it
  os.environ.setdefault('OMP_NUM_THREADS', str(args.threads))
  os.makedirs(args.work, exist_ok=True)
  import httpx
  from rich.console import Console
  from rich.table import Table
  console = Console()
  hf, job, texts = prepare(args.work)
  levels = [int(c) for c in args.concurrency.split(',')]
  n = max(levels) * args.requests_per_client
  asked = prompts(texts, args.prompt_tokens, n * 2, hf)
  pax, pax_url = start_pax(job, args.slots, os.path.join(args.work, 'pax_serve.log'))
  hf_proc, hf_url = start_transformers(hf, os.path.join(args.work, 'transformers_serve.log'))
  servers = {'pax serve': (pax_url, 'pax'), 'transformers serve': (hf_url, hf)}
  results = {(name, c): [] for name in list(servers) + ['pax decode'] for c in levels}
  gone = {}   # server -> where it stopped answering
  try:
    for name, (url, model) in servers.items():   # warm-up: compilations and first-use costs, untimed
      for c in levels:   # as many clients as the level has: pax serve compiles each shape its cache takes
        asyncio.run(load(url, model, c, asked[n:n + c], 4))
    for r in range(args.rounds):
      for c in levels:
        texts_c = asked[:c * args.requests_per_client]
        order = list(servers) if r % 2 == 0 else list(servers)[::-1]
        for name in order:
          url, model = servers[name]
          if name in gone:
            continue
          try:
            compiled = compile_seconds(url) if name == 'pax serve' else 0.0
            got = asyncio.run(load(url, model, c, texts_c, args.max_tokens))
          except httpx.HTTPError as e:   # a server that died (e.g. killed for memory) leaves the others measured
            gone[name] = f'{c} clients: {type(e).__name__}'
            console.print(f'round {r + 1}, {c} clients, {name}: stopped answering ({type(e).__name__}); see its log')
            continue
          results[name, c].append(got)
          more = f', {compile_seconds(url) - compiled:.1f} s compiling' if name == 'pax serve' else ''
          console.print(f'round {r + 1}, {c} clients, {name}: {got["tokens_per_s"]:,.1f} tokens/s, TTFT p50 '
                        f'{got["ttft_p50"]:.2f} s, p99 {got["ttft_p99"]:.2f} s ({got["tokens"]} tokens{more})')
        if not args.skip_decode:
          got = pax_decode(job, texts_c, c, args.max_tokens, args.work)
          results['pax decode', c].append(got)
          console.print(f'round {r + 1}, batch {c}, pax decode: {got["tokens_per_s"]:,.1f} tokens/s')
  finally:
    for proc in (pax, hf_proc):
      proc.send_signal(signal.SIGTERM)
    for proc in (pax, hf_proc):
      try:
        proc.wait(120)
      except subprocess.TimeoutExpired:
        proc.kill()
  table = Table(title=f'Serving a {CONFIG["num_hidden_layers"]}-layer d{CONFIG["hidden_size"]} Llama (float32, random '
                      f'weights) on {args.threads} CPUs of a {machine.processor()}: ~{args.prompt_tokens}-token prompts, '
                      f'{args.max_tokens} new tokens, greedy; best of {args.rounds} rounds')
  table.add_column('clients', justify='right')
  for name in ('pax serve', 'transformers serve', 'pax decode'):
    table.add_column(f'{name}\ntokens/s', justify='right')
    table.add_column(f'{name}\nTTFT p50 / p99 s', justify='right')
  table.add_column('pax serve /\ntransformers', justify='right')
  for c in levels:
    row = [str(c)]
    for name in ('pax serve', 'transformers serve', 'pax decode'):
      if results[name, c]:
        b = best(results[name, c])
        row += [f'{b["tokens_per_s"]:,.1f}', f'{b["ttft_p50"]:.2f} / {b["ttft_p99"]:.2f}']
      else:
        row += ['-', '-']
    both = results['pax serve', c] and results['transformers serve', c]
    ratio = (f"{best(results['pax serve', c])['tokens_per_s'] / best(results['transformers serve', c])['tokens_per_s']:.2f}x"
             if both else '-')
    table.add_row(*row, ratio)
  console.print(table)
  for name, where in gone.items():
    console.print(f'{name} stopped answering at {where} (its log: {args.work}).')
  console.print(f'{os.cpu_count()} CPUs on the machine, load average {os.getloadavg()[0]:.1f} at the end.')


if __name__ == '__main__':
  main()
