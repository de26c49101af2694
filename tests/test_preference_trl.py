"""Preference tuning certified against TRL (issue 41, part 1): for a Llama built by transformers (tiny, CPU,
float32) imported with `pax checkpoint convert --from hf`, and the same batch of pairs, paxcli's train step
(its loss, the reward metrics TRL logs and the gradients) equals TRL's own trainers on the same weights:
DPOTrainer._compute_loss (sigmoid, robust with label smoothing, hinge, IPO) with a reference model of other
weights, CPOTrainer.get_batch_loss_metrics (SimPO) and ORPOTrainer.get_batch_loss_metrics (ORPO), within 1e-5
relative. Conservative DPO (sigmoid with label smoothing), which TRL 1.16's DPOTrainer no longer has, is held
to CPOTrainer.cpo_loss on the log-ratios TRL's DPOTrainer.compute_ref_log_probs gives."""

import json

import jax
import numpy as np
import pytest

import hf_models
from paxcli import api
from paxcli.jobdir import restore
from paxcli.layers.base import NON_TRAINABLE
from paxcli.loops import reference
from paxcli.loops.train import _fresh_state, step_gradients
from paxcli.models import registry
from paxcli.models.lm import flat_view
from paxcli.models.preference import COPY
from paxcli.models.weight_map import WeightMap
from paxcli.recipes import finetune, posttrain
from paxcli.runtime import engine, infeed, sharding
from paxcli.runtime.sharding import to_global
from paxcli.convert.certify import base_weights

torch = pytest.importorskip('torch')
trl = pytest.importorskip('trl')

PAIRS = 8
SEQ = 32
RTOL = 1e-5


@pytest.fixture(scope='module')
def made(tmp_path_factory):
  """Two tiny Llamas by transformers (the policy, and the reference of other weights), their tokenizer, both
  imported into paxcli job directories, and 8 preference pairs."""
  root = tmp_path_factory.mktemp('preference_trl')
  config = dict(finetune.TINY_CONFIG)
  out = {'root': root, 'config': config}
  for name, seed in (('policy', 0), ('reference', 1)):
    model = hf_models.build(config, seed=seed)
    hf = hf_models.save(model, str(root / f'{name}_hf'))
    finetune.write_tokenizer(hf, [p['prompt'] + p['chosen'] for p in posttrain.example_pairs(100, 0)],
                             config['vocab_size'])
    api.convert_checkpoint(hf, str(root / name), fmt='hf', verify=False)
    out[name], out[f'{name}_hf'] = model, hf
  prefs = root / 'prefs.jsonl'
  prefs.write_text(''.join(json.dumps(p) + '\n' for p in posttrain.example_pairs(PAIRS, 3)))
  out['prefs'] = str(prefs)
  return out


def _ours(made, *sets):
  """(loss, metrics, HF-named gradients, the batch) of paxcli's train step on the first batch of the pairs,
  the reference's params in the train state's copy."""
  resolved = api.resolve('posttrain.Dpo', [f'BASE={made["root"] / "policy"}', f'TRAIN_DATA={made["prefs"]}',
                                           f'MAX_SEQ_LEN={SEQ}', f'PERCORE_BATCH_SIZE={PAIRS}', *sets])
  setup = engine.build(resolved, mesh=sharding.make_mesh([1, 1, 1], devices=jax.devices()[:1]))   # compiles fastest
  base = restore.base_ref(str(made['root'] / 'policy'))
  if setup.model.lora['rank']:   # the frozen base, and the adapters LORA_INIT names
    state = _fresh_state(setup, base, 0, lambda _: None)
  else:                          # the base's params alone: what the step reads (no optimizer state, no init)
    state = {'step': jax.numpy.zeros([], jax.numpy.int32), 'params': restore.base_params(setup, base, False)}
  inp = infeed.build_input(resolved.train_dataset(), setup)
  if NON_TRAINABLE in setup.state_shardings or reference.asking([inp]):   # the reference: the other model's weights
    ref = restore.base_params(setup, restore.base_ref(str(made['root'] / 'reference')), False)
    if reference.asking([inp]):   # REFERENCE='precomputed': its log-probabilities, as pax train computes them
      inp.set_reference(reference.compute(setup, ref, inp), 'the test')
    else:                         # the stored copy
      state[NON_TRAINABLE] = {COPY: {'params': ref, 'ready': jax.numpy.ones([], jax.numpy.int32)}}
  batch = inp.get_next()
  done = jax.jit(step_gradients(setup, 0))(state, to_global(batch, sharding.batch_sharding(setup.mesh),
                                                                 setup.global_batch))
  metrics = {k: float(v) for k, (v, _) in done.metrics.items()}
  _ours.last_grads, _ours.last_setup = jax.device_get(done.grads), setup
  hf = None if setup.model.lora['rank'] else _hf_names(setup.model, done.grads)
  return float(done.loss), metrics, hf, batch


