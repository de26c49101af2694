"""GRPO's loss on a decoder-only LM, with TRL's formulas, normalisations and metric names (trl.GRPOTrainer;
tests/test_grpo_trl.py holds each normalisation to TRL's own compute_loss on the same rollouts).

A batch is one rollout batch (paxcli.loops.rollout makes it), one sampled completion a row:

  ids, labels, weights, segment_ids   [B, L]  prompt then completion from position 0; weights 1 where the label
                                              is a completion token
  advantages                          [B]     the completion's reward less its group's mean (over the std)
  old_logps                           [B, L]  the sampling policy's per-token log-probabilities (NUM_ITERATIONS > 1:
                                              several optimisation steps per rollout batch)
  ref_logps                           [B, L]  the reference's (BETA > 0)
  stat/<name>                         [B]     rollout metrics (reward, reward_std, ...), reported as <name>

Per token, with the ratio r = exp(logp - old_logp) and the advantage A:
  loss_t = -min(r A, clip(r, 1 - EPSILON, 1 + EPSILON_HIGH) A) + BETA r (exp(ref - logp) - (ref - logp) - 1)
(the KL term times r, with r's gradient: TRL's use_bias_correction_kl, on by default, which makes the KL's
gradient the unbiased reverse KL's; KL_BIAS_CORRECTION=False leaves r out)
and the batch's loss by LOSS_TYPE:
  grpo      the mean over sequences of each one's token mean
  bnpo      the mean over the batch's completion tokens
  dr_grpo   the sum over B x MAX_COMPLETION_LENGTH
  dapo      the sum over the rollout batch's completion tokens (TRL's default)
A step here is one optimizer update over the whole global batch, which is one rollout batch (TRL with
steps_per_generation = gradient_accumulation_steps, its default), so bnpo and dapo give the same number; TRL's
differ only where it splits a batch over devices or accumulation steps. Log-probabilities are at the sampling
temperature, as TRL scores them. Each loss is a mean over its weight (rows or tokens), so GRAD_ACCUM_STEPS
(paxcli.loops.accumulate) gives the whole batch's loss.

Advantages (`group_advantages`) are computed on the host from the rewards, as TRL computes them.
"""

from __future__ import annotations

import typing
from typing import Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np

from paxcli.errors import UserError
from paxcli.models.lm import LanguageModel
from paxcli.models.losses import token_nll

GrpoLossName = Literal['grpo', 'bnpo', 'dr_grpo', 'dapo']
GRPO_LOSSES: tuple[str, ...] = typing.get_args(GrpoLossName)
ScaleRewardsName = Literal['group', 'batch', 'none']
SCALE_REWARDS: tuple[str, ...] = typing.get_args(ScaleRewardsName)
STAT = 'stat/'
# The metrics the log line shows after the loss (all go to TensorBoard, train_metrics.jsonl and the trackers).
LINE_METRICS = ('reward', 'reward_std', 'kl', 'clip_ratio/region_mean', 'completions/mean_length')
STD_EPSILON = 1e-4   # TRL's: advantages are (r - mean) / (std + 1e-4)


