"""The Gemma 3 text family: Hugging Face `Gemma3ForCausalLM` (model_type gemma3_text).

A Gemma 3 layer is a Gemma 2 layer (paxcli.models.gemma) with an RMSNorm x (1 + w) over each head's query
and key before rotary (USE_QK_NORM, NORM_PLUS_ONE), no soft caps, five local layers to one global
(config.json's layer_types, or sliding_window_pattern 6 in the released configs), and rotary positions per
kind: the local layers at base rope_local_base_freq (10,000) unscaled, the global ones at rope_theta
(1,000,000) with rope_scaling (linear, factor 8, from 4B up). Weight map: Gemma 2's, and per layer

  params/layer_i/attention/query_norm/scale [E]   model.layers.i.self_attn.q_norm.weight [E]
  params/layer_i/attention/key_norm/scale [E]     model.layers.i.self_attn.k_norm.weight [E]

The released 4B, 12B and 27B checkpoints are Gemma3ForConditionalGeneration (model_type gemma3): the
text model's config.json is its `text_config`, holding a few keys and leaving the rest to transformers'
Gemma3TextConfig defaults (TEXT_DEFAULTS), and its weights sit under a language-model prefix beside a
SigLIP vision tower: `language_model.model.layers.N...` and `language_model.lm_head.weight` as transformers
4.5x (and the released files) spell them, `model.language_model.layers.N...` and `lm_head.weight` as later
transformers do. paxcli reads the text model of either spelling as a Gemma 3 (this family) and leaves the
vision tower and the multimodal projector out, saying so; `--to hf` writes the text model back as
Gemma3ForCausalLM.
"""

from __future__ import annotations

from paxcli.errors import UserError
from paxcli.models import hf_config
from paxcli.models.family import MaxTextBlock
from paxcli.models.gemma import MAXTEXT_GEMMA, Gemma2, maxtext_gemma_knobs, pattern_for

_LOCAL = {'SLIDING_WINDOW': 1024, 'ROTARY_MAX_TIMESCALE': 10000.0, 'ROTARY_SCALING': 'none',
          'ROTARY_SCALING_FACTOR': 1.0}

# transformers' Gemma3TextConfig defaults, for the keys a config.json or a released Gemma3ForConditionalGeneration's
# text_config leaves out (the family's hf_defaults: tests/test_family_contract.py holds them against transformers'
# own class). rope_theta and rope_local_base_freq are its default rotary bases of the global and the local layers.
TEXT_DEFAULTS = {
    'vocab_size': 262208, 'hidden_size': 2304, 'intermediate_size': 9216, 'num_hidden_layers': 26,
    'num_attention_heads': 8, 'num_key_value_heads': 4, 'head_dim': 256, 'hidden_activation': 'gelu_pytorch_tanh',
    'max_position_embeddings': 131072, 'rms_norm_eps': 1e-6, 'tie_word_embeddings': True, 'attention_bias': False,
    'attention_dropout': 0.0, 'query_pre_attn_scalar': 256, 'sliding_window': 4096,
    'final_logit_softcapping': None, 'attn_logit_softcapping': None, 'use_bidirectional_attention': False,
    'rope_theta': 1e6, 'rope_local_base_freq': 10000.0, 'sliding_window_pattern': 6}
MULTIMODAL_TYPE, MULTIMODAL_ARCHITECTURE = 'gemma3', 'Gemma3ForConditionalGeneration'
# Keys of the multimodal config.json beside text_config: the vision tower's and the image tokens' (the text
# model is all paxcli reads; an image token is an ordinary token to it).
_MULTIMODAL_KEYS = frozenset({
    'text_config', 'vision_config', 'mm_tokens_per_image', 'boi_token_index', 'eoi_token_index',
    'image_token_index', 'boi_token_id', 'eoi_token_id', 'image_token_id', 'tie_word_embeddings'})
# The text model's weights: prefix in the file -> prefix in Gemma3ForCausalLM's names (hf_weights).
_TEXT_PREFIXES = (('language_model.model.', 'model.'), ('language_model.lm_head.', 'lm_head.'),   # transformers 4.5x
                  ('model.language_model.', 'model.'), ('lm_head.', 'lm_head.'))                     # later ones
