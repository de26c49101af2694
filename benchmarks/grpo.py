"""A GRPO step against TRL's GRPOTrainer with transformers' generate, side by side in one process.

  .venv/bin/python benchmarks/grpo.py [--prompts 8] [--generations 8] [--new-tokens 32] [--layers 4]
                                      [--dims 256] [--heads 4] [--hidden 704] [--threads 2] [--repeats 3]

One Llama (by default the default recipe's size: 4 layers, d256, MLP 704, tied embeddings) with random
weights, made by paxcli and handed to transformers through the Llama family's weight map
(convert.certify.hf_model), float32 on both sides. A step samples `--generations` completions of each of
`--prompts` prompts of the addition example (recipes/grpo.py), `--new-tokens` tokens each (EOS held off so
both sides decode the same count), scores them with the exact-match reward, and takes one optimizer step
(AdamW) on the GRPO loss (dapo, BETA 0):

  paxcli   the train loop's own pieces: loops.rollout.Rollouts.get_next (paxcli's decoder on the mesh, rewards,
           advantages) and the jitted train step (loss, backward, update)
  TRL      GRPOTrainer._generate_and_score_completions (transformers' generate, rewards, advantages), then
           compute_loss, backward and torch.optim.AdamW's step

After a warm-up step of each (compiles excluded), the median of `--repeats` timed steps is reported; rollout
tokens/s counts the completion tokens sampled. Both get the same threads: the process is pinned to `--threads`
CPUs, torch gets set_num_threads, XLA sizes its pool from the pinned CPUs. Shared machines are noisy: only the
ratio within one run means anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import machine   # benchmarks/machine.py: the processor beside the table


def knobs(args, files: dict) -> list[str]:
  return [f'NUM_LAYERS={args.layers}', f'MODEL_DIMS={args.dims}', f'HIDDEN_DIMS={args.hidden}',
          f'NUM_HEADS={args.heads}', f'MAX_SEQ_LEN={16 + args.new_tokens}', f'PERCORE_BATCH_SIZE={args.prompts * args.generations}',
          f'NUM_GENERATIONS={args.generations}', f'MAX_COMPLETION_LENGTH={args.new_tokens}', 'LEARNING_RATE=1e-5',
          f'TRAIN_DATA={files["prompts"]}', f'TOKENIZER={files["tokenizer"]}']


def paxcli_side(args, files: dict, job_dir: str):
  """(setup, state, step function, rollouts) of the GRPO example at the benchmark's size."""
  from paxcli import config
  from paxcli.loops import rollout
  from paxcli.loops import train as train_loop
  from paxcli.runtime import engine, infeed, sharding

  resolved = config.resolve('grpo.GrpoAddition', knobs(args, files))
  setup = engine.build(resolved)
  state = engine.init_state(setup, 0)
  batch_sharding = sharding.batch_sharding(setup.mesh)
  step = train_loop.make_train_step(setup, batch_sharding, 1)
  rollouts = rollout.Rollouts(resolved, setup, job_dir, infeed.build_input(resolved.train_dataset(), setup))
  rollouts.opts.min_length = args.new_tokens   # no EOS before the last token: both sides decode the same count
  return setup, state, step, rollouts, batch_sharding


def time_paxcli(setup, state, step, rollouts, batch_sharding, repeats: int):
  import jax

  from paxcli.runtime import sharding
  times = []
  for i in range(repeats + 1):
    start = time.perf_counter()
    host = rollouts.get_next(state)
    made = time.perf_counter()
    state, metrics = step(state, sharding.to_global(host, batch_sharding, setup.global_batch))
    jax.block_until_ready(metrics)
    if i:   # the first step compiles
      times.append((made - start, time.perf_counter() - made))
  return times, int(host['weights'].sum())


