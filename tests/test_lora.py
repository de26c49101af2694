"""LoRA: adapters on a frozen base from INIT_FROM; checkpoints of adapters naming their base; eval,
decode, merge and PEFT's format. One base and one LoRA run, trained once for the module."""

import json
import os

import numpy as np
import pytest
from rich.console import Console

from conftest import pax_main

EXP = 'lm_cloud.LmCloudSpmdTest'
QUIET = Console(quiet=True)
# A tiny Llama-shaped model (so that --to hf and PEFT's names apply).
LLAMA = ['MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=4', 'NUM_KV_HEADS=2', 'PERCORE_BATCH_SIZE=1', 'MAX_SEQ_LEN=16',
         'VOCAB_SIZE=64', 'NUM_LAYERS=2', 'NORM_TYPE="rmsnorm"', 'USE_GATED_ACTIVATION=True', 'ACTIVATION="silu"',
         'POSITION_EMBEDDING="rotary"', 'USE_BIAS=False', 'SEPARATE_EMBEDDING=True']
TARGETS = 'LORA_TARGETS=("query","value","output","mlp")'


def _lora(base: str, *more: str) -> list:
  return LLAMA + ['LORA_RANK=4', 'LORA_ALPHA=8.0', TARGETS, 'LEARNING_RATE=0.01', f'INIT_FROM={base!r}', *more]


def _sets(overrides):
  return [a for o in overrides for a in ('--set', o)]


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """(work dir, base job, LoRA job): the base trained 2 steps (checkpoints 1 and 2), then LoRA 3 steps on it
  (checkpoints 2 and 3)."""
  import paxcli
  work = tmp_path_factory.mktemp('lora')
  base, tuned = str(work / 'base'), str(work / 'lora')
  paxcli.train(EXP, job_dir=base, overrides=LLAMA + ['NUM_TRAIN_STEPS=2', 'SAVE_INTERVAL_STEPS=1'], console=QUIET)
  paxcli.train(EXP, job_dir=tuned, overrides=_lora(base, 'NUM_TRAIN_STEPS=3', 'SAVE_INTERVAL_STEPS=2'), console=QUIET)
  return work, base, tuned


def _setup_and_params(overrides, job=None):
  """(setup, params on the host) of an experiment: restored from `job`'s latest checkpoint, or fresh."""
  import jax
  from paxcli import config
  from paxcli.jobdir import restore
  from paxcli.loops import train
  from paxcli.runtime import engine
  setup = engine.build(config.resolve(EXP, overrides))
  if job is None:
    ref = restore.base_ref(setup.train.init_from)
    state = train._fresh_state(setup, ref, 0, lambda m: None)
  else:
    state = restore.restore(setup, job, restore.choose_step(job), params_only=True).state
  return setup, jax.tree.map(np.asarray, jax.device_get(state['params']))


def _logits(model, params, ids):
  import jax.numpy as jnp
  return np.asarray(model.apply({'params': params}, jnp.asarray(ids)))


IDS = np.arange(32, dtype=np.int32).reshape(2, 16) % 64


def _flat(params):
  from flax.traverse_util import flatten_dict
  return {'/'.join(k): v for k, v in flatten_dict(params).items()}


def test_fresh_adapters_leave_the_function_alone_and_only_they_train():
  """Engine only (no job directory): the LoRA model with its frozen params is the base model's
  function at step 0; steps change the adapters alone; the optimizer state holds only them."""
  import jax
  from paxcli import config
  from paxcli.loops import train
  from paxcli.runtime import engine
  one_layer = ['NUM_LAYERS=1']   # every target once: the fewest ops to compile and run
  sets = _lora('unused')[:-1] + ['LORA_BASE_DTYPE="bfloat16"'] + one_layer   # no INIT_FROM: random base
  setup, state, step, batch_sharding, batches = train.ready_step(config.resolve(EXP, sets))
  params = jax.tree.map(np.asarray, jax.device_get(state['params']))
  adapters, frozen = engine.split_trainable(setup.model, params)
  assert all(x.dtype == np.dtype('bfloat16') for x in jax.tree.leaves(frozen))   # LORA_BASE_DTYPE
  base = engine.build(config.resolve(EXP, LLAMA + one_layer))
  np.testing.assert_array_equal(_logits(setup.model, params, IDS), _logits(base.model, frozen, IDS))
  size = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree) if x.shape)
  assert size(setup.abstract_state['opt_state']) == 2 * size(adapters) < size(frozen)
  from paxcli.runtime import sharding
  for _ in range(2):
    state, _ = step(state, sharding.to_global(batches.get_next(), batch_sharding, setup.global_batch))
  after = engine.split_trainable(setup.model, jax.tree.map(np.asarray, jax.device_get(state['params'])))
  for name, value in _flat(frozen).items():
    np.testing.assert_array_equal(_flat(after[1])[name], value, err_msg=name)
  assert all(np.abs(v).max() > 0 for k, v in _flat(after[0]).items() if k.endswith('_lora_b'))


