"""GRPO certified against TRL's own GRPOTrainer: the same prompts, completions, rewards and old log-probabilities
give the same advantages, loss, metrics and gradients, for each loss normalisation TRL offers.

The model is built once by paxcli (a tiny Llama, float32) and handed to transformers through the family's
weight map (convert.certify.hf_model, as the conversion certificates are); TRL generates the rollout batch
with transformers' generate and its own _generate_and_score_completions (rewards from the same Python
function paxcli calls), and computes its loss with its own compute_loss on a real GRPOTrainer. paxcli takes
that very batch through its rollout layout (loops.rollout.layout_rows) and its train step's gradient
(loops.train.step_gradients); each gradient is mapped to transformers' names and compared.
"""

import dataclasses

import jax
import numpy as np
import pytest

torch = pytest.importorskip('torch')
trl = pytest.importorskip('trl')
transformers = pytest.importorskip('transformers')
datasets = pytest.importorskip('datasets')

from paxcli import config
from paxcli.convert import certify
from paxcli.convert import hf as convert_hf
from paxcli.loops import rollout
from paxcli.loops import train as train_loop
from paxcli.models import grpo
from paxcli.models.lm import flat_view
from paxcli.models.weight_map import WeightMap
from paxcli.recipes import grpo as grpo_recipe
from paxcli.runtime import engine, sharding

G, PROMPTS, COMPLETION, TEMPERATURE = 4, 2, 8, 0.7
KNOBS = ['NUM_LAYERS=2', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=4', 'NUM_KV_HEADS=2', 'DIMS_PER_HEAD=8',
         'VOCAB_SIZE=26', 'MAX_SEQ_LEN=32', 'PERCORE_BATCH_SIZE=1', f'NUM_GENERATIONS={G}',
         f'MAX_COMPLETION_LENGTH={COMPLETION}', f'TEMPERATURE={TEMPERATURE}', 'EPSILON_HIGH=0.28']
PROMPT_TEXTS = ['three plus four is <answer>', 'one plus one plus two plus nine is <answer>']


def length_reward(completions, completion_ids, **kwargs):
  """A deterministic reward with ties and spread: the completion's length mod 3, None for an empty one."""
  del completions, kwargs
  return [float(len(ids) % 3) if ids else None for ids in completion_ids]


@pytest.fixture(scope='module')
def made(tmp_path_factory):
  """paxcli's setup and initial state, transformers' model of the same weights, and TRL's rollout batch."""
  tmp = tmp_path_factory.mktemp('grpo_trl')
  files = grpo_recipe.write_example(str(tmp), n=8)
  resolved = config.resolve('grpo.GrpoAddition', KNOBS + [f'TRAIN_DATA={files["prompts"]}',
                                                         f'TOKENIZER={files["tokenizer"]}'])
  setup = engine.build(resolved)
  state = engine.init_state(setup, 0)
  view = flat_view(setup.model)
  family = convert_hf.family_of(view)
  weights = certify.base_weights(jax.device_get(state['params']), view.num_layers)
  # Saved and loaded back, so that TRL finds the reference model (BETA > 0) where config.json says the model is.
  certify.hf_model(family, view, weights).save_pretrained(str(tmp / 'hf'))
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp / 'hf'), dtype=torch.float32,
                                                               attn_implementation='eager')
  tok = transformers.PreTrainedTokenizerFast(tokenizer_file=files['tokenizer'], bos_token='<bos>', eos_token='<eos>',
                                             pad_token='<pad>')
  trainer = _trainer(hf_model, tok, tmp, 'dapo', beta=0.04, iterations=2)
  records = [{'prompt': p} for p in PROMPT_TEXTS for _ in range(G)]
  torch.manual_seed(1)
  out = trainer._generate_and_score_completions(records)
  return dict(setup=setup, state=state, hf_model=hf_model, tok=tok, tmp=tmp, out=out, family=family, view=view,
              trainer=trainer)


