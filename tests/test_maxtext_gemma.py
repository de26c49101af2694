"""`pax import-maxtext` of MaxText's gemma2 and gemma3 runs: recipes on the Gemma families.

MaxText's gemma2/gemma3 decoder blocks (MaxText models/gemma2.py, gemma3.py; configs/models/*.yml) are
the Gemma families' layers: a gemma2 decoder layer is a (local, global) pair, a gemma3 one a single
layer of five local to one global; soft caps, the local window, post-norms, Gemma 3's QK norm, query
scale and rope per kind come from the run's config. The fixture scripts are MaxText's own command lines
(tests/fixtures/maxtext/gemma*.sh).
"""

import json
import re
import types

import pytest

from conftest import pax_main
from maxtext_common import FIXTURES
from paxcli.models.gemma import GEMMA2
from paxcli.models.gemma3 import GEMMA3
from paxcli.models.knobs import LM_KNOBS, effective

SCRIPTS = {'gemma2': 'gemma2-9b-v6e.sh', 'gemma3': 'gemma3-4b.sh'}
FAMILIES = {'gemma2': GEMMA2, 'gemma3': GEMMA3}


def _translation(script, capsys):
  code, out, err = pax_main(['import-maxtext', str(script), '--dry-run', '--json'], capsys)
  assert code == 0, err
  return json.loads(out)


def _flat(knob_values):
  values = {k: tuple(v) if k == 'LAYER_PATTERN' else v for k, v in knob_values.items() if k in {n.name for n in LM_KNOBS}}
  return types.SimpleNamespace(**effective(values, LM_KNOBS))


@pytest.mark.parametrize('name', list(SCRIPTS))
def test_gemma_runs_import_to_their_family(name, capsys):
  """Nothing unsupported, and the model is the family's: its misfit names only MaxText's bfloat16 tied
  logits (logits_dot_in_fp32 false), which MaxText computes and the family's HF layout does not."""
  knobs = _translation(FIXTURES / SCRIPTS[name], capsys)['knobs']
  assert knobs['UNSUPPORTED_FEATURES'] == {}
  family = FAMILIES[name]
  assert [r.split(' ')[0] for r in family.misfit(_flat(knobs))] == ['tied_logits_bfloat16']
  assert family.misfit(_flat({**knobs, 'TIED_LOGITS_BFLOAT16': False})) == []


def test_gemma2_9b_knobs(capsys):
  knobs = _translation(FIXTURES / SCRIPTS['gemma2'], capsys)['knobs']
  assert knobs['NUM_LAYERS'] == 42 and tuple(knobs['LAYER_PATTERN']) == ('local', 'global')   # 21 MaxText pairs
  assert knobs['LAYER_KINDS'] == {'local': {'SLIDING_WINDOW': 4096}}
  assert (knobs['ATTEN_LOGIT_CAP'], knobs['SOFTMAX_CAP_LOGITS'], knobs['POST_NORMS']) == (50.0, 30.0, True)
  assert knobs.get('QUERY_PRE_ATTN_SCALAR') is None   # MaxText's gemma2 query kernel carries 1/sqrt(head_dim)


def test_gemma3_4b_knobs(capsys):
  knobs = _translation(FIXTURES / SCRIPTS['gemma3'], capsys)['knobs']
  group = ('local',) * 5 + ('global',)
  assert knobs['NUM_LAYERS'] == 34 and tuple(knobs['LAYER_PATTERN']) == (group * 6)[:34]
  assert knobs['LAYER_KINDS'] == {'local': {'SLIDING_WINDOW': 1024, 'ROTARY_MAX_TIMESCALE': 10000.0,
                                            'ROTARY_SCALING': 'none', 'ROTARY_SCALING_FACTOR': 1.0}}
  assert (knobs['ROTARY_MAX_TIMESCALE'], knobs['ROTARY_SCALING'], knobs['ROTARY_SCALING_FACTOR']) == (1e6, 'linear', 8.0)
  assert knobs['USE_QK_NORM'] and knobs['QUERY_PRE_ATTN_SCALAR'] == 256.0
  assert (knobs['ATTEN_LOGIT_CAP'], knobs['SOFTMAX_CAP_LOGITS']) == (0.0, 0.0)


def test_gemma3_27b_query_scale_is_emb_over_heads(tmp_path, capsys):
  script = tmp_path / 'g27.sh'
  script.write_text('python3 MaxText/train.py MaxText/configs/base.yml model_name=gemma3-27b run_name=x steps=5\n')
  knobs = _translation(script, capsys)['knobs']
  assert knobs['QUERY_PRE_ATTN_SCALAR'] == 5376 // 32 and knobs['DIMS_PER_HEAD'] == 128


def test_differing_post_norms_stay_unsupported(tmp_path, capsys):
  """MaxText's two post-norm keys are one knob in paxcli: one without the other is named, not guessed."""
  script = tmp_path / 'g2.sh'
  script.write_text('python3 MaxText/train.py MaxText/configs/base.yml model_name=gemma2-2b run_name=x '
                    'use_post_ffw_norm=false steps=5\n')
  knobs = _translation(script, capsys)['knobs']
  assert 'post_norms' in knobs['UNSUPPORTED_FEATURES'] and 'POST_NORMS' not in knobs


def test_gemma2_9b_recipe_counts_the_released_model_with_maxtexts_vocab(tmp_path, capsys, monkeypatch):
  """The recipe describes Gemma 2 9B: the released count (recipes/gemma.py, held against transformers in
  test_gemma.py) plus MaxText's 128 padding rows of the tied embedding (vocab 256128, not 256000)."""
  monkeypatch.chdir(tmp_path)
  code, _, err = pax_main(['import-maxtext', str(FIXTURES / SCRIPTS['gemma2'])], capsys)
  assert code == 0, err
  code, out, err = pax_main(['describe', '--exp', 'maxtext_gemma2_9b_v6e.py:MaxTextGemma2_9bV6e'], capsys)
  assert code == 0, err
  shown = int(re.search(r'# parameters: .*\(([\d,]+)\)', out).group(1).replace(',', ''))
  assert shown == 9_241_705_984 + (256128 - 256000) * 3584


@pytest.mark.slow   # two 2-step trainings (~30 s each on the loaded 2-core machine)
@pytest.mark.parametrize('name', list(SCRIPTS))
def test_the_recipes_own_tiny_check_trains(name, tmp_path, capsys, monkeypatch):
  from test_import_maxtext_cli import _tiny_check_command
  monkeypatch.chdir(tmp_path)
  code, _, err = pax_main(['import-maxtext', str(FIXTURES / SCRIPTS[name])], capsys)
  assert code == 0, err
  recipe = next(tmp_path.glob('maxtext_*.py'))
  command = _tiny_check_command(recipe.read_text())
  assert command[:2] == ['pax', 'train'] and 'UNSUPPORTED_FEATURES={}' not in command
  code, out, err = pax_main(command[1:], capsys)
  assert code == 0, err
  assert 'Done: step 2' in out
