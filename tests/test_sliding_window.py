"""SLIDING_WINDOW (issue 27): each token attends to the w most recent tokens of its segment, itself
included, as Hugging Face's sliding_window does; in every attention path (einsum, dot_product, the
decoder's KV cache), per layer kind through LAYER_KINDS, and refused when it cannot work."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import pax_main
from paxcli import config
from paxcli.layers import attention_ops
from paxcli.layers.base import instantiate
from paxcli.loops.decode.decoder import Decoder
from paxcli.loops.decode.options import DecodeOptions
from paxcli.loops.decode.prompts import Prompt
from paxcli.loops.decode.reference import full_recompute_greedy, teacher_forced_logprob
from paxcli.models import lm_config
from paxcli.runtime import engine

EXP = 'paxcli.models.LmExperiment'
TINY = ['VOCAB_SIZE=64', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=4', 'NUM_KV_HEADS=2', 'MAX_SEQ_LEN=32',
        'PERCORE_BATCH_SIZE=1', 'POSITION_EMBEDDING="rotary"', 'NORM_TYPE="rmsnorm"', 'USE_BIAS=False']


def _qkv(b=2, l=12, h=4, k=2, e=8, seed=0):
  r = np.random.default_rng(seed)
  q, kk, v = (jnp.asarray(r.standard_normal((b, l, n, e)), jnp.float32) for n in (h, k, k))
  return q, kk, v


def _numpy_attention(q, k, v, segments, window):
  """Attention written out query by query: key j is seen by query i when i - window < j <= i in one segment."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, l, h, e = q.shape
  groups = h // k.shape[2]
  out = np.zeros_like(q)
  for row in range(b):
    for head in range(h):
      for i in range(l):
        keys = [j for j in range(l) if j <= i and (not window or j > i - window) and segments[row, j] == segments[row, i]]
        scores = np.array([q[row, i, head] @ k[row, j, head // groups] for j in keys]) / np.sqrt(e)
        p = np.exp(scores - scores.max())
        out[row, i, head] = (p / p.sum()) @ v[row, keys, head // groups]
  return out


@pytest.mark.parametrize('window', [1, 3, 8])
def test_the_mask_is_transformers_sliding_window_mask(window):
  torch = pytest.importorskip('torch')
  masking = pytest.importorskip('transformers.masking_utils')
  theirs_fn = masking.sliding_window_causal_mask_function(window)
  idx = torch.arange(12)
  theirs = np.array([[bool(theirs_fn(0, 0, idx[i], idx[j])) for j in range(12)] for i in range(12)])
  ours = np.asarray(attention_ops.visible(jnp.arange(12)[:, None], jnp.arange(12)[None, :], window))
  np.testing.assert_array_equal(ours, theirs)
  assert ours.sum(axis=1).max() == window   # the w most recent keys, the query's own included


KERNELS = {
    'einsum': lambda q, k, v, seg, w: attention_ops.attention(q, k, v, seg, 'einsum', window=w),
    'auto': lambda q, k, v, seg, w: attention_ops.attention(q, k, v, seg, 'auto', window=w),   # local on a CPU
    'xla_local_window_size': lambda q, k, v, seg, w: attention_ops.dot_product_attention(q, k, v, seg, window=w),
}


@pytest.mark.parametrize('kernel', list(KERNELS))
@pytest.mark.parametrize('window', [1, 3, 5])
def test_every_kernel_computes_the_window_within_segments(kernel, window):
  q, k, v = _qkv()
  segments = np.array([[1] * 7 + [2] * 5, [1] * 12], np.int32)   # row 0 packs two documents
  out = KERNELS[kernel](q, k, v, jnp.asarray(segments), window)
  np.testing.assert_allclose(out, _numpy_attention(q, k, v, segments, window), atol=2e-5)


# Two cases in the default suite (one uncapped, one capped, several blocks each); the rest are slow.
_KERNEL_CASES = [(length, window, block, cap) for length, window, block in
                 [(13, 4, 4), (40, 7, 8), (50, 17, 16), (33, 1, 8), (24, 23, 0)] for cap in (0.0, 3.0)]
_KERNEL_DEFAULT = {(13, 4, 4, 0.0), (40, 7, 8, 3.0)}


@pytest.mark.parametrize('length, window, block, cap', [
    c if c in _KERNEL_DEFAULT else pytest.param(*c, marks=pytest.mark.slow) for c in _KERNEL_CASES])
def test_the_blockwise_kernel_equals_the_reference_values_and_gradients(length, window, block, cap):
  """Lengths that are not a multiple of the block, windows shorter and longer than it, soft caps, packing."""
  q, k, v = _qkv(l=length, seed=length)
  segments = jnp.asarray([[1] * (length // 2) + [2] * (length - length // 2), [1] * length], jnp.int32)

  def grads(fn):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v))), argnums=(0, 1, 2)))(q, k, v)

  # jitted, as training runs them: one compile each instead of their ops dispatched one by one
  local = jax.jit(lambda q, k, v: attention_ops.local_attention(q, k, v, segments, window, cap, block))
  ref = jax.jit(lambda q, k, v: attention_ops.einsum_attention(q, k, v, segments, cap, window))
  np.testing.assert_allclose(local(q, k, v), ref(q, k, v), atol=2e-6)
  for ours, theirs in zip(grads(local), grads(ref)):
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_the_blockwise_kernel_reads_about_a_window_of_keys_per_query():
  """At 8,192 tokens and window 1,024 its logits are [L, 1,280], not [L, L]: the memory a step holds."""
  q = jax.ShapeDtypeStruct((1, 8192, 2, 16), jnp.float32)
  jaxpr = jax.make_jaxpr(lambda q: attention_ops.attention(q, q, q, None, 'auto', window=1024))(q)
  shapes = [v.aval.shape for eq in jaxpr.jaxpr.eqns for v in eq.outvars]
  assert max(np.prod(s) for s in shapes) == 8192 * 1280 * 2


def test_window_one_is_each_tokens_own_value():
  q, k, v = _qkv()
  for impl in ('einsum', 'dot_product'):
    out = attention_ops.attention(q, k, v, None, impl, window=1)
    np.testing.assert_allclose(out, jnp.repeat(v, 2, axis=2), atol=1e-6)


def test_a_window_as_long_as_the_sequence_is_full_attention():
  q, k, v = _qkv()
  full = attention_ops.attention(q, k, v, None, 'einsum')
  for window in (12, 100):
    np.testing.assert_array_equal(attention_ops.attention(q, k, v, None, 'einsum', window=window), full)
  assert np.abs(np.asarray(attention_ops.attention(q, k, v, None, 'einsum', window=11) - full)).max() > 1e-3


def test_dot_product_gradients_equal_the_einsum_reference():
  q, k, v = _qkv(seed=1)
  segments = jnp.asarray([[1] * 5 + [2] * 7, [3] * 12], jnp.int32)

  def loss(impl):   # jitted, as training runs it
    total = lambda q, k, v: jnp.sum(jnp.sin(attention_ops.attention(q, k, v, segments, impl, window=4)))
    return jax.jit(jax.grad(total, argnums=(0, 1, 2)))(q, k, v)

  for ours, ref in zip(loss('dot_product'), loss('einsum')):
    np.testing.assert_allclose(ours, ref, atol=2e-5)


# ---- the model: what a token's logits can depend on -------------------------------------------------

SETTINGS = dict(vocab_size=32, num_layers=2, model_dims=16, hidden_dims=32, num_heads=4, num_kv_heads=2,
                dims_per_head=4, max_seq_len=16, position_embedding='rotary', norm_type='rmsnorm', use_bias=False)


def _reach(**settings):
  """Which positions' logits change when token 0 changes, for a model of SETTINGS with `settings`."""
  model = instantiate(lm_config(**{**SETTINGS, **settings}))
  ids = jnp.asarray(np.random.default_rng(0).integers(1, 32, (1, 12)), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(0), ids)['params']   # one compile, not the model op by op
  fwd = jax.jit(lambda x: model.apply({'params': params}, x))
  moved = np.abs(np.asarray(fwd(ids) - fwd(ids.at[0, 0].set(0)))).max(axis=-1)[0]
  return [t for t in range(12) if moved[t] > 1e-6]


@pytest.mark.slow
def test_two_windowed_layers_see_back_two_windows_less_two():
  """Window 3: a layer's token t reads t-2..t, so after two layers token 0 reaches positions 0..4, not 5
  (both kernels, unscanned and scanned); without a window it reaches every position."""
  assert _reach(sliding_window=3) == [0, 1, 2, 3, 4]
  assert _reach(sliding_window=3, attention_impl='einsum', scan_layers=True) == [0, 1, 2, 3, 4]
  assert _reach() == list(range(12))


def test_a_window_per_layer_kind():
  """('local', 'global') with a window on the local kind only: the global layer reads everything; with the
  window on both kinds the reach is that of two windowed layers."""
  assert _reach(layer_pattern=('local', 'global'), layer_kinds={'local': {'SLIDING_WINDOW': 3}}) == list(range(12))
  local = {'local': {'SLIDING_WINDOW': 3}, 'global': {'SLIDING_WINDOW': 2}}
  assert _reach(layer_pattern=('local', 'global'), layer_kinds=local, scan_layers=True) == [0, 1, 2, 3]


# ---- decoding -----------------------------------------------------------------------------------------

PROMPTS = [Prompt([1, 2, 3, 4, 5]), Prompt([7]), Prompt([9, 8, 7, 6, 5, 4, 3, 2, 1, 3, 40])]


@pytest.mark.parametrize('sets', [
    pytest.param(['SLIDING_WINDOW=4'], id='uniform', marks=pytest.mark.slow),   # local_global has windowed layers too
    pytest.param(['NUM_LAYERS=4', 'USE_REPEATED_LAYER=True', "LAYER_PATTERN=('local', 'global')",
                  "LAYER_KINDS={'local': {'SLIDING_WINDOW': 3}}"], id='local_global')])
def test_cached_decoding_equals_full_recomputation_with_a_window(sets):
  """Left-padded prompts of 1, 5 and 11 tokens in one batch, 12 new tokens (past the window): greedy tokens
  equal re-running the windowed model on the whole prefix; logprobs equal the teacher-forced ones."""
  setup = engine.build(config.resolve(EXP, TINY + sets))
  params = engine.init_state(setup, 0)['params']
  decoder = Decoder(setup, params)
  records, _ = decoder.run(PROMPTS, DecodeOptions(max_decode_steps=12))
  for prompt, r in zip(PROMPTS, records):
    assert r['decoded_ids'] == full_recompute_greedy(decoder.model, params, prompt.ids, 12)
    tf = teacher_forced_logprob(decoder.model, params, prompt.ids, r['decoded_ids'])
    assert r['logprob'] == pytest.approx(tf, abs=1e-4)


def _model(abstract=False, **settings):
  """(model, params): params initialised in one compile (not op by op), or only their shapes when `abstract`."""
  model = instantiate(lm_config(**{**SETTINGS, 'max_seq_len': 48, **settings}))
  init = lambda: model.init(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))['params']
  return model, (jax.eval_shape(init) if abstract else jax.jit(init)())


@pytest.mark.parametrize('settings', [pytest.param(dict(sliding_window=6), marks=pytest.mark.slow),
                                      dict(layer_pattern=('local', 'global'), scan_layers=True,
                                           layer_kinds={'local': {'SLIDING_WINDOW': 6}})], ids=['uniform', 'local_global'])
def test_extend_in_chunks_of_every_size_gives_the_full_forward_logits(settings):
  """The rolling cache through DecodingModel.extend: chunks of 1 token, fewer than the window, and more than
  it (the ring rewritten whole), one row left-padded by 3; every chunk's logits equal the plain forward pass's."""
  model, params = _model(**settings)
  rng = np.random.default_rng(2)
  ids = rng.integers(1, 32, (2, 40)).astype(np.int32)
  positions = np.stack([np.arange(40), np.arange(40) - 3]).astype(np.int32)   # row 1: 3 padding tokens, then 0..36
  # row 1 without its padding, right-padded instead (causal: its first 37 logits are its own), in the same batch
  both = np.concatenate([ids, np.pad(ids[1:, 3:], ((0, 0), (0, 3)))])
  full = np.asarray(jax.jit(lambda x: model.apply({'params': params}, x))(jnp.asarray(both)))
  full, alone = full[:2], full[2:, :37]
  extend = jax.jit(model.extend)
  cache = jax.tree.map(jnp.asarray, nn.meta.unbox(model.init_cache(params, 2, 40)))
  start = 0
  for size in (5, 1, 1, 13, 5, 1, 13, 1):   # three sizes: three compiles
    logits, cache = extend(params, cache, jnp.asarray(ids[:, start:start + size]),
                           jnp.asarray(np.where(positions[:, start:start + size] >= 0, positions[:, start:start + size], -1)))
    logits = np.asarray(logits)   # sliced on the host: each slice of a device array would compile
    np.testing.assert_allclose(logits[0], full[0, start:start + size], atol=2e-5)
    real = slice(max(start, 3), start + size)
    np.testing.assert_allclose(logits[1, real.start - start:], alone[0, real.start - 3:real.stop - 3], atol=2e-5)
    start += size
  assert start == 40


def test_the_rolling_cache_holds_a_window_of_tokens_and_a_global_layer_all():
  model, params = _model(abstract=True, layer_pattern=('local', 'global'), scan_layers=True,
                         layer_kinds={'local': {'SLIDING_WINDOW': 6}})
  cache = nn.meta.unbox(jax.eval_shape(lambda p: model.init_cache(p, 2, 4096), params))
  local, full = cache['layers']['block_0']['attention'], cache['layers']['block_1']['attention']
  # the full cache is heads-major: keys [layers, B, K, E, S]
  assert local['cached_key'].shape == (1, 2, 6, 2, 4) and full['cached_key'].shape == (1, 2, 2, 4, 4096)
  assert 'cached_position' in local and 'cached_position' not in full
  # a window at least as long as the text keeps the plain cache
  short, params = _model(abstract=True, sliding_window=64)
  plain = nn.meta.unbox(jax.eval_shape(lambda p: short.init_cache(p, 2, 48), params))
  assert plain['layer_0']['attention']['cached_key'].shape == (2, 2, 4, 48)


# ---- bad input ------------------------------------------------------------------------------------------


@pytest.mark.parametrize('sets, phrase', [
    (['SLIDING_WINDOW=-1'], 'SLIDING_WINDOW must be 0 (full attention) or positive, got -1'),
    (["LAYER_PATTERN=('local', 'global')", "LAYER_KINDS={'local': {'SLIDING_WINDOW': -4}}"],
     "LAYER_KINDS['local']: SLIDING_WINDOW must be 0"),
])
def test_a_negative_window_is_one_line(sets, phrase, capsys):
  args = [a for s in TINY + sets for a in ('--set', s)]
  code, _, err = pax_main(['describe', '--exp', EXP, *args], capsys)
  assert code == 2 and 'Traceback' not in err and len(err.strip().splitlines()) == 1, err
  assert phrase in ' '.join(err.split()), err


def test_a_window_on_a_swapped_in_attention_layer_is_one_line():
  import fiddle as fdl
  from paxcli.errors import UserError
  from paxcli.layers.transformer import Mlp
  from paxcli.models.validation import validate_lm
  cfg = lm_config(**SETTINGS, layer_pattern=('local', 'global'), layer_kinds={'local': {'SLIDING_WINDOW': 4}})
  cfg.lm_tpl.block_tpl.attention_tpl = fdl.Config(Mlp, hidden_dims=8)   # not paxcli's causal Attention
  with pytest.raises(UserError, match="LAYER_KINDS\\['local'\\] sets SLIDING_WINDOW 4, but the attention layer is Mlp"):
    validate_lm(cfg.lm_tpl)
