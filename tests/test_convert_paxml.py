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

from conftest import pax_main

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


def _ok(argv, capsys):
  code, out, err = pax_main(argv, capsys)
  assert code == 0, err
  return out, err


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


@pytest.mark.parametrize('name,scan', [('stacked', True), ('gpt3', False), ('repeated', False)])
def test_each_fixture_reproduces_paxml_logits(name, scan):
  """stacked: separate Q/K/V, gated SiLU; gpt3: learned positions, attention biases, LN eps 1e-5."""
  from paxcli.convert import core, paxml
  from paxcli.layers.base import instantiate
  from paxcli.models import lm_config
  src = paxml.PaxmlSource(_fixture(name))
  knobs = src.knobs()
  assert knobs.pop('UNSUPPORTED_FEATURES') == {}
  settings = {k.lower(): v for k, v in knobs.items()}
  model = instantiate(lm_config(
      vocab_size=knobs['VOCAB_SIZE'], num_layers=knobs['NUM_LAYERS'], model_dims=knobs['MODEL_DIMS'],
      hidden_dims=knobs['HIDDEN_DIMS'], num_heads=knobs['NUM_HEADS'], num_kv_heads=knobs['NUM_HEADS'],
      dims_per_head=knobs['DIMS_PER_HEAD'], max_seq_len=16, activation=knobs['ACTIVATION'],
      use_gated_activation=knobs['USE_GATED_ACTIVATION'], norm_type=knobs['NORM_TYPE'],
      use_bias=knobs['USE_BIAS'], position_embedding=knobs['POSITION_EMBEDDING'],
      separate_embedding=knobs['SEPARATE_EMBEDDING'], scan_layers=scan, checkpoint_policy='none',
      scale_embedding_sqrt_depth=knobs['SCALE_EMBEDDING_SQRT_DEPTH'], softmax_bias=knobs['USE_SOFTMAX_BIAS'],
      softmax_cap_logits=settings['softmax_cap_logits'], atten_logit_cap=settings['atten_logit_cap'],
      per_dim_scale=knobs['USE_PER_DIM_SCALE'], attention_use_bias=knobs['USE_ATTENTION_BIAS'],
      norm_epsilon=knobs['NORM_EPSILON']))
  view = src.paxcli_view(model)
  params = core.load_params(view, [a.name for a in view.arrays()])
  ids, want = _paxml_logits(name)
  got = np.asarray(model.apply({'params': params}, jnp.asarray(ids)))
  assert np.abs(got - want).max() <= TOLERANCE
  # Training moved every weight off its initial value, so the mappings above are exercised:
  # praxis LayerNorm scales (stored as scale - 1) and per-dim scales (initially 0) are not trivial.
  layer = params['layers' if scan else 'layer_0']
  assert np.abs(np.asarray(layer['attention_norm']['scale']) - 1).mean() > 1e-2
  if knobs['USE_PER_DIM_SCALE']:
    assert np.abs(np.asarray(layer['attention']['per_dim_scale'])).mean() > 1e-2


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
  recipe = tmp_path / 'paxml_gpt3px.py'
  text = recipe.read_text()
  assert "POSITION_EMBEDDING = 'learned'" in text and 'NORM_EPSILON = 1e-05' in text
  assert 'MAX_SEQ_LEN = 16' in text and 'USE_REPEATED_LAYER = True' in text   # Pax's input and layout
  got, _ = _logits_of_output(out_dir, f'{recipe}:PaxLm')
  _, want = _paxml_logits('gpt3')
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
  job = _copy(tmp_path)
  cfg = job / 'model_params.txt'
  cfg.write_text(cfg.read_text().replace("transformer_layer_params_tpl.norm_policy : 'pre'",
                                         "transformer_layer_params_tpl.norm_policy : 'post'"))
  code, _, err = pax_main(['checkpoint', 'convert', str(job / STEP_DIR), str(tmp_path / 'o'), '--from', 'paxml',
                           '--exp', _recipe(tmp_path)], capsys)
  assert code != 0 and 'post-norm' in err and 'UNSUPPORTED_FEATURES' in err
  from paxcli.convert import paxml
  assert 'post-norm' in paxml.PaxmlSource(str(job)).knobs()['UNSUPPORTED_FEATURES']


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