def _hf_names(model, grads) -> dict:
  view = flat_view(model)
  wmap = WeightMap(registry.by_name('llama').hf_weights(view))
  flat = base_weights(jax.device_get(grads), view.num_layers)
  return {name: wmap.to_hf(name, lambda p: np.asarray(flat[p], np.float32)) for name in wmap.hf_shapes}


def _trl_inputs(batch) -> dict:
  """TRL's DPO batch of ours: [chosen rows; rejected rows], each the full token sequence (the first id, then
  the labels), its attention mask and completion mask (1 on the tokens our weights train)."""
  rows = {'input_ids': [], 'attention_mask': [], 'completion_mask': []}
  for side in ('chosen', 'rejected'):
    ids, labels, weights, segments = (batch[f'{side}_{k}'] for k in ('ids', 'labels', 'weights', 'segment_ids'))
    rows['input_ids'].append(np.concatenate([ids[:, :1], labels], 1))
    rows['attention_mask'].append(np.concatenate([segments[:, :1], segments], 1))
    rows['completion_mask'].append(np.concatenate([np.zeros_like(segments[:, :1]), weights > 0], 1))
  return {k: torch.as_tensor(np.concatenate(v, 0).astype(np.int64)) for k, v in rows.items()}


def _cpo_inputs(batch) -> dict:
  """TRL's CPO/ORPO batch of ours: per side input_ids, attention_mask and labels (-100 off the completion)."""
  out = {}
  for side in ('chosen', 'rejected'):
    ids, labels, weights, segments = (batch[f'{side}_{k}'] for k in ('ids', 'labels', 'weights', 'segment_ids'))
    full = np.concatenate([ids[:, :1], labels], 1)
    trained = np.concatenate([np.zeros_like(weights[:, :1]), weights], 1) > 0
    out[f'{side}_input_ids'] = torch.as_tensor(full.astype(np.int64))
    out[f'{side}_attention_mask'] = torch.as_tensor(np.concatenate([segments[:, :1], segments], 1).astype(np.int64))
    out[f'{side}_labels'] = torch.as_tensor(np.where(trained, full, -100).astype(np.int64))
  return out


def _fresh(made, name: str):
  model = hf_models.load(made[f'{name}_hf'])
  model.train()
  return model


def _dataset(made):
  import datasets
  return datasets.Dataset.from_list([json.loads(line) for line in open(made['prefs'])])


def _tokenizer(made):
  import transformers
  return transformers.AutoTokenizer.from_pretrained(made['policy_hf'])


def _args(cls, tmp_path, **settings):
  return cls(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, max_length=None, **settings)


def _grads(model) -> dict:
  return {n: p.grad.detach().numpy() for n, p in model.named_parameters() if p.grad is not None}


def _close(got, want, what):
  want = np.asarray(want, np.float64)
  np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * max(np.max(np.abs(want)), 1e-12), err_msg=what)


def _check_grads(ours: dict, theirs: dict):
  assert set(theirs) <= set(ours), sorted(set(theirs) - set(ours))
  for name, g in theirs.items():
    _close(ours[name], g, name)
  assert any(np.max(np.abs(g)) > 1e-6 for g in theirs.values())   # a loss whose gradient vanished certifies nothing


