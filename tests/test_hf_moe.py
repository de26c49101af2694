"""The mixture-of-experts families (Mixtral, Qwen3-MoE) beyond what tests/test_hf_families.py holds for every
family: the recipes at released sizes (DeepSeek-V3's too) count transformers' parameters of the released
config.json; the expert weights as transformers 5 holds them in memory (fused 3-D tensors) read as well as the
per-expert spelling that releases and save_pretrained write; config.json settings paxcli cannot express are
refused by name; a paxcli MoE model that is not one of the families says why."""

import json
import os
import shutil
import types

import pytest

import hf_models
from paxcli.errors import UserError
from conftest import pax_main

pytest.importorskip('transformers')

# huggingface.co/Qwen/Qwen3-30B-A3B, mistralai/Mixtral-8x7B-v0.1 and deepseek-ai/DeepSeek-V3 (its router biases,
# e_score_correction_bias, counted: weights of the checkpoint), as transformers counts them (meta device).
COUNTS = {'mixtral.Mixtral8x7B': (hf_models.MIXTRAL_8X7B, 46_702_792_704),
          'deepseek.DeepSeekV3': (hf_models.DEEPSEEK_V3, 671_026_419_200),
          'qwen.Qwen3Moe30BA3B': (hf_models.QWEN3_30B_A3B, 30_532_122_624)}


def _ok(argv, capsys):
  code, out, err = pax_main(argv, capsys)
  assert code == 0, err
  return out, err


def _refused(argv, capsys):
  code, out, err = pax_main(argv, capsys)
  assert code == 2 and 'Traceback' not in err and err.strip().splitlines()[-1].startswith('error: '), err
  return ' '.join(err.strip().splitlines()[-1].split())


@pytest.mark.parametrize('exp', sorted(COUNTS))
def test_the_released_size_recipes_count_the_released_parameters(exp, capsys):
  released, count = COUNTS[exp]
  described = json.loads(_ok(['describe', '--exp', exp, '--json'], capsys)[0])
  assert described['summary.parameters'] == hf_models.parameter_count(released) == count
  assert described['summary.family'] == released['model_type']


def test_fused_expert_tensors_read_as_the_per_expert_ones(hf_reference, tmp_path, capsys):
  """transformers 5's own module names (mlp.experts.gate_up_proj [E, 2F, D], mlp.experts.down_proj, mlp.gate):
  a directory holding them converts, certified by transformers loading that directory, to the same weights."""
  import safetensors.torch
  made = hf_reference('mixtral')
  fused = tmp_path / 'fused'
  fused.mkdir()
  shutil.copy(os.path.join(made.hf, 'config.json'), fused / 'config.json')
  state = {k: v.contiguous() for k, v in made.model.state_dict().items()}
  assert 'model.layers.0.mlp.experts.gate_up_proj' in state and not any('block_sparse_moe' in k for k in state)
  safetensors.torch.save_file(state, str(fused / 'model.safetensors'), metadata={'format': 'pt'})
  out, _ = _ok(['checkpoint', 'convert', '--from', 'hf', str(fused), str(tmp_path / 'a'), '--recipe',
                str(tmp_path / 'a.py'), '--json'], capsys)
  v = json.loads(out)['verify']
  assert v['ok'] and v['reference'] == 'transformers MixtralForCausalLM (float32) on the source' and v['kl'] < 1e-8
  _ok(['checkpoint', 'convert', '--from', 'hf', made.hf, str(tmp_path / 'b'), '--recipe', str(tmp_path / 'b.py'),
       '--no-verify'], capsys)
  from paxcli.convert import formats
  a, b = formats.open_source(str(tmp_path / 'a')), formats.open_source(str(tmp_path / 'b'))
  names = [x.name for x in b.arrays() if '/mlp/' in x.name]
  assert names and sorted(names) == sorted(x.name for x in a.arrays() if '/mlp/' in x.name)
  import numpy as np
  for name in names:
    np.testing.assert_array_equal(a.read(name), b.read(name))


@pytest.mark.parametrize('family', ['mixtral', 'qwen3_moe'])
def test_the_fused_expert_spelling_is_written_too(hf_reference, family):
  """The fused spelling is an ordinary weight map (paxcli.models.weight_map), both ways: transformers' own fused
  tensors read into paxcli's arrays and written back are those tensors, bit for bit."""
  import numpy as np

  from paxcli.models import knobs, registry
  from paxcli.models.weight_map import WeightMap
  made = hf_reference(family)
  theirs = {k: v.detach().numpy() for k, v in made.model.state_dict().items()}
  fam = registry.by_name(family)
  view = types.SimpleNamespace(**knobs.effective(fam.from_hf_config(made.ref.config, '/m')[0], knobs.LM_KNOBS))
  wmap = WeightMap(fam.hf_read_weights(view, list(theirs)))
  ours = {name: wmap.from_hf(name, theirs.__getitem__) for name in wmap.paxcli_shapes}
  fused = [n for n in wmap.hf_shapes if n.endswith(('experts.gate_up_proj', 'experts.down_proj'))]
  assert len(fused) == 2 * view.num_layers
  for name in wmap.hf_shapes:
    np.testing.assert_array_equal(wmap.to_hf(name, ours.__getitem__), theirs[name])


