"""Translates a MaxText run (script overrides over dated defaults) into LmExperiment knobs.

The order MaxText applies settings is kept: base.yml defaults (a dated snapshot, or the
user's own file), then the `model_name` preset, then the script's `key=value` overrides.
Model sizes follow the scaling rule of the script's era. Every key the script sets is
either translated into a knob (a row of the table) or listed with the reason it is not.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import math
import re
from importlib import resources
from typing import Any, Optional

import yaml

from paxcli import options
from paxcli.errors import UserError, did_you_mean
from paxcli.files import read_text
from paxcli.maxtext import defaults as mt
from paxcli.maxtext.keys import DATA_KEYS, IGNORED_KEYS, KNOWN_KEYS
from paxcli.maxtext.shell import ScriptInfo
from paxcli.models import registry
from paxcli.models.knobs import LM_KNOB

ERA_CHOICES = mt.ERA_ORDER
MAX_CONFIG_BYTES = 16 << 20  # MaxText's base.yml is ~30 KB

# MaxText mesh axes (the middle of `<net>_<axis>_parallelism`) -> Pax axis index
# (0 replica, 1 data, 2 mdl). Axes Pax lacks are folded into the closest Pax axis so the
# mesh keeps its device count; the import warns about each one that is not 1.
_AXIS_FOLD = {
    'data': 0, 'fsdp': 1, 'tensor': 2, 'diloco': 0, 'fsdp_transpose': 1, 'sequence': 1,
    'context': 1, 'context_autoregressive': 1, 'context_usp_ulysses': 1, 'expert': 1,
    'pipeline': 1, 'tensor_transpose': 2, 'tensor_sequence': 2, 'autoregressive': 2,
}
_PAX_AXES = ('replica', 'data', 'mdl')
# Mesh axes whose use changes what a step computes: pax train refuses until accepted.
_AXIS_FEATURES = {
    'sequence': 'sequence_parallelism', 'context': 'context_parallelism',
    'context_autoregressive': 'context_parallelism', 'context_usp_ulysses': 'context_parallelism',
    'pipeline': 'pipeline_parallelism', 'diloco': 'diloco',
}
_PARALLELISM_RE = re.compile(r'^(ici|dcn)_(.+)_parallelism$')

# Keys that only appeared in the 2023 base.yml: a sign of a 2023 script.
_KEYS_2023 = {'save_period', 'warmup_steps', 'use_int8_training', 'max_eval_target_length',
              'vocab_relative_path', 'load_from_other_directory', 'max_predict_length'}
_KEYS_LATER = {'base_num_query_heads', 'base_num_kv_heads', 'model_name', 'decoder_block',
               'weight_dtype', 'opt_type'}

# The epsilon of MaxText's norms before base.yml had normalization_layer_epsilon (layers' own default).
_EARLY_NORM_EPSILON = 1e-6
# MaxText's key for it, and the name it had in base.yml for a week of January 2024 (and in the
# llama2 GPU configs after): both are NORM_EPSILON.
_NORM_EPSILON_KEYS = ('normalization_layer_epsilon', 'rms_norm_epsilon')
_ACTIVATIONS = set(options.ACTIVATIONS)  # paxcli.options declares every allowed value once
_DTYPES = set(options.DTYPES)

# Specific reasons for keys that are read but have no Pax knob.
_REASONS = {
    'load_parameters_path': 'the recipe starts from random weights; convert the checkpoint with '
                            'pax checkpoint convert --from maxtext CKPT OUT --exp <this recipe>',
    'load_full_state_path': 'the recipe starts from random weights; convert the checkpoint with '
                            'pax checkpoint convert --from maxtext CKPT OUT --exp <this recipe>',
    'weight_dtype': 'paxcli keeps weights in float32',
    'gradient_accumulation_steps': 'no Pax knob; raise PERCORE_BATCH_SIZE for the same global '
                                   'batch',
    'adam_eps_root': 'no Pax knob (paxcli uses 0)',
    'enable_dropout': 'read into DROPOUT_PROB',
    'enable_checkpointing': 'paxcli always checkpoints; SAVE_INTERVAL_STEPS is set to the '
                            'number of steps instead',
}


@dataclasses.dataclass
class Options:
  """Command-line choices that steer a translation."""
  era: Optional[str] = None
  date: Optional[str] = None
  base_config: Optional[str] = None
  model_config: Optional[str] = None
  num_devices: Optional[int] = None
  topology: Optional[str] = None
  num_slices: Optional[int] = None


@dataclasses.dataclass
class Row:
  knob: str
  value: Any
  key: str          # MaxText key(s) it comes from
  raw: str          # the raw MaxText value
  after: str        # the value after the era's scaling, when scaled
  source: str       # 'script', 'base.yml <snapshot>', 'model <name>', ...


@dataclasses.dataclass
class Untranslated:
  key: str
  value: str
  reason: str
  kind: str         # 'no_equivalent', 'ignored', 'data', 'unknown'
  source: str


@dataclasses.dataclass
class Translation:
  """The result: knobs, the table rows, and everything not translated, with reasons."""
  script: ScriptInfo
  era: str
  era_reason: str
  defaults: str
  defaults_reason: str
  preset: Optional[str]
  knobs: dict[str, Any]
  rows: list[Row]
  untranslated: list[Untranslated]
  warnings: list[str]
  strict_warnings: list[str]
  notes: list[str]
  unsupported: dict[str, str]
  unknown_keys: list[str] = dataclasses.field(default_factory=list)  # MaxText would refuse these

  def to_json(self) -> dict:
    era = mt.ERAS[self.era]
    return {
        'script': self.script.path,
        'trainer': self.script.entry,
        'base_config_path': self.script.config_path,
        'era': self.era,
        'era_rule': era.rule,
        'era_reason': self.era_reason,
        'defaults': self.defaults,
        'defaults_reason': self.defaults_reason,
        'model_preset': self.preset,
        'knobs': self.knobs,
        'rows': [dataclasses.asdict(r) for r in self.rows],
        'untranslated': [dataclasses.asdict(u) for u in self.untranslated],
        'unsupported_features': self.unsupported,
        'warnings': self.warnings,
        'notes': self.notes,
    }


# ---- values ---------------------------------------------------------------------


def parse_value(raw: Any, like: Any = None) -> Any:
  """A MaxText value from its command-line text, typed like the default when known."""
  if not isinstance(raw, str):
    return raw
  text = raw.strip()
  if len(text) >= 2 and text[0] == text[-1] and text[0] in '\'"':
    text = text[1:-1]
  low = text.lower()
  value: Any = text
  if low in ('true', 'false'):
    value = low == 'true'
  elif low in ('none', 'null'):
    value = None
  elif re.fullmatch(r'[-+]?\d[\d_]*', text):
    value = int(text.replace('_', ''))
  elif re.fullmatch(r'[-+]?(\d[\d_]*\.?[\d_]*|\.\d+)([eE][-+]?\d+)?', text):
    value = float(text.replace('_', ''))
  elif text.startswith('['):
    value = _parse_list(text)
  if isinstance(like, float) and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if isinstance(like, list) and isinstance(value, str):
    value = [value]
  return value


def _parse_list(text: str) -> Any:
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    pass
  try:  # a list written YAML-style, e.g. [silu,linear]
    return yaml.safe_load(text)
  except Exception:  # pylint: disable=broad-except
    return text


def show(value: Any) -> str:
  if isinstance(value, bool):
    return 'true' if value else 'false'
  if isinstance(value, list):
    return '[' + ', '.join(show(v) for v in value) + ']'
  if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
    return str(value)
  return str(value)


def _integral(value: Any) -> Any:
  if isinstance(value, float) and value.is_integer():
    return int(value)
  return value


def load_yaml(path: str, what: str) -> dict[str, Any]:
  text = read_text(path, what, MAX_CONFIG_BYTES)
  try:
    data = yaml.safe_load(text)
  except yaml.YAMLError as e:
    raise UserError(f'{what} {path!r} is not valid YAML: {str(e).splitlines()[0]}') from None
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise UserError(f'{what} {path!r} is not a mapping of MaxText keys.')
  # PyYAML reads `1e-5` (no dot) as a string; MaxText reads it as a number.
  return {str(k): parse_value(v) if isinstance(v, str) else v for k, v in data.items()}


# ---- era and defaults -----------------------------------------------------------


def _check_date(date: str) -> str:
  if not re.fullmatch(r'\d{4}-\d{2}(-\d{2})?', date):
    raise UserError(f'--maxtext-date {date!r} is not a date like 2023-08-15.')
  return date if len(date) == 10 else date + '-01'


def detect_era(script_keys: set[str], base_keys: set[str], entry: str,
               options: Options) -> tuple[str, str]:
  """The scaling era and why it was chosen."""
  if options.era:
    if options.era not in mt.ERAS:
      raise UserError(f'--maxtext-era {options.era!r} is not one of {", ".join(mt.ERA_ORDER)}.')
    return options.era, 'chosen with --maxtext-era'
  if options.date:
    return mt.era_at(options.date), f'in force on {options.date} (--maxtext-date)'
  for keys, where in ((script_keys, 'the script'), (base_keys, 'your base.yml')):
    if 'scale' in keys:
      return 'scale', f'{where} sets `scale`, the size key of MaxText until 2023-07-21'
    if 'global_parameter_scale' in keys:
      return 'current', (f'{where} sets `global_parameter_scale`, read with the rule in force '
                         'since 2023-09-07 (use --maxtext-era jul2023 or aug2023 for a script '
                         'of 21 July to 6 September 2023)')
  keys = script_keys | base_keys
  if 'base_num_heads' in keys:
    return 'scale', ('`base_num_heads` is the 2023 head-count key (before base_num_query_heads); '
                     'assuming the first 2023 rule')
  later = sorted(keys & _KEYS_LATER)
  if later:
    return 'current', f'`{later[0]}` only exists in MaxText since late 2023'
  if 'maxtext.trainers' in entry:
    return 'current', f'`{entry}` is the trainer module of today\'s MaxText'
  old = sorted(keys & _KEYS_2023)
  if old:
    return 'scale', f'`{old[0]}` is a key of the 2023 base.yml'
  return 'current', 'nothing in the script dates it; assuming today\'s MaxText (--maxtext-era to change)'


def choose_snapshot(era: str, script_keys: set[str], options: Options) -> tuple[mt.Snapshot, str]:
  """The dated base.yml defaults: the latest of the era that knows the script's keys best."""
  if options.date:
    snap = mt.snapshot_at(options.date)
    return snap, f'in force on {options.date} (--maxtext-date)'
  candidates = [s for s in mt.SNAPSHOTS if s.era == era]
  every = set.intersection(*(set(s.values) for s in mt.SNAPSHOTS))
  markers = {k for k in script_keys if any(k in s.values for s in mt.SNAPSHOTS)} - every
  best = max(candidates, key=lambda s: (len(markers & set(s.values)), s.start))
  why = f'latest defaults of era {era}'
  if markers & set(best.values):
    why += ' that know ' + ', '.join(f'`{k}`' for k in sorted(markers & set(best.values))[:3])
  return best, why


