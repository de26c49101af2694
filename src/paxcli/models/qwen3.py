"""The Qwen 3 dense family: Hugging Face `Qwen3ForCausalLM`.

A Qwen 3 layer is a Llama layer (paxcli.models.llama) whose queries and keys go through an RMSNorm
over each head (QK-norm: USE_QK_NORM, epsilon rms_norm_eps) before rotary; no biases. head_dim is
its own setting (128 in every released size, whatever hidden_size / num_attention_heads is; 128 is
also transformers' default where config.json leaves it out). Weight map: Llama's, and per layer

  params/layer_i/attention/query_norm/scale [E]   model.layers.i.self_attn.q_norm.weight [E]
  params/layer_i/attention/key_norm/scale [E]     model.layers.i.self_attn.k_norm.weight [E]

Sliding-window keys and the tokenizer as for Qwen 2 (paxcli.models.qwen2). attention_bias true (a
bias on all four projections, which no released Qwen 3 has) is refused by name.
"""

from __future__ import annotations

from paxcli.models import hf_config
from paxcli.models.family import Weight
from paxcli.models.qwen2 import QWEN_NEUTRAL, Qwen2


class Qwen3(Qwen2):
  name = 'qwen3'
  title = 'Qwen3'
  description = 'Qwen 3 dense: a Llama layer with RMSNorm on each head\'s query and key (HF Qwen3ForCausalLM)'
  knobs = {'ACTIVATION': 'silu', 'USE_GATED_ACTIVATION': True, 'NORM_TYPE': 'rmsnorm', 'USE_BIAS': False,
           'USE_QK_NORM': True, 'POSITION_EMBEDDING': 'rotary', 'ROTARY_MAX_TIMESCALE': 1e6}
  hf_model_types = ('qwen3',)
  hf_architectures = ('Qwen3ForCausalLM',)
  hf_neutral = {**QWEN_NEUTRAL, 'attention_bias': False, 'use_sliding_window': False}
  # transformers' Qwen3Config defaults, for keys a config.json leaves out.
  hf_defaults = {'max_position_embeddings': 32768, 'rope_theta': 10000.0, 'num_key_value_heads': 32, 'head_dim': 128,
                 'rms_norm_eps': 1e-6}
  attention_features = {'qkv_bias': False, 'qk_norm': True}

  def hf_layer_weights(self, model, hp: str, pp: str) -> list[Weight]:
    e = model.dims_per_head
    return [Weight(f'{hp}self_attn.{p}_norm.weight', f'{pp}attention/{name}_norm/scale', (e,), (e,), *hf_config.SAME)
            for p, name in (('q', 'query'), ('k', 'key'))]


QWEN3 = Qwen3()
