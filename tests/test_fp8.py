"""FP8 projections (#34 item 1): scaling against a NumPy reference, the one warning line on a device without
fp8 units (and the refusal where a step is timed), delayed scaling's state in checkpoints (a resumed run
continues bit-exact), HF export of plain weights read by transformers, and eval/decode/score in either
precision. The 200-step comparison with bf16 is slow."""

import json
import os
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import pax_main, run_pax

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
EXP = 'default.StdlibDocsLm'
TINY = ['NUM_LAYERS=2', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=4', 'VOCAB_SIZE=512', 'MAX_SEQ_LEN=32',
        'PERCORE_BATCH_SIZE=1', 'SAVE_INTERVAL_STEPS=2', 'SUMMARY_INTERVAL_STEPS=2', 'EVAL_INTERVAL_STEPS=0',
        'DECODE_INTERVAL_STEPS=0', 'LEARNING_RATE=0.01', 'FP8=delayed', 'FP8_AMAX_HISTORY=4']
ONE_DEVICE = {'XLA_FLAGS': ''}   # training runs in its own process on one CPU device: a quick compile


def _sets(knobs):
  return [a for k in knobs for a in ('--set', k)]


# ---- scaling against a reference -------------------------------------------------------------------


def _q(x, scale, dtype, limit):
  """x quantized to an fp8 dtype by `scale` and read back as float64: x / scale clipped, rounded by ml_dtypes."""
  return np.clip(np.asarray(x, np.float64) / scale, -limit, limit).astype(np.float32).astype(dtype).astype(np.float64)


def test_current_scaling_matches_a_numpy_reference():
  from paxcli.layers import fp8
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((4, 8, 16)) * 3).astype(np.float32)
  w = (rng.standard_normal((16, 12)) * 0.2).astype(np.float32)
  g = (rng.standard_normal((4, 8, 12)) * 1e-3).astype(np.float32)
  dims = (((2,), (0,)), ((), ()))
  out, vjp = jax.vjp(lambda a, b: fp8.current_scaled_dot_general(a, b, dims), jnp.asarray(x), jnp.asarray(w))
  dx, dw = vjp(jnp.asarray(g))
  # reference: scale = amax / the dtype's largest value; product of the fp8 values times both scales
  sx, sw, sg = np.abs(x).max() / E4M3_MAX, np.abs(w).max() / E4M3_MAX, np.abs(g).max() / E5M2_MAX
  qx, qw = _q(x, sx, ml_dtypes.float8_e4m3fn, E4M3_MAX), _q(w, sw, ml_dtypes.float8_e4m3fn, E4M3_MAX)
  qg = _q(g, sg, ml_dtypes.float8_e5m2, E5M2_MAX)
  np.testing.assert_allclose(out, np.einsum('bld,dk->blk', qx, qw) * sx * sw, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dx, np.einsum('blk,dk->bld', qg, qw) * sg * sw, rtol=1e-5, atol=1e-9)
  np.testing.assert_allclose(dw, np.einsum('blk,bld->dk', qg, qx) * sg * sx, rtol=1e-5, atol=1e-9)
  # fp8 numerics, not float32's: the products differ from the exact ones by e4m3's rounding (~2^-4)
  exact = x @ w
  assert 1e-3 < np.abs(np.asarray(out) - exact).max() / np.abs(exact).max() < 0.1
  # an all-zero tensor keeps scale 1 (nothing to divide by)
  assert float(fp8.scale_of(jnp.zeros(3), fp8.E4M3)[0]) == 1.0


