"""Every Hugging Face family held against transformers' own modelling code (LlamaForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM, ...: the entries of tests/hf_models.py REFERENCES).

For each family, one model built by transformers from a released config.json at a reduced size with
random weights (the session's `hf_reference`), imported once with `pax checkpoint convert --from hf`
(this module's fixture). Then: logits (float32, 1e-4), greedy decoding against generate(), `--to hf`
loaded back by transformers, LoRA through `pax train`, `pax eval`, `--to peft` and PEFT against
`pax score` (slow), the certification each conversion returns, and a failed one writing nothing.
"""

import json
import os
import types

import numpy as np
import pytest

import hf_models
from conftest import pax_main, pax_main_ok as _ok

pytest.importorskip('transformers')


def _failed(argv, capsys):
  """A conversion's error: its progress lines, then one line (no traceback) with exit code 2."""
  code, out, err = pax_main(argv, capsys)
  assert code == 2 and 'Traceback' not in err and err.strip().splitlines()[-1].startswith('error: '), err
  return ' '.join(err.strip().splitlines()[-1].split())


@pytest.fixture(scope='module', params=sorted(hf_models.REFERENCES))
def imported(request, hf_reference, tmp_path_factory):
  """The family's reduced transformers model, its save_pretrained directory, and its import into a job."""
  made = hf_reference(request.param)
  work = tmp_path_factory.mktemp(f'imported-{request.param}')
  job, recipe = str(work / 'job'), str(work / 'recipe.py')
  from rich.console import Console

  from paxcli import api
  result = api.convert_checkpoint(made.hf, job, fmt='hf', recipe=recipe, console=Console(quiet=True))
  return types.SimpleNamespace(name=request.param, ref=made.ref, work=work, model=made.model, hf=made.hf, job=job,
                               recipe=recipe, exp=f'{recipe}:{made.ref.recipe_class}', result=result)


def _paxcli_logits(imported, ids):
  from paxcli import config
  from paxcli.convert import core, formats
  model = core.build_model(config.resolve(imported.exp, []))
  params = core.load_params(formats.open_source(imported.job), [n for n in model.abstract if n.startswith('params/')])
  return core.logits(model.module, params, ids)


def test_import_is_certified_by_transformers_and_gives_its_logits(imported):
  v = imported.result['verify']
  assert v['ok'] and v['reference'] == f'transformers {imported.ref.architecture} (float32) on the source'
  assert v['result'] == 'paxcli on the written result' and v['top1_agreement'] == 1.0 and v['max_abs_diff'] < 1e-4
  assert 0 <= v['kl'] <= v['kl_max'] < 1e-8
  text = open(imported.recipe).read()
  heads = () if 'kv_lora_rank' in imported.ref.config else ('NUM_KV_HEADS = 2',)   # latent attention has none
  for line in imported.ref.recipe_lines + heads:
    assert f'  {line}\n' in text, line
  # Other ids than the certificate's, of its shape (2 x 64): paxcli's forward pass is then the program the
  # import's certification compiled, which the persistent compilation cache gives back.
  ids = np.random.default_rng(7).integers(0, 128, (2, 64)).astype(np.int32)
  np.testing.assert_allclose(_paxcli_logits(imported, ids), hf_models.logits(imported.model, ids), atol=1e-4, rtol=0)


def test_greedy_decoding_is_transformers_generate(imported, capsys):
  prompts = [[5, 17, 99, 3], [42], [7, 7, 120, 64, 1, 88, 13]]
  hf_models.check_decoding(pax_main, capsys, imported.exp, imported.job, imported.model, prompts, 8)


def test_export_to_hf_is_certified_and_transformers_loads_the_same_model(imported, capsys):
  back = str(imported.work / 'back')
  out, err = _ok(['checkpoint', 'convert', imported.job, back, '--to', 'hf', '--json'], capsys)
  v = json.loads(out)['verify']
  assert v['ok'] and v['reference'] == 'paxcli on the source' and v['top1_agreement'] == 1.0
  assert v['result'] == f'transformers {imported.ref.architecture} (float32) on the written result'
  config = json.load(open(os.path.join(back, 'config.json')))
  assert config['architectures'] == [imported.ref.architecture] and config['model_type'] == imported.ref.released['model_type']
  again = hf_models.load(back)
  assert type(again).__name__ == imported.ref.architecture
  ids = np.random.default_rng(8).integers(0, 128, (2, 33)).astype(np.int32)
  np.testing.assert_allclose(hf_models.logits(again, ids), hf_models.logits(imported.model, ids), atol=1e-5, rtol=0)


