"""recipes/c4.py (Pax's C4 runs) and paxcli.inputs.c4 (C4 as Pax reads it).

The recipes: parameter counts against Pax's, computed here from Pax's own values; each run
compiled at reduced size on the 8 fake devices; the multislice mesh's device assignment.
The input: a real C4 in TFDS's format (tests/c4_data.py writes it with TFDS's c4 builder) read
through the recipe by 2 processes; and the one-line stop when the data or vocabulary is missing.
"""

import json
import os
import re
import subprocess
import sys
import socket

import numpy as np
import pytest

import c4_data
from conftest import REPO, pax_main, run_pax
from paxcli import config
from paxcli.errors import UserError
from paxcli.loops import bench
from paxcli.runtime import distributed
from paxcli.runtime import engine, infeed

# Small enough to compile in seconds; every structural choice of the recipes kept.
TINY = ['NUM_LAYERS=4', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=4', 'DIMS_PER_HEAD=8', 'VOCAB_SIZE=128',
        'MAX_SEQ_LEN=32']


def pax_parameters(layers, dims, hidden, heads, head_dim, vocab, attention_bias, per_dim_scale, softmax_bias,
                   position_rows=0) -> int:
  """Parameters of Pax's TransformerLm (praxis): per layer a LayerNorm before attention and one in
  the feed-forward (scale + bias), combined QKV [3, D, N, H] and output [D, N, H] projections
  (with biases when the attention has them), PerDimScale [H], two feed-forward matrices with
  biases; then the final LayerNorm, the shared embedding/softmax [V, D] (+ its bias), learned
  positions."""
  attention = 4 * dims * heads * head_dim + (3 * heads * head_dim + dims) * attention_bias + head_dim * per_dim_scale
  feed_forward = 2 * dims * hidden + hidden + dims
  return (layers * (attention + feed_forward + 4 * dims) + 2 * dims + vocab * dims + vocab * softmax_bias
          + position_rows * dims)


# Pax's values (paxml/tasks/lm/params/c4.py, c4_multislice.py; configure_gpt3_task for the GPT-3 one).
PAX = {
    'C4Spmd1BAdam4Replicas': pax_parameters(13, 2560, 10240, 20, 128, 32000, False, True, True),
    'C4Spmd16BAdam32Replicas': pax_parameters(36, 6144, 24576, 48, 128, 32000, False, True, True),
    'C4SpmdPipelineGpt3SmallAdam64Replicas': pax_parameters(24, 3072, 12288, 24, 128, 50257, True, False, False,
                                                            position_rows=16384),
    'C4Spmd22BAdam2xv4_128': pax_parameters(48, 6144, 24576, 24, 256, 32768, False, True, True),
}


@pytest.mark.parametrize('name', sorted(PAX))
def test_describe_shows_pax_parameter_count(name, capsys):
  code, out, err = pax_main(['describe', '--exp', f'c4.{name}'], capsys)
  assert code == 0, err
  shown = int(re.search(r'# parameters: .*\(([\d,]+)\)', out).group(1).replace(',', ''))
  assert shown == pytest.approx(PAX[name], rel=0.01)


def test_recipes_port_paxs_meshes_batches_and_optimizers():
  def knobs(name):
    return config.resolve(f'c4.{name}').experiment

  one_b, gpt3, multi = knobs('C4Spmd1BAdam4Replicas'), knobs('C4SpmdPipelineGpt3SmallAdam64Replicas'), \
      knobs('C4Spmd22BAdam2xv4_128')
  assert (one_b.ICI_MESH_SHAPE, one_b.PERCORE_BATCH_SIZE, one_b.MAX_SEQ_LEN) == ([1, 4, 1], 32, 1024)
  assert knobs('C4Spmd16BAdam32Replicas').ICI_MESH_SHAPE == [1, 16, 2]
  assert (multi.ICI_MESH_SHAPE, multi.DCN_MESH_SHAPE, multi.PERCORE_BATCH_SIZE) == ([1, 64, 1], [2, 1, 1], 16)
  assert (gpt3.ICI_MESH_SHAPE, gpt3.NUM_STAGES, gpt3.MICROBATCH_SIZE) == ([4, 1, 4, 4], 4, 16)
  flat = config.resolve('c4.C4Spmd1BAdam4Replicas').flat()
  assert flat['task.train.optimizer.clip_threshold'] == 1.0 and flat['task.train.optimizer.weight_decay'] == 1e-3
  assert flat['task.train.lr_schedule.kind'] == 'linear_rampup_exponential_decay'
  assert flat['task.train.clip_gradient_norm_to_value'] == 5.0 and flat['task.train.save_max_to_keep'] == 10
  assert flat['task.activation_sharding_rules'] == {'embed': ('mdl',)}
  flat = config.resolve('c4.C4SpmdPipelineGpt3SmallAdam64Replicas').flat()
  assert flat['task.train.optimizer.clip_threshold'] == 0.0 and flat['task.train.optimizer.beta2'] == 0.95
  assert flat['task.model.lm_tpl.max_seq_len'] == 16384 and flat['datasets.C4Train.seq_len'] == 2048
  assert flat['datasets.C4Train.spm_model'].startswith('gs://mlperf-llm-public2/')


