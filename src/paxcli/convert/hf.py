"""Hugging Face Llama directories: export (`--to hf`), import (`--from hf`) and inspect.

Mapping (paxcli unrolled names -> `LlamaForCausalLM` keys; HF stores nn.Linear weights
[out, in], paxcli kernels [in, ...]):
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
"""

from __future__ import annotations

import json
import os
import re
import types
from typing import Optional

import numpy as np

from paxcli import files, gencode
from paxcli.convert import formats, hf_tokenizer, safetensors_io
from paxcli.convert.formats import ArrayInfo
from paxcli.errors import UserError, shorten
from paxcli.models.knobs import LM_KNOB, LM_KNOBS, effective

RMS_EPS = LM_KNOB['NORM_EPSILON'].default   # HF's rms_norm_eps is NORM_EPSILON
# config.json keys that are one LM knob each, both ways: import reads them into the knob,
# export writes the knob's setting (read under its flat name, models.flat_view).
_HF_KNOBS = {'vocab_size': 'VOCAB_SIZE', 'hidden_size': 'MODEL_DIMS', 'intermediate_size': 'HIDDEN_DIMS',
             'num_hidden_layers': 'NUM_LAYERS', 'num_attention_heads': 'NUM_HEADS',
             'num_key_value_heads': 'NUM_KV_HEADS', 'head_dim': 'DIMS_PER_HEAD',
             'max_position_embeddings': 'MAX_SEQ_LEN', 'rms_norm_eps': 'NORM_EPSILON',
             'rope_theta': 'ROTARY_MAX_TIMESCALE'}
# What every Llama sets the same way.
_LLAMA_KNOBS = {'ACTIVATION': 'silu', 'USE_GATED_ACTIVATION': True, 'NORM_TYPE': 'rmsnorm', 'USE_BIAS': False,
                'POSITION_EMBEDDING': 'rotary', 'USE_REPEATED_LAYER': False}


def misfit(model) -> list[str]:
  """Why a paxcli model cannot be a Llama (empty when it can)."""
  reasons = []
  if model.norm_type != 'rmsnorm':
    reasons.append(f'norm_type is {model.norm_type!r} (Llama uses RMSNorm: NORM_TYPE=\'rmsnorm\')')
  if model.use_bias or model.attention_use_bias:
    reasons.append('the layers have biases (Llama has none: USE_BIAS=False)')
  if model.position_embedding != 'rotary':
    reasons.append(f'positions are {model.position_embedding!r} (Llama uses rotary: POSITION_EMBEDDING=\'rotary\')')
  pax_options = [('softmax_cap_logits', 'output logits are soft-capped'),
                 ('atten_logit_cap', 'attention logits are soft-capped'),
                 ('per_dim_scale', 'queries have learned per-dimension scales'),
                 ('softmax_bias', 'the output logits have a bias'),
                 ('scale_embedding_sqrt_depth', 'token embeddings are scaled by sqrt(MODEL_DIMS)')]
  reasons += [f'{why} (Llama has no {name})' for name, why in pax_options if getattr(model, name, None)]
  if getattr(model, 'tied_logits_bfloat16', False):
    reasons.append('tied logits read a bfloat16 copy of the embedding (TIED_LOGITS_BFLOAT16=False to accept '
                   'Llama\'s float32 one)')
  if getattr(model, 'parallel_block', False):
    reasons.append('attention and MLP run in parallel from one norm (PARALLEL_BLOCK; a Llama layer is sequential)')
  if not model.use_gated_activation or model.activation not in ('silu', 'swish'):
    reasons.append(f'the MLP is {"gated " if model.use_gated_activation else ""}{model.activation} '
                   '(Llama uses gated SiLU: USE_GATED_ACTIVATION=True, ACTIVATION=\'silu\')')
  return reasons


def config_for(model, dtype: str = 'float32', token_ids: Optional[dict] = None) -> dict:
  """config.json of a LlamaForCausalLM; token ids from the tokenizer (hf_tokenizer.token_ids)."""
  settings = {key: getattr(model, LM_KNOB[knob].flat, None) for key, knob in _HF_KNOBS.items()}
  return {
      'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', **settings,
      'rms_norm_eps': float(settings['rms_norm_eps'] or RMS_EPS), 'rope_theta': float(settings['rope_theta']),
      'hidden_act': 'silu', 'rope_scaling': rope_scaling_of(model), 'attention_bias': False, 'mlp_bias': False, 'attention_dropout': 0.0,
      'tie_word_embeddings': not model.separate_embedding, 'initializer_range': 0.02,
      'torch_dtype': dtype, 'use_cache': True,
      **(token_ids or {'bos_token_id': None, 'eos_token_id': None, 'pad_token_id': None}),
  }


