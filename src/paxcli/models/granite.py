"""The Granite family: Hugging Face `GraniteForCausalLM` (IBM's Granite 3.0 to 3.3 dense models).

A Granite layer is a Llama layer (paxcli.models.llama: same weights, names and rotary convention) with four
multipliers (muP's): token embeddings x embedding_multiplier (EMBEDDING_MULTIPLIER), attention's and the MLP's
outputs x residual_multiplier where they join the residual stream (RESIDUAL_MULTIPLIER), attention logits
q . k x attention_multiplier in place of 1/sqrt(head_dim) (ATTENTION_MULTIPLIER), and output logits divided by
logits_scaling (LOGITS_SCALING). Where config.json leaves one out it is transformers' GraniteConfig default, 1:
for attention_multiplier that is a logit of q . k unscaled, which paxcli writes as ATTENTION_MULTIPLIER = 1.0.

config.json: Llama's keys and the four multipliers; head_dim is hidden_size / num_attention_heads (GraniteConfig
has none). attention_dropout (0.1 in the released Granite 3.0 and 3.1 configs) drops attention weights in
training only, which paxcli does not do: the function is the same, and the recipe's NOTES say so. Biases
(attention_bias, mlp_bias true) are refused by name.
"""

from __future__ import annotations

from typing import Optional

from paxcli.errors import UserError
from paxcli.models import hf_config
from paxcli.models.llama import NEUTRAL_VALUES, READ_KEYS, Llama

# config.json key -> knob, each a positive number.
_MULTIPLIERS = {'embedding_multiplier': 'EMBEDDING_MULTIPLIER', 'residual_multiplier': 'RESIDUAL_MULTIPLIER',
                'attention_multiplier': 'ATTENTION_MULTIPLIER', 'logits_scaling': 'LOGITS_SCALING'}


class Granite(Llama):
  name = 'granite'
  title = 'Granite'
  description = ('Granite: a Llama layer with muP multipliers on embeddings, residual branches, attention logits '
                 'and output logits (HF GraniteForCausalLM)')
  knobs = dict(Llama.knobs)   # the multipliers are each model's own (a recipe without them has none)
  hf_model_types = ('granite',)
  hf_architectures = ('GraniteForCausalLM',)
  hf_read_keys = READ_KEYS | set(_MULTIPLIERS) | {'attention_dropout'}
  hf_neutral = {k: v for k, v in NEUTRAL_VALUES.items() if k != 'attention_dropout'}
  # transformers' GraniteConfig defaults, for keys a config.json leaves out.
  hf_defaults = {'max_position_embeddings': 2048, 'rope_theta': 10000.0, 'rms_norm_eps': 1e-6,
                 **{key: 1.0 for key in _MULTIPLIERS}}
  multipliers = True
  maxtext_blocks = {}
  maxtext_layer_params = {}

  def from_hf_config(self, config: dict, path: str) -> tuple[dict, list[str]]:
    knobs, notes = super().from_hf_config(config, path)
    get = hf_config.Reader(config, f'{path}/config.json', f'a {self.title} config')
    for key, knob in _MULTIPLIERS.items():
      knobs[knob] = get.float(key, self.hf_defaults[key])
    dropout = config.get('attention_dropout') or 0.0
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0 <= dropout < 1:
      raise UserError(f'{path}/config.json: attention_dropout is {hf_config.shown(dropout)}; it must be a number '
                      'from 0 to below 1.')
    if dropout:
      notes.append(f'attention_dropout {dropout} drops attention weights in training only; paxcli trains without '
                   'it (DROPOUT_PROB is its residual dropout), and the model computes the same function.')
    return knobs, notes

  def to_hf_config(self, model, dtype: str = 'float32', token_ids: Optional[dict] = None) -> dict:
    attention = model.attention_multiplier
    if attention is None:   # paxcli's own scale, written as Granite spells it
      attention = float(model.query_pre_attn_scalar or model.dims_per_head) ** -0.5
    return {**super().to_hf_config(model, dtype, token_ids), 'embedding_multiplier': float(model.embedding_multiplier),
            'residual_multiplier': float(model.residual_multiplier), 'attention_multiplier': float(attention),
            'logits_scaling': float(model.logits_scaling), 'attention_dropout': 0.0}


GRANITE = Granite()
