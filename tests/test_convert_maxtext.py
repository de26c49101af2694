"""`pax checkpoint convert --from maxtext`: real MaxText checkpoints reproduce MaxText's logits.

The fixtures in tests/fixtures/maxtext_ckpt were written by MaxText itself on CPU
(make_fixtures.py and README.md there: the commit, the commands); each `run.sh` is the MaxText
command that trained it, `run/checkpoints/<step>/items` MaxText's checkpoint and `logits.npy`
what MaxText's own model computed from it on `ids.npy`. No MaxText is needed here. The user's
path: `pax import-maxtext run.sh` writes the recipe, `pax checkpoint convert --from maxtext`
converts the checkpoint into it. Tolerance: max |Δ logits| <= 1e-4 (float32 on CPU).
"""

import json
import os
import pathlib
import shutil

import numpy as np
import pytest

from conftest import pax_main, pax_main_ok as _ok

FIXTURES = os.path.join(os.path.dirname(__file__), 'fixtures', 'maxtext_ckpt')
NAMES = sorted(n for n in os.listdir(FIXTURES) if os.path.isfile(os.path.join(FIXTURES, n, 'logits.npy')))
TOLERANCE = 1e-4


def _recipe(name, tmp_path, capsys, *extra) -> str:
  path = str(tmp_path / f'maxtext_{name}.py')
  _ok(['import-maxtext', os.path.join(FIXTURES, name, 'run.sh'), '-o', path, '--class-name', 'Fixture', *extra],
      capsys)
  return f'{path}:Fixture'


def _logits_of_output(out, exp):
  """Logits of a converted checkpoint, read back from disk with the recipe's model."""
  from paxcli import config
  from paxcli.convert import core, formats
  src = formats.open_source(out)
  params = core.load_params(src, [a.name for a in src.arrays()])
  model = core.build_model(config.resolve(exp, [])).module
  return core.logits(model, params, np.load(os.path.join(FIXTURES, 'ids.npy'))), params


@pytest.mark.parametrize('name', NAMES)
def test_fixture_converts_to_maxtexts_logits(name, tmp_path, capsys):
  """Scanned and unscanned layers, llama2 and default (parallel) blocks, tied and untied logits."""
  exp = _recipe(name, tmp_path, capsys)
  out_dir = str(tmp_path / 'px')
  out, _ = _ok(['checkpoint', 'convert', os.path.join(FIXTURES, name, 'run'), out_dir, '--from', 'maxtext',
                '--exp', exp, '--json'], capsys)
  result = json.loads(out)
  assert result['step'] == 1 and result['params_only'] and result['verify']['ok']
  got, params = _logits_of_output(out_dir, exp)
  want = np.load(os.path.join(FIXTURES, name, 'logits.npy'))
  assert got.shape == want.shape and np.abs(got - want).max() <= TOLERANCE
  scanned = 'unscanned' not in name
  assert ('layers' in params) == scanned and ('layer_1' in params) == (not scanned)   # the recipe's layout


def test_layout_changes_with_the_recipe(tmp_path, capsys):
  """A scanned MaxText checkpoint into an unrolled recipe (and back): the same function."""
  name = 'llama2_scanned'
  exp = _recipe(name, tmp_path, capsys)
  out_dir = str(tmp_path / 'px')
  _ok(['checkpoint', 'convert', os.path.join(FIXTURES, name, 'run', 'checkpoints', '1'), out_dir, '--from',
       'maxtext', '--exp', exp, '--set', 'USE_REPEATED_LAYER=False'], capsys)
  from paxcli.convert import formats
  src = formats.open_source(out_dir)
  assert 'params/layer_1/attention/query/kernel' in {a.name for a in src.arrays()}


def test_inspect_lists_maxtext_arrays(capsys):
  out, _ = _ok(['checkpoint', 'inspect', os.path.join(FIXTURES, 'llama2_unscanned', 'run'), '--json'], capsys)
  info = json.loads(out)
  names = {a['name'] for a in info['arrays']}
  assert info['format'] == 'maxtext' and info['step'] == 1
  assert 'params/params/decoder/layers_1/self_attention/query/kernel' in names
  assert info['totals']['parameters'] < sum(a['bytes'] for a in info['arrays']) // 4   # optimizer state beside


def test_without_exp_says_which_recipe(tmp_path, capsys):
  code, _, err = pax_main(['checkpoint', 'convert', os.path.join(FIXTURES, 'llama2_scanned', 'run'),
                           str(tmp_path / 'o'), '--from', 'maxtext'], capsys)
  assert code != 0 and 'pax import-maxtext' in err and '--exp' in err and 'Traceback' not in err


def _convert_into_edited_recipe(name, old, new, tmp_path, capsys, *extra):
  """(exit code, stderr) of converting fixture `name` into the recipe of its run.sh with `old` -> `new`."""
  script = tmp_path / 'run.sh'
  script.write_text(pathlib.Path(FIXTURES, name, 'run.sh').read_text(encoding='utf-8').replace(old, new))
  recipe = str(tmp_path / 'r.py')
  _ok(['import-maxtext', str(script), '-o', recipe, '--class-name', 'Edited', '--force'], capsys)
  code, _, err = pax_main(['checkpoint', 'convert', os.path.join(FIXTURES, name, 'run'), str(tmp_path / 'o'),
                           '--from', 'maxtext', '--exp', f'{recipe}:Edited', '--no-verify', *extra], capsys)
  assert 'Traceback' not in err and os.path.exists(tmp_path / 'o') == (code == 0)
  return code, err


