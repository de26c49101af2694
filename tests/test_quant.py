"""Quantized weights, KV cache and products (paxcli.layers.quant, aqt), held to bitsandbytes' own functions.

NF4 and int8 codes and dequantised values against bitsandbytes' quantize_4bit / dequantize_4bit and
int8_vectorwise_quant / int8_vectorwise_dequant on the same weights (its CPU backend); the product and its
gradient against the float product of the dequantised kernel; every projection of a model coded (dense, MoE and
latent attention); the int8 KV cache and int8 weights against the float model through the decoding path (top-1
agreement and KL on fixed prompts, as certifications report them); AQT's int8 products and gradients against
float ones; the settings refused in one line before anything compiles. Engine-level only: no job directory.
"""

import numpy as np
import pytest

from conftest import pax_main

EXP = 'lm_cloud.LmCloudSpmdTest'
LLAMA = ['MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=4', 'NUM_KV_HEADS=2', 'PERCORE_BATCH_SIZE=1', 'MAX_SEQ_LEN=32',
         'VOCAB_SIZE=64', 'NUM_LAYERS=2', 'NORM_TYPE="rmsnorm"', 'USE_GATED_ACTIVATION=True', 'ACTIVATION="silu"',
         'POSITION_EMBEDDING="rotary"', 'USE_BIAS=False', 'SEPARATE_EMBEDDING=True']
# The bounds the quantized models are held to against float32 on the fixed prompts (a random tiny model: see
# test_trained_model_agreement in tests/test_qlora.py for a trained one).
INT8_KL = 1e-3          # mean KL (nats) of int8 weights + int8 cache
INT8_TOP1 = 0.95        # top-1 agreement of the same


def _bnb():
  bnb = pytest.importorskip('bitsandbytes')
  return bnb.functional


def _torch(x):
  import torch
  return torch.from_numpy(np.ascontiguousarray(x))


def _kernel(shape, seed=0):
  """A float32 kernel with a few outliers and an all-zero output channel (the edge bitsandbytes codes to 0)."""
  rng = np.random.default_rng(seed)
  w = rng.standard_normal(shape).astype(np.float32) * 0.05
  w.reshape(-1, shape[-1])[3, 1] = 1.5
  w[..., 0] = 0.0
  return w


@pytest.mark.parametrize('shape,in_ndim,block', [pytest.param((128, 48), 1, 64, marks=pytest.mark.slow),
                                                  ((4, 8, 96), 2, 32), ((64, 4, 8), 1, 32), ((256, 300), 1, 64)])
def test_nf4_codes_and_values_are_bitsandbytes(shape, in_ndim, block):
  """quantize_4bit(W^T, nf4, compress_statistics=True) on Hugging Face's [out, in] layout: the same packed codes,
  absmax codes, their scales (state2) and offset; dequantize_4bit the same floats, bit for bit. The offset is the
  mean of the block absmaxes: torch sums in an order of its own, so ours is given torch's for the bitwise check,
  and our own mean is compared to it to the last bits."""
  import jax.numpy as jnp
  F = _bnb()
  from paxcli.layers import quant
  w = _kernel(shape)
  n_in = int(np.prod(shape[:in_ndim]))
  hf = w.reshape(n_in, -1).T                                       # [out, in]
  packed, state = F.quantize_4bit(_torch(hf), blocksize=block, compress_statistics=True, quant_type='nf4')
  ours = quant.quantize_nf4(jnp.asarray(w), in_ndim, block, offset=float(state.offset))
  theirs = quant.to_bitsandbytes(ours)
  np.testing.assert_array_equal(theirs['codes'], packed.numpy())
  np.testing.assert_array_equal(theirs['absmax'], state.absmax.numpy())
  np.testing.assert_array_equal(theirs['absmax_scale'], state.state2.absmax.numpy())
  np.testing.assert_array_equal(F.get_4bit_type('nf4', device='cpu').numpy(), quant.NF4)
  np.testing.assert_array_equal(state.state2.code.numpy(), quant.DYNAMIC)
  values = F.dequantize_4bit(packed, state).numpy()                # [out, in]
  ours_w = np.asarray(quant.dequantize_nf4(ours)).reshape(n_in, -1).T
  np.testing.assert_array_equal(ours_w, values)
  own = quant.quantize_nf4(jnp.asarray(w), in_ndim, block)         # our own mean
  assert abs(float(own['absmax_offset']) - float(state.offset)) <= 4 * np.spacing(np.float32(state.offset))
  assert np.mean(np.asarray(own['codes']) == np.asarray(ours['codes'])) == 1.0
  err = np.abs(ours_w - hf).max() / np.abs(hf).max()
  assert err < 0.1   # NF4's coarsest step is about 0.16 of a block's absmax: half of it at most