# config.json keys that do not change the function a Llama computes (bookkeeping, generation
# defaults, the token ids: the tokenizer's own files say which tokens are special, and they are
# kept with the job). Every other key is read into knobs below, or refused by name: a key this
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
# Keys that leave the function alone only at one value (dropout is off in paxcli's own knobs).
NEUTRAL_VALUES = {'attention_bias': False, 'mlp_bias': False, 'attention_dropout': 0.0, 'pruned_heads': {},
                  'is_encoder_decoder': False, 'add_cross_attention': False, 'is_decoder': False,
                  'tie_encoder_decoder': False, 'cross_attention_hidden_size': None, 'hidden_act': 'silu'}
# Keys read into knobs: _HF_KNOBS, tie_word_embeddings, and the rotary ones.
READ_KEYS = frozenset(_HF_KNOBS) | {'tie_word_embeddings', 'rope_scaling', 'rope_parameters'}
# rope_scaling types (HF's rope_type, or type in older configs) -> paxcli's ROTARY_SCALING.
_ROPE_TYPES = {'default': 'none', 'linear': 'linear', 'llama3': 'llama3'}
_LLAMA3_KEYS = {'factor': 'ROTARY_SCALING_FACTOR', 'low_freq_factor': 'ROTARY_LOW_FREQ_FACTOR',
                'high_freq_factor': 'ROTARY_HIGH_FREQ_FACTOR',
                'original_max_position_embeddings': 'ROTARY_ORIGINAL_MAX_LEN'}


def rope_scaling_of(model) -> Optional[dict]:
  """config.json's rope_scaling for a model's ROTARY_SCALING knobs (None: none)."""
  kind = getattr(model, 'rotary_scaling', 'none')
  if kind == 'none':
    return None
  out = {'rope_type': kind, 'factor': float(model.rotary_scaling_factor)}
  if kind == 'llama3':
    out.update({key: getattr(model, LM_KNOB[knob].flat) for key, knob in _LLAMA3_KEYS.items()})
  return out


def knobs_from_config(config: dict, path: str) -> tuple[dict, list[str]]:
  """paxcli knobs for a Llama config.json, and notes; a UserError naming every key paxcli cannot express."""
  arch = (config.get('architectures') or [''])[0]
  if config.get('model_type') != 'llama' and arch != 'LlamaForCausalLM':
    raise UserError(f'{path}: model_type {config.get("model_type")!r} ({arch or "no architectures"}) is not '
                    'a Llama; paxcli imports LlamaForCausalLM checkpoints only.')
  problems = _function_changing(config)
  rope = _rope_scaling(config, problems)
  if problems:
    raise UserError(f'{path}: this Llama config cannot be expressed in paxcli: ' + '; '.join(problems) + '.')
  get = _Reader({**config, 'rope_theta': config.get('rope_theta', rope.pop('rope_theta', None))},
                f'{path}/config.json')
  heads = get.int('num_attention_heads')
  dims = get.int('hidden_size')
  defaults = {'num_key_value_heads': heads, 'head_dim': dims // heads if dims % heads == 0 else None,
              'max_position_embeddings': 2048, 'rope_theta': 10000.0, 'rms_norm_eps': RMS_EPS}
  knobs = {}
  for key, knob in _HF_KNOBS.items():
    read = get.float if LM_KNOB[knob].type is float else get.int
    knobs[knob] = read(key, defaults.get(key, _Reader.REQUIRED))
  knobs.update(_LLAMA_KNOBS, SEPARATE_EMBEDDING=not get.bool('tie_word_embeddings', False))
  knobs.update(_rope_knobs(rope, _Reader(rope, f'{path}/config.json rope_scaling')))
  if knobs['DIMS_PER_HEAD'] is None:
    raise UserError(f'{path}/config.json: hidden_size {dims} is not a multiple of num_attention_heads {heads} '
                    'and there is no head_dim.')
  if heads % knobs['NUM_KV_HEADS']:
    raise UserError(f'{path}/config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads '
                    f'{knobs["NUM_KV_HEADS"]}.')
  return knobs, []