def test_update_capping_is_paxs_adam():
  """praxis sharded_adam's first step: m / (sqrt(v) + eps), scaled to RMS <= clip_threshold,
  plus weight decay x param, times -learning rate (OptimizerConfig.clip_threshold)."""
  import jax.numpy as jnp

  from paxcli.optim import make_optimizer
  from paxcli.tasks import OptimizerConfig, TrainConfig
  opt = OptimizerConfig(name='adamw', beta1=0.9, beta2=0.99, epsilon=1e-6, weight_decay=0.01, clip_threshold=0.5)
  tx = make_optimizer(TrainConfig(learning_rate=0.1, clip_gradient_norm_to_value=0.0, optimizer=opt))
  params, grads = {'w': jnp.array([1.0, -2.0, 3.0, 0.5])}, {'w': jnp.array([0.3, -0.1, 2.0, 0.0])}
  updates, _ = tx.update(grads, tx.init(params), params)
  adam = grads['w'] / (jnp.abs(grads['w']) + 1e-6)  # bias-corrected first step
  capped = adam / max(1.0, float(jnp.sqrt(jnp.mean(adam ** 2))) / 0.5)
  np.testing.assert_allclose(updates['w'], -0.1 * (capped + 0.01 * params['w']), rtol=1e-5)


# Each run at reduced size on the 8 fake devices, its mesh shrunk to 8 with every axis kept.
REDUCED = {
    'C4Spmd1BAdam4Replicas': ['ICI_MESH_SHAPE=[1,8,1]', 'PERCORE_BATCH_SIZE=2'],
    'C4Spmd16BAdam32Replicas': ['ICI_MESH_SHAPE=[1,4,2]', 'PERCORE_BATCH_SIZE=2'],
    'C4SpmdPipelineGpt3SmallAdam64Replicas': ['ICI_MESH_SHAPE=[4,1,1,2]', 'PERCORE_BATCH_SIZE=2',
                                              'MICROBATCH_SIZE=4', 'TRAINABLE_PE_MAX_SEQ_LEN=64'],
    'C4Spmd22BAdam2xv4_128': ['ICI_MESH_SHAPE=[1,4,1]', 'PERCORE_BATCH_SIZE=2'],
}


# ~13 s of CPU each: the default suite compiles the pipelined and the multislice runs; the two
# plain FSDP runs (the 22B's code path on other meshes) compile in the slow suite.
@pytest.mark.parametrize('name', [pytest.param(n, marks=pytest.mark.slow) if n in (
    'C4Spmd1BAdam4Replicas', 'C4Spmd16BAdam32Replicas') else n for n in sorted(REDUCED)])
def test_recipe_compiles_at_reduced_size_without_data(name):
  """`pax bench mfu --compile-only`'s path: the C4 input declares its batch, so no data is read."""
  row = bench.measure(config.resolve(f'c4.{name}', TINY + REDUCED[name]), compile_only=True)
  assert row['status'] == 'compiled' and row['memory_total_bytes'] > 0
  assert row['devices'] == 8 and row['seq_len'] == 32


def test_multislice_mesh_puts_the_dcn_axis_across_slices():
  """C4Spmd22BAdam2xv4_128's DCN [2, 1, 1] is the `replica` axis: one slice per replica index.

  On fake devices a slice is a consecutive block of devices (process-major order, as slices of
  whole hosts are); weights never use `replica`, so no weight is split across slices.
  """
  setup = engine.build(config.resolve('c4.C4Spmd22BAdam2xv4_128', TINY + REDUCED['C4Spmd22BAdam2xv4_128']))
  mesh = setup.mesh
  assert dict(mesh.shape) == {'replica': 2, 'data': 4, 'mdl': 1}
  for replica, slice_ids in enumerate(([0, 1, 2, 3], [4, 5, 6, 7])):
    assert sorted(d.id for d in mesh.devices[replica].flat) == slice_ids
  specs = [s.spec for s in __import__('jax').tree.leaves(setup.state_shardings['params'])]
  assert all('replica' not in str(spec) for spec in specs) and any('data' in str(spec) for spec in specs)
  # The batch: the first half of the global rows on slice 0, the second on slice 1.
  from paxcli.runtime import sharding
  rows = sharding.batch_sharding(mesh).devices_indices_map((setup.global_batch, 32))
  half = setup.global_batch // 2
  for device, index in rows.items():
    assert (index[0].start < half) == (device.id < 4)