def test_int8_codes_and_values_are_bitsandbytes():
  """int8_vectorwise_quant of W^T (per output channel absmax, round half to even) and its dequantisation."""
  import jax.numpy as jnp
  F = _bnb()
  from paxcli.layers import quant
  for shape, in_ndim in (((96, 40), 1), ((4, 8, 24), 2)):
    w = _kernel(shape, seed=1)
    n_in = int(np.prod(shape[:in_ndim]))
    hf = w.reshape(n_in, -1).T
    codes, stats, _ = F.int8_vectorwise_quant(_torch(hf.copy()))
    ours = quant.quantize_int8(jnp.asarray(w), in_ndim)
    np.testing.assert_array_equal(np.asarray(ours['codes']).reshape(n_in, -1).T, codes.numpy())
    np.testing.assert_array_equal(np.asarray(ours['scale']).reshape(-1), stats.numpy())
    values = F.int8_vectorwise_dequant(codes, stats).numpy()
    np.testing.assert_array_equal(np.asarray(quant.dequantize_int8(ours)).reshape(n_in, -1).T, values)


@pytest.mark.parametrize('fmt', ['nf4', 'int8'])
def test_the_product_and_its_gradient_are_the_dequantised_kernels(fmt):
  """x times the codes = x times the dequantised kernel; the gradient reaches x (the codes are frozen)."""
  import jax
  import jax.numpy as jnp
  from paxcli.layers import quant
  w = _kernel((4, 8, 32), seed=2)
  group = quant.quantize(fmt, jnp.asarray(w), 2, 32)
  dense = quant.dequantize(fmt, group)
  x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 5, 4, 8)).astype(np.float32))
  np.testing.assert_allclose(quant.quantized_product(fmt, x, group, 2, jnp.float32),
                             jnp.einsum('blhe,hed->bld', x, dense), rtol=1e-5, atol=1e-6)
  loss = lambda f: lambda x: jnp.sum(jnp.sin(f(x)))
  got = jax.grad(loss(lambda x: quant.quantized_product(fmt, x, group, 2, jnp.float32)))(x)
  want = jax.grad(loss(lambda x: jnp.einsum('blhe,hed->bld', x, dense)))(x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _setup(*more):
  from paxcli import config
  from paxcli.runtime import engine
  return engine.build(config.resolve(EXP, LLAMA + list(more)))


def _flat(tree):
  from flax.traverse_util import flatten_dict
  return {'/'.join(map(str, k)): v for k, v in flatten_dict(tree).items()}


def test_every_projection_is_coded_and_frozen_and_counted_as_its_kernel():
  """WEIGHT_QUANT=nf4 with LoRA: attention's query/key/value/out and the MLP's three kernels are NF4 groups;
  embeddings and norms stay float; only the adapters train; the parameter count is the float model's."""
  from paxcli.runtime import train_state
  lora = ['LORA_RANK=4', 'LORA_TARGETS=("query","value","output","mlp")']
  setup = _setup('WEIGHT_QUANT="nf4"', 'QUANT_BLOCK_SIZE=32', *lora)
  plain = _setup()
  names = _flat(setup.abstract_state['params'])
  for proj in ('attention/query', 'attention/key', 'attention/value', 'attention/out', 'mlp/wi_0', 'mlp/wi_1',
               'mlp/wo'):
    group = {n.rsplit('/', 1)[1] for n in names if f'/{proj}/kernel_nf4/' in n}
    assert sorted(group) == ['absmax', 'absmax_offset', 'absmax_scale', 'codes'], proj
    assert not any(n.endswith(f'/{proj}/kernel') for n in names), proj
  codes = [x for n, x in names.items() if n.endswith('/codes')]
  assert codes and all(x.dtype == np.uint8 for x in codes)
  trainable, _ = train_state.split_trainable(setup.model, setup.abstract_state['params'])
  assert all('_lora_' in n for n in _flat(trainable))
  assert train_state.param_count(setup.abstract_state) == train_state.param_count(
      _setup(*lora).abstract_state) > train_state.param_count(plain.abstract_state)


def _decode_logits(setup, params, ids):
  """Teacher-forced logits [B, L, V] through the decoding path: a prefill of the first half, then one token at a
  time with the cache (where KV_CACHE_QUANT acts)."""
  import jax
  import jax.numpy as jnp
  model = setup.model
  b, n = ids.shape
  cache = model.init_cache(params, b, n)
  half = n // 2
  pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
  extend = jax.jit(model.extend)
  logits, cache = extend(params, cache, jnp.asarray(ids[:, :half]), pos[:, :half])
  out = [np.asarray(logits)]
  for t in range(half, n):
    logits, cache = extend(params, cache, jnp.asarray(ids[:, t:t + 1]), pos[:, t:t + 1])
    out.append(np.asarray(logits))
  return np.concatenate(out, axis=1)


@pytest.fixture(scope='module')
def float_decode():
  """(params, prompts, logits) of the random float32 model through the decoding path: the reference every int8
  case below is compared to, computed once for them."""
  import jax
  from paxcli.convert import certify
  from paxcli.runtime import engine
  float_setup = _setup()
  params = jax.device_get(engine.init_state(float_setup, 0)['params'])
  ids = certify.prompts(64, 32)
  return params, ids, _decode_logits(float_setup, params, ids)


@pytest.mark.parametrize('knobs', [
    pytest.param(('WEIGHT_QUANT="int8"', 'KV_CACHE_QUANT="int8"'), id='weights+cache'),
    pytest.param(('WEIGHT_QUANT="int8"',), id='weights', marks=pytest.mark.slow),
    pytest.param(('KV_CACHE_QUANT="int8"',), id='cache', marks=pytest.mark.slow)])
def test_int8_weights_and_cache_decode_as_float32_within_the_stated_bound(knobs, float_decode):
  """One random model through the decoding path on the certification's fixed prompts: float32 against int8
  weights (its float kernels coded as decode reads a checkpoint: quantize_like) and/or an int8 cache, compared as
  certifications report (compare): top-1 agreement and mean KL, held to INT8_TOP1 and INT8_KL. (A trained model
  agrees far more closely: benchmarks/quant.py measured 100% and a mean KL of 3e-5 for both.)"""
  from paxcli.convert import certify
  from paxcli.layers import quant
  params, ids, want = float_decode
  setup = _setup(*knobs)
  plan = quant.float_twin(setup.abstract_state['params'], setup.logical)[2]
  coded = quant.quantize_like(params, plan) if plan else params
  report = certify.compare(want, _decode_logits(setup, coded, ids))
  assert report['top1_agreement'] >= INT8_TOP1 and report['kl'] <= INT8_KL, report
  assert report['max_abs_diff'] > 0   # it is quantized


# ---- AQT: int8 products in training ------------------------------------------------------------------------


def test_aqt_int8_products_forward_and_backward_are_the_float_ones_within_int8_error():
  """int8_matmul: forward x w, backward g w^T and x^T g, each of per-row/per-channel int8 codes summed in int32;
  within 2% of float32 on normal data; stochastic rounding of g is unbiased (the mean of many draws nears the
  round-to-nearest-free float gradient more closely than one draw does)."""
  import jax
  import jax.numpy as jnp
  from paxcli.layers import aqt
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((64, 48)).astype(np.float32))
  w = jnp.asarray(rng.standard_normal((48, 40)).astype(np.float32) * 0.1)
  g = jnp.asarray(rng.standard_normal((64, 40)).astype(np.float32))
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  assert rel(aqt.int8_matmul(x, w, None, False), x @ w) < 0.02
  _, vjp = jax.vjp(lambda x, w: aqt.int8_matmul(x, w, None, False), x, w)
  dx, dw = vjp(g)
  assert rel(dx, g @ w.T) < 0.02 and rel(dw, x.T @ g) < 0.02
  draw = jax.jit(lambda k: jax.vjp(lambda x, w: aqt.int8_matmul(x, w, k, True), x, w)[1](g)[1])
  draws = [draw(k) for k in jax.random.split(jax.random.PRNGKey(0), 32)]
  xq, xs = aqt.quantize(x, 0)   # x's own rounding (to nearest) stays; g's averages out
  exact_g = (xq.astype(jnp.float32) * xs).T @ g
  assert rel(sum(draws) / len(draws), exact_g) < rel(draws[0], exact_g) / 3