def _function_changing(config: dict) -> list[str]:
  """The keys of config.json that would change the function, each with its value (short: all of
  them fit the one line of the error)."""
  problems, unknown = [], []
  for key, value in config.items():
    if key in HARMLESS_KEYS or key in READ_KEYS:
      continue
    if key not in NEUTRAL_VALUES:
      unknown.append(key)
    elif value != NEUTRAL_VALUES[key] and value not in (None, {}, []) and (key, value) != ('hidden_act', 'swish'):
      problems.append(f'{key} {_shown(value)} (paxcli\'s Llama: {_shown(NEUTRAL_VALUES[key])})')
  if unknown:
    problems.append(f'{", ".join(sorted(unknown))} (unknown to paxcli: may change what the model computes; '
                    'remove from config.json what you know does not)')
  return problems


def _rope_scaling(config: dict, problems: list) -> dict:
  """config.json's rope scaling (rope_type 'default' for none): rope_scaling, or transformers 5's
  rope_parameters (which also holds rope_theta). Unsupported kinds go into `problems`."""
  rope = config.get('rope_scaling') or config.get('rope_parameters') or {}
  if not isinstance(rope, dict):
    problems.append(f'rope_scaling {_shown(rope)} (an object with rope_type and factor was expected)')
    return {'rope_type': 'default'}
  kind = rope.get('rope_type', rope.get('type', 'default'))
  if kind not in _ROPE_TYPES:
    problems.append(f'rope_scaling {_shown(rope)} (paxcli scales rotary positions as '
                    f'{", ".join(repr(k) for k in _ROPE_TYPES)} only)')
    return {'rope_type': 'default'}
  known = {'rope_type', 'type', 'rope_theta', 'factor'} | (set(_LLAMA3_KEYS) if kind == 'llama3' else set())
  unknown = sorted(set(rope) - known)
  if unknown:
    problems.append(f'rope_scaling {_shown(rope)} (paxcli does not read its {", ".join(unknown)})')
  return {**rope, 'rope_type': kind}


def _rope_knobs(rope: dict, get: '_Reader') -> dict:
  """ROTARY_SCALING and its factors from a linear or llama3 rope_scaling ({} for the default)."""
  if rope['rope_type'] == 'default':
    return {}
  knobs = {'ROTARY_SCALING': _ROPE_TYPES[rope['rope_type']], 'ROTARY_SCALING_FACTOR': get.float('factor')}
  if rope['rope_type'] == 'llama3':
    for key, knob in _LLAMA3_KEYS.items():
      knobs[knob] = (get.int if LM_KNOB[knob].type is int else get.float)(key)
  return knobs


def _shown(value) -> str:
  return shorten(json.dumps(value), 60)


class _Reader:
  """Values of a config.json, checked: a missing, wrong-typed or out-of-range one is a UserError."""
  REQUIRED = object()

  def __init__(self, config: dict, where: str):
    self.config, self.where = config, where

  def _get(self, key, default):
    value = self.config.get(key)
    if value is None:
      if default is self.REQUIRED:
        raise UserError(f'{self.where}: {key} is missing; a Llama config needs it.')
      return None, default
    return value, None

  def int(self, key: str, default=REQUIRED):
    value, fallback = self._get(key, default)
    if value is None:
      return fallback
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise UserError(f'{self.where}: {key} is {str(json.dumps(value))[:60]}; it must be a positive integer.')
    return value

  def float(self, key: str, default=REQUIRED):
    value, fallback = self._get(key, default)
    if value is None:
      return fallback
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float('inf'):
      raise UserError(f'{self.where}: {key} is {str(json.dumps(value))[:60]}; it must be a positive number.')
    return float(value)

  def bool(self, key: str, default=REQUIRED):
    value, fallback = self._get(key, default)
    if value is None:
      return fallback
    if not isinstance(value, bool):
      raise UserError(f'{self.where}: {key} is {str(json.dumps(value))[:60]}; it must be true or false.')
    return value


def _model_of(knobs: dict):
  """The settings mapping() reads, from knobs (no model is built)."""
  return types.SimpleNamespace(**effective(knobs, LM_KNOBS))


def shape_problems(have: dict, model) -> list[str]:
  """What in the weights (name -> ArrayInfo) does not fit a Llama of `model`'s settings."""
  layers = {int(m.group(1)) for m in map(_LAYER.match, have) if m}
  if layers and model.num_layers != len(layers):   # before listing 9 names for each of a million layers
    return [f'config.json says num_hidden_layers {model.num_layers}; the weights hold {len(layers)} layers']
  problems = []
  entries = mapping(model)
  for hf_name, _, hf_shape, _, _ in entries:
    if hf_name not in have:
      problems.append(f'{hf_name}: missing (expected {list(hf_shape)})')
    elif tuple(have[hf_name].shape) != hf_shape:
      problems.append(f'{hf_name}: {list(have[hf_name].shape)}, expected {list(hf_shape)}')
  known = {e[0] for e in entries} | {'lm_head.weight'}
  problems += [f'{n}: not part of a Llama of this config' for n in have if n not in known
               and not n.endswith('rotary_emb.inv_freq')]
  return problems


