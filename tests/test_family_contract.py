"""The family contract, for every family in the registry with nothing to add per family: its reference entry
(tests/hf_models.py REFERENCES), its section in the user's guide, config.json read as transformers' own config
class reads it (defaults where a key is missing, and every key the class has), its refusals by name, and its
parameter count at the released size equal to transformers'. A new family is held to all of it by its registry
line and its reference entry (docs/development/adding-a-family.md).
"""

import re
import types

import jax
import pytest

import hf_models
from conftest import REPO
from paxcli.errors import UserError
from paxcli.layers.base import instantiate
from paxcli.models import hf_config, knobs, lm_config, registry
from paxcli.models.weight_map import WeightMap
from paxcli.runtime import engine, train_state

pytest.importorskip('transformers')

HF_FAMILIES = [f for f in registry.FAMILIES if f.hf_model_types]
GUIDE = REPO / 'docs' / 'guides' / 'model-families.md'


def _transformers():
  import transformers
  transformers.logging.set_verbosity_error()   # the reduced sizes' token ids lie outside their vocabularies
  return transformers


def _filled(config: dict) -> dict:
  """config.json as transformers' own config class for its model_type reads it: every field, defaults filled."""
  settings = dict(config)
  return _transformers().AutoConfig.for_model(settings.pop('model_type'), **settings).to_dict()


def _meta_shapes(config: dict) -> dict:
  """The state-dict shapes of transformers' model of `config`, built on the meta device (no memory)."""
  import torch
  transformers = _transformers()
  settings = dict(config)
  with torch.device('meta'):
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(settings.pop('model_type'), **settings))
  return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _view(knob_values: dict):
  return types.SimpleNamespace(**knobs.effective(knob_values, knobs.LM_KNOBS))


@pytest.mark.parametrize('family', registry.FAMILIES, ids=lambda f: f.name)
def test_every_family_has_its_reference_entry_refusals_and_guide_section(family):
  """The checklist of adding-a-family.md, asserted: what the other tests of this file (and test_hf_families.py)
  then hold the family to."""
  assert family.hf_model_types, f'{family.name}: paxcli\'s families all read and write Hugging Face checkpoints'
  ref = hf_models.REFERENCES.get(family.name)
  assert ref is not None, f'{family.name}: no entry in tests/hf_models.py REFERENCES'
  assert ref.released['model_type'] in family.hf_model_types and ref.architecture in family.hf_architectures
  assert ref.refusals, f'{family.name}: its entry names no refusal'
  guide = GUIDE.read_text()
  assert f'| `{family.name}` |' in guide, f'{family.name}: no row in the families table of {GUIDE.name}'
  headings = re.findall(r'^### (.+)$', guide, re.M)
  assert any(family.title in h for h in headings), f'{family.name}: no "### ... {family.title} ..." section'


@pytest.mark.parametrize('family', HF_FAMILIES, ids=lambda f: f.name)
def test_config_json_reads_as_transformers_config_class_reads_it(family):
  """For each key of the reference config.json, left out: paxcli either refuses the config or reads the model
  transformers' own config class and modelling code make of it (the knobs of the config the class fills in, and
  the weights' shapes of the model it builds). Every field the class has is one paxcli reads, or leaves the
  function alone at the class's default: the filled-in config converts to the same knobs."""
  ref = hf_models.REFERENCES[family.name]
  read = lambda config: family.from_hf_config(config, '/m')[0]
  assert read(_filled(ref.config)) == read(ref.config)
  checked = 0
  for key in sorted(set(ref.config) - hf_config.HARMLESS_KEYS):   # token ids, dtypes: no function, no shape
    config = {k: v for k, v in ref.config.items() if k != key}
    try:
      ours = read(config)
    except UserError:
      continue   # a refusal computes nothing else
    assert read(_filled(config)) == ours, f'{key}: paxcli\'s default is not transformers\''
    theirs = {k: v for k, v in _meta_shapes(config).items() if not k.endswith('inv_freq')}
    view = _view(ours)
    shapes = WeightMap(family.hf_read_weights(view, list(theirs))).hf_shapes
    if not view.separate_embedding:
      theirs.pop('lm_head.weight', None)   # tied: the embedding's
    assert shapes == theirs, f'{key} left out: the weights differ from transformers\''
    checked += 1
  assert checked > 5


@pytest.mark.parametrize('family, changes, named', [
    (f, changes, named) for f in HF_FAMILIES for changes, named in hf_models.REFERENCES[f.name].refusals],
    ids=lambda x: getattr(x, 'name', None) or '-')
def test_what_a_family_cannot_express_is_refused_by_name(family, changes, named):
  ref = hf_models.REFERENCES[family.name]
  with pytest.raises(UserError) as e:
    family.from_hf_config({**ref.released, **changes}, '/m')
  message = str(e.value)
  assert '\n' not in message and message.startswith('/m')
  for text in named:
    assert text in message, (text, message)
  with pytest.raises(UserError, match=r'paxcli_probe \(unknown to paxcli'):   # and any key it does not know
    family.from_hf_config({**ref.released, 'paxcli_probe': 1}, '/m')


@pytest.mark.parametrize('family', HF_FAMILIES, ids=lambda f: f.name)
def test_the_released_size_counts_transformers_parameters(family):
  """The released config.json (the reference entry's, at full size) as paxcli reads it counts the parameters
  transformers' model of it has (pax describe's count: the abstract parameters of the model)."""
  ref = hf_models.REFERENCES[family.name]
  values, _ = family.from_hf_config(ref.released, '/released')
  assert values['MODEL_FAMILY'] == family.name
  model = instantiate(lm_config(**knobs.flat_settings({**values, 'USE_REPEATED_LAYER': True}, knobs.LM_KNOBS)))
  params = jax.eval_shape(lambda r: engine.init_variables(model, r, 8)['params'], jax.random.key(0))
  ours = train_state.param_count({'params': train_state.unbox(params)})
  assert ours == hf_models.parameter_count(ref.released)


