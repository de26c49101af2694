"""Deprecated: what was here lives in paxcli.models (the experiment bases, the knob tables).

  paxcli.families.lm          -> paxcli.models.lm_experiment   (from paxcli.models import LmExperiment)
  paxcli.families.base        -> paxcli.models.training        (TrainingExperiment)
  paxcli.families.classifier  -> paxcli.models.classifier_experiment
  paxcli.families.knobs       -> paxcli.models.knobs

Each old module is the new one under its old name (the same module object), so recipes and
recipes written by earlier conversions keep working; importing one warns (DeprecationWarning).
"""

import importlib
import sys
import warnings


def alias(old: str, new: str) -> None:
  """Makes module `old` the module `new` (sys.modules), with a DeprecationWarning."""
  warnings.warn(f'{old} moved to {new}; import it from there (or `from paxcli.models import ...`).',
                DeprecationWarning, stacklevel=3)
  sys.modules[old] = importlib.import_module(new)
