"""Pax's LmCloud experiments on synthetic data.

`pax train --exp lm_cloud.LmCloudSpmdTest` trains a 2-layer, 64-wide model in seconds
on a CPU. LmCloudSpmd2B is the 2B-parameter configuration from Pax's README; it needs
4 accelerators (ICI_MESH_SHAPE [1, 4, 1]) and does not run on a CPU, but `pax describe`
and the tests build its config and parameter shapes anywhere.
"""

from paxcli.experiment import register
from paxcli.models import LmExperiment


@register
class LmCloudSpmdTest(LmExperiment):
  """A tiny SPMD LM for smoke tests: 2 layers, MODEL_DIMS 64, synthetic data."""

  NUM_LAYERS = 2
  MODEL_DIMS = 64
  HIDDEN_DIMS = 256
  NUM_HEADS = 8
  DIMS_PER_HEAD = 8
  VOCAB_SIZE = 256
  MAX_SEQ_LEN = 64
  PERCORE_BATCH_SIZE = 4
  LEARNING_RATE = 1e-3
  NUM_TRAIN_STEPS = 100
  SAVE_INTERVAL_STEPS = 50


@register
class LmCloudSpmd2B(LmExperiment):
  """Pax's 2B LM: 18 layers, MODEL_DIMS 3072, HIDDEN_DIMS 4x, on 4 devices."""

  NUM_LAYERS = 18
  MODEL_DIMS = 3072
  HIDDEN_DIMS = 3072 * 4
  NUM_HEADS = 24
  DIMS_PER_HEAD = 128
  VOCAB_SIZE = 32000
  MAX_SEQ_LEN = 1024
  PERCORE_BATCH_SIZE = 8
  ICI_MESH_SHAPE = [1, 4, 1]
  FPROP_DTYPE = 'bfloat16'
  USE_REPEATED_LAYER = True
  CHECKPOINT_POLICY = 'save_nothing'
  SEPARATE_EMBEDDING = True
  LEARNING_RATE = 1e-4
  NUM_TRAIN_STEPS = 100_000
  SAVE_INTERVAL_STEPS = 5000
  SUMMARY_INTERVAL_STEPS = 100


@register
class LmCloudSpmd2BLimitSteps(LmCloudSpmd2B):
  """LmCloudSpmd2B stopped after 300 steps."""

  def task(self):
    task = super().task()
    task.train.num_train_steps = 300
    return task
