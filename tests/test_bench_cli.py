"""`pax bench mfu` (and convert's size and tolerance options) through the CLI: bad values are one line
before any work, a sweep is checked whole before its first row, the table survives piping and
plotting, and the plot draws MFU against the swept number."""

import json

import pytest

from conftest import pax_main, run_pax
from paxcli.maxtext.recipe import TINY as MAXTEXT_TINY

TINY_BENCH = ['--exp', 'bench.LlamaTiny', '--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=32', '--set',
              'HIDDEN_DIMS=64', '--set', 'NUM_HEADS=2', '--set', 'DIMS_PER_HEAD=16', '--set', 'VOCAB_SIZE=64',
              '--set', 'MAX_SEQ_LEN=16']


@pytest.mark.parametrize('args, message', [
    (['bench', 'mfu', '--device-memory', '-1GB'], "--device-memory '-1GB': give a positive size"),
    (['bench', 'mfu', '--device-memory', '0'], "--device-memory '0': give a positive size"),
    (['bench', 'mfu', '--device-memory', 'infGB'], "--device-memory 'infGB': give a positive size"),
    (['bench', 'mfu', '--device-memory', 'nan'], "--device-memory 'nan': give a positive size"),
    (['bench', 'mfu', '--peak-tflops', '-5'], '--peak-tflops must be a positive number'),
    (['bench', 'mfu', '--peak-tflops', '0'], '--peak-tflops must be a positive number'),
    (['bench', 'mfu', '--peak-tflops', 'inf'], '--peak-tflops must be a positive number'),
    (['bench', 'mfu', '--peak-tflops', 'nan'], '--peak-tflops must be a positive number'),
    (['checkpoint', 'convert', 'src', 'out', '--max-shard-size', '-5GB'], "--max-shard-size '-5GB'"),
    (['checkpoint', 'convert', 'src', 'out', '--max-shard-size', '0'], "--max-shard-size '0'"),
    (['checkpoint', 'convert', 'src', 'out', '--max-shard-size', 'infGB'], "--max-shard-size 'infGB'"),
    (['checkpoint', 'convert', 'src', 'out', '--kl-tolerance', 'nan'], '--kl-tolerance must be a positive'),
    (['checkpoint', 'convert', 'src', 'out', '--kl-tolerance', '-1'], '--kl-tolerance must be a positive'),
    (['checkpoint', 'convert', 'src', 'out', '--kl-tolerance', '0'], '--kl-tolerance must be a positive'),
    (['checkpoint', 'convert', 'src', 'out', '--kl-tolerance', 'inf'], '--kl-tolerance must be a positive'),
    # last: before this fix it made 100,000 fake devices and ran for minutes when jax had not started
    (['bench', 'mfu', '--num-devices', '100000'], '--num-devices 100,000 is more than 2,048'),
])
def test_bad_numbers_are_one_line_before_any_work(tmp_path, monkeypatch, capsys, args, message):
  monkeypatch.chdir(tmp_path)
  if args[0] == 'bench':  # a tiny compile, should the option be accepted
    args = args + TINY_BENCH + ['--compile-only']
  code, out, err = pax_main(args, capsys)
  assert code == 2, (out, err)
  assert message in ' '.join(err.split()), err
  assert 'Traceback' not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize('sweep, message', [
    ('PERCORE_BATCH_SIZE=1,abc', 'PERCORE_BATCH_SIZE must be float'),
    ('ICI_MESH_SHAPE=[1,8,1],[1,3,1]', 'ICI_MESH_SHAPE=[1,3,1]'),
    ('CHECKPOINT_POLICY=none,bogus', 'CHECKPOINT_POLICY must be'),
])
def test_a_bad_sweep_value_is_found_before_the_first_row(monkeypatch, capsys, sweep, message):
  from paxcli.loops import bench

  def no_row(*args, **kwargs):
    raise AssertionError('a row ran before the sweep was checked')
  monkeypatch.setattr(bench, 'measure', no_row)
  code, out, err = pax_main(['bench', 'mfu', *TINY_BENCH, '--compile-only', '--sweep', sweep], capsys)
  assert code == 2, err
  assert message in ' '.join(err.split()) and '--sweep combination' in err, err
  assert 'Traceback' not in err


