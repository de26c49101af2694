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

from paxcli.models.family import MaxTextBlock
from paxcli.models.gemma import MAXTEXT_GEMMA, Gemma2, maxtext_gemma_knobs, pattern_for

_LOCAL = {'SLIDING_WINDOW': 1024, 'ROTARY_MAX_TIMESCALE': 10000.0, 'ROTARY_SCALING': 'none',
          'ROTARY_SCALING_FACTOR': 1.0}


# MaxText's gemma3 query scale by model_name (models/gemma3.py get_query_pre_attn_scalar): queries x
# head_dim^-0.5, or (emb_dim // query heads)^-0.5 for 27B, and no other 1/sqrt(head_dim).
_MAXTEXT_QUERY_BY_EMB = ('gemma3-27b',)


def _maxtext_gemma3(get, knobs) -> list:
  """MaxText's gemma3 block: five local layers to one global, each layer one of them; rope per kind."""
  local_rope = float(get('local_rope_max_timescale', -1) or -1)
  local = {'ROTARY_SCALING': 'none', 'ROTARY_SCALING_FACTOR': 1.0}
  if local_rope > 0:
    local['ROTARY_MAX_TIMESCALE'] = local_rope
  factor = float(get('rope_linear_scaling_factor', 1.0) or 1.0)
  scaling = [('ROTARY_SCALING', 'linear' if factor != 1.0 else 'none', 'rope_linear_scaling_factor'),
             ('ROTARY_SCALING_FACTOR', factor, 'rope_linear_scaling_factor')]
  if get('model_name') in _MAXTEXT_QUERY_BY_EMB:
    scalar = knobs['MODEL_DIMS'] // knobs['NUM_HEADS']
  else:
    scalar = knobs['DIMS_PER_HEAD']
  group = ('local',) * 5 + ('global',)
  return ([('LAYER_PATTERN', pattern_for(group, knobs['NUM_LAYERS']), 'decoder_block, base_num_decoder_layers'),
           ('USE_QK_NORM', True, 'decoder_block'), ('QUERY_PRE_ATTN_SCALAR', float(scalar), 'model_name, head_dim')]
          + scaling + maxtext_gemma_knobs(get, knobs, local))


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
  maxtext_blocks = {'gemma3': MaxTextBlock(MAXTEXT_GEMMA, from_config=_maxtext_gemma3)}
  maxtext_layer_params = {}   # --from maxtext reads no gemma3 checkpoints yet (import-maxtext does write recipes)
  qk_norm = True
  soft_caps = False
  rope_per_kind = True
  global_every = 6


GEMMA3 = Gemma3()
