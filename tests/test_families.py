"""Model families (paxcli.models.family, registry): every family's data is well-formed and its weight
map covers its model exactly; the registry answers --from hf, --to hf, import-maxtext, recipes and
describe; the old import paths of what moved into paxcli.models keep working with a warning."""

import importlib
import json
import sys
import warnings

import jax
import pytest

from conftest import pax_main
from paxcli import compat, experiment, gencode
from paxcli.errors import UserError
from paxcli.layers.base import instantiate
from paxcli.models import LmExperiment, knobs, lm_config, registry
from paxcli.models.llama import LLAMA
from paxcli.models.lm import flat_view
from paxcli.models.weight_map import WeightMap
from paxcli.runtime import engine
from paxcli.values import coerce

SMALL = {'VOCAB_SIZE': 48, 'NUM_LAYERS': 2, 'MODEL_DIMS': 16, 'HIDDEN_DIMS': 40, 'NUM_HEADS': 4, 'NUM_KV_HEADS': 2,
         'DIMS_PER_HEAD': 8, 'MAX_SEQ_LEN': 8}


def _small_model(family, **more):
  period = len(family.knobs.get('LAYER_PATTERN', ()))   # whole groups of a family's layer pattern
  settings = knobs.flat_settings({**family.knobs, **SMALL, 'NUM_LAYERS': max(2, period), **more}, knobs.LM_KNOBS)
  return instantiate(lm_config(**settings))


@pytest.mark.parametrize('family', registry.FAMILIES, ids=lambda f: f.name)
def test_a_family_is_well_formed(family):
  assert family is registry.by_name(family.name) and family.title and family.description
  for name, value in family.knobs.items():      # presets are knobs, of their declared types
    assert coerce(value, knobs.LM_KNOB[name].type, name) == value
  for block in family.maxtext_blocks.values():
    assert set(block.knobs) <= set(knobs.LM_KNOB)
  assert family.misfit(flat_view(_small_model(family))) == []   # the family's own presets fit it


@pytest.mark.parametrize('family', [f for f in registry.FAMILIES if f.hf_model_types], ids=lambda f: f.name)
@pytest.mark.parametrize('tied', [True, False])
def test_the_hf_weight_map_covers_the_model_exactly(family, tied):
  model = _small_model(family, SEPARATE_EMBEDDING=not tied)
  params = jax.eval_shape(lambda r: engine.init_variables(model, r, 8)['params'], jax.random.key(0))
  flat = {'params/' + '/'.join(map(str, engine.train_state.keys(p))): x.shape
          for p, x in jax.tree_util.tree_flatten_with_path(engine.unbox(params))[0]}
  wmap = WeightMap(family.hf_weights(flat_view(model)))   # its rows tile every array they name
  assert wmap.paxcli_shapes == flat
  config = family.to_hf_config(flat_view(model), 'float32', {})
  assert config['model_type'] in family.hf_model_types
  back, _ = family.from_hf_config(config, 'exported')   # config.json read back gives the model's knobs
  heads = ('NUM_KV_HEADS', 'DIMS_PER_HEAD') if flat_view(model).kv_lora_rank else ()   # latent attention: neither
  keys = [k for k in SMALL if k != 'NUM_LAYERS' and k not in heads]
  assert {k: back[k] for k in keys} == {k: SMALL[k] for k in keys}
  assert back['NUM_LAYERS'] == flat_view(model).num_layers and back['SEPARATE_EMBEDDING'] == (not tied)


def test_a_misspelt_family_is_one_line_with_a_suggestion():
  with pytest.raises(UserError, match="No model family 'lama'.*Did you mean 'llama'"):
    registry.by_name('lama')