def trl_side(args, setup, state, files: dict, out_dir: str):
  import datasets
  import jax
  import torch
  import transformers
  import trl

  from paxcli.convert import certify
  from paxcli.convert import hf as convert_hf
  from paxcli.models import rewards
  from paxcli.models.lm import flat_view

  view = flat_view(setup.model)
  model = certify.hf_model(convert_hf.family_of(view), view,
                           certify.base_weights(jax.device_get(state['params']), view.num_layers))
  tok = transformers.PreTrainedTokenizerFast(tokenizer_file=files['tokenizer'], bos_token='<bos>', eos_token='<eos>',
                                             pad_token='<pad>')
  config = trl.GRPOConfig(output_dir=out_dir, per_device_train_batch_size=args.prompts * args.generations,
                          num_generations=args.generations, max_completion_length=args.new_tokens, loss_type='dapo',
                          beta=0.0, learning_rate=1e-5, report_to='none', use_cpu=True, bf16=False, seed=0,
                          generation_kwargs={'min_new_tokens': args.new_tokens})
  match = rewards.exact_match()
  reward = lambda prompts, completions, **kw: match(prompts, completions, **kw)   # pylint: disable=unnecessary-lambda
  reward.__name__ = 'exact_match'
  import json
  records = [json.loads(line) for line in open(files['prompts'], encoding='utf-8')][:args.prompts]
  trainer = trl.GRPOTrainer(model=model, reward_funcs=[reward], args=config, processing_class=tok,
                            train_dataset=datasets.Dataset.from_list(records))
  trainer.model.train()
  trainer.current_gradient_accumulation_steps = 1
  optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=1e-5)
  batch = [r for r in records for _ in range(args.generations)]
  return trainer, optimizer, batch


def time_trl(trainer, optimizer, batch, repeats: int):
  times = []
  for i in range(repeats + 1):
    start = time.perf_counter()
    inputs = trainer._generate_and_score_completions(batch)   # pylint: disable=protected-access
    made = time.perf_counter()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if i:
      times.append((made - start, time.perf_counter() - made))
  return times, int(inputs['completion_mask'].sum())


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--prompts', type=int, default=8)
  parser.add_argument('--generations', type=int, default=8)
  parser.add_argument('--new-tokens', type=int, default=32)
  parser.add_argument('--layers', type=int, default=4)
  parser.add_argument('--dims', type=int, default=256)
  parser.add_argument('--heads', type=int, default=4)
  parser.add_argument('--hidden', type=int, default=704)
  parser.add_argument('--threads', type=int, default=2)
  parser.add_argument('--repeats', type=int, default=3)
  args = parser.parse_args()
  os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.threads])   # before XLA sizes its pool
  import torch
  from rich.console import Console
  from rich.table import Table

  from paxcli.recipes import grpo as grpo_recipe

  torch.set_num_threads(args.threads)
  with tempfile.TemporaryDirectory() as tmp:
    files = grpo_recipe.write_example(tmp, n=max(64, args.prompts))
    setup, state, step, rollouts, batch_sharding = paxcli_side(args, files, os.path.join(tmp, 'job'))
    trainer, optimizer, batch = trl_side(args, setup, state, files, os.path.join(tmp, 'trl'))
    pax_times, pax_tokens = time_paxcli(setup, state, step, rollouts, batch_sharding, args.repeats)
    trl_times, trl_tokens = time_trl(trainer, optimizer, batch, args.repeats)
  rows = args.prompts * args.generations
  table = Table(title=f'GRPO step on {machine.processor()}: Llama {args.layers} layers d{args.dims} (MLP {args.hidden}), '
                      f'{args.prompts} prompts x {args.generations} completions x {args.new_tokens} tokens, float32, '
                      f'{args.threads} threads each; median of {args.repeats}')
  for col in ('side', 'rollout tokens/s', 'rollout s', 'loss + backward + update s', 'step s'):
    table.add_column(col, justify='right')
  results = {}
  for side, times, tokens in (('paxcli (own decoder, jitted step)', pax_times, pax_tokens),
                              ('TRL GRPOTrainer (transformers generate)', trl_times, trl_tokens)):
    roll, upd = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
    results[side] = (tokens / roll, roll + upd)
    table.add_row(side, f'{tokens / roll:,.0f}', f'{roll:.3f}', f'{upd:.3f}', f'{roll + upd:.3f}')
  (pax_tps, pax_step), (trl_tps, trl_step) = results.values()
  Console().print(table)
  Console().print(f'paxcli / TRL: rollout tokens/s {pax_tps / trl_tps:.2f}x, step time {trl_step / pax_step:.2f}x '
                  f'faster; {rows} completions of {args.new_tokens} tokens a step.')
  Console().print(machine.describe())


if __name__ == '__main__':
  main()
