"""The Gemma 2 family: Hugging Face `Gemma2ForCausalLM` (and Gemma 3's text layer, paxcli.models.gemma3).

A Gemma layer is a Llama layer (paxcli.models.llama) with:
  RMSNorm x (1 + w), w stored as it is (NORM_PLUS_ONE); four norms a layer: before and after attention,
  before and after the MLP (POST_NORMS); gated GELU with the tanh approximation (ACTIVATION 'gelu',
  flax's default, is transformers' gelu_pytorch_tanh); token embeddings x sqrt(hidden_size) rounded to
  the activation dtype (SCALE_EMBEDDING_SQRT_DEPTH); queries x 1/sqrt(query_pre_attn_scalar)
  (QUERY_PRE_ATTN_SCALAR); attention logits soft-capped at attn_logit_softcapping (ATTEN_LOGIT_CAP) and
  the output logits at final_logit_softcapping (SOFTMAX_CAP_LOGITS); tied embeddings (every released
  one; an untied lm_head is read and written too); and layers of two
  kinds, config.json's layer_types: 'sliding_attention' is paxcli's kind 'local' (SLIDING_WINDOW =
  sliding_window), 'full_attention' the kind 'global'. LAYER_PATTERN is the shortest group that repeats to
  layer_types ('local', 'global') for Gemma 2; a stack that repeats no shorter group is one group of all
  its layers.

Weight map: Llama's (paxcli.models.llama), except the norms
  params/layer_i/attention_norm/scale        model.layers.i.input_layernorm.weight
  params/layer_i/post_attention_norm/scale   model.layers.i.post_attention_layernorm.weight
  params/layer_i/mlp_norm/scale              model.layers.i.pre_feedforward_layernorm.weight
  params/layer_i/post_mlp_norm/scale         model.layers.i.post_feedforward_layernorm.weight
and lm_head only when untied (tie_word_embeddings false).

config.json comes in two spellings, both read: transformers 5's (layer_types, rope_parameters, per layer
type for Gemma 3) and the released checkpoints' (rope_theta, rope_scaling, rope_local_base_freq,
sliding_window_pattern). `--to hf` writes transformers 5's.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Optional

from paxcli.errors import UserError
from paxcli.models import hf_config
from paxcli.models.family import Family, MaxTextBlock, Weight
from paxcli.models.knobs import LM_KNOB
from paxcli.models.llama import LLAMA, MULTIPLIERS, NEUTRAL_VALUES as LLAMA_NEUTRAL

# config.json keys that are one LM knob each, both ways.
_HF_KNOBS = {'vocab_size': 'VOCAB_SIZE', 'hidden_size': 'MODEL_DIMS', 'intermediate_size': 'HIDDEN_DIMS',
             'num_hidden_layers': 'NUM_LAYERS', 'num_attention_heads': 'NUM_HEADS',
             'num_key_value_heads': 'NUM_KV_HEADS', 'head_dim': 'DIMS_PER_HEAD',
             'max_position_embeddings': 'MAX_SEQ_LEN', 'rms_norm_eps': 'NORM_EPSILON',
             'query_pre_attn_scalar': 'QUERY_PRE_ATTN_SCALAR'}
_INTS = {'vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads',
         'num_key_value_heads', 'head_dim', 'max_position_embeddings'}
# HF layer types <-> paxcli kinds.
KINDS = {'sliding_attention': 'local', 'full_attention': 'global'}
LAYER_TYPES = {kind: layer_type for layer_type, kind in KINDS.items()}
_TANH_GELU = 'gelu_pytorch_tanh'
_NEUTRAL = {**{k: v for k, v in LLAMA_NEUTRAL.items() if k not in ('hidden_act', 'mlp_bias')},
            'hidden_act': _TANH_GELU, 'hidden_activation': _TANH_GELU, 'use_bidirectional_attention': False}
# Read (or, cache_implementation, a generation setting of transformers, ignored).
_READ = frozenset(_HF_KNOBS) | {
    'tie_word_embeddings', 'rope_scaling', 'rope_parameters', 'rope_theta', 'rope_local_base_freq', 'layer_types',
    'sliding_window', 'sliding_window_size', 'sliding_window_pattern', '_sliding_window_pattern',
    'final_logit_softcapping', 'attn_logit_softcapping', 'cache_implementation'}
# Fields a kind may set in a Gemma (its window and its rotary positions); the rest is one layer for all.
_KIND_FIELDS = ('sliding_window', 'rotary_max_timescale', 'rotary_scaling', 'rotary_scaling_factor')


def kind_setting(model, kind: str, field: str):
  """An attention field's value in the layers of `kind` (a flat view): the kind's override, else the model's."""
  overrides = dict(dict(model.layer_kinds or ()).get(kind, ()))
  return overrides.get(f'attention_tpl.{field}', getattr(model, field))


