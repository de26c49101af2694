"""Resolving an experiment into configs: dotted overrides, checks, and printing.

The resolved config of a run is the experiment's knobs, its task config and its
dataset configs, flattened to `path = value` lines (`task.train.num_train_steps = 20`,
`datasets.train.batch_size = None`). It is what `pax describe` prints and what a run
saves in its job directory.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import typing
from typing import Any, Optional

import fiddle as fdl

from paxcli import values as ptypes
from paxcli.errors import UserError, did_you_mean, shorten
from paxcli.experiment import Experiment, instantiate, maxtext_hint


@dataclasses.dataclass
class Resolved:
  """An experiment with every override applied, ready to build."""
  name: str
  experiment: Experiment
  task: fdl.Config
  datasets: dict[str, fdl.Config]  # by name
  # Things the user should hear about (e.g. a knob given on the command line that the
  # experiment's own code overrides); the CLI prints them as warnings.
  warnings: list[str] = dataclasses.field(default_factory=list)

  def flat(self) -> dict[str, Any]:
    out = {f'knobs.{k}': v for k, v in self.experiment.knobs().items()}
    out.update(flatten(self.task, 'task'))
    for name, cfg in self.datasets.items():
      out.update(flatten(cfg, f'datasets.{name}'))
    return out

  def as_text(self) -> str:
    lines = [f'# experiment: {self.name}']
    lines += [f'{k} = {_show(v)}' for k, v in self.flat().items()]
    return '\n'.join(lines) + '\n'

  def train_dataset(self) -> fdl.Config:
    training = [c for c in self.datasets.values() if c.is_training]
    if len(training) != 1:
      raise UserError(f'{self.name}.datasets() must return exactly one input with is_training=True, '
                      f'found {len(training)}.')
    return training[0]

  def eval_datasets(self) -> list[fdl.Config]:
    return [c for c in self.datasets.values() if not c.is_training]


def _show(v: Any) -> str:
  if isinstance(v, type) or callable(v) and not isinstance(v, fdl.Buildable):
    return f'{getattr(v, "__module__", "")}.{getattr(v, "__qualname__", repr(v))}'
  return repr(v)


def _params(cfg: fdl.Buildable) -> dict[str, inspect.Parameter]:
  fn = fdl.get_callable(cfg)
  return {name: p for name, p in inspect.signature(fn).parameters.items()
          if name not in ('self', 'parent', 'name') or name == 'name' and not _is_flax(fn)}


def _is_flax(fn) -> bool:
  return any(c.__module__.startswith('flax.') for c in getattr(fn, '__mro__', ()))


def _field_types(cfg: fdl.Buildable) -> dict[str, Any]:
  fn = fdl.get_callable(cfg)
  try:
    return typing.get_type_hints(fn)
  except Exception:  # an annotation we cannot resolve: skip type checks, keep name checks
    return {}


def _value(cfg: fdl.Buildable, name: str) -> Any:
  if name in cfg.__arguments__:
    return cfg.__arguments__[name]
  p = _params(cfg).get(name)
  if p is not None and p.default is not inspect.Parameter.empty:
    return p.default
  fn = fdl.get_callable(cfg)
  if dataclasses.is_dataclass(fn):
    for f in dataclasses.fields(fn):
      if f.name == name and f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
  return None


def flatten(cfg: Any, prefix: str) -> dict[str, Any]:
  """`prefix.field = value` for every parameter, nested configs expanded."""
  out: dict[str, Any] = {}
  if isinstance(cfg, fdl.Buildable):
    out[f'{prefix}.__fn_or_cls__'] = fdl.get_callable(cfg)
    for name in _params(cfg):
      out.update(flatten(_value(cfg, name), f'{prefix}.{name}'))
  elif dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
    for f in dataclasses.fields(cfg):
      out.update(flatten(getattr(cfg, f.name), f'{prefix}.{f.name}'))
  else:
    out[prefix] = cfg
  return out


def set_path(root: dict[str, Any], key: str, raw: Any) -> None:
  """Applies one dotted override (`task.train.learning_rate`) or raises UserError."""
  parts = key.split('.')
  if parts[0] not in root:
    hint = maxtext_hint(key, str(raw)) or did_you_mean(parts[0], root)
    raise UserError(f'Unknown override {shorten(repr(key))}: paths start with {" or ".join(sorted(root))}, '
                    f'and knobs are UPPERCASE.{hint}')
  node, path = root[parts[0]], parts[0]
  if isinstance(node, dict):  # datasets.<name>
    if len(parts) < 2 or parts[1] not in node:
      name = parts[1] if len(parts) > 1 else ''
      raise UserError(f'Unknown dataset {shorten(repr(name))} in override {shorten(repr(key))}; datasets are '
                      f'{", ".join(sorted(node))}.{did_you_mean(name, node)}')
    node, path, parts = node[parts[1]], f'{path}.{parts[1]}', parts[1:]
  for i, part in enumerate(parts[1:], start=1):
    if not isinstance(node, fdl.Buildable):
      raise UserError(f'Unknown override {shorten(repr(key))}: {path} is a value ({shorten(repr(node))}), not a config.')
    params = _params(node)
    if part not in params:
      raise UserError(f'Unknown config field {path}.{part} in override {shorten(repr(key))} '
                      f'({fdl.get_callable(node).__name__} has no field {part!r}).'
                      f'{did_you_mean(part, params)}')
    if i == len(parts) - 1:
      value = ptypes.parse_value(raw) if isinstance(raw, str) else raw
      tp = _field_types(node).get(part, Any)
      current = _value(node, part)
      if isinstance(current, fdl.Buildable):
        raise UserError(f'{path}.{part} is a nested config; set its fields, e.g. {path}.{part}.<field>=...')
      setattr(node, part, ptypes.coerce(value, tp, f'{path}.{part}'))
      return
    child = _value(node, part)
    if not isinstance(child, fdl.Buildable) and dataclasses.is_dataclass(child):
      child = fdl.Config(type(child), **{f.name: getattr(child, f.name) for f in dataclasses.fields(child)})
      setattr(node, part, child)
    node, path = child, f'{path}.{part}'
  raise UserError(f'Override {shorten(repr(key))} names a config, not a field.')


def _by_name(exp: Experiment, datasets: list) -> dict[str, fdl.Config]:
  by_name = {}
  for cfg in datasets:
    if not isinstance(cfg, fdl.Buildable):
      kind = type(cfg).__name__
      raise UserError(f'{type(exp).__name__}.datasets() returned a {kind} object; return fiddle configs of '
                      f'inputs instead, e.g. fdl.Config({kind}, name="train", is_training=True, ...): paxcli '
                      'builds them per process with its batch size and host index (see "Inputs in an '
                      'experiment" in the README).')
    ds_name = getattr(cfg, 'name', None) or ('train' if cfg.is_training else 'eval')
    if ds_name in by_name:
      raise UserError(f'{type(exp).__name__}.datasets() has two inputs named {ds_name!r}.')
    by_name[ds_name] = cfg
  return by_name


def _build(exp: Experiment, task_fn=None, datasets_fn=None) -> tuple[fdl.Config, dict[str, fdl.Config]]:
  """(task, datasets by name) from the experiment, or from the given unbound methods."""
  try:
    task = task_fn(exp) if task_fn else exp.task()
    datasets = datasets_fn(exp) if datasets_fn else exp.datasets()
  except (TypeError, AttributeError, ValueError) as e:
    raise UserError(f'{type(exp).__name__}: building its configs failed: {e}') from e
  return task, _by_name(exp, datasets)


def _flat_configs(exp: Experiment, task_fn=None, datasets_fn=None) -> Optional[dict[str, str]]:
  try:
    task, datasets = _build(exp, task_fn, datasets_fn)
  except NotImplementedError:  # an abstract base (Experiment itself) builds nothing
    return None
  out = flatten(task, 'task')
  for name, cfg in datasets.items():
    out.update(flatten(cfg, f'datasets.{name}'))
  return {k: repr(v) for k, v in out.items()}


def unreached_knobs(exp: Experiment, cli_knobs: dict[str, Any], dotted: set[str]) -> list[str]:
  """Warnings for knobs given on the command line that do not reach the fields they feed.

  A knob feeds the fields that change with it in the `task()`/`datasets()` of the class
  that declares it (e.g. NUM_TRAIN_STEPS -> task.train.num_train_steps in LmExperiment).
  When the experiment's own methods leave such a field unchanged (a subclass's `task()`
  sets `task.train.num_train_steps = 300`), the knob is silently ignored: say so. Knobs
  of the base class (mesh, batch size, seed) are read by the engine directly and feed no
  field here. Each comparison resolves the experiment twice, with the knob at its class
  default and at the given value, everything else equal. A knob declared where `datasets()` (or
  `task()`) is still abstract (TrainingExperiment's) is read through the nearest class below it
  that defines the method (LmExperiment's).
  """
  cls = type(exp)
  warnings = []
  for name, value in cli_knobs.items():
    default = getattr(cls, name, None)
    if repr(value) == repr(default):
      continue
    owner = next((k for k in reversed(cls.__mro__) if name in k.__dict__.get('__annotations__', {})), cls)
    at_default = copy.copy(exp)
    setattr(at_default, name, default)
    task_fn, datasets_fn = _reference(cls, owner, 'task'), _reference(cls, owner, 'datasets')
    try:
      ref_default = _flat_configs(at_default, task_fn, datasets_fn)
      if ref_default is None:
        continue
      ref_value = _flat_configs(exp, task_fn, datasets_fn) or {}
      fed = [k for k in ref_value if k in ref_default and ref_value[k] != ref_default[k]]
      if not fed:
        continue
      act_default, act_value = _flat_configs(at_default), _flat_configs(exp)
    except Exception:  # noqa: BLE001 - e.g. the default no longer fits the other knobs: no verdict
      continue
    for field in fed:
      if field in dotted or field not in act_value or act_value[field] != act_default.get(field):
        continue  # reached, absent in this experiment's inputs, or set by a dotted override
      if act_value[field] == ref_value[field]:
        continue  # the experiment gives the field the knob's value anyway
      method = 'task' if field.startswith('task.') else 'datasets'
      where = next((k for k in cls.__mro__ if method in k.__dict__), cls).__name__
      warnings.append(f'--set {name}={value!r} does not reach {field}: {where}.{method}() sets it to '
                      f'{act_value[field]} (the knob would make it {ref_value[field]}). Set {name} as a class '
                      f'attribute instead of in {method}(), or override the field: --set {field}=...')
  return warnings


def _reference(cls: type, owner: type, method: str):
  """The `method` a knob of `owner` is judged by: the owner's own, unless it is Experiment's
  abstract one; then the definition nearest below the owner in cls's hierarchy."""
  own = getattr(owner, method)
  if own is not getattr(Experiment, method):
    return own
  return next((k.__dict__[method] for k in reversed(cls.__mro__) if issubclass(k, owner) and method in k.__dict__),
              own)


def resolve(name: Optional[str], overrides: list[str] = ()) -> Resolved:
  """Experiment lookup, knob overrides, configs built, dotted overrides applied."""
  exp, rest = instantiate(name, overrides)
  task, by_name = _build(exp)
  cli_knobs = {k: getattr(exp, k) for k in exp.knob_types() if k in vars(exp)}
  warnings = unreached_knobs(exp, cli_knobs, {key for key, _ in rest}) if cli_knobs else []
  root = {'task': task, 'datasets': by_name}
  for key, raw in rest:
    set_path(root, key, raw)
  return Resolved(name or type(exp).registered_name(), exp, task, by_name, warnings)


def config_differences(saved: dict, current: dict,
                       prefixes=('knobs.', 'task.model.', 'task.train.optimizer.')) -> list[str]:
  keys = sorted(k for k in set(saved) | set(current) if k.startswith(prefixes))
  return [f'{k}: checkpoint {saved.get(k, "<absent>")} -> now {current.get(k, "<absent>")}'
          for k in keys if saved.get(k) != current.get(k)]
