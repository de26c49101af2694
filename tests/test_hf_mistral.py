"""The Mistral family against transformers' own MistralForCausalLM: a model built by transformers from
Mistral-7B-v0.1's config.json at a reduced size with a window of 6 tokens (tests/hf_models.py), saved
with save_pretrained, imported with `pax checkpoint convert --from hf`; logits (float32, 1e-4) and
greedy decoding (the rolling KV cache, far past the window) equal transformers'; `--to hf` loads back
in transformers; the released size counts transformers' parameters; config.json keys paxcli cannot
express are refused by name. LoRA through `pax train`/`eval`/`score` and `--to peft` against PEFT runs for
Mistral in tests/test_hf_families.py (its reference's 9-token texts reach past the window of 6).
"""

import json
import os
import types

import numpy as np
import pytest

import hf_models
from conftest import pax_main

pytest.importorskip('transformers')
REF = hf_models.REFERENCES['mistral']


def _ok(argv, capsys):
  code, out, err = pax_main(argv, capsys)
  assert code == 0, err
  return out, err


@pytest.fixture(scope='module')
def imported(tmp_path_factory):
  work = tmp_path_factory.mktemp('mistral')
  model = hf_models.build(REF.config)
  hf = hf_models.save(model, str(work / 'hf'))
  job, recipe = str(work / 'job'), str(work / 'recipe.py')
  from rich.console import Console

  from paxcli import api
  result = api.convert_checkpoint(hf, job, fmt='hf', recipe=recipe, console=Console(quiet=True))
  return types.SimpleNamespace(work=work, model=model, hf=hf, job=job, recipe=recipe, result=result,
                               exp=f'{recipe}:{REF.recipe_class}')


def _paxcli_logits(imported, ids):
  from paxcli import config
  from paxcli.convert import core, formats
  model = core.build_model(config.resolve(imported.exp, []))
  params = core.load_params(formats.open_source(imported.job), [n for n in model.abstract if n.startswith('params/')])
  return core.logits(model.module, params, ids)


def test_import_gives_transformers_logits_with_the_window(imported):
  assert imported.result['verify']['ok']
  text = open(imported.recipe).read()
  for line in REF.recipe_lines + ('NUM_KV_HEADS = 2',):
    assert f'  {line}\n' in text, line
  ids = np.random.default_rng(7).integers(0, 128, (3, 40)).astype(np.int32)
  ours = _paxcli_logits(imported, ids)
  np.testing.assert_allclose(ours, hf_models.logits(imported.model, ids), atol=1e-4, rtol=0)
  # the window matters at these lengths: the same weights with full attention are another function
  full = hf_models.build(dict(REF.config, sliding_window=None))
  full.load_state_dict(imported.model.state_dict())
  assert np.abs(hf_models.logits(full, ids) - ours)[:, 6:].max() > 1e-2


def test_greedy_decoding_is_transformers_generate_far_past_the_window(imported, capsys):
  """Prompts shorter and longer than the window, 20 new tokens: the rolling cache of 6 slots wraps
  several times, and every token is the one transformers' generate() picks."""
  prompts = [[5, 17, 99, 3], [42], [7, 7, 120, 64, 1, 88, 13, 9, 30, 2, 77]]
  hf_models.check_decoding(pax_main, capsys, imported.exp, imported.job, imported.model, prompts, 20)


def test_export_to_hf_loads_back_in_transformers_as_the_same_model(imported, capsys):
  back = str(imported.work / 'back')
  out, _ = _ok(['checkpoint', 'convert', imported.job, back, '--to', 'hf', '--json'], capsys)
  assert json.loads(out)['verify']['ok']
  config = json.load(open(os.path.join(back, 'config.json')))
  assert (config['architectures'], config['model_type'], config['sliding_window']) == (['MistralForCausalLM'],
                                                                                        'mistral', 6)
  again = hf_models.load(back)
  assert type(again).__name__ == 'MistralForCausalLM' and again.config.sliding_window == 6
  ids = np.random.default_rng(8).integers(0, 128, (2, 33)).astype(np.int32)
  np.testing.assert_allclose(hf_models.logits(again, ids), hf_models.logits(imported.model, ids), atol=1e-5, rtol=0)