def scale_factors(era: str, scale: Any) -> dict[str, Any]:
  """Multipliers for emb, heads, mlp, layers, and how each came about."""
  if era == 'scale':
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0:
      raise UserError(f'scale={scale!r} must be a positive number.')
    desc = f'scale {show(_integral(scale))}'
    return {k: (_integral(scale), desc) for k in ('emb', 'heads', 'mlp', 'layers')}
  if (not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0
      or 2 ** round(math.log2(scale)) != scale):
    raise UserError(f'global_parameter_scale={show(scale)} is not a power of two; MaxText '
                    'requires one (set base_emb_dim, base_num_query_heads, base_mlp_dim and '
                    'base_num_decoder_layers explicitly for other sizes).')
  b, r = divmod(round(math.log2(scale)), 3)
  if era == 'jul2023':
    if b < 0:
      raise UserError(f'global_parameter_scale={show(scale)} below 1 has no meaning in era jul2023.')
    mult = {'emb': b + 1 + (r > 0), 'heads': b + 1 + (r > 1), 'mlp': b + 1 + (r > 1),
            'layers': b + 1}
    return {k: (v, f'x{v} (jul2023 rule, scale {show(scale)})') for k, v in mult.items()}
  if era == 'aug2023':
    exps = {'emb': b + (r > 0), 'heads': b + (r > 1), 'mlp': b + (r > 1), 'layers': b}
  else:
    exps = {'heads': b + (r > 0), 'mlp': b + (r > 0), 'emb': b + (r > 1), 'layers': b}
  return {k: (2.0 ** e if e < 0 else 2 ** e, f'2**{e} ({era} rule, scale {show(scale)})')
          for k, e in exps.items()}


