"""The train state's helpers that the engine, the train loop, restore and conversions share.

The train state is a dict {'step', 'params', 'opt_state'} (+ 'non_trainable'); here: its
logical-name boxes taken off (unbox), its key paths as names (keys, path_name), the params
split by what trains (LoRA: adapters train, the base stays frozen, and checkpoints hold only
what trains: saved_state), its shapes (shape_signature, param_count) and the checksums a
checkpoint is saved and verified with.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from paxcli.layers import quant


def unbox(tree):
  return nn.meta.unbox(tree)


def keys(path) -> tuple:
  """The keys of a pytree key path (dict keys, attribute names, indices) as plain values."""
  out = []
  for k in path:
    for attr in ('key', 'name', 'idx'):
      if hasattr(k, attr):
        out.append(getattr(k, attr))
        break
  return tuple(out)


def path_name(path) -> str:
  """'params/layers/mlp/wo/kernel' for a pytree key path: the names checksums are kept under."""
  return '/'.join(str(k) for k in keys(path))


# ---- frozen weights (LoRA): the model's is_trainable says which params train --------------------

def _flat(params) -> dict:
  return flax.traverse_util.flatten_dict(params) if params else {}


def split_trainable(model, params) -> tuple[dict, dict]:
  """(trainable, frozen) nested dicts of params, by the model's is_trainable; frozen is {} when all train."""
  trainable, frozen = {}, {}
  for path, leaf in _flat(params).items():
    (trainable if model.is_trainable(path) else frozen)[path] = leaf
  return flax.traverse_util.unflatten_dict(trainable), flax.traverse_util.unflatten_dict(frozen)


def join_params(*parts) -> dict:
  """One nested params dict from disjoint parts (split_trainable's, or adapters and a base)."""
  flat = {}
  for part in parts:
    flat.update(_flat(part))
  return flax.traverse_util.unflatten_dict(flat)


def has_frozen(setup) -> bool:
  """True when some params are frozen (a LoRA base): checkpoints then hold the trainable ones and name the base.
  Quantized kernels alone (WEIGHT_QUANT without LoRA: decode, score) are no base: they are read from the
  checkpoint's own float kernels."""
  frozen = split_trainable(setup.model, setup.abstract_state['params'])[1]
  return any(not quant.is_quantized_path(path) for path in _flat(frozen))


def quantized(setup) -> bool:
  """True when the params hold quantized kernels (WEIGHT_QUANT)."""
  return any(quant.is_quantized_path(path) for path in _flat(setup.abstract_state['params']))


def cast_frozen(model, params):
  """Boxed or plain params with the frozen floating-point ones cast to the model's frozen_dtype."""
  dtype = getattr(model, 'frozen_dtype', None)
  if not dtype:
    return params
  is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)

  def one(path, leaf):
    value = leaf.unbox() if is_box(leaf) else leaf
    names = tuple(keys(path))
    if model.is_trainable(names) or not jnp.issubdtype(value.dtype, jnp.floating) or quant.is_quantized_path(names):
      return leaf   # a quantized kernel's scales keep float32: its codes are read against them
    cast = value.astype(dtype)
    return leaf.replace_boxed(cast) if is_box(leaf) else cast
  return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_box)


def saved_state(setup, state: dict) -> dict:
  """The part of a train state (or of its abstract) that checkpoints hold: the frozen params are left
  out (they are the base's, named in the checkpoint's meta)."""
  if not has_frozen(setup):
    return state
  return dict(state, params=split_trainable(setup.model, state['params'])[0])


def param_count(abstract_state) -> int:
  """The weights the params stand for: a quantized kernel counts as the kernel it codes (layers.quant)."""
  flat = jax.tree_util.tree_flatten_with_path(abstract_state['params'])[0]
  return int(sum(quant.represented_elements(keys(path), x.shape) for path, x in flat))


def shape_signature(abstract_state) -> dict[str, list[int]]:
  """'path' -> shape for every leaf of the state: what a checkpoint must match."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
    out['/'.join(str(k) for k in keys(path))] = list(leaf.shape)
  return out


def checksums(state) -> dict[str, str]:
  """'path' -> checksum of every array of `state`, computed where the arrays live (one jitted pass).

  Each array's bits (as unsigned integers) are summed modulo 2**32 in two lanes, weighted by
  odd multipliers that depend on the element's position: any single flipped bit changes the
  sum, and the result does not depend on how the array is sharded (integer addition modulo
  2**32 is exact in any order), so a checkpoint verifies on another mesh or process count.
  """
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  names = [path_name(path) for path, _ in flat]
  out = _checksum_fn()([leaf for _, leaf in flat])
  if jax.process_count() > 1:
    out = multihost_utils.process_allgather(out, tiled=True)
  sums = np.asarray(jax.device_get(out))
  return {name: checksum_hex(lanes) for name, lanes in zip(names, sums)}


def checksum_part(x, offset: int = 0):
  """checksums()'s two lanes (uint32) for the elements of x at flat positions offset, offset+1, ...

  The NumPy twin of the jitted pass, for writers that stream an array in pieces (checkpoint
  conversion): the lanes of the pieces of one array add up (modulo 2**32) to the lanes of the
  whole, so checksum_hex(sum of parts) equals what checksums() computes for the array.
  """
  x = np.ascontiguousarray(x)
  if x.dtype == np.bool_:
    b, words = x.reshape(-1).astype(np.uint32), 1
  elif x.dtype.itemsize == 8:   # both 32-bit halves, as the jitted pass does
    b, words = x.reshape(-1).view(np.uint32), 2
  else:
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
    b, words = x.reshape(-1).view(width).astype(np.uint32), 1
  i = (np.arange(b.size, dtype=np.uint64) + np.uint64(offset * words)).astype(np.uint32)
  lane1 = np.sum(b * (i * np.uint32(2) + np.uint32(1)), dtype=np.uint32)
  lane2 = np.sum((b ^ (i * np.uint32(0x9E3779B9))) * np.uint32(0x85EBCA6B), dtype=np.uint32)
  return np.array([lane1, lane2], np.uint32)


def checksum_hex(lanes) -> str:
  return f'{int(lanes[0]):08x}{int(lanes[1]):08x}'


@functools.cache
def _checksum_fn():
  """One jitted checksum pass, compiled once per set of shapes and reused at every save."""
  def bits(x):
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
      return x.astype(jnp.uint32)
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}.get(x.dtype.itemsize)
    if width is None:  # 8-byte values: both halves
      halves = jax.lax.bitcast_convert_type(x, jnp.uint32)
      return halves.reshape(x.shape + (2,))
    return jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)

  def one(x):
    b = bits(x).reshape(-1)
    i = jnp.arange(b.shape[0], dtype=jnp.uint32)
    lane1 = jnp.sum(b * (i * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)
    lane2 = jnp.sum((b ^ (i * jnp.uint32(0x9E3779B9))) * jnp.uint32(0x85EBCA6B), dtype=jnp.uint32)
    return jnp.stack([lane1, lane2])

  return jax.jit(lambda leaves: jnp.stack([one(x) for x in leaves]) if leaves
                 else jnp.zeros((0, 2), jnp.uint32))