@pytest.mark.slow
def test_lora_starts_as_the_base_and_trains_only_its_adapters(runs):
  import jax
  from paxcli import config
  from paxcli.jobdir import restore
  from paxcli.loops import train
  from paxcli.runtime import infeed, sharding
  _, base, _ = runs
  base_setup, base_params = _setup_and_params(LLAMA, base)
  setup, params = _setup_and_params(_lora(base))
  adapters = {k for k in _flat(params) if '_lora_' in k}
  assert len(adapters) == 2 * 2 * 6  # 2 layers x (query, value, out, wi_0, wi_1, wo) x (A, B)
  assert all(not _flat(params)[k].any() for k in adapters if k.endswith('_lora_b'))  # B = 0
  # B = 0: the LoRA model computes the base model's function, bit for bit.
  np.testing.assert_array_equal(_logits(setup.model, params, IDS), _logits(base_setup.model, base_params, IDS))

  # Only the adapters are in the optimizer state (adamw: mu and nu of each, besides scalar counts).
  size = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree) if x.shape)
  adapter_size = sum(_flat(params)[k].size for k in adapters)
  assert size(setup.abstract_state['opt_state']) == 2 * adapter_size
  assert size(base_setup.abstract_state['opt_state']) == 2 * size(base_params)
  assert 2 * adapter_size < size(base_params)

  resolved = config.resolve(EXP, _lora(base))
  state = train._fresh_state(setup, restore.base_ref(setup.train.init_from), 0, lambda m: None)
  batches = infeed.build_input(resolved.train_dataset(), setup)
  batch_sharding = sharding.batch_sharding(setup.mesh)
  step = train.make_train_step(setup, batch_sharding, 1)
  for _ in range(3):
    state, _ = step(state, sharding.to_global(batches.get_next(), batch_sharding, setup.global_batch))
  after = _flat(jax.tree.map(np.asarray, jax.device_get(state['params'])))
  for name, value in _flat(base_params).items():   # the frozen base: bit-identical after the steps
    np.testing.assert_array_equal(after[name], value, err_msg=name)
  assert all(np.abs(after[k]).max() > 0 for k in adapters if k.endswith('_lora_b'))   # B moved off zero


@pytest.mark.slow
def test_checkpoints_hold_the_adapters_and_refuse_another_base(runs, capsys):
  from paxcli.jobdir import restore
  work, base, tuned = runs
  saved = restore.saved_metadata(tuned, 3)
  names = [k for k in _flat(dict(saved['params']))]
  assert names and all('_lora_' in n for n in names)
  meta = restore.read_meta(tuned, 3)
  assert meta['base']['job_dir'] == base and meta['base']['step'] == 2
  # Eval with the base the adapters were not trained on: one line, naming the right one.
  other = os.path.join(base, 'checkpoints', '1')
  code, out, err = pax_main(['eval', '--exp', EXP, *_sets(_lora(other)), '--job-log-dir', tuned], capsys)
  assert code != 0 and 'Traceback' not in err
  assert 'adapters were trained on the base' in err and f'INIT_FROM={os.path.join(base, "checkpoints", "2")}' in err


@pytest.mark.slow
def test_merged_equals_unmerged_and_eval_decode_apply_the_adapters(runs, capsys):
  import paxcli
  work, base, tuned = runs
  merged = str(work / 'merged')
  code, out, err = pax_main(['checkpoint', 'convert', tuned, merged, '--merge-lora'], capsys)
  assert code == 0, err
  lora_setup, lora_params = _setup_and_params(_lora(base), tuned)
  plain_setup, plain_params = _setup_and_params(LLAMA, merged)
  assert not any('_lora_' in k for k in _flat(plain_params))
  want = _logits(lora_setup.model, lora_params, IDS)
  np.testing.assert_allclose(_logits(plain_setup.model, plain_params, IDS), want, atol=1e-5, rtol=0)
  _, base_params = _setup_and_params(LLAMA, base)
  assert np.abs(_logits(plain_setup.model, base_params, IDS) - want).max() > 1e-3   # the adapters matter

  evals = {name: paxcli.evaluate(EXP, job_dir=job, overrides=sets, console=QUIET)['results']['eval']['loss']
           for name, job, sets in (('lora', tuned, _lora(base)), ('merged', merged, LLAMA), ('base', base, LLAMA))}
  assert abs(evals['lora'] - evals['merged']) < 1e-5 and abs(evals['lora'] - evals['base']) > 1e-4
  decoded = {name: paxcli.decode(EXP, job_dir=job, overrides=sets, prompt_ids=['1,2,3', '7'], max_decode_steps=8,
                                 output=str(work / f'{name}.jsonl'), console=QUIET)
             for name, job, sets in (('lora', tuned, _lora(base)), ('merged', merged, LLAMA))}
  assert [r['decoded_ids'] for r in decoded['lora']] == [r['decoded_ids'] for r in decoded['merged']]
  np.testing.assert_allclose([lp for r in decoded['lora'] for lp in r['token_logprobs']],
                             [lp for r in decoded['merged'] for lp in r['token_logprobs']], atol=1e-5)

  hf_dir = str(work / 'hf')
  code, out, err = pax_main(['checkpoint', 'convert', tuned, hf_dir, '--to', 'hf'], capsys)
  assert code == 0, err
  assert 'Certified on ' in ' '.join(err.split()) and ': ok' in err and os.path.isfile(os.path.join(hf_dir, 'config.json'))
  code, out, err = pax_main(['checkpoint', 'convert', tuned, str(work / 'plain')], capsys)
  assert code != 0 and '--merge-lora' in err and 'Traceback' not in err