def _trainer(model, tok, tmp, loss_type: str, beta: float, iterations: int, kl_correction: bool = True,
             scale_rewards: str = 'group'):
  args = trl.GRPOConfig(output_dir=str(tmp / f'trl-{loss_type}-{beta}-{iterations}-{kl_correction}-{scale_rewards}'),
                        per_device_train_batch_size=G * PROMPTS, use_bias_correction_kl=kl_correction,
                        scale_rewards=scale_rewards,
                        num_generations=G, max_completion_length=COMPLETION, temperature=TEMPERATURE,
                        loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28, num_iterations=iterations,
                        report_to='none', use_cpu=True, bf16=False, seed=0, logging_steps=1)
  trainer = trl.GRPOTrainer(model=model, reward_funcs=[length_reward], args=args, processing_class=tok,
                            train_dataset=datasets.Dataset.from_dict({'prompt': PROMPT_TEXTS}))
  trainer.model.train()
  trainer.current_gradient_accumulation_steps = 1
  return trainer


def _unpadded(ids, mask) -> list[list[int]]:
  return [[int(t) for t, m in zip(row, keep) if m] for row, keep in zip(ids.tolist(), mask.tolist())]


def _spread(per_completion: np.ndarray, prompts: list, completions: list, length: int) -> np.ndarray:
  """TRL's [B, C] per-token values onto paxcli's rows [B, L] (the label positions of each completion)."""
  out = np.zeros((len(prompts), length), np.float32)
  for r, (p, c) in enumerate(zip(prompts, completions)):
    out[r, len(p) - 1:len(p) - 1 + len(c)] = per_completion[r, :len(c)]
  return out


@pytest.mark.parametrize('scale', ['group'] + [pytest.param(s, marks=pytest.mark.slow) for s in grpo.SCALE_REWARDS
                                                if s != 'group'])
def test_advantages_equal_trls_on_its_own_rollout(made, scale):
  out = made['out']
  if scale != 'group':   # TRL's trainer with that scaling samples and scores its own rollout batch
    trainer = _trainer(made['hf_model'], made['tok'], made['tmp'], 'dapo', 0.0, 1, scale_rewards=scale)
    torch.manual_seed(2)
    out = trainer._generate_and_score_completions([{'prompt': p} for p in PROMPT_TEXTS for _ in range(G)])
  completions = _unpadded(out['completion_ids'], out['completion_mask'])
  rewards = np.array([np.nan if r is None else r for r in length_reward([], completions)], np.float32)
  mine, _ = grpo.group_advantages(rewards, G, scale)
  np.testing.assert_allclose(mine, out['advantages'].numpy(), rtol=1e-6, atol=1e-6)
  assert np.abs(mine).max() > 0.1   # the groups differ: the advantages are not all zero


# (LOSS_TYPE, BETA, NUM_ITERATIONS, KL_BIAS_CORRECTION): every normalisation with the KL term and the ratio to old
# log-probabilities; TRL's default (dapo, no KL, one step a batch); the KL without its bias correction, on-policy.
# The default suite takes every normalisation and TRL's default; the rest run in the slow suite.
CASES = [('grpo', 0.04, 2, True), ('bnpo', 0.04, 2, True), ('dr_grpo', 0.04, 2, True), ('dapo', 0.04, 2, True),
         ('dapo', 0.0, 1, True), pytest.param('grpo', 0.04, 1, False, marks=pytest.mark.slow)]


@pytest.mark.parametrize('loss_type,beta,iterations,kl_correction', CASES)
def test_loss_metrics_and_gradients_equal_trls(made, loss_type, beta, iterations, kl_correction):
  _check_against_trl(made, loss_type, beta, iterations, kl_correction, accumulate=1)


@pytest.mark.slow
@pytest.mark.parametrize('loss_type', ['grpo', 'bnpo', 'dr_grpo'])
def test_gradient_accumulation_gives_trls_whole_batch(made, loss_type):
  """GRAD_ACCUM_STEPS=2: each microbatch's loss is a mean over its weight (rows or tokens), so the step is still
  TRL's over the whole rollout batch."""
  _check_against_trl(made, loss_type, 0.04, 2, True, accumulate=2)