def test_the_released_size_has_exactly_transformers_parameter_count(capsys):
  out, _ = _ok(['describe', '--exp', 'mistral.Mistral7B'], capsys)
  count = hf_models.parameter_count(hf_models.MISTRAL_7B)
  assert count == 7_241_732_096
  assert f'# parameters: 7.24 G ({count:,})' in out
  assert '# model family: mistral' in out and 'knobs.SLIDING_WINDOW = 4096' in out


def test_config_keys_paxcli_cannot_express_are_refused_by_name(tmp_path, capsys):
  from paxcli.errors import UserError
  from paxcli.models import registry
  family = registry.for_hf_config(REF.config, '/m')
  assert family is registry.by_name('mistral')
  with pytest.raises(UserError) as e:
    family.from_hf_config(dict(REF.config, layer_types=['sliding_attention', 'full_attention'],
                               attention_dropout=0.1, rope_scaling={'rope_type': 'dynamic', 'factor': 4.0}), '/m')
  for name in ('layer_types', 'attention_dropout 0.1', 'rope_scaling {"rope_type": "dynamic"'):
    assert name in str(e.value), (name, str(e.value))
  for bad in (0, -4, 2.5, 'long', True):
    with pytest.raises(UserError, match=r'/m/config.json: sliding_window is .*positive whole number'):
      family.from_hf_config(dict(REF.config, sliding_window=bad), '/m')
  # transformers' default where the key is missing; null is full attention (Mistral 7B v0.2, v0.3)
  assert family.from_hf_config({k: v for k, v in REF.config.items() if k != 'sliding_window'}, '/m')[0][
      'SLIDING_WINDOW'] == 4096
  assert family.from_hf_config(dict(REF.config, sliding_window=None), '/m')[0]['SLIDING_WINDOW'] == 0


def test_the_window_decides_which_family_a_model_that_records_none_is():
  """A windowed model computes a Mistral's function and no Llama's; a full-attention one both (Mistral's v0.2/v0.3
  have sliding_window null): recorded, it is what it records; without a record, the family Mistral is built on."""
  import types as t

  from paxcli.errors import UserError
  from paxcli.models import knobs, registry

  def view(family, **more):
    return t.SimpleNamespace(**knobs.effective({**registry.by_name(family).knobs, **more}, knobs.LM_KNOBS))
  mistral, llama = registry.by_name('mistral'), registry.by_name('llama')
  assert registry.fits(view('mistral', SLIDING_WINDOW=6))[0] == [mistral, registry.by_name('phi3')]
  assert registry.fits(view('mistral', SLIDING_WINDOW=0))[0][:2] == [llama, mistral]   # and Phi-3, built on Mistral
  assert registry.of_model(view('mistral', SLIDING_WINDOW=6, MODEL_FAMILY=None)) is mistral
  assert registry.of_model(view('mistral', SLIDING_WINDOW=0)) is mistral   # Mistral v0.3: MistralForCausalLM
  assert mistral.to_hf_config(view('mistral', SLIDING_WINDOW=0))['sliding_window'] is None
  assert registry.of_model(view('mistral', SLIDING_WINDOW=0, MODEL_FAMILY=None)) is llama
  assert registry.of_model(view('llama', MODEL_FAMILY=None), 'mistral') is mistral   # --family mistral
  assert any('sliding window of 6 tokens' in r for r in llama.misfit(view('llama', SLIDING_WINDOW=6)))
  with pytest.raises(UserError, match=r"is a Llama \(--family llama\) but does not compute a Llama's function.*sliding "
                                      'window of 6 tokens'):
    registry.of_model(view('mistral', SLIDING_WINDOW=6), 'llama')
