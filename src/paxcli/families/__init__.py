"""Deprecated: what was here lives in paxcli.models (the experiment bases, the knob tables).

  paxcli.families.lm          -> paxcli.models.lm_experiment   (from paxcli.models import LmExperiment)
  paxcli.families.base        -> paxcli.models.training        (TrainingExperiment)
  paxcli.families.classifier  -> paxcli.models.classifier_experiment
  paxcli.families.knobs       -> paxcli.models.knobs

Each old name is the new module itself (paxcli.compat.MOVED_MODULES), so recipes and the recipes
earlier conversions wrote keep working; importing one warns with the new name. This package stays
(empty) so that the old names have a parent that is not paxcli.models itself.
"""
