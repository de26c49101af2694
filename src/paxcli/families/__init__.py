"""Deprecated: what was here lives in paxcli.models (the experiment bases, the knob tables).

  paxcli.families.lm          -> paxcli.models.lm_experiment   (from paxcli.models import LmExperiment)
  paxcli.families.base        -> paxcli.models.training        (TrainingExperiment)
  paxcli.families.classifier  -> paxcli.models.classifier_experiment
  paxcli.families.knobs       -> paxcli.models.knobs

Each old name is the new module itself (one module, two names: the same classes, the same
registry), so recipes and the recipes earlier conversions wrote keep working; importing one warns
(DeprecationWarning) with the new name.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

MOVED = {
    'paxcli.families.lm': 'paxcli.models.lm_experiment',
    'paxcli.families.base': 'paxcli.models.training',
    'paxcli.families.classifier': 'paxcli.models.classifier_experiment',
    'paxcli.families.knobs': 'paxcli.models.knobs',
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Finds an old module name and hands back the new module object."""

  def __init__(self):
    self._own = {}   # new module name -> its own (spec, loader)

  def find_spec(self, fullname, path=None, target=None):
    return importlib.machinery.ModuleSpec(fullname, self) if fullname in MOVED else None

  def create_module(self, spec):
    warnings.warn(f'{spec.name} moved to {MOVED[spec.name]}; import it from there (or `from paxcli.models import '
                  '...`).', DeprecationWarning, stacklevel=2)
    module = importlib.import_module(MOVED[spec.name])
    self._own[module.__name__] = (module.__spec__, module.__loader__)
    return module

  def exec_module(self, module):
    # The new module ran when it was imported; the import system has just given it the old name's
    # spec and loader: give it back its own (importlib.reload, pickling by module name).
    module.__spec__, module.__loader__ = self._own[module.__name__]


if not any(isinstance(f, _Alias) for f in sys.meta_path):
  sys.meta_path.insert(0, _Alias())