@pytest.mark.slow
def test_aqt_training_steps_follow_the_float_model():
  """AQT='int8' on the projections and MLP: the same params as the float model (its checkpoints are float), a
  loss within int8 error of the float one, and gradients pointing the same way (cosine > 0.99)."""
  import jax
  import jax.numpy as jnp
  from paxcli.runtime import engine
  float_setup, aqt_setup = _setup(), _setup('AQT="int8"', 'AQT_STOCHASTIC_ROUNDING=True')
  params = jax.device_get(engine.init_state(float_setup, 0)['params'])
  assert jax.tree.structure(params) == jax.tree.structure(jax.device_get(engine.init_state(aqt_setup, 0)['params']))
  ids = jnp.asarray(np.random.default_rng(5).integers(0, 64, (2, 32)), jnp.int32)
  batch = {'ids': ids, 'labels': jnp.roll(ids, -1, 1), 'weights': jnp.ones(ids.shape, jnp.float32)}

  def loss_and_grad(setup):
    def loss(p):
      return setup.model.apply({'params': p}, batch, rngs={'random': jax.random.PRNGKey(1)},
                               method=setup.model.fprop)[0]
    return jax.jit(jax.value_and_grad(loss))(params)
  (l_float, g_float), (l_aqt, g_aqt) = loss_and_grad(float_setup), loss_and_grad(aqt_setup)
  assert abs(float(l_aqt) - float(l_float)) < 0.01 * float(l_float)
  a, b = (jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(g)]) for g in (g_aqt, g_float))
  assert float(a @ b / (jnp.linalg.norm(a) * jnp.linalg.norm(b))) > 0.99


