"""GRPO's loss on a decoder-only LM, with TRL's formulas, normalisations and metric names (trl.GRPOTrainer;
tests/test_posttrain_trl.py holds each normalisation to TRL's own compute_loss on the same rollouts).

A batch is a slice of a rollout batch (paxcli.loops.rollout makes them), one sampled completion a row:

  ids, labels, weights, segment_ids   [B, L]  prompt then completion; weights 1 on the completion's tokens
  advantages                          [B]     the completion's reward less its group's mean (over the std)
  old_logps                           [B, L]  the sampling policy's log-probabilities (when it is not this one:
                                              several optimisation steps per rollout batch)
  ref_logps                           [B, L]  the reference's (BETA > 0)
  generation_tokens                   [B]     completion tokens of the whole rollout batch per step (dapo)
  stat/<name>                         [B]     rollout metrics (reward, reward_std, ...), reported as <name>

Per token, with the ratio r = exp(logp - old_logp) and the advantage A:
  loss_t = -min(r A, clip(r, 1 - EPSILON, 1 + EPSILON_HIGH) A) + BETA (exp(ref - logp) - (ref - logp) - 1)
and the batch's loss by LOSS_TYPE: grpo, the mean over sequences of each one's token mean; bnpo, the mean over
the batch's completion tokens; dr_grpo, the sum over B x MAX_COMPLETION_LENGTH; dapo, the sum over the rollout
batch's completion tokens per step. Log-probabilities are at the sampling temperature, as TRL scores them.
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
STAT = 'stat/'
LINE_METRICS = ('reward', 'reward_std', 'kl', 'clip_ratio/region_mean')


class GrpoLm(LanguageModel):
  """A LanguageModel trained on its own sampled completions (module docstring)."""
  loss_type: str = 'dapo'
  beta: float = 0.0
  epsilon: float = 0.2
  epsilon_high: Optional[float] = None   # None: EPSILON
  temperature: float = 1.0
  max_completion_length: int = 256
  uses_old_logps: bool = False           # several steps per rollout batch: the batch carries old_logps
  line_metrics = LINE_METRICS

  @property
  def eps_high(self) -> float:
    return self.epsilon if self.epsilon_high is None else self.epsilon_high

  def validate(self) -> None:
    super().validate()
    if self.loss_type not in GRPO_LOSSES:
      raise UserError(f'LOSS_TYPE={self.loss_type!r}: choose one of {", ".join(GRPO_LOSSES)}.')
    if self.beta < 0 or self.epsilon < 0 or self.eps_high < 0:
      raise UserError('BETA, EPSILON and EPSILON_HIGH must not be negative.')
    if self.temperature <= 0:
      raise UserError(f'TEMPERATURE must be positive, got {self.temperature}.')

  def compute_predictions(self, input_batch: dict, deterministic: bool = True) -> dict:
    x, head = self(input_batch['ids'], input_batch['segment_ids'], None, deterministic=deterministic, features=True)
    nll, _ = token_nll(x, head.replace(temperature=self.temperature), input_batch['labels'], self.loss_chunk_tokens)
    return {'logp': -nll}

  def compute_loss(self, predictions: dict, input_batch: dict):
    return grpo_loss(self, predictions['logp'], input_batch)

  def dummy_batch(self, batch_size: int, seq_len: int) -> dict:
    shape = (batch_size, seq_len)
    out = {'ids': np.zeros(shape, np.int32), 'labels': np.zeros(shape, np.int32),
           'weights': np.zeros(shape, np.float32), 'segment_ids': np.zeros(shape, np.int32),
           'advantages': np.zeros((batch_size,), np.float32), 'generation_tokens': np.zeros((batch_size,), np.float32)}
    if self.uses_old_logps:
      out['old_logps'] = np.zeros(shape, np.float32)
    if self.beta:
      out['ref_logps'] = np.zeros(shape, np.float32)
    return out

  def examples_in(self, input_batch: dict):
    return jnp.sum(jnp.sum(input_batch['weights'], axis=-1) > 0)

  def count_in(self, metrics: dict):
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
    per_token = per_token + model.beta * kl
  tokens = jnp.sum(mask)
  masked_sum = jnp.sum(per_token * mask)
  kind = model.loss_type
  if kind == 'grpo':
    loss, weight = jnp.mean(jnp.sum(per_token * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0)), rows
  elif kind == 'bnpo':
    loss, weight = masked_sum / jnp.maximum(tokens, 1.0), tokens
  elif kind == 'dr_grpo':
    loss, weight = masked_sum / (rows * model.max_completion_length), rows
  else:   # dapo: over the rollout batch's tokens per step
    loss, weight = masked_sum / jnp.maximum(jnp.mean(batch['generation_tokens']), 1.0), rows
  global_mean = lambda x: jnp.sum(x * mask) / jnp.maximum(tokens, 1.0)
  low = ((ratio < 1 - model.epsilon) & (adv < 0)).astype(jnp.float32)
  high = ((ratio > 1 + model.eps_high) & (adv > 0)).astype(jnp.float32)
  per_seq = lambda x: jnp.sum(x * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0)
  metrics = {
      'loss': (loss, weight),
      'clip_ratio/low_mean': (global_mean(low), tokens), 'clip_ratio/high_mean': (global_mean(high), tokens),
      'clip_ratio/region_mean': (global_mean(jnp.maximum(low, high)), tokens),
      'clip_ratio/low_min': (jnp.min(per_seq(low)), rows), 'clip_ratio/high_max': (jnp.max(per_seq(high)), rows),
      'tokens_per_row': (jnp.sum(batch['segment_ids'] > 0) / rows, rows),
  }
  if model.beta:
    metrics['kl'] = (jax.lax.stop_gradient(global_mean(kl)), tokens)
  for key, value in batch.items():
    if key.startswith(STAT):
      metrics[key[len(STAT):]] = (jnp.mean(value.astype(jnp.float32)), rows)
  return loss, metrics
