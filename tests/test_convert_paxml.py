"""`pax checkpoint convert --from paxml`: real paxml 1.4.0 checkpoints reproduce paxml's logits.

The fixtures in tests/fixtures/paxml were written by paxml itself (make_fixture.py there,
run with the peer install of paxml 1.4.0); `logits.npy` is what praxis computed from each
checkpoint on `batch.npy`. No paxml is needed here. Tolerance: max |Δ logits| <= 1e-4
(float32 on CPU; measured about 2e-6 with logits up to 7).
"""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import pax_main, pax_main_ok as _ok

FIXTURES = os.path.join(os.path.dirname(__file__), 'fixtures', 'paxml')
STEP_DIR = 'checkpoints/checkpoint_00000004'
TOLERANCE = 1e-4

# What a Pax user writes for lm_cloud's LmCloudSpmd at this size (the `--exp my.PaxExp`).
RECIPE = '''
from paxcli.experiment import register
from paxcli.models import LmExperiment


@register
class TinyLmCloud(LmExperiment):
  NUM_LAYERS = 2
  MODEL_DIMS = 32
  HIDDEN_DIMS = 64
  NUM_HEADS = 4
  DIMS_PER_HEAD = 8
  VOCAB_SIZE = 64
  MAX_SEQ_LEN = 16
  PERCORE_BATCH_SIZE = 1
  USE_REPEATED_LAYER = {scan}
  POSITION_EMBEDDING = 'sinusoidal'
  SCALE_EMBEDDING_SQRT_DEPTH = True
  USE_SOFTMAX_BIAS = True
  SOFTMAX_CAP_LOGITS = {cap}
  ATTEN_LOGIT_CAP = 50.0
  USE_PER_DIM_SCALE = True
  USE_ATTENTION_BIAS = False
'''


def _fixture(name):
  return os.path.join(FIXTURES, name, STEP_DIR)


def _paxml_logits(name):
  return np.load(os.path.join(FIXTURES, 'batch.npy')), np.load(os.path.join(FIXTURES, name, 'logits.npy'))


def _recipe(tmp_path, scan=False, cap=30.0):
  path = tmp_path / f'my_pax_{int(scan)}_{int(cap)}.py'
  path.write_text(RECIPE.format(scan=scan, cap=cap))
  return f'{path}:TinyLmCloud'


def _logits_of_output(out, exp):
  """Logits of a converted checkpoint, read back from disk with the target experiment's model."""
  from paxcli import config
  from paxcli.convert import core, formats
  src = formats.open_source(out)
  params = core.load_params(src, [a.name for a in src.arrays()])
  model = core.build_model(config.resolve(exp, [])).module
  ids, _ = _paxml_logits('repeated')
  return core.logits(model, params, ids), params


def test_repeated_lm_cloud_checkpoint_converts_to_the_same_function(tmp_path, capsys):
  """The issue's command; the unrolled layout is covered in-process below (repeated -> layer_<i>)."""
  scan = True
  out_dir = str(tmp_path / 'px')
  exp = _recipe(tmp_path, scan=scan)
  out, err = _ok(['checkpoint', 'convert', _fixture('repeated'), out_dir, '--from', 'paxml', '--exp', exp,
                  '--json'], capsys)
  result = json.loads(out)
  assert result['step'] == 4 and result['params_only'] and result['verify']['ok']
  got, params = _logits_of_output(out_dir, exp)
  _, want = _paxml_logits('repeated')
  assert np.abs(got - want).max() <= TOLERANCE
  # the layout asked for, whatever Pax's was (Pax: StackedTransformerRepeated)
  assert ('layers' in params) == scan and ('layer_1' in params) == (not scan)


def _paxcli_model(knobs, scan, **overrides):
  """The paxcli model of a checkpoint's knobs (every LM knob; the layout asked for)."""
  from paxcli.layers.base import instantiate
  from paxcli.models import lm_config
  from paxcli.models.knobs import LM_KNOBS, flat_settings
  values = {**knobs, 'MAX_SEQ_LEN': 16, 'USE_REPEATED_LAYER': scan, 'CHECKPOINT_POLICY': 'none', **overrides}
  return instantiate(lm_config(**flat_settings(values, LM_KNOBS)))


