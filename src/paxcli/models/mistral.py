"""The Mistral family: Hugging Face `MistralForCausalLM` (Mistral 7B v0.1 and its fine-tunes).

A Mistral layer is a Llama layer (paxcli.models.llama: same weights, names and rotary convention)
whose attention sees only the `sliding_window` most recent tokens, itself included (query i attends
key j when i - w < j <= i): SLIDING_WINDOW, the same window in every layer. Training runs the
blockwise window kernel and decoding a rolling KV cache of `sliding_window` slots
(paxcli.layers.attention_ops, paxcli.layers.transformer; docs/guides/attention.md).

config.json: sliding_window is read into SLIDING_WINDOW (hf_config.sliding_window); a missing key is
transformers' default, 4096, and null is full attention (Mistral 7B v0.2/v0.3): such a model records
the Mistral family and `--to hf` writes it back as MistralForCausalLM with sliding_window null. (It
computes a Llama's function too: a model that records no family and has no window is placed as the
Llama the Mistral family is built on.) The other keys are
Llama's (rope_theta, rope scaling, GQA, tie_word_embeddings); a key that would change the function
and that paxcli does not read (layer_types, for one: MistralForCausalLM ignores it, Ministral reads
it) is refused by name.
"""

from __future__ import annotations

from typing import Optional

from paxcli.models import hf_config
from paxcli.models.llama import NEUTRAL_VALUES, READ_KEYS, Llama

# MistralConfig's default where config.json has no sliding_window.
HF_DEFAULT_WINDOW = 4096


class Mistral(Llama):
  name = 'mistral'
  title = 'Mistral'
  description = ('Mistral: a Llama layer whose attention sees a sliding window of recent tokens '
                 '(SLIDING_WINDOW; HF MistralForCausalLM)')
  knobs = {**Llama.knobs, 'SLIDING_WINDOW': HF_DEFAULT_WINDOW}
  hf_model_types = ('mistral',)
  hf_architectures = ('MistralForCausalLM',)
  hf_read_keys = READ_KEYS | {'sliding_window'}
  # MistralConfig has no attention_bias/mlp_bias fields: an export does not write them.
  hf_neutral = {k: v for k, v in NEUTRAL_VALUES.items() if k not in ('attention_bias', 'mlp_bias')}
  # transformers' MistralConfig defaults, for keys a config.json leaves out.
  hf_defaults = {'max_position_embeddings': 4096 * 32, 'rope_theta': 10000.0, 'num_key_value_heads': 8,
                 'rms_norm_eps': 1e-6, 'sliding_window': HF_DEFAULT_WINDOW}
  sliding_window = None   # a window in every layer, or none (sliding_window null)
  maxtext_blocks = {}
  maxtext_layer_params = {}

  def from_hf_config(self, config: dict, path: str) -> tuple[dict, list[str]]:
    knobs, notes = super().from_hf_config(config, path)
    knobs['SLIDING_WINDOW'] = hf_config.sliding_window(config, path, self.hf_defaults['sliding_window'], self.title)
    return knobs, notes

  def to_hf_config(self, model, dtype: str = 'float32', token_ids: Optional[dict] = None) -> dict:
    return {**super().to_hf_config(model, dtype, token_ids), 'sliding_window': int(model.sliding_window) or None}


MISTRAL = Mistral()
