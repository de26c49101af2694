"""The Phi-3 family: Hugging Face `Phi3ForCausalLM` (Phi-3, Phi-3.5 and Phi-4-mini: fused weights, LongRoPE, partial rotary).

A Phi-3 layer is a Mistral layer (paxcli.models.mistral: Llama's norms, gated SiLU and rotary convention, a
sliding window in every layer or none) whose checkpoints fuse what Llama's keep apart: the query, key and value
projections are one nn.Linear, self_attn.qkv_proj ([(H + 2K) E, D]: the query's rows, then the key's, then the
value's), and the MLP's gate and up projections are mlp.gate_up_proj ([2F, D]: the gate's rows, then the up
projection's). So the weight map is Llama's with those rows fused (paxcli.models.weight_map.fuse_named); LoRA
adapters of the fused modules go out as one PEFT adapter each (paxcli.convert.lora). The same function as a
Mistral's, and still a Phi-3: the model records its family (MODEL_FAMILY), and `--to hf` writes Phi3ForCausalLM.

Rotary positions: Phi-3-mini-128k, Phi-3.5 and Phi-4-mini scale them with LongRoPE (rope_scaling of type
longrope, or su and yarn as transformers' Phi3Config reads them): a factor per rotated pair stretches its
wavelength, short_factor for a text of at most original_max_position_embeddings positions and long_factor, at
every position of it, for a longer one (ROTARY_SHORT_FACTORS, ROTARY_LONG_FACTORS, ROTARY_ORIGINAL_MAX_LEN); rotated
queries and keys x attention_factor, else sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) with factor
max_position_embeddings / original_max_position_embeddings where rope_scaling has none (ROTARY_SCALING_FACTOR).
A text decoded past original_max_position_embeddings has its cache computed again with the long factors, as
transformers' generate() does (paxcli.models.lm). partial_rotary_factor (Phi-4-mini's 0.75): the first
int(head_dim x it) dimensions of each head rotate, the rest pass (ROTARY_FRACTION).

config.json: sliding_window (2047 in Phi-3-mini-4k; none where the key is missing, as in transformers'
Phi3Config) into SLIDING_WINDOW; rms_norm_eps 1e-5 where missing. Refused by name: other rope_scaling types
(Phi3Config refuses them too), a partial_rotary_factor whose rotated dimensions are not a whole even number, and
dropout (resid_pdrop, embd_pdrop, attention_dropout) above 0. auto_map naming Phi-3's own classes
(configuration_phi3.Phi3Config, modeling_phi3.Phi3ForCausalLM, as the released configs do for transformers
before 4.40) is read as moot: transformers without remote code runs its own Phi3ForCausalLM, which paxcli's
certification runs too; another auto_map is refused like any unknown key.
"""

from __future__ import annotations

from typing import Optional

from paxcli.errors import UserError
from paxcli.models import hf_config, weight_map
from paxcli.models.family import Weight
from paxcli.models.llama import Llama
from paxcli.models.mistral import Mistral

# HF's fused arrays: name -> the arrays Llama's layout keeps apart, in the order of their rows.
FUSED = {'self_attn.qkv_proj.weight': ('self_attn.q_proj.weight', 'self_attn.k_proj.weight', 'self_attn.v_proj.weight'),
         'mlp.gate_up_proj.weight': ('mlp.gate_proj.weight', 'mlp.up_proj.weight')}
# auto_map values of the released configs: Phi-3's own classes (with the repository in front, as the Hub writes
# them into a copy: 'microsoft/Phi-3-mini-4k-instruct--configuration_phi3.Phi3Config').
_OWN_CLASSES = ('configuration_phi3.Phi3Config', 'modeling_phi3.Phi3ForCausalLM')


class Phi3(Mistral):
  name = 'phi3'
  title = 'Phi-3'
  description = ('Phi-3: a Mistral layer whose checkpoints fuse q/k/v (qkv_proj) and the MLP\'s gate and up '
                 '(gate_up_proj) (HF Phi3ForCausalLM)')
  knobs = dict(Llama.knobs)
  hf_model_types = ('phi3',)
  hf_architectures = ('Phi3ForCausalLM',)
  hf_read_keys = Mistral.hf_read_keys | {'original_max_position_embeddings', 'auto_map', 'partial_rotary_factor'}
  hf_neutral = {**Mistral.hf_neutral, 'attention_bias': False, 'resid_pdrop': 0.0, 'embd_pdrop': 0.0}
  # transformers' Phi3Config defaults, for keys a config.json leaves out.
  hf_defaults = {'max_position_embeddings': 4096, 'rope_theta': 10000.0, 'rms_norm_eps': 1e-5, 'sliding_window': None,
                 'original_max_position_embeddings': 4096, 'partial_rotary_factor': 1.0}
  hf_rope_types = hf_config.LONGROPE_TYPES
  hf_rope_reads = frozenset({'partial_rotary_factor'})   # transformers 5 writes it into rope_parameters
  partial_rotary = True

  def hf_problems(self, config: dict) -> list[str]:
    auto_map = config.get('auto_map')
    if auto_map is None or (isinstance(auto_map, dict) and all(
        isinstance(v, str) and v.split('--')[-1] in _OWN_CLASSES for v in auto_map.values())):
      return []
    return [f'auto_map {hf_config.shown(auto_map)} (custom code other than Phi-3\'s own classes: it may compute '
            'another function)']

  def rope_knobs(self, config: dict, rope: dict, knobs: dict, path: str) -> dict:
    """ROTARY_FRACTION of partial_rotary_factor (rope_parameters' where transformers 5 put it there, as Phi3Config
    reads it first), and LongRoPE's knobs."""
    where = f'{path}/config.json'
    top = hf_config.Reader(config, where, f'a {self.title} config')
    fraction = hf_config.Reader(rope, f'{where} rope_scaling').float(
        'partial_rotary_factor', top.float('partial_rotary_factor', self.hf_defaults['partial_rotary_factor']))
    head = knobs['DIMS_PER_HEAD']
    rotated = int(head * fraction)
    if fraction > 1 or rotated < 2 or rotated % 2:
      raise UserError(f'{where}: partial_rotary_factor {fraction} rotates {rotated} of a head\'s {head} dimensions; '
                      f'paxcli\'s {self.title} rotates a whole even number of them, at most all.')
    out = {'ROTARY_FRACTION': fraction}
    if rope['rope_type'] == 'longrope':
      # Phi3Config's own original_max_position_embeddings (its default where config.json has none) overrides the
      # one transformers 5 writes into rope_parameters.
      original = top.int('original_max_position_embeddings', self.hf_defaults['original_max_position_embeddings'])
      out.update(hf_config.longrope_knobs(rope, hf_config.Reader(rope, f'{where} rope_scaling'), rotated // 2,
                                          original, knobs['MAX_SEQ_LEN']))
    return out

  def to_hf_config(self, model, dtype: str = 'float32', token_ids: Optional[dict] = None) -> dict:
    out = {**super().to_hf_config(model, dtype, token_ids), 'partial_rotary_factor': float(model.rotary_fraction)}
    if model.rotary_scaling == 'longrope':
      out['original_max_position_embeddings'] = int(model.rotary_original_max_len)
    return out

  def hf_weights(self, model) -> list[Weight]:
    return weight_map.fuse_named(super().hf_weights(model), FUSED)


PHI3 = Phi3()