# ---- settings refused before anything compiles ---------------------------------------------------------------


@pytest.mark.parametrize('sets,words', [
    (['WEIGHT_QUANT="nf4"', 'QUANT_BLOCK_SIZE=48'], 'QUANT_BLOCK_SIZE must be a power of two'),
    (['WEIGHT_QUANT="nf4"', 'QUANT_BLOCK_SIZE=128'], 'not a multiple of QUANT_BLOCK_SIZE=128'),
    (['WEIGHT_QUANT="int8"', 'FP8="current"'], "choose one"),
    (['WEIGHT_QUANT="nf4"', 'QUANT_BLOCK_SIZE=32'], 'train adapters on them with LORA_RANK > 0'),
    (['WEIGHT_QUANT="int4"'], "'nf4'"),
])
def test_a_setting_that_cannot_work_is_one_line(tmp_path, capsys, sets, words):
  argv = ['train', '--exp', EXP, '--job-log-dir', str(tmp_path / 'job')]
  for s in LLAMA + ['NUM_TRAIN_STEPS=1'] + sets:
    argv += ['--set', s]
  code, _, err = pax_main(argv, capsys)
  assert code != 0 and 'Traceback' not in err, err
  last = err.strip().splitlines()[-1]
  assert words in last, err
  assert not (tmp_path / 'job' / 'checkpoints').exists()


