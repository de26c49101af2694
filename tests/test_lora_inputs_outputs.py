"""LoRA runs in and out, as received files (issue 33): a PEFT adapter directory (LORA_INIT) made by PEFT
itself is read only when paxcli computes what PEFT would (every adapter_config.json field that changes
the function is refused by name; a lora_A of another shape is never reshaped; a FIFO or deeply nested
config is one line), and `pax checkpoint convert` never writes over the run's base, through a symlink
or not, for --merge-lora, --to peft and --to hf."""

import hashlib
import json
import os
import shutil

import numpy as np
import pytest
from rich.console import Console

from conftest import pax_main, run_pax

EXP = 'lm_cloud.LmCloudSpmdTest'
QUIET = Console(quiet=True)
LLAMA = ['MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=4', 'NUM_KV_HEADS=2', 'PERCORE_BATCH_SIZE=1', 'MAX_SEQ_LEN=16',
         'VOCAB_SIZE=64', 'NUM_LAYERS=2', 'NORM_TYPE="rmsnorm"', 'USE_GATED_ACTIVATION=True', 'ACTIVATION="silu"',
         'POSITION_EMBEDDING="rotary"', 'USE_BIAS=False', 'SEPARATE_EMBEDDING=True']
MODULES = ['q_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']   # LORA_TARGETS below


def _lora(base: str, *more: str) -> list:
  return LLAMA + ['LORA_RANK=4', 'LORA_ALPHA=8.0', 'LORA_TARGETS=("query","value","output","mlp")',
                  f'INIT_FROM={base!r}', *more]


def _sets(overrides):
  return [a for o in overrides for a in ('--set', o)]


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """(work dir, base job, LoRA job): one step each, a checkpoint each."""
  import paxcli
  work = tmp_path_factory.mktemp('lora_io')
  base, tuned = str(work / 'base'), str(work / 'lora')
  paxcli.train(EXP, job_dir=base, overrides=LLAMA + ['NUM_TRAIN_STEPS=1', 'SAVE_INTERVAL_STEPS=1'], console=QUIET)
  paxcli.train(EXP, job_dir=tuned, overrides=_lora(base, 'NUM_TRAIN_STEPS=1', 'SAVE_INTERVAL_STEPS=1'),
               console=QUIET)
  return work, base, tuned


def _tree_digest(path) -> dict:
  out = {}
  for root, _, names in os.walk(path):
    for name in names:
      full = os.path.join(root, name)
      out[os.path.relpath(full, path)] = hashlib.sha256(open(full, 'rb').read()).hexdigest()
  return out


# ---- convert never writes over the base ------------------------------------------------------------


@pytest.mark.parametrize('to', [['--merge-lora'], ['--to', 'peft'], ['--to', 'hf']])
def test_convert_never_replaces_the_runs_base(to, runs, tmp_path, capsys):
  work, base, tuned = runs
  before = _tree_digest(base)
  os.symlink(base, tmp_path / 'LINK')                  # a link to the base job
  os.symlink(os.path.dirname(base), tmp_path / 'up')   # a link to the directory holding it
  for output in (tmp_path / 'LINK', tmp_path / 'up' / os.path.basename(base), base,
                 os.path.join(base, 'merged')):
    code, out, err = pax_main(['checkpoint', 'convert', tuned, str(output), *to, '--force'], capsys)
    text = ' '.join(err.split())
    assert code == 2 and 'Traceback' not in err and len(err.strip().splitlines()) == 1, err
    assert 'would be inside or over the base of the LoRA run' in text, err
  assert _tree_digest(base) == before
  assert os.path.islink(tmp_path / 'LINK') and sorted(os.listdir(tmp_path)) == ['LINK', 'up']


# ---- PEFT adapters made by PEFT ----------------------------------------------------------------------


def _peft_dir(path, **config):
  """save_pretrained of PEFT's LoRA on a transformers Llama of LLAMA's shape."""
  import torch
  import transformers
  from peft import LoraConfig, get_peft_model
  torch.manual_seed(0)
  llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=8, max_position_embeddings=16, tie_word_embeddings=False))
  settings = dict(r=4, lora_alpha=8, target_modules=MODULES, init_lora_weights=False)
  settings.update(config)
  get_peft_model(llama, LoraConfig(**settings)).save_pretrained(str(path))
  return str(path)


VARIANTS = {
    'layers_to_transform': dict(layers_to_transform=[0]),
    'rank_pattern': dict(rank_pattern={'q_proj': 2}),
    'alpha_pattern': dict(alpha_pattern={'v_proj': 32}),
    'modules_to_save': dict(modules_to_save=['lm_head']),
    'bias': dict(bias='lora_only'),
    'use_dora': dict(use_dora=True),
    'use_rslora': dict(use_rslora=True),
    'target_modules': dict(target_modules=MODULES + ['k_proj']),
}


@pytest.fixture(scope='module')
def adapters(tmp_path_factory):
  work = tmp_path_factory.mktemp('peft')
  made = {name: _peft_dir(work / name, **config) for name, config in VARIANTS.items()}
  made['plain'] = _peft_dir(work / 'plain')
  return made


