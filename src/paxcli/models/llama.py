"""The Llama family: Hugging Face `LlamaForCausalLM`, MaxText's llama2/mistral and default decoder
blocks (mixtral is the Mixtral family's), and paxcli's own Llama-shaped recipes (default.StdlibDocsLm, bench.Llama1B).

Weight map (paxcli unrolled names -> `LlamaForCausalLM` keys; HF stores nn.Linear weights [out, in],
paxcli kernels [in, ...]):
  params/embedding/embedding [V, D]              model.embed_tokens.weight [V, D]
  params/layer_i/attention_norm/scale            model.layers.i.input_layernorm.weight
  params/layer_i/attention/query/kernel [D,H,E]  model.layers.i.self_attn.q_proj.weight [H*E, D]
  params/layer_i/attention/key|value [D,K,E]     ...self_attn.k_proj|v_proj.weight [K*E, D]
  params/layer_i/attention/out/kernel [H,E,D]    ...self_attn.o_proj.weight [D, H*E]
  params/layer_i/mlp_norm/scale                  ...post_attention_layernorm.weight
  params/layer_i/mlp/wi_0|wi_1|wo/kernel         ...mlp.gate_proj|up_proj|down_proj.weight (transposed)
  params/final_norm/scale                        model.norm.weight
  params/logits/kernel [D, V] (untied only)      lm_head.weight [V, D]; tied: tie_word_embeddings
Rotary: paxcli rotates the two halves of each head (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
with timescale theta^(2i/E), which is HF Llama's rotate_half convention: no permutation of
q/k rows is needed (unlike Meta's interleaved original checkpoints). Gated MLP: paxcli's
act(x wi_0) * (x wi_1) is HF's act(gate_proj x) * up_proj x.

MaxText (under params/params/decoder/layers or layers_<i>; see paxcli.convert.maxtext for the
rest): the llama2 block's pre_self_attention_layer_norm and post_self_attention_layer_norm are
attention_norm and mlp_norm; the default block is the same layer with attention and MLP in parallel
from its one pre_self_attention_norm (PARALLEL_BLOCK: a Llama-shaped layer that `--to hf` refuses).
"""

from __future__ import annotations

from typing import Optional

from paxcli.errors import UserError
from paxcli.models import hf_config
from paxcli.models.family import Family, MaxTextBlock, Weight
from paxcli.models.knobs import LM_KNOB

RMS_EPS = LM_KNOB['NORM_EPSILON'].default   # HF's rms_norm_eps is NORM_EPSILON
# config.json keys that are one LM knob each, both ways: import reads them into the knob,
# export writes the knob's setting (read under its flat name, paxcli.models.lm.flat_view).
_HF_KNOBS = {'vocab_size': 'VOCAB_SIZE', 'hidden_size': 'MODEL_DIMS', 'intermediate_size': 'HIDDEN_DIMS',
             'num_hidden_layers': 'NUM_LAYERS', 'num_attention_heads': 'NUM_HEADS',
             'num_key_value_heads': 'NUM_KV_HEADS', 'head_dim': 'DIMS_PER_HEAD',
             'max_position_embeddings': 'MAX_SEQ_LEN', 'rms_norm_eps': 'NORM_EPSILON',
             'rope_theta': 'ROTARY_MAX_TIMESCALE'}
# Keys that leave the function alone only at one value (dropout is off in paxcli's own knobs).
NEUTRAL_VALUES = {'attention_bias': False, 'mlp_bias': False, 'attention_dropout': 0.0, 'pruned_heads': {},
                  'is_encoder_decoder': False, 'add_cross_attention': False, 'is_decoder': False,
                  'tie_encoder_decoder': False, 'cross_attention_hidden_size': None, 'hidden_act': 'silu'}
