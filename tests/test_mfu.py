"""MFU: the FLOPs model, peaks, `pax bench mfu`, MFU in training, and the faster kernels
(dot-product attention, the fused loss) held to their references."""

import functools
import io
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import pax_main, run_pax

TINY_BENCH = ['--exp', 'bench.LlamaTiny', '--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=32', '--set',
              'HIDDEN_DIMS=64', '--set', 'NUM_HEADS=2', '--set', 'DIMS_PER_HEAD=16', '--set', 'VOCAB_SIZE=64',
              '--set', 'MAX_SEQ_LEN=16']


def _one_device_setup(overrides):
  from paxcli import config
  from paxcli.runtime import engine
  from paxcli.runtime import sharding
  resolved = config.resolve('lm_cloud.LmCloudSpmdTest', overrides)
  mesh = sharding.make_mesh(None, None, devices=jax.devices()[:1])
  return engine.build(resolved, mesh=mesh)


@pytest.mark.parametrize('shape', [
    ['USE_GATED_ACTIVATION=False'],
    ['USE_GATED_ACTIVATION=True', 'ACTIVATION=silu', 'NUM_KV_HEADS=2', 'SEPARATE_EMBEDDING=True'],
], ids=['mha', 'gated_gqa_untied'])
def test_flops_model_matches_xla_cost_analysis(shape):
  """Without remat, XLA counts what the model computes: the FLOPs model (PaLM's full attention,
  as the einsum kernel computes every logit) is within a few percent of it."""
  from paxcli.perf import flops
  from paxcli.runtime import sharding
  from paxcli.loops.train import make_train_step
  setup = _one_device_setup(['NUM_LAYERS=2', 'MODEL_DIMS=128', 'HIDDEN_DIMS=512', 'NUM_HEADS=4',
                             'DIMS_PER_HEAD=32', 'VOCAB_SIZE=512', 'MAX_SEQ_LEN=64', 'PERCORE_BATCH_SIZE=8',
                             'USE_BIAS=False', 'CHECKPOINT_POLICY=none', 'ATTENTION_IMPL=einsum', *shape])
  batch_sharding = sharding.batch_sharding(setup.mesh)
  batch = {k: jax.ShapeDtypeStruct((8, 64), dt, sharding=batch_sharding)
           for k, dt in (('ids', jnp.int32), ('labels', jnp.int32), ('weights', jnp.float32))}
  compiled = make_train_step(setup, batch_sharding, 0).lower(setup.abstract_state, batch).compile()
  xla = flops.xla_flops(compiled)
  model = flops.for_model(setup.model, 64)
  tokens = 8 * 64
  assert xla == pytest.approx(model.palm_per_token * tokens, rel=0.06)
  assert model.per_step(tokens) < xla  # the causal figure leaves out the masked half of attention
  assert model.palm_per_token - model.per_token == pytest.approx(0.5 * 12 * 2 * 4 * 32 * 64)


def test_flops_model_of_the_llama_1b_recipe():
  """5.74 GFLOP per token, which makes the issue's 289 ms step (8 x 2048 tokens) 33% of 989."""
  from paxcli import config
  from paxcli.runtime import engine
  from paxcli.perf import flops
  model = engine.build_task(config.resolve('bench.Llama1B').task).model
  f = flops.for_model(model, 2048)
  assert f.per_token == pytest.approx(5.738e9, rel=1e-3)
  assert f.per_step(8 * 2048) / 0.289 / 1e12 / 989 == pytest.approx(0.33, abs=0.005)


