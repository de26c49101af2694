"""YaRN rope scaling through the one rope reader (paxcli.models.hf_config) for a family with key and value heads: a
Qwen2 of transformers' own making with a long Qwen 2.5's rope_scaling (yarn, factor 4, here from 16 positions, which
the certificate's 64-token prompts pass) imports and exports certified against transformers' Qwen2ForCausalLM.
DeepSeek-V3's YaRN (with mscale_all_dim and latent attention): tests/test_hf_families.py."""

import json
import os

import pytest

import hf_models
from conftest import pax_main

pytest.importorskip('transformers')

YARN = {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 16}


def _ok(argv, capsys):
  code, out, err = pax_main(argv, capsys)
  assert code == 0, err
  return json.loads(out)


@pytest.mark.slow   # two conversions, each certified by transformers
def test_a_yarn_qwen_converts_both_ways_certified_by_transformers(tmp_path, capsys):
  # a copy: transformers' config class writes rope_theta into the dict it is given
  config = {**hf_models.QWEN25_05B, **hf_models.TINY, 'max_position_embeddings': 64, 'rope_scaling': dict(YARN)}
  hf = hf_models.save(hf_models.build(config), str(tmp_path / 'hf'))
  job, recipe, back = str(tmp_path / 'job'), str(tmp_path / 'recipe.py'), str(tmp_path / 'back')
  v = _ok(['checkpoint', 'convert', '--from', 'hf', hf, job, '--recipe', recipe, '--json'], capsys)['verify']
  assert v['ok'] and v['top1_agreement'] == 1.0 and v['max_abs_diff'] < 1e-4
  text = open(recipe).read()
  for line in ("ROTARY_SCALING = 'yarn'", 'ROTARY_SCALING_FACTOR = 4.0', 'ROTARY_ORIGINAL_MAX_LEN = 16'):
    assert f'  {line}\n' in text, line
  v = _ok(['checkpoint', 'convert', job, back, '--to', 'hf', '--json'], capsys)['verify']
  assert v['ok'] and v['result'] == 'transformers Qwen2ForCausalLM (float32) on the written result'
  with open(os.path.join(back, 'config.json')) as f:
    written = json.load(f)['rope_scaling']
  assert {k: written[k] for k in YARN} == YARN