def test_a_model_that_fits_no_family_says_why_for_each():
  pax_lm = flat_view(instantiate(lm_config(**knobs.flat_settings(SMALL, knobs.LM_KNOBS))))
  found, why = registry.fits(pax_lm)
  assert found == [] and "norm_type is 'layernorm'" in why['llama'][0]
  with pytest.raises(UserError, match="fits none of the Hugging Face layouts paxcli writes: llama: norm_type"):
    registry.of_model(pax_lm)
  patterned = _small_model(LLAMA, LAYER_PATTERN=('a', 'b'), LAYER_KINDS={'a': {'NUM_KV_HEADS': 1}})
  assert any('several kinds' in r for r in LLAMA.misfit(flat_view(patterned)))


def test_recipes_take_the_family_presets():
  recipes = experiment.import_all_recipes()
  for name in ('default.StdlibDocsLm', 'bench.Llama1B', 'bench.LlamaTiny'):
    exp = recipes[name]()
    assert {k: exp.knobs()[k] for k in LLAMA.knobs} == LLAMA.knobs, name

  @LLAMA.preset
  class Mine(LmExperiment):
    ACTIVATION = 'gelu'   # what the class sets itself stays
  assert Mine.ACTIVATION == 'gelu' and Mine.NORM_TYPE == 'rmsnorm'


def test_maxtext_blocks_come_from_the_family():
  family, block = registry.maxtext_block('default')
  assert family is LLAMA and block.knobs['PARALLEL_BLOCK'] is True
  assert registry.maxtext_block('llama2')[0] is LLAMA and registry.maxtext_block('gemma2')[0].name == 'gemma2'
  assert registry.maxtext_block('gemma3')[0].name == 'gemma3' and registry.maxtext_block('gpt3') is None
  assert registry.maxtext_block('mixtral')[0].name == 'mixtral'
  found, wrong = registry.maxtext_family({'NORM_TYPE': 'layernorm', 'USE_BIAS': False, 'POSITION_EMBEDDING': 'rotary'})
  assert found is None and wrong == ["NORM_TYPE = 'layernorm' (MaxText: 'rmsnorm')"]


def test_describe_names_the_family(capsys):
  code, out, err = pax_main(['describe'], capsys)
  assert code == 0, err
  assert '# model family: llama (pax checkpoint convert --to hf writes its Hugging Face layout)' in out
  code, out, err = pax_main(['describe', '--set', 'USE_BIAS=True'], capsys)   # recorded, and no longer a Llama
  assert code == 0, err
  assert ("# model family: llama (MODEL_FAMILY); --to hf refuses it: it does not compute a Llama's function (the "
          'layers have biases (Llama has none: USE_BIAS=False))') in out
  code, out, err = pax_main(['describe', '--exp', 'lm_cloud.LmCloudSpmdTest', '--json'], capsys)
  summary = json.loads(out)
  assert summary['summary.family'] is None and 'not llama' in summary['summary.family_note']
  # Issue 38: one reason shared by every family is said once, with the families named together.
  code, out, err = pax_main(['describe', '--exp', 'lm_cloud.LmCloudSpmdTest'], capsys)
  (line,) = [l for l in out.splitlines() if l.startswith('# model family:')]
  names = [f.name for f in registry.FAMILIES if f.hf_model_types]
  assert line == ('# model family: none with a Hugging Face layout (not ' + ', '.join(names[:-1]) + f' or {names[-1]}: '
                  "norm_type is 'layernorm' (each has NORM_TYPE='rmsnorm'))"), line
  code, out, err = pax_main(['describe', '--exp', 'lm_cloud.LmCloudSpmdTest', '--set', 'NORM_TYPE=rmsnorm'], capsys)
  (line,) = [l for l in out.splitlines() if l.startswith('# model family:')]
  assert line.count('the layers have biases') == 1 and line.count('norm_plus_one is False') == 1 and len(line) < 300


