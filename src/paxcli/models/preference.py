"""Preference tuning of a decoder-only LM: DPO (sigmoid, with label smoothing), robust DPO, hinge, IPO, and the
reference-free SimPO and ORPO, with TRL's formulas and metric names (trl.DPOTrainer, trl.experimental's
CPOTrainer for SimPO and ORPOTrainer; tests/test_posttrain_trl.py holds each to TRL's own code on the same batch).

A batch holds pairs, one a row, each side laid out as an LM row (paxcli.inputs.preference):

  chosen_ids, chosen_labels, chosen_weights, chosen_segment_ids          [B, L]
  rejected_ids, rejected_labels, rejected_weights, rejected_segment_ids  [B, L]
  chosen_count, rejected_count                                           [B]  the completion's tokens
  ref_chosen_logps, ref_rejected_logps                                   [B]  REFERENCE='precomputed' only

weights are 1 on the completion's tokens only (the prompt's are read, never trained on) and segment_ids 1 on
every real token (0: padding). The two sides run as one forward pass of 2B rows, a pair's two sides next to
each other (so that no row moves between devices).

A sequence's log-probability is the sum of its completion tokens' (SimPO and ORPO: their mean). The reference
(DPO, robust, hinge, IPO) is the frozen starting model, by REFERENCE:

  copy          the starting params, kept beside the trained ones (the train state's `reference`,
                paxcli.runtime.reference): a second copy of the weights
  adapters_off  LoRA: the same params with every adapter's B set to zero, which is the base exactly: no copy
  precomputed   log-probabilities computed once before training (paxcli.loops.posttrain) and fed in the batch
"""

from __future__ import annotations

import typing
from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from paxcli.errors import UserError
from paxcli.layers import lora
from paxcli.models.lm import LanguageModel
from paxcli.models.losses import token_nll

PreferenceLossName = Literal['sigmoid', 'robust', 'hinge', 'ipo', 'simpo', 'orpo']
ReferenceName = Literal['copy', 'adapters_off', 'precomputed']
PREFERENCE_LOSSES: tuple[str, ...] = typing.get_args(PreferenceLossName)
REFERENCES: tuple[str, ...] = typing.get_args(ReferenceName)
REFERENCE_FREE = ('simpo', 'orpo')
SIDES = ('chosen', 'rejected')
ROW_FEATURES = ('ids', 'labels', 'weights', 'segment_ids')
# The metrics the log line shows after the loss (all go to TensorBoard, train_metrics.jsonl and the trackers).
LINE_METRICS = ('rewards/margins', 'rewards/accuracies')