def test_the_printed_certificate_names_both_sides_and_its_numbers(hf_reference, tmp_path, capsys):
  """One family is enough: the printed line is certify.line of the report whose sides each family's
  test_import_is_certified_by_transformers_and_gives_its_logits checks (the architecture named in it)."""
  made = hf_reference('qwen3')
  _, err = _ok(['checkpoint', 'convert', '--from', 'hf', made.hf, str(tmp_path / 'again')], capsys)
  line = ' '.join(err.split())   # the report goes to stderr, as every line of pax checkpoint convert
  assert (f'Certified on 2 fixed prompts x 64 tokens: transformers {made.ref.architecture} (float32) on the '
          'source against paxcli on the written result: max |Δ logit| ') in line
  assert 'top-1 agreement 100.0%: ok' in line and 'tolerance 1e-05' in line


def test_a_conversion_beyond_tolerance_fails_and_writes_nothing(hf_reference, tmp_path, capsys):
  """One family is enough: the check is the same code for all. Here a tolerance no float32 pair meets."""
  made = hf_reference('qwen3')
  job = tmp_path / 'job'
  err = _failed(['checkpoint', 'convert', '--from', 'hf', made.hf, str(job), '--recipe', str(tmp_path / 'r.py'),
                  '--kl-tolerance', '1e-300'], capsys)
  assert 'does not compute the source\'s function, so nothing was written' in err and 'FAILED' in err
  assert 'transformers Qwen3ForCausalLM (float32) on the source' in err
  assert sorted(os.listdir(tmp_path)) == []   # no job, no recipe, no temporary directory left
  _ok(['checkpoint', 'convert', '--from', 'hf', made.hf, str(job), '--recipe', str(tmp_path / 'r.py'), '--no-verify'],
      capsys)
  err = _failed(['checkpoint', 'convert', str(job), str(tmp_path / 'back'), '--to', 'hf', '--kl-tolerance', '1e-300'],
                capsys)
  assert 'nothing was written' in err and 'on the written result' in err
  assert sorted(os.listdir(tmp_path)) == ['job', 'r.py']


def _linear_modules(model, attention_only: bool) -> list:
  """The names of the nn.Linear modules of transformers' first layer (q_proj, ..., or Phi-3's qkv_proj and
  gate_up_proj), as PEFT's target_modules lists them."""
  import torch
  layer = model.model.layers[0]
  names = {n.rsplit('.', 1)[-1] for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)
           and (n.startswith('self_attn.') or not attention_only)}
  return sorted(names)


@pytest.mark.slow
def test_lora_trains_evaluates_and_through_peft_gives_pax_scores_log_likelihood(imported, capsys):
  """LORA_RANK on the imported model, a few steps; pax eval; --to peft (certified by PEFT); PEFT's LoRA on
  transformers' model of the source directory scores a continuation as `pax score` does."""
  peft = pytest.importorskip('peft')
  sft, adapters = str(imported.work / 'sft'), str(imported.work / 'peft')
  targets = ('query', 'key', 'value', 'output') + (() if imported.ref.experts else ('mlp',))   # experts: no adapters
  sets = [f'INIT_FROM={imported.job!r}', 'LORA_RANK=4', 'LORA_ALPHA=8.0', 'LEARNING_RATE=0.01',
          f'LORA_TARGETS={targets!r}', 'NUM_TRAIN_STEPS=3', 'MAX_SEQ_LEN=32', 'PERCORE_BATCH_SIZE=1']
  overrides = [a for s in sets for a in ('--set', s)]
  _ok(['train', '--exp', imported.exp, *overrides, '--job-log-dir', sft], capsys)
  out, _ = _ok(['eval', '--exp', imported.exp, *overrides, '--job-log-dir', sft, '--json'], capsys)
  evaluated = json.loads(out)
  assert evaluated['step'] == 3 and np.isfinite(evaluated['results']['eval']['loss'])
  out, _ = _ok(['checkpoint', 'convert', sft, adapters, '--to', 'peft', '--exp', imported.exp, '--json'], capsys)
  v = json.loads(out)['verify']
  assert v['ok'] and v['result'].startswith('PEFT\'s LoRA') and v['max_abs_diff'] < 1e-4
  config = json.load(open(os.path.join(adapters, 'adapter_config.json')))
  assert config['target_modules'] == _linear_modules(imported.model, attention_only=imported.ref.experts)
  context, continuation = [3, 9, 27, 81, 115, 100], [17, 4, 66]
  requests = imported.work / 'requests.jsonl'
  requests.write_text(json.dumps({'context_ids': context, 'continuation_ids': continuation}) + '\n')
  out, _ = _ok(['score', str(requests), '--exp', imported.exp, *overrides, '--job-log-dir', sft, '--json'], capsys)
  ours = [json.loads(line) for line in out.splitlines() if line.startswith('{')][0]['logprob']
  tuned = peft.PeftModel.from_pretrained(hf_models.load(imported.hf), adapters).eval()
  theirs = hf_models.log_likelihood(tuned, context, continuation)
  assert abs(ours - theirs) < 1e-4, (ours, theirs)
  assert abs(theirs - hf_models.log_likelihood(imported.model, context, continuation)) > 1e-3   # the adapters act