def test_delayed_scaling_follows_its_amax_history():
  """flax's delayed scaling, as the projections use it: step t quantizes by max(amax history before t) /
  448 and then pushes this step's amax into the history; the train step carries the state on."""
  from paxcli.layers import fp8
  dense = nn.Dense(6, use_bias=False, dot_general_cls=fp8.dot_general_cls('delayed', amax_history=3))
  rng = np.random.default_rng(1)
  variables = dense.init(jax.random.key(0), jnp.ones((2, 5)))
  state, params = variables[fp8.FP8_STATE], variables['params']
  w = np.asarray(params['kernel'], np.float64)
  history, scale = np.zeros(3), 1.0   # the input's
  w_history, w_scale = np.zeros(3), 1.0

  def step(params, state, x):
    def loss(p, s):
      return jnp.sum(dense.apply({'params': p, fp8.FP8_STATE: s}, x) ** 2) * 1e-3, dense.apply(
          {'params': p, fp8.FP8_STATE: s}, x)
    (_, y), (_, new_state) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, state)
    return y, new_state

  step = jax.jit(step)
  for t, magnitude in enumerate([2.0, 30.0, 0.5, 0.5]):
    x = (rng.standard_normal((2, 5)) * magnitude).astype(np.float32)
    y, state = step(params, state, jnp.asarray(x))
    cell = next(iter(state.values()))
    # the reference: new scale from the history so far, then this step's amax joins it
    scale = history.max() / E4M3_MAX if history.max() > 0 else scale
    w_scale = w_history.max() / E4M3_MAX if w_history.max() > 0 else w_scale
    history = np.roll(history, -1)
    history[0] = np.abs(x).max()
    w_history = np.roll(w_history, -1)
    w_history[0] = np.abs(w).max()
    np.testing.assert_allclose(cell['input_amax_history'], history, rtol=1e-6, err_msg=f'step {t}')
    np.testing.assert_allclose(cell['input_scale'], [scale], rtol=1e-6, err_msg=f'step {t}')
    np.testing.assert_allclose(cell['kernel_scale'], [w_scale], rtol=1e-6, err_msg=f'step {t}')
    expected = (_q(x, scale, ml_dtypes.float8_e4m3fn, E4M3_MAX) @ _q(w, w_scale, ml_dtypes.float8_e4m3fn, E4M3_MAX)
                * scale * w_scale)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6, err_msg=f'step {t}')
  # step 1's large input was quantized by a scale from step 0's small one (clipped at 448 x that scale);
  # step 3 (small again) still by the large one, within the last 3 steps
  assert history.max() > 10 and scale == pytest.approx(history.max() / E4M3_MAX)


# ---- through the commands ------------------------------------------------------------------------


def _arrays(path):
  from paxcli.convert import formats
  src = formats.open_source(path)
  return {a.name: np.asarray(src.read(a.name)) for a in src.arrays()}


@pytest.fixture(scope='module')
def fp8_job(tmp_path_factory):
  """A tiny FP8=delayed run of 4 steps (checkpoints at 2 and 4) and the stderr of its training."""
  job = str(tmp_path_factory.mktemp('fp8') / 'job')
  done = run_pax('train', '--exp', EXP, *_sets(TINY + ['NUM_TRAIN_STEPS=4']), '--job-log-dir', job, env=ONE_DEVICE)
  assert done.returncode == 0, done.stderr[-3000:]
  return job, done.stderr


def test_training_on_a_cpu_warns_once_that_fp8_is_emulated(fp8_job):
  _, err = fp8_job
  lines = [line for line in err.splitlines() if 'FP8=' in line]
  assert len(lines) == 1 and lines[0].startswith('warning: FP8=delayed on cpu') and 'emulated' in lines[0], err


def test_bench_mfu_refuses_to_time_emulated_fp8_in_one_line(capsys):
  code, out, err = pax_main(['bench', 'mfu', '--exp', EXP, *_sets(TINY), '--steps', '1'], capsys)
  assert code == 2 and 'Traceback' not in err
  lines = err.strip().splitlines()
  assert len(lines) == 1 and 'no fp8 matmul units' in lines[0] and '--compile-only' in lines[0], err


def test_checkpoints_hold_the_scaling_state_and_a_resumed_run_continues_bit_exact(fp8_job, tmp_path):
  job, _ = fp8_job
  whole = _arrays(job)
  histories = {k: v for k, v in whole.items() if k.startswith('fp8/') and k.endswith('input_amax_history')}
  assert len(histories) == 2 * 7   # q, k, v, out and the MLP's three per layer
  assert all(np.count_nonzero(h) == 4 for h in histories.values())   # 4 steps of history, length 4
  # the run stopped after its checkpoint at step 2 (a copy without step 4's), then the same command again
  resumed = str(tmp_path / 'job')
  shutil.copytree(job, resumed)
  shutil.rmtree(os.path.join(resumed, 'checkpoints', '4'))
  done = run_pax('train', '--exp', EXP, *_sets(TINY + ['NUM_TRAIN_STEPS=4']), '--job-log-dir', resumed, env=ONE_DEVICE)
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'Resumed from step 2' in done.stdout, done.stdout[-2000:]
  again = _arrays(resumed)
  assert sorted(again) == sorted(whole)
  for name in whole:
    np.testing.assert_array_equal(again[name], whole[name], err_msg=name)


