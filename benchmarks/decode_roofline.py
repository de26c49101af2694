"""Where a greedy decoding step's time goes, paxcli against transformers: the whole step beside its matrix
products alone, in each framework, on the same Llama as benchmarks/decode_vs_hf.py.

  .venv/bin/python benchmarks/decode_roofline.py [--batch-sizes 1,16,64] [--new-tokens 64] [--untied]
                                                 [--isa native|avx2] [--threads 2] (model flags as decode_vs_hf)

"products alone" chains one step's weight products (per layer q/k/v, out, the gated MLP's wi and wo, then the
output projection) on [batch, d] activations, with nothing else: no attention over the cache, no norms, no
sampling, no framework around them. XLA runs them jitted in the layouts paxcli's decoder uses on this processor
(joined q/k/v and wi_0/wi_1; the output projection [D, V] for one row, [V, D] for several); torch runs
F.linear with nn.Linear's [out, in] weights, as transformers' Llama does. A step cannot take less than its
products, so when both sides' steps sit near their products' time, and the products of both frameworks take
the same time, no rework of the decoder's other parts can make one side much faster than the other: only
fewer bytes or fewer products can (lower-precision weights, speculative decoding). The last columns give the
weights' bytes read per second by paxcli's step, against the bytes per second of the products alone.

Machines are shared and noisy: compare within one run only.
"""

from __future__ import annotations

import argparse
import os
import time

import decode_vs_hf
import machine


def layer_shapes(args) -> list[tuple[int, int]]:
  """[(in, out)] of one layer's products, with q/k/v and wi_0/wi_1 joined as the decoder joins them."""
  kv = args.dims // args.heads * args.kv_heads
  return [(args.dims, args.dims + 2 * kv), (args.dims, args.dims), (args.dims, 2 * args.hidden),
          (args.hidden, args.dims)]


def best_of(fn, repeats: int) -> float:
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)


def xla_products(args, batch: int, repeats: int) -> float:
  """Seconds for one step's products in XLA, in the decoder's layouts."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from paxcli.layers import cpu_isa
  transposed = cpu_isa.vector_isa() == 'avx2'   # the decoder lays its joined kernels out [N, D] there
  rng = np.random.default_rng(0)
  make = lambda shape: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02)
  layers = [[make((n, d) if transposed else (d, n)) for d, n in layer_shapes(args)] for _ in range(args.layers)]
  table = make((args.dims, args.vocab) if batch == 1 else (args.vocab, args.dims))
  product = (lambda x, w: x @ w.T) if transposed else (lambda x, w: x @ w)

  @jax.jit
  def step(x, layers, table):
    for qkv, out, wi, wo in layers:
      x = x + product(product(x, qkv)[:, :args.dims], out)
      g = product(x, wi)
      x = x + product(g[:, :args.hidden] * g[:, args.hidden:], wo)
    return x @ table if batch == 1 else x @ table.T

  x = make((batch, args.dims))
  return best_of(lambda: step(x, layers, table).block_until_ready(), repeats)


def torch_products(args, batch: int, repeats: int) -> float:
  """Seconds for one step's products in torch (F.linear, [out, in] weights as nn.Linear holds them)."""
  import torch
  import torch.nn.functional as F
  g = torch.Generator().manual_seed(0)
  make = lambda shape: torch.randn(shape, generator=g) * 0.02
  layers = [[make((n, d)) for d, n in layer_shapes(args)] for _ in range(args.layers)]
  table = make((args.vocab, args.dims))
  x0 = make((batch, args.dims))

  def step():
    with torch.inference_mode():
      x = x0
      for qkv, out, wi, wo in layers:
        x = x + F.linear(F.linear(x, qkv)[:, :args.dims], out)
        h = F.linear(x, wi)
        x = x + F.linear(h[:, :args.hidden] * h[:, args.hidden:], wo)
      return F.linear(x, table)
  return best_of(step, repeats)


def weight_bytes(args) -> int:
  per_layer = sum(d * n for d, n in layer_shapes(args))
  return 4 * (args.layers * per_layer + args.vocab * args.dims)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  decode_vs_hf.add_arguments(parser, new_tokens=64)
  parser.add_argument('--repeats', type=int, default=5, help='timed runs of the products (best kept)')
  args = parser.parse_args()
  machine.restrict(args.isa)
  os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.threads])   # before XLA sizes its pool
  import numpy as np
  import torch
  import transformers
  from rich.console import Console
  from rich.table import Table

  from paxcli.loops.decode.prompts import Prompt

  torch.set_num_threads(args.threads)
  torch.manual_seed(0)
  config = decode_vs_hf.hf_config(args)
  hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
  decoder = decode_vs_hf.paxcli_decoder(config, hf_model.state_dict())
  gb = weight_bytes(args) / 1e9
  table = Table(title=f'One greedy step against its products alone: Llama ({args.layers} layers, d{args.dims}, '
                      f'GQA {args.heads}/{args.kv_heads}, MLP {args.hidden}, vocab {args.vocab}, '
                      f'{"untied" if args.untied else "tied"}), float32, {args.threads} threads, '
                      f'{gb:.2f} GB of weights a step; mean step over {args.new_tokens} new tokens after '
                      f'{args.prompt_len}-token prompts (prefill included)')
  for col in ('batch', 'paxcli step ms', 'XLA products ms', 'transformers step ms', 'torch products ms',
              'paxcli step / torch step', 'weights GB/s: paxcli step', 'XLA products', 'torch products'):
    table.add_column(col, justify='right')
  rng = np.random.default_rng(0)
  for b in [int(x) for x in args.batch_sizes.split(',')]:
    ids = rng.integers(3, args.vocab, (b, args.prompt_len))
    (pax_s, _), _ = decode_vs_hf.time_paxcli(decoder, [Prompt(row.tolist()) for row in ids], args.new_tokens, 1)
    (hf_s, _), _ = decode_vs_hf.time_hf(hf_model, torch.as_tensor(ids), args.new_tokens, 1)
    pax_ms, hf_ms = 1e3 * pax_s / args.new_tokens, 1e3 * hf_s / args.new_tokens
    xla_ms, torch_ms = 1e3 * xla_products(args, b, args.repeats), 1e3 * torch_products(args, b, args.repeats)
    table.add_row(str(b), f'{pax_ms:.1f}', f'{xla_ms:.1f}', f'{hf_ms:.1f}', f'{torch_ms:.1f}',
                  f'{pax_ms / hf_ms:.2f}', f'{gb / pax_ms * 1e3:.1f}', f'{gb / xla_ms * 1e3:.1f}',
                  f'{gb / torch_ms * 1e3:.1f}')
    Console().print(f'batch {b}: paxcli {pax_ms:.1f} ms (products {xla_ms:.1f}), transformers {hf_ms:.1f} ms '
                    f'(products {torch_ms:.1f})')
  console = Console()
  console.print(table)
  console.print(machine.describe())
  console.print(f'torch {torch.__version__} (ATen {torch.backends.cpu.get_cpu_capability()}), '
                f'transformers {transformers.__version__}; XLA_FLAGS={os.environ.get("XLA_FLAGS", "")!r}')


if __name__ == '__main__':
  main()
