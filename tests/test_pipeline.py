"""Pipeline parallelism: the pipelined model computes the unpipelined one's loss and gradients.

float32 on the suite's 8 fake devices, with data and mdl axes beside the stage axis. The
reference is the same scanned model, unpipelined, on a [1, 4, 2] mesh, with the same
weights; every pipelined case reads those weights with its own shardings (layers over
`stage`). A few cases run by default; the full grid is marked slow.
"""

import itertools
import json

import jax
import numpy as np
import pytest

from conftest import pax_main
from paxcli import config
from paxcli.runtime import engine
from paxcli.runtime import sharding
from paxcli.errors import UserError
from paxcli.layers import pipeline

# 8 layers: 4 stages x 2 repeats x 1 layer, 2 x 2 x 2, 2 x 1 x 4, ...; global batch 2 x 8 = 16.
TINY = ['NUM_LAYERS=8', 'MODEL_DIMS=16', 'HIDDEN_DIMS=32', 'NUM_HEADS=2', 'DIMS_PER_HEAD=8', 'VOCAB_SIZE=32',
        'MAX_SEQ_LEN=8', 'USE_REPEATED_LAYER=True', 'PERCORE_BATCH_SIZE=2']
EXP = 'lm_cloud.LmCloudSpmdTest'
DEFAULT_CASES = [  # (stages, microbatches, repeats, mesh)
    (2, 2, 1, '[2,1,2,2]'),
    (2, 4, 2, '[2,1,2,2]'),   # circular, as many microbatches as stages x 2: the ring holds 2
    (4, 4, 1, '[4,1,2,1]'),
    (4, 8, 2, '[4,1,1,2]'),   # circular over 4 stages, the ring holds 4; mdl 2
]


def _mesh(stages, repeats):
  return '[2,1,2,2]' if stages == 2 else '[4,1,2,1]' if repeats == 1 else '[4,1,1,2]'


FULL_GRID = [(s, m, r, _mesh(s, r)) for s, m, r in itertools.product((2, 4), (1, 2, 4, 8), (1, 2))
             if not (r > 1 and m < s)]
SLOW_CASES = [c for c in FULL_GRID if c not in DEFAULT_CASES]


def _batch():
  rng = np.random.default_rng(0)
  b, l = 16, 8
  return {'ids': rng.integers(0, 32, (b, l)).astype(np.int32),
          'labels': rng.integers(0, 32, (b, l)).astype(np.int32),
          'weights': (rng.random((b, l)) > 0.1).astype(np.float32),
          # two packed segments per row: segment ids and positions travel with each microbatch
          'segment_ids': np.repeat([[1] * 5 + [2] * 3], b, 0).astype(np.int32),
          'positions': np.repeat([[0, 1, 2, 3, 4, 0, 1, 2]], b, 0).astype(np.int32)}


def _loss_and_grads(setup, params, batch):
  def loss(p):
    with setup.activation_sharding():
      value, _ = setup.model.apply({'params': p}, batch, method='fprop')
    return value

  fn = jax.jit(jax.value_and_grad(loss), in_shardings=(setup.state_shardings['params'],))
  return jax.device_get(fn(jax.device_put(params, setup.state_shardings['params'])))


@pytest.fixture(scope='module')
def reference():
  setup = engine.build(config.resolve(EXP, TINY + ['ICI_MESH_SHAPE=[1,4,2]']))
  params = jax.device_get(engine.init_state(setup, 0)['params'])
  batch = _batch()
  return params, batch, _loss_and_grads(setup, params, batch)


