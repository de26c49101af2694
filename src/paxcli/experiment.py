"""Experiments: Pax-style classes with UPPERCASE knobs, a registry and lookup.

An experiment declares knobs as annotated UPPERCASE class attributes and builds two
fiddle configs from them: `task()` (model and training settings) and `datasets()`
(input configs). Unlike Pax, an UPPERCASE attribute that no class in the hierarchy
declares is an error, so `PER_CORE_BATCH_SIZE = 8` cannot pass silently.

This module imports no jax, flax or tensorflow: `pax experiments` stays quick.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
import sys
import traceback
import typing
from typing import Any, Optional

from paxcli import compat
from paxcli import values as ptypes
from paxcli.errors import UserError, did_you_mean, shorten
from paxcli.options import ContextStrategyName

_KNOB_RE = re.compile(r'^[A-Z][A-Z0-9_]*$')
_REGISTRY: dict[str, type['Experiment']] = {}
RECIPES_PACKAGE = 'paxcli.recipes'
DEFAULT_EXPERIMENT = 'default.StdlibDocsLm'
MODEL_FIELDS = 'task.model.'   # dotted overrides of the model's own config: what it computes (Experiment.replayable)


class Experiment:
  """Base of all experiments. Subclasses set knobs and override `task()`/`datasets()`."""

  # Mesh: axes ('replica', 'data', 'mdl'). None means every device on `data`.
  ICI_MESH_SHAPE: Optional[list[int]] = None
  DCN_MESH_SHAPE: Optional[list[int]] = None  # the mesh across slices or hosts (times ICI_MESH_SHAPE); None: one
  # Context parallelism: a six-entry mesh [stage, replica, data, expert, context, mdl] with context > 1 splits
  # each sequence over that axis (paxcli.layers.context_parallel, docs/guides/long-context.md).
  CONTEXT_PARALLEL_STRATEGY: ContextStrategyName = 'all_gather'  # attention: keys, values gathered, or a 'ring'
  CONTEXT_LOAD_BALANCE: bool = True  # each device holds an early and a late chunk of a sequence: causal work evened out
  # Examples per device per step; below 1 means fewer infeed hosts than processes.
  PERCORE_BATCH_SIZE: float = 4
  RANDOM_SEED: int = 1234  # seeds initialisation, dropout and the data order: the same seed, the same run
  # Environment variables set before jax starts, per platform ('cpu', 'gpu', 'tpu'),
  # e.g. {'tpu': {'LIBTPU_INIT_ARGS': '...'}, 'gpu': {'XLA_FLAGS': '...'}}.
  PLATFORM_ENV: dict[str, dict[str, str]] = {}
  # Features the source of this experiment needs that paxcli cannot honour (name ->
  # why), e.g. from a MaxText import. `pax train` refuses to run while any is listed,
  # rather than silently training a different model; `--set UNSUPPORTED_FEATURES={}`
  # accepts the difference.
  UNSUPPORTED_FEATURES: dict[str, str] = {}

  # The knobs of this class that a job's record (experiment.jsonl) may set when a command reads the job
  # (`replayable`): what the model computes, how it trains, the data it reads. Every other knob is taken
  # only from the command line: those that act on the process or the machine (PLATFORM_ENV: environment
  # variables, XLA flags, dump and cache paths, endpoints), tracker destinations, paths written outside the
  # job, and any knob nobody classified (deny by default). A class that declares knobs lists its model and
  # data ones here (a knob table's are listed by paxcli.models.knobs.declare).
  replayed = frozenset({'ICI_MESH_SHAPE', 'DCN_MESH_SHAPE', 'CONTEXT_PARALLEL_STRATEGY', 'CONTEXT_LOAD_BALANCE',
                        'PERCORE_BATCH_SIZE', 'RANDOM_SEED', 'UNSUPPORTED_FEATURES'})

  def task(self):
    """Returns a fiddle config of `paxcli.tasks.Task`."""
    raise NotImplementedError(f'{type(self).__name__} must define task().')

  def datasets(self) -> list:
    """Returns fiddle configs of inputs; exactly one has is_training=True."""
    raise NotImplementedError(f'{type(self).__name__} must define datasets().')

  # ---- knob machinery -------------------------------------------------------------

  @classmethod
  def knob_types(cls) -> dict[str, Any]:
    """Declared knobs (annotated UPPERCASE names over the whole hierarchy) and types."""
    try:
      hints = typing.get_type_hints(cls)
    except Exception:  # an unresolvable annotation in a user's class: check that knob loosely
      hints = {}
    types: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
      for name in klass.__dict__.get('__annotations__', {}):
        if _KNOB_RE.match(name):
          types[name] = hints.get(name, Any)
    return types

  @classmethod
  def check_knobs(cls) -> None:
    """Raises UserError for an UPPERCASE assignment that no class declares (a renamed knob's old
    name sets the new one, with a warning)."""
    declared = cls.knob_types()
    for klass in cls.__mro__:
      if klass is object:
        continue
      for name, value in list(klass.__dict__.items()):
        if not _KNOB_RE.match(name) or name in declared or callable(value):
          continue
        if name in compat.RENAMED_KNOBS and compat.RENAMED_KNOBS[name] in declared:
          _rename_class_knob(klass, name, compat.new_knob(name))
          continue
        raise UserError(
            f'{klass.__name__}.{name} is not a declared knob.{did_you_mean(name, declared)} '
            f'(Declare a new knob with a type annotation, e.g. `{name}: int = ...`.)')
    for name, tp in declared.items():  # values set in classes must fit the declared types
      if hasattr(cls, name):
        owner = next((k for k in cls.__mro__ if name in k.__dict__), cls)
        ptypes.coerce(getattr(cls, name), tp, f'{owner.__name__}.{name}')

  def knobs(self) -> dict[str, Any]:
    """Current knob values (class defaults with instance overrides)."""
    return {name: getattr(self, name) for name in sorted(self.knob_types())}

  def set_knob(self, name: str, raw: Any) -> None:
    """Sets one knob from a raw value (a string from the command line, or a value)."""
    types = self.knob_types()
    name = compat.new_knob(name) if name not in types else name
    if name not in types:
      hint = maxtext_hint(name, str(raw)) if name.lower() in MAXTEXT_SPELLINGS else did_you_mean(name, types)
      raise UserError(f'Unknown knob {shorten(repr(name))} for experiment {type(self).__name__}.{hint}')
    value = ptypes.parse_value(raw) if isinstance(raw, str) else raw
    setattr(self, name, ptypes.coerce(value, types[name], name))

  @classmethod
  def replayable(cls, key: str) -> bool:
    """Whether a job's record may set the override `key` (a knob, or a dotted config path): a knob some class
    of the hierarchy lists in `replayed` (under its current name), or a field of the model (task.model...)."""
    if not _KNOB_RE.match(key):
      return key.startswith(MODEL_FIELDS) and '..' not in key
    name = compat.RENAMED_KNOBS.get(key, key)
    return any(name in klass.__dict__.get('replayed', ()) for klass in cls.__mro__)

  @classmethod
  def registered_name(cls) -> str:
    # From the class itself, never inherited: an unregistered subclass is not its parent.
    return cls.__dict__.get('_registered_name', f'{cls.__module__}.{cls.__qualname__}')


def _rename_class_knob(klass: type, old: str, new: str) -> None:
  """A class that sets a renamed knob by its old name: the value moves to the new name."""
  if new not in klass.__dict__:
    setattr(klass, new, klass.__dict__[old])
  delattr(klass, old)


def register(cls: type[Experiment]) -> type[Experiment]:
  """Class decorator: makes an experiment available by `<module>.<Class>` and `<Class>`."""
  module = cls.__module__
  if module.startswith(RECIPES_PACKAGE + '.'):
    module = module[len(RECIPES_PACKAGE) + 1:]
  name = f'{module}.{cls.__name__}'
  cls._registered_name = name
  _REGISTRY[name] = cls
  return cls


def import_all_recipes() -> dict[str, type[Experiment]]:
  """Imports every module of `paxcli.recipes` and returns the registry."""
  package = importlib.import_module(RECIPES_PACKAGE)
  for info in pkgutil.iter_modules(package.__path__):
    if not info.name.startswith('_'):
      importlib.import_module(f'{RECIPES_PACKAGE}.{info.name}')
  return dict(_REGISTRY)


# Recipe classes read as data, never run (the recipes `pax checkpoint convert` writes, read by
# paxcli.convert.core.recipe_class), by (absolute path, class name): `lookup` serves these.
_DATA_CLASSES: dict[tuple[str, str], type[Experiment]] = {}


def provide_file_class(path: str, class_name: str, cls: type[Experiment]) -> None:
  """Makes `path:class_name` resolve to `cls` in this process, without importing the file."""
  _DATA_CLASSES[(os.path.abspath(path), class_name)] = cls


def _load_file(path: str, class_name: str) -> type[Experiment]:
  known = _DATA_CLASSES.get((os.path.abspath(path), class_name))
  if known is not None:
    return known
  if not os.path.isfile(path):
    raise UserError(f'Experiment file {shorten(repr(path))} does not exist.{_kept_recipe_hint(path, class_name)}')
  module_name = '_paxcli_user_' + re.sub(r'\W', '_', os.path.abspath(path))
  if module_name not in sys.modules:
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
      raise UserError(f'Experiment file {path!r} is not a Python file: give a .py file, as in '
                      'path/file.py:Class.')
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in sys.path:
      sys.path.insert(0, directory)  # so the file can import its neighbours
    try:
      spec.loader.exec_module(module)
    except UserError:
      del sys.modules[module_name]
      raise
    except SyntaxError as e:
      del sys.modules[module_name]
      raise UserError(f'{path}, line {e.lineno}: syntax error: {e.msg}') from None
    except Exception as e:  # the user's code raised while being imported
      del sys.modules[module_name]
      raise UserError(import_failure(path, e)) from None
  module = sys.modules[module_name]
  cls = _class_from_module(module, class_name, path)
  if cls.__module__ == module_name:  # `runs/my_experiments.MyLm`, not the internal module name
    cls._registered_name = f'{os.path.splitext(os.path.basename(path))[0]}.{cls.__qualname__}'
  return cls


def _kept_recipe_hint(path: str, class_name: str) -> str:
  """For a recipe an import wrote beside its output before 0.3 (out/hf_base.py for out/base): where the
  output keeps it now (out/base/recipe.py), when that is there."""
  match = re.fullmatch(r'(?:hf|paxml)_(.+)\.py', os.path.basename(path))
  if not match:
    return ''
  directory = os.path.dirname(path)
  for name in dict.fromkeys((match.group(1), match.group(1).replace('_', '-'))):
    kept = os.path.join(directory, name, 'recipe.py')
    if os.path.isfile(kept):
      return f' An import keeps its recipe in the job it writes now: --exp {shorten(kept)}:{class_name}.'
  return ''


def _class_from_module(module, class_name: str, where: str) -> type[Experiment]:
  cls = getattr(module, class_name, None)
  if cls is None:
    names = [n for n, v in vars(module).items() if inspect.isclass(v) and issubclass(v, Experiment)]
    raise UserError(f'Unknown experiment: no class {shorten(repr(class_name))} in {shorten(where)}.{did_you_mean(class_name, names)}')
  if not (inspect.isclass(cls) and issubclass(cls, Experiment)):
    raise UserError(f'{where}:{class_name} is not a subclass of paxcli.experiment.Experiment.')
  return cls


def _try_import(module_name: str):
  try:
    return importlib.import_module(module_name)
  except SyntaxError as e:
    raise UserError(f'{e.filename}, line {e.lineno}: syntax error: {e.msg}') from None
  except ModuleNotFoundError as e:
    if e.name and (module_name == e.name or module_name.startswith(e.name + '.')):
      return None
    raise UserError(import_failure(module_name, e)) from None
  except UserError:
    raise
  except Exception as e:  # the user's module raised while being imported
    raise UserError(import_failure(module_name, e)) from None


def import_failure(what: str, e: BaseException) -> str:
  """'Importing X failed: Type: message (raised at file, line N)', naming the user's frame.

  The frame is the innermost one outside Python's import machinery, paxcli and installed
  packages: the user's line that raised (or the last frame at all, if none qualifies).
  """
  frames = traceback.extract_tb(e.__traceback__)
  skip = ('<frozen ', os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.__file__))
  own = [f for f in frames if not f.filename.startswith(skip) and 'site-packages' not in f.filename]
  where = (own or frames)[-1:]
  at = f' (raised at {where[0].filename}, line {where[0].lineno})' if where else ''
  return f'Importing {what} failed: {type(e).__name__}: {shorten(str(e))}{at}'


def lookup(name: Optional[str]) -> type[Experiment]:
  """Finds an experiment class by registered name, `module.Class` or `file.py:Class`."""
  name = name or DEFAULT_EXPERIMENT
  if ':' in name:
    path, class_name = name.rsplit(':', 1)
    cls = _load_file(path, class_name)
  else:
    registry = import_all_recipes()
    if name in registry:
      cls = registry[name]
    else:
      by_class = {}
      for key, value in registry.items():
        by_class.setdefault(key.rsplit('.', 1)[1], []).append(value)
      if '.' not in name and len(by_class.get(name, [])) == 1:
        cls = by_class[name][0]
      elif '.' in name:
        module_name, class_name = name.rsplit('.', 1)
        if os.getcwd() not in sys.path:
          sys.path.insert(0, os.getcwd())
        module = _try_import(f'{RECIPES_PACKAGE}.{module_name}') or _try_import(module_name)
        if module is None:
          raise UserError(f'Unknown experiment {shorten(repr(name))}: no module {shorten(repr(module_name))}.'
                          f'{did_you_mean(name, registry)} (`pax experiments` lists them.)')
        cls = _class_from_module(module, class_name, module_name)
      else:
        raise UserError(f'Unknown experiment {shorten(repr(name))}.'
                        f'{did_you_mean(name, list(registry) + list(by_class))} '
                        '(`pax experiments` lists them.)')
  cls.check_knobs()
  return cls


# MaxText's spellings of settings a MaxText user types by habit (`--set steps=10`), and paxcli's knob
# for each: named in the error, as a did-you-mean that spelling alone would not find.
MAXTEXT_SPELLINGS = {
    'steps': 'NUM_TRAIN_STEPS', 'per_device_batch_size': 'PERCORE_BATCH_SIZE', 'learning_rate': 'LEARNING_RATE',
    'base_emb_dim': 'MODEL_DIMS', 'emb_dim': 'MODEL_DIMS', 'base_mlp_dim': 'HIDDEN_DIMS', 'mlp_dim': 'HIDDEN_DIMS',
    'base_num_decoder_layers': 'NUM_LAYERS', 'num_decoder_layers': 'NUM_LAYERS', 'base_num_query_heads': 'NUM_HEADS',
    'num_query_heads': 'NUM_HEADS', 'base_num_kv_heads': 'NUM_KV_HEADS', 'num_kv_heads': 'NUM_KV_HEADS',
    'head_dim': 'DIMS_PER_HEAD', 'max_target_length': 'MAX_SEQ_LEN', 'vocab_size': 'VOCAB_SIZE',
    'checkpoint_period': 'SAVE_INTERVAL_STEPS', 'eval_interval': 'EVAL_INTERVAL_STEPS',
    'log_period': 'SUMMARY_INTERVAL_STEPS', 'dataset_path': 'TRAIN_DATA', 'tokenizer_path': 'TOKENIZER',
    'dtype': 'FPROP_DTYPE', 'remat_policy': 'CHECKPOINT_POLICY', 'scan_layers': 'USE_REPEATED_LAYER',
    'adam_b1': 'ADAM_BETA1', 'adam_b2': 'ADAM_BETA2', 'adam_eps': 'ADAM_EPSILON', 'adam_weight_decay': 'WEIGHT_DECAY',
    'gradient_clipping_threshold': 'CLIP_GRADIENT_NORM_TO_VALUE', 'load_parameters_path': 'INIT_FROM',
    'warmup_steps': 'LR_WARMUP_STEPS', 'opt_type': 'OPTIMIZER', 'lora_rank': 'LORA_RANK',
}


def maxtext_hint(key: str, value: str = '...') -> str:
  """' MaxText's steps is NUM_TRAIN_STEPS in paxcli: --set NUM_TRAIN_STEPS=10.' for a MaxText spelling, else ''."""
  knob = MAXTEXT_SPELLINGS.get(key.strip().lower())
  return f" MaxText's {key.strip()} is {knob} in paxcli: --set {knob}={shorten(value, 80)}." if knob else ''


