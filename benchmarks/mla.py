"""DeepSeek-V3's parts against their usual counterparts: latent attention's decode cache and step, DeepSeekMoE's step.

  .venv/bin/python benchmarks/mla.py [--length 2048] [--repeats 20] [--skip-decode] [--skip-moe]

1. KV-cache bytes per token and layer at DeepSeek-V3's sizes (bfloat16; shapes only, nothing allocated): the
   latent and rotary key of multi-head latent attention, against grouped-query attention with 128 heads of 128 and
   8 key/value heads (a Llama-3-70B-like layer) and against the full keys and values of its own 128 heads.
2. One decode step (batch 1, float32, the median of --repeats) after --length tokens of a small model (2 layers x
   512, 8 heads), whose step is mostly attention: latent attention (latent 128, heads 64 + 32 rotary, values 64) in
   each decode form, against GQA with 2 key/value heads of 64; parameters counted, so the sizes can be compared.
3. One training step (forward + backward, 2 layers x 256, 16 experts of 256, 4 per token, dropless, batch 4 x 256)
   of DeepSeekMoE's routing (sigmoid, bias, 4 groups of which 2, a shared expert of 256) against Mixtral's
   (softmax over the chosen, no shared expert): the router and the shared expert's share of the time.

The machine may be shared: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import time

_V3 = {'KV_LORA_RANK': 512, 'Q_LORA_RANK': 1536, 'QK_NOPE_HEAD_DIMS': 128, 'QK_ROPE_HEAD_DIMS': 64, 'V_HEAD_DIMS': 128,
       'NUM_HEADS': 128, 'MODEL_DIMS': 7168}


def _model(values: dict):
  from paxcli.layers.base import instantiate
  from paxcli.models import knobs, lm_config
  return instantiate(lm_config(**knobs.flat_settings({'NORM_TYPE': 'rmsnorm', 'POSITION_EMBEDDING': 'rotary',
                                                      'USE_BIAS': False, **values}, knobs.LM_KNOBS)))


def cache_bytes_per_token(values: dict, length: int = 4096) -> float:
  """Bytes of one layer's KV cache (bfloat16, batch 1) per token: shapes only."""
  import jax
  model = _model({'VOCAB_SIZE': 256, 'NUM_LAYERS': 1, 'HIDDEN_DIMS': 256, 'MAX_SEQ_LEN': length, **values})
  model = model.with_fprop_dtype('bfloat16')
  params = jax.eval_shape(lambda r: model.init(r, jax.numpy.zeros((1, 8), 'int32'))['params'], jax.random.key(0))
  cache = jax.eval_shape(lambda p: model.init_cache(p, 1, length), params)
  arrays = [x for x in jax.tree.leaves(cache) if len(x.shape) >= 2 and length in x.shape]
  return sum(x.size * x.dtype.itemsize for x in arrays) / length


