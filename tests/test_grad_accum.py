"""Gradient accumulation (#34 item 2): GRAD_ACCUM_STEPS microbatches scanned inside one step give the
unaccumulated step's loss, gradients and metrics on the same global batch (float32, 1e-6 relative) on the
suite's 8 fake devices: FSDP (weights over `data`), FSDP with tensor parallelism, LoRA, pipeline stages;
tokens (and so MFU and tokens/s) count the global batch; `--compile-only` memory falls with the number of
microbatches; a count that does not divide each shard's rows is one line before any compile."""

import json

import jax
import numpy as np
import pytest

from conftest import pax_main
from paxcli import config
from paxcli.errors import UserError
from paxcli.loops.train import make_train_step, step_gradients
from paxcli.runtime import engine, sharding

EXP = 'lm_cloud.LmCloudSpmdTest'
TINY = ['NUM_LAYERS=2', 'MODEL_DIMS=16', 'HIDDEN_DIMS=32', 'NUM_HEADS=2', 'DIMS_PER_HEAD=8', 'VOCAB_SIZE=32',
        'MAX_SEQ_LEN=8', 'USE_REPEATED_LAYER=True', 'PERCORE_BATCH_SIZE=4']   # global batch 32
LORA = ['LORA_RANK=2', 'LORA_TARGETS=("query","value","mlp")']
CASES = {   # name -> knobs
    'fsdp': ['ICI_MESH_SHAPE=[1,8,1]'],
    'fsdp+tensor': ['ICI_MESH_SHAPE=[1,4,2]'],
    'lora': ['ICI_MESH_SHAPE=[1,4,2]', *LORA],
    'pipeline': ['NUM_LAYERS=4', 'NUM_STAGES=2', 'ICI_MESH_SHAPE=[2,1,2,2]'],
}


def _batch(rows=32, length=8):
  rng = np.random.default_rng(0)
  return {'ids': rng.integers(0, 32, (rows, length)).astype(np.int32),
          'labels': rng.integers(0, 32, (rows, length)).astype(np.int32),
          # uneven weights: microbatches weigh differently, as padded rows make them
          'weights': (rng.random((rows, length)) > 0.3).astype(np.float32),
          'segment_ids': np.repeat([[1] * 5 + [2] * 3], rows, 0).astype(np.int32),
          'positions': np.repeat([[0, 1, 2, 3, 4, 0, 1, 2]], rows, 0).astype(np.int32)}


def _state(setup):
  """The initial state, LoRA's B made nonzero (else A's gradients are all zero)."""
  state = engine.init_state(setup, 0)
  rng = np.random.default_rng(1)
  state['params'] = jax.tree_util.tree_map_with_path(
      lambda p, x: x + 0.1 * rng.standard_normal(x.shape).astype(x.dtype) if p[-1].key.endswith('_lora_b') else x,
      jax.device_get(state['params']))
  return jax.device_put(state, setup.state_shardings)


def _gradients(knobs, steps):
  setup = engine.build(config.resolve(EXP, TINY + knobs + [f'GRAD_ACCUM_STEPS={steps}']))
  batch_sharding = sharding.batch_sharding(setup.mesh)
  batch = sharding.to_global(_batch(), batch_sharding, setup.global_batch)
  done = jax.jit(step_gradients(setup, 0))(_state(setup), batch)
  return setup, jax.device_get(done)


