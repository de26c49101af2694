"""The Gemma families beyond what tests/test_hf_families.py holds against transformers: the recipes at
released sizes, config.json as released and as transformers 5 writes it, refusals by name, and the
blockwise kernel that soft-capped attention runs on (values, gradients, and no L x L logits)."""

import re
import types

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import hf_models
from conftest import pax_main
from paxcli.errors import UserError
from paxcli.layers import attention_ops
from paxcli.models import registry
from paxcli.models.knobs import LM_KNOBS, effective


@pytest.mark.slow
@pytest.mark.parametrize('recipe, released', [('Gemma2_9B', hf_models.GEMMA2_9B), ('Gemma3_4B', hf_models.GEMMA3_4B)])
def test_recipes_count_the_released_models_parameters(recipe, released, capsys):
  """pax describe's count equals transformers' own model of the released config.json (and the model card's)."""
  pytest.importorskip('transformers')
  code, out, err = pax_main(['describe', '--exp', f'gemma.{recipe}'], capsys)
  assert code == 0, err
  shown = int(re.search(r'# parameters: .*\(([\d,]+)\)', out).group(1).replace(',', ''))
  assert shown == hf_models.parameter_count(released) == {'Gemma2_9B': 9_241_705_984, 'Gemma3_4B': 3_880_263_168}[recipe]
  assert f'# model family: {registry.by_name(recipe[:6].lower()).name}' in out


def _knobs(config):
  return registry.for_hf_config(config, 'hf').from_hf_config(config, 'hf')[0]


def test_released_config_and_transformers_5_spelling_read_alike():
  """gemma-3-4b's released keys (rope_local_base_freq, rope_scaling, sliding_window_pattern) and what
  transformers 5 makes of them (layer_types, rope_parameters per layer type) are the same model."""
  transformers = pytest.importorskip('transformers')
  for released in (hf_models.GEMMA2_9B, hf_models.GEMMA3_4B):
    settings = dict(released)
    rewritten = transformers.AutoConfig.for_model(settings.pop('model_type'), **settings).to_dict()
    rewritten = {k: v for k, v in rewritten.items() if k in released or k in ('layer_types', 'rope_parameters')}
    assert 'layer_types' in rewritten
    assert _knobs(released) == _knobs(rewritten)
  gemma3 = _knobs(hf_models.GEMMA3_4B)
  assert len(gemma3['LAYER_PATTERN']) == 34 and gemma3['LAYER_PATTERN'][5::6] == ('global',) * 5
  assert gemma3['LAYER_KINDS'] == {'local': {'SLIDING_WINDOW': 1024, 'ROTARY_MAX_TIMESCALE': 10000.0,
                                             'ROTARY_SCALING': 'none', 'ROTARY_SCALING_FACTOR': 1.0}}
  assert (gemma3['ROTARY_SCALING'], gemma3['ROTARY_SCALING_FACTOR'], gemma3['ROTARY_MAX_TIMESCALE']) == ('linear', 8.0, 1e6)
  twelve = _knobs(dict(hf_models.GEMMA3_4B, num_hidden_layers=12))
  assert twelve['LAYER_PATTERN'] == ('local',) * 5 + ('global',)   # whole groups: the shortest that repeats


@pytest.mark.parametrize('family, change, named', [
    ('gemma2', {'hidden_activation': 'gelu'}, 'hidden_activation "gelu"'),
    ('gemma2', {'rope_scaling': {'rope_type': 'yarn', 'factor': 2.0}}, 'rope_scaling {"rope_type": "yarn"'),
    ('gemma2', {'attention_bias': True}, 'attention_bias true'),
    ('gemma2', {'layer_types': ['sliding_attention', 'chunked_attention'], 'num_hidden_layers': 2}, 'layer_types must'),
    ('gemma3', {'attn_logit_softcapping': 50.0}, 'attn_logit_softcapping 50.0'),
    ('gemma3', {'quantization_config': {'quant_method': 'gptq'}}, 'quantization_config (unknown to paxcli'),
])
def test_what_a_gemma_cannot_be_is_refused_by_name(family, change, named):
  released = {'gemma2': hf_models.GEMMA2_9B, 'gemma3': hf_models.GEMMA3_4B}[family]
  with pytest.raises(UserError) as e:
    _knobs({**released, **change})
  assert named in str(e.value) and '\n' not in str(e.value)


