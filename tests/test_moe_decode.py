"""Decoding a mixture-of-experts LM with the KV cache, against transformers' own Mixtral.

A tiny MixtralForCausalLM with random weights; the same weights in a paxcli LM of Llama's shape with
NUM_EXPERTS 4, EXPERTS_PER_TOKEN 2 and the softmax after top-k (Mixtral's router): the logits agree,
and paxcli's Decoder (prefill, then one token at a time through the KV cache, the experts sharded
over the expert mesh axis) gives transformers' greedy `generate` token for token. The weights go through
the Mixtral family's map of transformers' in-memory (fused) expert names (paxcli.models.moe_family); the
family's --from hf/--to hf is held in tests/test_hf_families.py.
"""

import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

import jax  # noqa: E402

from paxcli import config  # noqa: E402
from paxcli.loops.decode.decoder import Decoder  # noqa: E402
from paxcli.loops.decode.options import DecodeOptions  # noqa: E402
from paxcli.loops.decode.prompts import Prompt  # noqa: E402
from paxcli.models.lm import flat_view  # noqa: E402
from paxcli.models.weight_map import WeightMap  # noqa: E402
from paxcli.models.llama import LLAMA  # noqa: E402
from paxcli.models.mixtral import MIXTRAL  # noqa: E402
from paxcli.runtime import engine  # noqa: E402

V, D, F, L, H, KV, E, K = 64, 16, 24, 2, 4, 2, 4, 2
SETS = [f'{k}={v!r}' for k, v in LLAMA.knobs.items()] + [
    f'VOCAB_SIZE={V}', f'MODEL_DIMS={D}', f'HIDDEN_DIMS={F}', f'NUM_LAYERS={L}', f'NUM_HEADS={H}',
    f'NUM_KV_HEADS={KV}', 'DIMS_PER_HEAD=4', 'MAX_SEQ_LEN=32', 'SEPARATE_EMBEDDING=True', 'USE_REPEATED_LAYER=False',
    'NORM_EPSILON=1e-5', 'ROTARY_MAX_TIMESCALE=10000.0', f'NUM_EXPERTS={E}', f'EXPERTS_PER_TOKEN={K}',
    "ROUTER_SOFTMAX='after_topk'", 'PERCORE_BATCH_SIZE=1', 'ICI_MESH_SHAPE=[1,1,2,4,1]']


def _mixtral():
  cfg = transformers.MixtralConfig(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
                                   num_attention_heads=H, num_key_value_heads=KV, head_dim=D // H,
                                   num_local_experts=E, num_experts_per_tok=K, rms_norm_eps=1e-5, rope_theta=10000.0,
                                   max_position_embeddings=32, tie_word_embeddings=False, sliding_window=None)
  torch.manual_seed(0)
  model = transformers.MixtralForCausalLM(cfg).eval()
  with torch.no_grad():   # random norms and router too, so that every weight matters
    for p in model.parameters():
      p.copy_(torch.randn_like(p) * 0.3)
  return model


def _paxcli_params(setup, hf_model) -> dict:
  """The HF weights in paxcli's tree through the Mixtral family's map of transformers' own (fused) names."""
  state = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
  params = jax.tree.map(lambda a: None, setup.abstract_state['params'])   # every weight comes from HF
  wmap = WeightMap(MIXTRAL.hf_read_weights(flat_view(setup.model), state))
  for name in wmap.paxcli_shapes:
    path = name.split('/')[1:]
    node = params
    for part in path[:-1]:
      node = node[part]
    node[path[-1]] = np.asarray(wmap.from_hf(name, state.__getitem__), np.float32)
  shapes = jax.tree.map(lambda a: a.shape, setup.abstract_state['params'])
  assert jax.tree.map(np.shape, params) == shapes
  return params


@pytest.fixture(scope='module')
def pair():
  setup = engine.build(config.resolve('paxcli.models.LmExperiment', SETS))
  hf = _mixtral()
  params = _paxcli_params(setup, hf)
  return setup, jax.device_put(params, setup.state_shardings['params']), hf


def test_logits_equal_transformers_mixtral(pair):
  setup, params, hf = pair
  ids = np.random.default_rng(0).integers(0, V, (2, 12))
  ours = np.asarray(jax.jit(lambda p, x: setup.model.apply({'params': p}, x))(params, ids))
  with torch.no_grad():
    want = hf(torch.as_tensor(ids)).logits.numpy()
  np.testing.assert_allclose(ours, want, atol=2e-4)


def test_greedy_decoding_with_the_kv_cache_equals_transformers_generate(pair):
  setup, params, hf = pair
  prompts = [[5, 9, 2, 33, 7], [1], [60, 3, 3, 8, 12, 40, 41, 2, 19]]
  records, _ = Decoder(setup, params).run([Prompt(p) for p in prompts], DecodeOptions(max_decode_steps=12))
  for prompt, record in zip(prompts, records):
    with torch.no_grad():
      out = hf.generate(torch.as_tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                        pad_token_id=0, eos_token_id=None)
    assert record['decoded_ids'] == out[0, len(prompt):].tolist()