# Each case compiles a train step (10-20 s on a shared CPU): DPO's sigmoid is the default suite's, the rest slow.
# 'precomputed': the reference's log-probabilities computed before the steps (paxcli.loops.reference), not a copy.
@pytest.mark.parametrize('loss_type, smoothing, ref', [('sigmoid', 0.0, 'copy')] + [
    pytest.param(kind, eps, ref, marks=pytest.mark.slow) for kind, eps, ref in (
        ('robust', 0.2, 'copy'), ('hinge', 0.0, 'copy'), ('ipo', 0.0, 'copy'), ('sigmoid', 0.0, 'precomputed'),
        ('ipo', 0.0, 'precomputed'))])
def test_dpo_losses_equal_trls_dpo_trainer(made, tmp_path, loss_type, smoothing, ref):
  beta = 0.1
  loss, metrics, grads, batch = _ours(made, f'LOSS_TYPE={loss_type!r}', f'BETA={beta}',
                                      f'LABEL_SMOOTHING={smoothing}', f'REFERENCE={ref!r}')
  policy = _fresh(made, 'policy')
  trainer = trl.DPOTrainer(model=policy, ref_model=_fresh(made, 'reference'), train_dataset=_dataset(made),
                           processing_class=_tokenizer(made),
                           args=_args(trl.DPOConfig, tmp_path, beta=beta, loss_type=[loss_type],
                                      label_smoothing=smoothing))
  trainer.model.train()
  theirs = trainer._compute_loss(trainer.model, _trl_inputs(batch), return_outputs=False)
  theirs.backward()
  logged = {k: v[-1] for k, v in trainer._metrics['train'].items()}
  _close(loss, theirs.item(), 'loss')
  for name in ('rewards/chosen', 'rewards/rejected', 'rewards/margins', 'rewards/accuracies', 'logps/chosen',
               'logps/rejected', 'mean_token_accuracy'):
    _close(metrics[name], logged[name], name)
  _check_grads(grads, _grads(trainer.model))


@pytest.mark.slow
def test_conservative_dpo_equals_trls_cpo_loss_on_trls_log_ratios(made, tmp_path):
  beta, smoothing = 0.1, 0.2
  loss, metrics, _, batch = _ours(made, f'BETA={beta}', f'LABEL_SMOOTHING={smoothing}')
  dpo = trl.DPOTrainer(model=_fresh(made, 'policy'), ref_model=_fresh(made, 'reference'),
                       train_dataset=_dataset(made), processing_class=_tokenizer(made),
                       args=_args(trl.DPOConfig, tmp_path / 'dpo', beta=beta))
  inputs = _trl_inputs(batch)
  policy_c, policy_r = dpo.compute_ref_log_probs(dpo.model, inputs)
  ref_c, ref_r = dpo.compute_ref_log_probs(dpo.ref_model, inputs)   # it reads the model it is given
  from trl.experimental.cpo import CPOConfig, CPOTrainer
  cpo = CPOTrainer(model=_fresh(made, 'policy'), train_dataset=_dataset(made), processing_class=_tokenizer(made),
                   args=_args(CPOConfig, tmp_path / 'cpo', beta=beta, label_smoothing=smoothing, loss_type='sigmoid'))
  losses, chosen, rejected = cpo.cpo_loss(policy_c - ref_c, policy_r - ref_r)
  _close(loss, losses.mean().item(), 'loss')
  _close(metrics['rewards/chosen'], chosen.mean().item(), 'rewards/chosen')
  _close(metrics['rewards/margins'], (chosen - rejected).mean().item(), 'rewards/margins')


