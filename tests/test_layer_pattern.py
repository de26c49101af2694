"""Stacks of mixed layer kinds (LAYER_PATTERN, LAYER_KINDS: paxcli.models.pattern).

A two-kind pattern whose kinds really differ (grouped-query attention with one kv head, a short
rotary base and capped attention logits, against full heads with a learned per-dimension query
scale and a narrower MLP): scanned group by group it computes what an unscanned loop of the same
layers computes, it trains, decodes through its KV cache as its full forward pass does, its
checkpoints convert between the scanned and unscanned layouts and evaluate the same, the pipeline
cuts it into stages by groups, and a pattern that cannot work is one line before any compile.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import pax_main
from paxcli import config
from paxcli.layers.base import instantiate
from paxcli.models import lm_config, pattern
from paxcli.runtime import engine

KINDS = {'local': {'NUM_KV_HEADS': 1, 'ROTARY_MAX_TIMESCALE': 100.0, 'ATTEN_LOGIT_CAP': 5.0},
         'global': {'USE_PER_DIM_SCALE': True, 'HIDDEN_DIMS': 24}}
SETTINGS = dict(vocab_size=32, num_layers=4, model_dims=16, hidden_dims=32, num_heads=4, dims_per_head=4,
                max_seq_len=16, position_embedding='rotary', norm_type='rmsnorm', use_bias=False,
                layer_pattern=('local', 'global'), layer_kinds=KINDS)
SETS = ['NUM_LAYERS=4', 'MODEL_DIMS=16', 'HIDDEN_DIMS=32', 'NUM_HEADS=4', 'DIMS_PER_HEAD=4', 'VOCAB_SIZE=32',
        'MAX_SEQ_LEN=16', "POSITION_EMBEDDING='rotary'", "NORM_TYPE='rmsnorm'", 'USE_BIAS=False',
        "LAYER_PATTERN=('local', 'global')", f'LAYER_KINDS={KINDS!r}', 'PERCORE_BATCH_SIZE=1']
EXP = 'paxcli.models.LmExperiment'


def _ids(b=2, l=12, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 32, (b, l)), jnp.int32)


def _params(model, ids):
  return engine.unbox(model.init(jax.random.key(0), ids)['params'])


def _logits(model, params, ids):
  return np.asarray(jax.jit(lambda p, x: model.apply({'params': p}, x))(params, ids))


@pytest.fixture(scope='module')
def scanned():
  """The patterned LM scanned group by group, its weights, and a batch of ids."""
  model = instantiate(lm_config(**SETTINGS, scan_layers=True))
  ids = _ids(l=10)
  return model, _params(model, ids), ids


def test_scanned_groups_equal_an_unscanned_loop_of_the_same_layers(scanned):
  model, params, ids = scanned
  loop = instantiate(lm_config(**SETTINGS, scan_layers=False))
  stack = params['layers']
  # one scan over 2 groups, each a 'local' block then a 'global' block, each with its own weights
  assert sorted(stack) == ['block_0', 'block_1']
  assert stack['block_0']['attention']['key']['kernel'].shape == (2, 16, 1, 4)     # local: one kv head
  assert stack['block_1']['attention']['key']['kernel'].shape == (2, 16, 4, 4)     # global: four
  assert 'per_dim_scale' in stack['block_1']['attention'] and 'per_dim_scale' not in stack['block_0']['attention']
  assert stack['block_1']['mlp']['wi_0']['kernel'].shape == (2, 16, 24)
  # the same weights unstacked (layer i is block_<i % 2>, row i // 2) in an unscanned loop of 4 layers
  unrolled = {k: v for k, v in params.items() if k != 'layers'}
  unrolled.update(pattern.unstack(stack, 4, lambda x, row: x[row]))
  loop_shapes = jax.eval_shape(lambda r: engine.unbox(loop.init(r, ids)['params']), jax.random.key(0))
  assert jax.tree.map(lambda x: x.shape, unrolled) == jax.tree.map(lambda x: x.shape, loop_shapes)
  np.testing.assert_allclose(_logits(model, params, ids), _logits(loop, unrolled, ids), atol=2e-5)


def test_decoding_through_the_kv_cache_equals_the_full_forward_pass(scanned):
  model, params, ids = scanned
  full = _logits(model, params, ids)
  cache = model.init_cache(params, 2, 10)
  positions = jnp.broadcast_to(jnp.arange(10, dtype=jnp.int32)[None], (2, 10))
  extend = jax.jit(model.extend)
  logits, cache = extend(params, cache, ids[:, :6], positions[:, :6])           # prefill
  steps = [np.asarray(logits)]
  for t in range(6, 10):                                                        # then one token at a time
    logits, cache = extend(params, cache, ids[:, t:t + 1], positions[:, t:t + 1])
    steps.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=2e-5)


def test_training_flops_count_each_kind_with_its_own_settings(scanned):
  patterned = scanned[0].train_flops(16)
  halves = []
  for kind in ('local', 'global'):
    own = {k.lower(): v for k, v in KINDS[kind].items()}
    own['per_dim_scale'] = own.pop('use_per_dim_scale', False)
    uniform = {k: v for k, v in SETTINGS.items() if k not in ('layer_pattern', 'layer_kinds')}
    uniform.update(num_layers=2, **{k: v for k, v in own.items() if k in ('num_kv_heads', 'hidden_dims')})
    halves.append(instantiate(lm_config(**uniform)).train_flops(16))
  head = 16 * 32
  assert patterned.matmul_params == halves[0].matmul_params + halves[1].matmul_params - head
  assert patterned.attention_per_token == halves[0].attention_per_token + halves[1].attention_per_token


def test_pipeline_stages_hold_whole_groups_and_compute_the_unpipelined_loss():
  base = SETS + ['USE_REPEATED_LAYER=True', 'PERCORE_BATCH_SIZE=2']
  reference = engine.build(config.resolve(EXP, base + ['ICI_MESH_SHAPE=[1,4,2]']))
  params = jax.device_get(engine.init_state(reference, 0)['params'])
  rng = np.random.default_rng(1)
  batch = {'ids': rng.integers(0, 32, (16, 8)).astype(np.int32), 'labels': rng.integers(0, 32, (16, 8)).astype(np.int32),
           'weights': np.ones((16, 8), np.float32)}

  def loss_and_grads(setup):
    def loss(p):
      with setup.activation_sharding():
        return setup.model.apply({'params': p}, batch, method='fprop')[0]
    fn = jax.jit(jax.value_and_grad(loss), in_shardings=(setup.state_shardings['params'],))
    return jax.device_get(fn(jax.device_put(params, setup.state_shardings['params'])))

  piped = engine.build(config.resolve(EXP, base + ['NUM_STAGES=2', 'ICI_MESH_SHAPE=[2,1,2,2]']))
  assert piped.state_shardings['params']['layers']['block_0']['attention']['query']['kernel'].spec[0] == 'stage'
  (want, want_grads), (got, got_grads) = loss_and_grads(reference), loss_and_grads(piped)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize('sets, message', [
    (['NUM_LAYERS=3'], "NUM_LAYERS 3 is not a multiple of the 2 kinds of LAYER_PATTERN ('local', 'global')"),
    (['USE_REPEATED_LAYER=True', 'NUM_STAGES=4', 'ICI_MESH_SHAPE=[4,1,2,1]'], 'a stage would cut a group'),
    (["LAYER_KINDS={'locl': {'NUM_KV_HEADS': 1}}"], "LAYER_KINDS names 'locl', which LAYER_PATTERN"),
    (["LAYER_KINDS={'local': {'VOCAB_SIZE': 8}}"], "sets VOCAB_SIZE, which is not a per-layer knob"),
    (["LAYER_KINDS={'local': {'NUM_KV_HEADS': 3}}"], "LAYER_KINDS['local']: NUM_HEADS 4 must be a multiple of NUM_KV"),
])
def test_a_pattern_that_cannot_work_is_one_line_before_any_compile(sets, message, tmp_path, capsys):
  code, _, err = pax_main(['train', '--exp', EXP, *[a for s in SETS + sets for a in ('--set', s)],
                           '--job-log-dir', str(tmp_path / 'job')], capsys)
  assert code == 2 and message in err and 'Traceback' not in err, err
  assert not (tmp_path / 'job' / 'checkpoints').exists()


def _run(argv, capsys) -> str:
  code, out, err = pax_main(argv, capsys)
  assert code == 0, err
  return out


def _sets(*extra) -> list:
  return [a for s in SETS + list(extra) for a in ('--set', s)]


def _decoded(path, layout, capsys) -> list:
  """Beam search (its KV cache's rows move between beams) on two prompts of the job at `path`."""
  out = _run(['decode', '--exp', EXP, *_sets(layout), '--job-log-dir', path, '--prompt-ids', '3,5,7,9',
              '--prompt-ids', '4,6', '--beam-size', '2', '--max-decode-steps', '4', '--ignore-eos', '--json'], capsys)
  return [(r['beam_rank'], r['decoded_ids']) for r in map(json.loads, out.strip().splitlines())]


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A patterned job trained one step in the scanned layout, and its conversion to the unscanned one."""
  import paxcli
  root = tmp_path_factory.mktemp('pattern')
  job, unscanned = str(root / 'job'), str(root / 'unscanned')
  scanned = SETS + ['USE_REPEATED_LAYER=True']
  paxcli.train(EXP, overrides=scanned + ['NUM_TRAIN_STEPS=1', 'SAVE_INTERVAL_STEPS=1'], job_dir=job)
  result = paxcli.convert_checkpoint(job, unscanned, exp=EXP, overrides=scanned + ['USE_REPEATED_LAYER=False'])
  assert result['verify']['ok'] and result['verify']['max_abs_diff'] < 1e-4   # the same logits
  return job, unscanned


def test_a_trained_patterned_job_converts_to_the_unscanned_layout_and_decodes(trained, capsys):
  job, unscanned = trained
  from paxcli.convert import formats
  a, b = formats.open_source(job), formats.open_source(unscanned)
  assert a.step == b.step == 1
  np.testing.assert_array_equal(a.read('params/layers/block_1/attention/per_dim_scale')[1],
                                b.read('params/layer_3/attention/per_dim_scale'))    # layer 3: group 1, global
  np.testing.assert_array_equal(a.read('params/layers/block_0/attention/key/kernel')[1],
                                b.read('params/layer_2/attention/key/kernel'))       # layer 2: group 1, local
  ids = _decoded(unscanned, 'USE_REPEATED_LAYER=False', capsys)
  assert [rank for rank, _ in ids] == [0, 1, 0, 1] and all(len(x) == 4 for _, x in ids)


@pytest.mark.slow
def test_both_layouts_evaluate_and_decode_the_same(trained, capsys):
  job, unscanned = trained

  def eval_loss(path, layout):
    out = _run(['eval', '--exp', EXP, *_sets(layout), '--job-log-dir', path, '--json'], capsys)
    return json.loads(out.strip().splitlines()[-1])['results']['eval']['loss']
  assert eval_loss(unscanned, 'USE_REPEATED_LAYER=False') == pytest.approx(
      eval_loss(job, 'USE_REPEATED_LAYER=True'), rel=1e-5)
  assert _decoded(unscanned, 'USE_REPEATED_LAYER=False', capsys) == _decoded(job, 'USE_REPEATED_LAYER=True', capsys)


def test_the_uniform_stack_keeps_its_layout():
  """No pattern, or a one-kind pattern: the scanned weights stay `layers/...` [L, ...] (today's checkpoints)."""
  for extra in ({}, {'layer_pattern': ('dense',), 'layer_kinds': {'dense': {'NUM_KV_HEADS': 2}}}):
    base = {k: v for k, v in SETTINGS.items() if k not in ('layer_pattern', 'layer_kinds')}
    model = instantiate(lm_config(**base, **extra, scan_layers=True))
    params = jax.eval_shape(lambda r: _params(model, _ids()), jax.random.key(0))
    assert 'block_0' not in params['layers'] and params['layers']['attention']['query']['kernel'].shape[0] == 4


def test_unscanned_patterned_layers_initialise_through_their_scanned_twin():
  """Initialising N unrolled layers compiles N initialisers; the engine builds the scanned twin (one per
  kind) and unstacks it: with a pattern too, the twin's layers land on the unrolled ones."""
  setup = engine.build(config.resolve(EXP, SETS + ['USE_REPEATED_LAYER=False']))
  init = engine._init_through_scan(setup)
  assert init is not None
  state = jax.eval_shape(init, jax.random.key(0))
  assert state['params']['layer_2']['attention']['key']['kernel'].shape == (16, 1, 4)     # local
  assert 'per_dim_scale' in state['params']['layer_3']['attention']                       # global
