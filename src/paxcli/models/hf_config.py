"""Hugging Face config.json and weight layouts, the parts every family reads the same way.

A family (paxcli.models.family) maps its own keys and weight names; here are the checked reads of
config.json values (Reader: a missing, wrong-typed or out-of-range value is one line), the keys no
family's function depends on (HARMLESS_KEYS), the refusal of every other key a family does not read
(function_changing), rope scaling both ways, and the transforms between HF's nn.Linear weights
[out, in] and paxcli's kernels [in, ...].
"""

from __future__ import annotations

import json
from typing import Optional

import numpy as np

from paxcli.errors import UserError, shorten
from paxcli.models.knobs import LM_KNOB, MAX_COUNT, MAX_INT32


# config.json keys that do not change the function a model computes (bookkeeping, generation
# defaults, the token ids: the tokenizer's own files say which tokens are special, and they are
# kept with the job). Every other key is read into knobs by a family, or refused by name: a key this
# list does not know (auto_map's custom code, quantization_config, a new transformers option) may
# change what the model computes, and a model that silently computes another function is worse
# than a refusal the user can act on.
HARMLESS_KEYS = frozenset({
    'architectures', 'model_type', '_name_or_path', 'transformers_version', '_commit_hash', 'torch_dtype', 'dtype',
    'use_cache', 'initializer_range', 'pretraining_tp', 'bos_token_id', 'eos_token_id', 'pad_token_id',
    'sep_token_id', 'decoder_start_token_id', 'return_dict', 'output_hidden_states', 'output_attentions',
    'torchscript', 'use_bfloat16', 'tf_legacy_loss', 'chunk_size_feed_forward', 'id2label', 'label2id',
    'problem_type', 'finetuning_task', 'tokenizer_class', 'prefix', 'task_specific_params', '_attn_implementation',
    'attn_implementation', '_attn_implementation_autoset', 'max_length', 'min_length', 'do_sample',
    'early_stopping', 'num_beams', 'num_beam_groups', 'diversity_penalty', 'temperature', 'top_k', 'top_p',
    'typical_p', 'repetition_penalty', 'length_penalty', 'no_repeat_ngram_size', 'encoder_no_repeat_ngram_size',
    'bad_words_ids', 'num_return_sequences', 'output_scores', 'return_dict_in_generate', 'forced_bos_token_id',
    'forced_eos_token_id', 'remove_invalid_values', 'exponential_decay_length_penalty', 'suppress_tokens',
    'begin_suppress_tokens'})
# rope_scaling types (HF's rope_type, or type in older configs) -> paxcli's ROTARY_SCALING: what Llama-shaped
# families read (a family reads its own set: Family.hf_rope_types).
ROPE_TYPES = {'default': 'none', 'linear': 'linear', 'llama3': 'llama3', 'yarn': 'yarn'}
# Phi-3's: LongRoPE, under its earlier names too (transformers' Phi3Config reads 'su' and 'yarn' as 'longrope').
LONGROPE_TYPES = {'default': 'none', 'longrope': 'longrope', 'su': 'longrope', 'yarn': 'longrope'}
# Keys of transformers 5's rope_parameters that leave the rotation alone at one value: every dimension of a head
# rotated (Phi-3's partial_rotary_factor; Phi-4-mini's 0.75 rotates a part of each head only, and is refused), and
# YaRN's ramp bounds floored and ceiled (truncate; gpt-oss' false is refused).
ROPE_NEUTRAL = {'partial_rotary_factor': 1.0, 'truncate': True}
LLAMA3_ROPE_KEYS = {'factor': 'ROTARY_SCALING_FACTOR', 'low_freq_factor': 'ROTARY_LOW_FREQ_FACTOR',
                    'high_freq_factor': 'ROTARY_HIGH_FREQ_FACTOR',
                    'original_max_position_embeddings': 'ROTARY_ORIGINAL_MAX_LEN'}
YARN_ROPE_KEYS = {'factor': 'ROTARY_SCALING_FACTOR', 'original_max_position_embeddings': 'ROTARY_ORIGINAL_MAX_LEN',
                  'beta_fast': 'ROTARY_BETA_FAST', 'beta_slow': 'ROTARY_BETA_SLOW', 'mscale': 'ROTARY_MSCALE',
                  'mscale_all_dim': 'ROTARY_MSCALE_ALL_DIM', 'attention_factor': 'ROTARY_ATTENTION_FACTOR'}
# longrope's (its factors: one per rotated pair of a head, read by the family, which knows the pairs:
# longrope_knobs); its original_max_position_embeddings is the family's own key (Phi-3's config.json), which
# transformers 5 also writes into rope_parameters (so it is accepted there, and not written there).
LONGROPE_ROPE_KEYS = {'factor': 'ROTARY_SCALING_FACTOR', 'short_factor': 'ROTARY_SHORT_FACTORS',
                      'long_factor': 'ROTARY_LONG_FACTORS', 'attention_factor': 'ROTARY_ATTENTION_FACTOR'}