# ---- every kind of layer the families are made of -----------------------------------------------------------

_DENSE = {'VOCAB_SIZE': 40, 'NUM_LAYERS': 2, 'MODEL_DIMS': 32, 'HIDDEN_DIMS': 64, 'NUM_HEADS': 4, 'NUM_KV_HEADS': 2,
          'DIMS_PER_HEAD': 8, 'MAX_SEQ_LEN': 32, 'NORM_TYPE': 'rmsnorm', 'POSITION_EMBEDDING': 'rotary',
          'USE_BIAS': False, 'USE_GATED_ACTIVATION': True, 'ACTIVATION': 'silu'}
_LAYERS = {
    'llama': {},
    'qwen2 (qkv bias)': {'USE_QKV_BIAS': True},
    'gemma2 (local/global, caps)': {'LAYER_PATTERN': ('local', 'global'), 'LAYER_KINDS': {'local': {'SLIDING_WINDOW': 5}},
                                    'ATTEN_LOGIT_CAP': 50.0, 'NORM_PLUS_ONE': True, 'POST_NORMS': True},
    'mixtral (experts)': {'NUM_EXPERTS': 4, 'EXPERTS_PER_TOKEN': 2, 'HIDDEN_DIMS': 32},
    'deepseek_v3 (latent attention, shared expert, dense prefix)': {
        'KV_LORA_RANK': 32, 'Q_LORA_RANK': 32, 'QK_NOPE_HEAD_DIMS': 8, 'QK_ROPE_HEAD_DIMS': 4, 'V_HEAD_DIMS': 8,
        'NUM_EXPERTS': 4, 'EXPERTS_PER_TOKEN': 2, 'HIDDEN_DIMS': 32, 'SHARED_EXPERT_HIDDEN_DIMS': 32,
        'LAYER_PREFIX': ('dense',), 'LAYER_KINDS': {'dense': {'NUM_EXPERTS': 0, 'HIDDEN_DIMS': 32}},
        'ROUTER_SOFTMAX': 'sigmoid', 'USE_REPEATED_LAYER': False, 'NUM_KV_HEADS': 4}}
# Float kernels a quantized model keeps: the routers (bitsandbytes leaves them too) and latent attention's norms.
_KEPT = ('/router/', '/gate/')


# The Llama layers under NF4 in the default suite; the rest (a compile of 15-40 s each on 2 shared cores) slow.
_KINDS = [pytest.param(kind, fmt, marks=() if (kind, fmt) == ('llama', 'nf4') else pytest.mark.slow)
          for kind in sorted(_LAYERS) for fmt in ('nf4', 'int8')]