@pytest.mark.slow   # a certified conversion and transformers' import: over a minute here
def test_hf_export_writes_the_plain_weights_and_transformers_reads_them(fp8_job, tmp_path, capsys):
  import torch
  import transformers

  from paxcli import config
  from paxcli.convert import core, formats
  job, _ = fp8_job
  hf = str(tmp_path / 'hf')
  code, out, err = pax_main(['checkpoint', 'convert', job, hf, '--to', 'hf', '--json'], capsys)
  assert code == 0, err
  from safetensors.numpy import load_file
  weights = load_file(os.path.join(hf, 'model.safetensors'))
  assert all(w.dtype == np.float32 for w in weights.values()) and not any('fp8' in k or 'scale' in k for k in weights)
  saved = _arrays(job)
  np.testing.assert_array_equal(weights['model.layers.1.mlp.down_proj.weight'],
                                saved['params/layer_1/mlp/wo/kernel'].T)
  model = transformers.AutoModelForCausalLM.from_pretrained(hf)
  ids = np.random.default_rng(0).integers(0, 512, (2, 16)).astype(np.int32)
  with torch.no_grad():
    theirs = model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
  plain = core.build_model(config.resolve(EXP, TINY + ['FP8=none']))
  params = core.load_params(formats.open_source(job), [n for n in plain.abstract if n.startswith('params/')])
  np.testing.assert_allclose(core.logits(plain.module, params, ids), theirs, atol=2e-4, rtol=1e-4)
  # the run's own fp8 forward is close to it, not equal: the export is not of fp8-rounded weights
  fp8_logits = core.logits(core.build_model(config.resolve(EXP, TINY)).module, params, ids)
  assert 1e-3 < np.abs(fp8_logits - theirs).max() < 0.5 * np.abs(theirs).max()


@pytest.mark.slow   # seven commands, each compiling
def test_eval_decode_and_score_run_in_plain_or_fp8_precision_by_choice(fp8_job, tmp_path, capsys):
  job, _ = fp8_job
  base = ['--exp', EXP, *_sets(TINY), '--job-log-dir', job]
  requests = tmp_path / 'r.jsonl'
  requests.write_text('{"context_ids": [5, 6, 7, 8], "continuation_ids": [9, 10, 11]}\n')
  scores = {}
  for choice in (['--set', 'FP8=none', '--dtype', 'bfloat16'], ['--set', 'FP8=none'], ['--set', 'FP8=delayed']):
    code, out, err = pax_main(['score', str(requests), *base, *choice, '--json', '-o', str(tmp_path / 'o.jsonl'),
                               '--force'], capsys)
    assert code == 0, err
    scores[' '.join(choice)] = json.loads(out.splitlines()[0])['token_logprobs']
    assert ('emulated' in err) == ('FP8=delayed' in choice), err
    if choice[1] == 'FP8=none' and len(choice) == 2:
      continue   # decode and eval: bf16 and fp8 suffice
    code, out, err = pax_main(['decode', *base, *choice, '--prompt-ids', '5,6,7', '--max-decode-steps', '3',
                               '-o', str(tmp_path / 'd.jsonl'), '--force'], capsys)
    assert code == 0, err
    code, out, err = pax_main(['eval', *base, *choice[:2], '--json'], capsys)
    assert code == 0 and json.loads(out)['step'] == 4, err
  plain, fp8_scores = np.array(scores['--set FP8=none']), np.array(scores['--set FP8=delayed'])
  assert not np.array_equal(plain, fp8_scores)   # fp8's products, not float32's ...
  np.testing.assert_allclose(fp8_scores, plain, rtol=0.1)   # ... of the same weights
  np.testing.assert_allclose(scores['--set FP8=none --dtype bfloat16'], plain, rtol=0.05)


# ---- the default model, 200 steps ----------------------------------------------------------------

# The fp8 run's final loss (the mean of its last two summaries) is within this fraction of bf16's.
FP8_LOSS_MARGIN = 0.01


@pytest.mark.slow
def test_fp8_trains_the_default_model_200_steps_within_one_percent_of_bf16(tmp_path):
  """The built-in default experiment's model (4 layers, d256, vocab 2048) at its 200 steps, bf16 and
  bf16 + FP8=delayed, on one CPU device; PERCORE_BATCH_SIZE 4 (the default 16 takes 15 minutes a run here)."""
  losses = {}
  for mode in ('none', 'delayed'):
    job = str(tmp_path / mode)
    done = run_pax('train', *_sets(['FPROP_DTYPE=bfloat16', f'FP8={mode}', 'PERCORE_BATCH_SIZE=4',
                                    'SAVE_INTERVAL_STEPS=1000', 'DECODE_INTERVAL_STEPS=0', 'EVAL_INTERVAL_STEPS=0']),
                   '--job-log-dir', job, env=ONE_DEVICE, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in open(os.path.join(job, 'train_metrics.jsonl'))]
    assert records[-1]['step'] == 200
    losses[mode] = np.mean([r['loss'] for r in records[-2:]])
  assert losses['delayed'] < 0.8 * np.log(2048)   # it learned
  assert abs(losses['delayed'] - losses['none']) <= FP8_LOSS_MARGIN * losses['none'], losses