@pytest.mark.slow
def test_peft_export_loads_back_with_the_same_logits(runs, capsys):
  from paxcli.convert import safetensors_io
  work, base, tuned = runs
  peft = str(work / 'peft')
  code, out, err = pax_main(['checkpoint', 'convert', tuned, peft, '--to', 'peft'], capsys)
  assert code == 0, err
  config = json.load(open(os.path.join(peft, 'adapter_config.json')))
  assert (config['peft_type'], config['r'], config['lora_alpha']) == ('LORA', 4, 8.0)
  assert config['target_modules'] == ['down_proj', 'gate_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']
  arrays = {a.name: a.shape for a in safetensors_io.SafetensorsSource(
      os.path.join(peft, 'adapter_model.safetensors')).arrays()}
  assert arrays['base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight'] == (4, 32)   # [r, in]
  assert arrays['base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight'] == (32, 4)   # [H*E, r]
  assert arrays['base_model.model.model.layers.0.mlp.down_proj.lora_A.weight'] == (4, 64)

  lora_setup, lora_params = _setup_and_params(_lora(base), tuned)
  setup, params = _setup_and_params(_lora(base, f'LORA_INIT={peft!r}'))
  np.testing.assert_allclose(_logits(setup.model, params, IDS), _logits(lora_setup.model, lora_params, IDS),
                             atol=1e-6, rtol=0)