def _converted_logits(name, scan, with_dropped=False, **overrides):
  """(logits, params, knobs) of a fixture converted in-process; with_dropped: and the MoE layers'
  dropped_fraction summaries."""
  from paxcli.convert import core, paxml
  src = paxml.PaxmlSource(_fixture(name))
  knobs = src.knobs()
  assert knobs.pop('UNSUPPORTED_FEATURES') == {}
  model = _paxcli_model(knobs, scan, **overrides)
  view = src.paxcli_view(model)
  params = core.load_params(view, [a.name for a in view.arrays()])
  ids, _ = _paxml_logits(name)
  logits, state = model.apply({'params': params}, jnp.asarray(ids), mutable=['summaries'])
  dropped = [float(np.max(v)) for p, v in _flat(state) if p.endswith('dropped_fraction')]
  return (np.asarray(logits), params, knobs) + ((dropped,) if with_dropped else ())


def _flat(tree, prefix=''):
  for k, v in tree.items():
    if hasattr(v, 'items'):
      yield from _flat(v, f'{prefix}{k}/')
    else:
      yield f'{prefix}{k}', v


@pytest.mark.parametrize('name,scan', [('stacked', True), ('gpt3', False), ('repeated', False),
                                       ('qk_primer', False), ('qk_post', True)])
def test_each_fixture_reproduces_paxml_logits(name, scan):
  """stacked: separate Q/K/V, gated SiLU; gpt3: learned positions, attention biases, LN eps 1e-5;
  qk_primer: QK norm (x (1 + scale)) after rotary, norms before and after each sub-layer; qk_post:
  QK norm (direct scale), norms after each sub-layer only."""
  got, params, knobs = _converted_logits(name, scan)
  _, want = _paxml_logits(name)
  assert np.abs(got - want).max() <= TOLERANCE
  # Training moved every weight off its initial value, so the mappings above are exercised:
  # praxis LayerNorm scales (stored as scale - 1) and per-dim scales (initially 0) are not trivial.
  layer = params['layers' if scan else 'layer_0']
  norm = 'attention_norm' if knobs.get('PRE_NORMS', True) else 'post_attention_norm'
  assert np.abs(np.asarray(layer[norm]['scale']) - 1).mean() > 1e-2
  if knobs['USE_PER_DIM_SCALE']:
    assert np.abs(np.asarray(layer['attention']['per_dim_scale'])).mean() > 1e-2
  if knobs.get('USE_QK_NORM'):
    assert np.abs(np.asarray(layer['attention']['query_norm']['scale']) - 1).mean() > 1e-2


@pytest.mark.parametrize('name', ['qk_primer', 'qk_post'])
def test_praxis_layer_variants_need_their_knobs(name):
  """Each knob the praxis variants set changes the function (so the fixtures exercise them): QK norm
  before rotary (Qwen 3's order), or paxcli's pre-norm block, is far from praxis' logits."""
  _, want = _paxml_logits(name)
  got, _, knobs = _converted_logits(name, False, QK_NORM_AFTER_ROTARY=False)
  assert np.abs(got - want).max() > 1e-2
  assert knobs['POST_NORMS'] and knobs.get('PRE_NORMS', True) == (name == 'qk_primer')
  from paxcli.convert import paxml
  src = paxml.PaxmlSource(_fixture(name))
  view_of_prenorm = _paxcli_model(knobs, False, POST_NORMS=False, PRE_NORMS=True)
  with pytest.raises(Exception, match='no place in the paxcli model|no Pax array maps'):
    src.paxcli_view(view_of_prenorm)


