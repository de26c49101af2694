"""paxcli.layers.base: each BaseLayer verb, fiddle templates and sharing, and the train loop
honouring non-trainable variables (REQUIRES_MEAN_SYNC on 8 devices) and aux losses."""

import fiddle as fdl
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxcli import config

from paxcli.runtime import engine
from paxcli.errors import UserError
from paxcli.experiment import register
from paxcli.layers import base
from paxcli.layers.base import BaseLayer, WeightHParams, WeightInit, instance_field, instantiate, template_field
from paxcli.recipes.lm_cloud import LmCloudSpmdTest


class Linear(BaseLayer):
  input_dims: int = 0
  output_dims: int = 0

  def setup(self):
    self.create_variable('w', WeightHParams(shape=[self.input_dims, self.output_dims], init=self.params_init,
                                            tensor_split_dims_mapping=('embed', 'mlp')))

  def __call__(self, x):
    return x @ self.theta.w


class Inits(BaseLayer):
  def setup(self):
    shape = [256, 128]
    for name, init in (('gaussian', WeightInit.Gaussian(0.5)), ('uniform', WeightInit.Uniform(0.3)),
                       ('constant', WeightInit.Constant(0.7)), ('xavier', WeightInit.Xavier(1.0)),
                       ('fan_in', WeightInit.GaussianSqrtFanIn(2.0)),
                       ('trunc_fan_in', WeightInit.TruncatedGaussianSqrtFanIn(1.0))):
      self.create_variable(name, WeightHParams(shape=shape, init=init))

  def __call__(self):
    return self.theta.constant


def test_create_variable_weight_inits_and_logical_names():
  values = Inits().init(jax.random.key(0))['params']
  v = {k: np.asarray(engine.unbox(x)) for k, x in values.items()}
  assert v['gaussian'].std() == pytest.approx(0.5, rel=0.05)
  assert v['uniform'].min() >= -0.3 and v['uniform'].max() <= 0.3 and v['uniform'].std() == pytest.approx(
      0.3 / np.sqrt(3), rel=0.05)
  np.testing.assert_array_equal(v['constant'], np.float32(0.7))
  limit = np.sqrt(6 / (256 + 128))
  assert np.abs(v['xavier']).max() <= limit and np.abs(v['xavier']).max() > 0.95 * limit
  assert v['fan_in'].std() == pytest.approx(2.0 / np.sqrt(256), rel=0.05)
  assert v['trunc_fan_in'].std() == pytest.approx(1 / np.sqrt(256), rel=0.05)
  assert np.abs(v['trunc_fan_in']).max() <= 2 / np.sqrt(256) / 0.87962566 + 1e-6  # truncated at 2 sigma
  boxed = Linear(input_dims=3, output_dims=4).init(jax.random.key(0), jnp.ones((1, 3)))['params']['w']
  assert boxed.names == ('embed', 'mlp')  # logical axes reach the sharding table


class Counter(BaseLayer):
  dims: int = 4

  def setup(self):
    self.create_variable('count', WeightHParams(shape=[self.dims], init=WeightInit.Constant(5.0)), trainable=False)

  def __call__(self, x):
    self.update_var('count', self.get_var('count') + 1.0)
    self.add_summary('x_mean', jnp.mean(x))
    self.add_aux_loss('penalty', jnp.sum(x), weight=0.5)
    return x * self.get_var('count')


def test_non_trainable_get_update_var_summaries_and_aux_losses():
  layer = Counter()
  x = jnp.arange(4.0)
  variables = layer.init(jax.random.key(0), x)
  assert 'non_trainable' in variables and 'summaries' in variables  # flax init returns every collection
  np.testing.assert_array_equal(engine.unbox(variables['non_trainable'])['count'], 5.0)  # init: declared value
  variables = {'non_trainable': variables['non_trainable']}  # what the train step passes in
  out, updates = layer.apply(variables, x, mutable=[base.NON_TRAINABLE, base.SUMMARIES, base.AUX_LOSS])
  np.testing.assert_array_equal(engine.unbox(updates['non_trainable'])['count'], 6.0)
  assert float(updates['summaries']['x_mean']) == pytest.approx(1.5)
  assert float(updates['aux_loss']['penalty']) == pytest.approx(3.0)
  np.testing.assert_array_equal(out, x * 6.0)  # get_var after update_var reads the new value
  # Not mutable (eval): update_var leaves the variable alone instead of failing.
  np.testing.assert_array_equal(layer.apply(variables, x), x * 5.0)


