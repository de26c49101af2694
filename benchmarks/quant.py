"""Quantized weights and KV cache against float32: decode speed and memory, agreement, QLoRA against LoRA.

  .venv/bin/python benchmarks/quant.py [--repeats 20] [--length 512] [--skip-decode] [--skip-trained] [--skip-train]
                                       [--skip-8b]

1. Decoding (a CPU-size Llama: 4 layers x 512, 8 heads, 2 KV heads of 64, FFN 1408, vocab 8192, random weights):
   tokens/s of one decode step at batch 1 and 16 after --length tokens (median of --repeats), for float32, int8
   weights (WEIGHT_QUANT='int8'), an int8 KV cache (KV_CACHE_QUANT='int8') and both; the bytes of the weights and
   of the cache; and top-1 agreement and mean KL against float32 over the certification's fixed prompts through
   the decoding path (prefill, then a token at a time), as `pax checkpoint convert` reports them.
   The same agreement for a model trained here (the built-in docstrings corpus, 300 steps).
2. QLoRA against LoRA on that model: train-step time (LoRA r=8 on every projection; NF4 base, int8 base, float32
   and bfloat16 bases), batch 4 x 256, after one compile.
3. Qwen3-8B's train step compiled for one device without running it (`pax bench mfu --compile-only`'s compile):
   params + optimizer state of QLoRA (NF4 base, blocks of 64) against LoRA on a bfloat16 base, r=16, with float32
   and with bfloat16 compute.

The machine may be shared: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import time

import machine   # benchmarks/machine.py: the processor beside the table
import steps     # benchmarks/steps.py: a step's plan and time

EXP = 'bench.Llama1B'
CPU_SIZE = ['NUM_LAYERS=4', 'MODEL_DIMS=512', 'HIDDEN_DIMS=1408', 'NUM_HEADS=8', 'NUM_KV_HEADS=2', 'DIMS_PER_HEAD=64',
            'VOCAB_SIZE=8192', 'PERCORE_BATCH_SIZE=4']
DECODE = [('float32', []), ('int8 weights', ['WEIGHT_QUANT="int8"']), ('int8 KV cache', ['KV_CACHE_QUANT="int8"']),
          ('int8 weights + cache', ['WEIGHT_QUANT="int8"', 'KV_CACHE_QUANT="int8"'])]
TARGETS = 'LORA_TARGETS=("query","key","value","output","mlp")'
TRAIN = [('LoRA r=8, float32 base', ['LORA_RANK=8', TARGETS]),
         ('LoRA r=8, bfloat16 base', ['LORA_RANK=8', TARGETS, 'LORA_BASE_DTYPE="bfloat16"']),
         ('QLoRA r=8, NF4 base', ['LORA_RANK=8', TARGETS, 'WEIGHT_QUANT="nf4"']),
         ('QLoRA r=8, int8 base', ['LORA_RANK=8', TARGETS, 'WEIGHT_QUANT="int8"'])]
BIG = [(f'LoRA r=16, bfloat16 base, {c} compute', ['LORA_RANK=16', TARGETS, 'LORA_BASE_DTYPE="bfloat16"',
                                                   f'FPROP_DTYPE="{c}"']) for c in ('float32', 'bfloat16')] + [
    (f'QLoRA r=16, NF4 base (embeddings, norms bfloat16), {c} compute',
     ['LORA_RANK=16', TARGETS, 'WEIGHT_QUANT="nf4"', 'LORA_BASE_DTYPE="bfloat16"', f'FPROP_DTYPE="{c}"'])
    for c in ('float32', 'bfloat16')]


def _setup(overrides: list[str], length: int):
  from paxcli import config
  from paxcli.runtime import engine
  return engine.build(config.resolve(EXP, CPU_SIZE + [f'MAX_SEQ_LEN={length}'] + overrides))


def _params(setup, float_params):
  """The float params as `setup`'s model holds them (its kernels coded as decode reads a checkpoint)."""
  from paxcli.layers import quant
  plan = quant.float_twin(setup.abstract_state['params'], setup.logical)[2]
  return quant.quantize_like(float_params, plan) if plan else float_params