def _check_case(reference, stages, microbatches, repeats, mesh):
  params, batch, (ref_loss, ref_grads) = reference
  setup = engine.build(config.resolve(EXP, TINY + [f'NUM_STAGES={stages}', f'NUM_MICROBATCHES={microbatches}',
                                                   f'PIPELINE_CIRCULAR_REPEAT={repeats}', f'ICI_MESH_SHAPE={mesh}']))
  assert setup.pipeline == pipeline.Schedule(stages, microbatches, repeats)
  layers = setup.state_shardings['params']['layers']['attention']['query']['kernel']
  assert layers.spec[0] == 'stage'  # the [L, ...] stack is stored sharded over stages
  loss, grads = _loss_and_grads(setup, params, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  flat_ref = dict(jax.tree_util.tree_flatten_with_path(ref_grads)[0])
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    np.testing.assert_allclose(g, flat_ref[path], rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize('stages,microbatches,repeats,mesh', DEFAULT_CASES)
def test_pipelined_equals_unpipelined(reference, stages, microbatches, repeats, mesh):
  _check_case(reference, stages, microbatches, repeats, mesh)


@pytest.mark.slow
@pytest.mark.parametrize('stages,microbatches,repeats,mesh', SLOW_CASES)
def test_pipelined_equals_unpipelined_full_grid(reference, stages, microbatches, repeats, mesh):
  _check_case(reference, stages, microbatches, repeats, mesh)


def test_bubble_formula():
  assert pipeline.Schedule(4, 8, 1).bubble == pytest.approx(3 / 11)
  assert pipeline.Schedule(4, 8, 2).iterations == 19
  assert pipeline.Schedule(1, 4, 1).bubble == 0
  assert 'bubble (S-1)/(R*M+S-1) = 1/5 = 20.0%' in pipeline.Schedule(2, 4, 1).describe()
  # MICROBATCH_SIZE gives M from the global batch; neither knob: as many microbatches as stages.
  assert pipeline.schedule_for(8, 2, 1, 16, None, 4) == pipeline.Schedule(2, 4, 1)
  assert pipeline.schedule_for(8, 2, 1, 16, None, None) == pipeline.Schedule(2, 2, 1)


@pytest.mark.parametrize('knobs,message', [
    (['NUM_STAGES=2', 'PIPELINE_CIRCULAR_REPEAT=3', 'ICI_MESH_SHAPE=[2,1,2,2]'],
     r'NUM_LAYERS 8 is not divisible by NUM_STAGES x PIPELINE_CIRCULAR_REPEAT = 2 x 3'),
    (['NUM_STAGES=2', 'NUM_MICROBATCHES=3', 'ICI_MESH_SHAPE=[2,1,2,2]'],
     r'global batch of 16 is not divisible by NUM_MICROBATCHES 3'),
    (['NUM_STAGES=2', 'MICROBATCH_SIZE=5', 'ICI_MESH_SHAPE=[2,1,2,2]'],
     r'global batch of 16 is not divisible by MICROBATCH_SIZE 5'),
    (['NUM_STAGES=4', 'NUM_MICROBATCHES=2', 'PIPELINE_CIRCULAR_REPEAT=2', 'ICI_MESH_SHAPE=[4,1,2,1]'],
     r'circular pipeline .* needs at least as many microbatches as stages'),
    (['NUM_STAGES=2', 'ICI_MESH_SHAPE=[4,1,2,1]'], r'NUM_STAGES is 2 but the mesh has 4 on its stage axis'),
    (['NUM_STAGES=2', 'ICI_MESH_SHAPE=[1,4,2]'], r'NUM_STAGES is 2 but the mesh has 1 on its stage axis'),
    (['ICI_MESH_SHAPE=[2,1,4,1]'], r'NUM_STAGES is 1 but the mesh has 2 on its stage axis'),
    (['NUM_STAGES=2', 'USE_REPEATED_LAYER=False', 'ICI_MESH_SHAPE=[2,1,4,1]'], r'needs USE_REPEATED_LAYER=True'),
    (['ICI_MESH_SHAPE=[1,1,1,2,2,2,1]'], r'must have 3 entries .* 4 .* 5 .* or 6'),
])
def test_bad_pipeline_knobs_are_one_line_errors(knobs, message):
  with pytest.raises(UserError, match=message) as info:
    engine.build(config.resolve(EXP, TINY + knobs))
  assert '\n' not in str(info.value)


def test_four_entry_mesh_has_a_stage_axis():
  mesh = sharding.make_mesh([2, 1, 2, 2])
  assert dict(mesh.shape) == {'stage': 2, 'replica': 1, 'data': 2, 'mdl': 2}
  assert sharding.num_stages(mesh) == 2 and sharding.num_stages(sharding.make_mesh([1, 4, 2])) == 1
  # a three-entry DCN shape beside a four-entry ICI one: no stages across slices
  assert sharding.mesh_shape([2, 1, -1, 1], [1, 1, 1], 8) == ([2, 1, 4, 1], [1, 1, 1, 1])


def test_describe_reports_the_bubble(capsys):
  code, out, err = pax_main(['describe', '--exp', EXP, *[a for k in TINY + [
      'NUM_STAGES=4', 'NUM_MICROBATCHES=8', 'PIPELINE_CIRCULAR_REPEAT=2', 'ICI_MESH_SHAPE=[4,1,2,1]']
      for a in ('--set', k)]], capsys)
  assert code == 0, err
  assert '# pipeline: 4 stages x 8 microbatches x 2 circular repeat(s): bubble (S-1)/(R*M+S-1) = 3/19' in out


def test_bench_mfu_reports_the_bubble(capsys):
  knobs = TINY + ['NUM_STAGES=2', 'NUM_MICROBATCHES=2', 'ICI_MESH_SHAPE=[2,1,2,2]', 'NUM_LAYERS=2']
  code, out, err = pax_main(['bench', 'mfu', '--exp', EXP, *[a for k in knobs for a in ('--set', k)],
                             '--compile-only', '--json'], capsys)
  assert code == 0, err
  row = json.loads(out)[0]
  assert row['pipeline_bubble'] == pytest.approx(1 / 3) and 'bubble' in row['pipeline']
  assert row['mesh'] == 'stage=2 x replica=1 x data=2 x mdl=2' and row['status'] == 'compiled'


@pytest.mark.slow
def test_pipelined_dropout_trains(tmp_path, capsys):
  knobs = TINY + ['NUM_STAGES=2', 'NUM_MICROBATCHES=4', 'ICI_MESH_SHAPE=[2,1,2,2]', 'DROPOUT_PROB=0.1',
                  'NUM_TRAIN_STEPS=3', 'SUMMARY_INTERVAL_STEPS=1']
  code, out, err = pax_main(['train', '--exp', EXP, *[a for k in knobs for a in ('--set', k)], '--job-log-dir',
                             str(tmp_path / 'job')], capsys)
  assert code == 0, err
  losses = [json.loads(line)['loss'] for line in (tmp_path / 'job' / 'train_metrics.jsonl').read_text().splitlines()]
  assert len(losses) == 3 and all(np.isfinite(losses))
