"""The Qwen families held against transformers' own modelling code (Qwen2ForCausalLM, Qwen3ForCausalLM).

For each family, one model built by transformers from the family's released config.json (Qwen2.5-0.5B's,
Qwen3-0.6B's) at a reduced size with random weights, saved with save_pretrained, and imported once with
`pax checkpoint convert --from hf` (the module's fixture). Then: logits (float32, 1e-4), greedy
decoding against generate(), `--to hf` loaded back by transformers, LoRA adapters through `--to peft`
and PEFT against `pax score`, the certification each conversion prints, and the refusals.
"""

import json
import os
import types

import numpy as np
import pytest

import hf_models
from conftest import pax_main

# Released config.json files (huggingface.co/Qwen/Qwen2.5-0.5B and /Qwen/Qwen3-0.6B), as transformers
# reads them: the keys that define the function are kept; the sizes are cut (SIZES) for a test.
QWEN25_05B = {
    'architectures': ['Qwen2ForCausalLM'], 'attention_dropout': 0.0, 'bos_token_id': 151643, 'eos_token_id': 151643,
    'hidden_act': 'silu', 'hidden_size': 896, 'initializer_range': 0.02, 'intermediate_size': 4864,
    'max_position_embeddings': 32768, 'max_window_layers': 24, 'model_type': 'qwen2', 'num_attention_heads': 14,
    'num_hidden_layers': 24, 'num_key_value_heads': 2, 'rms_norm_eps': 1e-06, 'rope_theta': 1000000.0,
    'sliding_window': 32768, 'tie_word_embeddings': True, 'torch_dtype': 'bfloat16', 'transformers_version': '4.40.1',
    'use_cache': True, 'use_sliding_window': False, 'vocab_size': 151936}
QWEN3_06B = {
    'architectures': ['Qwen3ForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0, 'bos_token_id': 151643,
    'eos_token_id': 151645, 'head_dim': 128, 'hidden_act': 'silu', 'hidden_size': 1024, 'initializer_range': 0.02,
    'intermediate_size': 3072, 'max_position_embeddings': 40960, 'max_window_layers': 28, 'model_type': 'qwen3',
    'num_attention_heads': 16, 'num_hidden_layers': 28, 'num_key_value_heads': 8, 'rms_norm_eps': 1e-06,
    'rope_scaling': None, 'rope_theta': 1000000, 'sliding_window': None, 'tie_word_embeddings': True,
    'torch_dtype': 'bfloat16', 'transformers_version': '4.51.0', 'use_cache': True, 'use_sliding_window': False,
    'vocab_size': 151936}
# Qwen3's head_dim stays independent of hidden_size / heads (16 * 4 = 64 != 32), as in the released sizes.
SIZES = {'qwen2': dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128),
         'qwen3': dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=128, tie_word_embeddings=False)}
RELEASED = {'qwen2': QWEN25_05B, 'qwen3': QWEN3_06B}
CLASS = {'qwen2': 'HfQwen2', 'qwen3': 'HfQwen3'}
ARCH = {'qwen2': 'Qwen2ForCausalLM', 'qwen3': 'Qwen3ForCausalLM'}

pytest.importorskip('transformers')


def _ok(argv, capsys):
  code, out, err = pax_main(argv, capsys)
  assert code == 0, err
  return out, err


def _refused(argv, capsys):
  code, out, err = pax_main(argv, capsys)
  assert code == 2 and 'Traceback' not in err and len(err.strip().splitlines()) == 1, err
  return ' '.join(err.split())


@pytest.fixture(scope='module', params=['qwen2', 'qwen3'])
def imported(request, tmp_path_factory):
  """The family's reduced model (transformers), its save_pretrained directory, and its import into a job."""
  name = request.param
  work = tmp_path_factory.mktemp(name)
  model = hf_models.build(hf_models.reduced(RELEASED[name], **SIZES[name]))
  hf_dir = hf_models.save(model, str(work / 'hf'))
  job, recipe = str(work / 'job'), str(work / 'recipe.py')
  from paxcli import api
  result = api.convert_checkpoint(hf_dir, job, fmt='hf', recipe=recipe, console=_quiet())
  return types.SimpleNamespace(name=name, work=work, model=model, hf=hf_dir, job=job, recipe=recipe,
                               exp=f'{recipe}:{CLASS[name]}', result=result)


def _quiet():
  from rich.console import Console
  return Console(quiet=True)


def _paxcli_logits(imported, ids):
  from paxcli import config
  from paxcli.convert import core, formats
  model = core.build_model(config.resolve(imported.exp, []))
  params = core.load_params(formats.open_source(imported.job), [n for n in model.abstract if n.startswith('params/')])
  return core.logits(model.module, params, ids)


