"""The whole GPU check in one command: `make bench-gpu` (or .venv/bin/python benchmarks/gpu.py [--out FILE]).

A GPU is lent now and then, for minutes: this runs everything at once (about 6 minutes on one H100) and
writes one table and one JSON file (bench-gpu.json). It needs an NVIDIA GPU; where `nvidia-smi` finds
one but jax has no CUDA backend it installs the CUDA build of the jax version the project pins
(`pip install "jax[cuda12]==<that version>"`) into this venv first. Without a GPU it stops with one
line saying so. On the first GPU, each figure from a process of its own (the GPU to itself):

  - bench.Llama1B MFU at PERCORE_BATCH_SIZE 8 and 16, cuDNN attention on (ATTENTION_IMPL=auto) and off
    (einsum), bf16; then FP8=delayed at both sizes (refused in its row on a GPU without fp8 units);
    then batch 16 with and without PGLE (`--pgle auto`);
  - for each row, XLA's memory plan (what --compile-only prints) against the peak the device reports
    after the steps: how far the plan is from the real use;
  - launch-to-first-step seconds of `pax train --exp bench.Llama1B`, and the async-save stall: a save
    every SAVE_EVERY steps; the stall is the step after a save (the loop's share of the save: the
    finite check, checksums, orbax's save() and any wait for the previous one) less the median step;
  - greedy decoding tokens/s at batch 1 and 64 (64-token prompts, 128 new tokens, fresh weights).

Every part is a function taking an experiment and knobs, so that the tests run each on the CPU at a
tiny size (tests/test_bench_gpu.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

from rich.console import Console
from rich.table import Table

EXP = 'bench.Llama1B'
BATCHES = (8, 16)
TRAIN_STEPS = 16
SAVE_EVERY = 5
DECODE_BATCHES = (1, 64)
PROMPT_LEN, NEW_TOKENS = 64, 128
PAX = [sys.executable, '-m', 'paxcli.cli.app']


def _probe() -> tuple[str, str, str]:
  probe = 'import jax; d = jax.devices()[0]; print(jax.default_backend(), d.device_kind, jax.__version__, sep="|")'
  done = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True)
  last = done.stdout.strip().rpartition('\n')[-1].split('|')
  if done.returncode or len(last) != 3:
    return '', f'nothing ({done.stderr.strip().splitlines()[-1:]})', ''
  return last[0], last[1], last[2]


def device() -> str:
  """'NVIDIA H100 80GB HBM3' for the first GPU; exits in one line when there is none. Where nvidia-smi
  sees a GPU but jax runs on the CPU, installs the CUDA build of the installed jax version first."""
  backend, kind, version = _probe()
  if backend not in ('gpu', 'cuda', 'rocm') and shutil.which('nvidia-smi') and version:
    print(f'nvidia-smi finds a GPU and jax {version} runs on {backend}: installing jax[cuda12]=={version}', flush=True)
    subprocess.run([sys.executable, '-m', 'pip', 'install', '--quiet', f'jax[cuda12]=={version}'], check=False)
    backend, kind, version = _probe()
  if backend not in ('gpu', 'cuda', 'rocm'):
    found = f'{backend} ({kind})' if backend else kind
    sys.exit(f'make bench-gpu needs an NVIDIA GPU with CUDA JAX; jax here runs on {found}. On a GPU machine: '
             '.venv/bin/pip install -U "jax[cuda12]", then make bench-gpu.')
  return kind


def _sets(knobs) -> list[str]:
  return [a for k in knobs for a in ('--set', k)]


def mfu_rows(exp: str, knobs: list[str], *args: str, label: str = '') -> list[dict]:
  """`pax bench mfu --json` rows; a refusal (a UserError: FP8 without fp8 units, PGLE off a GPU) is one
  row with status 'refused: <its line>', so that one part's refusal leaves the others' figures."""
  done = subprocess.run([*PAX, 'bench', 'mfu', '--exp', exp, *_sets(knobs), '--json', *args], capture_output=True,
                        text=True)
  if done.returncode == 2 and 'Traceback' not in done.stderr:
    line = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'refused'
    return [{'experiment': exp, 'label': label, 'status': f'refused: {line.removeprefix("error: ")}'}]
  if done.returncode:
    return [{'experiment': exp, 'label': label, 'status': f'failed: {done.stderr.strip()[-500:]}'}]
  rows = json.loads(done.stdout)
  for r in rows:
    r['label'] = label
  return rows


def mfu_part(exp: str, knobs: list[str], batches=BATCHES, steps: int = 10) -> list[dict]:
  """The MFU grid: batches x cuDNN attention on/off in bf16, FP8=delayed at each batch, PGLE off/on."""
  sweep = ['--sweep', f'PERCORE_BATCH_SIZE={",".join(map(str, batches))}', '--steps', str(steps)]
  rows = mfu_rows(exp, knobs, *sweep, '--sweep', 'ATTENTION_IMPL=auto,einsum', label='bf16')
  rows += mfu_rows(exp, knobs + ['FP8=delayed'], *sweep, label='fp8 delayed')
  rows += mfu_rows(exp, knobs + [f'PERCORE_BATCH_SIZE={batches[-1]}'], '--steps', str(steps), '--pgle', 'auto',
                   label='bf16 pgle')
  return rows


def train_part(exp: str, knobs: list[str], steps: int = TRAIN_STEPS, save_every: int = SAVE_EVERY) -> dict:
  """Launch-to-first-step seconds and the save stalls of a short run of `exp`."""
  job_dir = tempfile.mkdtemp(prefix='paxcli-bench-gpu-')
  cmd = [*PAX, 'train', '--exp', exp, '--job-log-dir', job_dir,
         *_sets(knobs + [f'NUM_TRAIN_STEPS={steps}', f'SAVE_INTERVAL_STEPS={save_every}', 'SUMMARY_INTERVAL_STEPS=1'])]
  try:
    start = time.perf_counter()
    first_step, lines = None, []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
      for line in proc.stdout:
        lines.append(line)
        if first_step is None and re.match(r'step \d+:', line):
          first_step = time.perf_counter() - start
    if proc.returncode or first_step is None:
      return {'status': f'failed: {"".join(lines)[-500:]}'}
    with open(os.path.join(job_dir, 'train_metrics.jsonl')) as f:
      seconds = {r['step']: 1 / r['steps_per_sec'] for r in map(json.loads, f)}
  finally:
    shutil.rmtree(job_dir, ignore_errors=True)
  after_save = [s for s in seconds if s > save_every and (s - 1) % save_every == 0]
  steady = statistics.median(t for s, t in seconds.items() if s > 2 and s not in after_save)
  return {'status': 'ok', 'first_step_seconds': first_step, 'step_seconds': steady,
          'stalls': [seconds[s] - steady for s in after_save]}


def decode_rate(exp: str, knobs: list[str], batch: int, prompt_len: int, new_tokens: int) -> dict:
  """Greedy decoding of `batch` random prompts with fresh weights: new tokens/s (the compile left out)."""
  import numpy as np

  from paxcli import config
  from paxcli.loops.decode.decoder import Decoder
  from paxcli.loops.decode.options import DecodeOptions
  from paxcli.loops.decode.prompts import Prompt
  from paxcli.runtime import engine
  setup = engine.build(config.resolve(exp, knobs + [f'MAX_SEQ_LEN={prompt_len + new_tokens}']))
  decoder = Decoder(setup, engine.init_state(setup, 0)['params'])
  rng = np.random.default_rng(0)
  prompts = [Prompt(rng.integers(3, decoder.vocab_size, prompt_len).tolist()) for _ in range(batch)]
  opts = DecodeOptions(max_decode_steps=new_tokens, batch_size=batch, ignore_eos=True)
  decoder.run(prompts, opts)   # compiles
  start = time.perf_counter()
  records, _ = decoder.run(prompts, opts)
  elapsed = time.perf_counter() - start
  tokens = sum(len(r['decoded_ids']) for r in records)
  return {'batch': batch, 'new_tokens': tokens, 'seconds': elapsed, 'tokens_per_sec': tokens / elapsed}


def decode_part(exp: str, knobs: list[str], batches=DECODE_BATCHES, prompt_len: int = PROMPT_LEN,
                new_tokens: int = NEW_TOKENS) -> list[dict]:
  """decode_rate at each batch, each in a process of its own."""
  rows = []
  for b in batches:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), '--decode', exp, str(b), str(prompt_len),
                           str(new_tokens), *knobs], capture_output=True, text=True)
    if done.returncode:
      rows.append({'batch': b, 'status': f'failed: {done.stderr.strip()[-500:]}'})
    else:
      rows.append({'status': 'ok', **json.loads(done.stdout.strip().splitlines()[-1])})
  return rows


def run_all(exp: str = EXP, knobs: Optional[list[str]] = None, *, batches=BATCHES, steps: int = 10,
            train_steps: int = TRAIN_STEPS, save_every: int = SAVE_EVERY, decode_batches=DECODE_BATCHES,
            prompt_len: int = PROMPT_LEN, new_tokens: int = NEW_TOKENS) -> dict:
  """Every part, with the seconds each took."""
  knobs = list(knobs or [])
  out, seconds = {'experiment': exp, 'knobs': knobs}, {}
  for name, part in (('mfu', lambda: mfu_part(exp, knobs, batches, steps)),
                     ('train', lambda: train_part(exp, knobs, train_steps, save_every)),
                     ('decode', lambda: decode_part(exp, knobs, decode_batches, prompt_len, new_tokens))):
    start = time.perf_counter()
    out[name] = part()
    seconds[name] = time.perf_counter() - start
  out['part_seconds'] = seconds
  return out


def _gib(n) -> str:
  return f'{n / 2 ** 30:.2f} GiB' if n else '-'


def table(result: dict, kind: str) -> Table:
  t = Table(title=f'paxcli on one {kind}: {result["experiment"]}', caption_justify='left',
            caption='MFU: model FLOPs (paxcli.perf.flops) / step time / peak; plan: XLA\'s per-device memory of '
                    'the compiled step (--compile-only); peak: the device\'s peak bytes in use after the steps')
  for col in ('what', 'step ms', 'tokens/s', 'MFU', 'plan', 'peak', 'peak / plan', 'status / figure'):
    t.add_column(col, justify='right')
  for r in result['mfu']:
    ok = 'step_seconds_median' in r
    sweep = r.get('sweep') or {}
    what = ' '.join([r.get('label', ''), *(f'{k}={v}' for k, v in sweep.items())] + (['PGLE'] if r.get('pgle') else []))
    plan, peak = r.get('memory_total_bytes'), r.get('live_peak_bytes')
    t.add_row(what, f"{r['step_seconds_median'] * 1e3:.0f}" if ok else '-', f"{r['tokens_per_sec']:,.0f}" if ok else '-',
              f"{r['mfu']:.1%}" if ok and r.get('mfu') is not None else '-', _gib(plan), _gib(peak),
              f'{peak / plan:.2f}' if plan and peak else '-', r['status'][:120])
  run = result['train']
  if run.get('status') == 'ok':
    t.add_row('pax train: launch to first step', '-', '-', '-', '-', '-', '-', f"{run['first_step_seconds']:.1f} s")
    t.add_row('async-save stall per save', f"{run['step_seconds'] * 1e3:.0f}", '-', '-', '-', '-', '-',
              ', '.join(f'{s:.2f}' for s in run['stalls']) + ' s')
  else:
    t.add_row('pax train', '-', '-', '-', '-', '-', '-', run['status'][:120])
  for d in result['decode']:
    figure = f"{d['tokens_per_sec']:,.0f} new tokens/s" if d['status'] == 'ok' else d['status'][:120]
    t.add_row(f"greedy decode, batch {d['batch']}", '-', '-', '-', '-', '-', '-', figure)
  return t


def main(argv=None) -> None:
  import machine   # benchmarks/machine.py (this file is also loaded by tests, from elsewhere)
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ['--decode']:   # one decode_rate in this process: decode_part's child
    exp, batch, prompt_len, new_tokens, *knobs = argv[1:]
    print(json.dumps(decode_rate(exp, knobs, int(batch), int(prompt_len), int(new_tokens))))
    return
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default='bench-gpu.json', help='the JSON file of every figure')
  args = parser.parse_args(argv)
  kind = device()
  start = time.perf_counter()
  result = run_all()
  result.update(device=kind, total_seconds=time.perf_counter() - start)
  Console(width=170).print(table(result, kind))
  Console(width=170).print(machine.describe())
  with open(args.out, 'w') as f:
    json.dump(result, f, indent=1, default=str)
  print(f'Every figure: {os.path.abspath(args.out)} ({result["total_seconds"]:.0f} s in all).')


if __name__ == '__main__':
  main()
