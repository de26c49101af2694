"""Model options Pax's lm_cloud models need: each computes what Pax's layer computes.

The references here are written from praxis 1.4.0's documented semantics in NumPy, not
with paxcli's layers; tests/test_convert_paxml.py checks them all at once against logits
that paxml itself computed.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxcli.runtime import engine
from paxcli.layers.base import instantiate
from paxcli.layers.transformer import Attention, sinusoidal
from paxcli.models import lm_config

BASE = dict(vocab_size=50, num_layers=2, model_dims=32, hidden_dims=64, num_heads=4, num_kv_heads=4,
            dims_per_head=8, max_seq_len=12, checkpoint_policy='none')


def TransformerLm(**settings):  # noqa: N802: the LM from flat settings, as the LM knobs build it
  return instantiate(lm_config(**settings))


def _ids(b=2, l=12, seed=0):
  return jax.random.randint(jax.random.key(seed), (b, l), 0, 50)


def _init(model, ids):
  return engine.unbox(model.init(jax.random.key(0), ids)['params'])


def _perturb(params, seed=1, scale=0.5):
  """Random values everywhere (zero-initialised weights would hide mistakes)."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


@pytest.mark.parametrize('dims', [8, 7])
def test_sinusoidal_is_paxs_positional_embedding(dims):
  pos = np.array([[0, 1, 5, 100], [3, 2, 1, 0]])
  half = dims // 2
  inv = np.exp(-np.arange(half) * math.log(10000.0) / (half - 1))  # timescales 1 .. 10^4
  angles = pos[..., None] * inv
  want = np.concatenate([np.sin(angles), np.cos(angles), np.zeros(pos.shape + (dims % 2,))], -1)
  np.testing.assert_allclose(sinusoidal(jnp.asarray(pos), dims), want, rtol=1e-5, atol=1e-5)


def test_sinusoidal_lm_has_no_position_weights_and_follows_positions():
  model = TransformerLm(**BASE, position_embedding='sinusoidal')
  ids = _ids()
  params = _init(model, ids)
  assert 'position_embedding' not in params
  pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
  same = jnp.full((2, 12), 7)  # every token at one position: positions change the result
  a = model.apply({'params': params}, ids, positions_BxL=pos)
  b = model.apply({'params': params}, ids, positions_BxL=same)
  np.testing.assert_allclose(a, model.apply({'params': params}, ids), rtol=1e-6)  # default: 0..L-1
  assert not np.allclose(a, b, atol=1e-3)


def test_softmax_cap_and_bias_act_on_the_output_logits():
  ids = _ids()
  plain = TransformerLm(**BASE)
  capped = TransformerLm(**BASE, softmax_cap_logits=2.0, softmax_bias=True)
  params = _perturb(_init(capped, ids))
  assert params['logits_bias'].shape == (50,)
  raw = plain.apply({'params': {k: v for k, v in params.items() if k != 'logits_bias'}}, ids)
  got = capped.apply({'params': params}, ids)
  want = 2.0 * np.tanh((np.asarray(raw) + np.asarray(params['logits_bias'])) / 2.0)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(raw)).max() > 2.0 > np.abs(np.asarray(got)).max()


def test_separate_softmax_gets_a_bias_too():
  model = TransformerLm(**BASE, separate_embedding=True, softmax_bias=True)
  params = _init(model, _ids())
  assert params['logits']['bias'].shape == (50,)
  assert 'logits_bias' not in params


def _reference_attention(p, x, cap, per_dim_scale):
  """Pax's DotProductAttention (no bias, no rotary) in NumPy, from its documented steps."""
  q = np.einsum('bld,dhe->blhe', x, p['query']['kernel'])
  k = np.einsum('bld,dhe->blhe', x, p['key']['kernel'])
  v = np.einsum('bld,dhe->blhe', x, p['value']['kernel'])
  e = q.shape[-1]
  if per_dim_scale is None:
    q = q / np.sqrt(e)
  else:  # PerDimScale: 1.442695041 / sqrt(dim) * softplus(w)
    q = q * (1.442695041 / np.sqrt(e) * np.log1p(np.exp(per_dim_scale)))
  logits = np.einsum('blhe,bshe->bhls', q, k)
  if cap:
    logits = cap * np.tanh(logits / cap)
  l = x.shape[1]
  logits = np.where(np.tril(np.ones((l, l), bool)), logits, -1e30)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = np.einsum('bhls,bshe->blhe', probs, v)
  return np.einsum('blhe,hed->bld', out, p['out']['kernel'])


@pytest.mark.parametrize('cap', [0.0, 1.5])
def test_attention_logit_cap_and_per_dim_scale_match_pax(cap):
  x = jax.random.normal(jax.random.key(3), (2, 6, 16))
  seg = jnp.ones((2, 6), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
  layer = Attention(num_heads=2, num_kv_heads=2, dims_per_head=4, use_bias=False, per_dim_scale=True,
                    atten_logit_cap=cap)
  params = engine.unbox(layer.init(jax.random.key(0), x, seg, pos)['params'])
  assert params['per_dim_scale'].shape == (4,) and not params['per_dim_scale'].any()  # starts at 0
  # At its initial value the learned scale is exactly 1/sqrt(E): the plain layer's function.
  plain = Attention(num_heads=2, num_kv_heads=2, dims_per_head=4, use_bias=False, atten_logit_cap=cap)
  rest = {k: v for k, v in params.items() if k != 'per_dim_scale'}
  np.testing.assert_allclose(layer.apply({'params': params}, x, seg, pos),
                             plain.apply({'params': rest}, x, seg, pos), rtol=1e-5, atol=1e-6)
  params = _perturb(params, scale=1.0)
  got = layer.apply({'params': params}, x, seg, pos)
  want = _reference_attention(jax.tree.map(np.asarray, params), np.asarray(x), cap,
                              np.asarray(params['per_dim_scale']))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_embedding_scale_multiplies_token_embeddings_by_sqrt_dims():
  ids = _ids()
  one = dict(BASE, num_layers=1, position_embedding='none')
  scaled = TransformerLm(**one, scale_embedding_sqrt_depth=True)
  plain = TransformerLm(**one)
  params = _perturb(_init(plain, ids))
  p2 = dict(params, embedding={'embedding': params['embedding']['embedding'] * math.sqrt(32)})
  # Scaling the table scales the tied logits too: undo that on the plain model's output.
  got = scaled.apply({'params': params}, ids)
  want = plain.apply({'params': p2}, ids) / math.sqrt(32)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_attention_bias_apart_from_the_other_biases_and_norm_epsilon():
  ids = _ids()
  model = TransformerLm(**BASE, use_bias=True, attention_use_bias=False)
  params = _init(model, ids)
  assert 'bias' not in params['layer_0']['attention']['query']
  assert 'bias' in params['layer_0']['mlp']['wi_0'] and 'bias' in params['final_norm']
  loose = TransformerLm(**BASE, use_bias=True, attention_use_bias=False, norm_epsilon=10.0)
  assert not np.allclose(model.apply({'params': params}, ids), loose.apply({'params': params}, ids), atol=1e-3)