def test_fixture_features_are_the_ones_claimed():
  from paxcli.convert import paxml
  k = {n: paxml.PaxmlSource(_fixture(n)).knobs() for n in ('repeated', 'stacked', 'gpt3')}
  assert (k['repeated']['POSITION_EMBEDDING'], k['repeated']['SOFTMAX_CAP_LOGITS'],
          k['repeated']['ATTEN_LOGIT_CAP'], k['repeated']['USE_PER_DIM_SCALE']) == ('sinusoidal', 30.0, 50.0, True)
  assert paxml.PaxmlSource(_fixture('repeated')).pax().combine_qkv
  assert not paxml.PaxmlSource(_fixture('stacked')).pax().combine_qkv
  assert k['stacked']['USE_GATED_ACTIVATION'] and k['stacked']['ACTIVATION'] == 'silu'
  assert (k['gpt3']['POSITION_EMBEDDING'], k['gpt3']['USE_ATTENTION_BIAS'], k['gpt3']['NORM_EPSILON'],
          k['gpt3']['USE_PER_DIM_SCALE'], k['gpt3']['SOFTMAX_CAP_LOGITS']) == ('learned', True, 1e-5, False, 0.0)


def test_inspect_lists_paxml_arrays(capsys):
  out, _ = _ok(['checkpoint', 'inspect', _fixture('repeated'), '--json'], capsys)
  info = json.loads(out)
  assert info['format'] == 'paxml' and info['step'] == 4
  by_name = {a['name']: a for a in info['arrays']}
  qkv = by_name['mdl_vars.params.lm.transformer.repeat.sub.x_layers_0.self_attention.combined_qkv.w']
  assert qkv['shape'] == [2, 3, 32, 4, 8] and qkv['dtype'] == 'float32' and qkv['bytes'] == 2 * 3 * 32 * 4 * 8 * 4
  assert 'mdl' in qkv['sharding']
  assert any(n.startswith('opt_states') for n in by_name)
  params = [a for a in info['arrays'] if a['name'].startswith('mdl_vars.')]
  assert info['totals']['parameters'] == sum(int(np.prod(a['shape'])) for a in params)
  assert info['config']['knobs.SOFTMAX_CAP_LOGITS'] == 30.0 and info['config']['knobs.USE_REPEATED_LAYER']
  out, _ = _ok(['checkpoint', 'inspect', os.path.join(FIXTURES, 'stacked')], capsys)   # the job directory
  assert 'x_layers_1.self_attention.query.w' in out and 'POSITION_EMBEDDING' in out


def test_without_exp_writes_a_recipe_that_computes_the_same(tmp_path, capsys):
  out_dir = str(tmp_path / 'gpt3px')
  _ok(['checkpoint', 'convert', _fixture('gpt3'), out_dir, '--from', 'paxml'], capsys)
  recipe = tmp_path / 'gpt3px' / 'recipe.py'   # kept in the job, nothing written beside it
  assert not list(tmp_path.glob('*.py'))
  text = recipe.read_text()
  assert "POSITION_EMBEDDING = 'learned'" in text and 'NORM_EPSILON = 1e-05' in text
  assert 'MAX_SEQ_LEN = 16' in text and 'USE_REPEATED_LAYER = True' in text   # Pax's input and layout
  got, _ = _logits_of_output(out_dir, f'{recipe}:PaxLm')
  _, want = _paxml_logits('gpt3')
  assert np.abs(got - want).max() <= TOLERANCE


@pytest.mark.parametrize('name', ['qk_primer', 'qk_post'])
def test_praxis_qk_norm_and_post_norm_convert_to_a_recipe(name, tmp_path, capsys, monkeypatch):
  """The user's command from a fresh shell (relative paths): the recipe it writes holds praxis'
  layer as knobs and computes praxis' logits."""
  monkeypatch.chdir(tmp_path)
  shutil.copytree(os.path.join(FIXTURES, name), 'job')
  _ok(['checkpoint', 'convert', 'job', 'out', '--from', 'paxml'], capsys)
  recipe = tmp_path / 'out' / 'recipe.py'
  text = recipe.read_text()
  assert 'USE_QK_NORM = True' in text and 'QK_NORM_AFTER_ROTARY = True' in text and 'POST_NORMS = True' in text
  assert ('PRE_NORMS = False' in text) == (name == 'qk_post') and 'UNSUPPORTED_FEATURES = {}' in text
  got, _ = _logits_of_output(str(tmp_path / 'out'), f'{recipe}:PaxLm')
  _, want = _paxml_logits(name)
  assert np.abs(got - want).max() <= TOLERANCE