def test_the_classifier_counts_its_own_flops_close_to_xla():
  """Not only LMs: the classifier's train_flops (the blocks, plus its head once per sequence) is
  within a few percent of XLA's count of its train step (einsum attention: PaLM's full figure)."""
  from paxcli import config
  from paxcli.perf import flops
  from paxcli.runtime import engine, sharding
  from paxcli.loops.train import make_train_step
  resolved = config.resolve('classify.StdlibDocsClassifier', ['NUM_LAYERS=2', 'MODEL_DIMS=256', 'HIDDEN_DIMS=1024',
                                                             'MAX_SEQ_LEN=64', 'PERCORE_BATCH_SIZE=8'])
  resolved.task.model.block_tpl.attention_tpl.attention_impl = 'einsum'
  setup = engine.build(resolved, mesh=sharding.make_mesh(None, None, devices=jax.devices()[:1]))
  batch_sharding = sharding.batch_sharding(setup.mesh)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_sharding),
                          setup.model.dummy_batch(8, 64))
  compiled = make_train_step(setup, batch_sharding, 0).lower(setup.abstract_state, abstract).compile()
  model = flops.for_model(setup.model, 64)
  assert model.palm_per_token * 8 * 64 == pytest.approx(flops.xla_flops(compiled), rel=0.06)  # measured: 2.6%
  assert flops.compute_dtype(setup.model) == 'float32'


def test_a_model_without_a_flops_method_reports_mfu_as_na(tmp_path, capsys):
  (tmp_path / 'noflops.py').write_text(
      'import fiddle as fdl\n'
      'from paxcli.models import ClassificationModel\n'
      'from paxcli.recipes.classify import StdlibDocsClassifier\n\n'
      'class Plain(ClassificationModel):\n'
      '  train_flops = None   # as a model that never defined it\n\n'
      'class NoFlops(StdlibDocsClassifier):\n'
      '  def model(self):\n'
      '    return fdl.Config(Plain, **super().model().__arguments__)\n')
  code, out, err = pax_main(['describe', '--exp', str(tmp_path / 'noflops.py') + ':NoFlops'], capsys)
  assert code == 0, err
  assert '# FLOPs per token: n/a: model has no FLOPs method' in out
  code, out, err = pax_main(['bench', 'mfu', '--exp', str(tmp_path / 'noflops.py') + ':NoFlops',
                             '--set', 'MAX_SEQ_LEN=16'], capsys)
  assert code == 2 and 'MFU n/a: model has no FLOPs method' in err and 'Traceback' not in err


def test_peak_table_and_measured_cpu_peak():
  from paxcli.perf import flops
  assert flops.lookup_peak('NVIDIA H100 80GB HBM3').tflops == 989
  assert flops.lookup_peak('NVIDIA H100 PCIe').tflops == 756
  assert flops.lookup_peak('NVIDIA H200').tflops == 989
  assert flops.lookup_peak('NVIDIA A100-SXM4-80GB').tflops == 312
  assert flops.lookup_peak('NVIDIA B200').tflops == 2250
  assert flops.lookup_peak('NVIDIA H100 80GB HBM3', fp8=True).tflops == 1979
  assert flops.lookup_peak('TPU v4').tflops == 275
  assert flops.lookup_peak('TPU v5 lite').tflops == 197
  assert flops.lookup_peak('TPU v5p').tflops == 459
  assert flops.lookup_peak('TPU v6 lite').tflops == 918
  assert flops.lookup_peak('cpu') is None
  assert flops.device_peak(override=123.0).tflops == 123.0
  cpu = flops.device_peak(jax.devices()[0], 'float32', measure_size=256)
  assert cpu.measured and 'measured' in cpu.source and 'float32' in cpu.source
  assert 0 < cpu.tflops < 10  # 8 fake devices share a few CPU cores


def test_dot_product_attention_equals_the_einsum_reference_with_segments():
  from paxcli.layers import attention_ops
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (2, 16, 4, 8))
  k = jax.random.normal(keys[1], (2, 16, 2, 8))  # grouped-query: 2 kv heads for 4 query heads
  v = jax.random.normal(keys[2], (2, 16, 2, 8))
  packed = jnp.array([[1] * 5 + [2] * 7 + [3] * 4, [1] * 16], jnp.int32)
  attend = jax.jit(attention_ops.attention, static_argnums=4)

  @functools.partial(jax.jit, static_argnums=4)
  def grads(q, k, v, segments, impl):
    return jax.grad(lambda q, k, v: jnp.sum(jnp.sin(attention_ops.attention(q, k, v, segments, impl))),
                    argnums=(0, 1, 2))(q, k, v)

  for segments in (None, packed):
    np.testing.assert_allclose(attend(q, k, v, segments, 'dot_product'), attend(q, k, v, segments, 'einsum'),
                               atol=2e-6)
    for g_new, g_ref in zip(grads(q, k, v, segments, 'dot_product'), grads(q, k, v, segments, 'einsum')):
      np.testing.assert_allclose(g_new, g_ref, atol=2e-5)
  # Segment ids matter: the first row's second segment does not see the first.
  out_packed = attend(q, k, v, packed, 'dot_product')
  out_plain = attend(q, k, v, None, 'dot_product')
  np.testing.assert_allclose(out_packed[:, :5], out_plain[:, :5], atol=2e-6)
  assert not np.allclose(out_packed[0, 5:], out_plain[0, 5:])
  assert attention_ops.kernel_for(jnp.bfloat16, 128) == 'xla'  # cuDNN only on a GPU