def test_each_gemma_fits_its_own_family_and_not_the_other():
  view = lambda knobs: types.SimpleNamespace(**effective(knobs, LM_KNOBS))
  gemma2, gemma3 = view(_knobs(hf_models.GEMMA2_9B)), view(_knobs(hf_models.GEMMA3_4B))
  assert registry.fits(gemma2)[0] == [registry.by_name('gemma2')] and registry.fits(gemma3)[0] == [registry.by_name('gemma3')]
  assert any('USE_QK_NORM=False' in r for r in registry.by_name('gemma2').misfit(gemma3))
  assert any('no soft caps' in r for r in registry.by_name('gemma3').misfit(gemma2))
  # rotary bases per kind are Gemma 3's: Gemma 2's layers differ only in their window
  assert any('ROTARY' in r or 'rotary' in r for r in registry.by_name('gemma2').misfit(
      view({**_knobs(hf_models.GEMMA2_9B), 'LAYER_KINDS': {'local': {'SLIDING_WINDOW': 8, 'ROTARY_MAX_TIMESCALE': 1e4}},
            'ROTARY_MAX_TIMESCALE': 1e6})))


def _qkv(l, seed=0, h=4, k=2, e=8):
  rng = np.random.default_rng(seed)
  q, kk, v = (jnp.asarray(rng.normal(size=(2, l, n, e)) * 2, jnp.float32) for n in (h, k, k))
  return q, kk, v


@pytest.mark.parametrize('cap', [0.0, 1.5])
def test_the_blockwise_kernel_is_the_einsum_reference_values_and_gradients(cap):
  """Several blocks, the last one short, packing, Gemma's query scale and a soft cap that bites."""
  q, k, v = _qkv(45)
  segments = jnp.asarray(np.repeat([[1] * 20 + [2] * 25, [1] * 45], 1, axis=0), jnp.int32)
  ours = jax.jit(lambda q, k, v: attention_ops.blockwise_attention(q, k, v, segments, cap, scale=0.1, block_q=16))
  ref = jax.jit(lambda q, k, v: attention_ops.einsum_attention(q, k, v, segments, cap, scale=0.1))
  np.testing.assert_allclose(ours(q, k, v), ref(q, k, v), atol=2e-6)
  loss = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2)))(q, k, v)
  for a, b in zip(loss(ours), loss(ref)):
    np.testing.assert_allclose(a, b, atol=2e-5)
  if cap:   # the cap acts here: without it the function is another
    assert np.abs(ref(q, k, v) - attention_ops.einsum_attention(q, k, v, segments, 0.0, scale=0.1)).max() > 1e-2


def _largest_float32(jaxpr) -> int:
  """The most elements of any float32 value in a jaxpr (its sub-jaxprs included)."""
  sizes = []

  def walk(jp):
    for eqn in jp.eqns:
      sizes.extend(int(np.prod(o.aval.shape)) for o in eqn.outvars if getattr(o.aval, 'dtype', None) == jnp.float32)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(jaxpr.jaxpr)
  return max(sizes)


def _with_grad(fn, *args):
  return jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=tuple(range(len(args)))))(*args)


def test_capped_attention_never_holds_the_whole_float32_logits():
  """auto with a cap runs the blockwise kernel: no value of B x H x L x L float32 logits in either pass
  (the einsum reference has one)."""
  l = 512
  q, k, v = _qkv(l, e=8)
  whole = 2 * 4 * l * l
  capped = lambda q, k, v: attention_ops.attention(q, k, v, None, 'auto', 50.0)
  assert _largest_float32(_with_grad(lambda q, k, v: attention_ops.attention(q, k, v, None, 'einsum', 50.0), q, k, v)) >= whole
  assert _largest_float32(_with_grad(capped, q, k, v)) <= whole // 4


GEMMA_TOKENIZER_CONFIG = {'add_bos_token': True, 'add_eos_token': False, 'bos_token': '<bos>', 'eos_token': '<eos>',
                          'pad_token': '<pad>', 'unk_token': '<unk>', 'tokenizer_class': 'GemmaTokenizer'}