def test_import_is_certified_by_transformers_and_gives_its_logits(imported):
  v = imported.result['verify']
  assert v['ok'] and v['reference'] == f'transformers {ARCH[imported.name]} (float32) on the source'
  assert v['result'] == 'paxcli on the written result' and v['top1_agreement'] == 1.0 and v['max_abs_diff'] < 1e-4
  text = open(imported.recipe).read()
  assert 'ROTARY_MAX_TIMESCALE = 1000000.0' in text and 'NUM_KV_HEADS = 2' in text
  if imported.name == 'qwen2':
    assert 'USE_QKV_BIAS = True' in text and 'SEPARATE_EMBEDDING = False' in text   # tied at this size
  else:
    assert 'USE_QK_NORM = True' in text and 'DIMS_PER_HEAD = 16' in text and 'SEPARATE_EMBEDDING = True' in text
  ids = np.random.default_rng(7).integers(0, 128, (3, 40)).astype(np.int32)
  np.testing.assert_allclose(_paxcli_logits(imported, ids), hf_models.logits(imported.model, ids), atol=1e-4, rtol=0)


def test_greedy_decoding_is_transformers_generate(imported, capsys):
  prompts = [[5, 17, 99, 3], [42], [7, 7, 120, 64, 1, 88, 13]]
  argv = ['decode', '--exp', imported.exp, '--job-log-dir', imported.job, '--max-decode-steps', '8', '--ignore-eos',
          '--json']
  for prompt in prompts:
    argv += ['--prompt-ids', ','.join(map(str, prompt))]
  out, _ = _ok(argv, capsys)
  rows = [json.loads(line) for line in out.splitlines() if line.startswith('{')]
  assert [r['prompt_ids'] for r in rows] == prompts
  for row, prompt in zip(rows, prompts):
    assert row['decoded_ids'] == hf_models.generate(imported.model, prompt, 8), prompt


def test_export_to_hf_is_certified_and_transformers_loads_the_same_model(imported, capsys):
  back = str(imported.work / 'back')
  out, err = _ok(['checkpoint', 'convert', imported.job, back, '--to', 'hf', '--json'], capsys)
  v = json.loads(out)['verify']
  assert v['ok'] and v['reference'] == 'paxcli on the source'
  assert v['result'] == f'transformers {ARCH[imported.name]} (float32) on the written result'
  config = json.load(open(os.path.join(back, 'config.json')))
  assert config['architectures'] == [ARCH[imported.name]] and config['model_type'] == imported.name
  again = hf_models.load(back)
  assert type(again).__name__ == ARCH[imported.name]
  ids = np.random.default_rng(8).integers(0, 128, (2, 33)).astype(np.int32)
  np.testing.assert_allclose(hf_models.logits(again, ids), hf_models.logits(imported.model, ids), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_lora_adapters_through_peft_give_pax_scores_log_likelihood(imported, capsys):
  """LORA_RANK on the imported model, a few steps; --to peft (certified by PEFT); PEFT's LoRA on transformers'
  model of the source directory scores a continuation as `pax score` does."""
  peft = pytest.importorskip('peft')
  sft, adapters = str(imported.work / 'sft'), str(imported.work / 'peft')
  sets = [f'INIT_FROM={imported.job!r}', 'LORA_RANK=4', 'LORA_ALPHA=8.0', 'LEARNING_RATE=0.01',
          'LORA_TARGETS=("query","key","value","output","mlp")', 'NUM_TRAIN_STEPS=3', 'MAX_SEQ_LEN=32',
          'PERCORE_BATCH_SIZE=1']
  _ok(['train', '--exp', imported.exp, *[a for s in sets for a in ('--set', s)], '--job-log-dir', sft], capsys)
  out, _ = _ok(['checkpoint', 'convert', sft, adapters, '--to', 'peft', '--exp', imported.exp, '--json'], capsys)
  v = json.loads(out)['verify']
  assert v['ok'] and v['result'].startswith('PEFT\'s LoRA') and v['max_abs_diff'] < 1e-4
  config = json.load(open(os.path.join(adapters, 'adapter_config.json')))
  assert config['target_modules'] == ['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']
  context, continuation = [3, 9, 27, 81, 115, 100], [17, 4, 66]
  requests = imported.work / 'requests.jsonl'
  requests.write_text(json.dumps({'context_ids': context, 'continuation_ids': continuation}) + '\n')
  out, _ = _ok(['score', str(requests), '--exp', imported.exp, *[a for s in sets for a in ('--set', s)],
                '--job-log-dir', sft, '--json'], capsys)
  ours = [json.loads(line) for line in out.splitlines() if line.startswith('{')][0]['logprob']
  tuned = peft.PeftModel.from_pretrained(hf_models.load(imported.hf), adapters).eval()
  theirs = hf_models.log_likelihood(tuned, context, continuation)
  assert abs(ours - theirs) < 1e-4, (ours, theirs)
  assert abs(theirs - hf_models.log_likelihood(imported.model, context, continuation)) > 1e-3   # the adapters act