def test_model_with_dot_product_attention_equals_einsum_model():
  from paxcli.layers.base import instantiate
  from paxcli.models import lm_config, lm_loss
  common = dict(vocab_size=64, num_layers=2, model_dims=32, hidden_dims=64, num_heads=4, num_kv_heads=2,
                dims_per_head=8, max_seq_len=16, position_embedding='rotary', checkpoint_policy='none')
  ids = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
  segments = jnp.array([[1] * 9 + [2] * 7, [1] * 16], jnp.int32)
  params = instantiate(lm_config(**common)).init(jax.random.key(0), ids)['params']

  def loss(impl):
    model = instantiate(lm_config(**common, attention_impl=impl))
    return lambda p: lm_loss(model.apply({'params': p}, ids, segments), jnp.roll(ids, -1, 1), jnp.ones(ids.shape))[0]
  l_ref, g_ref = jax.jit(jax.value_and_grad(loss('einsum')))(params)
  l_new, g_new = jax.jit(jax.value_and_grad(loss('dot_product')))(params)
  assert float(l_new) == pytest.approx(float(l_ref), rel=1e-6)
  for a, b in zip(jax.tree.leaves(g_new), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, atol=2e-5)


def test_fused_loss_equals_plain_loss_and_holds_no_second_logits_copy():
  from paxcli.models import fused_lm_loss, lm_loss
  keys = jax.random.split(jax.random.key(0), 3)
  b, l, vocab = 4, 32, 512
  logits = 3 * jax.random.normal(keys[0], (b, l, vocab))
  labels = jax.random.randint(keys[1], (b, l), 0, vocab)
  weights = (jax.random.uniform(keys[2], (b, l)) > 0.2).astype(jnp.float32)
  (ref, ref_sums), ref_grad = jax.jit(jax.value_and_grad(lm_loss, has_aux=True))(logits, labels, weights)
  (new, new_sums), new_grad = jax.jit(jax.value_and_grad(fused_lm_loss, has_aux=True))(logits, labels, weights)
  assert float(new) == pytest.approx(float(ref), rel=1e-6)
  for key in ref_sums:
    assert float(new_sums[key]) == pytest.approx(float(ref_sums[key]), rel=1e-6)
  np.testing.assert_allclose(new_grad, ref_grad, atol=1e-7)
  # bfloat16 logits: the gradient comes back in bfloat16, matching within bf16 rounding.
  bf = logits.astype(jnp.bfloat16)
  g_bf = jax.jit(jax.grad(lambda x: fused_lm_loss(x, labels, weights)[0]))(bf)
  assert g_bf.dtype == jnp.bfloat16
  np.testing.assert_allclose(g_bf.astype(jnp.float32), jax.jit(jax.grad(lambda x: lm_loss(x.astype(jnp.float32), labels, weights)[0]))(bf),
                             atol=1e-4)
  # Memory, as the train step takes it (value, metrics and gradient): the plain loss keeps a float32
  # [B, L, V] temporary (log-probabilities for the backward pass); this one does not.
  size = b * l * vocab * 4

  def temp(fn):
    step = jax.jit(jax.value_and_grad(fn, has_aux=True))
    return step.lower(logits, labels, weights).compile().memory_analysis().temp_size_in_bytes
  assert temp(lm_loss) >= size
  assert temp(fused_lm_loss) < size / 4