def decode_step(values: dict, length: int, repeats: int) -> dict:
  """Median seconds of one decode step after `length` tokens, and the model's parameter count."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  model = _model({'VOCAB_SIZE': 1024, 'NUM_LAYERS': 2, 'MODEL_DIMS': 512, 'HIDDEN_DIMS': 1024, 'NUM_HEADS': 8,
                  'MAX_SEQ_LEN': length + 1, **values})
  params = nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))['params'])
  count = sum(x.size for x in jax.tree.leaves(params))
  cache = jax.tree.map(jnp.asarray, nn.meta.unbox(model.init_cache(params, 1, length + 1)))
  step = jax.jit(model.extend, donate_argnums=1)
  ids = jax.random.randint(jax.random.key(1), (1, length), 0, 1024)
  _, cache = step(params, cache, ids, jnp.arange(length)[None])
  one, at = ids[:, :1], jnp.full((1, 1), length)
  logits, cache = step(params, cache, one, at)
  jax.block_until_ready(logits)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    logits, cache = step(params, cache, one, at)
    jax.block_until_ready(logits)
    times.append(time.perf_counter() - t0)
  return {'s': sorted(times)[len(times) // 2], 'params': count}


def train_step(values: dict, repeats: int) -> float:
  """Median seconds of forward + backward of the mean logit square over a batch of 4 x 256."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  model = _model({'VOCAB_SIZE': 1024, 'NUM_LAYERS': 2, 'MODEL_DIMS': 256, 'HIDDEN_DIMS': 256, 'NUM_HEADS': 4,
                  'NUM_KV_HEADS': 4, 'DIMS_PER_HEAD': 64, 'MAX_SEQ_LEN': 256, 'NUM_EXPERTS': 16,
                  'EXPERTS_PER_TOKEN': 4, 'MOE_DISPATCH': 'dropless', 'LOAD_BALANCE_LOSS_WEIGHT': 0.0, **values})
  ids = jax.random.randint(jax.random.key(1), (4, 256), 0, 1024)
  params = nn.meta.unbox(model.init(jax.random.key(0), ids)['params'])
  grads = jax.jit(jax.grad(lambda p: jnp.mean(model.apply({'params': p}, ids) ** 2)))
  jax.block_until_ready(grads(params))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(grads(params))
    times.append(time.perf_counter() - t0)
  return sorted(times)[len(times) // 2]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--length', type=int, default=2048)
  parser.add_argument('--repeats', type=int, default=20)
  parser.add_argument('--skip-decode', action='store_true')
  parser.add_argument('--skip-moe', action='store_true')
  args = parser.parse_args()
  import jax
  from rich.console import Console
  from rich.table import Table
  console = Console()
  console.print(f'{jax.devices()[0].device_kind}, {jax.device_count()} device(s); jax {jax.__version__}')
  if not args.skip_decode:
    table = Table(title="KV cache per token and layer at DeepSeek-V3's sizes, bfloat16 (shapes only)")
    for col in ('attention', 'bytes/token/layer', 'vs latent'):
      table.add_column(col, justify='left' if col == 'attention' else 'right')
    latent = cache_bytes_per_token(_V3)
    rows = [('latent (kv_lora_rank 512 + rotary key 64)', latent),
            ('GQA, 128 heads x 128, 8 key/value heads', cache_bytes_per_token(
                {'MODEL_DIMS': 7168, 'NUM_HEADS': 128, 'NUM_KV_HEADS': 8, 'DIMS_PER_HEAD': 128})),
            ('its own 128 heads expanded (keys 192, values 128)', 128 * (192 + 128) * 2)]
    for name, size in rows:
      table.add_row(name, f'{size:,.0f}', f'{size / latent:.1f}x')
    console.print(table)
    mla = {'KV_LORA_RANK': 128, 'Q_LORA_RANK': 0, 'QK_NOPE_HEAD_DIMS': 64, 'QK_ROPE_HEAD_DIMS': 32, 'V_HEAD_DIMS': 64}
    table = Table(title=f'One decode step after {args.length:,} tokens: 2 layers x 512, 8 heads, float32, batch 1 '
                        f'(median of {args.repeats})')
    for col in ('attention', 'parameters', 'ms/step', 'tokens/s'):
      table.add_column(col, justify='left' if col == 'attention' else 'right')
    for name, values in (('latent, absorbed', {**mla, 'MLA_DECODE': 'absorbed'}),
                         ('latent, expanded', {**mla, 'MLA_DECODE': 'expanded'}),
                         ('GQA, 2 key/value heads of 64', {'NUM_KV_HEADS': 2, 'DIMS_PER_HEAD': 64})):
      r = decode_step(values, args.length, args.repeats)
      table.add_row(name, f"{r['params']:,}", f"{r['s'] * 1e3:.2f}", f"{1 / r['s']:,.0f}")
    console.print(table)
  if not args.skip_moe:
    table = Table(title='Training step, 2 layers x 256, 16 experts of 256, 4 per token, dropless, batch 4 x 256, '
                        f'float32 (median of {max(3, args.repeats // 4)})')
    for col in ('routing', 'ms/step', 'vs Mixtral'):
      table.add_column(col, justify='left' if col == 'routing' else 'right')
    mixtral = train_step({'ROUTER_SOFTMAX': 'after_topk'}, max(3, args.repeats // 4))
    deepseek = {'ROUTER_SOFTMAX': 'sigmoid', 'ROUTER_BIAS': True, 'ROUTER_GROUPS': 4, 'ROUTER_TOPK_GROUPS': 2,
                'ROUTED_SCALING_FACTOR': 2.5}
    rows = [("Mixtral's (softmax over the chosen)", mixtral),
            ("DeepSeekMoE's router (sigmoid, bias, 2 of 4 groups)", train_step(deepseek, max(3, args.repeats // 4))),
            ('... and a shared expert of 256', train_step({**deepseek, 'SHARED_EXPERT_HIDDEN_DIMS': 256},
                                                          max(3, args.repeats // 4)))]
    for name, s in rows:
      table.add_row(name, f'{s * 1e3:.1f}', f'{s / mixtral:.2f}x')
    console.print(table)


if __name__ == '__main__':
  main()