class PreferenceLm(LanguageModel):
  """A LanguageModel trained on preference pairs (module docstring); it decodes, converts and exports as one."""
  loss_type: str = 'sigmoid'
  beta: float = 0.1
  label_smoothing: float = 0.0   # sigmoid: conservative DPO's; robust: the chance a label is flipped
  simpo_gamma: float = 0.5       # SimPO's target margin (TRL's simpo_gamma)
  cpo_alpha: float = 0.0         # SimPO: weight of the chosen completions' NLL (TRL's CPOConfig.cpo_alpha)
  reference: str = 'copy'
  line_metrics = LINE_METRICS

  @property
  def needs_reference(self) -> bool:
    return self.loss_type not in REFERENCE_FREE

  @property
  def keeps_reference_copy(self) -> bool:
    """Whether the train state holds a copy of the starting params (paxcli.runtime.reference)."""
    return self.needs_reference and self.reference == 'copy'

  def validate(self) -> None:
    super().validate()
    if self.loss_type not in PREFERENCE_LOSSES:
      raise UserError(f'LOSS_TYPE={self.loss_type!r}: choose one of {", ".join(PREFERENCE_LOSSES)}.')
    if self.reference not in REFERENCES:
      raise UserError(f'REFERENCE={self.reference!r}: choose one of {", ".join(REFERENCES)}.')
    if self.beta <= 0:
      raise UserError(f'BETA must be positive, got {self.beta}.')
    if self.loss_type == 'robust' and not 0 <= self.label_smoothing < 0.5:
      raise UserError(f'LABEL_SMOOTHING={self.label_smoothing}: robust DPO reads it as the chance a label is flipped, '
                      'which must be in [0, 0.5).')
    if not 0 <= self.label_smoothing <= 0.5:
      raise UserError(f'LABEL_SMOOTHING must be in [0, 0.5], got {self.label_smoothing}.')
    if self.needs_reference and self.reference == 'adapters_off' and not self.lora['rank']:
      raise UserError("REFERENCE='adapters_off' reads the reference as the model without its LoRA adapters, and "
                      "LORA_RANK is 0: set LORA_RANK, or REFERENCE='copy' (a frozen copy of the starting weights).")

  # ---- the forward pass ---------------------------------------------------------------------------

  def compute_predictions(self, input_batch: dict, deterministic: bool = True) -> dict:
    """Per-token log-probabilities of both sides [2B, L] (chosen i at row 2i, rejected i at 2i + 1), whether
    each label is the argmax, and the reference's (None when not computed here)."""
    rows = pair_rows(input_batch)
    x, head = self(rows['ids'], rows['segment_ids'], None, deterministic=deterministic, features=True)
    nll, correct = token_nll(x, head, rows['labels'], self.loss_chunk_tokens)
    ref = None
    if self.needs_reference and self.reference != 'precomputed' and not self.is_initializing():
      ref = -reference_nll(self, self.reference_params(), rows)
    return {'logp': -nll, 'correct': correct, 'ref_logp': ref}

  def reference_params(self):
    """The reference's params: the train state's copy, or these params with every adapter's B at zero."""
    if self.reference == 'copy':
      found = self.variables.get('reference')
      if found is None:
        raise UserError("REFERENCE='copy' needs the train state's reference params (paxcli.runtime.reference); "
                        'this model was applied without them.')
      return found
    params = nn.meta.unbox(self.variables['params'])
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if str(path[-1].key).endswith(lora.SUFFIX_B) else x, params)

  def compute_loss(self, predictions: dict, input_batch: dict):
    return preference_loss(self, predictions, input_batch)

  def dummy_batch(self, batch_size: int, seq_len: int) -> dict:
    shape = (batch_size, seq_len)
    out = {}
    for side in SIDES:
      out.update({f'{side}_ids': np.zeros(shape, np.int32), f'{side}_labels': np.zeros(shape, np.int32),
                  f'{side}_weights': np.zeros(shape, np.float32), f'{side}_segment_ids': np.zeros(shape, np.int32),
                  f'{side}_count': np.zeros((batch_size,), np.int32)})
      if self.needs_reference and self.reference == 'precomputed':
        out[f'ref_{side}_logps'] = np.zeros((batch_size,), np.float32)
    return out

  def examples_in(self, input_batch: dict):
    return jnp.sum(jnp.sum(input_batch['chosen_weights'], axis=-1) > 0)

  def count_in(self, metrics: dict):
    value, weight = metrics['tokens_per_pair']
    return value * weight

  def eval_summary(self, means: dict, weights: dict) -> dict:
    return dict(means)


def pair_rows(batch: dict) -> dict:
  """The chosen and rejected rows of a batch as one [2B, L] batch, a pair's two sides next to each other."""
  return {k: jnp.stack([batch[f'chosen_{k}'], batch[f'rejected_{k}']], axis=1).reshape(
      (-1,) + batch[f'chosen_{k}'].shape[1:]) for k in ROW_FEATURES}


def reference_nll(model: LanguageModel, params, rows: dict, temperature: float = 1.0):
  """Each label's negative log-likelihood [rows, L] under `params` (the reference), without gradient:
  the model's own network applied to other weights, deterministically."""
  params = jax.lax.stop_gradient(params)
  plain = model.clone(parent=None)
  x, head = plain.apply({'params': params}, rows['ids'], rows['segment_ids'], None, deterministic=True,
                        features=True, method=LanguageModel.__call__)
  if temperature != 1.0:
    head = head.replace(temperature=temperature)
  return jax.lax.stop_gradient(token_nll(x, head, rows['labels'], model.loss_chunk_tokens)[0])


