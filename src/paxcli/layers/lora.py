"""LoRA: low-rank adapters beside frozen projection kernels (Hu et al. 2021; PEFT's layout).

A targeted projection y = x W gains y += (dropout(x) A B) * alpha / r, with A [in..., r] and
B [r, out...] named `<projection>_lora_a` / `_lora_b` beside the projection's own weights
(layer_0/attention/query_lora_a next to layer_0/attention/query/kernel). A starts as PEFT's
default, torch's kaiming-uniform with a = sqrt(5): uniform in +-1/sqrt(fan_in); B starts at
zero, so a fresh adapter leaves the model's function unchanged. Dropout applies to the
adapter's input only, and only in training.

Which weights train is the model's business (models.LanguageModel.is_trainable: the adapters
alone when LoRA is on); this module declares the adapters, merges them into kernels
(W + scale A B, for `pax checkpoint convert --merge-lora`) and names them.
"""

from __future__ import annotations

import math
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

TARGETS = ('query', 'key', 'value', 'output', 'mlp')
SUFFIX_A, SUFFIX_B = '_lora_a', '_lora_b'
# A target -> the projections (flax module names) it adapts.
# Latent attention (paxcli.layers.mla): the query's projections (query, or query_down and query_up); key and
# value come from the same ones (kv_down, kv_up), which 'key' and 'value' adapt together.
PROJECTIONS = {'query': ('query', 'query_down', 'query_up'), 'key': ('key', 'kv_down', 'kv_up'),
               'value': ('value', 'kv_down', 'kv_up'), 'output': ('out',), 'mlp': ('wi_0', 'wi_1', 'wo')}


def targets_projection(targets: Sequence[str], projection: str) -> bool:
  """True when `projection` (query, out, wi_0, ...) is adapted under `targets`."""
  return any(projection in PROJECTIONS.get(t, ()) for t in targets)


def is_adapter(name: str) -> bool:
  """True for an adapter weight's name (the last part of its path)."""
  return name.endswith((SUFFIX_A, SUFFIX_B))


def _kaiming_uniform_a_sqrt5(num_in_axes: int):
  """torch.nn.Linear's (and PEFT's lora_A) init: uniform in +-1/sqrt(fan_in), fan_in = the input axes."""
  def init(key, shape, dtype=jnp.float32):
    bound = 1.0 / math.sqrt(math.prod(shape[:num_in_axes]))
    return jax.random.uniform(key, shape, dtype, -bound, bound)
  return init


def delta(module: nn.Module, x, projection: str, in_names: tuple, out_shape: tuple, out_names: tuple,
          rank: int, alpha: float, dropout: float, deterministic: bool):
  """The adapter's term for `projection`, declared in `module`: (dropout(x) A B) * alpha / rank.

  x [..., in...] with len(in_names) input axes last; returns [..., out_shape...] in x's dtype.
  """
  a, b = adapter(module, projection, tuple(x.shape[-len(in_names):]), in_names, out_shape, out_names, rank)
  return applied(x, a, b, len(in_names), alpha, dropout, deterministic)


def adapter(module: nn.Module, projection: str, in_shape: tuple, in_names: tuple, out_shape: tuple,
            out_names: tuple, rank: int):
  """(A [in..., r], B [r, out...]) of `projection`, declared in `module` (A as PEFT's lora_A starts, B at 0); where
  each row of the batch has its own adapter (`pax serve`: the params hold them stacked), A [B, in..., r] and
  B [B, r, out...] as they are (per_row)."""
  name_a, name_b = projection + SUFFIX_A, projection + SUFFIX_B
  if module.has_variable('params', name_a) and per_row(module.get_variable('params', name_a), len(in_shape)):
    return module.get_variable('params', name_a), module.get_variable('params', name_b)
  a = module.param(name_a, nn.with_logical_partitioning(_kaiming_uniform_a_sqrt5(len(in_shape)),
                                                        tuple(in_names) + (None,)),
                   tuple(in_shape) + (rank,))
  b = module.param(name_b, nn.with_logical_partitioning(nn.initializers.zeros, (None,) + tuple(out_names)),
                   (rank,) + tuple(out_shape))
  return a, b


def per_row(a, n_in: int) -> bool:
  """Whether adapter A (of a projection with `n_in` input axes) holds one adapter per row of the batch."""
  return a.ndim == n_in + 2


def applied(x, a, b, n_in: int, alpha: float, dropout: float, deterministic: bool):
  """(dropout(x) A B) * alpha / rank for x [..., in...] with `n_in` input axes last, inside the module that
  declared the adapter (its dropout is one of its children); per-row adapters: _per_row."""
  rank = a.shape[-1]
  if per_row(a, n_in):
    return _per_row(x, a, b, n_in, alpha / rank)
  x = nn.Dropout(dropout, deterministic=deterministic)(x)
  h = jnp.tensordot(x, a.astype(x.dtype), axes=(tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))))
  y = jnp.tensordot(h, b.astype(x.dtype), axes=((h.ndim - 1,), (0,)))
  return y * jnp.asarray(alpha / rank, x.dtype)


def _per_row(x, a, b, n_in: int, scale: float):
  """The adapter's term when each row of the batch has its own adapter (`pax serve` with several adapters of
  one base): a [B, in..., r] and b [B, r, out...] hold row b's A and B (zeros: the base alone). Decoding only:
  no dropout."""
  rows, rank = x.shape[0], a.shape[-1]
  x_BxTxI = x.reshape(rows, -1, math.prod(x.shape[x.ndim - n_in:]))
  h_BxTxR = jnp.einsum('bti,bir->btr', x_BxTxI, a.reshape(rows, -1, rank).astype(x.dtype))
  y_BxTxO = jnp.einsum('btr,bro->bto', h_BxTxR, b.reshape(rows, rank, -1).astype(x.dtype))
  return (y_BxTxO * jnp.asarray(scale, x.dtype)).reshape(x.shape[:x.ndim - n_in] + b.shape[2:])


def merged_kernel(kernel, a, b, scale: float) -> np.ndarray:
  """kernel + scale * A B, in float32 then the kernel's dtype; a scanned stack ([layers, ...] on all
  three) merges layer by layer."""
  kernel, a, b = (np.asarray(v, np.float32) for v in (kernel, a, b))
  stacked = a.ndim + b.ndim - 2 - kernel.ndim  # 1: a leading layers axis on each
  if stacked:
    product = np.stack([np.tensordot(a[i], b[i], axes=1) for i in range(a.shape[0])])
  else:
    product = np.tensordot(a, b, axes=1)
  return kernel + np.float32(scale) * product


def merge(params: dict, scale: float) -> dict:
  """A nested params dict with every adapter folded into its kernel and removed (float32 kernels)."""
  out = {}
  adapters = {k[:-len(SUFFIX_A)] for k in params if isinstance(k, str) and k.endswith(SUFFIX_A)}
  for key, value in params.items():
    if isinstance(key, str) and is_adapter(key):
      continue
    if isinstance(value, dict):
      value = merge(value, scale)
      if key in adapters:
        value = dict(value, kernel=merged_kernel(value['kernel'], params[key + SUFFIX_A],
                                                 params[key + SUFFIX_B], scale))
    out[key] = value
  return out