def _check_against_trl(made, loss_type, beta, iterations, kl_correction, accumulate):
  out = dict(made['out'])
  rng = np.random.default_rng(7)
  mask = out['completion_mask'].numpy().astype(np.float32)
  prompts = _unpadded(out['prompt_ids'], out['prompt_mask'])
  completions = _unpadded(out['completion_ids'], out['completion_mask'])
  trainer = _trainer(made['hf_model'], made['tok'], made['tmp'], loss_type, beta, iterations, kl_correction)
  with torch.no_grad():
    ids = torch.cat([out['prompt_ids'], out['completion_ids']], 1)
    att = torch.cat([out['prompt_mask'], out['completion_mask']], 1)
    now, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, out['completion_ids'].size(1))
  now = now.numpy()
  # Old and reference log-probabilities off the current ones, so that the ratio is clipped on both sides.
  old = (now + rng.normal(0, 0.3, now.shape) * mask).astype(np.float32)
  ref = (now + rng.normal(0, 0.3, now.shape) * mask).astype(np.float32)
  inputs = {k: out[k] for k in ('prompt_ids', 'prompt_mask', 'completion_ids', 'completion_mask', 'advantages',
                                'num_items_in_batch')}
  if iterations > 1:
    inputs['old_per_token_logps'] = torch.from_numpy(old)
  if beta:
    inputs['ref_per_token_logps'] = torch.from_numpy(ref)
  trainer.model.zero_grad()
  trl_loss = trainer.compute_loss(trainer.model, inputs)
  trl_loss.backward()
  trl_grads = {n: p.grad.numpy().copy() for n, p in trainer.model.named_parameters() if p.grad is not None}
  trl_metrics = {k: v[-1] for k, v in trainer._metrics['train'].items()}

  setup = made['setup']
  model = setup.model.clone(loss_type=loss_type, beta=beta, num_iterations=iterations,
                            kl_bias_correction=kl_correction)
  setup = dataclasses.replace(setup, model=model,
                              train=dataclasses.replace(setup.train, grad_accum_steps=accumulate))
  batch = rollout.layout_rows(prompts, completions, setup.seq_len)
  batch['advantages'] = out['advantages'].numpy().astype(np.float32)
  if iterations > 1:
    batch['old_logps'] = _spread(old, prompts, completions, setup.seq_len)
  if beta:
    batch['ref_logps'] = _spread(ref, prompts, completions, setup.seq_len)
  batch = sharding.to_global(batch, sharding.batch_sharding(setup.mesh), setup.global_batch)
  done = jax.jit(train_loop.step_gradients(setup, 0))(made['state'], batch)

  np.testing.assert_allclose(float(done.loss), trl_loss.item(), rtol=1e-5, atol=1e-7)
  exact = ('clip_ratio/low_min', 'clip_ratio/high_max') if accumulate == 1 else ()   # microbatches' mean else
  for name in ('clip_ratio/low_mean', 'clip_ratio/high_mean', 'clip_ratio/region_mean') + exact + (
      ('kl',) if beta else ()):
    np.testing.assert_allclose(float(done.metrics[name][0]), trl_metrics[name], rtol=1e-5, atol=1e-6, err_msg=name)
  if iterations > 1:   # the clip held some tokens on each side: the test covers both branches of the min
    assert trl_metrics['clip_ratio/low_mean'] > 0 and trl_metrics['clip_ratio/high_mean'] > 0

  view = made['view']
  wmap = WeightMap(made['family'].hf_weights(view))
  mine = certify.base_weights(jax.device_get(done.grads), view.num_layers)
  scale = max(float(np.abs(g).max()) for g in trl_grads.values())
  assert scale > 0
  for name in wmap.hf_shapes:
    got = wmap.to_hf(name, lambda p: np.asarray(mine[p], np.float32))
    np.testing.assert_allclose(got, trl_grads[name], rtol=1e-5, atol=1e-5 * scale, err_msg=name)
