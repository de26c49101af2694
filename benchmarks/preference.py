"""Preference tuning: DPO step time against TRL's DPOTrainer, and the memory of LoRA-DPO against full DPO.

  .venv/bin/python benchmarks/preference.py [--steps 10] [--pairs 8] [--seq 64] [--skip-memory] [--skip-time]
      [--isa avx2]

Time: the fine-tuning example's Llama (recipes/finetune.py TINY_CONFIG: 2 layers x 64, vocab 384), float32, the
same batch of pairs (PAIRS x 2 rows of SEQ tokens) on both sides: paxcli's whole train step (forward of policy
and reference copy, backward, AdamW) on one CPU device, against TRL's DPOTrainer._compute_loss, backward and
torch's AdamW step on the same model built by transformers (eager attention, torch's threads). Mean of --steps
after a warm-up step each.

Memory: bench.Llama1B's structure (16 layers x 2048, vocab 32768, rows of 2048) as posttrain.Dpo, its train
step compiled for one device without running it (`jit(step).lower(...).compile().memory_analysis()`, what
`pax bench mfu --compile-only` reads): full DPO with its reference copy (non-trainable variables) against
LoRA-DPO, whose reference is its base with the adapters off, and full DPO with precomputed reference
log-probabilities. One pair a device (two rows). The machine is shared: compare rows of one run, not runs.
--isa avx2 runs it as on a processor without AVX-512 or AMX (benchmarks/machine.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import machine   # benchmarks/machine.py: the processor and its instruction sets
import steps     # benchmarks/steps.py: a step's plan and time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

TARGETS = 'LORA_TARGETS=("query","key","value","output","mlp")'
MEMORY_VARIANTS = [
    ('full DPO, reference copy', []),
    ('LoRA-DPO r=8, adapters off', ['LORA_RANK=8', TARGETS]),
    ('LoRA-DPO r=8, bf16 base', ['LORA_RANK=8', TARGETS, 'LORA_BASE_DTYPE="bfloat16"']),
    ('full DPO, precomputed reference', ["REFERENCE='precomputed'"]),
    ('SimPO (no reference)', ["LOSS_TYPE='simpo'"]),
]


def llama1b_knobs() -> list[str]:
  """bench.Llama1B's model knobs as --set lines for posttrain.Dpo (which has no BASE here)."""
  from paxcli import config
  from paxcli.models.knobs import LM_KNOB
  exp = config.resolve('bench.Llama1B').experiment
  return [f'{k}={v!r}' for k, v in exp.knobs().items() if k in LM_KNOB] + ['PERCORE_BATCH_SIZE=1',
                                                                            'ICI_MESH_SHAPE=[1, 1, 1]']


def memory(overrides: list[str]) -> dict:
  """Bytes of params, optimizer state, non-trainable state and the compiled step's buffers, nothing run."""
  setup, m, compile_s = steps.plan('posttrain.Dpo', llama1b_knobs() + overrides)
  state = setup.abstract_state
  return {'params': steps.nbytes(state['params']), 'opt_state': steps.nbytes(state['opt_state']),
          'reference': steps.nbytes(state.get('non_trainable', {})), 'arguments': m.argument_size_in_bytes,
          'temp': m.temp_size_in_bytes, 'compile_s': compile_s, 'seq': setup.seq_len}


def _example(directory: str, pairs: int) -> dict:
  """The tiny Llama (transformers' save_pretrained and paxcli's import of it) and `pairs` preference pairs."""
  import sys
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'tests'))
  import hf_models

  from paxcli import api
  from paxcli.recipes import finetune, posttrain
  hf = os.path.join(directory, 'hf')
  hf_models.save(hf_models.build(dict(finetune.TINY_CONFIG)), hf)
  finetune.write_tokenizer(hf, [p['prompt'] + p['chosen'] for p in posttrain.example_pairs(100, 0)], 384)
  api.convert_checkpoint(hf, os.path.join(directory, 'base'), fmt='hf', verify=False)
  path = os.path.join(directory, 'prefs.jsonl')
  with open(path, 'w') as f:
    f.writelines(json.dumps(p) + '\n' for p in posttrain.example_pairs(pairs, 3))
  return {'hf': hf, 'base': os.path.join(directory, 'base'), 'prefs': path}


