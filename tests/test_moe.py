"""The mixture-of-experts feed-forward (paxcli.layers.moe) and expert parallelism.

The layer against a plain per-token loop over numpy weights (both routers, both dispatch modes,
shared experts, biases); capacity-factor drops counted; aux losses and load summaries; MoE layers
placed by LAYER_PATTERN; on the suite's 8 fake devices, experts sharded 1, 2, 4 and 8 ways (and
beside tensor parallelism) give the same loss and gradients in float32; bad settings are one line
before any compile; a collapsed router is a warning naming its layer.
"""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import pax_main
from paxcli import config
from paxcli.errors import UserError
from paxcli.layers import moe
from paxcli.layers.base import AUX_LOSS, SUMMARIES, instantiate
from paxcli.loops.router_watch import RouterWatch, totals
from paxcli.models import lm_config
from paxcli.runtime import engine

D, F = 8, 16


def _layer(**fields):
  import fiddle as fdl
  return instantiate(fdl.Config(moe.MoeFeedForward, hidden_dims=F, **fields))


def _x(b=2, l=6, seed=0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(b, l, D)), jnp.float32)


def _init(layer, x):
  variables = layer.init(jax.random.key(1), x)
  return jax.tree.map(lambda v: getattr(v, 'value', v), variables['params'],
                      is_leaf=lambda v: isinstance(v, nn.LogicallyPartitioned))


def _apply(layer, params, x):
  return jax.jit(lambda p, x: layer.apply({'params': p}, x, mutable=[SUMMARIES, AUX_LOSS]))(params, x)


