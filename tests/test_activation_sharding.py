"""Activation sharding by logical axes: FSDP memory per device stays flat as the mesh grows.

On Pax's FSDP mesh [1, N, 1] (weights and batch both on `data`) with a fixed per-device
batch, what one device holds while the train step runs does not depend on N: its rows of
the batch (fixed), one layer's weights gathered at a time (fixed) and its 1/N of the
state (shrinking). Before activations were constrained GSPMD gathered the batch instead
of the weights, and temporaries grew with N: for this model 4.5 MiB on 4 devices and
6.5 MiB on 8 (LmCloudSpmd2B with 2 layers: 15.7, 29.8 and 58.2 GiB on 4, 8 and 16).
"""

import jax
import numpy as np
import pytest

from paxcli import config

from paxcli.loops import bench

from paxcli.runtime import engine

from paxcli.runtime import sharding
from paxcli.layers import activation_sharding
from paxcli.loops.train import make_train_step

# Wide enough that activations and weights, not fixed overheads, are what the step holds.
WIDE = ['NUM_LAYERS=1', 'MODEL_DIMS=128', 'HIDDEN_DIMS=512', 'NUM_HEADS=4', 'DIMS_PER_HEAD=32', 'VOCAB_SIZE=256',
        'MAX_SEQ_LEN=64', 'PERCORE_BATCH_SIZE=2']


def _memory(num_devices: int):
  resolved = config.resolve('lm_cloud.LmCloudSpmdTest', WIDE + [f'ICI_MESH_SHAPE=[1,{num_devices},1]'])
  mesh = sharding.make_mesh([1, num_devices, 1], devices=jax.devices()[:num_devices])
  setup = engine.build(resolved, mesh=mesh)
  batch_sharding = sharding.batch_sharding(mesh)
  example = setup.model.dummy_batch(1, setup.seq_len)
  step = make_train_step(setup, batch_sharding, 0)
  compiled = step.lower(setup.abstract_state, bench.abstract_batch(setup, batch_sharding, example)).compile()
  return compiled.memory_analysis()


def test_fsdp_memory_per_device_does_not_grow_with_devices():
  four, eight = _memory(4), _memory(8)
  # Temporaries: the same rows and the same gathered layer on every device; 10% for XLA's
  # buffer choices. (Unconstrained, they grew by 45%.)
  assert eight.temp_size_in_bytes <= 1.1 * four.temp_size_in_bytes, (four, eight)
  # Arguments (state and batch): the state is sharded N ways, so it halves, less the batch.
  assert eight.argument_size_in_bytes <= 0.6 * four.argument_size_in_bytes, (four, eight)


def test_constrain_maps_logical_names_and_overrides():
  mesh = sharding.make_mesh([1, 4, 2])
  x = np.zeros((8, 4, 6), np.float32)

  def spec(names, overrides=None):
    with activation_sharding.rules(mesh, overrides):
      out = tuple(jax.jit(lambda a: activation_sharding.constrain(a, names))(x).sharding.spec)
    return out + (None,) * (x.ndim - len(out))   # jax drops trailing unsharded dimensions

  assert spec(('batch', 'length', 'mlp')) == ('data', None, 'mdl')
  assert spec(('batch', 'length', 'embed')) == ('data', None, None)     # embed unsharded by default
  assert spec(('batch', 'length', 'embed'), {'embed': ('mdl',)}) == ('data', None, 'mdl')
  assert spec(('batch', 'length', 'heads'), {'batch': ()}) == (None, None, 'mdl')
  # 6 is no multiple of 4: a mesh axis that does not divide a dimension is skipped.
  assert spec(('batch', 'length', 'mlp'), {'mlp': ('data',)}) == ('data', None, None)
  # Outside a step's context, constrain does nothing.
  assert activation_sharding.constrain(x, ('batch', 'length', 'embed')) is x


def test_experiment_overrides_reach_the_step():
  resolved = config.resolve('lm_cloud.LmCloudSpmdTest', WIDE + [
      'ICI_MESH_SHAPE=[1,4,2]', "task.activation_sharding_rules={'embed': ('mdl',)}"])
  setup = engine.build(resolved)
  assert setup.activation_rules == {'embed': ('mdl',)}
  with pytest.raises(Exception):
    config.resolve('lm_cloud.LmCloudSpmdTest', ['task.activation_sharding_rulez={}'])
