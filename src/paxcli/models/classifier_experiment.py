"""ClassifierExperiment: the base for sequence classifiers (paxcli.models.classifier.ClassificationModel).

Its model knobs are a table like the LM's (paxcli.models.knobs), holding only what the
classifier uses; the optimizer and loop knobs come from TrainingExperiment. A subclass
sets knobs and supplies `datasets()` (batches of ids, mask, labels and weights).
"""

from __future__ import annotations

import fiddle as fdl

from paxcli.models.knobs import MAX_COUNT, Knob, declare, fill, flat_settings
from paxcli.models.training import TrainingExperiment
from paxcli.options import ActivationName, NormName

_ATTENTION = 'block_tpl.attention_tpl.'

CLASSIFIER_KNOBS: tuple[Knob, ...] = (
    Knob('VOCAB_SIZE', int, 256, 'vocab_size', 'rows of the token embedding'),
    Knob('NUM_CLASSES', int, 8, 'num_classes', 'classes the softmax chooses among'),
    Knob('MODEL_DIMS', int, 64, 'model_dims', 'the width of the residual stream'),
    Knob('NUM_LAYERS', int, 2, 'num_layers', 'Transformer blocks', maximum=MAX_COUNT),
    Knob('MAX_SEQ_LEN', int, 64, 'max_seq_len', 'tokens per example'),
    Knob('NUM_HEADS', int, 4, (_ATTENTION + 'num_heads', _ATTENTION + 'num_kv_heads'),
         'attention heads per block (MODEL_DIMS // NUM_HEADS dimensions each)', derived=((_ATTENTION + 'dims_per_head', lambda s: s['model_dims'] // s['num_heads']),)),
    Knob('HIDDEN_DIMS', int, 256, 'block_tpl.ffn_tpl.hidden_dims', 'the MLP hidden units'),
    Knob('ACTIVATION', ActivationName, 'gelu', 'block_tpl.ffn_tpl.activation', "the MLP's nonlinearity"),
    Knob('NORM_TYPE', NormName, 'layernorm', ('block_tpl.norm_tpl.kind', 'norm_tpl.kind'), 'every norm',
         flat='norm_type'),
)


@declare(CLASSIFIER_KNOBS)
class ClassifierExperiment(TrainingExperiment):
  """A Transformer sequence classifier: blocks, a masked mean over the sequence, a softmax over classes."""

  def model(self) -> fdl.Config:
    # flax: recipes import this module, and `pax experiments` stays quick without it.
    from paxcli.layers.transformer import Attention, Block, Mlp, Norm
    from paxcli.models.classifier import ClassificationModel
    block = fdl.Config(Block, attention_tpl=fdl.Config(Attention), ffn_tpl=fdl.Config(Mlp), norm_tpl=fdl.Config(Norm))
    config = fdl.Config(ClassificationModel, block_tpl=block, norm_tpl=fdl.Config(Norm))
    return fill(config, CLASSIFIER_KNOBS, flat_settings(self.knobs(), CLASSIFIER_KNOBS))
