"""Quantized weights and KV cache: NF4 and int8 codes as bitsandbytes makes them, dequantised inside the products.

WEIGHT_QUANT stores the kernels of the projections (attention query/key/value/out, the MLP's wi_0/wi_1/wo) as
codes, each projection one flax param group beside its bias (`query/kernel_nf4/...` where a float model has
`query/kernel`):

  'nf4'   QLoRA's 4-bit NormalFloat (Dettmers et al. 2023; bitsandbytes' quantize_4bit with quant_type='nf4',
          compress_statistics=True). The kernel read as Hugging Face's Linear weight [out, in] (row-major, so a
          row is one output's inputs) is cut into blocks of QUANT_BLOCK_SIZE inputs; each block keeps its
          absmax, and each weight the nearest of NF4's 16 values to weight / absmax (bitsandbytes' midpoint
          rule). The block absmaxes are themselves quantized (double quantisation): their mean is the offset
          (summed exactly, so that the codes do not depend on the mesh or the compiled function),
          and (absmax - offset) in blocks of 256 is coded in bitsandbytes' 8-bit dynamic map, each block with a
          float32 scale. 4.127 bits a weight at blocks of 64.
            codes          uint8 [*in[:-1], in[-1] / 2, *out]  two codes a byte along the last input axis,
                                                               the first in the high nibble (bitsandbytes')
            absmax         uint8 [n_in / block, *out]           the blocks' absmax codes
            absmax_scale   float32 [ceil(blocks / 256)]         the absmax blocks' scales (bitsandbytes' state2)
            absmax_offset  float32 []                           the mean absmax
          These are bitsandbytes' own arrays laid out input-first (our kernels are [in..., out...]): its
          packed codes are ours transposed, element for element (to_bitsandbytes).
  'int8'  LLM.int8()'s weight format (bitsandbytes' int8_vectorwise_quant): per output channel, codes =
          round(w x 127 / absmax), kept as `codes` int8 [*in, *out] and `scale` float32 [*out] (the absmax).

The products dequantise on the fly: NF4 through its code tables, then an ordinary product in the compute
dtype; int8 multiplies by the codes converted to the compute dtype and scales each output channel after. The
gradient (for LoRA's input) dequantises again rather than keep the float kernel between the passes
(`quantized_product`, a custom VJP). The codes are frozen: the model's is_trainable leaves them out, so they
train only as LoRA's base (QLoRA), and decode and score quantize a float checkpoint as they read it
(`float_twin`, `quantize_like`: paxcli.jobdir.restore).

KV_CACHE_QUANT='int8' keeps the decoding cache's keys and values as int8 with a float32 scale per head and per
token (absmax / 127 over the head's E dimensions): `quantize_heads`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

FORMATS = ('none', 'nf4', 'int8')
KERNEL = 'kernel'
# Leading axes of a param that stack whole kernels, each quantized on its own: the scanned layers, the experts.
STACK_AXES = ('layers', 'exp')
DOUBLE_BLOCK = 256   # bitsandbytes' blocks of the absmax codes (compress_statistics)

# bitsandbytes' NF4 table (functional.get_4bit_type('nf4')), and its quantize_4bit's decision bounds: a value
# takes the code of the bucket it falls in, a value on a bound the lower one.
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], np.float32)
NF4_BOUNDS = (NF4[:-1] + NF4[1:]) / np.float32(2)


def _torch_linspace(n: int) -> np.ndarray:
  """torch.linspace(0.1, 1, n, dtype=float32) as torch computes it (from each end, step rounded to float32)."""
  start, end = np.float32(0.1), np.float32(1.0)
  step = np.float32((np.float64(end) - np.float64(start)) / (n - 1))
  i = np.arange(n)
  return np.where(i < n // 2, start + step * i, end - step * (n - 1 - i)).astype(np.float32)


def dynamic_map() -> np.ndarray:
  """bitsandbytes' signed 8-bit dynamic map (functional.create_dynamic_map(signed=True)): 256 float32 values,
  sorted; each decade 10^-6 .. 1 holds twice as many values as the one below."""
  data = []
  for i in range(7):
    edges = _torch_linspace(2 ** i + 1)
    means = (edges[:-1] + edges[1:]) / np.float32(2)
    scale = np.float32(10.0 ** (i - 6))
    data += list(scale * means) + list(-scale * means)
  return np.sort(np.array(data + [0.0, 1.0], np.float32))


DYNAMIC = dynamic_map()   # bitsandbytes' double quantisation codes the block absmaxes in it
LUT_STEPS = 65536


def _dynamic_lut() -> np.ndarray:
  """bitsandbytes' CPU quantizer of the dynamic map (cpu_ops.cpp, build_quantize_lut): [-1, 1] cut into 65536
  even steps, each taking the code of the midpoint interval it falls in; a value is looked up at its step."""
  midpoints = (np.float32(0.5) * (DYNAMIC[:-1] + DYNAMIC[1:])).astype(np.float32)
  steps = np.float32(-1.0) + (np.float32(2.0) * np.arange(LUT_STEPS, dtype=np.float32)) / np.float32(LUT_STEPS - 1)
  return np.searchsorted(midpoints, steps.astype(np.float32), side='left').astype(np.uint8)


_DYNAMIC_LUT = _dynamic_lut()


# ---- the codes ----------------------------------------------------------------------------------

def _dynamic_codes(normed):
  """Codes of values in [-1, 1] as bitsandbytes' CPU blockwise quantizer finds them: the step
  trunc(((v + 1) / 2) x 65535 + 1/2) of a 65536-step table (its CUDA kernel searches the map itself instead, and
  differs on a few values within a step of a midpoint)."""
  v = jnp.clip(normed, -1.0, 1.0)
  step = _rounded(((v + 1.0) * 0.5) * float(LUT_STEPS - 1)) + 0.5
  return jnp.asarray(_DYNAMIC_LUT)[jnp.clip(step.astype(jnp.int32), 0, LUT_STEPS - 1)]


def _steady_mean(x):
  """The mean of x >= 0 (float32), the same however XLA orders or splits the sum (a float32 sum's rounding
  follows its order, which fusion and sharding choose): each value on a grid of max(x) / (2^24 - 1), summed
  exactly as four int32 limbs of 6 bits (up to 2^25 values). Within a few ulp of torch's mean, as bitsandbytes
  takes it; it makes a kernel's codes a function of the kernel alone."""
  top = jnp.max(x)
  safe = jnp.where(top > 0, top, 1.0)
  grid = float(2 ** 24 - 1)
  q = jnp.round(x * (grid / safe)).astype(jnp.int32)   # one product a value: nothing for XLA to reassociate
  total = sum(jnp.sum((q >> shift) & 63).astype(jnp.float32) * float(2 ** shift) for shift in (18, 12, 6, 0))
  # products only, and kept from a multiply-add with the subtraction after it: eager and compiled round alike
  return _rounded((total * safe) * (1.0 / (grid * x.shape[0])))


