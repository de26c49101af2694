"""The Gemma 3 text family: Hugging Face `Gemma3ForCausalLM` (model_type gemma3_text).

A Gemma 3 layer is a Gemma 2 layer (paxcli.models.gemma) with an RMSNorm x (1 + w) over each head's query
and key before rotary (USE_QK_NORM, NORM_PLUS_ONE), no soft caps, five local layers to one global
(config.json's layer_types, or sliding_window_pattern 6 in the released configs), and rotary positions per
kind: the local layers at base rope_local_base_freq (10,000) unscaled, the global ones at rope_theta
(1,000,000) with rope_scaling (linear, factor 8, from 4B up). Weight map: Gemma 2's, and per layer

  params/layer_i/attention/query_norm/scale [E]   model.layers.i.self_attn.q_norm.weight [E]
  params/layer_i/attention/key_norm/scale [E]     model.layers.i.self_attn.k_norm.weight [E]

Only the text model: the vision tower of Gemma3ForConditionalGeneration (model_type gemma3) is not read.
"""

from __future__ import annotations

from paxcli.models.gemma import Gemma2

_LOCAL = {'SLIDING_WINDOW': 1024, 'ROTARY_MAX_TIMESCALE': 10000.0, 'ROTARY_SCALING': 'none',
          'ROTARY_SCALING_FACTOR': 1.0}


class Gemma3(Gemma2):
  name = 'gemma3'
  title = 'Gemma 3'
  description = ('Gemma 3 text: Gemma 2\'s layer with (1 + w) QK-norm and no soft caps; five local layers '
                 '(window 1024, rope 10k) to one global (rope 1M, linear scaling) (HF Gemma3ForCausalLM)')
  knobs = {**Gemma2.knobs, 'USE_QK_NORM': True, 'ATTEN_LOGIT_CAP': 0.0, 'SOFTMAX_CAP_LOGITS': 0.0,
           'ROTARY_MAX_TIMESCALE': 1e6, 'ROTARY_SCALING': 'linear', 'ROTARY_SCALING_FACTOR': 8.0,
           'LAYER_PATTERN': ('local',) * 5 + ('global',), 'LAYER_KINDS': {'local': dict(_LOCAL)}}
  hf_model_types = ('gemma3_text',)
  hf_architectures = ('Gemma3ForCausalLM',)
  qk_norm = True
  soft_caps = False
  rope_per_kind = True
  global_every = 6


GEMMA3 = Gemma3()