_TOWER_PREFIXES = ('vision_tower.', 'multi_modal_projector.', 'model.vision_tower.', 'model.multi_modal_projector.')


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
  hf_model_types = ('gemma3_text', MULTIMODAL_TYPE)     # the first is what --to hf writes
  hf_architectures = ('Gemma3ForCausalLM', MULTIMODAL_ARCHITECTURE)
  maxtext_blocks = {'gemma3': MaxTextBlock(MAXTEXT_GEMMA, from_config=_maxtext_gemma3)}
  maxtext_layer_params = {}   # --from maxtext reads no gemma3 checkpoints yet (import-maxtext does write recipes)
  hf_defaults = TEXT_DEFAULTS
  qk_norm = True
  soft_caps = False
  rope_per_kind = True
  global_every = 6

  def from_hf_config(self, config: dict, path: str) -> tuple[dict, list[str]]:
    """Gemma3ForCausalLM's config.json, or the text model of a Gemma3ForConditionalGeneration's (its text_config
    over transformers' defaults); a UserError naming what paxcli cannot express."""
    if config.get('model_type') != MULTIMODAL_TYPE:
      return super().from_hf_config(config, path)
    text = text_config(config, path)
    try:
      return super().from_hf_config(text, path)
    except UserError as e:   # the same reading, said of text_config
      message = str(e)
      for prefix in (f'{path}/config.json: ', f'{path}: '):
        message = message.removeprefix(prefix)
      raise UserError(f'{path}/config.json text_config: {message}') from None

  def hf_checkpoint_names(self, config: dict, names: list[str], where: str) -> tuple[dict[str, str], list[str]]:
    """A Gemma3ForConditionalGeneration's text-model arrays under Gemma3ForCausalLM's names (either spelling of
    the language-model prefix), and a note on the vision arrays left out."""
    if config.get('model_type') != MULTIMODAL_TYPE:
      return super().hf_checkpoint_names(config, names, where)
    out, seen, tower = {}, {}, 0
    for name in names:
      if name.startswith(_TOWER_PREFIXES):
        tower += 1
        continue
      new = next((to + name[len(prefix):] for prefix, to in _TEXT_PREFIXES if name.startswith(prefix)), name)
      if new in seen:
        raise UserError(f'{where}: {seen[new]!r} and {name!r} are the same weight of the text model, spelled '
                        'twice; keep one.')
      out[name], seen[new] = new, name
    notes = [f'{where} is a {MULTIMODAL_ARCHITECTURE}: paxcli reads its text model (a {self.title}, written back '
             f'by --to hf as {self.hf_architectures[0]}) and skips its vision tower and multimodal projector '
             f'({tower} arrays).'] if tower else []
    return out, notes


def text_config(config: dict, path: str) -> dict:
  """The text model's config.json of a Gemma3ForConditionalGeneration config: text_config over TEXT_DEFAULTS;
  one line for a key beside it that paxcli does not know, or a text_config that is not a Gemma 3 text model."""
  where = f'{path}/config.json'
  unknown = hf_config.function_changing(config, _MULTIMODAL_KEYS, {}, 'Gemma 3')
  if unknown:
    raise UserError(f'{where}: this {MULTIMODAL_ARCHITECTURE} config cannot be read by paxcli: {"; ".join(unknown)}.')
  text = config.get('text_config')
  if not isinstance(text, dict):
    raise UserError(f'{where}: text_config is {hf_config.shown(text)}; a {MULTIMODAL_ARCHITECTURE} config.json '
                    'holds its text model\'s settings there (a JSON object).')
  if text.get('model_type', 'gemma3_text') != 'gemma3_text':
    raise UserError(f'{where}: text_config has model_type {hf_config.shown(text["model_type"])}; paxcli reads '
                    'the text model of a Gemma 3 (\'gemma3_text\').')
  outer, inner = config.get('tie_word_embeddings'), text.get('tie_word_embeddings')
  if outer is not None and inner is not None and outer != inner:
    raise UserError(f'{where}: tie_word_embeddings is {hf_config.shown(outer)} but text_config\'s is '
                    f'{hf_config.shown(inner)}; make them agree.')
  tied = {} if outer is None else {'tie_word_embeddings': outer}
  return {**TEXT_DEFAULTS, **tied, **text, 'model_type': 'gemma3_text'}


GEMMA3 = Gemma3()