def _reference(params, x, k, softmax, normalize, gated=True, activation=jax.nn.silu):
  """Each token through its k experts one at a time, in numpy (float64)."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  x = np.asarray(x, np.float64)
  out = np.zeros_like(x)
  for b in range(x.shape[0]):
    for t in range(x.shape[1]):
      h = x[b, t]
      logits = h @ p['router']
      probs = np.exp(logits - logits.max())
      probs /= probs.sum()
      chosen = np.argsort(-logits, kind='stable')[:k]
      if softmax == 'after_topk':
        w = np.exp(logits[chosen] - logits[chosen].max())
        w /= w.sum()
      else:
        w = probs[chosen] / (probs[chosen].sum() if normalize else 1.0)
      for e, we in zip(chosen, w):
        a = np.asarray(activation(h @ p['wi_0'][e] + (p['bi_0'][e] if 'bi_0' in p else 0)))
        if gated:
          a = a * (h @ p['wi_1'][e] + (p['bi_1'][e] if 'bi_1' in p else 0))
        out[b, t] += we * (a @ p['wo'][e] + (p['bo'][e] if 'bo' in p else 0))
      if 'shared' in p:
        s = p['shared']
        a = np.asarray(activation(h @ s['wi_0']['kernel'])) * (h @ s['wi_1']['kernel'])
        y = a @ s['wo']['kernel']
        if 'shared_gate' in p:
          y = y / (1 + np.exp(-(h @ p['shared_gate'])))
        out[b, t] += y
  return out


LAYER_CASES = {
    'mixtral': dict(num_experts=4, experts_per_token=2, router_softmax='after_topk'),
    'qwen3': dict(num_experts=8, experts_per_token=3, router_softmax='before_topk', normalize_topk=True),
    'switch': dict(num_experts=4, experts_per_token=1, router_softmax='before_topk', normalize_topk=False),
    'bias': dict(num_experts=4, experts_per_token=2, use_bias=True, gated=True),
    'shared': dict(num_experts=4, experts_per_token=2, shared_hidden_dims=12, shared_gate=True),   # Qwen2-MoE
}
DEFAULT_LAYER_CASES = {('dropless', 'mixtral'), ('dropless', 'qwen3'), ('dropless', 'bias'), ('dropless', 'shared'),
                       ('capacity', 'mixtral'), ('capacity', 'switch')}


@pytest.mark.parametrize('dispatch, case', [
    pytest.param(d, c, id=f'{d}-{c}', marks=() if (d, c) in DEFAULT_LAYER_CASES else pytest.mark.slow)
    for d in ('dropless', 'capacity') for c in LAYER_CASES])
def test_the_layer_computes_each_token_through_its_k_experts(dispatch, case):
  fields = LAYER_CASES[case]
  # capacity factor E / k: every expert has room for every token (capacity = L), so nothing is dropped
  factor = fields['num_experts'] / fields['experts_per_token']
  layer = _layer(dispatch=dispatch, capacity_factor=factor, **fields)
  x = _x()
  params = _init(layer, x)
  if fields.get('use_bias'):   # biases start at zero: make them matter
    params = jax.tree.map(lambda a: a + 0.1, params)
  y, side = _apply(layer, params, x)
  want = _reference(params, x, fields['experts_per_token'], layer.router_softmax, layer.normalize_topk)
  np.testing.assert_allclose(np.asarray(y), want, atol=1e-5)
  assert float(side[SUMMARIES]['dropped_fraction']) == 0.0


def test_capacity_drops_tokens_over_capacity_and_counts_them():
  layer = _layer(num_experts=4, experts_per_token=1, dispatch='capacity', capacity_factor=1.0)
  x = _x(b=2, l=8)
  params = _init(layer, x)
  # every token's largest logit is expert 0's: capacity ceil(1.0 x 8 x 1 / 4) = 2 of a sequence's 8
  params['router'] = jnp.zeros_like(params['router']).at[:, 0].set(10.0)
  x = jnp.abs(x) + 0.1
  y, side = _apply(layer, params, x)
  assert moe.expert_capacity(8, 4, 1, 1.0) == 2
  assert float(side[SUMMARIES]['dropped_fraction']) == pytest.approx(0.75)
  assert float(side[SUMMARIES]['expert_load_max']) == 1.0 and float(side[SUMMARIES]['expert_load_min']) == 0.0
  dropless = _layer(num_experts=4, experts_per_token=1)
  full, _ = _apply(dropless, params, x)
  y, full = np.asarray(y), np.asarray(full)
  # the first two tokens of each sequence got their expert, the rest only the residual (0 here)
  np.testing.assert_allclose(y[:, :2], full[:, :2], atol=1e-6)
  np.testing.assert_array_equal(y[:, 2:], 0.0)


def test_praxis_capacity_groups_the_batch_tokens():
  """MOE_GROUPS / EXPERT_CAPACITY_RULE 'praxis': the batch's tokens in G groups (across sequences), each expert
  int(factor x group / E) slots rounded up to 4; a decoding step routes each sequence alone; G must divide."""
  assert [moe.expert_capacity(n, 4, 2, 2.0, 'praxis') for n in (16, 24, 2, 1)] == [8, 12, 2, 1]
  assert moe.routing_groups(2, 16, 4) == 4 and moe.routing_groups(2, 16, 0) == 2 and moe.routing_groups(3, 1, 4) == 3
  with pytest.raises(UserError, match='MOE_GROUPS 4 does not divide the 1 x 6 tokens'):
    moe.routing_groups(1, 6, 4)
  layer = _layer(num_experts=4, experts_per_token=1, dispatch='capacity', capacity_factor=1.0, capacity_groups=1,
                 capacity_rule='praxis')
  x = jnp.abs(_x(b=2, l=8)) + 0.1
  params = _init(layer, x)
  params['router'] = jnp.zeros_like(params['router']).at[:, 0].set(10.0)   # every token's first choice: expert 0
  y, side = _apply(layer, params, x)
  # one group of 16 tokens: int(1.0 x 16 / 4) = 4 slots, all taken by the first sequence's first 4 tokens
  y = np.asarray(y)
  assert np.all(np.abs(y[0, :4]) > 0) and np.all(y[0, 4:] == 0) and np.all(y[1] == 0)
  assert float(side[SUMMARIES]['dropped_fraction']) == pytest.approx(12 / 16)


def test_second_choices_yield_to_first_choices_for_capacity():
  # two tokens, both choosing expert 0 second and expert 1/2 first: room for one of each in expert 0
  experts = jnp.asarray([[[1, 0], [2, 0], [0, 3]]], jnp.int32)
  weights = jnp.full((1, 3, 2), 0.5)
  _, _, kept = moe.capacity_masks(experts, weights, 4, 1)
  # token 2's first choice (expert 0) wins the single slot over tokens 0 and 1's second choices
  np.testing.assert_array_equal(np.asarray(kept), [[[True, False], [True, False], [True, True]]])


def test_aux_losses_and_load_summaries():
  layer = _layer(num_experts=4, experts_per_token=2, load_balance_weight=0.5, z_loss_weight=0.25)
  x = _x()
  params = _init(layer, x)
  _, side = _apply(layer, params, x)
  logits = np.einsum('bld,de->ble', np.asarray(x), np.asarray(params['router']))
  probs = np.asarray(jax.nn.softmax(logits))
  top = np.argsort(-probs, axis=-1)[..., :2]
  share = np.stack([(top == e).sum() for e in range(4)]) / (12 * 2)
  balance = 4 * np.sum(share * probs.mean(axis=(0, 1)))
  z = np.asarray(jax.nn.logsumexp(logits, axis=-1))
  aux = jax.tree.map(np.asarray, side[AUX_LOSS])
  flat = {k: v for k, v in jax.tree_util.tree_flatten_with_path(aux)[0]}
  values = sorted(float(np.sum(v)) for v in flat.values())
  assert values == pytest.approx(sorted([0.5 * balance, 0.25 * np.mean(z * z)]), rel=1e-5)
  load = np.stack([(top == e).sum() for e in range(4)]) / 12
  assert float(side[SUMMARIES]['expert_load_max']) == pytest.approx(load.max())
  assert float(side[SUMMARIES]['expert_load_min']) == pytest.approx(load.min())
  # weights 0: no aux loss at all
  _, quiet = _apply(_layer(num_experts=4, experts_per_token=2, load_balance_weight=0.0), params, x)
  assert not jax.tree.leaves(quiet.get(AUX_LOSS, {}))


# ---- in the LM ------------------------------------------------------------------------------------

SETS = ['NUM_LAYERS=4', 'MODEL_DIMS=16', 'HIDDEN_DIMS=16', 'NUM_HEADS=2', 'DIMS_PER_HEAD=8', 'VOCAB_SIZE=32',
        'MAX_SEQ_LEN=8', "POSITION_EMBEDDING='rotary'", "NORM_TYPE='rmsnorm'", 'USE_BIAS=False',
        'USE_GATED_ACTIVATION=True', "ACTIVATION='silu'", 'PERCORE_BATCH_SIZE=1', 'USE_REPEATED_LAYER=True']
EXP = 'paxcli.models.LmExperiment'
# every other layer a mixture of 8 experts (MOE_LAYERS as a pattern), top-2
MOE = ["LAYER_PATTERN=('dense', 'moe')",
       "LAYER_KINDS={'moe': {'NUM_EXPERTS': 8, 'EXPERTS_PER_TOKEN': 2, 'LOAD_BALANCE_LOSS_WEIGHT': 0.01}}"]


def test_layer_pattern_places_the_experts():
  model = engine.build(config.resolve(EXP, SETS + MOE)).model
  ids = jnp.zeros((1, 8), jnp.int32)
  params = jax.eval_shape(lambda r: engine.unbox(model.init(r, ids)['params']), jax.random.key(0))
  stack = params['layers']
  assert stack['block_0']['mlp']['wi_0']['kernel'].shape == (2, 16, 16)           # dense
  assert stack['block_1']['mlp']['wi_0'].shape == (2, 8, 16, 16)                   # 8 experts
  assert stack['block_1']['mlp']['router'].shape == (2, 16, 8)


def _batch(b=8, l=8):
  rng = np.random.default_rng(0)
  return {'ids': rng.integers(0, 32, (b, l)).astype(np.int32), 'labels': rng.integers(0, 32, (b, l)).astype(np.int32),
          'weights': np.ones((b, l), np.float32)}


def _loss_and_grads(setup, params, batch):
  """(loss with the aux losses, gradients) and the compiled program's text."""
  def loss(p):
    with setup.activation_sharding():
      (value, _), side = setup.model.apply({'params': p}, batch, method='fprop', mutable=[AUX_LOSS])
    return value + sum(jnp.sum(a) for a in jax.tree.leaves(side))

  shardings = setup.state_shardings['params']
  compiled = jax.jit(jax.value_and_grad(loss), in_shardings=(shardings,)).lower(params).compile()
  return jax.device_get(compiled(jax.device_put(params, shardings))), compiled.as_text()