@pytest.mark.parametrize('family, changes, named', [
    ('qwen3_moe', {'decoder_sparse_step': 2, 'mlp_only_layers': [1]},
     ['decoder_sparse_step 2 (paxcli\'s Qwen3-MoE: 1)', 'mlp_only_layers [1] (paxcli\'s Qwen3-MoE: [])']),
    ('qwen3_moe', {'use_sliding_window': True, 'shared_expert_intermediate_size': 64},
     ['use_sliding_window true', 'shared_expert_intermediate_size (unknown to paxcli']),
    ('mixtral', {'router_jitter_noise': 0.1, 'use_cache': False},
     ['router_jitter_noise 0.1 (paxcli\'s Mixtral: 0.0)']),
])
def test_a_moe_config_paxcli_cannot_express_is_refused_by_name(hf_reference, tmp_path, capsys, family, changes, named):
  source = hf_models.with_config(hf_reference(family), tmp_path / 'hf', **changes)
  err = _refused(['checkpoint', 'convert', '--from', 'hf', source, str(tmp_path / 'job')], capsys)
  title = {'qwen3_moe': 'Qwen3-MoE', 'mixtral': 'Mixtral'}[family]
  assert f'this {title} config cannot be expressed in paxcli' in err
  for name in named:
    assert name in err, (name, err)
  assert sorted(os.listdir(tmp_path)) == ['hf']   # nothing written


def test_a_mixtral_with_a_sliding_window_converts_certified_and_a_bad_one_is_one_line(hf_reference, tmp_path, capsys):
  """sliding_window null in the releases; a number is the window (transformers' Mixtral attends within it)."""
  made = hf_reference('mixtral')
  windowed = hf_models.with_config(made, tmp_path / 'six', sliding_window=6)
  out, _ = _ok(['checkpoint', 'convert', '--from', 'hf', windowed, str(tmp_path / 'job6'), '--recipe',
                str(tmp_path / 'six.py'), '--json'], capsys)
  assert json.loads(out)['verify']['ok'] and '  SLIDING_WINDOW = 6\n' in (tmp_path / 'six.py').read_text()
  windowless = hf_models.with_config(made, tmp_path / 'w', sliding_window=0)
  err = _refused(['checkpoint', 'convert', '--from', 'hf', windowless, str(tmp_path / 'j')], capsys)
  assert 'sliding_window is 0; a Mixtral config has a positive whole number of tokens or null' in err
  overfull = hf_models.with_config(made, tmp_path / 'k', num_experts_per_tok=5)
  err = _refused(['checkpoint', 'convert', '--from', 'hf', overfull, str(tmp_path / 'j')], capsys)
  assert 'num_experts_per_tok 5 is more than num_local_experts 4' in err


def test_a_paxcli_moe_model_that_is_neither_family_says_why():
  import types

  from paxcli.models import knobs, registry
  from paxcli.models.mixtral import MIXTRAL
  from paxcli.models.qwen3_moe import QWEN3_MOE

  def view(family, **more):
    return types.SimpleNamespace(**knobs.effective({**family.knobs, **more}, knobs.LM_KNOBS))
  assert registry.fits(view(MIXTRAL))[0] == [MIXTRAL]
  assert registry.fits(view(MIXTRAL, ROUTER_SOFTMAX='before_topk', ROUTER_NORMALIZE_TOPK=True))[0] == [MIXTRAL]
  assert registry.fits(view(MIXTRAL, SLIDING_WINDOW=4096))[0] == [MIXTRAL]
  assert registry.fits(view(QWEN3_MOE, ROUTER_NORMALIZE_TOPK=False))[0] == [QWEN3_MOE]
  found, why = registry.fits(view(MIXTRAL, MOE_DISPATCH='capacity', SHARED_EXPERT_HIDDEN_DIMS=64))
  assert found == []
  assert any('capacity dispatch drops tokens' in r for r in why['mixtral'])
  assert any('a shared expert of 64 units' in r for r in why['mixtral'])
  assert any('the MLP is a mixture of 8 experts' in r for r in why['llama'])
  _, why = registry.fits(view(MIXTRAL, ROUTER_SOFTMAX='before_topk', ROUTER_NORMALIZE_TOPK=False))
  assert any('not rescaled to sum to 1' in r for r in why['mixtral'])
  dense = view(QWEN3_MOE, NUM_EXPERTS=0)   # a dense Qwen 3 that still records qwen3_moe (MODEL_FAMILY)
  assert registry.fits(dense)[0] == [registry.by_name('qwen3')] and dense.family == 'qwen3_moe'
  assert any('the MLP is dense' in r for r in QWEN3_MOE.misfit(dense))
  with pytest.raises(UserError, match=r"is a Qwen3-MoE \(its MODEL_FAMILY 'qwen3_moe'\) but does not compute .*the MLP is "
                     'dense'):
    registry.of_model(dense)
  assert registry.of_model(dense, 'qwen3') is registry.by_name('qwen3')   # --family qwen3