# ---- the translation ------------------------------------------------------------


class _Builder:
  """Holds the merged config with each key's source, and collects rows and findings."""

  def __init__(self, script: ScriptInfo, options: Options):
    self.script = script
    self.options = options
    self.overrides: dict[str, str] = {}
    self.notes: list[str] = list(script.notes)
    self.warnings: list[str] = []
    self.strict: list[str] = []
    self.unknown: list[str] = []
    self.era = 'current'
    for o in script.overrides:
      if o.key in self.overrides and self.overrides[o.key] != o.value:
        self.notes.append(f'`{o.key}` is set twice; the later value {o.value!r} wins.')
      self.overrides[o.key] = o.value
    self.config: dict[str, Any] = {}
    self.source: dict[str, str] = {}
    self.rows: list[Row] = []
    self.knobs: dict[str, Any] = {}
    self.consumed: set[str] = set()
    self.unsupported: dict[str, str] = {}
    self.preset_name: Optional[str] = None
    self.preset_keys: dict[str, Any] = {}
    self.base_keys: set[str] = set()

  # -- config --

  def load(self) -> tuple[str, str, str, str]:
    script_keys = set(self.overrides)
    base = {}
    if self.options.base_config:
      base = load_yaml(self.options.base_config, 'base config')
    if self.options.date:
      self.options.date = _check_date(self.options.date)
    era, era_reason = detect_era(script_keys, set(base), self.script.entry, self.options)
    self.era = era
    snap, snap_reason = choose_snapshot(era, script_keys | set(base), self.options)
    self.snapshot = snap
    # MaxText's MoE keys came after the last dated snapshot: their defaults of the run's date (today's without one)
    when = self.options.date or 'today'
    self._layer(mt.moe_defaults(self.options.date), f'MaxText MoE defaults ({when})')
    self._layer(snap.values, f'base.yml {snap.name}')
    defaults_name = f'{snap.name} (from {snap.start}): {snap.description}'
    self.base_keys = set(base)
    if base:
      self._layer(base, 'your base.yml')
      defaults_name = f'{self.options.base_config} (keys it lacks from base.yml {snap.name})'
      snap_reason = '--base-config'
    self._load_preset()
    for key, raw in self.overrides.items():
      self.config[key] = parse_value(raw, self.config.get(key))
      self.source[key] = 'script'
    return era, era_reason, defaults_name, snap_reason

  def _layer(self, values: dict[str, Any], source: str) -> None:
    for key, value in values.items():
      self.config[key] = value
      self.source[key] = source

  def _load_preset(self) -> None:
    name = self.overrides.get('model_name', self.config.get('model_name', 'default'))
    name = str(parse_value(name))
    self.consumed.add('model_name')
    if self.options.model_config:
      values = load_yaml(self.options.model_config, 'model config')
      self.preset_name = self.options.model_config
      if name not in ('default', ''):
        self.notes.append(f'--model-config {self.options.model_config} used for model_name={name}.')
    elif name in ('default', ''):
      return
    elif name in mt.PRESETS:
      values = mt.PRESETS[name]
      self.preset_name = name
    else:
      known = ', '.join(sorted(mt.PRESETS))
      raise UserError(f'Unknown MaxText model_name {name!r}.{did_you_mean(name, mt.PRESETS)} '
                      f'Known: {known}. For another model give its MaxText config with '
                      '--model-config FILE.yml.')
    self.preset_keys = dict(values)
    self._layer(values, f'model {self.preset_name}')

  def get(self, key: str, fallback: Any = None) -> Any:
    self.consumed.add(key)
    return self.config.get(key, fallback)

  def whole(self, key: str, fallback: Any = None) -> int:
    return int(self._number(key, fallback, whole=True))

  def real(self, key: str, fallback: Any = None) -> float:
    return float(self._number(key, fallback, whole=False))

  def _number(self, key: str, fallback: Any, whole: bool) -> Any:
    value = self.get(key, fallback)
    if value is None or value == '':
      if self.overrides.get(key) == '' and fallback is None:
        raise UserError(f'{key}= is empty in the script: a variable it uses is not set. Give it after the '
                        f'script, e.g. `pax import-maxtext run.sh NAME=VALUE`.')
      value = fallback  # MaxText's null / empty means "the default"
    if (isinstance(value, bool) or not isinstance(value, (int, float))
        or whole and not float(value).is_integer()):
      raise UserError(f'{key}={show(value)} must be a {"whole " if whole else ""}number.')
    return value

  def raw(self, key: str) -> str:
    if key in self.overrides:
      return self.overrides[key]
    if key in self.config:
      return f'{show(self.config[key])} ({self.source[key]})'
    return '(unset)'

  def src(self, key: str) -> str:
    return self.source.get(key, 'paxcli')

  def put(self, knob: str, value: Any, key: str = '', raw: Optional[str] = None,
          after: str = '', source: Optional[str] = None) -> None:
    self.knobs[knob] = value
    if knob in LM_KNOB and key:   # a size or count the model would be built from: bounded here, naming the key
      LM_KNOB[knob].check(value, f'{key.split(",")[0].strip()}: ')
    first = key.split(',')[0].strip() if key else ''
    self.rows.append(Row(knob, value, key, raw if raw is not None else (self.raw(first) if first else ''),
                         after, source or (self.src(first) if first else 'paxcli')))

  def direct(self, knob: str, key: str, fallback: Any = None, **row) -> Any:
    """Puts a MaxText key that is one LM knob, read as the knob's type in the knob table."""
    read = self.real if LM_KNOB[knob].type is float else self.whole
    value = read(key, fallback)
    self.put(knob, value, key, **row)
    return value

  def feature(self, name: str, why: str) -> None:
    if name not in self.unsupported:
      self.unsupported[name] = why
      self.warnings.append(f'unsupported: {name}: {why}.')


