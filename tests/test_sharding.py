"""Sharded training equals single-device training; weights really are sharded."""

import json
import os

import jax
import numpy as np
import pytest

from conftest import pax_main, run_pax
from paxcli import config
from paxcli.runtime import engine
from paxcli.runtime import sharding
from paxcli.errors import UserError

MODEL = ['--exp', 'lm_cloud.LmCloudSpmdTest', '--set', 'NUM_LAYERS=2', '--set', 'MODEL_DIMS=32',
         '--set', 'HIDDEN_DIMS=64', '--set', 'NUM_HEADS=4', '--set', 'DIMS_PER_HEAD=8',
         '--set', 'MAX_SEQ_LEN=16', '--set', 'VOCAB_SIZE=64', '--set', 'task.train.num_train_steps=6',
         '--set', 'task.train.summary_interval_steps=1', '--set', 'task.train.save_interval_steps=100']


def _losses(job_dir):
  with open(os.path.join(job_dir, 'train_metrics.jsonl')) as f:
    return [json.loads(line)['loss'] for line in f]


def test_eight_devices_match_one_device(tmp_path, capsys):
  # Global batch 16 either way: 2 per device on 8 devices, 16 on 1 device.
  code, out, err = pax_main(['train', *MODEL, '--set', 'ICI_MESH_SHAPE=[1,4,2]', '--set', 'PERCORE_BATCH_SIZE=2',
                             '--job-log-dir', str(tmp_path / 'eight'), '--verbose'], capsys)
  assert code == 0, err
  assert 'mesh replica=1 x data=4 x mdl=2' in out
  # --verbose: every weight with shape, logical axes and mesh axes.
  row = next(line for line in out.splitlines() if 'layer_0/mlp/wi_0/kernel' in line)
  assert '32x64' in row and 'embed, mlp' in row and 'data, mdl' in row
  one = run_pax('train', *MODEL, '--set', 'PERCORE_BATCH_SIZE=16', '--job-log-dir', str(tmp_path / 'one'),
                env={'XLA_FLAGS': '--xla_force_host_platform_device_count=1'})
  assert one.returncode == 0, one.stderr
  assert 'Devices: 1 x' in one.stdout
  eight, single = _losses(tmp_path / 'eight'), _losses(tmp_path / 'one')
  assert len(eight) == len(single) == 6
  # float32 sums run in another order when sharded: agree to 1e-4 relative.
  np.testing.assert_allclose(eight, single, rtol=1e-4)
  assert eight[-1] < eight[0]


def test_params_and_optimizer_state_are_created_sharded():
  resolved = config.resolve('lm_cloud.LmCloudSpmdTest', ['ICI_MESH_SHAPE=[1,4,2]', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64',
                                                         'NUM_HEADS=4', 'DIMS_PER_HEAD=8', 'PERCORE_BATCH_SIZE=1'])
  setup = engine.build(resolved)
  state = engine.init_state(setup, 0)
  wi = state['params']['layer_0']['mlp']['wi_0']['kernel']  # (embed, mlp) -> (data, mdl)
  assert wi.shape == (32, 64)
  assert tuple(wi.sharding.spec) == ('data', 'mdl')
  assert {s.data.shape for s in wi.addressable_shards} == {(8, 32)}
  query = state['params']['layer_0']['attention']['query']['kernel']  # (embed, heads, head_dim)
  assert tuple(query.sharding.spec) == ('data', 'mdl', None)
  # Adam's moments follow their parameter's sharding.
  mu = state['opt_state'][1][0].mu['layer_0']['mlp']['wi_0']['kernel']
  assert mu.sharding == wi.sharding
  assert len(jax.devices()) == 8


def test_undivisible_dimension_falls_back_to_replication():
  mesh = sharding.make_mesh([1, 4, 2])
  abstract = {'w': jax.ShapeDtypeStruct((6, 3), np.float32)}
  out = sharding.logical_to_sharding({'w': ('embed', 'mlp')}, abstract, mesh)
  assert tuple(out['w'].spec) == (None, None)  # 6 % 4 and 3 % 2 are not 0


def test_mesh_errors_name_the_device_count():
  with pytest.raises(UserError, match='there are 8'):
    sharding.make_mesh([1, 3, 1])
  with pytest.raises(UserError, match='at most one -1'):
    sharding.make_mesh([-1, -1, 1])
  assert dict(sharding.make_mesh([1, -1, 2]).shape) == {'replica': 1, 'data': 4, 'mdl': 2}
  mesh = sharding.make_mesh([1, 2, 2], [2, 1, 1])
  assert dict(mesh.shape) == {'replica': 2, 'data': 2, 'mdl': 2}
