"""LoRA on a fused module (Phi-3's qkv_proj and gate_up_proj: several paxcli projections in one nn.Linear), both
ways. `--to peft` writes one PEFT adapter per fused module, the adapted projections' adapters side by side (the
same update, exactly); LORA_INIT reads that back, and PEFT's own adapters of rank LORA_RANK (one A the
projections share); an adapter that does not split exactly, or adapts a projection LORA_TARGETS leaves alone, is
one line. The slow test holds LORA_INIT against PEFT's own LoRA on transformers' Phi3ForCausalLM."""

import json
import os

import numpy as np
import pytest

import hf_models
from paxcli.convert import lora, safetensors_io
from paxcli.errors import UserError

R, ALPHA, D, H, K, E = 2, 6.0, 8, 4, 2, 2   # rank, alpha, model width, heads, kv heads, head dims
QKV = 'base_model.model.model.layers.0.self_attn.qkv_proj'
TARGETS = {(0, 'query'): lora.Target(QKV, (H + 2 * K) * E, (0, H * E)),
           (0, 'key'): lora.Target(QKV, (H + 2 * K) * E, (H * E, (H + K) * E)),
           (0, 'value'): lora.Target(QKV, (H + 2 * K) * E, ((H + K) * E, (H + 2 * K) * E))}


def _adapters(rng, projections):
  """paxcli's adapters (A [D, r], B [r, heads, E]) of the projections."""
  heads = {'query': H, 'key': K, 'value': K}
  return {p: (rng.normal(size=(D, R)).astype(np.float32), rng.normal(size=(R, heads[p], E)).astype(np.float32))
          for p in projections}


def _pairs(tmp_path, lora_a, lora_b, targets=('query', 'value'), config=None):
  """_PeftPairs over a real adapter_model.safetensors holding the module's pair."""
  os.makedirs(str(tmp_path), exist_ok=True)
  tensors = {f'{QKV}.lora_A.weight': lora_a, f'{QKV}.lora_B.weight': lora_b}
  written = safetensors_io.write(str(tmp_path), [(n, x.shape, 'float32') for n, x in tensors.items()],
                                 lambda name, put: put(tensors[name]), {'format': 'pt'}, max_shard_bytes=1 << 40)
  src = safetensors_io.SafetensorsSource(os.path.join(str(tmp_path), written[0]))
  settings = {'rank': R, 'alpha': ALPHA, 'targets': targets}
  return lora._PeftPairs(str(tmp_path), src, TARGETS, settings, config or {})


def _update(a, b, scale, rows=None):
  """The LoRA update scale x B A of PEFT's lora_A [r, in] and lora_B [out, r] (the rows `rows` of it)."""
  delta = scale * (b @ a)
  return delta if rows is None else delta[rows[0]:rows[1]]


def test_side_by_side_is_the_projections_update_exactly_and_reads_back(tmp_path):
  ours = _adapters(np.random.default_rng(0), ('query', 'value'))
  lora_a, lora_b = lora._peft_pair([(TARGETS[0, p], a, b) for p, (a, b) in ours.items()], R)
  assert lora_a.shape == (2 * R, D) and lora_b.shape == ((H + 2 * K) * E, 2 * R)
  fused = _update(lora_a, lora_b, ALPHA * 2 / (2 * R))   # alpha_pattern 2 alpha over rank_pattern 2 r
  for p, (a, b) in ours.items():
    rows = TARGETS[0, p].rows
    np.testing.assert_allclose(fused[rows[0]:rows[1]], _update(a.T, b.reshape(R, -1).T, ALPHA / R), rtol=1e-6)
  np.testing.assert_array_equal(fused[H * E:(H + K) * E], 0)   # the key, not adapted, stays as it was
  pairs = _pairs(tmp_path, lora_a, lora_b, config={'rank_pattern': {'qkv_proj': 2 * R},
                                                   'alpha_pattern': {'qkv_proj': 2 * ALPHA}})
  for p, (a, b) in ours.items():
    np.testing.assert_allclose(pairs.of(0, p, 'A')[1], a.T, rtol=1e-6)
    np.testing.assert_allclose(pairs.of(0, p, 'B')[1], b.reshape(R, -1).T, rtol=1e-6)


