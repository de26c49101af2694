"""The text model of a Gemma3ForConditionalGeneration checkpoint (model_type gemma3: gemma-3-4b, 12b, 27b) through
`pax checkpoint convert --from hf`, held against transformers' own Gemma3ForConditionalGeneration.

One model built by transformers from gemma-3-4b's released config.json (its text_config, which leaves most
keys to transformers' defaults, at a reduced size, and a tiny SigLIP vision tower), saved with save_pretrained
(transformers writes the released files' spelling, `language_model.model.layers.N...`), and a copy of it with
the weights renamed to later transformers' spelling (`model.language_model.layers.N...`).
"""

import io
import json
import os
import shutil
import types

import numpy as np
import pytest

import hf_models
from conftest import pax_main, pax_main_ok as _ok

pytest.importorskip('transformers')

# huggingface.co/google/gemma-3-4b-it/config.json as released (transformers 4.50).
GEMMA3_4B_MULTIMODAL = {
    'architectures': ['Gemma3ForConditionalGeneration'], 'boi_token_index': 255999, 'eoi_token_index': 256000,
    'eos_token_id': [1, 106], 'image_token_index': 262144, 'initializer_range': 0.02, 'mm_tokens_per_image': 256,
    'model_type': 'gemma3',
    'text_config': {'hidden_size': 2560, 'intermediate_size': 10240, 'model_type': 'gemma3_text',
                    'num_hidden_layers': 34, 'rope_scaling': {'factor': 8.0, 'rope_type': 'linear'},
                    'sliding_window': 1024},
    'torch_dtype': 'bfloat16', 'transformers_version': '4.50.0.dev0',
    'vision_config': {'hidden_size': 1152, 'image_size': 896, 'intermediate_size': 4304,
                      'model_type': 'siglip_vision_model', 'num_attention_heads': 16, 'num_hidden_layers': 27,
                      'patch_size': 14, 'vision_use_head': False}}
# The reduced sizes. What the released text_config leaves out stays transformers' default (query_pre_attn_scalar
# 256, not head_dim; rope_theta 1e6; max_position_embeddings 131072; tied embeddings): the logits depend on them.
TEXT_SIZES = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=128, sliding_window=7)
VISION = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=1, image_size=28,
              patch_size=14)
CONFIG = {**GEMMA3_4B_MULTIMODAL, 'mm_tokens_per_image': 4,
          'text_config': {**GEMMA3_4B_MULTIMODAL['text_config'], **TEXT_SIZES},
          'vision_config': {**GEMMA3_4B_MULTIMODAL['vision_config'], **VISION}}
# transformers 4.5x's prefixes (the released files') -> later transformers'.
NEW_SPELLING = (('language_model.model.', 'model.language_model.'), ('language_model.lm_head.', 'lm_head.'),
                ('vision_tower.', 'model.vision_tower.'), ('multi_modal_projector.', 'model.multi_modal_projector.'))


def _respell(src: str, dst: str) -> list:
  """A copy of the save_pretrained directory `src` with its weights under later transformers' names."""
  from safetensors.numpy import load_file, save_file
  os.makedirs(dst)
  shutil.copy(os.path.join(src, 'config.json'), dst)
  arrays = load_file(os.path.join(src, 'model.safetensors'))
  renamed = {next((new + k[len(old):] for old, new in NEW_SPELLING if k.startswith(old)), k): v
             for k, v in arrays.items()}
  save_file(renamed, os.path.join(dst, 'model.safetensors'), metadata={'format': 'pt'})
  return sorted(renamed)


@pytest.fixture(scope='module')
def mm(tmp_path_factory):
  """transformers' reduced Gemma3ForConditionalGeneration, its directory in both spellings, and the certified
  import of the released spelling into a job (with what the conversion printed)."""
  from rich.console import Console

  from paxcli import api
  work = tmp_path_factory.mktemp('gemma3mm')
  model = hf_models.build(CONFIG)
  old = hf_models.save(model, str(work / 'hf-old'))
  new = str(work / 'hf-new')
  new_names = _respell(old, new)
  job, recipe, printed = str(work / 'job'), str(work / 'recipe.py'), io.StringIO()
  result = api.convert_checkpoint(old, job, fmt='hf', recipe=recipe, console=Console(file=printed, width=400))
  return types.SimpleNamespace(model=model, old=old, new=new, new_names=new_names, job=job, recipe=recipe,
                               exp=f'{recipe}:HfGemma3', result=result, printed=printed.getvalue(), work=work)