def test_an_unknown_model_type_names_the_families_paxcli_has():
  with pytest.raises(UserError) as e:
    registry.for_hf_config({'model_type': 'mamba2', 'architectures': ['Mamba2ForCausalLM']}, '/m')
  assert str(e.value) == (f"/m: model_type 'mamba2' (Mamba2ForCausalLM) is not one paxcli reads; its model families "
                          f'are {registry.names()}.')
  for family in HF_FAMILIES:
    assert f'{family.name} (model_type {family.hf_model_types[0]!r}' in registry.names()
    assert registry.for_hf_config({'model_type': family.hf_model_types[0]}, '/m') is family
    assert registry.for_hf_config({'architectures': [family.hf_architectures[0]]}, '/m') is family   # no model_type


def test_a_model_that_records_no_family_is_placed_by_its_function_or_asked_for_one(monkeypatch):
  """Unrecorded (a checkpoint from before MODEL_FAMILY): the family its function places it in, a family built on
  another yielding to it (Phi-3, Mistral and Granite to Llama); two unrelated families computing it: one line asking."""
  llama, mistral, phi3 = (registry.by_name(n) for n in ('llama', 'mistral', 'phi3'))
  plain = _view({**llama.knobs, 'MODEL_FAMILY': None})
  granite = registry.by_name('granite')   # its multipliers at 1 (and attention at 1/sqrt(E)): a Llama's function
  assert registry.fits(plain)[0] == [llama, mistral, phi3, granite] and registry.of_model(plain) is llama
  assert registry.of_model(_view({**llama.knobs, 'MODEL_FAMILY': 'phi3'})) is phi3   # recorded: what it records
  assert registry.summary(plain) == {'family': 'llama', 'family_recorded': False}
  assert registry.of_knobs({**llama.knobs, 'MODEL_FAMILY': None}) is llama   # what --from paxml records
  assert registry.of_knobs({'NORM_TYPE': 'layernorm'}) is None

  class Twin(registry.Family):   # computes a Llama's function, built on no family
    name, title, hf_model_types, hf_architectures = 'twin', 'Twin', ('twin',), ('TwinForCausalLM',)

    def misfit(self, model):
      return llama.misfit(model)
  monkeypatch.setattr(registry, 'FAMILIES', registry.FAMILIES + (Twin(),))
  with pytest.raises(UserError, match=r'records no family \(MODEL_FAMILY\) and computes the function of several '
                                      r'\(llama, twin\): pass --family'):
    registry.of_model(plain)
  assert 'pass --family' in registry.summary(plain)['family_note'] and registry.summary(plain)['family'] is None


LLAMA_SHAPED = ['MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=4', 'NUM_KV_HEADS=2', 'PERCORE_BATCH_SIZE=1',
                'MAX_SEQ_LEN=16', 'VOCAB_SIZE=64', 'NUM_LAYERS=1', 'NORM_TYPE="rmsnorm"', 'USE_GATED_ACTIVATION=True',
                'ACTIVATION="silu"', 'POSITION_EMBEDDING="rotary"', 'USE_BIAS=False', 'SEPARATE_EMBEDDING=True',
                'NUM_TRAIN_STEPS=1']


def test_a_natively_trained_model_is_written_as_the_family_it_records_or_is_given(tmp_path, capsys):
  """A run of a recipe without presets records no family: --to hf writes the family its function places it in
  (Llama, before Mistral and Phi-3, which are built on it), saying so; --family names another that computes it,
  certified by transformers' own class for it; one that does not is one line."""
  import json

  from conftest import pax_main
  job = str(tmp_path / 'job')
  code, _, err = pax_main(['train', '--exp', 'lm_cloud.LmCloudSpmdTest', *[a for s in LLAMA_SHAPED for a in ('--set', s)],
                           '--job-log-dir', job], capsys)
  assert code == 0, err

  def convert(out, *more):
    code, stdout, err = pax_main(['checkpoint', 'convert', job, str(tmp_path / out), '--to', 'hf', '--json', *more],
                                 capsys)
    return code, (json.loads(stdout) if code == 0 else None), ' '.join(err.split())
  code, result, err = convert('placed')
  assert code == 0, err
  assert 'The model records no family (MODEL_FAMILY): writing it as a Llama (LlamaForCausalLM)' in err
  assert result['verify']['ok'] and result['verify']['result'].startswith('transformers LlamaForCausalLM')
  code, result, err = convert('mistral', '--family', 'mistral')
  assert code == 0, err
  written = json.load(open(tmp_path / 'mistral' / 'config.json'))
  assert written['architectures'] == ['MistralForCausalLM'] and written['sliding_window'] is None
  assert result['verify']['ok'] and 'MistralForCausalLM' in result['verify']['result']
  code, _, err = convert('qwen2', '--family', 'qwen2')
  assert code == 2 and "is a Qwen2 (--family qwen2) but does not compute a Qwen2's function" in err, err
  assert 'USE_QKV_BIAS=True' in err and not (tmp_path / 'qwen2').exists()
  code, _, err = convert('typo', '--family', 'lama')
  assert code == 2 and "--family: No model family 'lama'" in err and "Did you mean 'llama'" in err
  code, _, err = pax_main(['checkpoint', 'convert', job, str(tmp_path / 'o'), '--family', 'llama'], capsys)
  assert code == 2 and '--family names the Hugging Face layout written: it goes with --to hf or --to peft' in err
