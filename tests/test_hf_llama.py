"""`--from hf` for the Llama family as released: Llama 3's rope scaling against a NumPy forward,
the config keys refused by name, and the tokenizer as shipped (ids, special tokens, chat template)."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import pax_main, pax_main_ok
from paxcli.recipes import finetune

# A Llama-3-style config small enough for a test; original_max_position_embeddings 64 with head_dim 16
# and rope_theta 10000 puts rotated pairs in all three llama3 bands (kept, smoothed, divided by factor).
LLAMA3 = dict(finetune.TINY_CONFIG, rope_theta=10000.0, num_hidden_layers=2,
              rope_scaling={'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                            'original_max_position_embeddings': 64})


def _inv_freq(cfg):
  """HF's inv_freq for the config (modeling_rope_utils: default, linear, llama3), written from its formulas."""
  d, theta = cfg['head_dim'], cfg['rope_theta']
  inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
  rope = cfg.get('rope_scaling') or {}
  kind = rope.get('rope_type', rope.get('type'))
  if kind == 'linear':
    return inv / rope['factor']
  if kind != 'llama3':
    return inv
  factor, low, high = rope['factor'], rope['low_freq_factor'], rope['high_freq_factor']
  old = rope['original_max_position_embeddings']
  wavelen = 2 * np.pi / inv
  llama = np.where(wavelen > old / low, inv / factor, inv)
  smooth = (old / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * llama / factor + smooth * llama
  medium = ~(wavelen < old / high) & ~(wavelen > old / low)
  return np.where(medium, smoothed, llama)


def llama_logits(w, cfg, ids):
  """LlamaForCausalLM's forward in float64 (x @ W.T, RMSNorm, rotate_half rotary with _inv_freq, GQA)."""
  h, kv, d, eps = cfg['num_attention_heads'], cfg['num_key_value_heads'], cfg['head_dim'], cfg['rms_norm_eps']
  rms = lambda x, g: g * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))
  rotate_half = lambda x: np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
  b, seq = ids.shape
  freqs = np.outer(np.arange(seq), _inv_freq(cfg))
  cos, sin = np.cos(np.concatenate([freqs, freqs], -1)), np.sin(np.concatenate([freqs, freqs], -1))
  x = w['model.embed_tokens.weight'][ids].astype(np.float64)
  for i in range(cfg['num_hidden_layers']):
    p = f'model.layers.{i}.'
    y = rms(x, w[p + 'input_layernorm.weight'])
    heads = lambda name, n: (y @ w[p + name].T).reshape(b, seq, n, d).transpose(0, 2, 1, 3)
    q, k, v = heads('self_attn.q_proj.weight', h), heads('self_attn.k_proj.weight', kv), heads('self_attn.v_proj.weight', kv)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = np.repeat(k, h // kv, axis=1), np.repeat(v, h // kv, axis=1)
    scores = np.where(np.tril(np.ones((seq, seq), bool)), q @ k.transpose(0, 1, 3, 2) / np.sqrt(d), -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    x = x + (probs @ v).transpose(0, 2, 1, 3).reshape(b, seq, h * d) @ w[p + 'self_attn.o_proj.weight'].T
    y = rms(x, w[p + 'post_attention_layernorm.weight'])
    gate = y @ w[p + 'mlp.gate_proj.weight'].T
    x = x + (gate / (1 + np.exp(-gate)) * (y @ w[p + 'mlp.up_proj.weight'].T)) @ w[p + 'mlp.down_proj.weight'].T
  head = w['model.embed_tokens.weight'] if cfg['tie_word_embeddings'] else w['lm_head.weight']
  return rms(x, w['model.norm.weight']) @ head.T


def write_hf(directory, cfg, seed=0):
  """An HF Llama directory written with the safetensors library itself (config.json + model.safetensors)."""
  os.makedirs(directory, exist_ok=True)
  finetune.write_tiny_llama(str(directory), seed, cfg)   # the shapes; rewritten below by safetensors
  weights = load_file(os.path.join(directory, 'model.safetensors'))
  save_file(weights, os.path.join(directory, 'model.safetensors'), metadata={'format': 'pt'})
  return weights


def _ok(argv, capsys):
  return pax_main_ok(argv, capsys)[0]


@pytest.mark.parametrize('tied', [True, False])
def test_llama3_rope_scaling_matches_a_numpy_forward(tmp_path, capsys, tied):
  from paxcli import config
  from paxcli.convert import core, formats
  cfg = dict(LLAMA3, tie_word_embeddings=tied, vocab_size=96)
  weights = write_hf(tmp_path / 'hf', cfg)
  recipe, out = str(tmp_path / 'r.py'), str(tmp_path / 'job')
  result = json.loads(_ok(['checkpoint', 'convert', '--from', 'hf', str(tmp_path / 'hf'), out, '--recipe', recipe,
                           '--json'], capsys))
  assert result['verify']['ok']
  text = open(recipe).read()
  assert "ROTARY_SCALING = 'llama3'" in text and 'ROTARY_ORIGINAL_MAX_LEN = 64' in text
  assert f'SEPARATE_EMBEDDING = {not tied}' in text and 'NUM_KV_HEADS = 2' in text
  model = core.build_model(config.resolve(f'{recipe}:HfLlama', ['MAX_SEQ_LEN=48']))
  params = core.load_params(formats.open_source(out), [n for n in model.abstract if n.startswith('params/')])
  ids = np.random.default_rng(1).integers(0, 96, (2, 48)).astype(np.int32)
  ours = core.logits(model.module, params, ids)
  np.testing.assert_allclose(ours, llama_logits(weights, cfg, ids), atol=2e-4, rtol=1e-4)
  # the scaling matters here: the same weights without it are far off
  plain = llama_logits(weights, dict(cfg, rope_scaling=None), ids)
  assert np.abs(ours - plain).max() > 1e-2


def test_linear_rope_scaling_and_the_hf_export_writes_it_back(tmp_path, capsys):
  cfg = dict(LLAMA3, rope_scaling={'type': 'linear', 'factor': 4.0})
  write_hf(tmp_path / 'hf', cfg)
  recipe, job, back = str(tmp_path / 'r.py'), str(tmp_path / 'job'), str(tmp_path / 'back')
  _ok(['checkpoint', 'convert', '--from', 'hf', str(tmp_path / 'hf'), job, '--recipe', recipe], capsys)
  assert "ROTARY_SCALING = 'linear'" in open(recipe).read()
  assert json.loads(_ok(['checkpoint', 'convert', job, back, '--to', 'hf', '--json'], capsys))['verify']['ok']
  with open(os.path.join(back, 'config.json')) as f:
    assert json.load(f)['rope_scaling'] == {'rope_type': 'linear', 'factor': 4.0}


def test_function_changing_keys_are_refused_by_name(tmp_path, capsys):
  cfg = dict(LLAMA3, rope_scaling={'rope_type': 'dynamic', 'factor': 4.0}, attention_dropout=0.1,
             quantization_config={'quant_method': 'gptq'}, auto_map={'AutoModel': 'x.Y'},
             pretraining_tp=2, transformers_version='4.45.0', use_cache=True)
  write_hf(tmp_path / 'hf', cfg)
  code, _, err = pax_main(['checkpoint', 'convert', '--from', 'hf', str(tmp_path / 'hf'), str(tmp_path / 'o')], capsys)
  assert code == 2 and 'Traceback' not in err and len(err.strip().splitlines()) == 1, err
  for name in ('rope_scaling {"rope_type": "dynamic"', 'attention_dropout 0.1', 'quantization_config', 'auto_map'):
    assert name in err, (name, err)
  for harmless in ('pretraining_tp', 'transformers_version', 'use_cache'):
    assert harmless not in err
  assert not (tmp_path / 'o').exists()


@pytest.fixture(scope='module')
def shipped(tmp_path_factory):
  """A Llama-3-style tokenizer.json + tokenizer_config.json (eos named there: <|eot_id|>, which no
  name guess would pick), as finetune.write_tokenizer makes it."""
  directory = str(tmp_path_factory.mktemp('tok'))
  records = finetune.example_records(200, seed=0)
  finetune.write_tokenizer(directory, [r['prompt'] + r['completion'] for r in records], 384)
  path = os.path.join(directory, 'tokenizer_config.json')
  config = json.load(open(path))
  json.dump(dict(config, eos_token={'__type': 'AddedToken', 'content': '<|eot_id|>', 'lstrip': False,
                                       'normalized': False, 'rstrip': False, 'single_word': False, 'special': True}), open(path, 'w'))
  return directory


TEXTS = ['Q: What colour is the sky?\nA: The sky is blue.', 'naïve café 東京 🙂 <|eot_id|> tabs\tand  spaces', '']


def test_shipped_tokenizer_gives_the_ids_of_tokenizers_and_autotokenizer(shipped):
  import tokenizers as hf

  from paxcli.inputs import tokenizers
  ours = tokenizers.load(os.path.join(shipped, 'tokenizer.json'))
  theirs = hf.Tokenizer.from_file(os.path.join(shipped, 'tokenizer.json'))
  for text in TEXTS:
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False).ids
  vocab = theirs.get_vocab()
  assert (ours.bos_id, ours.eos_id, ours.bos_first) == (vocab['<|begin_of_text|>'], vocab['<|eot_id|>'], True)
  transformers = pytest.importorskip('transformers')
  auto = transformers.AutoTokenizer.from_pretrained(shipped)
  for text in TEXTS:
    assert auto(text)['input_ids'] == [ours.bos_id] + ours.encode(text)   # BOS first, as transformers adds it
  assert auto.eos_token_id == ours.eos_id


def test_the_shipped_tokenizer_and_chat_template_stay_with_the_converted_model_and_the_job(shipped, tmp_path, capsys):
  hf_dir = tmp_path / 'hf'
  write_hf(hf_dir, LLAMA3)
  for name in ('tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja'):
    (hf_dir / name).write_bytes(open(os.path.join(shipped, name), 'rb').read())
  job = str(tmp_path / 'job')
  _ok(['checkpoint', 'convert', '--from', 'hf', str(hf_dir), job, '--recipe', str(tmp_path / 'r.py'), '--no-verify'],
      capsys)
  from paxcli.jobdir import layout
  assert open(layout.tokenizer(job), 'rb').read() == (hf_dir / 'tokenizer.json').read_bytes()
  kept = json.load(open(layout.tokenizer_config(job)))
  assert kept['chat_template'] == finetune.CHAT_TEMPLATE and kept['eos_token']['content'] == '<|eot_id|>'
  # and out again: an HF export carries the chat template as text, where transformers 5 writes it
  out = str(tmp_path / 'back')
  _ok(['checkpoint', 'convert', job, out, '--to', 'hf', '--no-verify'], capsys)
  assert open(os.path.join(out, 'chat_template.jinja')).read() == finetune.CHAT_TEMPLATE
  assert 'chat_template' not in json.load(open(os.path.join(out, 'tokenizer_config.json')))