def test_a_run_paxcli_cannot_express_is_refused(tmp_path, capsys):
  """A script whose model paxcli does not build (here tied logits divided by sqrt(emb_dim)): the
  recipe names it in UNSUPPORTED_FEATURES and the conversion refuses, naming it."""
  code, err = _convert_into_edited_recipe('default_unscanned_tied', 'normalize_embedding_logits=false',
                                          'normalize_embedding_logits=true', tmp_path, capsys)
  assert code != 0 and 'normalize_embedding_logits' in err and 'UNSUPPORTED_FEATURES={}' in err
  code, err = _convert_into_edited_recipe('default_unscanned_tied', 'normalize_embedding_logits=false',
                                          'normalize_embedding_logits=true', tmp_path, capsys,
                                          '--set', 'UNSUPPORTED_FEATURES={}')   # the difference accepted
  assert code == 0, err


def test_a_recipe_of_another_block_is_refused(tmp_path, capsys):
  """The llama2 checkpoint into the recipe of the same script with the default (parallel) block: the
  llama2 layer's second norm has no place in it."""
  code, err = _convert_into_edited_recipe('llama2_scanned', 'decoder_block=llama2', 'decoder_block=default',
                                          tmp_path, capsys)
  assert code != 0 and 'params/layers/mlp_norm/scale: checkpoint [2, 16] -> not in the experiment' in err


def test_a_knob_maxtext_cannot_have_is_named(tmp_path, capsys):
  code, err = _convert_into_edited_recipe('llama2_unscanned', 'scan_layers=false', 'scan_layers=false', tmp_path,
                                          capsys, '--set', "NORM_TYPE='layernorm'")
  assert code != 0 and "NORM_TYPE = 'layernorm' (MaxText: 'rmsnorm')" in err


def test_unknown_maxtext_parameters_are_named(tmp_path, capsys):
  """A checkpoint with a parameter of a block paxcli does not build (here a query norm)."""
  run = tmp_path / 'run'
  shutil.copytree(os.path.join(FIXTURES, 'llama2_unscanned', 'run'), run)
  from paxcli.convert import maxtext
  src = maxtext.MaxTextSource(str(run))
  names = [a.name for a in src.arrays()]
  assert 'params/params/decoder/layers_0/pre_self_attention_layer_norm/scale' in names
  exp = _recipe('llama2_unscanned', tmp_path, capsys)
  _rename_leaf(str(run / 'checkpoints' / '1' / 'items'), 'layers_0', 'pre_self_attention_layer_norm',
               'query_norm')
  code, _, err = pax_main(['checkpoint', 'convert', str(run), str(tmp_path / 'o'), '--from', 'maxtext',
                           '--exp', exp], capsys)
  assert code != 0 and 'decoder/layers_0/query_norm/scale' in err and 'Traceback' not in err


def _rename_leaf(items: str, layer: str, old: str, new: str) -> None:
  """Rewrites a checkpoint so one parameter has another name (orbax restore, then save)."""
  import orbax.checkpoint as ocp
  tree = ocp.PyTreeCheckpointer().restore(items)
  layer_tree = tree['params']['params']['decoder'][layer]
  layer_tree[new] = layer_tree.pop(old)
  shutil.rmtree(items)
  ocp.PyTreeCheckpointer().save(items, tree)


def test_the_parallel_block_is_no_hugging_face_llama(tmp_path, capsys):
  exp = _recipe('default_unscanned_tied', tmp_path, capsys)
  code, _, err = pax_main(['checkpoint', 'convert', os.path.join(FIXTURES, 'default_unscanned_tied', 'run'),
                           str(tmp_path / 'hf'), '--from', 'maxtext', '--exp', exp, '--to', 'hf'], capsys)
  assert code != 0 and 'PARALLEL_BLOCK' in err and not os.path.exists(tmp_path / 'hf')


@pytest.mark.slow   # five models built (~22 s on the loaded 2-core machine)
def test_gemma2_pairs_unroll_and_each_gemma_knob_counts(tmp_path, capsys):
  """A MaxText gemma2 layer is a (local, global) pair: 2 MaxText layers are paxcli's layers 0-3, unrolled
  here (scanned, the parametrised test above). The recipe's Gemma knobs are each needed: without the
  attention or final soft cap, the local window or the bfloat16 tied logits, MaxText's logits are missed."""
  from paxcli import config
  from paxcli.convert import core
  name = 'gemma2_scanned'
  exp = _recipe(name, tmp_path, capsys)
  out_dir = str(tmp_path / 'px')
  _ok(['checkpoint', 'convert', os.path.join(FIXTURES, name, 'run'), out_dir, '--from', 'maxtext', '--exp', exp,
       '--set', 'USE_REPEATED_LAYER=False'], capsys)
  ids, want = np.load(os.path.join(FIXTURES, 'ids.npy')), np.load(os.path.join(FIXTURES, name, 'logits.npy'))
  from paxcli.convert import formats
  src = formats.open_source(out_dir)
  params = core.load_params(src, [a.name for a in src.arrays()])
  assert 'layer_3' in params and 'layer_4' not in params and 'post_mlp_norm' in params['layer_1']
  for change, same in (('USE_REPEATED_LAYER=False', True), ('ATTEN_LOGIT_CAP=0.0', False),
                       ('SOFTMAX_CAP_LOGITS=0.0', False), ('LAYER_KINDS={}', False), ('TIED_LOGITS_BFLOAT16=False', False)):
    model = core.build_model(config.resolve(exp, ['USE_REPEATED_LAYER=False', change])).module
    error = np.abs(core.logits(model, params, ids) - want).max()
    assert (error <= TOLERANCE) if same else (error > 1e-3), (change, error)
