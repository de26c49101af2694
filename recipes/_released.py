"""The base of the recipes of released models (gemma, mistral, mixtral, qwen): what they share besides
their family's presets and their sizes. Fine-tuning settings at the released size: bfloat16 compute,
one row a device, scanned layers saving nothing for the backward pass, AdamW at 1e-5."""

from paxcli.models import LmExperiment


class ReleasedLm(LmExperiment):
  """A released model at its size (not registered: the recipes that subclass it are)."""

  PERCORE_BATCH_SIZE = 1
  FPROP_DTYPE = 'bfloat16'
  USE_REPEATED_LAYER = True
  CHECKPOINT_POLICY = 'save_nothing'
  ICI_MESH_SHAPE = None   # all devices data-parallel (FSDP-style sharding: set a mesh for your hosts)
  OPTIMIZER = 'adamw'
  LEARNING_RATE = 1e-5
  WEIGHT_DECAY = 0.0