def test_old_import_paths_still_work_with_a_deprecation_warning():
  for old, new in [('paxcli.families.lm', 'paxcli.models.lm_experiment'), ('paxcli.families.knobs', 'paxcli.models.knobs'),
                   ('paxcli.families.base', 'paxcli.models.training'),
                   ('paxcli.families.classifier', 'paxcli.models.classifier_experiment')]:
    sys.modules.pop(old, None)
    with pytest.warns(compat.PaxcliDeprecationWarning, match=f'{old} is now {new}'):
      module = importlib.import_module(old)
    assert module is importlib.import_module(new)
  from paxcli.models import LmExperiment
  from paxcli.models import LmExperiment as New
  assert LmExperiment is New
  with pytest.warns(DeprecationWarning, match='paxcli.models.Block is paxcli.layers.transformer.Block'):
    from paxcli.models import Block
  assert Block is importlib.import_module('paxcli.layers.transformer').Block
  with warnings.catch_warnings():
    warnings.simplefilter('error')   # the package's own names load without a warning, and without flax
    from paxcli.models import BaseModel, DecodingModel, LanguageModel, lm_loss  # noqa: F401


def test_recipes_written_before_the_move_still_read(tmp_path):
  """A recipe `pax checkpoint convert --from hf` wrote into a job directory before paxcli.models: read as data."""
  text = ('"""A Hugging Face Llama."""\n\nfrom paxcli.experiment import register\n'
          'from paxcli.models import LmExperiment\n\n\n@register\nclass HfLlama(LmExperiment):\n'
          '  NUM_LAYERS = 2\n')
  assert gencode.knobs_of(text, 'HfLlama', 'old.py') == {'NUM_LAYERS': 2}


@pytest.mark.parametrize('name, settings, family, says', [
    ('granite', {'EMBEDDING_MULTIPLIER': 12.0, 'LOGITS_SCALING': 8.0}, 'llama',
     'token embeddings are multiplied (Llama has none: EMBEDDING_MULTIPLIER=1.0)'),
    ('granite', {'RESIDUAL_MULTIPLIER': 0.22}, 'gemma2', 'residual_multiplier is 0.22'),
    ('olmo2', {}, 'llama', "the norms are placed otherwise (PRE_NORMS=False, POST_NORMS=True; Llama's: PRE_NORMS=True"),
    ('olmo2', {'POST_NORMS': True, 'PRE_NORMS': False}, 'qwen3', 'QK-norm is over each head in Qwen3'),
    ('qwen3', {}, 'olmo2', 'QK-norm is over the whole projection in OLMo 2 (QK_NORM_PER_HEAD=False)'),
    ('phi3', {'ROTARY_SCALING': 'longrope', 'ROTARY_SHORT_FACTORS': (1.0,) * 4, 'ROTARY_LONG_FACTORS': (2.0,) * 4},
     'mistral', "rotary positions are scaled as 'longrope'"),
    ('phi3', {'ROTARY_FRACTION': 0.5}, 'llama', 'rotary positions turn 0.5 of each head (Llama turns all of it'),
    ('llama', {'ROTARY_SCALING': 'llama3'}, 'phi3', "rotary positions are scaled as 'llama3' (Phi-3's are scaled as"),
])
def test_what_sets_a_family_apart_keeps_the_others_from_writing_it(name, settings, family, says):
  """A model with one family's layer options is not written as another family, which would drop them: misfit names
  the knob, and the family built for them fits."""
  model = flat_view(_small_model(registry.by_name(name), **settings))
  assert any(says in reason for reason in registry.by_name(family).misfit(model)), registry.by_name(family).misfit(model)
  assert registry.by_name(name).misfit(model) == []


def test_granite_reads_its_released_attention_dropout_with_a_note():
  """Granite 3.0 and 3.1 ship attention_dropout 0.1: training-only, the same function; the recipe's NOTES say so."""
  import hf_models
  granite = registry.by_name('granite')
  values, notes = granite.from_hf_config(hf_models.GRANITE31_2B, '/m')
  assert values['EMBEDDING_MULTIPLIER'] == 12.0 and values['ATTENTION_MULTIPLIER'] == 0.015625
  assert notes == ['attention_dropout 0.1 drops attention weights in training only; paxcli trains without it '
                   '(DROPOUT_PROB is its residual dropout), and the model computes the same function.']
  assert granite.from_hf_config({**hf_models.GRANITE31_2B, 'attention_dropout': 0.0}, '/m')[1] == []