def translate(script: ScriptInfo, options: Options) -> Translation:
  """Translates a parsed MaxText script; raises UserError where the result would be wrong."""
  b = _Builder(script, options)
  era, era_reason, defaults_name, defaults_reason = b.load()
  _model(b, era)
  _activation_and_block(b)
  _precision_and_remat(b)
  _mesh(b)
  _optimizer(b)
  _schedule_and_loop(b)
  _platform_env(b)
  b.knobs['UNSUPPORTED_FEATURES'] = dict(b.unsupported)
  untranslated = _untranslated(b)
  return Translation(script=script, era=era, era_reason=era_reason, defaults=defaults_name,
                     defaults_reason=defaults_reason, preset=b.preset_name, knobs=b.knobs,
                     rows=b.rows, untranslated=untranslated, warnings=b.warnings,
                     strict_warnings=b.strict, notes=b.notes, unsupported=b.unsupported,
                     unknown_keys=b.unknown)


def _scaled(b: _Builder, knob: str, key: str, factor: tuple[Any, str], scale_key: str) -> int:
  base = b.get(key)
  if not isinstance(base, (int, float)) or isinstance(base, bool):
    raise UserError(f'{key}={base!r} must be a number.')
  mult, desc = factor
  value = base * mult
  if not float(value).is_integer():
    raise UserError(f'{key}={show(base)} times {desc} is {value}, not a whole number.')
  value = int(value)
  shown = mult != 1 or scale_key in b.overrides  # the seed table shows every scaled value
  after = f'{value} (= {desc} x {show(base)})' if shown else ''
  scaled_by = f', {scale_key}' if shown else ''
  b.put(knob, value, key + scaled_by, after=after)
  return value


def _model(b: _Builder, era: str) -> None:
  scale_key = mt.ERAS[era].scale_key
  other = 'global_parameter_scale' if scale_key == 'scale' else 'scale'
  if other in b.overrides:
    b.warnings.append(f'`{other}` is not a key of era {era}; the size comes from `{scale_key}` '
                      f'({show(b.config.get(scale_key, 1))}).')
  factors = scale_factors(era, b.config.get(scale_key, 1))
  b.consumed.add(scale_key)
  b.consumed.add(other)
  layers = _scaled(b, 'NUM_LAYERS', 'base_num_decoder_layers', factors['layers'], scale_key)
  _scaled(b, 'MODEL_DIMS', 'base_emb_dim', factors['emb'], scale_key)
  _scaled(b, 'HIDDEN_DIMS', 'base_mlp_dim', factors['mlp'], scale_key)
  query_key = _head_key(b)
  heads = _scaled(b, 'NUM_HEADS', query_key, factors['heads'], scale_key)
  if query_key == 'base_num_query_heads':
    kv_key = 'base_num_kv_heads' if 'base_num_kv_heads' in b.config else query_key
    kv = _scaled(b, 'NUM_KV_HEADS', kv_key, factors['heads'], scale_key)
    if heads % kv:
      raise UserError(f'{heads} query heads are not a multiple of {kv} kv heads.')
  b.consumed.update({'base_num_heads', 'base_num_query_heads', 'base_num_kv_heads'})
  b.direct('DIMS_PER_HEAD', 'head_dim')
  b.direct('VOCAB_SIZE', 'vocab_size')
  b.direct('MAX_SEQ_LEN', 'max_target_length')
  b.put('PERCORE_BATCH_SIZE', _integral(b.real('per_device_batch_size')), 'per_device_batch_size')
  if b.config.get('decoder_block') == 'gemma2':
    b.knobs['NUM_LAYERS'] = 2 * layers
    b.rows[0].value = 2 * layers
    b.rows[0].after = f'{2 * layers} (a gemma2 decoder layer is a local+global pair)'


def _head_key(b: _Builder) -> str:
  for key in ('base_num_query_heads', 'base_num_heads'):
    if key in b.overrides or key in b.preset_keys:
      return key
  return 'base_num_query_heads' if 'base_num_query_heads' in b.config else 'base_num_heads'


def _activation_and_block(b: _Builder) -> None:
  acts = b.get('mlp_activations', ['relu'])
  acts = [acts] if isinstance(acts, str) else list(acts)
  gated = len(acts) == 2 and 'linear' in acts
  act = [a for a in acts if a != 'linear'][0] if gated else (acts[0] if len(acts) == 1 else None)
  if act not in _ACTIVATIONS:
    b.feature('mlp_activations', f'mlp_activations={show(acts)} has no paxcli MLP; relu is used')
    act, gated = 'relu', False
  b.put('ACTIVATION', act, 'mlp_activations')
  b.put('USE_GATED_ACTIVATION', gated, 'mlp_activations')
  name = str(b.get('decoder_block', 'default'))
  block = _decoder_block(name)
  if block is None:
    b.feature('decoder_block', f'decoder_block={name} has no paxcli layer; a llama2-style layer '
                               'is used')
    block = _decoder_block('llama2')
  elif block.unsupported:
    b.feature(f'decoder_block_{name}', block.unsupported)
  knobs = dict(block.knobs)
  owner = registry.maxtext_block(name)
  if owner and not block.unsupported:   # the model is one of the family whose block it is
    b.put('MODEL_FAMILY', owner[0].name, 'decoder_block')
  if knobs.pop('PARALLEL_BLOCK', False):
    if b.snapshot.start < mt.DEFAULT_BLOCK_SINCE and not b.options.base_config:
      b.feature(f'decoder_block_{name}', mt.DEFAULT_BLOCK_2023)
    b.put('PARALLEL_BLOCK', True, 'decoder_block')
  position = knobs.pop('POSITION_EMBEDDING')
  if b.whole('trainable_position_size', -1) > 0:
    position = 'learned'
  b.put('NORM_TYPE', knobs.pop('NORM_TYPE'), 'decoder_block')
  _norm_epsilon(b)
  b.put('USE_BIAS', knobs.pop('USE_BIAS'), 'decoder_block')
  b.put('POSITION_EMBEDDING', position, 'decoder_block, trainable_position_size')
  for knob, value in knobs.items():   # whatever else the family's block sets
    b.put(knob, value, 'decoder_block')
  handled = set()
  for knob, value, keys, *after in (block.from_config(b.get, b.knobs) if block.from_config else ()):
    b.put(knob, value, keys, after=after[0] if after else '')
    handled.update(k.strip() for k in keys.split(','))
  if b.knobs.get('MOE_DISPATCH') == 'capacity':
    b.notes.append('capacity_factor: where an expert overflows, MaxText keeps the earlier tokens (each token\'s k '
                   'choices together); paxcli keeps every first choice before any second one (GShard\'s order), '
                   'so the dropped tokens can differ, not how many an expert takes.')
  if position == 'rotary':
    b.direct('ROTARY_MAX_TIMESCALE', 'rope_max_timescale', 10000,
             raw=b.raw('rope_max_timescale') if 'rope_max_timescale' in b.config else '10000 (MaxText)')
  b.put('SEPARATE_EMBEDDING', not bool(b.get('logits_via_embedding')), 'logits_via_embedding')
  if b.get('logits_via_embedding'):
    b.put('TIED_LOGITS_BFLOAT16', True, 'logits_via_embedding')
  # MaxText's stored embedding x sqrt(emb_dim) and tied logits / sqrt(emb_dim) are Gemma's embedding scale.
  gemma_scale = b.knobs.get('SCALE_EMBEDDING_SQRT_DEPTH', False)
  if b.get('logits_via_embedding') and b.get('normalize_embedding_logits', False) and not gemma_scale:
    b.feature('normalize_embedding_logits', 'MaxText divides the tied output logits by '
                                            'sqrt(emb_dim) (normalize_embedding_logits); paxcli does not')
  dropout = b.real('dropout_rate', 0)
  if b.get('enable_dropout', True) is False:
    dropout = 0.0
  b.put('DROPOUT_PROB', dropout, 'dropout_rate, enable_dropout')
  _model_features(b, handled)


