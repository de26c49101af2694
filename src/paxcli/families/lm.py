"""LmExperiment: the base for decoder-only Transformer language-model experiments."""

from __future__ import annotations

import fiddle as fdl

from paxcli.families.base import TrainingExperiment
from paxcli.families.knobs import LM_KNOBS, declare, flat_settings
from paxcli.inputs.synthetic import SyntheticLmInput


@declare(LM_KNOBS)
class LmExperiment(TrainingExperiment):
  """A decoder-only Transformer LM; knobs as in Pax's LmCloud and MaxText models.

  The model knobs (NUM_LAYERS, MODEL_DIMS, NORM_TYPE, ...) are declared by the table
  paxcli.families.knobs.LM_KNOBS; the optimizer and loop knobs by TrainingExperiment.
  Subclasses set knobs and, where they need more, override `task()` (call super and
  edit the config, e.g. `task.train.num_train_steps = 300`) or `datasets()`.
  """

  DECODE_INTERVAL_STEPS: int = 0  # 0: no decoding during training; else greedy on DECODE_PROMPTS
  DECODE_PROMPTS: list = []       # texts, or lists of token ids for models without a tokenizer
  DECODE_MAX_STEPS: int = 32

  def model(self) -> fdl.Config:
    """LanguageModel built from templates the knobs fill; edit a template to swap a layer:

      task.model.lm_tpl.block_tpl.ffn_tpl = fdl.Config(MyFeedForward, ...)
      task.model.lm_tpl.block_tpl.attention_tpl.use_bias = False
      task.model.lm_tpl.block_tpl.norm_tpl = fdl.Config(MyNorm)
    """
    from paxcli.models import lm_config  # flax: recipes import this module, `pax experiments` stays quick
    return lm_config(**flat_settings(self.knobs(), LM_KNOBS))

  def train_config(self) -> fdl.Config:
    train = super().train_config()
    train.decode_interval_steps = self.DECODE_INTERVAL_STEPS
    train.decode_prompts = list(self.DECODE_PROMPTS)
    train.decode_max_steps = self.DECODE_MAX_STEPS
    return train

  def datasets(self) -> list:
    """Synthetic LM data; override for real inputs (see recipes/default.py)."""
    return [
        fdl.Config(SyntheticLmInput, name='train', is_training=True, seq_len=self.MAX_SEQ_LEN,
                   vocab_size=self.VOCAB_SIZE, seed=self.RANDOM_SEED),
        fdl.Config(SyntheticLmInput, name='eval', is_training=False, seq_len=self.MAX_SEQ_LEN,
                   vocab_size=self.VOCAB_SIZE, seed=self.RANDOM_SEED + 1, num_batches=2, repeat=False,
                   reset_for_eval=True),
    ]
