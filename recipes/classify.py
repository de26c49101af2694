"""Classification: which standard-library package a docstring comes from (no download).

`pax train --exp classify.StdlibDocsClassifier` trains a 2-layer Transformer classifier
(paxcli.models.classifier.ClassificationModel) on docstrings of 8 stdlib packages (asyncio, email,
importlib, logging, xml, multiprocessing, unittest, http) and evaluates accuracy on held-out
docstrings. Chance is 1/8 = 0.125 and always answering the largest package (asyncio) scores
about 0.18; after the 300 steps (a few minutes on 2 CPU cores, one device, global batch 4) one
run reached eval accuracy 0.62 on the 194 held-out docstrings (loss 2.3 -> 1.1).
tests/test_classify.py holds a shorter run to at least 0.30.

The model is a BaseModel of its own: train, eval and init call its methods, and nothing in
the engine changed for it. Its experiment base (paxcli.models.classifier_experiment) shares only the
optimizer and loop knobs with the LM (paxcli.models.training.TrainingExperiment).
"""

import fiddle as fdl

from paxcli.experiment import register
from paxcli.inputs.classify import PACKAGES, StdlibDocsClassInput
from paxcli.models import ClassifierExperiment


@register
class StdlibDocsClassifier(ClassifierExperiment):
  """A 2-layer, 64-wide classifier of stdlib docstrings by package; accuracy in eval."""

  NUM_LAYERS = 2
  MODEL_DIMS = 64
  HIDDEN_DIMS = 256
  NUM_HEADS = 4
  VOCAB_SIZE = 2048
  NUM_CLASSES = 8  # the first NUM_CLASSES packages of paxcli.inputs.classify.PACKAGES (all 8)
  MAX_SEQ_LEN = 64
  PERCORE_BATCH_SIZE = 4
  LEARNING_RATE = 3e-3
  LR_SCHEDULE = 'linear_rampup_cosine_decay'
  LR_WARMUP_STEPS = 20
  LR_DECAY_START = 20
  LR_DECAY_END = 300
  NUM_TRAIN_STEPS = 300
  SAVE_INTERVAL_STEPS = 100
  SUMMARY_INTERVAL_STEPS = 50
  EVAL_INTERVAL_STEPS = 300

  def datasets(self) -> list:
    common = dict(seq_len=self.MAX_SEQ_LEN, vocab_size=self.VOCAB_SIZE, seed=self.RANDOM_SEED,
                  packages=PACKAGES[:self.NUM_CLASSES])
    return [
        fdl.Config(StdlibDocsClassInput, name='train', split='train', is_training=True, **common),
        fdl.Config(StdlibDocsClassInput, name='eval', split='eval', is_training=False, repeat=False,
                   reset_for_eval=True, **common),
    ]
