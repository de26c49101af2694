"""Plans compiled for a TPU slice by the TPU's own compiler: `pax bench mfu --compile-only --topology`.

libtpu (the tpu extra, in the test extra) compiles for the slice on this CPU machine. The slice names
are Cloud TPU's; a bad name or a mesh the slice cannot hold is one line. libtpu installed on a machine
without a TPU runs JAX on the CPU, quietly.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import pax_main, run_pax
from paxcli.errors import UserError
from paxcli.runtime import platform, topology

GIB = 1024 ** 3
TINY = ['--exp', 'bench.LlamaTiny', '--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=32', '--set', 'HIDDEN_DIMS=64',
        '--set', 'NUM_HEADS=2', '--set', 'DIMS_PER_HEAD=16', '--set', 'VOCAB_SIZE=64', '--set', 'MAX_SEQ_LEN=16',
        '--set', 'PERCORE_BATCH_SIZE=2']


@pytest.mark.parametrize('name, slices, shape, devices, wrap, hbm', [
    ('v4-8', 1, (2, 2, 1), 4, (False, False, False), 32),       # TensorCores: 4 chips, one megacore device each
    ('v4-128', 1, (4, 4, 4), 64, (True, True, True), 32),
    ('v4-384', 1, (4, 4, 12), 192, (True, True, True), 32),
    ('v4-4096', 1, (8, 16, 16), 2048, (True, True, True), 32),
    ('v5p-256', 2, (4, 4, 8), 128, (True, True, True), 95),   # per slice: 128 chips
    ('v5e-4', 1, (2, 2), 4, (False, False, False), 16),         # chips
    ('v5litepod-256', 1, (16, 16), 256, (True, True, False), 16),
    ('v6e-128', 1, (8, 16), 128, (False, True, False), 32),
    ('V6E-1', 1, (1, 1), 1, (False, False, False), 32),
])
def test_slice_names_as_cloud_tpu_lays_them_out(name, slices, shape, devices, wrap, hbm):
  tpu = topology.parse(name, slices)
  assert (tpu.shape, tpu.num_devices, tpu.wrap, tpu.memory_bytes) == (shape, devices * slices, wrap, hbm * GIB)


@pytest.mark.parametrize('name, message', [
    ('v4-100', "v4 slices come as 8, 16, 32 or 64 TensorCores, then multiples of 128 (two per chip); the nearest "
               "are v4-64 and v4-128."),
    ('v5e-12', 'the nearest are v5e-8 and v5e-16'),
    ('v6e-512', 'the nearest is v6e-256'),
    ('tpu-v4-8', "Did you mean 'v4-8'?"),
    ('v7-8', 'is not a TPU slice name (v4-N, v5p-N, v5e-N or v5litepod-N, v6e-N)'),
])
def test_an_unknown_slice_is_one_line_with_the_close_names(name, message):
  with pytest.raises(UserError) as e:
    topology.parse(name)
  assert message in str(e.value) and '\n' not in str(e.value)


def test_a_mesh_the_slice_cannot_hold_is_one_line():
  v4_8 = topology.parse('v4-8')
  topology.check_mesh(v4_8, [1, 4, 1], None)
  topology.check_mesh(v4_8, [1, -1, 2], None)
  with pytest.raises(UserError, match=r'needs 8 devices, but --topology v4-8 has 4 \(v4-8 \(2x2x1, 4 devices\)\)'):
    topology.check_mesh(v4_8, [1, 8, 1], None)
  with pytest.raises(UserError, match='needs a multiple of 8 devices'):
    topology.check_mesh(v4_8, [1, -1, 8], None)
  with pytest.raises(UserError, match='makes 2 slice.s., but --topology v4-128 is 1: add --num-slices 2'):
    topology.check_mesh(topology.parse('v4-128'), [1, 64, 1], [2, 1, 1])
  with pytest.raises(UserError, match=r'set DCN_MESH_SHAPE to 2 slices \(e.g. \[2, 1, 1\]\)'):
    topology.check_mesh(topology.parse('v4-128', 2), [1, 128, 1], None)


@pytest.mark.parametrize('args, message', [
    (['--compile-only', '--topology', 'v4-100'], 'the nearest are v4-64 and v4-128'),
    (['--topology', 'v4-8'], 'add --compile-only'),
    (['--compile-only', '--topology', 'v4-8', '--num-devices', '4'], 'give one'),
    (['--compile-only', '--num-slices', '2'], '--num-slices counts slices of a --topology'),
    (['--compile-only', '--topology', 'v4-8', '--set', 'ICI_MESH_SHAPE=[1,8,1]'],
     'needs 8 devices, but --topology v4-8 has 4'),
    (['--compile-only', '--topology', 'v4-128', '--set', 'ICI_MESH_SHAPE=[1,64,1]', '--set', 'DCN_MESH_SHAPE=[2,1,1]'],
     'add --num-slices 2'),
])
def test_bench_refuses_bad_topology_input_in_one_line(capsys, args, message):
  code, out, err = pax_main(['bench', 'mfu', *TINY, *args], capsys)
  assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_libtpu_alone_is_not_a_tpu_and_jax_runs_on_the_cpu_quietly(tmp_path):
  """The tpu extra installed on a machine without a TPU: no TPU platform, no libtpu start-up warnings."""
  pytest.importorskip('libtpu')
  assert not platform.tpu_attached()
  env = {k: v for k, v in os.environ.items() if k != 'JAX_PLATFORMS'}
  code = 'from paxcli.runtime import platform; print(platform.detect_platform())'
  assert subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True).stdout.strip() == 'cpu'
  done = run_pax('describe', '--exp', 'bench.LlamaTiny', env={'JAX_PLATFORMS': None}, cwd=tmp_path)
  assert done.returncode == 0, done.stderr
  assert 'TPU_ACCELERATOR_TYPE' not in done.stderr and 'TPU_WORKER_HOSTNAMES' not in done.stderr, done.stderr


@pytest.mark.slow
def test_compile_only_plan_for_a_v4_slice_is_counted_by_the_tpu_compiler(tmp_path):
  """A tiny model planned for v4-8 (4 devices) through the CLI, from a fresh shell: XLA:TPU counts it,
  for TPU v4 devices, against 32 GiB each; its figures are the TPU's own (not XLA:CPU's: the same plan
  on 4 fake CPU devices counts other bytes)."""
  pytest.importorskip('libtpu')
  done = run_pax('bench', 'mfu', *TINY, '--compile-only', '--topology', 'v4-8', '--json',
                 env={'JAX_PLATFORMS': None}, cwd=tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'TPU_ACCELERATOR_TYPE' not in done.stderr, done.stderr   # libtpu's start-up lines are named away
  row = json.loads(done.stdout)[0]
  assert row['compiler'].startswith('XLA:TPU (libtpu 0.') and 'v4-8 (2x2x1, 4 devices)' in row['compiler']
  assert (row['devices'], row['device_kind'], row['platform']) == (4, 'TPU v4', 'tpu')
  assert row['mesh'] == 'replica=1 x data=4 x mdl=1' and row['status'] == 'compiled'
  assert (row['device_memory_bytes'], row['device_memory_source']) == (32 * GIB, 'TPU v4: 32 GiB HBM per chip')
  parts = {k: row[f'memory_{k}_bytes'] for k in ('argument', 'output', 'alias', 'temp', 'generated_code')}
  assert row['memory_total_bytes'] == (parts['argument'] + parts['output'] - parts['alias'] + parts['temp']
                                       + parts['generated_code'])
  # The donated train state aliases its update (what TPU's buffer assignment reports), and holds at least
  # this device's share of the weights and Adam's two moments in float32.
  assert parts['alias'] > 0 and parts['argument'] >= 3 * 4 * row['params'] / 4
  assert row['fits'] is True
  # XLA:TPU's FLOPs for one device: at least the model's forward and backward share of it.
  assert row['xla_flops_per_step_per_device'] >= 0.9 * row['model_flops_per_step'] / 4
  cpu = run_pax('bench', 'mfu', *TINY, '--compile-only', '--num-devices', '4', '--json', cwd=tmp_path)
  assert cpu.returncode == 0, cpu.stderr[-3000:]
  cpu_row = json.loads(cpu.stdout)[0]
  assert cpu_row['compiler'] == 'XLA:CPU' and cpu_row['params'] == row['params']
  assert cpu_row['memory_total_bytes'] != row['memory_total_bytes']


def test_libtpu_missing_or_not_the_one_jax_names_is_said_in_one_line(monkeypatch):
  wanted = topology.libtpu_for_jax()
  assert wanted and wanted.startswith('libtpu==')   # read from the installed jax's own tpu extra
  monkeypatch.setattr(topology, 'libtpu_version', lambda: None)
  with pytest.raises(UserError, match=r"libtpu, which is not installed here: pip install 'paxcli\[tpu\]' \(libtpu=="):
    topology.check_libtpu(pytest.fail)
  monkeypatch.setattr(topology, 'libtpu_version', lambda: '0.0.1')
  lines = []
  assert topology.check_libtpu(lines.append) == 'libtpu 0.0.1'
  assert lines == [f"Note: libtpu 0.0.1 is installed; jax {__import__('jax').__version__} was released with "
                   f"{wanted}. If the compile fails or counts oddly: pip install '{wanted}'."]


def test_only_the_experiments_libtpu_flags_reach_the_tpu_compiler():
  env = {'tpu': {'LIBTPU_INIT_ARGS': '--xla_tpu_enable_latency_hiding_scheduler=true', 'XLA_FLAGS': '--x'},
         'gpu': {'LIBTPU_INIT_ARGS': 'no'}}
  assert topology.libtpu_env(env) == {'LIBTPU_INIT_ARGS': '--xla_tpu_enable_latency_hiding_scheduler=true'}
  assert topology.libtpu_env({}) == {}