class GrpoLm(LanguageModel):
  """A LanguageModel trained on its own sampled completions (module docstring); it decodes, converts and
  exports as one. The sampling settings are the model's: its objective is over its own samples."""
  loss_type: str = 'dapo'
  beta: float = 0.0
  epsilon: float = 0.2
  epsilon_high: Optional[float] = None   # None: EPSILON
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0                         # 0: off
  max_completion_length: int = 64
  num_generations: int = 8
  num_iterations: int = 1                # optimisation steps per rollout batch
  scale_rewards: str = 'group'
  kl_bias_correction: bool = True        # TRL's use_bias_correction_kl: the KL term times the ratio
  stop: tuple = ()                       # stop strings: a completion ends with the first
  line_metrics = LINE_METRICS

  @property
  def eps_high(self) -> float:
    return self.epsilon if self.epsilon_high is None else self.epsilon_high

  @property
  def samples_own_batches(self) -> bool:
    """Read by the train loop: the batches come from this model's own rollouts (paxcli.loops.rollout)."""
    return True

  @property
  def uses_old_logps(self) -> bool:
    """Several steps per rollout batch: the ratio is to the sampling policy, whose log-probabilities the batch
    carries (with one step the policy is the sampler, and the ratio is 1 with its gradient)."""
    return self.num_iterations > 1

  def validate(self) -> None:
    super().validate()
    if self.loss_type not in GRPO_LOSSES:
      raise UserError(f'LOSS_TYPE={self.loss_type!r}: choose one of {", ".join(GRPO_LOSSES)}.')
    if self.scale_rewards not in SCALE_REWARDS:
      raise UserError(f'SCALE_REWARDS={self.scale_rewards!r}: choose one of {", ".join(SCALE_REWARDS)}.')
    if self.beta < 0 or self.epsilon < 0 or self.eps_high < 0:
      raise UserError('BETA, EPSILON and EPSILON_HIGH must not be negative.')
    if not self.temperature > 0:
      raise UserError(f'TEMPERATURE must be positive, got {self.temperature}.')
    if not 0 < self.top_p <= 1:
      raise UserError(f'TOP_P must be in (0, 1], got {self.top_p}.')
    if self.top_k < 0:
      raise UserError(f'TOP_K must be at least 0 (0: off), got {self.top_k}.')
    if self.num_generations < 2:
      raise UserError(f'NUM_GENERATIONS={self.num_generations}: GRPO compares the completions of a prompt with '
                      'one another, so it needs at least 2 per prompt.')
    if self.num_iterations < 1 or self.max_completion_length < 1:
      raise UserError('NUM_ITERATIONS and MAX_COMPLETION_LENGTH must be at least 1.')
    if self.max_completion_length >= self.max_seq_len:
      raise UserError(f'MAX_COMPLETION_LENGTH={self.max_completion_length} leaves no room for a prompt in rows of '
                      f'MAX_SEQ_LEN={self.max_seq_len}; raise MAX_SEQ_LEN or lower MAX_COMPLETION_LENGTH.')
    if '' in tuple(self.stop):
      raise UserError("STOP holds '': every text contains it; give non-empty strings.")

  def compute_predictions(self, input_batch: dict, deterministic: bool = True) -> dict:
    """The per-token log-probability of each label at the sampling temperature [B, L] float32."""
    x, head = self(input_batch['ids'], input_batch.get('segment_ids'), input_batch.get('positions'),
                   deterministic=deterministic, features=True)
    nll, _ = token_nll(x, head.replace(temperature=self.temperature), input_batch['labels'], self.loss_chunk_tokens)
    return {'logp': -nll}

  def compute_loss(self, predictions: dict, input_batch: dict):
    return grpo_loss(self, predictions['logp'], input_batch)

  def dummy_batch(self, batch_size: int, seq_len: int) -> dict:
    shape = (batch_size, seq_len)
    out = {'ids': np.zeros(shape, np.int32), 'labels': np.zeros(shape, np.int32),
           'weights': np.zeros(shape, np.float32), 'segment_ids': np.zeros(shape, np.int32),
           'advantages': np.zeros((batch_size,), np.float32)}
    if self.uses_old_logps:
      out['old_logps'] = np.zeros(shape, np.float32)
    if self.beta:
      out['ref_logps'] = np.zeros(shape, np.float32)
    return out

  def count_in(self, metrics: dict):
    """Tokens a step trained on (prompts and completions), for tokens_per_sec."""
    value, weight = metrics['tokens_per_row']
    return value * weight

  def eval_summary(self, means: dict, weights: dict) -> dict:
    return dict(means)