def test_peft_own_adapter_of_rank_r_is_read_with_its_a_shared(tmp_path):
  rng = np.random.default_rng(1)
  lora_a = rng.normal(size=(R, D)).astype(np.float32)
  lora_b = rng.normal(size=((H + 2 * K) * E, R)).astype(np.float32)
  lora_b[H * E:(H + K) * E] = 0   # PEFT's adapter of q and v: nothing on the key's rows
  pairs = _pairs(tmp_path, lora_a, lora_b, config={'alpha_pattern': {'qkv_proj': 2 * ALPHA}})
  for p in ('query', 'value'):
    rows = TARGETS[0, p].rows
    a, b = pairs.of(0, p, 'A')[1], pairs.of(0, p, 'B')[1]
    np.testing.assert_allclose(_update(a, b, ALPHA / R), _update(lora_a, lora_b, 2 * ALPHA / R, rows), rtol=1e-5)


def test_an_adapter_that_does_not_split_or_adapts_more_is_one_line(tmp_path):
  rng = np.random.default_rng(2)
  lora_a = rng.normal(size=(2 * R, D)).astype(np.float32)
  lora_b = rng.normal(size=((H + 2 * K) * E, 2 * R)).astype(np.float32)
  lora_b[H * E:(H + K) * E] = 0
  mixed = _pairs(tmp_path / 'mixed', lora_a, lora_b, config={'rank_pattern': {'qkv_proj': 2 * R}})
  with pytest.raises(UserError, match=r'an adapter of rank 4 on qkv_proj does not split exactly into rank-2 '
                                      r'adapters of query, value \(LORA_RANK 2\)'):
    mixed.of(0, 'query', 'A')
  lora_b[H * E] = 1.0   # the key's first row
  stray = _pairs(tmp_path / 'stray', lora_a, lora_b, config={'rank_pattern': {'qkv_proj': 2 * R}})
  with pytest.raises(UserError, match=r"also adapts key, which LORA_TARGETS=\['query', 'value'\] leaves alone"):
    stray.of(0, 'query', 'A')
  with pytest.raises(UserError, match=r'rank_pattern is \{"q_proj": 4\}; paxcli reads one only for a fused module'):
    lora.check_peft_config({'r': R, 'lora_alpha': ALPHA, 'target_modules': ['qkv_proj'], 'rank_pattern': {'q_proj': 4}},
                           'adapter_config.json', {'rank': R, 'alpha': ALPHA, 'targets': ('query', 'value')},
                           {'query': 'qkv_proj', 'key': 'qkv_proj', 'value': 'qkv_proj'})


@pytest.mark.slow
def test_lora_init_from_peft_on_phi3_computes_what_peft_does(hf_reference, tmp_path):
  """PEFT's own LoRA (rank 4 on qkv_proj, o_proj, gate_up_proj, down_proj, random B) on transformers' Phi-3,
  saved by PEFT; paxcli's LoRA run on the imported Phi-3 with LORA_INIT of it gives PEFT's logits."""
  peft = pytest.importorskip('peft')
  import jax
  import torch
  from rich.console import Console

  from paxcli import api, config
  from paxcli.convert import core
  from paxcli.jobdir import restore
  from paxcli.loops import train
  from paxcli.runtime import engine
  made = hf_reference('phi3')
  job, recipe = str(tmp_path / 'job'), str(tmp_path / 'phi3.py')
  api.convert_checkpoint(made.hf, job, fmt='hf', recipe=recipe, verify=False, console=Console(quiet=True))
  model = hf_models.load(made.hf)
  peft_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=['qkv_proj', 'o_proj', 'gate_up_proj', 'down_proj'],
                                lora_dropout=0.0, init_lora_weights=False)   # random A and B: the adapters act
  tuned = peft.get_peft_model(model, peft_config).eval()
  adapters = str(tmp_path / 'adapters')
  tuned.save_pretrained(adapters)
  assert json.load(open(os.path.join(adapters, 'adapter_config.json')))['r'] == 4
  sets = [f'INIT_FROM={job!r}', 'LORA_RANK=4', 'LORA_ALPHA=8.0', f'LORA_INIT={adapters!r}',
          "LORA_TARGETS=('query', 'key', 'value', 'output', 'mlp')"]
  setup = engine.build(config.resolve(f'{recipe}:HfPhi3', sets))
  state = train._fresh_state(setup, restore.base_ref(job), 0, lambda m: None)
  params = jax.tree.map(np.asarray, jax.device_get(state['params']))
  ids = np.random.default_rng(3).integers(0, 128, (2, 24)).astype(np.int32)
  with torch.no_grad():
    theirs = tuned(input_ids=torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()
  np.testing.assert_allclose(core.logits(setup.model, params, ids), theirs, atol=1e-4, rtol=0)
  assert np.abs(theirs - hf_models.logits(hf_models.load(made.hf), ids)).max() > 1e-3   # the adapters act