def shortest_period(items: list) -> tuple:
  """The shortest group that repeats to `items` (all of them when none shorter does)."""
  n = len(items)
  for p in range(1, n + 1):
    if n % p == 0 and list(items[:p]) * (n // p) == list(items):
      return tuple(items[:p])
  return tuple(items)


def pattern_for(group: tuple, num_layers: int) -> tuple:
  """LAYER_PATTERN for `num_layers` layers repeating `group`: the group itself when it divides them, else
  all the layers (Gemma 3 4B's 34 layers are five groups of six and four local layers more)."""
  if num_layers % len(group) == 0:
    return tuple(group)
  return tuple(group[i % len(group)] for i in range(num_layers))


def maxtext_gemma_knobs(get, knobs, local: dict, global_: Optional[dict] = None) -> list:
  """What a MaxText gemma2/gemma3 decoder block takes from the run's config: the soft caps, the window of
  the local layers, the post-norms. `local`/`global_` add each kind's own settings (Gemma 3's rope)."""
  window = int(get('sliding_window_size', 0) or 0)
  kinds = {'local': {**({'SLIDING_WINDOW': window} if window > 0 else {}), **local}}
  if global_:
    kinds['global'] = dict(global_)
  out = [('ATTEN_LOGIT_CAP', float(get('attn_logits_soft_cap', 0.0) or 0.0), 'attn_logits_soft_cap'),
         ('SOFTMAX_CAP_LOGITS', float(get('final_logits_soft_cap', 0.0) or 0.0), 'final_logits_soft_cap'),
         ('LAYER_KINDS', kinds, 'sliding_window_size')]
  post = (bool(get('use_post_attn_norm', False)), bool(get('use_post_ffw_norm', False)))
  if post[0] == post[1]:   # one knob for both; MaxText's two differing stay unsupported
    out.append(('POST_NORMS', post[0], 'use_post_attn_norm, use_post_ffw_norm'))
  return out


def _maxtext_gemma2(get, knobs) -> list:
  # A MaxText gemma2 decoder layer is a (local, global) pair; the importer counts NUM_LAYERS in layers.
  return [('LAYER_PATTERN', ('local', 'global'), 'decoder_block')] + maxtext_gemma_knobs(get, knobs, {})


# What MaxText's gemma2 and gemma3 blocks share with Gemma's layer, in MaxText's parametrisation
# translated: MaxText stores the embedding x sqrt(emb_dim) and divides the tied logits by sqrt(emb_dim)
# (normalize_embedding_logits), which is Gemma's sqrt(d) embedding scale; its RMSNorm scale is plain (1 + w
# with w = scale - 1); gated tanh-GELU.
MAXTEXT_GEMMA = {'NORM_TYPE': 'rmsnorm', 'USE_BIAS': False, 'POSITION_EMBEDDING': 'rotary', 'NORM_PLUS_ONE': True,
                 'SCALE_EMBEDDING_SQRT_DEPTH': True}


class Gemma2(Family):
  name = 'gemma2'
  title = 'Gemma 2'
  description = ('Gemma 2: (1 + w) RMSNorms before and after attention and MLP, gated tanh-GELU, sqrt(d) embedding '
                 'scale, soft caps, local (window 4096) and global layers alternating (HF Gemma2ForCausalLM)')
  knobs = {'ACTIVATION': 'gelu', 'USE_GATED_ACTIVATION': True, 'NORM_TYPE': 'rmsnorm', 'USE_BIAS': False,
           'POSITION_EMBEDDING': 'rotary', 'NORM_PLUS_ONE': True, 'POST_NORMS': True,
           'SCALE_EMBEDDING_SQRT_DEPTH': True, 'SEPARATE_EMBEDDING': False, 'ATTEN_LOGIT_CAP': 50.0,
           'SOFTMAX_CAP_LOGITS': 30.0, 'LAYER_PATTERN': ('local', 'global'),
           'LAYER_KINDS': {'local': {'SLIDING_WINDOW': 4096}}}
  hf_model_types = ('gemma2',)
  hf_architectures = ('Gemma2ForCausalLM',)
  maxtext_blocks = {'gemma2': MaxTextBlock(MAXTEXT_GEMMA, from_config=_maxtext_gemma2)}
  # MaxText gemma2 layer parameter -> (paxcli name below a layer, per-layer rank, position in the layer):
  # a MaxText layer is a (local, global) pair, paxcli's layers 2i and 2i + 1 (models/gemma2.py).
  maxtext_layer_params = {
      f'{mt}_{kind}/{leaf}': (pax, rank, slot)
      for slot, kind in enumerate(('local', 'global'))
      for mt, leaf, pax, rank in (
          ('self_attention', 'query/kernel', 'attention/query/kernel', 3),
          ('self_attention', 'key/kernel', 'attention/key/kernel', 3),
          ('self_attention', 'value/kernel', 'attention/value/kernel', 3),
          ('self_attention', 'out/kernel', 'attention/out/kernel', 3),
          ('mlp', 'wi_0/kernel', 'mlp/wi_0/kernel', 2), ('mlp', 'wi_1/kernel', 'mlp/wi_1/kernel', 2),
          ('mlp', 'wo/kernel', 'mlp/wo/kernel', 2),
          ('pre_self_attention_norm', 'scale', 'attention_norm/scale', 1),
          ('post_self_attention_norm', 'scale', 'post_attention_norm/scale', 1),
          ('pre_ffw_norm', 'scale', 'mlp_norm/scale', 1), ('post_ffw_norm', 'scale', 'post_mlp_norm/scale', 1))}
  # transformers' Gemma2Config defaults, for keys a config.json leaves out (tests/test_family_contract.py).
  hf_defaults = {'num_key_value_heads': 4, 'head_dim': 256, 'max_position_embeddings': 8192, 'rms_norm_eps': 1e-6,
                 'query_pre_attn_scalar': 256, 'attn_logit_softcapping': 50.0, 'final_logit_softcapping': 30.0,
                 'sliding_window': 4096, 'rope_theta': 10000.0, 'tie_word_embeddings': True}
  qk_norm = False          # Gemma 3's layer normalises each head's query and key
  soft_caps = True         # Gemma 3 has none
  rope_per_kind = False    # Gemma 3: local and global layers have their own rotary base and scaling

  # ---- what a Gemma is ----

  def misfit(self, model) -> list[str]:
    """Why a paxcli model cannot be one of the family (empty when it can)."""
    title, reasons = self.title, []
    wants = [('norm_type', 'rmsnorm', "NORM_TYPE='rmsnorm'"),
             ('norm_plus_one', True, 'NORM_PLUS_ONE=True'),
             ('post_norms', True, 'POST_NORMS=True'),
             ('scale_embedding_sqrt_depth', True, 'SCALE_EMBEDDING_SQRT_DEPTH=True'),
             ('position_embedding', 'rotary', "POSITION_EMBEDDING='rotary'"),
             ('use_gated_activation', True, 'USE_GATED_ACTIVATION=True'),
             ('activation', 'gelu', "ACTIVATION='gelu'"),
             ('use_bias', False, 'USE_BIAS=False'),
             ('attention_use_bias', False, 'USE_ATTENTION_BIAS=False'),
             ('per_dim_scale', False, 'USE_PER_DIM_SCALE=False'),
             ('softmax_bias', False, 'USE_SOFTMAX_BIAS=False'),
             ('tied_logits_bfloat16', False, 'TIED_LOGITS_BFLOAT16=False'),
             ('parallel_block', False, 'PARALLEL_BLOCK=False'),
             ('qk_norm', self.qk_norm, f'USE_QK_NORM={self.qk_norm}'),
             ('pre_norms', True, 'PRE_NORMS=True'), ('qk_norm_after_rotary', False, 'QK_NORM_AFTER_ROTARY=False'),
             ('kv_lora_rank', False, 'KV_LORA_RANK=0'), ('rotary_interleave', False, 'ROTARY_INTERLEAVE=False'),
             ('layer_prefix', False, 'LAYER_PREFIX=()'), ('rotary_fraction', 1.0, 'ROTARY_FRACTION=1.0'),
             *((LM_KNOB[knob].flat, neutral, f'{knob}={neutral}') for knob, neutral, _ in MULTIPLIERS)]
    for flat, value, knob in wants:
      have = getattr(model, flat, None)
      if (bool(have) if isinstance(value, bool) else have) != value:
        reasons.append(f'{flat} is {have!r} ({title} has {knob})')
    if not self.soft_caps and (model.atten_logit_cap or model.softmax_cap_logits):
      reasons.append(f'logits are soft-capped ({title} has no soft caps: ATTEN_LOGIT_CAP=0, SOFTMAX_CAP_LOGITS=0)')
    pattern = tuple(model.layer_pattern or ())
    if set(pattern) - set(LAYER_TYPES):
      reasons.append(f'LAYER_PATTERN {pattern} names kinds other than {tuple(LAYER_TYPES)} ({title}\'s layers are '
                     'local (windowed) or global)')
      return reasons
    allowed = _KIND_FIELDS if self.rope_per_kind else _KIND_FIELDS[:1]
    for kind, fields in model.layer_kinds or ():
      extra = [path for path, _ in fields if path.removeprefix('attention_tpl.') not in allowed]
      if extra:
        reasons.append(f'LAYER_KINDS[{kind!r}] changes {", ".join(extra)} ({title}\'s kinds differ only in '
                       f'{", ".join(allowed)})')
    windows = {kind: kind_setting(model, kind, 'sliding_window') for kind in set(pattern)}
    if windows.get('global'):
      reasons.append(f'the global layers have a window ({title}: LAYER_KINDS[\'global\'] without SLIDING_WINDOW)')
    if 'local' in windows and not windows['local']:
      reasons.append(f'the local layers have no window ({title}: LAYER_KINDS[\'local\'] sets SLIDING_WINDOW)')
    if not pattern and model.sliding_window:
      reasons.append(f'every layer has a window but no LAYER_PATTERN says so ({title}: LAYER_PATTERN=(\'local\',))')
    return reasons

  # ---- config.json ----

  def from_hf_config(self, config: dict, path: str) -> tuple[dict, list[str]]:
    """paxcli knobs for a config.json of the family, and notes; a UserError naming what paxcli cannot express."""
    where = f'{path}/config.json'
    problems = hf_config.function_changing(config, _READ, _NEUTRAL, self.title)
    if not self.soft_caps:
      problems += [f'{key} {hf_config.shown(config[key])} (paxcli\'s {self.title}: none)'
                   for key in ('attn_logit_softcapping', 'final_logit_softcapping') if config.get(key)]
    types = self._layer_types(config, where)
    ropes = {t: self._rope(config, t, problems) for t in set(types)}
    if problems:
      raise UserError(f'{path}: this {self.title} config cannot be expressed in paxcli: ' + '; '.join(problems) + '.')
    get = hf_config.Reader(config, where, f'a {self.title} config')
    knobs, defaults = dict(self.knobs), self.hf_defaults
    for key, knob in _HF_KNOBS.items():
      knobs[knob] = (get.int if key in _INTS else get.float)(key, defaults.get(key, hf_config.Reader.REQUIRED))
    knobs['SEPARATE_EMBEDDING'] = not get.bool('tie_word_embeddings', defaults['tie_word_embeddings'])
    if knobs['NUM_HEADS'] % knobs['NUM_KV_HEADS']:
      raise UserError(f'{where}: num_attention_heads {knobs["NUM_HEADS"]} is not a multiple of num_key_value_heads '
                      f'{knobs["NUM_KV_HEADS"]}.')
    if self.soft_caps:
      knobs['ATTEN_LOGIT_CAP'] = _cap(get, 'attn_logit_softcapping', defaults)
      knobs['SOFTMAX_CAP_LOGITS'] = _cap(get, 'final_logit_softcapping', defaults)
    pattern = shortest_period([KINDS[t] for t in types])
    window = hf_config.sliding_window(config, path, defaults['sliding_window'], self.title)
    base = ropes.get('full_attention') or ropes['sliding_attention']
    kinds = {}
    if 'local' in pattern:
      local = {k: v for k, v in ropes['sliding_attention'].items() if base[k] != v}
      kinds['local'] = {'SLIDING_WINDOW': window, **local}
    knobs.update(base, USE_REPEATED_LAYER=False, LAYER_PATTERN=pattern, LAYER_KINDS=kinds)
    return knobs, []

  def _layer_types(self, config: dict, where: str) -> list[str]:
    """config.json's layer_types, or what the released configs' sliding_window_pattern (Gemma 3) or the
    alternation (Gemma 2) make of num_hidden_layers."""
    n = hf_config.Reader(config, where).int('num_hidden_layers', self.hf_defaults.get('num_hidden_layers',
                                                                                      hf_config.Reader.REQUIRED))
    types = config.get('layer_types')
    if types is None:
      every = config.get('sliding_window_pattern') or config.get('_sliding_window_pattern') or self.global_every
      if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise UserError(f'{where}: sliding_window_pattern is {hf_config.shown(every)}; it must be a positive integer.')
      types = ['full_attention' if (i + 1) % every == 0 else 'sliding_attention' for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in KINDS for t in types):
      raise UserError(f'{where}: layer_types must list {n} entries (num_hidden_layers), each one of '
                      f'{", ".join(repr(t) for t in KINDS)}; it is {hf_config.shown(types)}.')
    return types

  global_every = 2   # Gemma 2: every second layer is global

  def _rope(self, config: dict, layer_type: str, problems: list) -> dict:
    """ROTARY_* knobs of the layers of `layer_type`: rope_parameters (per layer type in transformers 5's
    Gemma 3), else rope_theta / rope_local_base_freq and rope_scaling (global layers only)."""
    params = config.get('rope_parameters')
    if isinstance(params, dict) and set(params) <= set(KINDS) and params:
      rope = params.get(layer_type) or {}
    elif params:
      rope = params
    elif layer_type == 'sliding_attention' and self.rope_per_kind:
      rope = {'rope_type': 'default', 'rope_theta': config.get('rope_local_base_freq',
                                                               self.hf_defaults['rope_local_base_freq'])}
    else:
      scaling = config.get('rope_scaling') or {}
      rope = ({**scaling, 'rope_theta': config.get('rope_theta', self.hf_defaults['rope_theta'])}
              if isinstance(scaling, dict) else scaling)
    rope = hf_config.rope_scaling({'rope_scaling': rope}, problems)
    if rope['rope_type'] in ('llama3', 'yarn'):
      problems.append(f'rope_scaling {hf_config.shown(rope)} (paxcli\'s {self.title} scales rotary positions '
                      'linearly or not at all)')
      return {}
    get = hf_config.Reader(rope, 'config.json rope', 'rotary positions')
    return {'ROTARY_MAX_TIMESCALE': get.float('rope_theta', 10000.0), 'ROTARY_SCALING': 'none',
            'ROTARY_SCALING_FACTOR': 1.0, **hf_config.rope_knobs(rope, get)}

  def to_hf_config(self, model, dtype: str = 'float32', token_ids: Optional[dict] = None) -> dict:
    """config.json of the family's architecture, as transformers 5 writes it."""
    settings = {key: getattr(model, LM_KNOB[knob].flat, None) for key, knob in _HF_KNOBS.items()}
    pattern = tuple(model.layer_pattern or ('global',))
    types = [LAYER_TYPES[pattern[i % len(pattern)]] for i in range(model.num_layers)]
    window = kind_setting(model, 'local', 'sliding_window') if 'local' in pattern else 4096
    out = {
        'architectures': [self.hf_architectures[0]], 'model_type': self.hf_model_types[0], **settings,
        'rms_norm_eps': float(settings['rms_norm_eps']),
        'query_pre_attn_scalar': _number(settings['query_pre_attn_scalar'] or settings['head_dim']),
        'hidden_activation': _TANH_GELU, 'layer_types': types, 'sliding_window': int(window),
        'rope_parameters': self._rope_parameters(model, pattern), 'attention_bias': False,
        'attention_dropout': 0.0, 'tie_word_embeddings': not model.separate_embedding, 'initializer_range': 0.02,
        'torch_dtype': dtype, 'use_cache': True,
        **(token_ids or {'bos_token_id': None, 'eos_token_id': None, 'pad_token_id': None}),
    }
    if self.soft_caps:
      out['attn_logit_softcapping'] = float(model.atten_logit_cap) or None
      out['final_logit_softcapping'] = float(model.softmax_cap_logits) or None
    return out

  def _rope_parameters(self, model, pattern) -> dict:
    def rope(kind):
      scaling = hf_config.rope_scaling_of(types_view(model, kind)) or {'rope_type': 'default'}
      return {**scaling, 'rope_theta': float(kind_setting(model, kind, 'rotary_max_timescale'))}
    if not self.rope_per_kind:
      return rope(pattern[0])
    return {LAYER_TYPES[kind]: rope(kind) for kind in LAYER_TYPES if kind in pattern}

  # ---- weights ----

  def hf_weights(self, model) -> list[Weight]:
    """Llama's map (paxcli.models.llama) with Gemma's four norms a layer (the module docstring), tied."""
    d, e, same = model.model_dims, model.dims_per_head, hf_config.SAME
    out = []
    for w in LLAMA.hf_weights(model):
      if w.hf.endswith('post_attention_layernorm.weight'):   # Llama's pre-MLP norm; Gemma's is named for the MLP
        hp, pp = w.hf.removesuffix('post_attention_layernorm.weight'), w.paxcli.removesuffix('mlp_norm/scale')
        out += [dataclasses.replace(w, hf=hp + 'pre_feedforward_layernorm.weight'),
                Weight(hp + 'post_attention_layernorm.weight', pp + 'post_attention_norm/scale', (d,), (d,), *same),
                Weight(hp + 'post_feedforward_layernorm.weight', pp + 'post_mlp_norm/scale', (d,), (d,), *same)]
        if self.qk_norm:
          out += [Weight(f'{hp}self_attn.{p}_norm.weight', f'{pp}attention/{name}_norm/scale', (e,), (e,), *same)
                  for p, name in (('q', 'query'), ('k', 'key'))]
      else:
        out.append(w)
    return out


def _cap(get: hf_config.Reader, key: str, defaults: dict) -> float:
  """A soft cap of config.json: the family's default where the key is missing, none (0) where it is null."""
  value = get.config[key] if key in get.config else defaults[key]
  return 0.0 if value is None else get.float(key, value)


def _number(x):
  """An integral float as an int: transformers 5's Gemma configs type query_pre_attn_scalar int."""
  return int(x) if float(x).is_integer() else float(x)


def types_view(model, kind: str):
  """The model's rotary settings as the layers of `kind` have them (for hf_config.rope_scaling_of)."""
  return types.SimpleNamespace(**{f: kind_setting(model, kind, f) for f in _KIND_FIELDS[1:]})


GEMMA2 = Gemma2()