# The one table of rope scalings (paxcli's ROTARY_SCALING, layers.transformer.ROTARY_SCALINGS' rows) -> the
# rope_scaling keys it reads, each into its knob (both ways).
ROPE_KEYS = {'linear': {'factor': 'ROTARY_SCALING_FACTOR'}, 'llama3': LLAMA3_ROPE_KEYS, 'yarn': YARN_ROPE_KEYS,
             'longrope': LONGROPE_ROPE_KEYS}
# Keys a rope_scaling of a kind may hold beyond ROPE_KEYS' (read elsewhere).
ROPE_ALSO = {'longrope': frozenset({'original_max_position_embeddings'})}
# What transformers takes where a rope_scaling leaves a key out (None: not set; yarn's missing
# original_max_position_embeddings is the config's max_position_embeddings: rope_knobs' `max_positions`).
ROPE_DEFAULTS = {'yarn': {'beta_fast': 32.0, 'beta_slow': 1.0, 'mscale': None, 'mscale_all_dim': None,
                          'attention_factor': None}}


def rope_scaling_of(model) -> Optional[dict]:
  """config.json's rope_scaling for a model's ROTARY_SCALING knobs (None: none)."""
  kind = getattr(model, 'rotary_scaling', 'none')
  if kind == 'none':
    return None
  out = {'rope_type': kind}
  for key, knob in ROPE_KEYS[kind].items():
    value = getattr(model, LM_KNOB[knob].flat)
    if value is not None:
      out[key] = [float(x) for x in value] if isinstance(value, (tuple, list)) else value
  return out


def function_changing(config: dict, read_keys, neutral: dict, title: str) -> list[str]:
  """The keys of config.json that would change the function, each with its value (short: all of
  them fit the one line of the error): every key but HARMLESS_KEYS, the family's `read_keys` and its
  `neutral` keys at their neutral value."""
  problems, unknown = [], []
  for key, value in config.items():
    if key in HARMLESS_KEYS or key in read_keys:
      continue
    if key not in neutral:
      unknown.append(key)
    elif value != neutral[key] and value not in (None, {}, []) and not _same_activation(key, value, neutral[key]):
      problems.append(f'{key} {shown(value)} (paxcli\'s {title}: {shown(neutral[key])})')
  if unknown:
    problems.append(f'{", ".join(sorted(unknown))} (unknown to paxcli: may change what the model computes; '
                    'remove from config.json what you know does not)')
  return problems


def _same_activation(key: str, value, neutral) -> bool:
  """hidden_act 'swish' is transformers' other name for 'silu'."""
  return key == 'hidden_act' and {value, neutral} == {'silu', 'swish'}


def rope_scaling(config: dict, problems: list, kinds: Optional[dict] = None, reads=frozenset()) -> dict:
  """config.json's rope scaling (rope_type 'default' for none; its rope_type the HF name `kinds` maps to paxcli's,
  ROPE_TYPES unless given): rope_scaling, or transformers 5's rope_parameters (which also holds rope_theta).
  Unsupported kinds, and keys neither the kind nor the family (`reads`) reads, go into `problems`."""
  kinds = ROPE_TYPES if kinds is None else kinds
  rope = config.get('rope_scaling') or config.get('rope_parameters') or {}
  if not isinstance(rope, dict):
    problems.append(f'rope_scaling {shown(rope)} (an object with rope_type and factor was expected)')
    return {'rope_type': 'default'}
  kind = rope.get('rope_type', rope.get('type', 'default'))
  if not isinstance(kind, str) or kind not in kinds:
    problems.append(f'rope_scaling {shown(rope)} (paxcli scales rotary positions as '
                    f'{", ".join(repr(k) for k in kinds)} only)')
    return {'rope_type': 'default'}
  kind = kinds[kind] if kinds[kind] != 'none' else 'default'
  known = {'rope_type', 'type', 'rope_theta', 'factor', *reads} | set(ROPE_KEYS.get(kind, {})) | ROPE_ALSO.get(
      kind, frozenset())
  unknown = sorted(k for k in set(rope) - known if rope[k] != ROPE_NEUTRAL.get(k, object()))
  if unknown:
    problems.append(f'rope_scaling {shown(rope)} (paxcli does not read its {", ".join(unknown)})')
  return {**rope, 'rope_type': kind}


def rope_knobs(rope: dict, get: 'Reader', max_positions: Optional[int] = None) -> dict:
  """ROTARY_SCALING and its settings from a rope_scaling ({} for the default), each key of its kind (ROPE_KEYS)
  read into its knob, transformers' value where it is left out (ROPE_DEFAULTS; `max_positions`: the config's
  max_position_embeddings, yarn's original_max_position_embeddings where that is missing). longrope's are the
  family's to read (longrope_knobs: its factors are one per rotated pair)."""
  kind = rope['rope_type']
  if kind == 'default':
    return {}
  if kind == 'longrope':
    raise ValueError('longrope is read by longrope_knobs')
  defaults = {**ROPE_DEFAULTS.get(kind, {}), 'original_max_position_embeddings': max_positions or Reader.REQUIRED}
  knobs = {'ROTARY_SCALING': kind}
  for key, knob in ROPE_KEYS[kind].items():
    default = defaults.get(key, Reader.REQUIRED) if kind == 'yarn' else Reader.REQUIRED
    knobs[knob] = (get.int if LM_KNOB[knob].type is int else get.float)(key, default)
  return knobs