def _train_with(runs, adapter, capsys):
  work, base, _ = runs
  job = str(work / f'job-{len(os.listdir(work))}')
  code, out, err = pax_main(['train', '--exp', EXP, *_sets(_lora(base, f'LORA_INIT={adapter!r}', 'NUM_TRAIN_STEPS=1')),
                             '--job-log-dir', job], capsys)
  return code, out, err, job


def _refused(code, err, *phrases):
  text = ' '.join(err.split())
  assert code == 2 and 'Traceback' not in err and len(err.strip().splitlines()) == 1, err[-3000:]
  for phrase in phrases:
    assert phrase in text, (phrase, err)


@pytest.mark.parametrize('field', sorted(VARIANTS))
def test_a_peft_setting_paxcli_does_not_compute_is_refused_by_name(field, runs, adapters, capsys):
  code, out, err, job = _train_with(runs, adapters[field], capsys)
  _refused(code, err, 'adapter_config.json: ' + field)
  assert not os.path.exists(os.path.join(job, 'checkpoints', '1'))


def test_a_plain_peft_adapter_loads_as_peft_saved_it(runs, adapters):
  """The adapters PEFT saved are the run's first adapters, value for value (A and B transposed)."""
  from safetensors.numpy import load_file

  import paxcli
  from paxcli.convert import lora
  from paxcli.runtime import engine
  work, base, _ = runs
  saved = load_file(os.path.join(adapters['plain'], 'adapter_model.safetensors'))
  setup = engine.build(paxcli.config.resolve(EXP, _lora(base)))
  got = lora.read_peft(adapters['plain'], setup.model, setup.abstract_state['params'])
  a = got['layer_1']['attention']['query_lora_a']   # [D, r]
  np.testing.assert_array_equal(a.reshape(-1, 4).T, saved['base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight'])
  b = got['layer_0']['mlp']['wo_lora_b']   # [r, D]
  np.testing.assert_array_equal(b.T, saved['base_model.model.model.layers.0.mlp.down_proj.lora_B.weight'])


def test_a_plain_peft_adapter_trains_from_the_cli(runs, adapters, capsys):
  code, out, err, _ = _train_with(runs, adapters['plain'], capsys)
  assert code == 0 and 'LoRA adapters from' in out + err, err[-3000:]


def _edited_copy(adapters, tmp_path, edit_config=None, edit_weights=None):
  from safetensors.numpy import load_file, save_file
  path = tmp_path / 'adapter'
  shutil.copytree(adapters['plain'], path)
  if edit_config:
    config = json.loads((path / 'adapter_config.json').read_text())
    (path / 'adapter_config.json').write_text(json.dumps(edit_config(config)))
  if edit_weights:
    weights = load_file(str(path / 'adapter_model.safetensors'))
    save_file(edit_weights(weights), str(path / 'adapter_model.safetensors'), metadata={'format': 'pt'})
  return str(path)


def test_a_lora_a_of_another_shape_is_refused_never_reshaped(runs, adapters, tmp_path, capsys):
  key = 'base_model.model.model.layers.0.mlp.down_proj.lora_A.weight'   # [4, 64]: r x HIDDEN_DIMS

  def reshape(weights):
    assert weights[key].shape == (4, 64)
    return dict(weights, **{key: weights[key].reshape(8, 32)})

  code, _, err, _ = _train_with(runs, _edited_copy(adapters, tmp_path, edit_weights=reshape), capsys)
  _refused(code, err, key, 'has shape [8, 32]', 'needs [4, 64]')


def test_an_unknown_config_field_or_an_extra_array_is_refused(runs, adapters, tmp_path, capsys):
  path = _edited_copy(adapters, tmp_path, edit_config=lambda c: dict(c, shiny_new_option=True))
  code, _, err, _ = _train_with(runs, path, capsys)
  _refused(code, err, 'shiny_new_option', 'unknown to paxcli')
  extra = 'base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight'
  shutil.rmtree(path)
  path = _edited_copy(adapters, tmp_path, edit_weights=lambda w: dict(w, **{extra: np.zeros((4, 32), np.float32)}))
  code, _, err, _ = _train_with(runs, path, capsys)
  _refused(code, err, 'would not apply', extra)


def test_a_nested_adapter_config_is_one_line(runs, adapters, tmp_path, capsys):
  path = _edited_copy(adapters, tmp_path)
  with open(os.path.join(path, 'adapter_config.json'), 'w') as f:
    f.write('[' * 100_000)
  code, _, err, _ = _train_with(runs, path, capsys)
  _refused(code, err, 'adapter_config.json', 'nested too deeply')


def test_an_adapter_config_that_is_a_fifo_is_one_line_not_a_hang(runs, adapters, tmp_path):
  work, base, _ = runs
  path = _edited_copy(adapters, tmp_path)
  os.remove(os.path.join(path, 'adapter_config.json'))
  os.mkfifo(os.path.join(path, 'adapter_config.json'))
  done = run_pax('train', '--exp', EXP, *_sets(_lora(base, f'LORA_INIT={path!r}', 'NUM_TRAIN_STEPS=1')),
                 '--job-log-dir', str(tmp_path / 'job'), timeout=300)
  _refused(done.returncode, done.stderr, 'adapter_config.json', 'is a FIFO')
