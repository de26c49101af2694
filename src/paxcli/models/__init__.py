"""What the engine trains: model interfaces, the LM, its losses, the classifier, the FLOPs model,
the knob tables, the experiment bases recipes derive from, and one family object per architecture.

  base.py                  BaseModel, DecodingModel: the only methods train, eval, init and decode call
  lm.py                    TransformerLm (the network; a patterned stack scans LayerGroups), LanguageModel,
                           lm_config, flat_view
  pattern.py               layer patterns: the kinds of a repeating group, each its own block template, and
                           where a layer's weights live in each layout
  losses.py                lm_loss, fused_lm_loss (a custom VJP)
  validation.py            checks of an LM config (one line each, before anything compiles)
  classifier.py            ClassificationModel
  preference.py            PreferenceLm: DPO, IPO, SimPO, ORPO on preference pairs
  flops.py                 ModelFlops, stack_flops: training FLOPs per token
  knobs.py                 the knob tables (LM_KNOBS): each knob once, with the config fields it sets
  training.py, lm_experiment.py, classifier_experiment.py
                           TrainingExperiment, LmExperiment, ClassifierExperiment (recipes' bases)
  family.py, registry.py   the Family object and the registry of families (by name, by HF model_type)
  hf_config.py             Hugging Face config.json reads and weight transforms every family shares
  llama.py                 the Llama family: presets, HF config and weights both ways, MaxText names

Recipes import `from paxcli.models import LmExperiment`. Names are loaded on first use (PEP 562):
the experiment bases and knob tables import no jax or flax, so `pax experiments` stays quick.
"""

from __future__ import annotations

import importlib
import warnings

# Public name -> the module (under paxcli.models) that defines it.
_PUBLIC = {
    'BaseModel': 'base', 'DecodingModel': 'base', 'dtype_name': 'base',
    'TransformerLm': 'lm', 'LanguageModel': 'lm', 'lm_config': 'lm', 'flat_view': 'lm',
    'pipeline_schedule': 'lm', 'REMAT_POLICIES': 'lm',
    'lm_loss': 'losses', 'fused_lm_loss': 'losses',
    'validate_lm': 'validation', 'validate_lora': 'validation',
    'ClassificationModel': 'classifier', 'PreferenceLm': 'preference',
    'ModelFlops': 'flops', 'stack_flops': 'flops',
    'TrainingExperiment': 'training', 'LmExperiment': 'lm_experiment',
    'ClassifierExperiment': 'classifier_experiment', 'CLASSIFIER_KNOBS': 'classifier_experiment',
    'LM_KNOBS': 'knobs', 'LM_KNOB': 'knobs',
    'Family': 'family', 'FAMILIES': 'registry', 'LLAMA': 'llama',
    'GrpoLm': 'grpo',
}
# Names paxcli/models.py used to import from paxcli.layers (and so served as paxcli.models.X):
# still served, with a DeprecationWarning naming their home.
_FROM_LAYERS = {
    'AUX_LOSS': 'base', 'NON_TRAINABLE': 'base', 'RANDOM': 'base', 'SUMMARIES': 'base', 'BaseLayer': 'base',
    'LayerTpl': 'base', 'WeightHParams': 'base', 'WeightInit': 'base', 'build_arguments': 'base',
    'instantiate': 'base', 'template_field': 'base',
    'Attention': 'transformer', 'Block': 'transformer', 'Mlp': 'transformer', 'Norm': 'transformer',
    'dtype_of': 'transformer', 'fill_template': 'transformer', 'sinusoidal': 'transformer',
    'soft_cap': 'transformer', 'lora': None, 'pipeline': None,
}


def __getattr__(name: str):
  if name in _PUBLIC:
    return getattr(importlib.import_module(f'{__name__}.{_PUBLIC[name]}'), name)
  if name in _FROM_LAYERS:
    module = _FROM_LAYERS[name]
    home = f'paxcli.layers.{module}' if module else f'paxcli.layers.{name}'
    warnings.warn(f'paxcli.models.{name} is {home}{"." + name if module else ""}; import it from there '
                  '(paxcli.models no longer re-exports layers).', DeprecationWarning, stacklevel=2)
    target = importlib.import_module(home)
    return getattr(target, name) if module else target
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__() -> list[str]:
  return sorted(list(globals()) + list(_PUBLIC))