def _paxcli_logits(exp, job, ids):
  from paxcli import config
  from paxcli.convert import core, formats
  model = core.build_model(config.resolve(exp, []))
  params = core.load_params(formats.open_source(job), [n for n in model.abstract if n.startswith('params/')])
  return core.logits(model.module, params, ids)


def test_text_defaults_are_transformers_gemma3_text_config():
  """What paxcli fills into a released text_config is what transformers' own Gemma3TextConfig fills in."""
  import transformers

  from paxcli.models import gemma3
  theirs = transformers.Gemma3TextConfig()
  rope = theirs.rope_parameters
  for key, value in gemma3.TEXT_DEFAULTS.items():
    if key == 'rope_theta':
      assert value == rope['full_attention']['rope_theta'] and rope['full_attention']['rope_type'] == 'default'
    elif key == 'rope_local_base_freq':
      assert value == rope['sliding_attention']['rope_theta']
    elif key == 'sliding_window_pattern':
      assert value == theirs._sliding_window_pattern
    else:
      assert getattr(theirs, key) == value, key


def test_the_text_model_imports_certified_by_gemma3_for_conditional_generation(mm):
  v = mm.result['verify']
  assert v['ok'] and v['reference'] == 'transformers Gemma3ForConditionalGeneration (float32) on the source'
  assert v['top1_agreement'] == 1.0 and v['max_abs_diff'] < 1e-4
  printed = ' '.join(mm.printed.split())
  assert ('is a Gemma3ForConditionalGeneration: paxcli reads its text model (a Gemma 3, written back by --to hf as '
          'Gemma3ForCausalLM) and skips its vision tower and multimodal projector (') in printed
  text = open(mm.recipe).read()
  assert 'skips its vision tower' in text.split('NOTES = ')[1].splitlines()[0]
  for line in ("LAYER_PATTERN = ('local', 'local', 'local', 'local', 'local', 'global')", 'USE_QK_NORM = True',
               "ROTARY_SCALING = 'linear'", 'ROTARY_MAX_TIMESCALE = 1000000.0', 'QUERY_PRE_ATTN_SCALAR = 256.0',
               'MAX_SEQ_LEN = 131072', 'SEPARATE_EMBEDDING = False', 'NUM_KV_HEADS = 2'):
    assert f'  {line}\n' in text, line
  ids = np.random.default_rng(7).integers(0, 128, (3, 40)).astype(np.int32)
  np.testing.assert_allclose(_paxcli_logits(mm.exp, mm.job, ids), hf_models.logits(mm.model, ids), atol=1e-4, rtol=0)


def test_greedy_decoding_is_gemma3_for_conditional_generation_generate(mm, capsys):
  prompts = [[5, 17, 99, 3], [7, 7, 120, 64, 1, 88, 13]]
  hf_models.check_decoding(pax_main, capsys, mm.exp, mm.job, mm.model, prompts, 8)


def test_both_spellings_of_the_language_model_read_the_same_weights(mm):
  """transformers 4.5x's names (language_model.model.layers.N...) and later ones (model.language_model.layers.N...)
  are the same text model to paxcli; transformers itself loads the renamed copy to the same model."""
  from paxcli.convert import hf
  assert any(n.startswith('model.language_model.layers.0.') for n in mm.new_names)
  assert not any(n.startswith('language_model.') for n in mm.new_names)
  old, new = hf.HfSource(mm.old), hf.HfSource(mm.new)
  assert old.knobs() == new.knobs() and new.notes == [n.replace(mm.old, mm.new) for n in old.notes]
  names = sorted(a.name for a in old.arrays())
  assert names == sorted(a.name for a in new.arrays())
  assert 'model.layers.5.self_attn.q_norm.weight' in names and not any('vision' in n for n in names)
  for name in names:
    np.testing.assert_array_equal(old.read(name), new.read(name))
  ids = np.random.default_rng(3).integers(0, 128, (1, 20))
  np.testing.assert_array_equal(hf_models.logits(hf_models.load(mm.new), ids), hf_models.logits(mm.model, ids))