# Keys read into knobs: _HF_KNOBS, tie_word_embeddings, and the rotary ones.
READ_KEYS = frozenset(_HF_KNOBS) | {'tie_word_embeddings', 'rope_scaling', 'rope_parameters'}
# Neutral keys an export writes out (at their neutral value), where the family's config has them.
_WRITTEN_NEUTRAL = ('attention_bias', 'mlp_bias', 'attention_dropout', 'use_sliding_window')
# Why a model is not of a family, per attention feature: [False] it has the feature, [True] it lacks it.
_FEATURES = {
    'qkv_bias': {False: 'the query, key and value projections have biases ({title} has none: USE_QKV_BIAS=False)',
                 True: '{title} has biases on the query, key and value projections only (USE_QKV_BIAS=True)'},
    'qk_norm': {False: 'queries and keys are RMS-normalised per head ({title} has no QK-norm: USE_QK_NORM=False)',
                True: '{title} RMS-normalises each head\'s query and key (USE_QK_NORM=True)'},
}
# Granite's multipliers (paxcli.models.granite): knob, its neutral value, what it does; other families have none.
MULTIPLIERS = (('EMBEDDING_MULTIPLIER', 1.0, 'token embeddings are multiplied'),
               ('RESIDUAL_MULTIPLIER', 1.0, 'attention and MLP outputs are multiplied'),
               ('ATTENTION_MULTIPLIER', None, 'attention logits have their own multiplier'),
               ('LOGITS_SCALING', 1.0, 'output logits are divided'))
# What every MaxText decoder block of the family sets the same way.
MAXTEXT_LAYER = {'NORM_TYPE': 'rmsnorm', 'USE_BIAS': False, 'POSITION_EMBEDDING': 'rotary'}