@pytest.mark.slow  # the default suite keeps the main path; CI runs this in make test-slow
def test_piped_table_keeps_rows_whole_and_plot_makes_its_directory(tmp_path, capsys):
  png = tmp_path / 'new' / 'dir' / 'mfu.png'
  code, out, err = pax_main(['bench', 'mfu', *TINY_BENCH, '--steps', '1', '--warmup', '0', '--sweep',
                             'PERCORE_BATCH_SIZE=1,2', '--plot', str(png)], capsys)
  assert code == 0, err
  rows = [line for line in out.splitlines() if line.startswith('│')]
  assert len(rows) == 2, out  # one line per row (before: 160 columns, each row wrapped over several lines)
  assert all(line.rstrip().endswith('│ ok     │') and '%' in line for line in rows), out
  assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and 'Plot written' in err


def _row(batch, policy, mfu, status='ok'):
  return {'experiment': 'E', 'devices': 8, 'device_kind': 'cpu', 'status': status,
          'sweep': {'CHECKPOINT_POLICY': policy, 'PERCORE_BATCH_SIZE': batch},
          'mfu': mfu, 'tokens_per_sec': None if mfu is None else 1000 * mfu}


def test_plot_draws_mfu_against_the_swept_number_one_line_per_other_combination(tmp_path):
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  from paxcli.loops import bench
  rows = [_row(b, p, 0.1 * b + (p == 'none') * 0.05) for p in ('none', 'save_dot_only') for b in (1, 2, 4)]
  rows.append(_row(8, 'none', None, status='out of memory'))
  assert bench.plot_axes(rows) == ('PERCORE_BATCH_SIZE', ['CHECKPOINT_POLICY'])  # the numeric knob, though second
  captured = {}
  original = plt.close
  plt.close = lambda fig: captured.setdefault('fig', fig)
  try:
    bench.plot(rows, str(tmp_path / 'p.png'))
  finally:
    plt.close = original
  mfu_ax, tps_ax = captured['fig'].axes[:2]
  assert mfu_ax.get_ylabel() == 'MFU (%)' and tps_ax.get_ylabel() == 'tokens/s'  # two panels, no overlap
  lines = [line for line in mfu_ax.get_lines() if line.get_label() in ('none', 'save_dot_only')]
  assert sorted(line.get_label() for line in lines) == ['none', 'save_dot_only']
  for line in lines:
    assert list(line.get_xdata()) == [1, 2, 4]  # the knob's numbers, in order
  assert all(t.get_rotation() == 0 for t in tps_ax.get_xticklabels())
  assert any('out of memory' in t.get_text() for t in mfu_ax.texts)


def test_compile_only_of_a_recipe_with_unsupported_features_warns(tmp_path, capsys):
  from maxtext_common import FIXTURES
  recipe = tmp_path / 'seed.py'
  code, _, err = pax_main(['import-maxtext', str(FIXTURES / '2xv4-128.sh'), '-o', str(recipe)], capsys)
  assert code == 0, err
  sets = [a for s in MAXTEXT_TINY for a in ('--set', s)]
  code, out, err = pax_main(['bench', 'mfu', '--exp', f'{recipe}:MaxText2xv4_128', *sets, '--compile-only',
                             '--json'], capsys)
  assert code == 0, err
  assert 'WARNING' in err and 'decoder_block_default' in err
  assert json.loads(out)[0]['status'] == 'compiled'
  # timing steps of a different model is still refused
  code, out, err = pax_main(['bench', 'mfu', '--exp', f'{recipe}:MaxText2xv4_128', *sets, '--steps', '1'], capsys)
  assert code == 2 and 'UNSUPPORTED_FEATURES={}' in err


