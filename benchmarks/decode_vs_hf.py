"""Greedy decoding against transformers' `generate()`, side by side in one process.

  .venv/bin/python benchmarks/decode_vs_hf.py [--batch-sizes 1,16,64] [--prompt-len 64] [--new-tokens 256]
                                              [--threads 2] [--repeats 2] [--layers 12] [--dims 768]
                                              [--heads 12] [--kv-heads 4] [--hidden 2048] [--vocab 32000]
                                              [--untied] [--isa native|avx2]

One Llama (by default 12 layers, d768, GQA 12/4, MLP 2048, vocabulary 32,000, tied embeddings: 110M
parameters; `--untied`: a separate output projection, as Llama 3 8B, Qwen 7B and Mistral have) with random
weights, built once in transformers (LlamaForCausalLM, float32) and
converted into paxcli by the Llama family's weight map, so that both decode the same function.
Each batch size decodes the same random prompts (no padding) with paxcli's Decoder (greedy,
`--new-tokens` each, EOS ignored) and with `model.generate(do_sample=False, min_new_tokens=
max_new_tokens)`; after a warm-up run of each (compiles excluded), the best of `--repeats` timed
runs is reported. Both get the same threads: the process is pinned to `--threads` CPUs, torch
gets `torch.set_num_threads`, XLA sizes its pool from the pinned CPUs. "same tokens" is the
share of rows whose greedy tokens agree exactly (float32 rounding may flip a near-tie late in
a row; the first difference is reported). The last column divides the CPU seconds (all threads) each
side spent: on a machine other work loads, it shows the work done apart from waiting for a core
(torch's and XLA's idle threads spin a little, so it is not exact either).

`--isa avx2` runs both sides as on a processor without AVX-512 and AMX (benchmarks/machine.py: CPUID masked
for the whole process, XLA_FLAGS=--xla_cpu_max_isa=AVX2, ONEDNN_MAX_CPU_ISA=AVX2). The processor and the
instruction sets the process saw are printed under the table.

Machines are shared and noisy: only the ratio within one run means anything.
"""

from __future__ import annotations

import argparse
import os
import time

import machine


def hf_config(args) -> dict:
  return {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'vocab_size': args.vocab,
          'hidden_size': args.dims, 'intermediate_size': args.hidden, 'num_hidden_layers': args.layers,
          'num_attention_heads': args.heads, 'num_key_value_heads': args.kv_heads,
          'head_dim': args.dims // args.heads, 'max_position_embeddings': args.prompt_len + args.new_tokens,
          'rms_norm_eps': 1e-6, 'rope_theta': 10000.0, 'hidden_act': 'silu', 'tie_word_embeddings': not args.untied,
          'attention_bias': False, 'mlp_bias': False, 'attention_dropout': 0.0}


def paxcli_decoder(config: dict, state_dict: dict):
  """A Decoder of the same Llama in paxcli, its weights converted from `state_dict`."""
  import jax
  import numpy as np

  from paxcli import config as cfg
  from paxcli.convert.core import nest
  from paxcli.loops.decode.decoder import Decoder
  from paxcli.models.lm import flat_view
  from paxcli.models.llama import LLAMA
  from paxcli.models.weight_map import WeightMap
  from paxcli.runtime import engine

  knobs, _ = LLAMA.from_hf_config(config, 'benchmark')
  setup = engine.build(cfg.resolve('default.StdlibDocsLm', [f'{k}={v!r}' for k, v in knobs.items()]))
  wmap = WeightMap(LLAMA.hf_weights(flat_view(setup.model)))
  flat = {name[len('params/'):]: wmap.from_hf(name, lambda hf: state_dict[hf].numpy()).astype(np.float32)
          for name in wmap.paxcli_shapes}
  params = jax.device_put(nest(flat), setup.state_shardings['params'])
  return Decoder(setup, params)


def time_paxcli(decoder, prompts, new_tokens: int, repeats: int):
  from paxcli.loops.decode.options import DecodeOptions
  opts = DecodeOptions(max_decode_steps=new_tokens, batch_size=len(prompts), ignore_eos=True)
  decoder.run(prompts, opts)  # compiles
  best = None
  for _ in range(repeats):
    start, cpu = time.perf_counter(), time.process_time()
    records, _ = decoder.run(prompts, opts)
    elapsed = (time.perf_counter() - start, time.process_time() - cpu)
    best = elapsed if best is None else min(best, elapsed)
  return best, [r['decoded_ids'] for r in records]


