"""The Phi-3 family: Hugging Face `Phi3ForCausalLM` (Phi-3-mini-4k and the like, with rotary positions unscaled).

A Phi-3 layer is a Mistral layer (paxcli.models.mistral: Llama's norms, gated SiLU and rotary convention, a
sliding window in every layer or none) whose checkpoints fuse what Llama's keep apart: the query, key and value
projections are one nn.Linear, self_attn.qkv_proj ([(H + 2K) E, D]: the query's rows, then the key's, then the
value's), and the MLP's gate and up projections are mlp.gate_up_proj ([2F, D]: the gate's rows, then the up
projection's). So the weight map is Llama's with those rows fused (paxcli.models.weight_map.fuse_named); LoRA
adapters of the fused modules go out as one PEFT adapter each (paxcli.convert.lora). The same function as a
Mistral's, and still a Phi-3: the model records its family (MODEL_FAMILY), and `--to hf` writes Phi3ForCausalLM.

config.json: sliding_window (2047 in Phi-3-mini-4k; none where the key is missing, as in transformers'
Phi3Config) into SLIDING_WINDOW; rms_norm_eps 1e-5 where missing. Refused by name: rope_scaling of type
longrope (su, yarn: Phi-3-mini-128k, Phi-3.5, Phi-4-mini) and partial_rotary_factor below 1 (Phi-4-mini), which
paxcli's rotary positions do not compute yet; dropout (resid_pdrop, embd_pdrop, attention_dropout) above 0.
original_max_position_embeddings acts only with longrope: read as moot. auto_map naming Phi-3's own classes
(configuration_phi3.Phi3Config, modeling_phi3.Phi3ForCausalLM, as the released configs do for transformers
before 4.40) is read as moot: transformers without remote code runs its own Phi3ForCausalLM, which paxcli's
certification runs too; another auto_map is refused like any unknown key.
"""

from __future__ import annotations

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
  hf_read_keys = Mistral.hf_read_keys | {'original_max_position_embeddings', 'auto_map'}
  hf_neutral = {**Mistral.hf_neutral, 'attention_bias': False, 'resid_pdrop': 0.0, 'embd_pdrop': 0.0,
                'partial_rotary_factor': 1.0}
  # transformers' Phi3Config defaults, for keys a config.json leaves out.
  hf_defaults = {'max_position_embeddings': 4096, 'rope_theta': 10000.0, 'rms_norm_eps': 1e-5, 'sliding_window': None}

  def hf_problems(self, config: dict) -> list[str]:
    auto_map = config.get('auto_map')
    if auto_map is None or (isinstance(auto_map, dict) and all(
        isinstance(v, str) and v.split('--')[-1] in _OWN_CLASSES for v in auto_map.values())):
      return []
    return [f'auto_map {hf_config.shown(auto_map)} (custom code other than Phi-3\'s own classes: it may compute '
            'another function)']

  def hf_weights(self, model) -> list[Weight]:
    return weight_map.fuse_named(super().hf_weights(model), FUSED)


PHI3 = Phi3()