def _sides(x_2BxL):
  return x_2BxL[0::2], x_2BxL[1::2]


def preference_loss(model: PreferenceLm, predictions: dict, batch: dict):
  """(loss, metrics) of a batch of pairs, each metric as TRL names it, weighted by the pairs it averages over
  (padding pairs, all weights 0, count for nothing)."""
  w_c, w_r = batch['chosen_weights'].astype(jnp.float32), batch['rejected_weights'].astype(jnp.float32)
  real = (jnp.sum(w_c, -1) > 0).astype(jnp.float32)
  pairs = jnp.sum(real)
  mean = lambda v: jnp.sum(jnp.where(real > 0, v, 0.0)) / jnp.maximum(pairs, 1.0)
  logp_c, logp_r = _sides(predictions['logp'])
  sum_c, sum_r = jnp.sum(logp_c * w_c, -1), jnp.sum(logp_r * w_r, -1)
  n_c, n_r = jnp.sum(w_c, -1), jnp.sum(w_r, -1)
  beta, kind = model.beta, model.loss_type
  metrics = {}
  if kind in REFERENCE_FREE:   # padding pairs read -1 (log 1 - e^0 would be -inf, and its gradient NaN)
    avg_c = jnp.where(real > 0, sum_c / jnp.maximum(n_c, 1.0), -1.0)
    avg_r = jnp.where(real > 0, sum_r / jnp.maximum(n_r, 1.0), -1.0)
    per_pair, extra = _reference_free(model, avg_c, avg_r, logp_c, w_c, batch, real)
    chosen_logps, rejected_logps = avg_c, avg_r
    chosen_rewards, rejected_rewards = beta * avg_c, beta * avg_r
    loss = extra.pop('_loss')(mean(per_pair))
  else:
    ref_c, ref_r = _reference_logps(predictions, batch, w_c, w_r)
    ratio_c, ratio_r = sum_c - ref_c, sum_r - ref_r
    delta = ratio_c - ratio_r
    per_pair = _with_reference(kind, beta, model.label_smoothing, delta, ratio_c, ratio_r, batch)
    chosen_logps, rejected_logps = sum_c, sum_r
    chosen_rewards, rejected_rewards = beta * ratio_c, beta * ratio_r
    loss, extra = mean(per_pair), {}
  chosen_rewards, rejected_rewards = jax.lax.stop_gradient(chosen_rewards), jax.lax.stop_gradient(rejected_rewards)
  metrics.update({
      'loss': (loss, pairs),
      'rewards/chosen': (mean(chosen_rewards), pairs), 'rewards/rejected': (mean(rejected_rewards), pairs),
      'rewards/accuracies': (mean((chosen_rewards > rejected_rewards).astype(jnp.float32)), pairs),
      'rewards/margins': (mean(chosen_rewards - rejected_rewards), pairs),
      'logps/chosen': (mean(jax.lax.stop_gradient(chosen_logps)), pairs),
      'logps/rejected': (mean(jax.lax.stop_gradient(rejected_logps)), pairs),
      'tokens_per_pair': (jnp.sum(batch['chosen_segment_ids'] > 0) / jnp.maximum(pairs, 1.0)
                          + jnp.sum(batch['rejected_segment_ids'] > 0) / jnp.maximum(pairs, 1.0), pairs),
  })
  correct_c = _sides(predictions['correct'])[0].astype(jnp.float32)
  chosen_tokens = jnp.sum(w_c)
  metrics['mean_token_accuracy'] = (jnp.sum(correct_c * w_c) / jnp.maximum(chosen_tokens, 1.0), chosen_tokens)
  metrics.update({k: (v, pairs) for k, v in extra.items()})
  return loss, metrics


