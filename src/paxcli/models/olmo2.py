"""The OLMo 2 family: Hugging Face `Olmo2ForCausalLM` (AllenAI's OLMo-2 7B, 13B, 32B, 1B).

An OLMo 2 layer is a Llama layer (paxcli.models.llama: gated SiLU, rotary positions, no biases) with its norms
moved: attention and the MLP read the residual stream as it is, and their outputs are RMS-normalised before they
join it (PRE_NORMS=False, POST_NORMS=True); and QK-norm over the whole query projection [H x E] and the whole key
projection [K x E], not over each head, before rotary (USE_QK_NORM, QK_NORM_PER_HEAD=False), epsilon rms_norm_eps.
Weight map: Llama's without its two pre-norms, and per layer

  params/layer_i/post_attention_norm/scale [D]    model.layers.i.post_attention_layernorm.weight [D]
  params/layer_i/post_mlp_norm/scale [D]          model.layers.i.post_feedforward_layernorm.weight [D]
  params/layer_i/attention/query_norm/scale [HE]  model.layers.i.self_attn.q_norm.weight [H E]
  params/layer_i/attention/key_norm/scale [KE]    model.layers.i.self_attn.k_norm.weight [K E]

(transformers' post_attention_layernorm is Llama's name for the MLP's pre-norm; here it is attention's post-norm.)
config.json: Llama's keys (rope_theta, rope scaling, GQA, tie_word_embeddings); head_dim is hidden_size /
num_attention_heads (Olmo2Config has no head_dim). attention_bias true is refused by name.
"""

from __future__ import annotations

from paxcli.models import hf_config
from paxcli.models.family import Weight
from paxcli.models.llama import NEUTRAL_VALUES, Llama


class Olmo2(Llama):
  name = 'olmo2'
  title = 'OLMo 2'
  description = ('OLMo 2: a Llama layer whose norms follow attention and the MLP, and QK-norm over the whole '
                 'query and key projections (HF Olmo2ForCausalLM)')
  knobs = {**Llama.knobs, 'PRE_NORMS': False, 'POST_NORMS': True, 'USE_QK_NORM': True, 'QK_NORM_PER_HEAD': False}
  hf_model_types = ('olmo2',)
  hf_architectures = ('Olmo2ForCausalLM',)
  # Olmo2Config has no mlp_bias: an export does not write it.
  hf_neutral = {k: v for k, v in NEUTRAL_VALUES.items() if k != 'mlp_bias'}
  # transformers' Olmo2Config defaults, for keys a config.json leaves out.
  hf_defaults = {'max_position_embeddings': 2048, 'rope_theta': 10000.0, 'rms_norm_eps': 1e-5}
  attention_features = {'qkv_bias': False, 'qk_norm': True}
  qk_norm_per_head = False
  pre_norms, post_norms = False, True
  maxtext_blocks = {}
  maxtext_layer_params = {}

  def hf_norm_weights(self, model, hp: str, pp: str) -> list[Weight]:
    d, h, k, e = model.model_dims, model.num_heads, model.num_kv_heads, model.dims_per_head
    same = hf_config.SAME
    return [Weight(hp + 'post_attention_layernorm.weight', pp + 'post_attention_norm/scale', (d,), (d,), *same),
            Weight(hp + 'post_feedforward_layernorm.weight', pp + 'post_mlp_norm/scale', (d,), (d,), *same),
            Weight(hp + 'self_attn.q_norm.weight', pp + 'attention/query_norm/scale', (h * e,), (h * e,), *same),
            Weight(hp + 'self_attn.k_norm.weight', pp + 'attention/key_norm/scale', (k * e,), (k * e,), *same)]


OLMO2 = Olmo2()