_LAYER = re.compile(r'model\.layers\.(\d+)\.')


def _linear(shape_pax_in: int):
  """kernel [in, *out] <-> weight [prod(out), in]."""
  return (lambda x: x.reshape(shape_pax_in, -1).T,
          lambda w, shape: np.ascontiguousarray(w.T).reshape(shape))


def _out_proj(d: int):
  return (lambda x: x.reshape(-1, d).T, lambda w, shape: np.ascontiguousarray(w.T).reshape(shape))


_SAME = (lambda x: x, lambda w, shape: w.reshape(shape))


def mapping(model) -> list[tuple[str, str, tuple, tuple, tuple]]:
  """[(hf name, paxcli name, hf shape, paxcli shape, (to_hf, from_hf))] for an unrolled model."""
  d, f, v = model.model_dims, model.hidden_dims, model.vocab_size
  h, k, e = model.num_heads, model.num_kv_heads, model.dims_per_head
  out = [('model.embed_tokens.weight', 'params/embedding/embedding', (v, d), (v, d), _SAME)]
  for i in range(model.num_layers):
    hp, pp = f'model.layers.{i}.', f'params/layer_{i}/'
    out += [
        (hp + 'input_layernorm.weight', pp + 'attention_norm/scale', (d,), (d,), _SAME),
        (hp + 'self_attn.q_proj.weight', pp + 'attention/query/kernel', (h * e, d), (d, h, e), _linear(d)),
        (hp + 'self_attn.k_proj.weight', pp + 'attention/key/kernel', (k * e, d), (d, k, e), _linear(d)),
        (hp + 'self_attn.v_proj.weight', pp + 'attention/value/kernel', (k * e, d), (d, k, e), _linear(d)),
        (hp + 'self_attn.o_proj.weight', pp + 'attention/out/kernel', (d, h * e), (h, e, d), _out_proj(d)),
        (hp + 'post_attention_layernorm.weight', pp + 'mlp_norm/scale', (d,), (d,), _SAME),
        (hp + 'mlp.gate_proj.weight', pp + 'mlp/wi_0/kernel', (f, d), (d, f), _linear(d)),
        (hp + 'mlp.up_proj.weight', pp + 'mlp/wi_1/kernel', (f, d), (d, f), _linear(d)),
        (hp + 'mlp.down_proj.weight', pp + 'mlp/wo/kernel', (d, f), (f, d), _linear(f)),
    ]
  out.append(('model.norm.weight', 'params/final_norm/scale', (d,), (d,), _SAME))
  if model.separate_embedding:
    out.append(('lm_head.weight', 'params/logits/kernel', (v, d), (d, v), _linear(d)))
  return out


def is_hf(path: str) -> bool:
  return os.path.isdir(path) and os.path.exists(os.path.join(path, 'config.json')) and (
      bool(safetensors_io.files_of(path)) or bool([n for n in os.listdir(path) if n.endswith('.bin')]))


class HfSource(formats.SourceBase):
  """A Hugging Face directory; names are HF's. paxcli_view(model) gives paxcli names."""
  kind = 'hf'
  paxcli_names = False

  def __init__(self, path: str, step: Optional[int] = None, target=None):
    self.path = path
    text = files.read_text(files.member(path, 'config.json', 'config'), 'config.json', 16 << 20)
    try:
      self.native = json.loads(text)
    except (ValueError, RecursionError) as e:
      raise UserError(f'{path}/config.json is not valid JSON ({str(e)[:100]}).') from None
    if not isinstance(self.native, dict):
      raise UserError(f'{path}/config.json is a JSON {type(self.native).__name__}, not an object.')
    if not safetensors_io.files_of(path):
      raise UserError(f'{path} has no .safetensors weights (PyTorch .bin files are not read: convert them '
                      'to safetensors first).')
    self._st = safetensors_io.SafetensorsSource(path)
    self.step = self._st.step if step is None else step
    self._knobs = None

  def arrays(self):
    return self._st.arrays()

  def read(self, name, index=None):
    return self._st.read(name, index)

  def knobs(self) -> dict:
    """The knobs of config.json, checked against the weights' shapes before any model is built."""
    if self._knobs is None:
      knobs, self.notes = knobs_from_config(self.native, self.path)
      problems = shape_problems({a.name: a for a in self.arrays()}, _model_of(knobs))
      if problems:
        raise UserError(f'{self.path}: the weights do not match its config.json:\n  ' + '\n  '.join(problems[:20]))
      self._knobs = knobs
    return self._knobs

  def extra_files(self) -> dict:
    return hf_tokenizer.find_in(self.path)

  def paxcli_view(self, model) -> 'PaxView':
    return PaxView(self, model)