def _decoder_block(name: str):
  """The MaxTextBlock of a decoder_block name: a family's (paxcli.models.registry), else one of the
  blocks no family computes; None for a name paxcli does not know."""
  owned = registry.maxtext_block(name)
  return owned[1] if owned else mt.OTHER_DECODER_BLOCKS.get(name)


def _norm_epsilon(b: _Builder) -> None:
  """NORM_EPSILON from whichever of MaxText's names for it the run has (the script's own first)."""
  present = [k for k in _NORM_EPSILON_KEYS if k in b.config]
  key = next((k for k in present if k in b.overrides), present[0] if present else None)
  b.consumed.update(_NORM_EPSILON_KEYS)
  if key:  # base.yml since late 2023 (1e-5 in 2024), a model preset, or the script
    b.direct('NORM_EPSILON', key)
  else:
    b.put('NORM_EPSILON', _EARLY_NORM_EPSILON, _NORM_EPSILON_KEYS[0],
          raw=f'(no such key yet: MaxText\'s norms used {_EARLY_NORM_EPSILON:g})')


def _model_features(b: _Builder, handled: set = frozenset()) -> None:
  """MaxText settings that make a model paxcli cannot build (but those the decoder block has `handled`)."""
  checks = [
      ('num_experts', lambda v: int(v) > 1, 'mixture_of_experts',
       'num_experts={v} on a decoder block paxcli builds with a dense MLP (it reads experts of decoder_block=mixtral)'),
      ('use_random_routing', bool, 'random_routing', 'MaxText routes each token to random experts'),
      ('ragged_buffer_factor', lambda v: v is not None and float(v) > 0, 'moe_token_dropping',
       'MaxText drops routed tokens past ragged_buffer_factor={v} x the balanced share of a device'),
      ('sliding_window_size', lambda v: v and int(v) > 0, 'sliding_window_attention',
       'MaxText limits attention to a window of {v} tokens'),
      ('attn_logits_soft_cap', lambda v: v and float(v) > 0, 'logit_soft_capping',
       'MaxText soft-caps attention logits at {v}'),
      ('final_logits_soft_cap', lambda v: v and float(v) > 0, 'logit_soft_capping',
       'MaxText soft-caps output logits at {v}'),
      ('use_post_attn_norm', bool, 'post_norms', 'MaxText adds norms after attention and MLP'),
      ('use_post_ffw_norm', bool, 'post_norms', 'MaxText adds norms after attention and MLP'),
      ('use_qk_norm', bool, 'qk_norm', 'MaxText normalizes queries and keys'),
      ('quantization', lambda v: v not in ('', None), 'quantization',
       'MaxText trains with quantization={v}'),
      ('int8_training', bool, 'quantization', 'MaxText trains with int8 matmuls'),
      ('use_int8_training', bool, 'quantization', 'MaxText trains with int8 matmuls'),
      ('attention_type', lambda v: v not in ('global', None), 'attention_type',
       'MaxText uses attention_type={v}'),
      ('use_untrainable_positional_embedding', bool, 'sinusoidal_positions',
       'MaxText adds sinusoidal position embeddings'),
      ('rope_type', lambda v: v not in ('default', None, ''), 'rope_scaling',
       'MaxText scales rotary positions (rope_type={v})'),
  ]
  for key, test, feature, why in checks:
    if key not in b.config or key in handled:
      continue
    value = b.get(key)
    try:
      bad = test(value)
    except (TypeError, ValueError):
      bad = True
    if bad:
      b.feature(feature, why.format(v=show(value)))


def _precision_and_remat(b: _Builder) -> None:
  dtype = str(b.get('dtype', 'bfloat16'))
  if dtype not in _DTYPES:
    b.feature('dtype', f'dtype={dtype} has no paxcli equivalent; bfloat16 is used')
    dtype = 'bfloat16'
  b.put('FPROP_DTYPE', dtype, 'dtype')
  weights = b.config.get('weight_dtype', 'float32')
  if str(weights) != 'float32':
    b.warnings.append(f'weight_dtype={weights}: paxcli keeps weights in float32.')
  b.put('USE_REPEATED_LAYER', bool(b.get('scan_layers', True)), 'scan_layers')
  policy = str(b.get('remat_policy', 'full'))
  pax, differs = mt.REMAT.get(policy, ('save_nothing', f'unknown MaxText policy {policy!r}'))
  b.put('CHECKPOINT_POLICY', pax, 'remat_policy')
  if differs:
    b.notes.append(f'remat_policy={policy} -> CHECKPOINT_POLICY={pax!r}, the closest: {differs} '
                   '(memory and speed only; the numbers are the same).')