class Noisy(BaseLayer):
  def __call__(self, x):
    return x + jax.random.uniform(self.next_prng_key(), x.shape), x + jax.random.uniform(self.next_prng_key(), x.shape)


def test_next_prng_key_differs_per_call_and_per_step():
  from paxcli.loops.train import step_rngs
  layer, x = Noisy(), jnp.zeros(3)
  a1, a2 = layer.apply({}, x, rngs=step_rngs(7, jnp.int32(1)))
  b1, _ = layer.apply({}, x, rngs=step_rngs(7, jnp.int32(2)))
  c1, _ = layer.apply({}, x, rngs=step_rngs(7, jnp.int32(1)))
  assert not np.allclose(a1, a2)  # two calls in one step
  assert not np.allclose(a1, b1)  # two steps
  np.testing.assert_array_equal(a1, c1)  # the same step again (a resume) draws the same


class Pair(BaseLayer):
  """Two instance children and two children from one template."""
  left: nn.Module = instance_field(Linear)
  right: nn.Module = instance_field(Linear)
  tpl: base.LayerTpl = template_field(Linear)

  def setup(self):
    self.create_children('made', [self.tpl, self.tpl])

  def __call__(self, x):
    return self.left(x) + self.right(x) + self.made[0](x) + self.made[1](x)


def test_shared_child_config_is_one_layer_and_templates_make_new_ones():
  shared = fdl.Config(Linear, input_dims=3, output_dims=3)
  cfg = fdl.Config(Pair, left=shared, right=shared, tpl=fdl.Config(Linear, input_dims=3, output_dims=3))
  layer = instantiate(cfg)
  assert isinstance(layer.tpl, base.Config)  # template fields stay configs (with clone/set)
  params = engine.unbox(layer.init(jax.random.key(0), jnp.ones((1, 3)))['params'])
  assert sorted(params) == ['left', 'made_0', 'made_1']  # right IS left: one set of weights
  x = jnp.ones((1, 3))
  grads = jax.grad(lambda p: layer.apply({'params': p}, x).sum())(params)
  np.testing.assert_allclose(grads['left']['w'], 2 * grads['made_0']['w'], rtol=1e-6)  # used twice
  separate = instantiate(fdl.Config(Pair, left=shared, right=fdl.Config(Linear, input_dims=3, output_dims=3),
                                    tpl=fdl.Config(Linear, input_dims=3, output_dims=3)))
  assert sorted(separate.init(jax.random.key(0), x)['params']) == ['left', 'made_0', 'made_1', 'right']


def test_typo_on_a_layer_config_raises_at_assignment():
  cfg = fdl.Config(Linear, input_dims=3)
  with pytest.raises(AttributeError, match="No parameter named 'output_dim'.*output_dims"):
    cfg.output_dim = 4
  tpl = config.resolve('lm_cloud.LmCloudSpmdTest').task.model.lm_tpl.block_tpl.ffn_tpl
  with pytest.raises(AttributeError, match='hiden_dims'):
    tpl.hiden_dims = 8
  with pytest.raises(UserError, match='did you mean|Did you mean'):
    config.resolve('lm_cloud.LmCloudSpmdTest', ['task.model.lm_tpl.block_tpl.ffn_tpl.hiden_dims=8'])


# ---- the LM from templates ------------------------------------------------------------------

class TinyFfn(BaseLayer):
  """A feed-forward with an aux loss and a mean-synced record of its input's batch mean."""
  input_dims: int = 0
  output_dims: int = 0
  aux_weight: float = 0.0

  def setup(self):
    self.create_child('proj', fdl.Config(Linear, input_dims=self.input_dims, output_dims=self.output_dims))
    self.create_variable('input_mean', WeightHParams(shape=[], init=WeightInit.Constant(0.0),
                                                     collections=[base.REQUIRES_MEAN_SYNC]), trainable=False)

  def __call__(self, x_BxLxD):
    self.update_var('input_mean', jnp.mean(x_BxLxD[..., 0]))  # a statistic that differs per example
    y = self.proj(x_BxLxD)
    self.add_aux_loss('w_l2', self.aux_weight * jnp.sum(self.proj.theta.w ** 2))
    return y


@register
class TinyFfnLm(LmCloudSpmdTest):
  NUM_LAYERS = 1
  MODEL_DIMS = 16
  NUM_HEADS = 2
  DIMS_PER_HEAD = 8
  HIDDEN_DIMS = 32
  VOCAB_SIZE = 64
  MAX_SEQ_LEN = 8
  PERCORE_BATCH_SIZE = 1
  ICI_MESH_SHAPE = [1, 8, 1]

  def task(self):
    task = super().task()
    task.model.lm_tpl.block_tpl.ffn_tpl = fdl.Config(TinyFfn)
    return task