def test_an_experiment_of_another_function_is_refused(tmp_path, capsys):
  code, _, err = pax_main(['checkpoint', 'convert', _fixture('repeated'), str(tmp_path / 'o'), '--from', 'paxml',
                           '--exp', _recipe(tmp_path, cap=0.0)], capsys)
  assert code != 0 and 'SOFTMAX_CAP_LOGITS = 0.0, the checkpoint needs 30.0' in err
  assert 'Traceback' not in err and not os.path.exists(tmp_path / 'o')


def _copy(tmp_path, name='repeated'):
  job = tmp_path / 'job'
  shutil.copytree(os.path.join(FIXTURES, name), job)
  return job


def test_unsupported_pax_features_are_named_not_converted(tmp_path, capsys):
  """praxis' 'post_skip' (the norm after the residual sum, the original Transformer's) has no knob."""
  job = _copy(tmp_path)
  cfg = job / 'model_params.txt'
  cfg.write_text(cfg.read_text().replace("transformer_layer_params_tpl.norm_policy : 'pre'",
                                         "transformer_layer_params_tpl.norm_policy : 'post_skip'"))
  code, _, err = pax_main(['checkpoint', 'convert', str(job / STEP_DIR), str(tmp_path / 'o'), '--from', 'paxml',
                           '--exp', _recipe(tmp_path)], capsys)
  assert code != 0 and 'norm_policy post_skip' in err and 'UNSUPPORTED_FEATURES' in err
  from paxcli.convert import paxml
  assert 'norm_policy post_skip' in paxml.PaxmlSource(str(job)).knobs()['UNSUPPORTED_FEATURES']


def test_a_layernorm_qk_norm_is_named_not_converted(tmp_path):
  job = _copy(tmp_path, 'qk_post')
  cfg = job / 'model_params.txt'
  cfg.write_text(cfg.read_text().replace('tr_atten_tpl.ln_tpl.cls : type/praxis.layers.normalizations/RmsNorm',
                                         'tr_atten_tpl.ln_tpl.cls : type/praxis.layers.normalizations/LayerNorm'))
  from paxcli.convert import paxml
  knobs = paxml.PaxmlSource(str(job)).knobs()
  assert 'LayerNorm' in knobs['UNSUPPORTED_FEATURES']['QK norm'] and not knobs.get('USE_QK_NORM')


@pytest.mark.parametrize('case', ['no_config', 'no_step', 'stray_array'])
def test_paxml_errors(case, tmp_path, capsys):
  job = _copy(tmp_path)
  argv = ['checkpoint', 'convert', str(job), str(tmp_path / 'o'), '--from', 'paxml', '--exp', _recipe(tmp_path)]
  if case == 'no_config':
    os.remove(job / 'model_params.txt')
    want = 'model_params.txt'
  elif case == 'no_step':
    argv += ['--step', '7']
    want = 'No checkpoint of step 7'
  else:   # an array of a layer paxcli does not have (e.g. a relative-bias table)
    state = job / STEP_DIR / 'state'
    shutil.copytree(state / 'mdl_vars.params.lm.final_ln.bias', state / 'mdl_vars.params.lm.relative_bias.wrb')
    want = 'relative_bias.wrb: [32] has no place in the paxcli model'
  code, _, err = pax_main(argv, capsys)
  assert code != 0 and want in err and 'Traceback' not in err


# ---- praxis' mixture of experts (GShard: StackedTransformer num_experts / moe_layers, TransformerFeedForwardMoe) ----