def _optimizer(b: _Builder) -> None:
  opt = str(b.get('opt_type', 'adam' if 'adam_weight_decay' not in b.config else 'adamw'))
  if opt == 'adam_pax':
    b.notes.append('opt_type=adam_pax (Pax-style Adam with decoupled weight decay) -> OPTIMIZER '
                   "'adamw'.")
    opt = 'adamw'
  if opt not in ('adam', 'adamw', 'sgd', 'adafactor'):
    b.feature('optimizer', f'opt_type={opt} has no paxcli optimizer; adamw is used')
    opt = 'adamw'
  raw = b.raw('opt_type') if 'opt_type' in b.config else 'adam (2023 MaxText: optax.adam)'
  b.put('OPTIMIZER', opt, 'opt_type', raw=raw)
  b.put('LEARNING_RATE', b.real('learning_rate'), 'learning_rate')
  b.put('ADAM_BETA1', b.real('adam_b1', 0.9), 'adam_b1')
  b.put('ADAM_BETA2', b.real('adam_b2', 0.95), 'adam_b2')
  b.put('ADAM_EPSILON', b.real('adam_eps', 1e-8), 'adam_eps')
  decay = b.real('adam_weight_decay', 0.0) if opt == 'adamw' else 0.0
  b.put('WEIGHT_DECAY', decay, 'adam_weight_decay',
        raw=b.raw('adam_weight_decay') if 'adam_weight_decay' in b.config else '(none in this MaxText)')
  clip = b.config.get('gradient_clipping_threshold')
  b.put('CLIP_GRADIENT_NORM_TO_VALUE', b.real('gradient_clipping_threshold', 0.0),
        'gradient_clipping_threshold',
        raw=None if clip is not None else '(none: 2023 MaxText did not clip)')


def _schedule_and_loop(b: _Builder) -> None:
  steps = b.whole('steps')
  sched_steps = b.whole('learning_rate_schedule_steps', -1)
  if steps < 0:
    steps = sched_steps
  if 'warmup_steps_fraction' in b.config:
    total = sched_steps if sched_steps > 0 else steps
    warmup = int(total * b.real('warmup_steps_fraction'))
    final = b.config.get('learning_rate_final_fraction',
                         b.config.get('cosine_learning_rate_final_fraction', 0.1))
    b.consumed.update({'learning_rate_final_fraction', 'cosine_learning_rate_final_fraction'})
    kind = str(b.get('lr_schedule_type', 'cosine'))
    if kind != 'cosine':
      b.notes.append(f'lr_schedule_type={kind}: approximated by Pax\'s linear ramp + cosine decay.')
    b.put('LR_SCHEDULE', 'linear_rampup_cosine_decay', 'warmup_steps_fraction',
          raw=f'warmup {show(b.config["warmup_steps_fraction"])} x {total} steps, cosine to '
              f'{show(final)}')
    b.put('LR_WARMUP_STEPS', warmup, 'warmup_steps_fraction', after=f'{warmup} (= fraction x {total})')
    b.put('LR_DECAY_START', warmup, 'warmup_steps_fraction')
    b.put('LR_DECAY_END', total, 'learning_rate_schedule_steps, steps', raw=str(total))
    b.put('LR_MIN_RATIO', float(final), 'cosine_learning_rate_final_fraction', raw=show(final))
    if steps > total:
      b.notes.append(f'MaxText sets the learning rate to 0 after step {total}; Pax keeps it at '
                     f'the final ratio.')
  else:
    warmup = b.whole('warmup_steps', 0)
    b.put('LR_SCHEDULE', 'constant', 'warmup_steps', raw=b.raw('warmup_steps'))
    b.put('LR_WARMUP_STEPS', warmup, 'warmup_steps')
    b.notes.append('2023 MaxText decays the learning rate as 1/sqrt(step) after the warm-up; '
                   'Pax has no such schedule, so it stays constant after the warm-up.')
  b.put('NUM_TRAIN_STEPS', steps, 'steps')
  period_key = 'checkpoint_period' if 'checkpoint_period' in b.config else 'save_period'
  period = b.whole(period_key, steps)
  b.consumed.update({'checkpoint_period', 'save_period'})
  if b.get('enable_checkpointing', True) is False:
    period = max(steps, 1)
    b.notes.append('enable_checkpointing=false: paxcli always checkpoints; SAVE_INTERVAL_STEPS is '
                   'the number of steps.')
  b.put('SAVE_INTERVAL_STEPS', period, f'{period_key}, enable_checkpointing')
  b.put('SUMMARY_INTERVAL_STEPS', b.whole('log_period', 100), 'log_period')
  if 'init_weights_seed' in b.config:
    b.put('RANDOM_SEED', b.whole('init_weights_seed'), 'init_weights_seed')


# ---- mesh -----------------------------------------------------------------------


def _devices(b: _Builder, dcn_fixed: int, dcn_fill: bool) -> tuple[Optional[int], int, str]:
  """(devices per slice or None, number of slices, how they were known)."""
  o = b.options
  topology, slices, per_slice, how = o.topology, o.num_slices, None, ''
  compiled = str(b.get('compile_topology', '') or '')
  if not topology and compiled:
    # A train_compile.py script names its target: use it unless the user gave a topology.
    if mt.topology_devices(compiled) is not None:
      topology = compiled
      if slices is None and b.whole('compile_topology_num_slices', -1) > 0:
        slices = b.whole('compile_topology_num_slices')
    else:
      b.notes.append(f'compile_topology={compiled} is not a TPU type paxcli knows; give --num-devices.')
  if topology:
    per_slice = mt.topology_devices(topology)
    if per_slice is None:
      raise UserError(f'--topology {topology!r} is not a TPU type paxcli knows (e.g. '
                      f'{", ".join(mt.topology_examples())}); give --num-devices instead.')
    how = f'{"--topology " if o.topology else "compile_topology="}{topology}: {per_slice} devices per slice'
  if slices is None:
    # The script's own DCN sizes say how many slices it ran on; a -1 axis counts as 1.
    slices = dcn_fixed
    if dcn_fill:
      b.notes.append(f'DCN fill (-1) resolved for {slices} slice(s); give --num-slices N for '
                     'another count.')
  elif slices < 1:
    raise UserError(f'--num-slices {slices} must be at least 1.')
  if o.num_devices is not None:
    if o.num_devices < 1:
      raise UserError(f'--num-devices {o.num_devices} must be at least 1.')
    if per_slice is not None and o.num_devices != per_slice * slices:
      raise UserError(f'--num-devices {o.num_devices} does not match {topology} x '
                      f'{slices} slices = {per_slice * slices} devices.')
    if o.num_devices % slices:
      raise UserError(f'--num-devices {o.num_devices} is not a multiple of {slices} slices.')
    per_slice = o.num_devices // slices
    how = how or f'--num-devices {o.num_devices} over {slices} slice(s)'
  return per_slice, slices, how