def test_unrolled_model_initialises_through_its_scanned_twin():
  from paxcli import config
  from paxcli.runtime import engine
  resolved = config.resolve('lm_cloud.LmCloudSpmdTest', ['NUM_LAYERS=3', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64',
                                                         'NUM_HEADS=4', 'DIMS_PER_HEAD=8', 'VOCAB_SIZE=64',
                                                         'MAX_SEQ_LEN=16', 'PERCORE_BATCH_SIZE=1'])
  setup = engine.build(resolved)
  assert engine._init_through_scan(setup) is not None
  state = engine.init_state(setup, 0)
  assert engine.shape_signature(state) == engine.shape_signature(setup.abstract_state)
  kernels = [np.asarray(state['params'][f'layer_{i}']['mlp']['wi_0']['kernel']) for i in range(3)]
  assert not np.allclose(kernels[0], kernels[1]) and not np.allclose(kernels[1], kernels[2])
  assert np.std(kernels[0]) == pytest.approx(32 ** -0.5, rel=0.15)  # fan-in scaled
  assert all(leaf.sharding == s for leaf, s in zip(jax.tree.leaves(state), jax.tree.leaves(setup.state_shardings)))


def test_train_summaries_carry_mfu_and_mark_compile_and_eval_windows(tmp_path, capsys):
  job = str(tmp_path / 'job')
  code, out, err = pax_main(['train', *TINY_BENCH, '--job-log-dir', job, '--set', 'NUM_TRAIN_STEPS=6',
                             '--set', 'SUMMARY_INTERVAL_STEPS=2', '--set', 'EVAL_INTERVAL_STEPS=2',
                             '--set', 'PERCORE_BATCH_SIZE=1', '--profile-steps', '3-4'], capsys)
  assert code == 0, err
  records = [json.loads(line) for line in open(os.path.join(job, 'train_metrics.jsonl'))]
  assert [r['step'] for r in records] == [2, 4, 6]
  # MFU recomputed here, not with paxcli.perf.flops: 6 x N matmul weights per token + causal attention,
  # N counted from the shapes of the checkpoint's parameters. TINY_BENCH: 1 layer, D 32, FFN 64
  # (gated: 3 matrices), 2 heads x 16 (K/V heads too), vocab 64, untied output, sequence 16.
  info = json.loads(pax_main(['checkpoint', 'inspect', job, '--json'], capsys)[1])
  kernels = {a['name']: int(np.prod(a['shape'])) for a in info['arrays']
             if a['name'].startswith('params/') and a['name'].endswith('/kernel')}
  n_matmul = sum(kernels.values())  # q, k, v, out, wi_0, wi_1, wo and the output layer; no lookup table
  assert len(kernels) == 8 and n_matmul == 3 * 32 * 2 * 16 + 2 * 16 * 32 + 3 * 32 * 64 + 32 * 64 == 12288
  seq, tokens_per_step, devices = 16, 8 * 16, jax.device_count()
  attention = 12 * 1 * 2 * 16 * seq / 2  # Q.K^T and probs.V, forward and backward, causal half
  flops_per_step = (6 * n_matmul + attention) * tokens_per_step
  logged = re.search(r'MFU: (\S+) model TFLOP per step over (\d+) device\(s\); peak measured: .* -> (\S+) per device',
                     out)
  assert logged, out
  assert float(logged.group(1)) == pytest.approx(flops_per_step / 1e12, rel=1e-3) and int(logged.group(2)) == devices
  peak = float(logged.group(3))  # the measured CPU peak per device, as logged (3 digits)
  for r in records:
    assert r['tokens_per_sec'] / r['steps_per_sec'] == pytest.approx(tokens_per_step)
    tflops = flops_per_step * r['steps_per_sec'] / devices / 1e12
    assert r['model_tflops_per_device'] == pytest.approx(tflops, rel=1e-6)
    assert r['mfu'] == pytest.approx(tflops / peak, rel=0.01)  # the logged peak is rounded to 3 digits
  assert records[0]['compile_seconds'] > 0          # the first window compiled the step
  assert records[1]['eval_seconds'] > 0             # the eval after step 2 is timed apart
  assert 'MFU' in out and 'compilation, left out of the rates' in out and 'eval, left out' in out
  assert 'peak measured' in out
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  events = EventAccumulator(os.path.join(job, 'summaries', 'train'))
  events.Reload()
  assert {'mfu', 'model_tflops_per_device', 'compile_seconds', 'eval_seconds'} <= set(events.Tags()['scalars'])
  traces = [f for _, _, files in os.walk(os.path.join(job, 'profile')) for f in files]
  assert any(f.endswith(('.xplane.pb', '.trace.json.gz')) for f in traces), traces
  assert 'Profile of steps 3-4 written' in out