@pytest.mark.parametrize('kind,fmt', _KINDS)
def test_each_kind_of_layer_codes_every_projection_and_computes_its_dequantised_self(kind, fmt):
  """The quantized model's logits are the float model's on the dequantised kernels (1e-5), and no projection
  kernel is left float."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  from paxcli.layers import quant
  from paxcli.layers.base import instantiate
  from paxcli.models import knobs, lm_config

  def model(**more):
    return instantiate(lm_config(**knobs.flat_settings({**_DENSE, **_LAYERS[kind], **more}, knobs.LM_KNOBS)))
  ids = jnp.asarray(np.random.default_rng(6).integers(0, 40, (2, 12)), jnp.int32)
  coded_model = model(WEIGHT_QUANT=fmt, QUANT_BLOCK_SIZE=32)
  boxed = jax.jit(coded_model.init)(jax.random.key(0), ids)['params']
  logical = jax.tree.map(lambda b: tuple(b.names), boxed, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
  coded = nn.meta.unbox(boxed)
  left = [n for n in _flat(coded) if n.endswith('kernel') and not any(k in f'/{n}' for k in _KEPT)]
  assert not left, left
  floats = quant.float_params(coded, logical)
  assert floats is not coded
  logits = lambda m, p: jax.jit(lambda p: m.apply({'params': p}, ids))(p)
  np.testing.assert_allclose(logits(coded_model, coded), logits(model(), floats), rtol=1e-5, atol=1e-5)


# ---- pax serve's engine on int8 weights and an int8 cache ----------------------------------------------------


@pytest.mark.slow
def test_serve_engine_decodes_int8_rows_beside_each_other_as_a_plain_greedy_loop():
  """`pax serve`'s continuous batching with WEIGHT_QUANT and KV_CACHE_QUANT int8 (the cache's scales move with
  its rows): two requests beside each other, the first ending first, each the tokens of a plain greedy loop over
  model.extend with the same quantized weights."""
  import jax
  import jax.numpy as jnp
  from paxcli import config
  from paxcli.loops.serve.slots import Slots
  from paxcli.runtime import engine
  from test_serve_engine import Asked, _engine, _turn_until
  from tiny_lm import EXP as TINY, KNOBS
  setup = engine.build(config.resolve(TINY, KNOBS + ['WEIGHT_QUANT="int8"', 'KV_CACHE_QUANT="int8"']))
  params = engine.init_state(setup, 0)['params']
  slots = Slots(setup, params, max_rows=4, chunk=16, max_steps=4)
  served = _engine(slots)
  asked = [Asked([5, 6, 7, 8], 3), Asked([9, 10, 11], 12)]
  for a in asked:
    served.submit(a.request)
  _turn_until(served, lambda: all(a.done for a in asked))
  extend = jax.jit(setup.model.extend)
  for a, prompt, n in zip(asked, ([5, 6, 7, 8], [9, 10, 11]), (3, 12)):
    cache = setup.model.init_cache(params, 1, 32)
    logits, cache = extend(params, cache, jnp.asarray([prompt]), jnp.arange(len(prompt))[None])
    want = []
    for t in range(n):
      want.append(int(jnp.argmax(logits[0, -1])))
      logits, cache = extend(params, cache, jnp.asarray([[want[-1]]]), jnp.asarray([[len(prompt) + t]]))
    assert a.tokens[0] == want


# ---- a float checkpoint read into a quantized model, a chunk at a time ---------------------------------------


@pytest.mark.slow
def test_a_float_checkpoint_is_coded_a_kernel_at_a_time_as_whole(tmp_path, monkeypatch):
  """decode/score/serve/QLoRA read a float checkpoint into a quantized model in chunks of QUANTIZE_CHUNK_BYTES of
  float kernels (here 1 byte: each kernel alone), coded on their devices as they arrive: the codes are those of the
  whole float params coded at once in another compiled function and on one device (the codes are a function of
  the kernel alone: quant._steady_mean), and the rest of the params is read as saved."""
  import jax
  import paxcli
  from rich.console import Console
  from paxcli.jobdir import restore
  from paxcli.layers import quant
  job = str(tmp_path / 'job')
  paxcli.train(EXP, job_dir=job, overrides=LLAMA + ['NUM_TRAIN_STEPS=1'], console=Console(quiet=True))
  plain = _setup()
  floats = jax.device_get(restore.restore(plain, job, 1, params_only=True).state['params'])
  setup = _setup('WEIGHT_QUANT="nf4"', 'QUANT_BLOCK_SIZE=32')
  monkeypatch.setattr(restore, 'QUANTIZE_CHUNK_BYTES', 1)
  got = _flat(jax.device_get(restore.restore(setup, job, 1, params_only=True).state['params']))
  plan = quant.float_twin(setup.abstract_state['params'], setup.logical)[2]
  want = _flat(jax.device_get(jax.jit(lambda p: quant.quantize_like(p, plan))(floats)))
  assert len(plan) == 14 and sorted(got) == sorted(want)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)