MOE_ON_8 = ['--exp', 'bench.Qwen3Moe30BA3B', '--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=64', '--set', 'HIDDEN_DIMS=32',
            '--set', 'NUM_HEADS=4', '--set', 'NUM_KV_HEADS=2', '--set', 'DIMS_PER_HEAD=16', '--set', 'VOCAB_SIZE=256',
            '--set', 'NUM_EXPERTS=8', '--set', 'EXPERTS_PER_TOKEN=2', '--set', 'MAX_SEQ_LEN=64',
            '--set', 'ICI_MESH_SHAPE=[1,1,2,4,1]']


@pytest.mark.slow   # a compile of 8 devices in a fresh process: half a minute on a loaded machine
def test_xla_full_rematerialization_is_one_line_of_the_caption():
  """Issue 38: XLA's raw `Involuntary full rematerialization` warning (C++ logging, several hundred characters
  an array) is taken out of the terminal and said in one line under the table, with the array and both
  shardings. A tiny MoE on data 2 x expert 4 reshards its activations so. A fresh process as a user's, with
  XLA's warnings shown (the suite hides them) and no compilation cache (a cached program logs nothing)."""
  env = {'TF_CPP_MIN_LOG_LEVEL': None, 'JAX_ENABLE_COMPILATION_CACHE': 'false'}
  done = run_pax('bench', 'mfu', *MOE_ON_8, '--compile-only', '--num-devices', '8', env=env, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'Involuntary full rematerialization' not in done.stdout + done.stderr, done.stderr[-3000:]
  flat = ' '.join(done.stdout.split())
  assert ('XLA resharded 1 array(s) by full rematerialization (each made whole on every device, then cut to the '
          'new sharding: memory and communication the step could do without), e.g. bf16[1,64,64] from '
          '{devices=[8,1,1]<=[8]} to {devices=[1,1,2,4]<=[8] last_tile_dim_replicate}; --json lists them.') in flat, flat


@pytest.mark.slow   # the same compile, and one train step
def test_train_says_the_full_rematerialization_in_one_line(tmp_path):
  env = {'TF_CPP_MIN_LOG_LEVEL': None, 'JAX_ENABLE_COMPILATION_CACHE': 'false'}
  done = run_pax('train', *MOE_ON_8, '--set', 'NUM_TRAIN_STEPS=1', '--job-log-dir', str(tmp_path / 'job'), env=env,
                 timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'Involuntary full rematerialization' not in done.stdout + done.stderr, done.stderr[-3000:]
  assert done.stdout.count('XLA resharded 1 array(s) by full rematerialization') == 1, done.stdout[-3000:]
  assert 'pax bench mfu --json lists them.' in done.stdout


def test_full_rematerialization_warnings_become_the_rows_fields(capsys):
  """The warnings a compile logs are read into the row; any other line it logs is shown as it was."""
  import os
  from paxcli.perf import xla_log
  row = {}
  line = ('W1129 00:43:35.528118   25314 spmd_partitioner.cc:656] [SPMD] Involuntary full rematerialization. The '
          'compiler cannot go from sharding {devices=[16,1,1]<=[16]} to {devices=[1,1,4,4]<=[16] '
          'last_tile_dim_replicate} efficiently for HLO operation %fake_parameter.2 = bf16[1,4096,2048]{2,1,0} '
          'parameter(2), sharding={devices=[16,1,1]<=[16]}. As the last resort, SPMD will replicate the tensor.\n')
  with xla_log.rematerialized(row):
    os.write(2, (line * 2 + 'E1129 another line XLA logged\n').encode())
  assert row['xla_rematerialized'] == 2
  assert row['xla_rematerialized_examples'][0] == {'array': 'bf16[1,4096,2048]', 'from': '{devices=[16,1,1]<=[16]}',
                                                   'to': '{devices=[1,1,4,4]<=[16] last_tile_dim_replicate}'}
  assert capsys.readouterr().err == 'E1129 another line XLA logged\n'
  assert xla_log.remat_note({}) is None and 'XLA resharded 2 array(s)' in xla_log.remat_note(row)
