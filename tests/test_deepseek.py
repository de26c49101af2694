"""DeepSeek-V3's own parts (paxcli.layers.mla, the DeepSeekMoE router, the dense first layers) on a tiny model with
every one of them on: decoding through the cache of latents (absorbed, expanded and the form 'auto' picks per call)
equals the full forward pass, left-padded rows and a LoRA adapter included; the cache holds the latent and the
rotary key only; rows with their own LoRA adapters (pax serve's) decode as each alone; and a model whose dense first
layers differ in more than their MLP is not a DeepSeek-V3.
Against transformers' own DeepseekV3ForCausalLM: tests/test_hf_families.py (its reference entry)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxcli.layers.base import instantiate
from paxcli.layers.mla import LatentAttention, decode_form
from paxcli.errors import UserError
from paxcli.models import knobs, lm_config
from paxcli.models.deepseek import DEEPSEEK_V3
from paxcli.models.lm import flat_view
from paxcli.models.validation import validate_lm

# 2 layers, the first dense; 8 experts in 4 groups, 3 per token from the best 2 groups, a shared expert; latents of
# 16 (kv) and 12 (queries); YaRN from 8 positions (the texts here pass it) with DeepSeek's mscale_all_dim.
TINY = {'VOCAB_SIZE': 40, 'NUM_LAYERS': 2, 'MODEL_DIMS': 24, 'HIDDEN_DIMS': 16, 'NUM_HEADS': 4, 'MAX_SEQ_LEN': 32,
        'KV_LORA_RANK': 16, 'Q_LORA_RANK': 12, 'QK_NOPE_HEAD_DIMS': 8, 'QK_ROPE_HEAD_DIMS': 4, 'V_HEAD_DIMS': 6,
        'NUM_EXPERTS': 8, 'EXPERTS_PER_TOKEN': 3, 'ROUTER_GROUPS': 4, 'ROUTER_TOPK_GROUPS': 2,
        'SHARED_EXPERT_HIDDEN_DIMS': 16, 'LAYER_PREFIX': ('dense',),
        'LAYER_KINDS': {'dense': {'NUM_EXPERTS': 0, 'HIDDEN_DIMS': 32}}, 'ROTARY_SCALING': 'yarn',
        'ROTARY_SCALING_FACTOR': 4.0, 'ROTARY_ORIGINAL_MAX_LEN': 8, 'ROTARY_MSCALE': 1.0,
        'ROTARY_MSCALE_ALL_DIM': 1.0, 'USE_REPEATED_LAYER': False}


def _model(**more):
  return instantiate(lm_config(**knobs.flat_settings({**DEEPSEEK_V3.knobs, **TINY, **more}, knobs.LM_KNOBS)))


def _params(model, seed=0):
  """Random weights, the router bias and LoRA's B (zeros at init) included, so that each one counts."""
  shapes = model.init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))['params']
  leaves, tree = jax.tree.flatten(nn.meta.unbox(shapes))
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return jax.tree.unflatten(tree, [x + 0.2 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


@pytest.fixture(scope='module')
def text():
  rng = np.random.default_rng(3)
  ids = rng.integers(1, 40, (2, 20)).astype(np.int32)
  positions = np.stack([np.arange(20), np.arange(20) - 3]).astype(np.int32)   # row 1: 3 padding tokens, then 0..16
  return ids, positions


# 'auto' runs both forms (expanded for the 9-token prefill, absorbed for the rest at these sizes). Slow: five
# compiles of a model with experts; the default suite decodes through the cache of latents against transformers'
# generate() (tests/test_hf_families.py).
@pytest.mark.slow
@pytest.mark.parametrize('form', ['absorbed', 'expanded', 'auto'])
def test_decoding_through_the_latent_cache_equals_the_full_forward_pass(form, text):
  """A prefill of 9 tokens, then one token at a time and a chunk of 4 (auto: expanded for the prefill, absorbed for
  the steps at these sizes), with LoRA on the query, key/value and output projections."""
  model = _model(MLA_DECODE=form, LORA_RANK=2, LORA_TARGETS=('query', 'value', 'output'))
  params = _params(model)
  assert 'lora_b' in str(jax.tree_util.tree_structure(params))
  ids, positions = text
  full = np.asarray(model.apply({'params': params}, jnp.asarray(ids)))
  alone = np.asarray(model.apply({'params': params}, jnp.asarray(ids[1:, 3:])))
  extend = jax.jit(model.extend)
  cache = jax.tree.map(jnp.asarray, nn.meta.unbox(model.init_cache(params, 2, 20)))
  start = 0
  for size in (9, 1, 1, 4, 1, 4):
    chunk = positions[:, start:start + size]
    logits, cache = extend(params, cache, jnp.asarray(ids[:, start:start + size]), jnp.asarray(np.where(chunk >= 0, chunk, -1)))
    np.testing.assert_allclose(logits[0], full[0, start:start + size], atol=2e-4, rtol=1e-4)
    real = max(start, 3)
    np.testing.assert_allclose(logits[1, real - start:], alone[0, real - 3:start + size - 3], atol=2e-4, rtol=1e-4)
    start += size
  assert start == 20


def test_the_cache_holds_the_latent_and_the_rotary_key_only():
  model = _model()
  params = jax.eval_shape(lambda: _params(model))   # the cache's shapes need the params' only
  cache = nn.meta.unbox(jax.eval_shape(lambda p: model.init_cache(p, 2, 64), params))
  attention = cache['layer_1']['attention']
  assert attention['cached_latent'].shape == (2, 64, 16) and attention['cached_rope_key'].shape == (2, 64, 4)
  assert not [k for k in attention if k.startswith('cached_key') or k.startswith('cached_value')]


def test_auto_absorbs_decoding_steps_and_expands_long_prefills_at_the_released_sizes():
  assert [decode_form(n, 20, 4, 8, 4, 6, 16) for n in (9, 1, 4)] == ['expanded', 'absorbed', 'absorbed']   # TINY's
  sizes = dict(heads=128, nope=128, rope=64, value=128, rank=512)
  assert decode_form(1, 4096, **sizes) == 'absorbed' and decode_form(8, 4096, **sizes) == 'absorbed'
  assert decode_form(4096, 4096, **sizes) == 'expanded'


def test_dense_first_layers_fit_with_lora_and_differ_in_their_mlp_only():
  assert DEEPSEEK_V3.misfit(flat_view(_model(LORA_RANK=4))) == []   # LoRA reaches the swapped-in MLP too
  gelu = flat_view(_model(LAYER_KINDS={'dense': {'NUM_EXPERTS': 0, 'HIDDEN_DIMS': 32, 'ACTIVATION': 'gelu'}}))
  assert any("changes ['ffn_tpl.activation']" in r for r in DEEPSEEK_V3.misfit(gelu))


def test_rows_with_their_own_lora_adapters_decode_as_each_alone():
  """`pax serve`'s per-row adapters ([B, ...] stacks of A and B) through the cache of latents: the absorbed form
  has no one merged kernel for them, so the step is expanded; each row equals a forward pass with its adapter."""
  layer = LatentAttention(num_heads=4, num_kv_heads=4, dims_per_head=12, use_bias=False, rotary=True,
                          rotary_scaling='yarn', rotary_scaling_factor=4.0, rotary_original_max_len=8,
                          rotary_mscale=1.0, rotary_mscale_all_dim=1.0, rotary_interleave=True, kv_lora_rank=16,
                          qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, decode='absorbed', lora_rank=2,
                          lora_targets=('query', 'key', 'value', 'output'))
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(size=(2, 12, 24)), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
  # Each apply jitted: one compile per shape instead of the layer's ops dispatched one by one.
  base = nn.meta.unbox(jax.jit(layer.init)(jax.random.key(0), x, None, positions)['params'])
  # drawn by numpy: jax.random.normal would compile once for each weight's shape
  own = [jax.tree.map(lambda w: (0.3 * np.random.default_rng(i + 1).standard_normal(w.shape)).astype(np.float32), base)
         for i in range(2)]
  rows = [{k: own[i][k] if k.endswith(('_lora_a', '_lora_b')) else base[k] for k in base} for i in range(2)]
  stacked = {k: jnp.stack([rows[0][k], rows[1][k]]) if k.endswith(('_lora_a', '_lora_b')) else base[k]
             for k in base}
  apply = jax.jit(functools.partial(layer.apply, mutable=['cache']))
  cache = apply({'params': stacked}, jnp.zeros_like(x), None, positions)[1]['cache']
  got = []
  for start, size in ((0, 7), (7, 1), (8, 4)):
    out, mutated = apply({'params': stacked, 'cache': cache}, x[:, start:start + size], None,
                         positions[:, start:start + size])
    cache = mutated['cache']
    got.append(out)
  got = np.asarray(jnp.concatenate(got, axis=1))
  forward = jax.jit(layer.apply)
  for i in range(2):
    alone = np.asarray(forward({'params': rows[i]}, x[i:i + 1], None, positions[i:i + 1]))
    np.testing.assert_allclose(got[i], alone[0], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize('more, named', [({'ROTARY_FRACTION': 0.5}, 'ROTARY_FRACTION=0.5'),
                                         ({'ROTARY_SCALING': 'longrope'}, "ROTARY_SCALING='longrope'")])
def test_latent_attention_refuses_what_it_does_not_rotate_as_named(more, named):
  """A part of QK_ROPE_HEAD_DIMS left unrotated, and LongRoPE (whose decoding computes the cache again when a text
  crosses the original context: the cache of latents is not), are refused in one line."""
  config = lm_config(**knobs.flat_settings({**DEEPSEEK_V3.knobs, **TINY, **more}, knobs.LM_KNOBS))
  with pytest.raises(UserError, match=named.replace('(', r'\(')):
    validate_lm(config.lm_tpl)


def test_the_latents_are_sharded_fsdp_style():
  """The up-projections [latent, heads, head_dim] (DeepSeek-V3's largest attention weights) are sharded over
  `data` on their latent axis, as the other weights' model dimension is, not replicated on every data shard."""
  from paxcli.runtime import sharding
  model = _model(USE_REPEATED_LAYER=True)
  boxed = jax.eval_shape(lambda r: model.init(r, jnp.zeros((2, 8), jnp.int32)), jax.random.key(0))['params']
  mesh = sharding.make_mesh([1, 1, 4, 1, 2], None, jax.devices()[:8])
  specs = jax.tree.map(lambda s: s.spec, sharding.logical_to_sharding(nn.get_partition_spec(boxed),
                                                                      nn.unbox(boxed), mesh))
  attention = specs['layers']['attention']
  assert attention['query_up']['kernel'] == jax.sharding.PartitionSpec(None, 'data', 'mdl', None)
  assert attention['kv_up']['kernel'] == jax.sharding.PartitionSpec(None, 'data', 'mdl', None)
  assert attention['query_down']['kernel'] == jax.sharding.PartitionSpec(None, 'data', None)   # embed took data
