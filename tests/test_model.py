"""The Transformer LM: variants, equivalences, causality, loss weights, optimizers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxcli import config, optim

from paxcli.runtime import engine
from paxcli.layers.base import instantiate
from paxcli.models import lm_config, lm_loss
from paxcli.tasks import ScheduleConfig

BASE = dict(vocab_size=50, num_layers=2, model_dims=32, hidden_dims=64, num_heads=4, num_kv_heads=4,
            dims_per_head=8, max_seq_len=12)


def TransformerLm(**settings):  # noqa: N802: the LM from flat settings, as the LM knobs build it
  return instantiate(lm_config(**settings))


def _init(model, ids):
  return engine.unbox(model.init(jax.random.key(0), ids)['params'])


def _ids(b=2, l=12, seed=0):
  return jax.random.randint(jax.random.key(seed), (b, l), 0, 50)


@pytest.mark.parametrize('variant', [
    dict(),
    dict(num_kv_heads=2, position_embedding='rotary', norm_type='rmsnorm', use_bias=False),
    dict(activation='silu', use_gated_activation=True, separate_embedding=True),
    dict(scan_layers=True, checkpoint_policy='save_dot_only'),
    dict(scan_layers=True, checkpoint_policy='save_qkv_out_proj', fprop_dtype='bfloat16'),
    dict(checkpoint_policy='save_everything', activation='relu', position_embedding='none'),
])
def test_variants_train_a_step(variant):
  model = TransformerLm(**{**BASE, **variant})
  ids = _ids()
  params = _init(model, ids)
  for leaf in jax.tree.leaves(params):
    assert leaf.dtype == jnp.float32  # weights stay float32 whatever FPROP_DTYPE is

  def loss(p):
    return lm_loss(model.apply({'params': p}, ids), jnp.roll(ids, -1, 1), jnp.ones(ids.shape))[0]

  value, grads = jax.value_and_grad(loss)(params)
  assert np.isfinite(value) and abs(float(value) - np.log(50)) < 1.0  # near uniform at init
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def test_scan_matches_a_loop_of_layers():
  ids = _ids()
  loop = TransformerLm(**BASE, checkpoint_policy='none')
  scan = TransformerLm(**BASE, scan_layers=True, checkpoint_policy='save_nothing')
  p_loop = _init(loop, ids)
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), p_loop['layer_0'], p_loop['layer_1'])
  p_scan = {k: v for k, v in p_loop.items() if not k.startswith('layer_')}
  p_scan['layers'] = stacked
  assert jax.tree.structure(p_scan) == jax.tree.structure(_init(scan, ids))
  np.testing.assert_allclose(loop.apply({'params': p_loop}, ids), scan.apply({'params': p_scan}, ids),
                             rtol=1e-5, atol=1e-5)


def test_grouped_query_attention_equals_mha_with_repeated_kv_heads():
  ids = _ids()
  gqa = TransformerLm(**{**BASE, 'num_kv_heads': 2, 'num_layers': 1})
  mha = TransformerLm(**{**BASE, 'num_layers': 1})
  p = _init(gqa, ids)
  p_mha = jax.tree.map(lambda x: x, p)
  attn = p_mha['layer_0']['attention']
  for name in ('key', 'value'):  # kv head k serves query heads [2k, 2k+1]
    attn[name]['kernel'] = jnp.repeat(attn[name]['kernel'], 2, axis=1)
    attn[name]['bias'] = jnp.repeat(attn[name]['bias'], 2, axis=0)
  np.testing.assert_allclose(gqa.apply({'params': p}, ids), mha.apply({'params': p_mha}, ids),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('position', ['learned', 'rotary'])
def test_attention_is_causal(position):
  model = TransformerLm(**{**BASE, 'position_embedding': position})
  ids = _ids()
  params = _init(model, ids)
  changed = ids.at[:, 7:].set((ids[:, 7:] + 1) % 50)
  a, b = model.apply({'params': params}, ids), model.apply({'params': params}, changed)
  np.testing.assert_allclose(a[:, :7], b[:, :7], rtol=1e-6, atol=1e-6)
  assert not np.allclose(a[:, 7:], b[:, 7:])


def test_loss_ignores_zero_weight_positions():
  logits = jax.random.normal(jax.random.key(1), (2, 5, 7))
  labels = jnp.array([[1, 2, 3, 4, 5], [0, 1, 2, 3, 4]])
  weights = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], jnp.float32)
  loss, sums = lm_loss(logits, labels, weights)
  other = labels.at[0, 3:].set(6)  # labels under zero weight do not matter
  assert float(lm_loss(logits, other, weights)[0]) == pytest.approx(float(loss))
  nll = -jax.nn.log_softmax(logits)[jnp.arange(2)[:, None], jnp.arange(5)[None], labels]
  assert float(loss) == pytest.approx(float((nll * weights).sum() / 8), rel=1e-6)
  assert float(sums['weight_sum']) == 8


def test_schedules():
  def at(kind, step, **kw):
    cfg = ScheduleConfig(kind=kind, **kw)
    return float(optim.schedule_multiplier(cfg, 100)(step))
  assert at('constant', 0) == 1.0
  assert at('constant', 4, warmup_steps=10) == pytest.approx(0.5)
  cos = dict(warmup_steps=10, min_ratio=0.1)
  assert at('linear_rampup_cosine_decay', 10, **cos) == pytest.approx(1.0)
  assert at('linear_rampup_cosine_decay', 55, **cos) == pytest.approx(0.55, rel=1e-5)
  assert at('linear_rampup_cosine_decay', 100, **cos) == pytest.approx(0.1)
  exp = dict(warmup_steps=10, decay_start=20, decay_end=60, min_ratio=0.01)
  assert at('linear_rampup_exponential_decay', 20, **exp) == pytest.approx(1.0)
  assert at('linear_rampup_exponential_decay', 40, **exp) == pytest.approx(0.1, rel=1e-5)
  assert at('linear_rampup_exponential_decay', 90, **exp) == pytest.approx(0.01, rel=1e-5)


@pytest.mark.parametrize('name', ['adam', 'adamw', 'adafactor', 'sgd'])
def test_each_optimizer_lowers_the_loss_sharded(name):
  from paxcli.loops.train import ready_step
  from paxcli.runtime.sharding import to_global
  lr = {'sgd': 0.5, 'adafactor': 0.01}.get(name, 3e-3)
  resolved = config.resolve('lm_cloud.LmCloudSpmdTest', [
      'ICI_MESH_SHAPE=[1,4,2]', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=4', 'DIMS_PER_HEAD=8',
      'PERCORE_BATCH_SIZE=1', 'MAX_SEQ_LEN=16', 'VOCAB_SIZE=64', f'OPTIMIZER={name}', f'LEARNING_RATE={lr}',
      'WEIGHT_DECAY=0.001'])
  setup, state, step, batch_sharding, data = ready_step(resolved)
  batch = to_global(data.get_next(), batch_sharding, setup.global_batch)
  losses = []
  for _ in range(8):
    state, metrics = step(state, batch)
    losses.append(float(metrics['loss']))
  assert losses[-1] < losses[0] - 0.1, losses