def test_pgle_on_cpu_says_it_needs_a_gpu(tmp_path, capsys):
  code, _, err = pax_main(['train', *TINY_BENCH, '--job-log-dir', str(tmp_path / 'j'), '--pgle', 'auto'], capsys)
  assert code != 0 and 'PGLE' in err and 'needs a GPU' in err and 'Traceback' not in err
  code, _, err = pax_main(['bench', 'mfu', *TINY_BENCH, '--pgle-profile', str(tmp_path / 'p.pb')], capsys)
  assert code != 0 and 'needs a GPU' in err and 'Traceback' not in err
  code, _, err = pax_main(['train', *TINY_BENCH, '--job-log-dir', str(tmp_path / 'j'), '--profile-steps', '5-2'],
                          capsys)
  assert code != 0 and '--profile-steps' in err


def test_bench_sweep_writes_table_json_and_png(tmp_path, capsys):
  png = tmp_path / 'mfu.png'
  code, out, err = pax_main(['bench', 'mfu', *TINY_BENCH, '--steps', '2', '--warmup', '1',
                             '--sweep', 'PERCORE_BATCH_SIZE=1,2', '--plot', str(png), '--json'], capsys)
  assert code == 0, err
  rows = json.loads(out)
  assert [r['sweep'] for r in rows] == [{'PERCORE_BATCH_SIZE': '1'}, {'PERCORE_BATCH_SIZE': '2'}]
  assert [r['tokens_per_step'] for r in rows] == [8 * 16, 16 * 16]
  for r in rows:
    assert r['status'] == 'ok' and r['devices'] == 8
    assert r['step_seconds_min'] <= r['step_seconds_median'] <= r['step_seconds_max']
    assert r['mfu'] == pytest.approx(r['model_tflops_per_device'] / r['peak_tflops'])
    assert r['hfu'] > 0 and r['peak_measured'] and r['memory_total_bytes'] > 0 and r['compile_seconds'] > 0
  assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'

  from rich.console import Console

  from paxcli.loops import bench
  console = Console(width=400, record=True, file=io.StringIO())
  console.print(bench.table(rows, compile_only=False))
  text = console.export_text()
  assert 'PERCORE_BATCH_SIZE' in text and 'MFU' in text and 'HFU' in text and 'measured' in text
  assert bench.split_values('[1,8,1],[8,1,1]') == ['[1,8,1]', '[8,1,1]']


def test_sweep_row_that_does_not_fit_says_so_with_the_memory_needed_and_the_sweep_goes_on(capsys):
  """A combination whose compiled program needs more than the device's memory (here set with
  --device-memory between what two batch sizes need) is a row 'out of memory' that says how much
  it needed, and is not run; the next combination still runs."""
  code, out, err = pax_main(['bench', 'mfu', *TINY_BENCH, '--compile-only', '--sweep', 'PERCORE_BATCH_SIZE=1,64',
                             '--json'], capsys)
  assert code == 0, err
  small, large = (r['memory_total_bytes'] for r in json.loads(out))
  assert small < large
  limit = (small + large) // 2
  code, out, err = pax_main(['bench', 'mfu', *TINY_BENCH, '--steps', '1', '--warmup', '0', '--sweep',
                             'PERCORE_BATCH_SIZE=64,1', '--device-memory', str(limit), '--json'], capsys)
  assert code == 0, err
  too_big, ok = json.loads(out)
  assert too_big['status'] == 'out of memory' and too_big['fits'] is False
  assert too_big['memory_total_bytes'] == large and too_big['device_memory_bytes'] == limit
  assert 'needs' in too_big['error'] and '--device-memory' in too_big['error']
  assert 'step_seconds_median' not in too_big and 'mfu' not in too_big
  assert ok['status'] == 'ok' and ok['fits'] and ok['step_seconds_median'] > 0
  code, _, err = pax_main(['bench', 'mfu', *TINY_BENCH, '--device-memory', 'lots'], capsys)
  assert code == 2 and "--device-memory 'lots'" in err


