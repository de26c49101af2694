"""int8 products in training (AQT=int8): Pax's (and MaxText's) Accurate Quantized Training for the projections.

The projections (attention query/key/value/out, the MLP's wi_0/wi_1/wo) are flax Dense/DenseGeneral layers; the
int8 product enters through their `dot_general_cls`, as fp8 does (paxcli.layers.fp8). Weights stay float (their
checkpoints are those of the float model); each product quantizes its two operands on the fly, symmetrically, to
int8 codes round(x / s) with s = max |x| / 127 over the axis the product sums:

  forward    y = x w            x per token (a row of x), w per output channel
  backward   dx = g w^T         g per token, w per input channel
             dw = x^T g         x per input channel, g per output channel

each product of int8 codes summed exactly in int32, then scaled back (aqtp's fully_quantized int8 config:
every matmul of the step is int8, forward and backward). With AQT_STOCHASTIC_ROUNDING the gradient g rounds
stochastically (uniform noise in [-1/2, 1/2) before rounding: unbiased) in the two backward products, from the
train step's random stream; eval, decode and score round to nearest.

Codes are [-127, 127] (the symmetric range; -128 unused), a row of zeros codes to zeros with scale 0.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from paxcli.layers.base import RANDOM

MODES = ('none', 'int8')


def quantize(x, axis, key=None):
  """(int8 codes, float32 scale, keepdims over `axis`) of x: symmetric, scale = max |x| / 127 over `axis`; with
  a PRNG `key`, stochastic rounding."""
  x = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x), axis=axis, keepdims=True) / 127.0
  scaled = x / jnp.where(scale > 0, scale, 1.0)
  if key is not None:
    scaled = scaled + jax.random.uniform(key, x.shape, jnp.float32, -0.5, 0.5)
  return jnp.clip(jnp.round(scaled), -127, 127).astype(jnp.int8), scale


def _int_matmul(a, b):
  """[M, K] x [K, N] int8 codes summed exactly in int32, as float32."""
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32).astype(jnp.float32)


def _fwd(x2, w2):
  xq, xs = quantize(x2, 1)    # per token
  wq, ws = quantize(w2, 0)    # per output channel
  return _int_matmul(xq, wq) * xs * ws


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def int8_matmul(x2, w2, key, stochastic: bool):
  """x2 [T, n_in] @ w2 [n_in, n_out] with both operands as int8 codes, forward and backward (module
  docstring); float32 out. `key` (a PRNG key, or None) draws the gradient's stochastic rounding."""
  return _fwd(x2, w2)


def _int8_fwd(x2, w2, key, stochastic):
  return _fwd(x2, w2), (x2, w2, key)


def _int8_bwd(stochastic, residuals, g):
  x2, w2, key = residuals
  keys = jax.random.split(key) if (stochastic and key is not None) else (None, None)
  gq, gs = quantize(g, 1, keys[0])            # per token
  wq, ws = quantize(w2, 1)                    # per input channel
  dx = _int_matmul(gq, wq.T) * gs * ws.T
  xq, xs = quantize(x2, 0)                    # per input channel
  gq, gs = quantize(g, 0, keys[1])            # per output channel
  dw = _int_matmul(xq.T, gq) * xs.T * gs
  return dx.astype(x2.dtype), dw.astype(w2.dtype), None


int8_matmul.defvjp(_int8_fwd, _int8_bwd)


class Int8DotGeneral(nn.Module):
  """A dot_general for flax's Dense and DenseGeneral (`dot_general_cls`): the int8 product of int8_matmul. They
  contract the last axes of the input with the first of the kernel, the only form taken."""
  stochastic_rounding: bool = False

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    del precision, preferred_element_type   # the product's precision is int8's; its output the inputs' dtype
    (lc, rc), (lb, rb) = dimension_numbers
    n = len(lc)
    if lb or rb or tuple(lc) != tuple(range(lhs.ndim - n, lhs.ndim)) or tuple(rc) != tuple(range(n)):
      raise ValueError(f'AQT=int8 multiplies inputs [..., in] by kernels [in, out]; got dimension numbers '
                       f'{dimension_numbers}.')
    n_in = math.prod(rhs.shape[:n])
    out_shape = lhs.shape[:lhs.ndim - n] + rhs.shape[n:]
    key = self._key() if self.stochastic_rounding else None
    y = int8_matmul(lhs.reshape(-1, n_in), rhs.reshape(n_in, -1), key, self.stochastic_rounding)
    return y.reshape(out_shape).astype(rhs.dtype)

  def _key(self) -> Optional[jax.Array]:
    """The train step's random stream (stochastic rounding); None outside training (round to nearest)."""
    return self.make_rng(RANDOM) if self.has_rng(RANDOM) else None


def dot_general_cls(mode: str, stochastic_rounding: bool = False):
  """What a Dense's `dot_general_cls` is under AQT=`mode` (None: the plain product)."""
  if mode == 'int8':
    return functools.partial(Int8DotGeneral, stochastic_rounding=stochastic_rounding)
  return None