def test_template_swaps_change_the_model():
  plain = engine.abstract_params(config.resolve('lm_cloud.LmCloudSpmdTest'))
  assert {'wi_0', 'wo'} <= set(plain['layer_0']['mlp'])
  swapped = engine.abstract_params(config.resolve('test_layers.TinyFfnLm'))
  assert set(swapped['layer_0']['mlp']) == {'proj'}
  assert swapped['layer_0']['mlp']['proj']['w'].shape == (16, 16)  # the block filled in MODEL_DIMS
  rms = engine.abstract_params(config.resolve('lm_cloud.LmCloudSpmdTest', [
      'task.model.lm_tpl.block_tpl.norm_tpl.kind=rmsnorm']))
  assert set(rms['layer_0']['attention_norm']) == {'scale'} and 'bias' in rms['final_norm']
  with pytest.raises(UserError, match="activation = 'gleu'.*Did you mean 'gelu'"):
    engine.abstract_params(config.resolve('lm_cloud.LmCloudSpmdTest', [
        'task.model.lm_tpl.block_tpl.ffn_tpl.activation=gleu']))


def _one_step(aux_weight):
  from paxcli.loops.train import ready_step
  from paxcli.runtime.sharding import to_global
  resolved = config.resolve('test_layers.TinyFfnLm', [f'task.model.lm_tpl.block_tpl.ffn_tpl.aux_weight={aux_weight}'])
  setup, state, step, sharding, data = ready_step(resolved)
  w_before = np.asarray(state['params']['layer_0']['mlp']['proj']['w'])
  local = data.get_next()
  batch = to_global(local, sharding, setup.global_batch)
  params_before = jax.tree.map(np.asarray, {k: state[k] for k in ('params', 'non_trainable')})
  state, metrics = step(state, batch)
  return setup, state, metrics, w_before, local, params_before


def test_non_trainable_mean_sync_and_aux_loss_in_the_train_step():
  setup, state, metrics, w_before, local, params_before = _one_step(0.0)
  assert 'non_trainable' in state and 'non_trainable' not in str(jax.tree.structure(state['opt_state']))
  synced = state['non_trainable']['layer_0']['mlp']['input_mean']
  assert setup.mean_sync['layer_0']['mlp']['input_mean'] is True
  # 8 data-parallel replicas, one example each: the variable is the mean of what each
  # replica's examples give, and every device holds that same value.
  assert synced.sharding.is_fully_replicated
  shards = {float(np.asarray(s.data)) for s in synced.addressable_shards}
  assert len(shards) == 1
  # Pax with pmap: each replica runs its own example, then REQUIRES_MEAN_SYNC averages.
  per_replica = []
  for row in range(8):
    shard = {k: v[row:row + 1] for k, v in local.items()}
    _, updates = setup.model.apply(params_before, shard, method='fprop', mutable=['non_trainable'])
    per_replica.append(float(engine.unbox(updates['non_trainable'])['layer_0']['mlp']['input_mean']))
  assert len(set(per_replica)) > 1  # the replicas' own values differ
  assert float(synced) == pytest.approx(np.mean(per_replica), rel=1e-5)
  assert float(metrics['aux_loss/layer_0/mlp/w_l2']) == 0.0
  _, state_aux, metrics_aux, w_before_aux, _, _ = _one_step(10.0)
  np.testing.assert_array_equal(w_before, w_before_aux)  # same init
  w_plain = np.asarray(state['params']['layer_0']['mlp']['proj']['w'])
  w_aux = np.asarray(state_aux['params']['layer_0']['mlp']['proj']['w'])
  assert float(metrics_aux['aux_loss/layer_0/mlp/w_l2']) == pytest.approx(10 * (w_before ** 2).sum(), rel=1e-4)
  assert float(metrics_aux['loss']) == pytest.approx(
      float(metrics_aux['model_loss']) + float(metrics_aux['aux_loss/layer_0/mlp/w_l2']), rel=1e-5)
  assert not np.allclose(w_plain, w_aux)  # the aux loss changed the gradient
  # With only the aux loss's pull the weight shrinks more: |w| after the aux step is smaller.
  assert np.abs(w_aux).sum() < np.abs(w_plain).sum()