@pytest.mark.parametrize('name,scan', [('moe', True), ('moe', False), ('moe_capacity', False)])
def test_praxis_moe_reproduces_paxml_logits(name, scan):
  """moe: layer 1 of 2 a mixture of experts (a LAYER_PATTERN ('dense', 'moe'); gated SiLU experts of 48 units,
  narrower than the dense MLP) at a capacity factor that never drops (dropless); moe_capacity: every layer MoE,
  praxis' default capacity factor 2.0 in 4 routing groups of half a sequence, where praxis drops tokens: paxcli drops the same."""
  got, params, knobs, dropped = _converted_logits(name, scan, with_dropped=True)
  _, want = _paxml_logits(name)
  assert np.abs(got - want).max() <= TOLERANCE
  if name == 'moe':
    kind = knobs['LAYER_KINDS']['moe']
    assert knobs['LAYER_PATTERN'] == ('dense', 'moe') and 'NUM_EXPERTS' not in knobs
    assert (kind['NUM_EXPERTS'], kind['EXPERTS_PER_TOKEN'], kind['HIDDEN_DIMS'], kind['MOE_DISPATCH']) == \
        (4, 2, 48, 'dropless')
    mlp = params['layers']['block_1']['mlp'] if scan else params['layer_1']['mlp']
    assert 'wi_1' in mlp and mlp['wi_0'].shape[-1] == 48 and not np.any(np.asarray(mlp['bo']))
    assert dropped == [0.0]
  else:
    assert (knobs['MOE_DISPATCH'], knobs['EXPERT_CAPACITY_RULE'], knobs['MOE_GROUPS'],
            knobs['EXPERT_CAPACITY_FACTOR']) == ('capacity', 'praxis', 4, 2.0)
    assert len(dropped) == 2 and min(dropped) > 0.1   # the capacity semantics are exercised
  # Training moved the router off its initial value in each MoE layer.
  router = params['layer_1']['mlp']['router'] if not scan else params['layers']['block_1']['mlp']['router']
  assert np.abs(np.asarray(router)).mean() > 1e-2


@pytest.mark.parametrize('name,overrides', [
    ('moe_capacity', {'MOE_GROUPS': 0}),                            # a group per sequence, not praxis' 4 of 8 tokens
    ('moe_capacity', {'EXPERT_CAPACITY_RULE': 'paxcli'}),           # ceil(2.0 x 8 x 2 / 4) = 8 slots, not 4
    ('moe', {'LAYER_KINDS': {'moe': {'NUM_EXPERTS': 4, 'HIDDEN_DIMS': 48, 'ROUTER_SOFTMAX': 'after_topk',
                                     'ROUTER_NORMALIZE_TOPK': False, 'EXPERTS_PER_TOKEN': 1}}}),   # top-1
])
def test_praxis_moe_needs_its_knobs(name, overrides):
  """Each knob the conversion sets changes the function: paxcli's own capacity grouping or rule, or another
  routing, is far from praxis' logits."""
  got, _, _ = _converted_logits(name, False, **overrides)
  _, want = _paxml_logits(name)
  assert np.abs(got - want).max() > 1e-3


def _convert_moe_from_a_fresh_shell(tmp_path, capsys, monkeypatch):
  """The user's command (relative paths, no --exp): the recipe kept in the job."""
  monkeypatch.chdir(tmp_path)
  shutil.copytree(os.path.join(FIXTURES, 'moe_capacity'), 'old_pax_job')
  _ok(['checkpoint', 'convert', 'old_pax_job', 'out/px', '--from', 'paxml'], capsys)
  return tmp_path / 'out' / 'px' / 'recipe.py'


def test_praxis_moe_converts_to_a_recipe(tmp_path, capsys, monkeypatch):
  """The recipe holds praxis' routing as knobs, and its model computes praxis' logits from the converted job."""
  recipe = _convert_moe_from_a_fresh_shell(tmp_path, capsys, monkeypatch)
  text = recipe.read_text()
  assert "MOE_DISPATCH = 'capacity'" in text and 'MOE_GROUPS = 4' in text and 'UNSUPPORTED_FEATURES = {}' in text
  assert "EXPERT_CAPACITY_RULE = 'praxis'" in text and 'NUM_EXPERTS = 4' in text
  got, _ = _logits_of_output(str(tmp_path / 'out' / 'px'), f'{recipe}:PaxLm')
  _, want = _paxml_logits('moe_capacity')
  assert np.abs(got - want).max() <= TOLERANCE


