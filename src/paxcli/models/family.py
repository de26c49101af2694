"""Family: one object per model architecture, owning everything that makes a model one of it.

What a family owns, each read by one consumer:
  knobs                 the knob values every member shares (Llama: gated SiLU, RMSNorm, rotary, no
                        biases); recipes take them with `@FAMILY.preset`, imports write them
  hf_model_types        config.json model_type values it reads (`pax checkpoint convert --from hf`)
  from_hf_config        config.json -> (knobs, notes), refusing by name what the family cannot express
  to_hf_config          a model's settings -> config.json (`--to hf`)
  hf_weights            the weight map both ways (paxcli.models.weight_map): one Weight row per array or
                        piece of a fused or stacked one
  misfit                why a model is not one of the family (empty: it is): the check of a model that
                        records the family (MODEL_FAMILY), and how one that records none is placed
  maxtext_blocks        MaxText decoder_block names it computes, with the knobs each sets
                        (`pax import-maxtext`) and MaxText's weight names below a layer (`--from maxtext`)

A family is a subclass with its data as class attributes and its own methods where it differs;
one instance is listed in paxcli.models.registry.FAMILIES. A model names its family (the MODEL_FAMILY
knob): the presets set it, and so do the recipes `--from hf`, `pax import-maxtext` and `--from paxml`
write; `--to hf`, `--to peft`, `pax describe` and the certifications read it. Nothing here imports jax or flax: recipes
and `pax experiments` read families. A model is given to a family as its flat view
(paxcli.models.lm.flat_view, or the namespace of paxcli.models.knobs.effective): knob settings under
their flat names (num_heads, norm_type, layer_pattern, ...).

Layer kinds (paxcli.models.pattern) are where families differ layer by layer: a family whose
layers alternate (local and global attention, dense and MoE feed-forward) presets LAYER_PATTERN and
LAYER_KINDS like any other knob, and its weight map names each layer's kind by its index.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

from paxcli.errors import UserError
from paxcli.models.weight_map import Piece, Weight, fuse  # noqa: F401  (a family's map is written with these)


@dataclasses.dataclass(frozen=True)
class MaxTextBlock:
  """A MaxText decoder_block a family computes: the knobs it sets, and why paxcli's layer would be
  another model (None: it is the same)."""
  knobs: Mapping[str, Any]
  unsupported: Optional[str] = None
  # The knobs the block takes from the run's MaxText config (soft caps, windows, rope per kind):
  # from_config(get, knobs so far) -> [(knob, value, 'the MaxText keys it comes from'), ...]; those keys
  # are then read, not unsupported.
  from_config: Optional[Callable[[Callable, Mapping[str, Any]], list]] = None


class Family:
  """An architecture (see the module docstring); subclasses fill in the data and methods."""
  name: str = ''
  title: str = ''                       # for messages: 'Llama'
  description: str = ''
  knobs: Mapping[str, Any] = {}
  hf_model_types: tuple[str, ...] = ()
  hf_architectures: tuple[str, ...] = ()
  maxtext_blocks: Mapping[str, MaxTextBlock] = {}
  maxtext_layer_params: Mapping[str, tuple[str, int]] = {}

  def __init__(self):
    # The presets name the family too: a recipe that takes them, and every import, records what it is.
    self.knobs = {**{k: v for k, v in type(self).knobs.items() if k != 'MODEL_FAMILY'}, 'MODEL_FAMILY': self.name}

  def preset(self, cls: type) -> type:
    """Class decorator: the family's knobs on an experiment class, under what the class sets itself."""
    for name, value in self.knobs.items():
      if name not in cls.__dict__:
        setattr(cls, name, value)
    return cls

  def misfit(self, model) -> list[str]:
    """Why `model` (a flat view) does not compute this family's function, each in the user's terms (the knob
    to set); [] when it does. What the model records (MODEL_FAMILY) is not read here."""
    raise NotImplementedError(f'{type(self).__name__} must define misfit().')

  # ---- Hugging Face (families without an HF layout leave hf_model_types empty) ----

  def from_hf_config(self, config: dict, where: str) -> tuple[dict, list[str]]:
    raise UserError(f'{where}: paxcli reads no Hugging Face {self.title} checkpoints.')

  def to_hf_config(self, model, dtype: str, token_ids: dict) -> dict:
    raise UserError(f'paxcli writes no Hugging Face {self.title} checkpoints.')

  def hf_weights(self, model) -> list[Weight]:
    return []

  def hf_checkpoint_names(self, config: dict, names: list[str], where: str) -> tuple[dict[str, str], list[str]]:
    """The arrays of a Hugging Face directory (`names`, as its safetensors hold them) that the family reads,
    each under the name hf_weights gives it (file name -> that name), and notes on the arrays it leaves out.
    A family whose checkpoints nest the model under a prefix (Gemma 3's multimodal one) overrides this."""
    return {n: n for n in names}, []

  def hf_read_weights(self, model, names) -> list[Weight]:
    """The weight map that reads a directory holding the HF arrays `names`: hf_weights, unless the family
    reads another spelling some transformers release writes (fused expert tensors, say)."""
    return self.hf_weights(model)

  def __repr__(self) -> str:
    return f'<family {self.name}>'