def longrope_knobs(rope: dict, get: 'Reader', pairs: int, original: int, max_len: int) -> dict:
  """ROTARY_SCALING 'longrope' and its knobs, as transformers computes LongRoPE: a factor per rotated pair
  (`pairs` of them) for texts within `original` positions and beyond; the scaling factor rope_scaling's `factor`,
  else max_len / original (what sets the attention factor where attention_factor is not given)."""
  knobs = {'ROTARY_SCALING': 'longrope', 'ROTARY_ORIGINAL_MAX_LEN': original,
           'ROTARY_SCALING_FACTOR': get.float('factor', max_len / original),
           'ROTARY_ATTENTION_FACTOR': get.float('attention_factor', None)}
  for key, knob in (('short_factor', 'ROTARY_SHORT_FACTORS'), ('long_factor', 'ROTARY_LONG_FACTORS')):
    values = get.config.get(key)
    if (not isinstance(values, list) or len(values) != pairs
        or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < float('inf') for x in values)):
      raise UserError(f'{get.where}: {key} is {shown(values)}; it must be a list of {pairs} positive numbers (one '
                      'per rotated pair of a head).')
    knobs[knob] = tuple(float(x) for x in values)
  return knobs


def sliding_window(config: dict, path: str, default: Optional[int], title: str) -> int:
  """SLIDING_WINDOW of config.json's sliding_window, the one reader of it: null is full attention (0), a missing
  key the family's default (its transformers config class's; None: full attention); anything but a positive
  whole number of tokens or null is one line."""
  window = config['sliding_window'] if 'sliding_window' in config else default
  if window is None:
    return 0
  if isinstance(window, bool) or not isinstance(window, int) or window < 1:
    raise UserError(f'{path}/config.json: sliding_window is {shown(window)}; a {title} config has a positive whole '
                    'number of tokens or null (full attention).')
  return window


def shown(value) -> str:
  return shorten(json.dumps(value), 60)


# config.json's counts of what a model is built from one by one (layers, experts, under each family's spelling):
# read at most MAX_COUNT, before any list of layers or weight names is made from them. Every other integer is
# a size, at most MAX_INT32 (the knobs' bounds, paxcli.models.knobs).
COUNT_KEYS = frozenset({'num_hidden_layers', 'num_experts', 'num_local_experts', 'n_routed_experts'})


class Reader:
  """Values of a config.json, checked: a missing, wrong-typed or out-of-range one is a UserError."""
  REQUIRED = object()

  def __init__(self, config: dict, where: str, what: str = 'the config'):
    self.config, self.where, self.what = config, where, what

  def _get(self, key, default):
    value = self.config.get(key)
    if value is None:
      if default is self.REQUIRED:
        raise UserError(f'{self.where}: {key} is missing; {self.what} needs it.')
      return None, default
    return value, None

  def int(self, key: str, default=REQUIRED):
    value, fallback = self._get(key, default)
    if value is None:
      return fallback
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise UserError(f'{self.where}: {key} is {shorten(json.dumps(value), 60)}; it must be a positive integer.')
    maximum = MAX_COUNT if key in COUNT_KEYS else MAX_INT32
    if value > maximum:
      raise UserError(f'{self.where}: {key} is {shorten(f"{value:,}", 60)}; paxcli reads at most {maximum:,} '
                      f'({"a model of more cannot be built here" if key in COUNT_KEYS else "a 32-bit size"}). '
                      'Is this the model\'s config.json?')
    return value

  def float(self, key: str, default=REQUIRED):
    value, fallback = self._get(key, default)
    if value is None:
      return fallback
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float('inf'):
      raise UserError(f'{self.where}: {key} is {shorten(json.dumps(value), 60)}; it must be a positive number.')
    return float(value)

  def bool(self, key: str, default=REQUIRED):
    value, fallback = self._get(key, default)
    if value is None:
      return fallback
    if not isinstance(value, bool):
      raise UserError(f'{self.where}: {key} is {shorten(json.dumps(value), 60)}; it must be true or false.')
    return value


def linear(shape_pax_in: int):
  """kernel [in, *out] <-> weight [prod(out), in]."""
  return (lambda x: x.reshape(shape_pax_in, -1).T,
          lambda w, shape: np.ascontiguousarray(w.T).reshape(shape))


def out_proj(d: int):
  return (lambda x: x.reshape(-1, d).T, lambda w, shape: np.ascontiguousarray(w.T).reshape(shape))


SAME = (lambda x: x, lambda w, shape: w.reshape(shape))
# A bias [H, E] of paxcli's <-> nn.Linear's bias [H * E].
FLAT = (lambda x: x.reshape(-1), lambda w, shape: w.reshape(shape))