@pytest.mark.slow
@pytest.mark.parametrize('loss_type', ['simpo', 'orpo'])
def test_reference_free_losses_equal_trls_cpo_and_orpo_trainers(made, tmp_path, loss_type):
  beta, gamma, alpha = (2.0, 1.0, 0.5) if loss_type == 'simpo' else (0.1, 0.0, 0.0)
  loss, metrics, grads, batch = _ours(made, f'LOSS_TYPE={loss_type!r}', f'BETA={beta}', f'SIMPO_GAMMA={gamma}',
                                      f'CPO_ALPHA={alpha}')
  if loss_type == 'simpo':
    from trl.experimental.cpo import CPOConfig as Config, CPOTrainer as Trainer
    settings = dict(loss_type='simpo', simpo_gamma=gamma, cpo_alpha=alpha)
  else:
    from trl.experimental.orpo import ORPOConfig as Config, ORPOTrainer as Trainer
    settings = {}
  trainer = Trainer(model=_fresh(made, 'policy'), train_dataset=_dataset(made), processing_class=_tokenizer(made),
                    args=_args(Config, tmp_path, beta=beta, **settings))
  trainer.model.train()
  theirs, logged = trainer.get_batch_loss_metrics(trainer.model, _cpo_inputs(batch), 'train')
  theirs.backward()
  _close(loss, theirs.item(), 'loss')
  for name in ('rewards/chosen', 'rewards/rejected', 'rewards/margins', 'rewards/accuracies', 'logps/chosen',
               'logps/rejected', 'nll_loss') + (('log_odds_ratio', 'log_odds_chosen') if loss_type == 'orpo' else ()):
    _close(metrics[name], float(logged[name]), name)
  _check_grads(grads, _grads(trainer.model))


@pytest.mark.slow
def test_lora_dpo_with_adapters_off_equals_trls_dpo_trainer_on_a_peft_model(made, tmp_path):
  """TRL's reference for a new PEFT adapter is the model with its adapters disabled; ours is the same weights with
  every adapter's B at zero. PEFT's adapters (B made non-zero, so that the policy is not its reference) start both:
  ours through LORA_INIT. Our adapter gradients are compared in PEFT's layout by writing PEFT's gradients as an
  adapter and reading it the way LORA_INIT reads one."""
  import peft

  from paxcli.convert import lora as convert_lora
  beta = 0.1
  trainer = trl.DPOTrainer(model=_fresh(made, 'policy'), train_dataset=_dataset(made),
                           processing_class=_tokenizer(made), args=_args(trl.DPOConfig, tmp_path / 'trl', beta=beta),
                           peft_config=peft.LoraConfig(r=4, lora_alpha=16, target_modules=['q_proj', 'v_proj'],
                                                       lora_dropout=0.0, bias='none', task_type='CAUSAL_LM'))
  with torch.no_grad():
    for name, p in trainer.model.named_parameters():
      if 'lora_B' in name:
        p.copy_(0.5 * torch.randn_like(p))
  trainer.model.save_pretrained(str(tmp_path / 'adapter'))
  loss, metrics, _, batch = _ours(made, f'BETA={beta}', 'LORA_RANK=4', 'LORA_ALPHA=16.0',
                                  f'LORA_INIT={tmp_path / "adapter"}')
  trainer.model.train()
  theirs = trainer._compute_loss(trainer.model, _trl_inputs(batch), return_outputs=False)
  theirs.backward()
  logged = {k: v[-1] for k, v in trainer._metrics['train'].items()}
  _close(loss, theirs.item(), 'loss')
  for name in ('rewards/chosen', 'rewards/rejected', 'rewards/margins', 'rewards/accuracies'):
    _close(metrics[name], logged[name], name)
  with torch.no_grad():
    for _, p in trainer.model.named_parameters():
      if p.grad is not None:
        p.copy_(p.grad)
  trainer.model.save_pretrained(str(tmp_path / 'grads'))
  ours = _ours.last_grads
  setup = _ours.last_setup
  want = convert_lora.read_peft(str(tmp_path / 'grads'), setup.model, setup.abstract_state['params'])
  flat_want, flat_ours = (dict(jax.tree_util.tree_flatten_with_path(t)[0]) for t in (want, ours))
  assert flat_want and set(flat_want) == set(flat_ours)
  for path, g in flat_want.items():
    _close(np.asarray(flat_ours[path]), g, jax.tree_util.keystr(path))