class PaxView(formats.SourceBase):
  """An HF Llama directory under paxcli's (unrolled) names and shapes."""
  kind = 'hf'

  def __init__(self, hf: HfSource, model):
    self.path, self.step, self.hf = hf.path, hf.step, hf
    self.knobs = hf.knobs
    self.extra_files = hf.extra_files
    have = {a.name: a for a in hf.arrays()}
    problems = shape_problems(have, model)
    self._map = {pax_name: (hf_name, pax_shape, back, have[hf_name].dtype)
                 for hf_name, pax_name, _, pax_shape, (_, back) in mapping(model) if not problems}
    if problems:
      raise UserError(f'{hf.path}: the weights do not match its config.json:\n  ' + '\n  '.join(problems[:20]))

  def arrays(self):
    return [ArrayInfo(p, shape, dtype) for p, (_, shape, _, dtype) in self._map.items()]

  def read(self, name, index=None):
    hf_name, shape, back, _ = self._map[name]
    x = back(self.hf.read(hf_name), shape)
    return x[index] if index is not None else x


formats.register_reader('hf', lambda path, step=None, target=None: HfSource(path, step), detect=is_hf)


def export(directory: str, src, items_by_name: dict, model, read, dtype: str, max_shard_bytes: int,
           on_bytes) -> None:
  """Writes model.safetensors (+ shards and index), config.json, generation_config.json and, when the
  run has a tokenizer, the tokenizer files transformers reads (hf_tokenizer) into directory."""
  reasons = misfit(model)
  if reasons:
    raise UserError('This model does not fit the Hugging Face Llama layout: ' + '; '.join(reasons) + '.')
  entries = mapping(model)
  fns = {hf_name: (pax_name, to_hf) for hf_name, pax_name, _, _, (to_hf, _) in entries}
  arrays = [(hf_name, hf_shape, items_by_name[pax_name].dtype) for hf_name, pax_name, hf_shape, _, _ in entries]

  def fill(hf_name, put):
    pax_name, to_hf = fns[hf_name]
    put(to_hf(read(items_by_name[pax_name])))

  tokenizer = src.extra_files().get('tokenizer')
  ids = hf_tokenizer.token_ids(tokenizer)   # the special ids of the tokenizer the model was trained with
  safetensors_io.write(directory, arrays, fill, {'format': 'pt', 'step': src.step}, max_shard_bytes, on_bytes)
  with open(os.path.join(directory, 'config.json'), 'w', encoding='utf-8') as f:
    json.dump(config_for(model, dtype, ids), f, indent=2)
  with open(os.path.join(directory, 'generation_config.json'), 'w', encoding='utf-8') as f:
    json.dump({k: v for k, v in ids.items() if v is not None}, f, indent=2)
  if tokenizer:
    hf_tokenizer.write(directory, tokenizer, model.max_seq_len)


def recipe_text(class_name: str, knobs: dict, source: str, notes: list[str]) -> str:
  """The recipe of an imported Llama: its knobs; the source path and notes only as literals."""
  lines = ['"""A Hugging Face Llama as a paxcli experiment (written by pax checkpoint convert --from hf).', '',
           'SOURCE is the directory it was converted from; the knobs come from its config.json.', '"""', '',
           'from paxcli.experiment import register', 'from paxcli.models import LmExperiment', '',
           f'SOURCE = {gencode.literal(os.path.abspath(source))}']
  if notes:
    lines.append(f'NOTES = {gencode.literal(tuple(str(n) for n in notes))}')
  lines += ['', '', '@register', f'class {class_name}(LmExperiment):',
            '  """The Llama of SOURCE, with the knobs of its config.json."""', '']
  lines += [f'  {k} = {gencode.literal(v)}' for k, v in knobs.items()]
  lines += ['  PERCORE_BATCH_SIZE = 1', '  ICI_MESH_SHAPE = None  # all devices data-parallel; set a mesh for large models']
  return '\n'.join(lines) + '\n'
