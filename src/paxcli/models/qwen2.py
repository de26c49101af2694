"""The Qwen 2 family (Qwen 2 and Qwen 2.5): Hugging Face `Qwen2ForCausalLM`.

A Qwen 2 layer is a Llama layer (paxcli.models.llama) whose query, key and value projections have
a bias and whose output projection has none (USE_QKV_BIAS). The small sizes tie the output layer to
the token embedding (tie_word_embeddings); rope_theta is 1e6 from Qwen 2 on. Weight map: Llama's,
and per layer

  params/layer_i/attention/query/bias [H, E]       model.layers.i.self_attn.q_proj.bias [H*E]
  params/layer_i/attention/key|value/bias [K, E]   ...self_attn.k_proj|v_proj.bias [K*E]

config.json carries sliding-window keys: with use_sliding_window false (every released Qwen 2.5)
transformers computes full attention whatever sliding_window and max_window_layers say, so they are
read as moot. use_sliding_window true, or layer_types other than full attention, is refused by name:
transformers then windows only the layers from max_window_layers on, a stack of two kinds that no
repeating LAYER_PATTERN group expresses (paxcli's window itself is SLIDING_WINDOW, as Mistral's). The tokenizer is Qwen's tokenizer.json, which adds no BOS,
with its chat template in tokenizer_config.json; both stay with the job (paxcli.convert.hf_tokenizer).
"""

from __future__ import annotations

from paxcli.models import hf_config
from paxcli.models.family import Weight
from paxcli.models.llama import NEUTRAL_VALUES, READ_KEYS, Llama

# Llama's harmless-at-one-value keys without the two Qwen 2's config has no field for, and Qwen's own.
QWEN_NEUTRAL = {**{k: v for k, v in NEUTRAL_VALUES.items() if k not in ('attention_bias', 'mlp_bias')},
                'use_mrope': False}
# Sliding-window keys: moot while use_sliding_window is false (hf_problems refuses it true).
WINDOW_KEYS = frozenset({'use_sliding_window', 'sliding_window', 'max_window_layers', 'layer_types'})


def window_problems(config: dict) -> list[str]:
  """The sliding-window settings of a Qwen config.json that would change the function, each by name."""
  problems = []
  if config.get('use_sliding_window') not in (None, False):
    problems.append(f'use_sliding_window {hf_config.shown(config["use_sliding_window"])} with sliding_window '
                    f'{hf_config.shown(config.get("sliding_window"))} (windows on the layers from max_window_layers '
                    'on only, which paxcli\'s Qwen layers do not compute; released Qwen models set it false)')
  types = config.get('layer_types')
  if types is not None and (not isinstance(types, list) or any(t != 'full_attention' for t in types)):
    problems.append(f'layer_types {hf_config.shown(types)} (paxcli\'s Qwen layers are all "full_attention")')
  return problems


class Qwen2(Llama):
  name = 'qwen2'
  title = 'Qwen2'
  description = ('Qwen 2 and 2.5: a Llama layer with biases on the query, key and value projections only '
                 '(HF Qwen2ForCausalLM)')
  knobs = {'ACTIVATION': 'silu', 'USE_GATED_ACTIVATION': True, 'NORM_TYPE': 'rmsnorm', 'USE_BIAS': False,
           'USE_QKV_BIAS': True, 'POSITION_EMBEDDING': 'rotary', 'ROTARY_MAX_TIMESCALE': 1e6}
  hf_model_types = ('qwen2',)
  hf_architectures = ('Qwen2ForCausalLM',)
  hf_read_keys = READ_KEYS | WINDOW_KEYS
  hf_neutral = {**QWEN_NEUTRAL, 'use_sliding_window': False}
  # transformers' Qwen2Config defaults, for keys a config.json leaves out.
  hf_defaults = {'max_position_embeddings': 32768, 'rope_theta': 10000.0, 'num_key_value_heads': 32,
                 'rms_norm_eps': 1e-6}
  attention_features = {'qkv_bias': True, 'qk_norm': False}
  maxtext_blocks = {}
  maxtext_layer_params = {}

  def hf_problems(self, config: dict) -> list[str]:
    return window_problems(config)

  def hf_layer_weights(self, model, hp: str, pp: str) -> list[Weight]:
    h, k, e = model.num_heads, model.num_kv_heads, model.dims_per_head
    return [Weight(f'{hp}self_attn.{p}_proj.bias', f'{pp}attention/{name}/bias', (n * e,), (n, e), *hf_config.FLAT)
            for p, name, n in (('q', 'query', h), ('k', 'key', k), ('v', 'value', k))]


QWEN2 = Qwen2()