def canonical_name(name: Optional[str]) -> str:
  """An experiment name the user gave (None: the default) as it means the same from any directory:
  `path/file.py:Class` with the path made absolute, a registered experiment by its registered name
  (`StdlibDocsLm` -> `default.StdlibDocsLm`), anything else as given. What a job directory records."""
  name = name or DEFAULT_EXPERIMENT
  if ':' in name:
    path, class_name = name.rsplit(':', 1)
    return f'{os.path.abspath(os.path.expanduser(path))}:{class_name}'
  registered = lookup(name).__dict__.get('_registered_name')
  return registered if registered in _REGISTRY else name


def instantiate(name: Optional[str], overrides: list[str] = ()) -> tuple[Experiment, list[tuple[str, Any]]]:
  """Looks up and instantiates an experiment, applying UPPERCASE knob overrides.

  Returns the experiment and the remaining dotted-path overrides (key, raw value),
  which apply to the configs built by `task()` and `datasets()`.
  """
  cls = lookup(name)
  exp = cls()
  rest = []
  for item in overrides:
    key, raw = split_override(item)
    if _KNOB_RE.match(key):
      exp.set_knob(key, raw)
    else:
      rest.append((key, raw))
  return exp, rest


def split_override(item: str) -> tuple[str, str]:
  if '=' not in item:
    raise UserError(f'Override {shorten(repr(item))} is not KEY=VALUE (e.g. --set NUM_LAYERS=2).')
  key, raw = item.split('=', 1)
  key = key.strip()
  if not key:
    raise UserError(f'Override {shorten(repr(item))} has an empty key.')
  return key, raw
