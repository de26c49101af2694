"""The knob tables (paxcli.models.knobs): every knob lands in real layer fields, every layer
field is a knob's or filled by its parent, experiments declare what the tables hold, and a MaxText
key the importer maps onto a knob reaches the resolved model config."""

import dataclasses
import typing

import fiddle as fdl
import pytest

from paxcli import config
from paxcli.maxtext import recipe
from paxcli.maxtext.shell import read_script
from paxcli.maxtext.translate import Options, translate
from paxcli.layers.base import instantiate
from paxcli.layers.transformer import Block
from paxcli.models import (CLASSIFIER_KNOBS, ClassifierExperiment, LmExperiment, TrainingExperiment, flat_view, knobs,
                           lm_config)

# Layer fields no LM knob sets, and who sets them instead.
FILLED_ELSEWHERE = {
    'parent', 'name',                               # flax
    'dtype', 'fprop_dtype', 'params_init',          # weight and compute dtypes: the parent layer fills them
    'deterministic',                                # train or eval (dropout): the parent layer fills it
    'block_tpl', 'final_norm_tpl', 'attention_tpl', 'ffn_tpl', 'norm_tpl', 'lm_tpl',  # templates
}
FILLED_BY_THE_LM = {'model_dims', 'dropout_prob'}   # Block's, from TransformerLm


def _layer_configs(cfg, path=''):
  """(dotted path with a trailing dot, fiddle config) of every template in a model config, the root first."""
  yield path, cfg
  for name, value in cfg.__arguments__.items():
    if isinstance(value, fdl.Buildable):
      yield from _layer_configs(value, f'{path}{name}.')


def _field_names(cfg) -> set[str]:
  return {f.name for f in dataclasses.fields(fdl.get_callable(cfg))}


def _applying(table, settings):
  """The table's knobs whose fields are set with these settings (a `when` knob only where its layer is)."""
  full = knobs.complete(settings, table)
  return [k for k in table if k.applies(full)]


@pytest.mark.parametrize('table, settings, build', [
    (knobs.LM_KNOBS, {}, lambda: lm_config()),
    (knobs.LM_KNOBS, {'num_experts': 4}, lambda: lm_config(num_experts=4)),
    (CLASSIFIER_KNOBS, {}, lambda: ClassifierExperiment().model()),
], ids=['lm', 'lm-moe', 'classifier'])
def test_every_knob_names_layer_fields(table, settings, build):
  configs = dict(_layer_configs(build()))
  for knob in _applying(table, settings):
    for path in knob.fields + tuple(p for p, _ in knob.derived):
      parent, _, name = path.rpartition('.')
      owner = configs[parent + '.' if parent else '']
      assert name in _field_names(owner), f'{knob.name}: {fdl.get_callable(owner).__name__} has no field {name}'


@pytest.mark.parametrize('settings', [{}, {'num_experts': 4}], ids=['dense', 'moe'])
def test_every_field_of_the_lm_layers_is_a_knobs(settings):
  """A new field in an LM layer needs its row in LM_KNOBS (or a line above saying who fills it)."""
  set_by_knobs = {p for k in knobs.LM_KNOBS for p in k.fields + tuple(p for p, _ in k.derived)}
  for prefix, layer in _layer_configs(lm_config(**settings)):
    skip = FILLED_ELSEWHERE | (FILLED_BY_THE_LM if fdl.get_callable(layer) is Block else set())
    for name in _field_names(layer) - skip:
      assert prefix + name in set_by_knobs, f'{prefix}{name} is a layer field no knob of LM_KNOBS sets'


def test_lm_config_sets_each_knobs_fields_and_flat_view_reads_them_back():
  settings = dict(vocab_size=96, num_layers=3, model_dims=48, hidden_dims=80, num_heads=6, num_kv_heads=None,
                  dims_per_head=None, norm_type='rmsnorm', use_bias=False, attention_use_bias=True,
                  position_embedding='rotary', norm_epsilon=3e-6, use_gated_activation=True)
  cfg = lm_config(**settings)
  values = knobs.effective({k.name: settings[k.flat] for k in knobs.LM_KNOBS if k.flat in settings}, knobs.LM_KNOBS)
  assert values['num_kv_heads'] == 6 and values['dims_per_head'] == 8 and values['attention_use_bias'] is True
  assert values['num_experts'] is None and values['experts_per_token'] is None   # no MoE layer: no MoE fields
  for knob in knobs.LM_KNOBS:
    for path in knob.fields:
      assert knobs.get_path(cfg, path) == values[knob.flat], path
  assert cfg.lm_tpl.block_tpl.attention_tpl.rotary is True
  view = flat_view(instantiate(cfg))
  assert {k.flat: getattr(view, k.flat) for k in knobs.LM_KNOBS} == values
  with pytest.raises(TypeError, match='num_head'):
    lm_config(num_head=4)


def test_experiments_declare_the_tables_knobs_with_their_types_and_defaults():
  for cls, table in ((LmExperiment, knobs.LM_KNOBS), (ClassifierExperiment, CLASSIFIER_KNOBS)):
    types = cls.knob_types()
    for knob in table:
      assert types[knob.name] == knob.type and getattr(cls, knob.name) == knob.default
  # Optimizer and loop knobs are the training base's; the classifier has no LM-only knob.
  assert set(typing.get_type_hints(TrainingExperiment)) <= set(ClassifierExperiment.knob_types())
  lm_only = set(LmExperiment.knob_types()) - set(ClassifierExperiment.knob_types())
  assert {'USE_BIAS', 'NORM_EPSILON', 'DECODE_PROMPTS', 'NUM_STAGES', 'CHECKPOINT_POLICY'} <= lm_only


@pytest.mark.parametrize('key', ['normalization_layer_epsilon', 'rms_norm_epsilon'])
def test_a_maxtext_key_reaches_the_resolved_model_config_through_the_table(tmp_path, key):
  script = tmp_path / 'eps.sh'
  script.write_text('python3 MaxText/train.py MaxText/configs/base.yml run_name=x model_name=llama2-7b '
                    f'{key}=3e-6 rope_max_timescale=500000 steps=5\n')
  t = translate(read_script(str(script)), Options())
  assert t.knobs['NORM_EPSILON'] == 3e-6
  assert key not in [u.key for u in t.untranslated]   # read into NORM_EPSILON, never "no Pax knob"
  path = tmp_path / 'eps.py'
  recipe.write(t, 'Eps', str(path), force=False)
  flat = config.resolve(f'{path}:Eps', ['UNSUPPORTED_FEATURES={}']).flat()
  model_rows = [row for row in t.rows if row.knob in knobs.LM_KNOB]
  assert {'NORM_EPSILON', 'ROTARY_MAX_TIMESCALE', 'NUM_LAYERS', 'HIDDEN_DIMS'} <= {r.knob for r in model_rows}
  values = knobs.effective(t.knobs, knobs.LM_KNOBS)
  for row in model_rows:   # every MaxText key translated into a model knob lands in that knob's fields
    knob = knobs.LM_KNOB[row.knob]
    for field in knob.fields:
      assert flat[f'task.model.{field}'] == values[knob.flat], (row.key, field)
  assert flat['task.model.lm_tpl.block_tpl.norm_tpl.epsilon'] == flat['task.model.lm_tpl.final_norm_tpl.epsilon'] == 3e-6