def _relative(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize('case', [pytest.param(c, marks=pytest.mark.slow) if c == 'fsdp+tensor' else c for c in CASES])
def test_accumulated_step_equals_the_whole_batch_step(case):
  _, whole = _gradients(CASES[case], 1)
  setup, acc = _gradients(CASES[case], 4)
  if case == 'pipeline':
    assert setup.pipeline is not None   # 4 microbatches of 8 rows each run through the stages
  assert _relative(acc.loss, whole.loss) <= 1e-6 and _relative(acc.total, whole.total) <= 1e-6
  for name, (value, weight) in whole.metrics.items():
    assert float(acc.metrics[name][1]) == float(weight), name   # the global batch's weight, summed
    assert _relative(acc.metrics[name][0], value) <= 1e-6, name
  flat = dict(jax.tree_util.tree_flatten_with_path(whole.grads)[0])
  got = dict(jax.tree_util.tree_flatten_with_path(acc.grads)[0])
  assert set(got) == set(flat) and flat
  if case == 'lora':
    assert all('lora' in jax.tree_util.keystr(p) for p in flat)   # only the adapters train
  # 1e-6 of each gradient's norm; the key bias's gradient is zero but for rounding (softmax ignores a
  # constant per query), so it is held to 1e-6 of the whole gradient's norm instead
  total = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in flat.values()))
  for path, g in flat.items():
    norm = np.linalg.norm(np.asarray(g, np.float64))
    scale = norm if norm > 1e-5 * total else total
    error = np.linalg.norm(np.asarray(got[path], np.float64) - g) / scale
    assert error <= 1e-6, (jax.tree_util.keystr(path), error)


def test_the_step_reports_the_global_batch_tokens_and_loss():
  """The full train step (optimizer included): the same metrics; `tokens` (what tokens/s and MFU divide)
  counts the whole global batch, not one microbatch."""
  rows = {}
  for steps in (1, 2):
    setup = engine.build(config.resolve(EXP, TINY + ['ICI_MESH_SHAPE=[1,8,1]', f'GRAD_ACCUM_STEPS={steps}']))
    batch_sharding = sharding.batch_sharding(setup.mesh)
    step = make_train_step(setup, batch_sharding, 0)
    _, metrics = step(engine.init_state(setup, 0), sharding.to_global(_batch(), batch_sharding, setup.global_batch))
    rows[steps] = jax.device_get(metrics)
  assert float(rows[2]['tokens']) == float(rows[1]['tokens']) == float(_batch()['weights'].sum())
  for name in ('loss', 'accuracy', 'grad_norm'):
    assert _relative(rows[2][name], rows[1][name]) <= 1e-6, name


def test_compile_only_memory_falls_with_microbatches(capsys):
  """pax bench mfu --compile-only at a fixed global batch: XLA's per-device temp memory falls as the step
  holds one microbatch's activations at a time (a quarter of them with 4)."""
  knobs = ['NUM_LAYERS=2', 'MODEL_DIMS=64', 'HIDDEN_DIMS=256', 'NUM_HEADS=4', 'DIMS_PER_HEAD=16', 'VOCAB_SIZE=256',
           'MAX_SEQ_LEN=128', 'PERCORE_BATCH_SIZE=8', 'ICI_MESH_SHAPE=[1,8,1]']
  code, out, err = pax_main(['bench', 'mfu', '--exp', EXP, *[a for k in knobs for a in ('--set', k)],
                             '--sweep', 'GRAD_ACCUM_STEPS=1,4', '--compile-only', '--json'], capsys)
  assert code == 0, err
  rows = json.loads(out)
  temp = [r['memory_temp_bytes'] for r in rows]
  assert [r['global_batch'] for r in rows] == [64] * 2 and all(r['tokens_per_step'] == 64 * 128 for r in rows)
  assert temp[1] < temp[0] / 2, temp   # benchmarks/grad_accum.py has 1, 2, 4, 8


@pytest.mark.parametrize('knobs,message', [
    (['GRAD_ACCUM_STEPS=3'], 'GRAD_ACCUM_STEPS=3 must divide the batch of each data-parallel shard: 4 rows'),
    (['GRAD_ACCUM_STEPS=0'], 'grad_accum_steps'),
])
def test_a_count_that_does_not_divide_is_one_line_before_any_compile(knobs, message, capsys, monkeypatch):
  def no_compile(*a, **k):
    raise AssertionError('compiled')
  monkeypatch.setattr(jax.stages.Lowered, 'compile', no_compile)
  code, out, err = pax_main(['bench', 'mfu', '--exp', EXP, *[a for k in TINY + knobs for a in ('--set', k)],
                             '--compile-only'], capsys)
  assert code == 2 and 'Traceback' not in err and len(err.strip().splitlines()) == 1, err
  assert message in err, err
  with pytest.raises(UserError, match='GRAD_ACCUM'):
    engine.build(config.resolve(EXP, TINY + ['GRAD_ACCUM_STEPS=5']))