def _reference_logps(predictions: dict, batch: dict, w_c, w_r):
  """The reference's sequence log-probabilities (chosen, rejected) [B]: computed in this step or fed in."""
  if predictions['ref_logp'] is None:
    if 'ref_chosen_logps' not in batch:   # init and shape-only traces
      return jnp.zeros(w_c.shape[:1]), jnp.zeros(w_r.shape[:1])
    return batch['ref_chosen_logps'].astype(jnp.float32), batch['ref_rejected_logps'].astype(jnp.float32)
  ref_c, ref_r = _sides(predictions['ref_logp'])
  return jnp.sum(ref_c * w_c, -1), jnp.sum(ref_r * w_r, -1)


def _with_reference(kind: str, beta: float, smoothing: float, delta, ratio_c, ratio_r, batch):
  """Per-pair loss of the losses against a reference (TRL's DPOTrainer._compute_loss; sigmoid's label smoothing
  as conservative DPO, which TRL's CPOTrainer and earlier DPOTrainer releases compute)."""
  if kind == 'sigmoid':
    return -jax.nn.log_sigmoid(beta * delta) * (1 - smoothing) - jax.nn.log_sigmoid(-beta * delta) * smoothing
  if kind == 'robust':
    clean = -(1 - smoothing) * jax.nn.log_sigmoid(beta * delta)
    flipped = -smoothing * jax.nn.log_sigmoid(-beta * delta)
    return (clean - flipped) / (1 - 2 * smoothing)
  if kind == 'hinge':
    return jax.nn.relu(1 - beta * delta)
  # ipo: the log-ratios per completion token (TRL's normalisation, agreed with IPO's authors)
  n_c = jnp.maximum(batch['chosen_count'].astype(jnp.float32), 1.0)
  n_r = jnp.maximum(batch['rejected_count'].astype(jnp.float32), 1.0)
  return (ratio_c / n_c - ratio_r / n_r - 1 / (2 * beta)) ** 2


def _reference_free(model: PreferenceLm, avg_c, avg_r, logp_c, w_c, batch, real):
  """(per-pair loss, extra metrics with '_loss': the batch's loss from the mean of the per-pair ones) of SimPO
  (TRL's CPOTrainer, loss_type='simpo') and ORPO (ORPOTrainer): mean log-probabilities, no reference."""
  beta, smoothing = model.beta, model.label_smoothing
  if model.loss_type == 'simpo':
    logits = avg_c - avg_r - model.simpo_gamma / beta
    per_pair = (-jax.nn.log_sigmoid(beta * logits) * (1 - smoothing) - jax.nn.log_sigmoid(-beta * logits) * smoothing)
    nll = -jnp.sum(logp_c * w_c) / jnp.maximum(jnp.sum(w_c), 1.0)   # over the chosen completions' tokens
    extra = {'nll_loss': jax.lax.stop_gradient(nll)}
    extra['_loss'] = (lambda m: m + model.cpo_alpha * nll) if model.cpo_alpha else (lambda m: m)
    return per_pair, extra
  # orpo: the chosen side's NLL over all its tokens, prompt included, less beta x log sigmoid(log odds)
  log_odds = (avg_c - avg_r) - (log1mexp(avg_c) - log1mexp(avg_r))
  ratio = jax.nn.log_sigmoid(log_odds)
  every = (batch['chosen_segment_ids'] > 0).astype(jnp.float32)
  nll = -jnp.sum(logp_c * every) / jnp.maximum(jnp.sum(every), 1.0)
  pairs = jnp.maximum(jnp.sum(real), 1.0)
  masked_mean = lambda v: jnp.sum(jnp.where(real > 0, v, 0.0)) / pairs
  extra = {'nll_loss': jax.lax.stop_gradient(nll), 'log_odds_ratio': jax.lax.stop_gradient(masked_mean(ratio)),
           'log_odds_chosen': jax.lax.stop_gradient(masked_mean(log_odds)), '_loss': lambda m: nll - m}
  return beta * ratio, extra


def log1mexp(x):
  """log(1 - exp(x)) for x < 0, without cancellation (TRL's branch at -ln 2)."""
  t = -0.6931471805599453
  return jnp.where(x < t, jnp.log1p(-jnp.exp(jnp.minimum(x, t))), jnp.log(-jnp.expm1(jnp.maximum(x, t))))