@pytest.mark.slow
def test_praxis_moe_converted_job_evaluates_and_decodes(tmp_path, capsys, monkeypatch):
  """pax eval and pax decode (KV cache) on the converted job, as a user runs them next."""
  _convert_moe_from_a_fresh_shell(tmp_path, capsys, monkeypatch)
  exp = 'out/px/recipe.py:PaxLm'
  out, _ = _ok(['eval', '--exp', exp, '--job-log-dir', 'out/px', '--json'], capsys)
  result = json.loads(out.strip().splitlines()[-1])
  assert result['step'] == 4 and 0 < result['results']['eval']['loss'] < 10
  out, _ = _ok(['decode', '--exp', exp, '--job-log-dir', 'out/px', '--prompt-ids', '3,5,7', '--max-decode-steps', '4',
                '--json'], capsys)
  line = json.loads(out.strip().splitlines()[-1])
  assert line['num_decoded_tokens'] == 4 and all(0 <= t < 64 for t in line['decoded_ids'])


@pytest.mark.parametrize('field,value,feature', [
    ("moe_layer_tpl.second_expert_policy : 'all'", "moe_layer_tpl.second_expert_policy : 'sampling'",
     'MoE second expert'),
    ('moe_layer_tpl.gating_logit_cap : 0.0', 'moe_layer_tpl.gating_logit_cap : 10.0', 'MoE gating logit cap'),
    ("stacked_transformer_tpl.gating_func : 'top2'", "stacked_transformer_tpl.gating_func : 'expert_choice'",
     'MoE gating'),
])
def test_praxis_moe_gating_paxcli_lacks_is_refused(field, value, feature, tmp_path, capsys):
  """A routing paxcli cannot follow (a sampled second expert, capped router logits, expert-choice gating) is
  refused in one line naming praxis' field, and listed for a recipe written without --exp."""
  job = _copy(tmp_path, 'moe')
  cfg = job / 'model_params.txt'
  assert field in cfg.read_text()
  cfg.write_text(cfg.read_text().replace(field, value))
  from paxcli.convert import paxml
  knobs = paxml.PaxmlSource(str(job)).knobs()
  recipe = tmp_path / 'pax_moe.py'
  recipe.write_text(_moe_recipe(knobs))
  code, _, err = pax_main(['checkpoint', 'convert', str(job), str(tmp_path / 'o'), '--from', 'paxml', '--exp',
                           f'{recipe}:PaxMoe'], capsys)
  praxis_key = value.split(' : ')[0]
  assert code != 0 and feature in err and praxis_key in err and 'Traceback' not in err
  assert len(err.strip().splitlines()) == 1 and not os.path.exists(tmp_path / 'o')
  assert feature in knobs['UNSUPPORTED_FEATURES']


def _moe_recipe(knobs):
  """A recipe of the knobs the checkpoint needs (the unsupported features not accepted)."""
  lines = ['from paxcli.experiment import register', 'from paxcli.models import LmExperiment', '', '',
           '@register', 'class PaxMoe(LmExperiment):', '  MAX_SEQ_LEN = 16']
  lines += [f'  {k} = {v!r}' for k, v in knobs.items() if k != 'UNSUPPORTED_FEATURES']
  return '\n'.join(lines) + '\n'


def test_a_praxis_aqt_trained_checkpoint_converts_to_an_aqt_recipe():
  """praxis 1.4's quantized layers in training mode (quantize.for_transformer, AQT, int8 weights and activations)
  write float weights under the float layers' names: the conversion reads them, and the recipe trains on as
  AQT='int8'. praxis' logits (of its own int8 products) against paxcli's, with AQT and without, within 1% of
  their scale (measured 0.40% and 0.45%: the two int8 schemes round alike up to their scales' details)."""
  from paxcli.convert import paxml
  knobs = paxml.PaxmlSource(_fixture('aqt')).knobs()
  assert knobs['AQT'] == 'int8'
  _, want = _paxml_logits('aqt')
  scale = np.abs(want).max()
  quantized, _, _ = _converted_logits('aqt', False)
  floats, _, _ = _converted_logits('aqt', False, AQT='none')
  assert np.abs(quantized - want).max() <= 0.01 * scale and np.abs(floats - want).max() <= 0.01 * scale
  assert np.abs(quantized - floats).max() > 0   # AQT's products are int8