class Llama(Family):
  """Llama, and the base of families that are Llama with a layer feature more (paxcli.models.qwen2, qwen3):
  they set the class data below and add their weights to hf_weights."""
  name = 'llama'
  title = 'Llama'
  description = 'Llama: RMSNorm, rotary positions, gated SiLU MLP, no biases (HF LlamaForCausalLM)'
  # What every Llama sets the same way.
  knobs = {'ACTIVATION': 'silu', 'USE_GATED_ACTIVATION': True, 'NORM_TYPE': 'rmsnorm', 'USE_BIAS': False,
           'POSITION_EMBEDDING': 'rotary'}
  hf_model_types = ('llama',)
  hf_architectures = ('LlamaForCausalLM',)
  # config.json: keys read into knobs, keys harmless at one value, and what is taken where a key is missing:
  # transformers' config class's defaults (tests/test_family_contract.py holds each family's against it).
  hf_read_keys = READ_KEYS
  hf_neutral = NEUTRAL_VALUES
  hf_defaults = {'max_position_embeddings': 2048, 'rope_theta': 10000.0, 'rms_norm_eps': 1e-6}
  # Attention features (layers.transformer.Attention: qkv_bias, qk_norm) the family has (True) or lacks.
  attention_features = {'qkv_bias': False, 'qk_norm': False}
  # Whether the family's attention has a window (SLIDING_WINDOW > 0; paxcli.models.mistral); None: either.
  sliding_window: Optional[bool] = False
  # QK-norm (attention_features' qk_norm) over each head apart, or over the whole query and key projections (OLMo 2).
  qk_norm_per_head = True
  # Where the layer's norms are (the block's pre_norms, post_norms): before attention and MLP (Llama's), or after
  # them, on their outputs (OLMo 2's).
  pre_norms, post_norms = True, False
  # config.json's rope_scaling types the family reads (HF name -> ROTARY_SCALING), the keys of it the family reads
  # itself (rope_knobs), and whether a part of each head may pass unrotated (ROTARY_FRACTION; Phi-3's).
  hf_rope_types = hf_config.ROPE_TYPES
  hf_rope_reads = frozenset()
  partial_rotary = False
  # Whether the family has Granite's multipliers (EMBEDDING_MULTIPLIER, ...; paxcli.models.granite).
  multipliers = False
  maxtext_blocks = {
      'llama2': MaxTextBlock(MAXTEXT_LAYER),
      'mistral': MaxTextBlock(MAXTEXT_LAYER),
      # Since 2024 MaxText's default decoder layer is attention and MLP in parallel from one RMSNorm.
      'default': MaxTextBlock({'PARALLEL_BLOCK': True, **MAXTEXT_LAYER}),
  }
  # MaxText layer parameter (below decoder/layers) -> (paxcli name below a layer, per-layer rank).
  maxtext_layer_params = {
      'self_attention/query/kernel': ('attention/query/kernel', 3),
      'self_attention/key/kernel': ('attention/key/kernel', 3),
      'self_attention/value/kernel': ('attention/value/kernel', 3),
      'self_attention/out/kernel': ('attention/out/kernel', 3),
      'mlp/wi_0/kernel': ('mlp/wi_0/kernel', 2),
      'mlp/wi_1/kernel': ('mlp/wi_1/kernel', 2),
      'mlp/wi/kernel': ('mlp/wi_0/kernel', 2),
      'mlp/wo/kernel': ('mlp/wo/kernel', 2),
      'pre_self_attention_layer_norm/scale': ('attention_norm/scale', 1),
      'pre_self_attention_norm/scale': ('attention_norm/scale', 1),
      'post_self_attention_layer_norm/scale': ('mlp_norm/scale', 1),
  }

  def misfit(self, model) -> list[str]:
    """Why a paxcli model cannot be one of the family (empty when it can)."""
    reasons, title = [], self.title
    if model.norm_type != 'rmsnorm':
      reasons.append(f'norm_type is {model.norm_type!r} ({title} uses RMSNorm: NORM_TYPE=\'rmsnorm\')')
    if model.use_bias or model.attention_use_bias:
      reasons.append(f'the layers have biases ({title} has none: USE_BIAS=False)')
    for name, has in self.attention_features.items():
      if bool(getattr(model, name, False)) != has:
        reasons.append(_FEATURES[name][has].format(title=title))
    if model.position_embedding != 'rotary':
      reasons.append(f'positions are {model.position_embedding!r} ({title} uses rotary: POSITION_EMBEDDING=\'rotary\')')
    pax_options = [('softmax_cap_logits', 'output logits are soft-capped'),
                   ('atten_logit_cap', 'attention logits are soft-capped'),
                   ('per_dim_scale', 'queries have learned per-dimension scales'),
                   ('softmax_bias', 'the output logits have a bias'),
                   ('scale_embedding_sqrt_depth', 'token embeddings are scaled by sqrt(MODEL_DIMS)')]
    reasons += [f'{why} ({title} has no {name})' for name, why in pax_options if getattr(model, name, None)]
    if getattr(model, 'tied_logits_bfloat16', False):
      reasons.append('tied logits read a bfloat16 copy of the embedding (TIED_LOGITS_BFLOAT16=False to accept '
                     f'{title}\'s float32 one)')
    if self.sliding_window is not None and bool(getattr(model, 'sliding_window', 0)) != self.sliding_window:
      reasons.append(self.window_misfit(model))
    if getattr(model, 'parallel_block', False):
      reasons.append(f'attention and MLP run in parallel from one norm (PARALLEL_BLOCK; a {title} layer is sequential)')
    if (bool(getattr(model, 'pre_norms', True)), bool(getattr(model, 'post_norms', False))) != (self.pre_norms,
                                                                                                self.post_norms):
      reasons.append(f'the norms are placed otherwise (PRE_NORMS={getattr(model, "pre_norms", True)}, POST_NORMS='
                     f'{getattr(model, "post_norms", False)}; {title}\'s: PRE_NORMS={self.pre_norms}, '
                     f'POST_NORMS={self.post_norms})')
    if getattr(model, 'qk_norm_after_rotary', False):
      reasons.append(f'queries and keys are normalised after rotary (QK_NORM_AFTER_ROTARY=True; {title}\'s are not)')
    if getattr(model, 'qk_norm', False) and bool(getattr(model, 'qk_norm_per_head', True)) != self.qk_norm_per_head:
      reasons.append(f'QK-norm is over {"each head" if self.qk_norm_per_head else "the whole projection"} in '
                     f'{title} (QK_NORM_PER_HEAD={self.qk_norm_per_head})')
    reasons += self.rotary_misfit(model)
    if not self.multipliers:
      reasons += [f'{why} ({title} has none: {knob}={neutral})' for knob, neutral, why in MULTIPLIERS
                  if getattr(model, LM_KNOB[knob].flat, neutral) != neutral]
    if not model.use_gated_activation or model.activation not in ('silu', 'swish'):
      reasons.append(f'the MLP is {"gated " if model.use_gated_activation else ""}{model.activation} '
                     f'({title} uses gated SiLU: USE_GATED_ACTIVATION=True, ACTIVATION=\'silu\')')
    reasons += self.attention_misfit(model)
    reasons += self.mlp_misfit(model)
    reasons += self.kinds_misfit(model)
    return reasons

  def attention_misfit(self, model) -> list[str]:
    """Why the model's attention is not the family's (a Llama's: key and value heads, rotary halves)."""
    reasons = []
    if getattr(model, 'kv_lora_rank', None):
      reasons.append(f'attention is multi-head latent attention (KV_LORA_RANK {model.kv_lora_rank}; a {self.title}\'s '
                     'has key and value heads: KV_LORA_RANK=0)')
    if getattr(model, 'rotary_interleave', False):
      reasons.append(f'rotary pairs are neighbours (ROTARY_INTERLEAVE; {self.title} rotates the halves of a head)')
    return reasons

  def kinds_misfit(self, model) -> list[str]:
    """Why the model's layers are not the family's (a Llama's are all alike)."""
    if any(fields for _, fields in getattr(model, 'layer_kinds', None) or ()) or getattr(model, 'layer_prefix', ()):
      return [f'the layers are of several kinds (LAYER_PATTERN {tuple(model.layer_pattern or ())}, LAYER_PREFIX '
              f'{tuple(getattr(model, "layer_prefix", ()) or ())} with LAYER_KINDS; a {self.title}\'s layers are all '
              'alike)']
    return []

  def rotary_misfit(self, model) -> list[str]:
    """Why the model's rotary positions are not the family's: a scaling it does not read, a part of each head
    unrotated."""
    reasons, kinds = [], set(self.hf_rope_types.values())
    scaling = getattr(model, 'rotary_scaling', 'none')
    if scaling not in kinds:
      reasons.append(f'rotary positions are scaled as {scaling!r} ({self.title}\'s are scaled as '
                     f'{" or ".join(repr(k) for k in sorted(kinds))}: ROTARY_SCALING)')
    if not self.partial_rotary and getattr(model, 'rotary_fraction', 1.0) != 1.0:
      reasons.append(f'rotary positions turn {model.rotary_fraction} of each head ({self.title} turns all of it: '
                     'ROTARY_FRACTION=1.0)')
    return reasons

  def mlp_misfit(self, model) -> list[str]:
    """Why the model's feed-forward is not the family's (a dense MLP here)."""
    if getattr(model, 'num_experts', None):
      return [f'the MLP is a mixture of {model.num_experts} experts (NUM_EXPERTS; a {self.title} MLP is dense)']
    return []

  def window_misfit(self, model) -> str:
    return (f'attention has a sliding window of {model.sliding_window} tokens ({self.title}\'s attention is full: '
            'SLIDING_WINDOW=0)')

  def from_hf_config(self, config: dict, path: str) -> tuple[dict, list[str]]:
    """paxcli knobs for a Llama config.json, and notes; a UserError naming every key paxcli cannot express."""
    problems = hf_config.function_changing(config, self.hf_read_keys, self.hf_neutral, self.title)
    problems += self.hf_problems(config)
    rope = hf_config.rope_scaling(config, problems, self.hf_rope_types, self.hf_rope_reads)
    if problems:
      raise UserError(f'{path}: this {self.title} config cannot be expressed in paxcli: ' + '; '.join(problems) + '.')
    get = hf_config.Reader({**config, 'rope_theta': config.get('rope_theta', rope.pop('rope_theta', None))},
                           f'{path}/config.json', f'a {self.title} config')
    heads = get.int('num_attention_heads')
    dims = get.int('hidden_size')
    defaults = {'num_key_value_heads': heads, 'head_dim': dims // heads if dims % heads == 0 else None,
                **self.hf_defaults}
    knobs = dict(self.knobs)   # the family's presets, under what config.json says
    for key, knob in _HF_KNOBS.items():
      read = get.float if LM_KNOB[knob].type is float else get.int
      knobs[knob] = read(key, defaults.get(key, hf_config.Reader.REQUIRED))
    knobs.update(USE_REPEATED_LAYER=False, SEPARATE_EMBEDDING=not get.bool('tie_word_embeddings', False))
    if knobs['DIMS_PER_HEAD'] is None:
      raise UserError(f'{path}/config.json: hidden_size {dims} is not a multiple of num_attention_heads {heads} '
                      'and there is no head_dim.')
    knobs.update(self.rope_knobs(config, rope, knobs, path))
    if heads % knobs['NUM_KV_HEADS']:
      raise UserError(f'{path}/config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads '
                      f'{knobs["NUM_KV_HEADS"]}.')
    return knobs, []

  def rope_knobs(self, config: dict, rope: dict, knobs: dict, path: str) -> dict:
    """The rotary knobs of config.json's rope scaling `rope` (hf_config.rope_scaling's), given the knobs read so far."""
    return hf_config.rope_knobs(rope, hf_config.Reader(rope, f'{path}/config.json rope_scaling'),
                                knobs['MAX_SEQ_LEN'])

  def hf_problems(self, config: dict) -> list[str]:
    """What else in config.json the family cannot express (keys it reads itself), each naming the key."""
    return []

  def to_hf_config(self, model, dtype: str = 'float32', token_ids: Optional[dict] = None) -> dict:
    """config.json of a LlamaForCausalLM (of the family's architecture); token ids from the tokenizer
    (hf_tokenizer.token_ids)."""
    settings = {key: getattr(model, LM_KNOB[knob].flat, None) for key, knob in _HF_KNOBS.items()}
    return {
        'architectures': [self.hf_architectures[0]], 'model_type': self.hf_model_types[0], **settings,
        'rms_norm_eps': float(settings['rms_norm_eps'] or RMS_EPS), 'rope_theta': float(settings['rope_theta']),
        'hidden_act': 'silu', 'rope_scaling': hf_config.rope_scaling_of(model),
        **{key: value for key, value in self.hf_neutral.items() if key in _WRITTEN_NEUTRAL},
        'tie_word_embeddings': not model.separate_embedding, 'initializer_range': 0.02,
        'torch_dtype': dtype, 'use_cache': True,
        **(token_ids or {'bos_token_id': None, 'eos_token_id': None, 'pad_token_id': None}),
    }

  def hf_weights(self, model) -> list[Weight]:
    """The weight map of an unrolled model (the module docstring's table)."""
    d, f, v = model.model_dims, model.hidden_dims, model.vocab_size
    h, k, e = model.num_heads, model.num_kv_heads, model.dims_per_head
    linear, out_proj, same = hf_config.linear, hf_config.out_proj, hf_config.SAME
    out = [Weight('model.embed_tokens.weight', 'params/embedding/embedding', (v, d), (v, d), *same)]
    for i in range(model.num_layers):
      hp, pp = f'model.layers.{i}.', f'params/layer_{i}/'
      out += [
          *self.hf_norm_weights(model, hp, pp),
          Weight(hp + 'self_attn.q_proj.weight', pp + 'attention/query/kernel', (h * e, d), (d, h, e), *linear(d)),
          Weight(hp + 'self_attn.k_proj.weight', pp + 'attention/key/kernel', (k * e, d), (d, k, e), *linear(d)),
          Weight(hp + 'self_attn.v_proj.weight', pp + 'attention/value/kernel', (k * e, d), (d, k, e), *linear(d)),
          Weight(hp + 'self_attn.o_proj.weight', pp + 'attention/out/kernel', (d, h * e), (h, e, d), *out_proj(d)),
          *self.hf_mlp_weights(model, i, hp, pp),
          *self.hf_layer_weights(model, hp, pp),
      ]
    out.append(Weight('model.norm.weight', 'params/final_norm/scale', (d,), (d,), *same))
    if model.separate_embedding:
      out.append(Weight('lm_head.weight', 'params/logits/kernel', (v, d), (d, v), *linear(d)))
    return out

  def hf_norm_weights(self, model, hp: str, pp: str) -> list[Weight]:
    """A layer's norms: RMSNorm before attention (input_layernorm) and before the MLP (post_attention_layernorm)."""
    d = model.model_dims
    return [Weight(hp + 'input_layernorm.weight', pp + 'attention_norm/scale', (d,), (d,), *hf_config.SAME),
            Weight(hp + 'post_attention_layernorm.weight', pp + 'mlp_norm/scale', (d,), (d,), *hf_config.SAME)]

  def hf_mlp_weights(self, model, layer: int, hp: str, pp: str) -> list[Weight]:
    """Layer `layer`'s feed-forward weights: the gated MLP (a mixture of experts in paxcli.models.moe_families)."""
    d, f, linear = model.model_dims, model.hidden_dims, hf_config.linear
    return [Weight(hp + 'mlp.gate_proj.weight', pp + 'mlp/wi_0/kernel', (f, d), (d, f), *linear(d)),
            Weight(hp + 'mlp.up_proj.weight', pp + 'mlp/wi_1/kernel', (f, d), (d, f), *linear(d)),
            Weight(hp + 'mlp.down_proj.weight', pp + 'mlp/wo/kernel', (d, f), (f, d), *linear(f))]

  def hf_layer_weights(self, model, hp: str, pp: str) -> list[Weight]:
    """The weights of one layer (HF prefix `hp`, paxcli prefix `pp`) that a family adds to Llama's."""
    return []


LLAMA = Llama()