def paxcli_step(made: dict, pairs: int, seq: int, steps: int):
  """(seconds per step, the batch) of paxcli's DPO train step on one CPU device."""
  import jax

  from paxcli import config
  from paxcli.loops.train import ready_step
  from paxcli.runtime.sharding import to_global
  resolved = config.resolve('posttrain.Dpo', [f'BASE={made["base"]}', f'TRAIN_DATA={made["prefs"]}',
                                              f'MAX_SEQ_LEN={seq}', f'PERCORE_BATCH_SIZE={pairs}',
                                              'ICI_MESH_SHAPE=[1, 1, 1]', 'LEARNING_RATE=1e-6'])
  setup, state, step, batch_sharding, data = ready_step(resolved)
  host = data.get_next()
  batch = to_global(host, batch_sharding, setup.global_batch)
  times = []
  for _ in range(steps + 1):
    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t0)
  return statistics.mean(times[1:]), host


def trl_step(made: dict, batch: dict, steps: int, beta: float = 0.1) -> float:
  """Seconds per step of TRL's DPOTrainer loss, its backward and torch's AdamW on the same batch."""
  import sys
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'tests'))
  import datasets
  import hf_models
  import numpy as np
  import torch
  import transformers
  import trl
  policy, ref = hf_models.load(made['hf']), hf_models.load(made['hf'])
  policy.train()
  rows = [json.loads(line) for line in open(made['prefs'])]
  with tempfile.TemporaryDirectory() as out:
    trainer = trl.DPOTrainer(model=policy, ref_model=ref, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=transformers.AutoTokenizer.from_pretrained(made['hf']),
                             args=trl.DPOConfig(output_dir=out, report_to=[], use_cpu=True, bf16=False, beta=beta,
                                                max_length=None))
  inputs = {'input_ids': [], 'attention_mask': [], 'completion_mask': []}
  for side in ('chosen', 'rejected'):
    ids, labels, weights, segments = (batch[f'{side}_{k}'] for k in ('ids', 'labels', 'weights', 'segment_ids'))
    inputs['input_ids'].append(np.concatenate([ids[:, :1], labels], 1))
    inputs['attention_mask'].append(np.concatenate([segments[:, :1], segments], 1))
    inputs['completion_mask'].append(np.concatenate([np.zeros_like(segments[:, :1]), weights > 0], 1))
  inputs = {k: torch.as_tensor(np.concatenate(v, 0).astype(np.int64)) for k, v in inputs.items()}
  opt = torch.optim.AdamW(trainer.model.parameters(), lr=1e-6)
  times = []
  for _ in range(steps + 1):
    t0 = time.perf_counter()
    loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    loss.backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - t0)
  return statistics.mean(times[1:])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--pairs', type=int, default=8)
  parser.add_argument('--seq', type=int, default=64)
  parser.add_argument('--skip-memory', action='store_true')
  parser.add_argument('--skip-time', action='store_true')
  machine.add_isa_argument(parser)
  args = parser.parse_args()
  machine.restrict(args.isa)
  from rich.console import Console
  from rich.table import Table
  console = Console(width=200)   # the tables whole in a log file too
  console.print(machine.describe())
  if not args.skip_time:
    with tempfile.TemporaryDirectory() as d:
      made = _example(d, args.pairs * 4)
      ours, batch = paxcli_step(made, args.pairs, args.seq, args.steps)
      theirs = trl_step(made, batch, args.steps)
    table = Table(title=f'DPO train step, tiny Llama (2 x 64, vocab 384, float32), {args.pairs} pairs x 2 rows of '
                        f'{args.seq} tokens, mean of {args.steps} steps')
    for col in ('trainer', 's/step', 'pairs/s', 'vs TRL'):
      table.add_column(col, justify='left' if col == 'trainer' else 'right')
    for name, s in (('paxcli posttrain.Dpo (jit, 1 CPU device)', ours), ('TRL DPOTrainer + torch AdamW', theirs)):
      table.add_row(name, f'{s:.4f}', f'{args.pairs / s:,.1f}', f'{theirs / s:.2f}x')
    console.print(table)
  if not args.skip_memory:
    gib = lambda n: f'{n / 2**30:.2f}'
    table = Table(title='posttrain.Dpo at bench.Llama1B\'s size, train step compiled for 1 device (GiB; nothing run)')
    for col in ('variant', 'params', 'opt state', 'reference copy', 'step arguments', 'step temp',
                'arguments + temp', 'compile s'):
      table.add_column(col, justify='left' if col == 'variant' else 'right')
    for name, sets in MEMORY_VARIANTS:
      r = memory(sets)
      table.add_row(name, gib(r['params']), gib(r['opt_state']), gib(r['reference']), gib(r['arguments']),
                    gib(r['temp']), gib(r['arguments'] + r['temp']), f"{r['compile_s']:.0f}")
    console.print(table)


if __name__ == '__main__':
  main()