def _gemma_sentencepiece(path: str):
  """A sentencepiece model with Gemma's layout: BPE, byte fallback, <pad> 0, <eos> 1, <bos> 2, <unk> 3."""
  import io

  import sentencepiece as spm
  model = io.BytesIO()
  text = ['The quick brown fox jumps over the lazy dog.', 'Q: What colour is the sky?\nA: The sky is blue.'] * 40
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(text), model_writer=model, vocab_size=300, model_type='bpe', byte_fallback=True,
      pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece='<pad>', eos_piece='<eos>', bos_piece='<bos>',
      unk_piece='<unk>', num_threads=1, minloglevel=2)
  with open(path, 'wb') as f:
    f.write(model.getvalue())


@pytest.mark.slow
def test_gemmas_sentencepiece_tokenizer_and_its_bos_rule_stay_with_the_job(tmp_path, capsys):
  """A Gemma directory with tokenizer.model and add_bos_token: the job keeps the model as it is (ids as
  sentencepiece gives them), and a text prompt starts with <bos>, as transformers' Gemma tokenizer adds it."""
  import json as json_

  import sentencepiece as spm

  from paxcli.inputs import tokenizers
  from paxcli.jobdir import layout
  hf = tmp_path / 'hf'
  hf_models.save(hf_models.build(dict(hf_models.REFERENCES['gemma2'].config, vocab_size=300)), str(hf))
  _gemma_sentencepiece(str(hf / 'tokenizer.model'))
  (hf / 'tokenizer_config.json').write_text(json_.dumps(GEMMA_TOKENIZER_CONFIG))
  job = str(tmp_path / 'job')
  code, _, err = pax_main(['checkpoint', 'convert', '--from', 'hf', str(hf), job, '--recipe', str(tmp_path / 'r.py'),
                           '--no-verify'], capsys)
  assert code == 0, err
  kept = layout.tokenizer(job)
  assert open(kept, 'rb').read() == (hf / 'tokenizer.model').read_bytes()
  ours, theirs = tokenizers.load(kept), spm.SentencePieceProcessor(model_file=str(hf / 'tokenizer.model'))
  assert (ours.bos_first, ours.bos_id, ours.eos_id) == (True, 2, 1)
  text = 'The sky is blue, the fox is brown.'
  assert ours.encode(text) == theirs.encode(text)
  code, out, err = pax_main(['decode', '--exp', f'{tmp_path / "r.py"}:HfGemma2', '--job-log-dir', job, '--prompt', text,
                             '--max-decode-steps', '2', '--json'], capsys)
  assert code == 0, err
  row = [json_.loads(line) for line in out.splitlines() if line.startswith('{')][0]
  assert row['prompt_ids'] == [2] + theirs.encode(text)


def test_the_final_cap_runs_inside_the_chunked_loss_values_gradients_and_memory():
  """Gemma 2's final cap (30) in paxcli.models.losses.head_lm_loss, a chunk of positions at a time: the loss
  and gradients of the capped whole logits, and no float32 value of B x L x V in either pass."""
  from paxcli.layers.transformer import soft_cap
  from paxcli.models import losses
  b, l, d, v = 2, 64, 16, 96
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(b, l, d)) * 3, jnp.float32)
  table = jnp.asarray(rng.normal(size=(v, d)) * 3, jnp.float32)
  labels = jnp.asarray(rng.integers(0, v, (b, l)), jnp.int32)
  weights = jnp.ones((b, l), jnp.float32).at[1, 50:].set(0.0)

  def chunked(x, w):
    head = losses.Head(w, None, tied=True, dtype=jnp.float32, table_dtype=jnp.float32, cap=30.0)
    return losses.head_lm_loss(x, head, labels, weights, chunk_tokens=32)[0]

  def whole(x, w):
    return losses.lm_loss(soft_cap(jnp.einsum('bld,vd->blv', x, w), 30.0), labels, weights)[0]

  np.testing.assert_allclose(chunked(x, table), whole(x, table), rtol=1e-5)
  for ours, theirs in zip(jax.grad(chunked, (0, 1))(x, table), jax.grad(whole, (0, 1))(x, table)):
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
  assert abs(whole(x, table) - losses.lm_loss(jnp.einsum('bld,vd->blv', x, table), labels, weights)[0]) > 1e-2
  assert _largest_float32(jax.make_jaxpr(jax.value_and_grad(chunked, (0, 1)))(x, table)) < b * l * v