def time_hf(model, ids, new_tokens: int, repeats: int):
  import torch
  kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None)
  with torch.inference_mode():
    model.generate(ids, **kwargs)   # warm-up
    best = None
    for _ in range(repeats):
      start, cpu = time.perf_counter(), time.process_time()
      out = model.generate(ids, **kwargs)
      elapsed = (time.perf_counter() - start, time.process_time() - cpu)
      best = elapsed if best is None else min(best, elapsed)
  return best, out[:, ids.shape[1]:].tolist()


def agreement(a: list, b: list) -> tuple[float, int]:
  """(share of rows equal, first differing position over all rows or -1)."""
  same = sum(x == y for x, y in zip(a, b)) / len(a)
  first = min((next(i for i, (p, q) in enumerate(zip(x, y)) if p != q) for x, y in zip(a, b) if x != y), default=-1)
  return same, first


def add_arguments(parser, new_tokens: int) -> None:
  """The model's, the prompts' and the machine's flags (shared with decode_roofline.py)."""
  parser.add_argument('--batch-sizes', default='1,16,64')
  parser.add_argument('--prompt-len', type=int, default=64)
  parser.add_argument('--new-tokens', type=int, default=new_tokens)
  parser.add_argument('--threads', type=int, default=2)
  parser.add_argument('--layers', type=int, default=12)
  parser.add_argument('--dims', type=int, default=768)
  parser.add_argument('--heads', type=int, default=12)
  parser.add_argument('--kv-heads', type=int, default=4)
  parser.add_argument('--hidden', type=int, default=2048)
  parser.add_argument('--vocab', type=int, default=32000)
  parser.add_argument('--untied', action='store_true', help='a separate output projection (lm_head)')
  machine.add_isa_argument(parser)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  add_arguments(parser, new_tokens=256)
  parser.add_argument('--repeats', type=int, default=2)
  args = parser.parse_args()
  machine.restrict(args.isa)
  os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.threads])   # before XLA sizes its pool
  import jax
  import numpy as np
  import torch
  import transformers
  from rich.console import Console
  from rich.table import Table

  from paxcli.loops.decode.prompts import Prompt

  torch.set_num_threads(args.threads)
  torch.manual_seed(0)
  config = hf_config(args)
  hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
  params = sum(p.numel() for p in hf_model.parameters())
  decoder = paxcli_decoder(config, hf_model.state_dict())
  embeddings = 'untied' if args.untied else 'tied'
  table = Table(title=f'Greedy decoding, Llama {params / 1e6:.0f}M ({args.layers} layers, d{args.dims}, GQA '
                      f'{args.heads}/{args.kv_heads}, vocab {args.vocab}, {embeddings}), {args.prompt_len}-token '
                      f'prompts, {args.new_tokens} new tokens, {args.threads} threads each, float32; best of {args.repeats}')
  for col in ('batch', 'paxcli tokens/s', 'transformers tokens/s', 'paxcli / transformers', 'same tokens',
              'first difference', 'tokens per CPU-s: paxcli / transformers'):
    table.add_column(col, justify='right')
  rng = np.random.default_rng(0)
  for b in [int(x) for x in args.batch_sizes.split(',')]:
    ids = rng.integers(3, args.vocab, (b, args.prompt_len))
    (pax_s, pax_cpu), pax_ids = time_paxcli(decoder, [Prompt(row.tolist()) for row in ids], args.new_tokens,
                                            args.repeats)
    (hf_s, hf_cpu), hf_ids = time_hf(hf_model, torch.as_tensor(ids), args.new_tokens, args.repeats)
    same, first = agreement(pax_ids, hf_ids)
    pax_tps, hf_tps = b * args.new_tokens / pax_s, b * args.new_tokens / hf_s
    table.add_row(str(b), f'{pax_tps:,.1f}', f'{hf_tps:,.1f}', f'{pax_tps / hf_tps:.2f}x', f'{same:.0%}',
                  '-' if first < 0 else f'token {first}', f'{hf_cpu / pax_cpu:.2f}x')
    Console().print(f'batch {b}: paxcli {pax_tps:,.1f} tokens/s, transformers {hf_tps:,.1f} tokens/s')
  console = Console()
  console.print(table)
  console.print(f'{machine.describe()} (at the end: a loaded machine lowers both sides)')
  flags = os.environ.get('XLA_FLAGS', '')
  console.print(f'jax {jax.__version__} on {jax.devices()[0].device_kind} (XLA_FLAGS={flags!r}); '
                f'torch {torch.__version__} (ATen {torch.backends.cpu.get_cpu_capability()}), '
                f'transformers {transformers.__version__}')


if __name__ == '__main__':
  main()