def grpo_loss(model: GrpoLm, logp, batch: dict):
  """(loss, metrics) of a batch of completions, as TRL's GRPOTrainer._compute_loss computes them."""
  mask = batch['weights'].astype(jnp.float32)
  rows = jnp.float32(mask.shape[0])
  adv = batch['advantages'].astype(jnp.float32)[:, None]
  old = batch['old_logps'] if 'old_logps' in batch else jax.lax.stop_gradient(logp)
  ratio = jnp.exp(logp - old)
  clipped = jnp.clip(ratio, 1 - model.epsilon, 1 + model.eps_high)
  per_token = -jnp.minimum(ratio * adv, clipped * adv)
  if model.beta:
    d = batch['ref_logps'] - logp
    kl = jnp.exp(d) - d - 1
    if model.kl_bias_correction:   # the ratio (with its gradient, 1 in value on-policy) makes it unbiased
      kl = kl * ratio
    per_token = per_token + model.beta * kl
  seq_tokens = jnp.sum(mask, -1)
  tokens = jnp.sum(seq_tokens)
  masked_sum = jnp.sum(per_token * mask)
  if model.loss_type == 'grpo':
    loss, weight = jnp.mean(jnp.sum(per_token * mask, -1) / jnp.maximum(seq_tokens, 1.0)), rows
  elif model.loss_type == 'dr_grpo':
    loss, weight = masked_sum / (rows * model.max_completion_length), rows
  else:   # bnpo, dapo: over the batch's completion tokens
    loss, weight = masked_sum / jnp.maximum(tokens, 1.0), tokens
  metrics = {'loss': (loss, weight), **_clip_metrics(model, ratio, adv, mask),
             'tokens_per_row': (jnp.sum(batch['segment_ids'] > 0) / rows, rows)}
  if model.beta:
    metrics['kl'] = (jax.lax.stop_gradient(jnp.sum(kl * mask) / jnp.maximum(tokens, 1.0)), tokens)
  for key, value in batch.items():
    if key.startswith(STAT):
      metrics[key[len(STAT):]] = (jnp.mean(value.astype(jnp.float32)), rows)
  return loss, metrics


def _clip_metrics(model: GrpoLm, ratio, adv, mask) -> dict:
  """TRL's clip_ratio/* metrics: the share of completion tokens whose ratio the clip holds, over the batch's
  tokens (low, high, either), and the lowest and highest share of one sequence. (Under GRAD_ACCUM_STEPS the
  last two are the means of the microbatches' own.)"""
  ratio = jax.lax.stop_gradient(ratio)
  tokens = jnp.maximum(jnp.sum(mask), 1.0)
  seq_tokens = jnp.maximum(jnp.sum(mask, -1), 1.0)
  low = ((ratio < 1 - model.epsilon) & (adv < 0)).astype(jnp.float32)
  high = ((ratio > 1 + model.eps_high) & (adv > 0)).astype(jnp.float32)
  region = jnp.maximum(low, high)
  whole = lambda x: (jnp.sum(x * mask) / tokens, jnp.sum(mask))
  rows = jnp.float32(mask.shape[0])
  return {'clip_ratio/low_mean': whole(low), 'clip_ratio/high_mean': whole(high),
          'clip_ratio/region_mean': whole(region),
          'clip_ratio/low_min': (jnp.min(jnp.sum(low * mask, -1) / seq_tokens), rows),
          'clip_ratio/high_max': (jnp.max(jnp.sum(high * mask, -1) / seq_tokens), rows)}


def group_advantages(rewards: np.ndarray, group: int, scale: str) -> tuple[np.ndarray, np.ndarray]:
  """(advantages [N], whether the std used is 0 [N]) of rewards [N] in groups of `group` consecutive
  completions, as TRL computes them: NaN rewards (no function scored the completion) are left out of the
  means and get advantage 0; std is the unbiased one (TRL's nanstd), of the group ('group'), of the whole
  batch ('batch'), or only reported ('none')."""
  r = np.asarray(rewards, np.float32)
  grouped = r.reshape(-1, group)
  mean = np.repeat(nanmean(grouped, axis=1), group)
  if scale == 'batch':
    std = np.full_like(r, nanstd(r))
  else:
    std = np.repeat(nanstd(grouped, axis=1), group).astype(np.float32)
  adv = r - mean
  if scale != 'none':
    adv = adv / (std + np.float32(STD_EPSILON))
  return np.nan_to_num(adv, nan=0.0).astype(np.float32), np.isclose(std, 0.0)


def nanmean(x: np.ndarray, axis=None):
  count = np.sum(~np.isnan(x), axis=axis)
  return (np.nansum(x, axis=axis) / np.maximum(count, 1)).astype(np.float32)


def nanstd(x: np.ndarray, axis=None):
  """TRL's nanstd: sqrt(nanmean((x - nanmean(x))^2) * n / (n - 1)) over the non-NaN values."""
  mean = nanmean(x, axis=axis)
  centred = x - (np.expand_dims(mean, axis) if axis is not None else mean)
  count = np.sum(~np.isnan(x), axis=axis)
  var = np.nansum(centred * centred, axis=axis) / np.maximum(count, 1)
  with np.errstate(divide='ignore', invalid='ignore'):
    var = np.where(count > 1, var * count / (count - 1), np.nan)
  return np.sqrt(var).astype(np.float32)
