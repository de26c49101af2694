"""fp8 matmuls for the projections (knob FP8): e4m3 inputs and weights forward, e5m2 gradients back.

The projections (attention query/key/value/out, the MLP's wi_0/wi_1/wo) are flax Dense/DenseGeneral
layers; fp8 enters through their `dot_general_cls`, the injection point flax made for it. Weights stay
in float32 (or FPROP_DTYPE) and only the product runs in fp8, so checkpoints, conversions and HF
exports hold the ordinary de-quantized weights.

  'delayed'  flax's Fp8DirectDotGeneralOp (flax.linen.fp8_ops): each tensor is scaled by the largest
             |value| over the last FP8_AMAX_HISTORY steps (Transformer Engine's delayed scaling). Its
             state, scales and amax histories, is the flax collection FP8_STATE; the train step
             differentiates with respect to it and takes the result as the next state (flax's
             "overwrite with gradient"), and the train state keeps it as 'fp8', so checkpoints hold
             it and a resumed run continues as an uninterrupted one.
  'current'  each tensor scaled by its own largest |value| in this step (torchao's tensorwise, Qwix's
             absmax): no state. Inference (eval, decode, score) of a 'delayed' model uses it too,
             since those are given the params alone.

On a device without fp8 matmul units (CPUs, GPUs before Ada/Hopper) XLA emulates the fp8 products:
the numerics of fp8, not its speed (`emulated` says which).
"""

from __future__ import annotations

import functools
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

FP8_STATE = fp8_ops.OVERWRITE_WITH_GRADIENT   # the flax collection of delayed scaling's state
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


class DelayedFp8(fp8_ops.Fp8DirectDotGeneralOp):
  """flax's delayed-scaling fp8 dot_general; where its state is absent (a model applied to params alone:
  eval, decode, score) it scales by the current tensors instead."""

  def setup(self):
    if self.is_initializing() or self.has_variable(FP8_STATE, 'input_scale'):
      super().setup()

  def __call__(self, *args, **kwargs):
    if self.has_variable(FP8_STATE, 'input_scale'):
      return super().__call__(*args, **kwargs)
    return current_scaled_dot_general(*args[:3])


class CurrentFp8(nn.Module):
  """A dot_general for flax's Dense: fp8 with current (per-step, per-tensor) scaling; no state."""

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    del precision, preferred_element_type   # the product's precision is fp8's; its output the inputs' dtype
    return current_scaled_dot_general(lhs, rhs, dimension_numbers)


def dot_general_cls(mode: str, amax_history: int = 1024):
  """What a Dense's `dot_general_cls` is under FP8=`mode` (None: the plain product)."""
  if mode == 'delayed':
    return functools.partial(DelayedFp8, amax_history_length=amax_history)
  if mode == 'current':
    return CurrentFp8
  return None


def scale_of(x, q_dtype):
  """The current scale of `x` for `q_dtype` (x / scale fills its range): max |x| / the dtype's largest
  finite value, float32; 1 where x is all zeros or not finite (as flax's compute_scale keeps the last)."""
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  scale = amax / jnp.finfo(q_dtype).max.astype(jnp.float32)
  return jnp.where((amax > 0) & jnp.isfinite(amax), scale, 1.0).reshape(1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def current_scaled_dot_general(lhs, rhs, dimension_numbers):
  """lax.dot_general with lhs and rhs quantized to e4m3 by their current scales (and the gradient to
  e5m2 by its own on the way back); the product accumulates in the inputs' dtype (rhs's, the weight)."""
  return _current_fwd(lhs, rhs, dimension_numbers)[0]


def _current_fwd(lhs, rhs, dimension_numbers):
  dtype = rhs.dtype
  lhs = lhs.astype(dtype)
  ls, rs = scale_of(lhs, E4M3), scale_of(rhs, E4M3)
  q_lhs, q_rhs = fp8_ops.quantize(lhs, E4M3, ls, dtype), fp8_ops.quantize(rhs, E4M3, rs, dtype)
  out = jax.lax.dot_general(q_lhs, q_rhs, dimension_numbers, preferred_element_type=dtype)
  return fp8_ops.dequantize(out, dtype, ls * rs), (q_lhs, q_rhs, ls, rs)


def _current_bwd(dimension_numbers, residuals, g):
  q_lhs, q_rhs, ls, rs = residuals
  dtype = g.dtype
  gs = scale_of(g, E5M2)
  q_g = fp8_ops.quantize(g, E5M2, gs, dtype)
  d_lhs = fp8_ops.dot_general_transpose_lhs(q_g, q_lhs, q_rhs, dimension_numbers=dimension_numbers, precision=None,
                                            preferred_element_type=dtype)
  d_rhs = fp8_ops.dot_general_transpose_rhs(q_g, q_lhs, q_rhs, dimension_numbers=dimension_numbers, precision=None,
                                            preferred_element_type=dtype)
  return fp8_ops.dequantize(d_lhs, dtype, rs * gs), fp8_ops.dequantize(d_rhs, dtype, ls * gs)


current_scaled_dot_general.defvjp(_current_fwd, _current_bwd)


# Device kinds with fp8 matmul units: NVIDIA Ada (sm_89) and Hopper/Blackwell (sm_90+), AMD MI300.
def has_fp8_units(device) -> bool:
  """Whether `device` multiplies fp8 in hardware (else XLA emulates it)."""
  if device.platform in ('gpu', 'cuda'):
    capability = getattr(device, 'compute_capability', None)
    try:
      return capability is not None and tuple(int(p) for p in str(capability).split('.')[:2]) >= (8, 9)
    except ValueError:
      return False
  if device.platform == 'rocm':
    return 'MI3' in getattr(device, 'device_kind', '')
  return False


def modes_of(flat: dict) -> tuple[str, ...]:
  """The FP8 modes other than 'none' a resolved config's flat fields (`Resolved.flat()`) set on its layers."""
  return tuple(sorted({v for k, v in flat.items() if k.endswith('.fp8') and v not in (None, 'none')}))


def _emulating(mode: str, device=None):
  """The device (the first one by default) when FP8=`mode` would run emulated on it, else None."""
  device = device or jax.devices()[0]
  return None if mode == 'none' or has_fp8_units(device) else device


def emulation_note(mode: str, device=None) -> Optional[str]:
  """One line when FP8=`mode` runs emulated on `device` (the first device); None when it need not be said."""
  device = _emulating(mode, device)
  return device and (f'FP8={mode} on {device.device_kind} ({device.platform}), which has no fp8 matmul units: '
                     'the products are emulated (the numerics of fp8, not its speed).')


def refusal(mode: str, device=None) -> Optional[str]:
  """The one line refusing to time FP8=`mode` where it would run emulated (a speed figure of emulated fp8
  measures XLA's emulation, not fp8); None where the device has fp8 units."""
  device = _emulating(mode, device)
  return device and (f'FP8={mode}: {device.device_kind} ({device.platform}) has no fp8 matmul units, so its fp8 '
                     'products would be emulated and their timing says nothing about fp8. Time fp8 on an NVIDIA '
                     'Ada/Hopper/Blackwell GPU or an AMD MI300; here use --compile-only for its memory plan, or '
                     'FP8=none.')