def test_missing_data_and_vocabulary_stop_training_in_one_line(tmp_path):
  result = run_pax('train', '--exp', 'c4.C4Spmd1BAdam4Replicas', *sum((['--set', s] for s in TINY), []),
                   '--set', 'ICI_MESH_SHAPE=[1,8,1]', '--set', f'C4_DATA_DIR={tmp_path / "tfds"}',
                   '--set', f'C4_VOCABULARY={tmp_path / "spm.model"}', '--job-log-dir', str(tmp_path / 'job'))
  assert result.returncode == 2 and 'Traceback' not in result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr
  assert f'C4 data: no {tmp_path / "tfds"}/c4/en/3.0.1/dataset_info.json' in lines[0]
  assert 'set C4_DATA_DIR' in lines[0] and 'tensorflow.org/datasets/catalog/c4' in lines[0]
  assert f'cannot read {tmp_path / "spm.model"}' in lines[0] and 'set C4_VOCABULARY' in lines[0]
  assert not (tmp_path / 'job' / 'checkpoints').exists()  # stopped before any state was made


# ---- a real C4 on 2 processes ---------------------------------------------------------------

@pytest.fixture(scope='module')
def c4(tmp_path_factory):
  return c4_data.write_c4(str(tmp_path_factory.mktemp('c4')))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _check_epoch(c4, hosts: list[dict]) -> None:
  """Every document of each split read by exactly one host, and every token of it."""
  for split in ('train', 'validation'):
    seen = [h[split]['documents'] for h in hosts]
    assert seen[0] and seen[1] and not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == c4_data.document_ids(split)  # each document once
    tokens = sum(h[split]['tokens'] for h in hosts)
    assert tokens == c4_data.expected_tokens(c4, split, seq_len=c4_data.SEQ_LEN)


def test_each_host_reads_its_own_documents(c4):
  """The recipe's inputs as host 0 and host 1 of 2 would build them, in this process."""
  resolved = config.resolve('c4.C4Spmd1BAdam4Replicas', c4_data.HOST_READ + [
      f'C4_DATA_DIR={c4["data_dir"]}', f'C4_VOCABULARY={c4["vocabulary"]}'])
  hosts = [{split: c4_data.read_epoch(infeed.build_input(cfg, process_batch=4, num_hosts=2, host_index=i))
            for split, cfg in (('train', resolved.train_dataset()), ('validation', resolved.eval_datasets()[0]))}
           for i in range(2)]
  _check_epoch(c4, hosts)
  first = infeed.build_input(resolved.train_dataset(), process_batch=4, num_hosts=1, host_index=0).get_next()
  assert sorted(first) == ['ids', 'labels', 'positions', 'segment_ids', 'weights']  # packed
  assert first['ids'].shape == (4, c4_data.SEQ_LEN)
  small = config.resolve('c4.C4Spmd1BAdam4Replicas', [f'C4_DATA_DIR={c4["data_dir"]}', 'VOCAB_SIZE=64',
                                                      f'C4_VOCABULARY={c4["vocabulary"]}'])
  with pytest.raises(UserError, match=r'has \d+ pieces but VOCAB_SIZE is 64'):
    infeed.build_input(small.train_dataset(), process_batch=4, num_hosts=1, host_index=0)


@pytest.mark.slow  # ~50 s of CPU: compiles a train and an eval step, reads C4 through seqio
def test_recipe_trains_and_evaluates_on_local_c4(c4, tmp_path):
  job = tmp_path / 'job'
  result = run_pax('train', '--exp', 'c4.C4Spmd1BAdam4Replicas', *sum((['--set', s] for s in TINY), []),
                   '--set', 'ICI_MESH_SHAPE=[1,8,1]', '--set', 'PERCORE_BATCH_SIZE=1', '--set', 'NUM_TRAIN_STEPS=4',
                   '--set', 'EVAL_INTERVAL_STEPS=4', '--set', 'SAVE_INTERVAL_STEPS=4',
                   '--set', f'C4_DATA_DIR={c4["data_dir"]}', '--set', f'C4_VOCABULARY={c4["vocabulary"]}',
                   '--job-log-dir', str(job))
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'step 4: eval on C4Validation: loss' in result.stdout
  assert (job / 'tokenizer' / 'spm.model').read_bytes() == open(c4['vocabulary'], 'rb').read()


@pytest.mark.slow  # two fresh processes start jax, tensorflow and seqio: ~1 min
@pytest.mark.alone  # jax.distributed heartbeats: not beside another worker
def test_two_hosts_read_every_document_once_per_epoch(c4, tmp_path):
  """2 processes (jax.distributed, 4 fake devices each) build the recipe's C4 inputs as `pax train`
  does and read one epoch of each split: every document is read by exactly one host, whole."""
  coordinator = f'127.0.0.1:{_free_port()}'
  procs = []
  for i in range(2):
    env = distributed.child_environment(os.environ, coordinator, 2, i, cpu_devices=4)
    env['PYTHONPATH'] = os.pathsep.join([str(REPO / 'tests'), env.get('PYTHONPATH', '')])
    procs.append(subprocess.Popen([sys.executable, '-m', 'c4_data', c4['data_dir'], c4['vocabulary'],
                                   str(tmp_path / f'host{i}.json')], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
  for p in procs:
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
  hosts = [json.loads((tmp_path / f'host{i}.json').read_text()) for i in range(2)]
  assert sorted(h['infeed_host_index'] for h in hosts) == [0, 1]
  _check_epoch(c4, hosts)