def _double_quantize(absmax_flat, offset=None):
  """(codes uint8 [n], scales float32 [ceil(n / 256)], offset float32 []): quantize_4bit's compress_statistics
  on the blocks' absmax in bitsandbytes' order. The offset is their mean (given: that one)."""
  offset = _steady_mean(absmax_flat) if offset is None else jnp.asarray(offset, jnp.float32)
  centred = absmax_flat - offset
  n = centred.shape[0]
  blocks = -(-n // DOUBLE_BLOCK)
  padded = jnp.pad(centred, (0, blocks * DOUBLE_BLOCK - n)).reshape(blocks, DOUBLE_BLOCK)
  scales = jnp.max(jnp.abs(padded), axis=1)
  inverse = jnp.where(scales > 0, 1.0 / jnp.where(scales > 0, scales, 1.0), 0.0)   # a block of zeros codes to 0
  codes = jnp.where(scales[:, None] > 0, _dynamic_codes(padded * inverse[:, None]), 0)
  return codes.astype(jnp.uint8).reshape(-1)[:n], scales, offset


def _split(kernel, in_ndim: int):
  """(in shape, out shape, the kernel as [n_in, n_out])."""
  in_shape, out_shape = kernel.shape[:in_ndim], kernel.shape[in_ndim:]
  return in_shape, out_shape, kernel.reshape(math.prod(in_shape), math.prod(out_shape))


def _omajor(x_BxO):
  """[blocks, n_out] -> bitsandbytes' order (output-major: the blocks of output 0, then of output 1, ...)."""
  return x_BxO.T.reshape(-1)


def check_shape(in_shape: Sequence[int], block: int, where: str = 'the kernel') -> Optional[str]:
  """Why NF4 cannot code a kernel with these input axes at this block size (None when it can)."""
  n_in = math.prod(in_shape)
  if in_shape[-1] % 2:
    return f'{where} has {in_shape[-1]} inputs along its last input axis; NF4 packs two codes a byte (an even count)'
  if n_in % block:
    return (f'{where} has {n_in} inputs per output, not a multiple of QUANT_BLOCK_SIZE={block} (the NF4 blocks '
            'run along one output\'s inputs, as bitsandbytes\' do)')
  return None


def quantize_nf4(kernel, in_ndim: int, block: int = 64, offset=None) -> dict:
  """The NF4 group of a float kernel [*in, *out] (see the module docstring), exactly as bitsandbytes codes
  its [out, in] transpose, up to the rounding of the mean absmax: torch sums in an order of its own (and of
  the CPU's vector width), so its float32 mean may differ from ours in the last bit. `offset` given: that one
  (the tests pass torch's, to compare the rest bit for bit)."""
  in_shape, out_shape, w = _split(jnp.asarray(kernel, jnp.float32), in_ndim)
  n_in, n_out = w.shape
  blocks = w.reshape(n_in // block, block, n_out)
  absmax = jnp.max(jnp.abs(blocks), axis=1)                                    # [n_in / block, n_out]
  # 1 / absmax as bitsandbytes' (1 / max(absmax, 1e-38)); an all-zero block 0, since XLA flushes 1e-38 (subnormal)
  inverse = jnp.where(absmax > 0, 1.0 / jnp.where(absmax > 0, absmax, 1.0), 0.0)
  scaled = jnp.clip(blocks * inverse[:, None, :], -1.0, 1.0)
  q = jnp.searchsorted(jnp.asarray(NF4_BOUNDS), scaled, side='left').astype(jnp.uint8).reshape(n_in // 2, 2, n_out)
  codes = (q[:, 0] << 4) | q[:, 1]
  absmax_codes, scales, offset = _double_quantize(_omajor(absmax), offset)
  absmax_codes = absmax_codes.reshape(n_out, n_in // block).T
  packed_in = tuple(in_shape[:-1]) + (in_shape[-1] // 2,)
  return {'codes': codes.reshape(packed_in + tuple(out_shape)),
          'absmax': absmax_codes.reshape((n_in // block,) + tuple(out_shape)),
          'absmax_scale': scales, 'absmax_offset': offset}


def nf4_absmax(group: dict):
  """The blocks' absmax, dequantised [n_in / block, *out] float32 (bitsandbytes' dequantize_blockwise, then
  + offset, each rounded to float32 on its own)."""
  codes = group['absmax']
  blocks, out_shape = codes.shape[0], codes.shape[1:]
  n_out = math.prod(out_shape)
  index = jnp.arange(n_out)[None, :] * blocks + jnp.arange(blocks)[:, None]    # each block's place, output-major
  scaled = jnp.asarray(DYNAMIC)[codes.reshape(blocks, n_out)] * group['absmax_scale'][index // DOUBLE_BLOCK]
  return (_rounded(scaled) + group['absmax_offset']).reshape(codes.shape)


def _rounded(x):
  """x, kept from being fused with the addition after it into one multiply-add (XLA's CPU backend contracts
  them, rounding once where bitsandbytes rounds twice): a select is not a product, and a compiler must keep it
  for NaNs."""
  return jnp.where(x == x, x, 0.0)


def dequantize_nf4(group: dict, dtype=jnp.float32):
  """The float kernel [*in, *out] of an NF4 group: NF4[code] x its block's absmax (float32, then `dtype`)."""
  codes = group['codes']
  absmax = nf4_absmax(group)
  blocks, out_shape = absmax.shape[0], absmax.shape[1:]
  n_out = math.prod(out_shape)
  packed_in = codes.shape[:codes.ndim - len(out_shape)]
  pairs = codes.reshape(-1, n_out)
  q = jnp.stack([pairs >> 4, pairs & 15], axis=1).reshape(blocks, -1, n_out)
  w = jnp.asarray(NF4)[q] * absmax.reshape(blocks, 1, n_out)
  in_shape = tuple(packed_in[:-1]) + (packed_in[-1] * 2,)
  return w.reshape(in_shape + tuple(out_shape)).astype(dtype)


_INV_127 = np.float32(7.874015718698502e-3)   # bitsandbytes' int8_vectorwise_dequant multiplies by this


def quantize_int8(kernel, in_ndim: int) -> dict:
  """The int8 group of a float kernel [*in, *out]: bitsandbytes' int8_vectorwise_quant of its [out, in] transpose
  (absmax per output; codes round(w x (127 / absmax)), half to even). An all-zero output codes to zeros."""
  x = jnp.asarray(kernel, jnp.float32)
  axes = tuple(range(in_ndim))
  absmax = jnp.max(jnp.abs(x), axis=axes)
  factor = jnp.where(absmax > 0, 127.0 / jnp.where(absmax > 0, absmax, 1.0), 0.0)
  return {'codes': jnp.round(x * factor[(None,) * in_ndim]).astype(jnp.int8), 'scale': absmax}


def dequantize_int8(group: dict, dtype=jnp.float32):
  """codes x absmax x (1 / 127), in that order (int8_vectorwise_dequant), then `dtype`."""
  codes, scale = group['codes'], group['scale']
  scale = scale[(None,) * (codes.ndim - scale.ndim)]
  return ((codes.astype(jnp.float32) * scale) * _INV_127).astype(dtype)


QUANTIZE = {'nf4': lambda k, n, block: quantize_nf4(k, n, block), 'int8': lambda k, n, block: quantize_int8(k, n)}


def dequantize(fmt: str, group: dict, dtype=jnp.float32):
  return dequantize_nf4(group, dtype) if fmt == 'nf4' else dequantize_int8(group, dtype)


def to_bitsandbytes(group: dict) -> dict:
  """An NF4 group in bitsandbytes' own layout (numpy): packed codes [n / 2, 1] (uint8), absmax codes [blocks],
  state2's absmax and the offset, for comparing with its quantize_4bit."""
  absmax = np.asarray(group['absmax'])
  n_out = int(np.prod(absmax.shape[1:]))
  codes = np.asarray(group['codes']).reshape(-1, n_out)
  return {'codes': np.ascontiguousarray(codes.T).reshape(-1, 1),
          'absmax': np.ascontiguousarray(absmax.reshape(absmax.shape[0], n_out).T).reshape(-1),
          'absmax_scale': np.asarray(group['absmax_scale']), 'absmax_offset': np.asarray(group['absmax_offset'])}


# ---- the product ----------------------------------------------------------------------------------

def _product(fmt: str, x, group: dict, in_ndim: int, dtype):
  n_in = math.prod(x.shape[x.ndim - in_ndim:])
  flat = x.reshape(x.shape[:x.ndim - in_ndim] + (n_in,)).astype(dtype)
  if fmt == 'int8':   # the codes in the product, each output channel scaled after it
    codes = group['codes']
    out_shape = codes.shape[in_ndim:]
    y = jnp.tensordot(flat, codes.reshape(n_in, -1).astype(dtype), axes=1)
    factor = (group['scale'].reshape(-1) * _INV_127).astype(dtype)
    return (y * factor.reshape((1,) * (y.ndim - 1) + (-1,))).reshape(y.shape[:-1] + tuple(out_shape))
  w = dequantize_nf4(group, dtype)
  out_shape = w.shape[in_ndim:]
  y = jnp.tensordot(flat, w.reshape(n_in, -1), axes=1)
  return y.reshape(y.shape[:-1] + tuple(out_shape))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def quantized_product(fmt: str, x, group: dict, in_ndim: int, dtype):
  """x [..., *in] times the quantized kernel [*in, *out] -> [..., *out] in `dtype`; the gradient reaches x only
  (the codes are frozen), and the backward pass dequantises again instead of keeping the float kernel."""
  return _product(fmt, x, group, in_ndim, dtype)


def _product_fwd(fmt, x, group, in_ndim, dtype):
  return _product(fmt, x, group, in_ndim, dtype), (x, group)


def _zero_cotangent(leaf):
  if jnp.issubdtype(leaf.dtype, jnp.inexact):
    return jnp.zeros_like(leaf)
  return np.zeros(leaf.shape, jax.dtypes.float0)


def _product_bwd(fmt, in_ndim, dtype, residuals, g):
  x, group = residuals
  w = dequantize(fmt, group, dtype)
  n_in = math.prod(w.shape[:in_ndim])
  g_flat = g.reshape(g.shape[:g.ndim - (w.ndim - in_ndim)] + (-1,)).astype(dtype)
  dx = jnp.tensordot(g_flat, w.reshape(n_in, -1).T, axes=1).reshape(x.shape).astype(x.dtype)
  return dx, jax.tree.map(_zero_cotangent, group)


quantized_product.defvjp(_product_fwd, _product_bwd)


class QuantizedDense(nn.Module):
  """A projection whose kernel is held quantized (`fmt`), named like the nn.DenseGeneral it replaces: its
  group `kernel_<fmt>` and `bias` sit where that one's `kernel` and `bias` do. It contracts the last
  `in_ndim` axes of its input. A fresh layer's codes come from `kernel_init`'s float kernel, quantized."""
  features: tuple
  in_ndim: int
  fmt: str
  block: int = 64
  use_bias: bool = False
  dtype: Any = jnp.float32
  kernel_init: Any = None
  kernel_names: tuple = ()
  bias_names: tuple = ()

  def _init_group(self, key, in_shape):
    kernel = nn.meta.unbox(self.kernel_init(key, tuple(in_shape) + tuple(self.features), jnp.float32))
    return boxed_group(self.fmt, quantize(self.fmt, kernel, self.in_ndim, self.block), self.kernel_names,
                       self.in_ndim)

  @nn.compact
  def __call__(self, x):
    in_shape = x.shape[x.ndim - self.in_ndim:]
    if self.fmt == 'nf4':
      problem = check_shape(in_shape, self.block, f'{self.name}')
      if problem:
        raise ValueError(f'WEIGHT_QUANT=nf4: {problem}.')
    group = self.param(group_name(KERNEL, self.fmt), self._init_group, in_shape)
    y = quantized_product(self.fmt, x, group, self.in_ndim, self.dtype)
    if self.use_bias:
      bias = self.param('bias', nn.with_logical_partitioning(nn.initializers.zeros, self.bias_names),
                        tuple(self.features))
      y = y + bias.astype(self.dtype).reshape((1,) * (y.ndim - len(self.features)) + tuple(self.features))
    return y


def quantize(fmt: str, kernel, in_ndim: int, block: int) -> dict:
  return QUANTIZE[fmt](kernel, in_ndim, block)


def group_names(fmt: str, kernel_names: tuple, in_ndim: int, stacked: int = 0) -> dict:
  """The logical axis names of a group's arrays from its kernel's ([*stack, *in, *out]): codes keep them (NF4's
  packed axis is the last input axis), the per-block and per-output arrays the stack's and the outputs'."""
  stack, kernel_names = tuple(kernel_names[:stacked]), tuple(kernel_names[stacked:])
  out_names = kernel_names[in_ndim:]
  if fmt == 'int8':
    return {'codes': stack + kernel_names, 'scale': stack + out_names}
  return {'codes': stack + kernel_names, 'absmax': stack + (kernel_names[0],) + out_names,
          'absmax_scale': stack + (None,), 'absmax_offset': stack}


def boxed_group(fmt: str, group: dict, kernel_names: tuple, in_ndim: int, stacked: int = 0) -> dict:
  names = group_names(fmt, kernel_names, in_ndim, stacked)
  return {k: nn.LogicallyPartitioned(v, names[k]) for k, v in group.items()}


# ---- reading float checkpoints into quantized models -------------------------------------------------

def group_name(float_name: str, fmt: str) -> str:
  """The param group holding `float_name`'s codes: kernel -> kernel_nf4, an expert stack wi_0 -> wi_0_int8."""
  return f'{float_name}_{fmt}'


def group_format(name: str) -> Optional[str]:
  """'nf4' or 'int8' for a quantized group's param name (kernel_nf4, wi_0_int8), else None."""
  for fmt in FORMATS[1:]:
    if name.endswith('_' + fmt):
      return fmt
  return None


def is_quantized_path(path: Sequence) -> bool:
  """True for a leaf of a quantized group (params/.../query/kernel_nf4/codes): frozen, its dtype its own."""
  return any(group_format(str(k)) for k in path)


def stacked_axes(names: Sequence) -> int:
  """How many leading axes of a leaf stack whole kernels (STACK_AXES in its logical names)."""
  n = 0
  for name in names:
    if name not in STACK_AXES:
      break
    n += 1
  return n


def float_twin(abstract_params: dict, logical: dict) -> tuple[dict, dict, dict]:
  """(float abstract params, their logical names, plan) for a params tree holding quantized groups: each group
  `<proj>/kernel_<fmt>` (`wi_0_<fmt>`) is `<proj>/kernel` (`wi_0`) float32 in the twin, as a float checkpoint
  holds it. plan maps each twin kernel's path (a tuple) to (fmt, stacked axes, input axes, block) for
  quantize_like. Trees as nested dicts of ShapeDtypeStructs (or arrays) and of logical-name tuples."""
  twin, names, plan = {}, {}, {}

  def walk(node, lnode, out, lout, prefix):
    for key, value in node.items():
      fmt = group_format(str(key))
      if fmt is None and isinstance(value, dict):
        out[key], lout[key] = {}, {}
        walk(value, lnode[key], out[key], lout[key], prefix + (key,))
      elif fmt is None:
        out[key], lout[key] = value, lnode[key]
      else:
        shape, kernel_names, entry = _twin_of(fmt, value, lnode[key])
        name = str(key)[:-len(fmt) - 1]
        out[name] = jax.ShapeDtypeStruct(shape, jnp.float32)
        lout[name] = kernel_names
        plan[prefix + (name,)] = entry
  walk(abstract_params, logical, twin, names, ())
  return twin, names, plan


def _twin_of(fmt: str, group: dict, names: dict):
  """(float kernel shape, its logical names, its plan entry) of one quantized group."""
  codes_names = tuple(names['codes'])
  stacked = stacked_axes(codes_names)
  codes = group['codes'].shape
  if fmt == 'int8':
    out_ndim = len(group['scale'].shape) - stacked
    return tuple(codes), codes_names, (fmt, stacked, len(codes) - stacked - out_ndim, 0)
  absmax = group['absmax'].shape
  out_ndim = len(absmax) - stacked - 1
  in_ndim = len(codes) - stacked - out_ndim
  packed = stacked + in_ndim - 1
  shape = tuple(codes[:packed]) + (codes[packed] * 2,) + tuple(codes[packed + 1:])
  n_in = math.prod(shape[stacked:stacked + in_ndim])
  return shape, codes_names, (fmt, stacked, in_ndim, n_in // absmax[stacked])


def quantize_like(float_params: dict, plan: dict) -> dict:
  """float_params (the twin's, nested) with each planned kernel replaced by its quantized group (vmapped over
  a scanned stack's leading axes: each layer quantized on its own, as init makes it)."""
  out = {}
  for key, value in float_params.items():
    if isinstance(value, dict):
      out[key] = quantize_like(value, {p[1:]: e for p, e in plan.items() if p[0] == key})
    elif (key,) in plan:
      fmt, stacked, in_ndim, block = plan[(key,)]
      fn = functools.partial(quantize, fmt, in_ndim=in_ndim, block=block)
      for _ in range(stacked):
        fn = jax.vmap(fn)
      out[group_name(key, fmt)] = fn(value)
    else:
      out[key] = value
  return out


def dequantize_like(params: dict, plan: dict) -> dict:
  """params (nested) with each planned quantized group replaced by the float32 kernel it codes, under the float
  model's name (quantize_like's inverse, up to the codes' rounding): what a float model, PEFT's base or a merge
  reads."""
  out = {}
  for key, value in params.items():
    fmt = group_format(str(key))
    name = str(key)[:-len(fmt) - 1] if fmt else key
    if fmt and (name,) in plan:
      fn = functools.partial(dequantize, fmt)
      for _ in range(plan[(name,)][1]):
        fn = jax.vmap(fn)
      out[name] = np.asarray(fn(value))
    elif isinstance(value, dict):
      out[key] = dequantize_like(value, {p[1:]: e for p, e in plan.items() if p[0] == key})
    else:
      out[key] = value
  return out


def float_params(params: dict, logical: dict) -> dict:
  """params with every quantized group dequantised (dequantize_like); params themselves when none is."""
  plan = float_twin(params, logical)[2]
  return dequantize_like(params, plan) if plan else params


def represented_elements(path: Sequence, shape: Sequence[int]) -> int:
  """How many weights a params leaf stands for: a quantized group's codes the kernel's (NF4: two a byte), its
  scales none; any other leaf its own size."""
  fmt = next((group_format(str(k)) for k in path if group_format(str(k))), None)
  size = int(np.prod(shape, dtype=np.int64))
  if fmt is None:
    return size
  if str(path[-1]) != 'codes':
    return 0
  return size * (2 if fmt == 'nf4' else 1)


# ---- the int8 KV cache ----------------------------------------------------------------------------

def quantize_heads(x, axis: int):
  """(int8 codes, float32 scales) of keys or values: one scale per head and token, absmax / 127 over the
  head's dimensions (`axis`), codes round(x / scale); an all-zero vector codes to zeros with scale 0."""
  x = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x), axis=axis) / 127.0
  safe = jnp.where(scale > 0, scale, 1.0)
  codes = jnp.clip(jnp.round(x / jnp.expand_dims(safe, axis)), -127, 127).astype(jnp.int8)
  return codes, scale


def dequantize_heads(codes, scale, axis: int, dtype):
  return (codes.astype(jnp.float32) * jnp.expand_dims(scale, axis)).astype(dtype)