def test_export_to_hf_writes_gemma3_for_causal_lm_of_the_text_model(mm, capsys):
  back = str(mm.work / 'back')
  out, _ = _ok(['checkpoint', 'convert', mm.job, back, '--to', 'hf', '--json'], capsys)
  v = json.loads(out)['verify']
  assert v['ok'] and v['result'] == 'transformers Gemma3ForCausalLM (float32) on the written result'
  config = json.load(open(os.path.join(back, 'config.json')))
  assert config['architectures'] == ['Gemma3ForCausalLM'] and config['model_type'] == 'gemma3_text'
  again = hf_models.load(back)
  assert type(again).__name__ == 'Gemma3ForCausalLM'
  ids = np.random.default_rng(8).integers(0, 128, (2, 33)).astype(np.int32)
  np.testing.assert_allclose(hf_models.logits(again, ids), hf_models.logits(mm.model, ids), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_the_later_spelling_imports_certified_too(mm, tmp_path):
  from rich.console import Console

  from paxcli import api
  printed = io.StringIO()
  result = api.convert_checkpoint(mm.new, str(tmp_path / 'job'), fmt='hf', recipe=str(tmp_path / 'r.py'),
                                  console=Console(file=printed, width=400))
  assert result['verify']['ok'] and result['verify']['max_abs_diff'] < 1e-4
  assert 'skips its vision tower and multimodal projector' in printed.getvalue()
  ids = np.random.default_rng(9).integers(0, 128, (2, 24)).astype(np.int32)
  np.testing.assert_allclose(_paxcli_logits(f'{tmp_path / "r.py"}:HfGemma3', str(tmp_path / 'job'), ids),
                             hf_models.logits(mm.model, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize('change, says', [
    ({'text_config': {**CONFIG['text_config'], 'attn_logit_softcapping': 50.0}},
     'config.json text_config: this Gemma 3 config cannot be expressed in paxcli: attn_logit_softcapping 50.0'),
    ({'text_config': {**CONFIG['text_config'], 'use_laurel': True}},
     'config.json text_config: this Gemma 3 config cannot be expressed in paxcli: use_laurel (unknown to paxcli'),
    ({'text_config': {**CONFIG['text_config'], 'num_key_value_heads': 3}},
     'config.json text_config: num_attention_heads 4 is not a multiple of num_key_value_heads 3'),
    ({'text_config': {**CONFIG['text_config'], 'model_type': 'gemma3n_text'}},
     'config.json: text_config has model_type "gemma3n_text"; paxcli reads the text model of a Gemma 3'),
    ({'text_config': [1, 2]}, 'config.json: text_config is [1, 2]; a Gemma3ForConditionalGeneration config.json'),
    ({'text_config': {**CONFIG['text_config'], 'tie_word_embeddings': False}, 'tie_word_embeddings': True},
     'config.json: tie_word_embeddings is true but text_config\'s is false; make them agree'),
    ({'audio_config': {}}, 'this Gemma3ForConditionalGeneration config cannot be read by paxcli: audio_config '
                           '(unknown to paxcli'),
])
def test_a_bad_text_config_is_refused_by_name(mm, tmp_path, capsys, change, says):
  directory = tmp_path / 'hf'
  os.makedirs(directory)
  shutil.copy(os.path.join(mm.old, 'model.safetensors'), directory)
  err = _refused_in(directory, {**CONFIG, **change}, capsys)
  assert err.startswith('error: ') and says in err, err


def _refused_in(directory, config, capsys) -> str:
  json.dump(config, open(os.path.join(directory, 'config.json'), 'w'))
  job = str(directory) + '-job'
  code, _, err = pax_main(['checkpoint', 'convert', '--from', 'hf', str(directory), job], capsys)
  assert code == 2 and 'Traceback' not in err, err
  assert not os.path.exists(job)
  return ' '.join(err.strip().splitlines()[-1].split())


@pytest.mark.slow
def test_the_imported_text_model_trains_with_lora_and_peft_on_its_causal_lm_gives_pax_scores(mm, capsys):
  """describe says gemma3; LoRA trains and evaluates; --to peft does not name the multimodal source as the base
  (PEFT would find none of the adapters' modules there) and, with --base-model the base's --to hf export
  (Gemma3ForCausalLM), PEFT's LoRA scores a continuation as `pax score` does."""
  peft = pytest.importorskip('peft')
  out, _ = _ok(['describe', '--exp', mm.exp], capsys)
  assert '# model family: gemma3' in out
  sft, base_hf = str(mm.work / 'sft'), str(mm.work / 'base-hf')
  sets = [f'INIT_FROM={mm.job!r}', 'LORA_RANK=4', 'LORA_ALPHA=8.0', 'LEARNING_RATE=0.01', 'NUM_TRAIN_STEPS=2',
          'MAX_SEQ_LEN=32', 'PERCORE_BATCH_SIZE=1', 'LORA_TARGETS=("query","key","value","output","mlp")']
  overrides = [a for s in sets for a in ('--set', s)]
  _ok(['train', '--exp', mm.exp, *overrides, '--job-log-dir', sft], capsys)
  out, _ = _ok(['eval', '--exp', mm.exp, *overrides, '--job-log-dir', sft, '--json'], capsys)
  assert json.loads(out)['step'] == 2 and np.isfinite(json.loads(out)['results']['eval']['loss'])
  _, err = _ok(['checkpoint', 'convert', sft, str(mm.work / 'peft-default'), '--to', 'peft', '--exp', mm.exp], capsys)
  assert 'is a Gemma3ForConditionalGeneration, whose modules are named otherwise' in ' '.join(err.split())
  config = json.load(open(mm.work / 'peft-default' / 'adapter_config.json'))
  assert config['base_model_name_or_path'] != mm.old
  _ok(['checkpoint', 'convert', mm.job, base_hf, '--to', 'hf'], capsys)
  adapters = str(mm.work / 'peft')
  out, _ = _ok(['checkpoint', 'convert', sft, adapters, '--to', 'peft', '--exp', mm.exp, '--base-model', base_hf,
                '--json'], capsys)
  assert json.loads(out)['verify']['ok']
  context, continuation = [3, 9, 27, 81, 115, 100], [17, 4, 66]
  requests = mm.work / 'requests.jsonl'
  requests.write_text(json.dumps({'context_ids': context, 'continuation_ids': continuation}) + '\n')
  out, _ = _ok(['score', str(requests), '--exp', mm.exp, *overrides, '--job-log-dir', sft, '--json'], capsys)
  ours = [json.loads(line) for line in out.splitlines() if line.startswith('{')][0]['logprob']
  tuned = peft.PeftModel.from_pretrained(hf_models.load(base_hf), adapters).eval()
  theirs = hf_models.log_likelihood(tuned, context, continuation)
  assert abs(ours - theirs) < 1e-4, (ours, theirs)
  assert abs(theirs - hf_models.log_likelihood(mm.model, context, continuation)) > 1e-3   # the adapters act

def test_inspect_lists_the_text_model_and_says_what_it_leaves_out(mm, capsys):
  out, _ = _ok(['checkpoint', 'inspect', mm.new, '--json'], capsys)
  info = json.loads(out)
  names = [a['name'] for a in info['arrays']]
  assert 'model.layers.0.self_attn.q_proj.weight' in names and not any('vision' in n for n in names)
  assert len(info['notes']) == 1 and 'skips its vision tower and multimodal projector' in info['notes'][0]


@pytest.mark.parametrize('text, says', [
    ('{"model_type": "gemma3", "text_config": {"rms_norm_eps": NaN}}', 'config.json: NaN is not a JSON number.'),
    ('{"model_type": "gemma3", "text_config": ' + '[' * 200 + ']' * 200 + '}', 'config.json: JSON nested'),
    ('{"model_type": "gemma3",', 'config.json: not valid JSON (column '),
])
def test_config_json_is_parsed_bounded_and_strict(mm, tmp_path, capsys, text, says):
  """config.json someone else wrote: no NaN, bounded nesting, one line for bad JSON (paxcli.files.parse_json)."""
  directory = tmp_path / 'hf'
  os.makedirs(directory)
  shutil.copy(os.path.join(mm.old, 'model.safetensors'), directory)
  (directory / 'config.json').write_text(text)
  code, _, err = pax_main(['checkpoint', 'inspect', str(directory)], capsys)
  assert code == 2 and 'Traceback' not in err and says in ' '.join(err.split()), err