def test_compile_only_on_64_fake_devices_memory_shrinks_with_fsdp():
  # MODEL_DIMS 64: the `embed` axis of every weight divides over the 64-way `data` axis.
  result = run_pax('bench', 'mfu', *TINY_BENCH, '--set', 'MODEL_DIMS=64', '--set', 'NUM_HEADS=4',
                   '--set', 'PERCORE_BATCH_SIZE=1', '--compile-only',
                   '--num-devices', '64', '--sweep', 'ICI_MESH_SHAPE=[64,1,1],[1,64,1]', '--json')
  assert result.returncode == 0, result.stderr
  rows = json.loads(result.stdout)
  assert [r['devices'] for r in rows] == [64, 64]
  replicated, fsdp = rows
  assert fsdp['memory_argument_bytes'] < replicated['memory_argument_bytes'] / 4  # weights + Adam state sharded
  for r in rows:
    assert r['status'] == 'compiled' and r['fits'] is True and 'step_seconds_median' not in r


def test_the_measured_peak_is_kept_per_machine_and_only_rises(tmp_path, monkeypatch):
  from paxcli.perf import flops
  monkeypatch.setenv('PAXCLI_CACHE', str(tmp_path))
  flops.measured_peak.cache_clear()
  one = flops.measured_peak('float32', 1, 128, seconds=0.1)
  flops.measured_peak.cache_clear()
  two = flops.measured_peak('float32', 2, 128, seconds=0.1)   # shared by 2 devices: half the host's each
  (key, entry), = json.loads((tmp_path / flops.PEAKS_FILE).read_text()).items()
  assert entry['runs'] == 2 and entry['tflops'] >= one.tflops and two.tflops == pytest.approx(entry['tflops'] / 2)
  assert 'the best of 2 run(s) on this machine' in two.source and key.endswith('|float32|128')
  flops.measured_peak.cache_clear()


@pytest.mark.slow   # two `pax bench mfu` runs
def test_a_measured_peak_is_the_best_this_machine_has_measured_and_a_damaged_record_is_measured_anew(
    tmp_path, monkeypatch, capsys):
  """CPU MFU swung 26-67% between identical runs on a busy machine, each run measuring its own peak (issue 38,
  item 10): the peak is the best any run here measured (kept under PAXCLI_CACHE), so one run's busy
  measurement no longer moves the MFU of the next; the line says how many runs and this run's noise."""
  from paxcli.perf import flops
  monkeypatch.setenv('PAXCLI_CACHE', str(tmp_path))
  args = ['bench', 'mfu', *TINY_BENCH, '--steps', '2', '--warmup', '1', '--json']
  flops.measured_peak.cache_clear()
  code, out, err = pax_main(args, capsys)
  assert code == 0, err
  first = json.loads(out)[0]
  path = tmp_path / flops.PEAKS_FILE
  (key, entry), = json.loads(path.read_text()).items()
  assert entry['runs'] == 1 and key.endswith('|1024') and 'cores|' in key   # the model's dtype, the matrix size
  # a faster run recorded on this machine before: the peak is its figure, whatever this run measures
  path.write_text(json.dumps({key: {'tflops': entry['tflops'] * 3, 'runs': 5}}))
  flops.measured_peak.cache_clear()
  code, out, err = pax_main(args, capsys)
  second = json.loads(out)[0]
  assert code == 0 and second['peak_tflops'] == pytest.approx(3 * entry['tflops'] / 8, rel=1e-6)   # 8 fake devices
  assert 'the best of 6 run(s) on this machine' in second['peak_source'] and 'median' in second['peak_source']
  assert second['mfu'] == pytest.approx(second['model_tflops_per_device'] / second['peak_tflops'])
  assert first['peak_measured']
  path.write_text('{not json')   # damaged: measured anew, the run goes on
  flops.measured_peak.cache_clear()
  assert 'the best of 1 run(s)' in flops.measured_peak('float32', 1, 128).source
  flops.measured_peak.cache_clear()
