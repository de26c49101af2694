"""Names that moved keep working for at least one release, with a warning naming the new one.

Three tables, one line per rename (docs/reference/compatibility.md):
  MOVED_MODULES    old module -> new module: `import paxcli.lm` gives paxcli.families.lm itself,
                   and recipes paxcli wrote with the old import still read as data (gencode)
  RENAMED_KNOBS    old knob -> new knob: `--set OLD=1` and a class attribute `OLD = 1` set NEW
  RENAMED_OPTIONS  old command-line option -> new one, for every command

A rename stays in its table for at least one release after the one that made it (the CHANGELOG
says when each goes). Old names warn with PaxcliDeprecationWarning, a FutureWarning, which Python
shows by default: users, not only developers, need to see it.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import warnings

MOVED_MODULES: dict[str, str] = {
    'paxcli.lm': 'paxcli.families.lm',  # 0.1.0: the layers rework; generated recipes imported it
    # 0.2.0: the models/ package (experiment bases and knob tables beside the models they build)
    'paxcli.families.lm': 'paxcli.models.lm_experiment',
    'paxcli.families.base': 'paxcli.models.training',
    'paxcli.families.classifier': 'paxcli.models.classifier_experiment',
    'paxcli.families.knobs': 'paxcli.models.knobs',
}
RENAMED_KNOBS: dict[str, str] = {}
RENAMED_OPTIONS: dict[str, str] = {}


class PaxcliDeprecationWarning(FutureWarning):
  """An old name of a module, knob or option was used; it still works, for now."""


def deprecated(old: str, new: str, kind: str) -> None:
  warnings.warn(f'{kind} {old} is now {new}; the old name still works but will be removed in a later '
                f'release (paxcli docs: Reference > Compatibility).', PaxcliDeprecationWarning, stacklevel=3)


def new_module(name: str) -> str:
  """The module an old name stands for today (following renames of renames), or `name` itself."""
  seen = set()
  while name in MOVED_MODULES and name not in seen:
    seen.add(name)
    name = MOVED_MODULES[name]
  return name


def new_knob(name: str) -> str:
  """The knob an old name stands for (with a warning), or `name` itself."""
  if name in RENAMED_KNOBS:
    deprecated(name, RENAMED_KNOBS[name], 'The knob')
    return RENAMED_KNOBS[name]
  return name


def new_option(arg: str) -> str:
  """A command-line word with an old option name replaced (`--old`, `--old=value`), with a warning."""
  name, eq, value = arg.partition('=')
  if name in RENAMED_OPTIONS:
    deprecated(name, RENAMED_OPTIONS[name], 'The option')
    return RENAMED_OPTIONS[name] + eq + value
  return arg


class _Alias:
  """Finds an old module name and hands back the new module object (one module, two names): a
  meta path finder and its loader (the protocols, without importlib.abc: `pax --help` stays quick)."""

  def __init__(self):
    self._specs = {}  # target module name -> its own spec

  def find_spec(self, fullname, path=None, target=None):
    if fullname not in MOVED_MODULES:
      return None
    return importlib.machinery.ModuleSpec(fullname, self)

  def create_module(self, spec):
    target = new_module(spec.name)
    deprecated(spec.name, target, 'The module')
    module = importlib.import_module(target)
    self._specs[target] = module.__spec__
    return module

  def exec_module(self, module):
    # The target ran when it was imported; the import system has just set its __spec__ to the old
    # name's, so give it back its own (reload, pickling and inspect read it).
    module.__spec__ = self._specs[module.__name__]


def install() -> None:
  """Puts the alias finder on sys.meta_path once (paxcli/__init__.py calls it)."""
  if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.append(_Alias())