def _resolve(values: dict[str, int], total: Optional[int], net: str) -> dict[str, int]:
  """Fills the one -1 axis of a network, or checks the product; raises if impossible."""
  fills = [a for a, v in values.items() if v == -1]
  bad = [f'{net}_{a}_parallelism={v}' for a, v in values.items() if v == 0 or v < -1]
  if bad:
    raise UserError(f'{", ".join(bad)}: parallelism must be positive or -1 (fill).')
  if len(fills) > 1:
    raise UserError(f'{" and ".join(f"{net}_{a}_parallelism" for a in fills)} are both -1; '
                    'MaxText allows one axis per network to fill the rest.')
  if total is None:
    return values
  fixed = math.prod(v for v in values.values() if v != -1)
  desc = ' x '.join(f'{net}_{a}={v}' for a, v in values.items() if v != 1) or 'all 1'
  if fills:
    if total % fixed:
      raise UserError(f'Cannot build the MaxText mesh: {desc} needs a multiple of {fixed} '
                      f'{"devices per slice" if net == "ici" else "slices"}, but there are {total}.')
    return dict(values, **{fills[0]: total // fixed})
  if fixed != total:
    raise UserError(f'Cannot build the MaxText mesh: {desc} = {fixed} '
                    f'{"devices per slice" if net == "ici" else "slices"}, but there are {total}.')
  return values


def _mesh(b: _Builder) -> None:
  nets: dict[str, dict[str, int]] = {'ici': {}, 'dcn': {}}
  for key in sorted(b.config):
    m = _PARALLELISM_RE.match(key)
    if m and m.group(2) in _AXIS_FOLD:
      nets[m.group(1)][m.group(2)] = b.whole(key)
  for net in nets:
    for axis in ('data', 'fsdp', 'tensor'):
      nets[net].setdefault(axis, 1)
  dcn_fixed = math.prod(v for v in nets['dcn'].values() if v != -1)
  per_slice, slices, how = _devices(b, dcn_fixed, -1 in nets['dcn'].values())
  ici = _resolve(nets['ici'], per_slice, 'ici')
  dcn = _resolve(nets['dcn'], slices, 'dcn')
  experts = b.knobs.get('NUM_EXPERTS', 0)
  expert_axis = bool(experts) and any(n.get('expert', 1) != 1 for n in (ici, dcn))
  if expert_axis:
    _check_expert_parallelism(experts, ici.get('expert', 1), dcn.get('expert', 1))
  pax_ici = _fold(b, ici, 'ici', expert_axis)
  pax_dcn = _fold(b, dcn, 'dcn', expert_axis)
  if -1 in pax_ici:
    b.notes.append(f'ICI_MESH_SHAPE {pax_ici}: -1 fills the remaining devices when paxcli '
                   'trains (give --num-devices N, or --topology and --num-slices, to resolve it now).')
  after = f'{pax_ici} ({how})' if how else ''
  keys = ', {net}_expert' if expert_axis else ''
  b.put('ICI_MESH_SHAPE', pax_ici, 'ici_data, ici_fsdp, ici_tensor' + keys.format(net='ici'),
        raw=_mesh_raw(nets['ici'], 'ici'), after=after, source=_mesh_source(b, 'ici'))
  b.put('DCN_MESH_SHAPE', pax_dcn, 'dcn_data, dcn_fsdp, dcn_tensor' + keys.format(net='dcn'),
        raw=_mesh_raw(nets['dcn'], 'dcn'), after=f'{pax_dcn}' if -1 in nets['dcn'].values() else '',
        source=_mesh_source(b, 'dcn'))


def _check_expert_parallelism(experts: int, ici: int, dcn: int) -> None:
  """One line when MaxText's expert parallelism (-1: filled later) does not divide the experts."""
  if ici != -1 and dcn != -1 and experts % (ici * dcn):
    raise UserError(f'ici_expert_parallelism={ici} x dcn_expert_parallelism={dcn} = {ici * dcn} does not divide '
                    f'num_experts={experts}: every device of the expert axis holds the same number of experts.')


# With an expert axis, paxcli's five-entry mesh [stage, replica, data, expert, mdl]: where each of the three
# Pax axes of _AXIS_FOLD goes, and the expert axis.
_EXPERT_MESH = {0: 1, 1: 2, 2: 4, 'expert': 3}


def _fold(b: _Builder, values: dict[str, int], net: str, expert_axis: bool = False) -> list[int]:
  """Pax's [replica, data, mdl] of a network's MaxText axes, or [stage 1, replica, data, expert, mdl] where
  the model's experts are sharded over MaxText's expert axis."""
  shape = [1] * (5 if expert_axis else 3)
  for axis, value in values.items():
    pax_axis = _AXIS_FOLD[axis]
    index = (_EXPERT_MESH['expert' if axis == 'expert' else pax_axis]) if expert_axis else pax_axis
    if axis not in ('data', 'fsdp', 'tensor') and value != 1 and not (expert_axis and axis == 'expert'):
      target = f'{_PAX_AXES[pax_axis]} ({"ICI" if net == "ici" else "DCN"}_MESH_SHAPE[{index}])'
      message = (f'{net}_{axis}_parallelism={value}: Pax has no {axis} mesh axis; folded into '
                 f'{target} so the mesh keeps its size.')
      b.warnings.append(message)
      b.strict.append(message)
      if axis in _AXIS_FEATURES:
        b.feature(_AXIS_FEATURES[axis], f'MaxText shards over {axis} ({net}_{axis}_parallelism='
                                        f'{value}); paxcli shards that dimension by data instead')
    if shape[index] == -1 or value == -1:
      shape[index] = -1
    else:
      shape[index] *= value
  return shape


def _mesh_raw(values: dict[str, int], net: str) -> str:
  return ', '.join(str(values.get(a, 1)) for a in ('data', 'fsdp', 'tensor')) + (
      '' if all(v == 1 for a, v in values.items() if a not in ('data', 'fsdp', 'tensor'))
      else ' (+ ' + ', '.join(f'{a}={v}' for a, v in values.items()
                               if a not in ('data', 'fsdp', 'tensor') and v != 1) + ')')


def _mesh_source(b: _Builder, net: str) -> str:
  keys = [k for k in b.overrides if k.startswith(f'{net}_') and k.endswith('_parallelism')]
  return 'script' if keys else b.src(f'{net}_fsdp_parallelism')


# ---- environment ----------------------------------------------------------------

_TPU_FLAG = re.compile(r'xla_(tpu|jf|sc)_|megacore|TPU_', re.I)
_GPU_FLAG = re.compile(r'xla_gpu_|cuda|nccl', re.I)


def _split_xla_flags(value: str, hardware: str) -> dict[str, list[str]]:
  """XLA flags per platform: TPU flags abort jax elsewhere; plain flags go where the run ran."""
  flags = value.split()
  tpu = [f for f in flags if _TPU_FLAG.search(f)]
  gpu = [f for f in flags if _GPU_FLAG.search(f) and f not in tpu]
  plain = [f for f in flags if f not in tpu and f not in gpu]
  split = {'tpu': tpu, 'gpu': gpu}
  split[hardware] = [f for f in flags if f in split[hardware] or f in plain]
  return {platform: chosen for platform, chosen in split.items() if chosen}


def _platform_env(b: _Builder) -> None:
  # MaxText's `hardware` says where the script ran (tpu unless gpu/gpu_multiprocess).
  hardware = 'gpu' if str(b.config.get('hardware', 'tpu')).startswith('gpu') else 'tpu'
  env: dict[str, dict[str, str]] = {}
  for name, value in sorted(b.script.env.items()):
    if name.startswith('M_'):
      continue
    if name == 'LIBTPU_INIT_ARGS' or name.startswith('TPU_') or (name.startswith('JAX_') and 'TPU' in name):
      env.setdefault('tpu', {})[name] = value
    elif name == 'XLA_FLAGS':
      for platform, flags in _split_xla_flags(value, hardware).items():
        env.setdefault(platform, {})[name] = ' '.join(flags)
    elif name.startswith(('NCCL_', 'NVTE_', 'CUDA_', 'XLA_PYTHON_CLIENT_', 'TF_GPU')):
      env.setdefault('gpu', {})[name] = value
  if env:
    b.put('PLATFORM_ENV', env, 'exported LIBTPU_INIT_ARGS / XLA_FLAGS',
          raw=', '.join(sorted({n for d in env.values() for n in d})), source='script')


# ---- what was not translated ----------------------------------------------------


@functools.cache
def _era_key_lists() -> dict[str, frozenset[str]]:
  """Keys of MaxText's base.yml over each 2023 era (every version within it), from MaxText's history."""
  data = json.loads(resources.files('paxcli.data').joinpath('maxtext_era_keys.json').read_text())
  return {era: frozenset(keys) for era, keys in data.items()}


def era_keys(era: str) -> frozenset[str]:
  """The keys MaxText's base.yml defines in an era ('current': every key since late 2023)."""
  return _era_key_lists().get(era, KNOWN_KEYS)


def _untranslated(b: _Builder) -> list[Untranslated]:
  # MaxText refuses keys its base.yml does not define: those of the script's era.
  every = set(era_keys(b.era)) | {k for s in mt.SNAPSHOTS if s.era == b.era for k in s.values}
  every |= set(b.preset_keys) | b.base_keys
  out = []
  why_unknown = {}
  for key, source in [(k, 'script') for k in b.overrides] + [(k, 'preset') for k in b.preset_keys]:
    if key in every or key in why_unknown:
      continue
    hint = did_you_mean(key, sorted(every))
    if key in KNOWN_KEYS or any(key in keys for keys in _era_key_lists().values()):
      why = (f"not a key of MaxText's base.yml in the {b.era} era (other MaxText versions have it; "
             '--maxtext-era or --maxtext-date pick another era).')
    else:
      why = 'MaxText has no such key.'
    why_unknown[key] = why + hint
    value = b.overrides.get(key, show(b.config.get(key)))
    message = f'unknown MaxText key `{key}`={value}: {why}{hint}'
    b.warnings.append(message)
    b.strict.append(message)
    if source == 'script':  # even when translated: MaxText itself would refuse the script
      b.unknown.append(f'`{key}`={value}: {why}{hint}')
  keys = [(k, 'script') for k in b.overrides] + [(k, f'model {b.preset_name}') for k in b.preset_keys
                                                  if k not in b.overrides]
  for key, source in keys:
    if key in b.consumed or _PARALLELISM_RE.match(key) and _PARALLELISM_RE.match(key).group(2) in _AXIS_FOLD:
      continue
    value = b.overrides.get(key, show(b.config.get(key)))
    if key in why_unknown:
      out.append(Untranslated(key, value, f'unknown key: {why_unknown[key]}', 'unknown', source))
    elif key == 'dataset_type' and str(b.config.get(key)) == 'synthetic':
      out.append(Untranslated(key, value, 'nothing to translate: the recipe trains on synthetic '
                              "data (LmExperiment's default datasets())", 'ignored', source))
    elif key in _REASONS:
      out.append(Untranslated(key, value, _REASONS[key], 'no_equivalent', source))
    elif key in IGNORED_KEYS or key.startswith(('sa_', 'dump_', 'profile')):
      out.append(Untranslated(key, value, 'ignored by design (logging, profiling, paths or '
                              'kernels: no effect on the model or its training)', 'ignored', source))
    elif key in DATA_KEYS or key.startswith(('hf_', 'grain_', 'dataset')):
      out.append(Untranslated(key, value, 'data: the recipe trains on synthetic data '
                              '(MaxText dataset_type=synthetic); override datasets() for this',
                              'data', source))
    else:
      out.append(Untranslated(key, value, 'no Pax equivalent', 'no_equivalent', source))
  dataset = str(b.config.get('dataset_type', 'c4'))
  if dataset != 'synthetic':
    b.notes.append(f'MaxText reads real data here (dataset_type={dataset}); the recipe trains on '
                   'synthetic data until its datasets() is overridden.')
  return out
