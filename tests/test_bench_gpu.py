"""`make bench-gpu` (benchmarks/gpu.py): on a machine without a GPU, one line saying what it needs; each of
its parts runs here on the CPU at a tiny size (the GPU's own figures only come from a lent GPU)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

TINY = ['NUM_LAYERS=1', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=2', 'DIMS_PER_HEAD=16', 'VOCAB_SIZE=64',
        'MAX_SEQ_LEN=16']
ONE_DEVICE = {'XLA_FLAGS': ''}


def _gpu_module():
  spec = importlib.util.spec_from_file_location('bench_gpu', REPO / 'benchmarks' / 'gpu.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_bench_gpu_without_a_gpu_stops_in_one_line():
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  done = subprocess.run([sys.executable, str(REPO / 'benchmarks' / 'gpu.py')], capture_output=True, text=True,
                        env=env, timeout=300)
  assert done.returncode != 0 and done.stdout == ''
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and 'Traceback' not in done.stderr
  assert 'needs an NVIDIA GPU' in lines[0] and 'runs on cpu' in lines[0] and 'jax[cuda12]' in lines[0]


def test_make_bench_gpu_is_the_script():
  text = (REPO / 'Makefile').read_text()
  assert 'bench-gpu: $(RUNTIME)\n\t$(BIN)/python benchmarks/gpu.py' in text


@pytest.fixture(scope='module')
def tiny_run(tmp_path_factory, monkeypatch_module):
  """Every part of the GPU check on the CPU: bench.LlamaTiny at a tiny size, one device per process."""
  for k, v in ONE_DEVICE.items():
    monkeypatch_module.setenv(k, v)
  gpu = _gpu_module()
  return gpu, gpu.run_all('bench.LlamaTiny', TINY, batches=(1, 2), steps=2, train_steps=6, save_every=2,
                          decode_batches=(1, 4), prompt_len=4, new_tokens=4)


@pytest.fixture(scope='module')
def monkeypatch_module():
  mp = pytest.MonkeyPatch()
  yield mp
  mp.undo()


# Eight `pax` processes (each starts jax and compiles): several minutes on 2 loaded cores.
@pytest.mark.slow
def test_each_part_runs_on_the_cpu_at_a_tiny_size(tiny_run):
  gpu, result = tiny_run
  rows = result['mfu']
  bf16 = [r for r in rows if r['label'] == 'bf16']
  assert [(r['sweep']['PERCORE_BATCH_SIZE'], r['sweep']['ATTENTION_IMPL']) for r in bf16] == [
      ('1', 'auto'), ('1', 'einsum'), ('2', 'auto'), ('2', 'einsum')]
  assert all(r['status'] == 'ok' and r['tokens_per_sec'] > 0 and r['memory_total_bytes'] > 0 for r in bf16)
  # fp8 and PGLE: refused in their rows, in the command's own words, on a CPU
  fp8 = [r for r in rows if r['label'] == 'fp8 delayed']
  assert len(fp8) == 1 and fp8[0]['status'].startswith('refused: FP8=delayed') and 'fp8 matmul units' in fp8[0]['status']
  pgle = [r for r in rows if r['label'] == 'bf16 pgle']
  assert len(pgle) == 1 and pgle[0]['status'].startswith('refused: PGLE') and 'needs a GPU' in pgle[0]['status']
  train = result['train']
  assert train['status'] == 'ok' and train['first_step_seconds'] > 0 and len(train['stalls']) == 2
  assert [(d['status'], d['batch'], d['new_tokens']) for d in result['decode']] == [('ok', 1, 4), ('ok', 4, 16)]
  assert all(d['tokens_per_sec'] > 0 for d in result['decode'])
  assert set(result['part_seconds']) == {'mfu', 'train', 'decode'}


@pytest.mark.slow
def test_the_table_and_json_hold_every_figure(tiny_run):
  from rich.console import Console
  gpu, result = tiny_run
  console = Console(width=200, record=True)
  console.print(gpu.table(result, 'cpu'))
  text = console.export_text()
  for what in ('bf16 PERCORE_BATCH_SIZE=2 ATTENTION_IMPL=einsum', 'fp8 delayed', 'launch to first step',
               'async-save stall', 'greedy decode, batch 4', 'peak / plan'):
    assert what in text, what
  assert json.loads(json.dumps(result, default=str))['decode'][1]['batch'] == 4