@pytest.fixture(scope='module')
def ep_references():
  """dispatch -> (weights, (loss, gradients)) with no expert parallelism: 8-way data parallel."""
  cache = {}

  def get(dispatch):
    if dispatch not in cache:
      sets = SETS + MOE + [f"MOE_DISPATCH={dispatch!r}", 'ICI_MESH_SHAPE=[1,1,8,1,1]']
      setup = engine.build(config.resolve(EXP, sets))
      params = jax.device_get(engine.init_state(setup, 0)['params'])
      cache[dispatch] = params, _loss_and_grads(setup, params, _batch())[0]
    return cache[dispatch]
  return get


def _check_expert_parallel(ep_references, dispatch, mesh):
  params, (want, want_grads) = ep_references(dispatch)
  setup = engine.build(config.resolve(EXP, SETS + MOE + [f'MOE_DISPATCH={dispatch!r}', f'ICI_MESH_SHAPE={mesh}']))
  wi = setup.state_shardings['params']['layers']['block_1']['mlp']['wi_0']
  assert wi.spec[1] == 'expert'    # [layers, experts, embed, mlp]: the experts over the expert axis
  (got, grads), text = _loss_and_grads(setup, params, _batch())
  np.testing.assert_allclose(got, want, rtol=1e-6)
  flat = dict(jax.tree_util.tree_flatten_with_path(want_grads)[0])
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    np.testing.assert_allclose(g, flat[path], rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
  return text


def test_experts_sharded_8_ways_give_the_same_loss_and_gradients_by_all_to_all(ep_references):
  assert 'all-to-all' in _check_expert_parallel(ep_references, 'dropless', '[1,1,1,8,1]')


EP_MESHES = {'ep2': '[1,1,4,2,1]', 'ep4': '[1,1,2,4,1]', 'ep8': '[1,1,1,8,1]', 'ep4-mdl2': '[1,1,1,4,2]'}


@pytest.mark.slow
@pytest.mark.parametrize('dispatch, mesh', [(d, m) for d in ('dropless', 'capacity') for m in EP_MESHES
                                            if (d, m) != ('dropless', 'ep8')])
def test_experts_sharded_n_ways_give_the_same_loss_and_gradients(ep_references, dispatch, mesh):
  text = _check_expert_parallel(ep_references, dispatch, EP_MESHES[mesh])
  if dispatch == 'capacity':   # GSPMD lowers the [E, B, C, D] reshard between batch and experts to all-to-all
    assert 'all-to-all' in text or 'all-gather' in text


# ---- bad input and the collapse warning --------------------------------------------------------------

@pytest.mark.parametrize('sets, message', [
    (["LAYER_KINDS={'moe': {'NUM_EXPERTS': 4, 'EXPERTS_PER_TOKEN': 5}}"],
     "LAYER_KINDS['moe']: EXPERTS_PER_TOKEN is 5, but each token must pick between 1 and NUM_EXPERTS (4)"),
    (["LAYER_KINDS={'moe': {'NUM_EXPERTS': 6}}", 'ICI_MESH_SHAPE=[1,1,2,4,1]'],
     'does not divide NUM_EXPERTS 6'),
    (["LAYER_KINDS={'moe': {'NUM_EXPERTS': 4}}", "MOE_DISPATCH='capacity'", 'EXPERT_CAPACITY_FACTOR=0'],
     'EXPERT_CAPACITY_FACTOR must be positive'),
    (["LAYER_KINDS={'moe': {'NUM_EXPERTS': 4}}", "MOE_DISPATCH='capacity'", 'MOE_GROUPS=-1'],
     'MOE_GROUPS must be 0'),
])
def test_bad_moe_settings_are_one_line_before_any_compile(sets, message, tmp_path, capsys):
  argv = ['train', '--exp', EXP, *[a for s in SETS + ["LAYER_PATTERN=('dense', 'moe')"] + sets for a in ('--set', s)],
          '--job-log-dir', str(tmp_path / 'job')]
  code, _, err = pax_main(argv, capsys)
  assert code == 2 and message in err and 'Traceback' not in err, err
  assert len(err.strip().splitlines()) == 1
  assert not (tmp_path / 'job' / 'checkpoints').exists()


def test_expert_axis_in_ici_and_dcn_meshes():
  from paxcli.runtime import sharding
  # 5 entries [stage, replica, data, expert, mdl]; a shorter shape beside one has expert (and stage) 1
  assert sharding.mesh_shape([1, 1, 2, 2, 1], [1, 1, 1, 2, 1], 8) == ([1, 1, 2, 2, 1], [1, 1, 1, 2, 1])
  assert sharding.mesh_shape([1, 4, 1], [1, 1, 1, 2, 1], 8) == ([1, 1, 4, 1, 1], [1, 1, 1, 2, 1])
  assert sharding.expert_axis_size([1, 1, 2, 2, 1], [1, 1, 1, 2, 1]) == 4
  assert sharding.expert_axis_size([1, 4, 1], None) == 1 and sharding.expert_axis_size([1, 1, 1, -1, 1], None) is None
  mesh = sharding.make_mesh([1, 1, 2, 2, 1], [1, 1, 1, 2, 1])
  assert dict(mesh.shape) == {'stage': 1, 'replica': 1, 'data': 2, 'expert': 4, 'mdl': 1}
  assert sharding.batch_axes(mesh) == ('replica', 'data', 'expert') and sharding.data_parallel_size(mesh) == 8


def test_an_expert_axis_filled_by_the_devices_is_checked_once_known():
  with pytest.raises(UserError, match=r'\(8, .*does not divide NUM_EXPERTS 4'):
    engine.build(config.resolve(EXP, SETS + ['NUM_EXPERTS=4', 'ICI_MESH_SHAPE=[1,1,1,-1,1]']))


def test_router_watch_warns_once_naming_the_layer():
  lines = []
  watch = RouterWatch(0.9, 3, lines.append)
  layer = 'layer_1/mlp'
  rows = [{'step': s, f'summary/{layer}/expert_load_max': 0.97, f'summary/{layer}/expert_load_min': 0.0,
           'summary/layer_3/mlp/expert_load_max': 0.4,
           'summary/layer_3/mlp/expert_load_min': 0.2} for s in range(1, 6)]
  watch(rows[:2])
  assert not lines              # two steps: not yet
  watch(rows[2:])
  assert len(lines) == 1 and layer in lines[0] and 'steps (1-3' in lines[0] and 'layer_3' not in lines[0]
  # every expert seeing every token (k = E) is not a collapse
  balanced = RouterWatch(0.9, 1, lines.append)
  balanced([{'step': 1, f'summary/{layer}/expert_load_max': 1.0, f'summary/{layer}/expert_load_min': 1.0}])
  assert len(lines) == 1
  # a scanned stack's summaries, one row per group: layer = group x period + position in the group
  from paxcli.models import pattern
  spread = pattern.per_layer({'layers': {'block_1': {'mlp': {'expert_load_max': np.array([0.5, 0.7])}}}}, 2)
  assert spread == {'layer_1': {'mlp': {'expert_load_max': 0.5}}, 'layer_3': {'mlp': {'expert_load_max': 0.7}}}
  assert totals(rows[0]) == {'moe/expert_load_min': 0.0, 'moe/expert_load_max': 0.97, 'moe/dropped_fraction': 0}


@pytest.mark.slow
def test_a_collapsed_router_is_a_warning_in_the_train_log(tmp_path, capsys):
  # top-1 of 4 experts with a router that starts (and, at learning rate 0, stays) on one expert
  sets = SETS + ["LAYER_PATTERN=('dense', 'moe')",
                 "LAYER_KINDS={'moe': {'NUM_EXPERTS': 4, 'EXPERTS_PER_TOKEN': 1}}", 'LEARNING_RATE=0.0',
                 'NUM_TRAIN_STEPS=4', 'SUMMARY_INTERVAL_STEPS=2', 'task.train.router_collapse_steps=3',
                 'task.train.router_collapse_fraction=0.3']
  argv = ['train', '--exp', EXP, *[a for s in sets for a in ('--set', s)], '--job-log-dir', str(tmp_path / 'job')]
  code, out, err = pax_main(argv, capsys)
  assert code == 0, err
  text = out + err
  assert 'warning: the router of layer_1/mlp has collapsed' in text, text
  assert 'experts: load' in text
  rows = [json.loads(x) for x in (tmp_path / 'job' / 'train_metrics.jsonl').read_text().splitlines()]
  assert {'moe/expert_load_max', 'moe/expert_load_min', 'moe/dropped_fraction'} <= set(rows[-1])
  assert any(k.startswith('aux_loss/') and k.endswith('load_balance_loss') for k in rows[-1])
  assert {'summary/layer_1/mlp/expert_load_max', 'summary/layer_3/mlp/expert_load_max'} <= set(rows[-1])
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  events = EventAccumulator(str(tmp_path / 'job' / 'summaries' / 'train'))
  events.Reload()
  assert {'moe/expert_load_max', 'moe/expert_load_min', 'moe/dropped_fraction'} <= set(events.Tags()['scalars'])


def test_knob_defaults_are_dense():
  model = instantiate(lm_config())
  assert 'wi_0' in jax.eval_shape(lambda r: engine.unbox(model.init(r, jnp.zeros((1, 4), jnp.int32))['params']),
                                  jax.random.key(0))['layer_0']['mlp']


# ---- counting and planning -----------------------------------------------------------------------------

def test_flops_count_the_router_and_k_experts_not_all():
  settings = dict(vocab_size=32, num_layers=2, model_dims=16, num_heads=2, dims_per_head=8, max_seq_len=8)
  sparse = instantiate(lm_config(**settings, hidden_dims=12, num_experts=8, experts_per_token=2)).train_flops(8)
  dense = instantiate(lm_config(**settings, hidden_dims=24)).train_flops(8)   # k x the expert width
  assert sparse.matmul_params - dense.matmul_params == 2 * 16 * 8                # + the router, per layer
  assert sparse.attention_per_token == dense.attention_per_token


def test_describe_shows_total_and_active_parameters_at_mixtrals_size(capsys):
  code, out, err = pax_main(['describe', '--exp', 'bench.Mixtral8x7B'], capsys)
  assert code == 0, err
  # Mixtral 8x7B's published figures: 46.7B parameters, 12.9B active
  assert '# parameters: 46.7 G (46,702,792,704); active per token: 12.9 G (12,879,925,248' in out
  code, out, err = pax_main(['describe', '--exp', 'bench.Qwen3Moe30BA3B', '--json'], capsys)
  assert code == 0, err
  summary = json.loads(out)
  assert round(summary['summary.parameters'] / 1e9, 1) == 30.5, err   # Qwen3-30B-A3B
  assert round(summary['summary.active_parameters'] / 1e9, 2) == 3.35
  dense = pax_main(['describe', '--exp', 'bench.LlamaTiny'], capsys)[1]
  assert 'active per token' not in dense


@pytest.mark.slow
def test_bench_mfu_compiles_an_expert_parallel_mesh(capsys):
  sets = SETS + MOE + ['ICI_MESH_SHAPE=[1,1,2,4,1]']
  code, out, err = pax_main(['bench', 'mfu', '--exp', EXP, *[a for s in sets for a in ('--set', s)], '--compile-only',
                             '--json'], capsys)
  assert code == 0, err
  row = json.loads(out)[0]
  assert row['mesh'] == 'stage=1 x replica=1 x data=2 x expert=4 x mdl=1' and row['status'] == 'compiled'


@pytest.mark.slow
@pytest.mark.parametrize('exp, devices', [('bench.Mixtral8x7B', 64), ('bench.Qwen3Moe30BA3B', 16)])
def test_real_size_plans_fit_80_gib_per_device(exp, devices):
  from conftest import run_pax
  done = run_pax('bench', 'mfu', '--exp', exp, '--compile-only', '--num-devices', str(devices), '--device-memory',
                 '80GiB', '--json', timeout=900)
  assert done.returncode == 0, done.stderr[-2000:]
  row = json.loads(done.stdout)[0]
  assert row['devices'] == devices and row['status'] == 'compiled' and row['fits'] is True, row
  assert row['memory_total_bytes'] < 80 * 2**30


@pytest.mark.slow
def test_experts_combine_with_pipeline_stages():
  """2 stages (each a group of a dense and an MoE layer) beside expert 4: the unpipelined loss and gradients.
  Without the load-balancing loss, which the pipeline computes per microbatch (a mean of per-microbatch
  products is not the whole batch's)."""
  moe = ["LAYER_PATTERN=('dense', 'moe')",
         "LAYER_KINDS={'moe': {'NUM_EXPERTS': 8, 'EXPERTS_PER_TOKEN': 2, 'LOAD_BALANCE_LOSS_WEIGHT': 0.0}}"]
  reference = engine.build(config.resolve(EXP, SETS + moe + ['ICI_MESH_SHAPE=[1,1,2,4,1]']))
  params = jax.device_get(engine.init_state(reference, 0)['params'])
  (want, want_grads), _ = _loss_and_grads(reference, params, _batch())
  piped = engine.build(config.resolve(EXP, SETS + moe + ['NUM_STAGES=2', 'ICI_MESH_SHAPE=[2,1,1,4,1]']))
  (got, grads), _ = _loss_and_grads(piped, params, _batch())
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