@pytest.mark.slow
def test_a_damaged_base_is_one_line_naming_it_and_no_adapter_checkpoint_is_skipped(runs, capsys):
  """The base every checkpoint of a LoRA run applies to is unreadable: no fallback to the run's older
  checkpoints (they name the same base), nothing set aside; one line naming the base."""
  import shutil
  work, base, tuned = runs
  bad_base, job = str(work / 'base_damaged'), str(work / 'lora_on_damaged')
  shutil.copytree(base, bad_base)
  shutil.copytree(tuned, job)
  for root, _, names in os.walk(os.path.join(bad_base, 'checkpoints', '2', 'state')):
    for name in names if os.path.basename(root) == 'd' else ():
      with open(os.path.join(root, name), 'r+b') as f:
        f.truncate(os.path.getsize(os.path.join(root, name)) // 2)
  steps = sorted(os.listdir(os.path.join(job, 'checkpoints')))
  assert len(steps) >= 2   # an older checkpoint a fallback could have tried
  sets = _lora(os.path.join(bad_base, 'checkpoints', '2'), 'NUM_TRAIN_STEPS=5')
  for command in ('train', 'eval'):
    code, out, err = pax_main([command, '--exp', EXP, *_sets(sets), '--job-log-dir', job], capsys)
    assert code != 0 and 'Traceback' not in err and 'Falling back' not in out + err, (out, err)
    line = [l for l in err.splitlines() if 'base weights' in l]
    assert line and bad_base in line[0] and 'cannot be read' in line[0], err
  assert sorted(os.listdir(os.path.join(job, 'checkpoints'))) == steps
  assert not os.path.exists(os.path.join(job, 'checkpoints_damaged'))


@pytest.mark.slow
def test_lora_on_a_scanned_base_exports_peft_per_layer_and_loads_back(tmp_path, capsys):
  """A base converted scanned (USE_REPEATED_LAYER=True, [layers, ...] stacks): LoRA trains on it,
  PEFT's file has one key per layer (the stack unstacked), and LORA_INIT reads them back restacked."""
  import jax
  import paxcli
  from paxcli import config
  from paxcli.convert import safetensors_io
  from paxcli.recipes import finetune
  from paxcli.runtime import engine
  made = finetune.write_example(str(tmp_path))
  base, job, peft = (str(tmp_path / n) for n in ('llama', 'sft', 'peft'))
  code, _, err = pax_main(['checkpoint', 'convert', '--from', 'hf', made['hf'], base, '--no-verify',
                           '--set', 'USE_REPEATED_LAYER=True'], capsys)
  assert code == 0, err
  sets = [f'BASE={base!r}', f'TRAIN_DATA={made["train"]!r}', 'USE_REPEATED_LAYER=True', 'LORA_RANK=4',
          'LORA_TARGETS=("query","mlp")', 'NUM_TRAIN_STEPS=3', 'EVAL_INTERVAL_STEPS=0']
  paxcli.train('finetune.TinyLlamaSft', job_dir=job, overrides=sets, console=QUIET)
  code, _, err = pax_main(['checkpoint', 'convert', job, peft, '--to', 'peft'], capsys)
  assert code == 0, err
  resolved = config.resolve('finetune.TinyLlamaSft', sets)
  setup = engine.build(resolved)
  from paxcli.jobdir import restore
  params = jax.device_get(restore.restore(setup, job, 3, params_only=True).state['params'])
  stack = params['layers']['attention']
  assert stack['query_lora_a'].shape[0] == 2   # scanned: [layers, ...]
  src = safetensors_io.SafetensorsSource(os.path.join(peft, 'adapter_model.safetensors'))
  names = {a.name for a in src.arrays()}
  assert len(names) == 2 * 4 * 2   # 2 layers x (q_proj, gate, up, down) x (A, B)
  for i in range(2):
    a = src.read(f'base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight')
    np.testing.assert_array_equal(a, np.asarray(stack['query_lora_a'][i]).reshape(-1, 4).T)
  again = engine.build(config.resolve('finetune.TinyLlamaSft', sets + [f'LORA_INIT={peft!r}']))
  from paxcli.loops import train
  fresh = train._fresh_state(again, restore.base_ref(again.train.init_from), 0, lambda m: None)
  got = jax.device_get(fresh['params'])
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    y = dict(jax.tree_util.tree_flatten_with_path(got)[0])[path]
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(x, np.float32), atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_lora_under_pipeline_stages_has_the_unpipelined_loss_and_gradients():
  """NUM_STAGES > 1 runs the same [layers, ...] stacks, adapters included: loss and adapter gradients
  equal the unpipelined model's (B made nonzero, so that A's gradients are not all zero)."""
  import jax
  from paxcli import config
  from paxcli.runtime import engine
  tiny = ['NUM_LAYERS=2', 'MODEL_DIMS=16', 'HIDDEN_DIMS=32', 'NUM_HEADS=2', 'DIMS_PER_HEAD=8', 'VOCAB_SIZE=32',
          'MAX_SEQ_LEN=8', 'USE_REPEATED_LAYER=True', 'PERCORE_BATCH_SIZE=2', 'LORA_RANK=2', TARGETS]
  ref = engine.build(config.resolve(EXP, tiny + ['ICI_MESH_SHAPE=[1,4,2]']))
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: x + 0.1 * rng.standard_normal(x.shape).astype(x.dtype) if p[-1].key.endswith('_lora_b') else x,
      jax.device_get(engine.init_state(ref, 0)['params']))
  tokens = lambda: rng.integers(0, 32, (16, 8)).astype(np.int32)
  batch = {'ids': tokens(), 'labels': tokens(),
           'weights': np.ones((16, 8), np.float32), 'segment_ids': np.ones((16, 8), np.int32),
           'positions': np.tile(np.arange(8, dtype=np.int32), (16, 1))}
  piped = engine.build(config.resolve(EXP, tiny + ['NUM_STAGES=2', 'ICI_MESH_SHAPE=[2,1,2,2]']))
  assert piped.pipeline is not None
  (loss, grads), (loss_p, grads_p) = (_loss_and_adapter_grads(s, params, batch) for s in (ref, piped))
  np.testing.assert_allclose(loss_p, loss, rtol=1e-6)
  assert grads and set(grads) == set(grads_p)
  for name, g in grads.items():
    assert np.abs(g).max() > 0, name
    np.testing.assert_allclose(grads_p[name], g, rtol=1e-4, atol=1e-6, err_msg=name)


def _loss_and_adapter_grads(setup, params, batch):
  """The loss and the gradients of the trainable params (the adapters), as the train step takes them."""
  import jax
  from paxcli.runtime import engine
  params = jax.device_put(params, setup.state_shardings['params'])
  adapters, frozen = engine.split_trainable(setup.model, params)

  def loss(trainable):
    with setup.activation_sharding():
      value, _ = setup.model.apply({'params': engine.join_params(trainable, frozen)}, batch, method='fprop')
    return value
  value, grads = jax.jit(jax.value_and_grad(loss))(adapters)
  return np.asarray(value), _flat(jax.device_get(grads))