def decode_speed(setup, params, batch: int, length: int, repeats: int) -> dict:
  import jax
  import jax.numpy as jnp
  cache = setup.model.init_cache(params, batch, length + 1)
  step = jax.jit(setup.model.extend, donate_argnums=1)
  ids = jax.random.randint(jax.random.key(1), (batch, length), 0, 8192)
  _, cache = step(params, cache, ids, jnp.broadcast_to(jnp.arange(length), (batch, length)))
  one, at = ids[:, :1], jnp.full((batch, 1), length)
  cache_bytes = steps.nbytes(cache)
  times = []
  for _ in range(repeats + 1):
    t0 = time.perf_counter()
    logits, cache = step(params, cache, one, at)
    jax.block_until_ready(logits)
    times.append(time.perf_counter() - t0)
  s = sorted(times[1:])[repeats // 2]
  return {'tokens_per_s': batch / s, 'cache_bytes': cache_bytes}


def teacher_forced(setup, params, ids):
  """Logits [B, L, V] through the decoding path: a prefill of half, then a token at a time."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  b, n = ids.shape
  cache = setup.model.init_cache(params, b, n)
  step = jax.jit(setup.model.extend)
  pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
  logits, cache = step(params, cache, jnp.asarray(ids[:, :n // 2]), pos[:, :n // 2])
  out = [np.asarray(logits)]
  for t in range(n // 2, n):
    logits, cache = step(params, cache, jnp.asarray(ids[:, t:t + 1]), pos[:, t:t + 1])
    out.append(np.asarray(logits))
  return np.concatenate(out, axis=1)


def decode_rows(length: int, repeats: int) -> list[dict]:
  import jax
  from paxcli.convert import certify
  from paxcli.runtime import engine
  base = _setup([], length + 1)
  float_params = jax.device_get(engine.init_state(base, 0)['params'])
  ids = certify.prompts(8192, 64)
  want = None
  rows = []
  for name, knobs in DECODE:
    setup = _setup(knobs, length + 1)
    params = _params(setup, float_params)
    logits = teacher_forced(setup, params, ids)
    want = logits if want is None else want
    row = {'name': name, 'weights': steps.nbytes(params), **certify.compare(want, logits)}
    for batch in (1, 16):
      r = decode_speed(setup, params, batch, length, repeats)
      row[f'tps_{batch}'], row[f'cache_{batch}'] = r['tokens_per_s'], r['cache_bytes']
    rows.append(row)
  return rows


TRAINED_KNOBS = ['NUM_LAYERS=2', 'MODEL_DIMS=64', 'HIDDEN_DIMS=128', 'NUM_HEADS=4', 'VOCAB_SIZE=512', 'MAX_SEQ_LEN=64',
                 'PERCORE_BATCH_SIZE=4', 'NUM_TRAIN_STEPS=300', 'SAVE_INTERVAL_STEPS=300', 'EVAL_INTERVAL_STEPS=0',
                 'DECODE_INTERVAL_STEPS=0', 'LEARNING_RATE=0.01', 'LR_WARMUP_STEPS=5']


def trained_rows() -> list[dict]:
  """Top-1 agreement and KL against float32 of a model trained here (the built-in docstrings corpus, 300 steps),
  read with each knob set as `pax decode` reads a checkpoint, through the decoding path."""
  import tempfile

  import jax
  from rich.console import Console

  import paxcli
  from paxcli import config
  from paxcli.convert import certify
  from paxcli.jobdir import restore
  from paxcli.runtime import engine
  job = tempfile.mkdtemp(prefix='quant-bench-')
  paxcli.train('default.StdlibDocsLm', job_dir=job, overrides=TRAINED_KNOBS, console=Console(quiet=True))
  ids = certify.prompts(512, 64)
  rows, want = [], None
  for name, knobs in DECODE:
    setup = engine.build(config.resolve('default.StdlibDocsLm', TRAINED_KNOBS + knobs))
    params = restore.restore(setup, job, restore.choose_step(job), params_only=True).state['params']
    logits = teacher_forced(setup, jax.device_get(params), ids)
    want = logits if want is None else want
    rows.append({'name': name, **certify.compare(want, logits)})
  return rows


def train_rows(count: int) -> list[dict]:
  rows = []
  for name, knobs in TRAIN:
    _, state, seconds = steps.timed(EXP, CPU_SIZE + ['MAX_SEQ_LEN=256'] + knobs, count)
    rows.append({'name': name, 'step_s': seconds, 'params': steps.nbytes(state['params']),
                 'opt_state': steps.nbytes(state['opt_state'])})
  return rows


def big_rows() -> list[dict]:
  """Qwen3-8B: params + optimizer state bytes and the compiled step's buffers, one device, nothing run."""
  rows = []
  for name, knobs in BIG:
    setup, m, compile_s = steps.plan('qwen.Qwen3_8B', knobs + ['PERCORE_BATCH_SIZE=1', 'MAX_SEQ_LEN=2048',
                                                               'ICI_MESH_SHAPE=[1,1,1]'])
    rows.append({'name': name, 'params': steps.nbytes(setup.abstract_state['params']),
                 'opt_state': steps.nbytes(setup.abstract_state['opt_state']), 'arguments': m.argument_size_in_bytes,
                 'temp': m.temp_size_in_bytes, 'compile_s': compile_s})
  return rows


def _gib(n: int) -> str:
  return f'{n / 2**30:.2f} GiB'


def _mib(n: int) -> str:
  return f'{n / 2**20:.1f} MiB'


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--repeats', type=int, default=20)
  parser.add_argument('--length', type=int, default=512)
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--skip-decode', action='store_true')
  parser.add_argument('--skip-trained', action='store_true')
  parser.add_argument('--skip-train', action='store_true')
  parser.add_argument('--skip-8b', action='store_true')
  args = parser.parse_args()
  import jax
  from rich.console import Console
  from rich.table import Table
  console = Console(width=170)
  console.print(f'{machine.processor()}; {jax.devices()[0].device_kind}, {jax.device_count()} device(s); '
                f'jax {jax.__version__}')
  if not args.skip_decode:
    rows = decode_rows(args.length, args.repeats)
    table = Table(title=f'Decode step after {args.length} tokens: 4 layers x 512, 8 heads (2 KV of 64), vocab 8192, '
                        f'random weights (median of {args.repeats}); agreement on 2 fixed prompts x 64 tokens')
    for col in ('model', 'tokens/s b=1', 'vs f32', 'tokens/s b=16', 'vs f32', 'weights', 'cache b=16',
                'top-1 vs f32', 'mean KL'):
      table.add_column(col, justify='left' if col == 'model' else 'right')
    f32 = rows[0]
    for r in rows:
      table.add_row(r['name'], f"{r['tps_1']:,.0f}", f"{r['tps_1'] / f32['tps_1']:.2f}x", f"{r['tps_16']:,.0f}",
                    f"{r['tps_16'] / f32['tps_16']:.2f}x", _mib(r['weights']), _mib(r['cache_16']),
                    f"{100 * r['top1_agreement']:.1f}%", f"{r['kl']:.2e}")
    console.print(table)
  if not args.skip_trained:
    rows = trained_rows()
    table = Table(title='A model trained here (2 layers x 64, vocab 512, 300 steps on the built-in corpus) against '
                        'float32, through the decoding path on 2 fixed prompts x 64 tokens')
    for col in ('model', 'top-1 agreement', 'mean KL', 'largest KL', 'max |Δ logit|'):
      table.add_column(col, justify='left' if col == 'model' else 'right')
    for r in rows:
      table.add_row(r['name'], f"{100 * r['top1_agreement']:.1f}%", f"{r['kl']:.2e}", f"{r['kl_max']:.2e}",
                    f"{r['max_abs_diff']:.3g}")
    console.print(table)
  if not args.skip_train:
    rows = train_rows(args.steps)
    table = Table(title=f'Train step, the same model, batch 4 x 256, float32 compute (mean of {args.steps})')
    for col in ('run', 's/step', 'vs LoRA f32', 'params', 'optimizer state'):
      table.add_column(col, justify='left' if col == 'run' else 'right')
    for r in rows:
      table.add_row(r['name'], f"{r['step_s']:.3f}", f"{r['step_s'] / rows[0]['step_s']:.2f}x", _mib(r['params']),
                    _mib(r['opt_state']))
    console.print(table)
  if not args.skip_8b:
    rows = big_rows()
    table = Table(title="Qwen3-8B train step compiled for one device (nothing run): batch 1 x 2048")
    for col in ('run', 'params', 'optimizer state', 'params + optimizer', 'compiled arguments', 'temp', 'compile s'):
      table.add_column(col, justify='left' if col == 'run' else 'right')
    for r in rows:
      table.add_row(r['name'], _gib(r['params']), _gib(r['opt_state']), _gib(r['params'] + r['opt_state']),
                    _gib(r['arguments']), _gib(r['temp']), f"{r['compile_s']:.0f}")
    console.print(table)


if __name__ == '__main__':
  main()
