"""Preference tuning of a decoder-only LM: DPO (sigmoid, with label smoothing), robust DPO, hinge, IPO, and the
reference-free SimPO and ORPO, with TRL's formulas and metric names (trl.DPOTrainer, trl.experimental's
CPOTrainer for SimPO and ORPOTrainer; tests/test_preference_trl.py holds each to TRL's own code on the same batch).

A batch holds pairs, one a row, each side laid out as an LM row (paxcli.inputs.preference):

  chosen_ids, chosen_labels, chosen_weights, chosen_segment_ids          [B, L]
  rejected_ids, rejected_labels, rejected_weights, rejected_segment_ids  [B, L]

weights are 1 on the completion's tokens only (the prompt's are read, never trained on) and segment_ids 1 on
every real token (0: padding; a pair whose weights are all 0 is padding and counts for nothing). The two sides
run as one forward pass of 2B rows, a pair's two sides next to each other (so that no row moves between
devices).

A sequence's log-probability is the sum of its completion tokens' (SimPO and ORPO: their mean). The reference
(every loss but SimPO and ORPO) is the frozen starting model, by REFERENCE:

  copy          a copy of the starting params, kept as non-trainable variables of the train state: made from the
                params at the first step (which are the base's: BASE, INIT_FROM), then read at every step, saved
                in checkpoints with the rest of the state and restored with it, so a resumed run compares with
                the same reference. A second copy of the weights on the devices (and on disk).
  adapters_off  LoRA: the same params with every adapter's B set to zero, which is the base exactly: no copy
                (TRL's reference for a PEFT model whose adapter is new)
  precomputed   each pair's reference log-probabilities, computed once with the starting params before the first
                step and kept in the job (paxcli.loops.reference), fed in the batch as ref_chosen_logps and
                ref_rejected_logps [B]: no copy on the devices, no reference forward pass in the steps
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from paxcli.errors import UserError
from paxcli.options import PREFERENCE_LOSSES, PREFERENCE_REFERENCES as REFERENCES
from paxcli.layers import lora
from paxcli.layers.base import NON_TRAINABLE
from paxcli.models.lm import LanguageModel
from paxcli.models.losses import token_nll

REFERENCE_FREE = ('simpo', 'orpo')
SIDES = ('chosen', 'rejected')
ROW_FEATURES = ('ids', 'labels', 'weights', 'segment_ids')
# The metrics the log line shows after the loss (all go to TensorBoard, train_metrics.jsonl and the trackers).
LINE_METRICS = ('rewards/margins', 'rewards/accuracies')
COPY = 'reference_copy'   # REFERENCE='copy': the non-trainable variables non_trainable/reference_copy/{params, ready}


class PreferenceLm(LanguageModel):
  """A LanguageModel trained on preference pairs (module docstring); it decodes, converts and exports as one."""
  loss_type: str = 'sigmoid'
  beta: float = 0.1
  label_smoothing: float = 0.0   # sigmoid: conservative DPO's; robust: the chance a label is flipped; SimPO too
  simpo_gamma: float = 0.5       # SimPO's target margin (TRL's simpo_gamma)
  cpo_alpha: float = 0.0         # SimPO: weight of the chosen completions' NLL (TRL's CPOConfig.cpo_alpha)
  reference: str = 'auto'        # 'auto': adapters_off under LoRA, else copy; or 'precomputed'
  line_metrics = LINE_METRICS

  @property
  def needs_reference(self) -> bool:
    return self.loss_type not in REFERENCE_FREE

  @property
  def reference_kind(self) -> str:
    """'copy', 'adapters_off', or None for the reference-free losses."""
    if not self.needs_reference:
      return None
    if self.reference == 'auto':
      return 'adapters_off' if self.lora['rank'] else 'copy'
    return self.reference

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
    kind = self.reference_kind
    if kind == 'adapters_off' and not self.lora['rank']:
      raise UserError("REFERENCE='adapters_off' reads the reference as the model without its LoRA adapters, and "
                      "LORA_RANK is 0: set LORA_RANK, or REFERENCE='copy' (a frozen copy of the starting weights).")
    if kind == 'copy' and self.lora['rank']:
      raise UserError("REFERENCE='copy' with LORA_RANK > 0 would copy the frozen base: the base is the reference "
                      "already. Use REFERENCE='adapters_off' (the default under LoRA).")

  def setup(self):
    super().setup()
    if self.reference_kind == 'copy':
      self.reference_copy = ReferenceCopy()   # its variables: non_trainable/reference_copy/...

  # ---- the forward pass ---------------------------------------------------------------------------

  def compute_predictions(self, input_batch: dict, deterministic: bool = True) -> dict:
    """Per-token log-probabilities of both sides [2B, L] (chosen i at row 2i, rejected i at 2i + 1), whether
    each label is the argmax, and the reference's (None for the reference-free losses)."""
    rows = pair_rows(input_batch)
    x, head = self(rows['ids'], rows['segment_ids'], None, deterministic=deterministic, features=True)
    nll, correct = token_nll(x, head, rows['labels'], self.loss_chunk_tokens)
    ref, kind = None, self.reference_kind
    if kind == 'copy':
      params = self.reference_copy(self.variables['params'])
      ref = jnp.zeros_like(nll) if params is None else -reference_nll(self, params, rows)
    elif kind == 'adapters_off':
      ref = (jnp.zeros_like(nll) if self.is_initializing() else
             -reference_nll(self, without_adapters(nn.meta.unbox(self.variables['params'])), rows))
    return {'logp': -nll, 'correct': correct, 'ref_logp': ref}

  def sequence_logps(self, input_batch: dict):
    """Each pair's (chosen, rejected) completion log-probabilities [B, 2] under these params, summed over the
    completion's tokens: what REFERENCE='precomputed' keeps of the starting model (paxcli.loops.reference)."""
    rows = pair_rows(input_batch)
    x, head = self(rows['ids'], rows['segment_ids'], None, deterministic=True, features=True)
    logp_c, logp_r = _sides(-token_nll(x, head, rows['labels'], self.loss_chunk_tokens)[0])
    w_c, w_r = input_batch['chosen_weights'].astype(jnp.float32), input_batch['rejected_weights'].astype(jnp.float32)
    return jnp.stack([jnp.sum(logp_c * w_c, -1), jnp.sum(logp_r * w_r, -1)], axis=-1)

  def compute_loss(self, predictions: dict, input_batch: dict):
    return preference_loss(self, predictions, input_batch)

  def dummy_batch(self, batch_size: int, seq_len: int) -> dict:
    shape = (batch_size, seq_len)
    out = {}
    for side in SIDES:
      out.update({f'{side}_ids': np.zeros(shape, np.int32), f'{side}_labels': np.zeros(shape, np.int32),
                  f'{side}_weights': np.zeros(shape, np.float32), f'{side}_segment_ids': np.zeros(shape, np.int32)})
      if self.reference_kind == 'precomputed':
        out[f'ref_{side}_logps'] = np.zeros((batch_size,), np.float32)
    return out

  def examples_in(self, input_batch: dict):
    return jnp.sum(jnp.sum(input_batch['chosen_weights'], axis=-1) > 0)

  def count_in(self, metrics: dict):
    """Tokens a step read (both sides, prompts and completions): what tokens_per_sec counts."""
    value, weight = metrics['tokens_per_pair']
    return value * weight

  def eval_summary(self, means: dict, weights: dict) -> dict:
    return dict(means)


class ReferenceCopy(nn.Module):
  """REFERENCE='copy': the starting params, kept as non-trainable variables (`params`, and `ready` once stored).

  Until the first train step has run they are the params themselves, which are then the starting ones (the
  base's), and that step stores them; every later step, eval and resumed run reads the stored copy. While the
  model is initialised the variables are declared (a copy of the initial params, with their logical axes, so the
  copy is sharded as the params are) and None is returned."""

  @nn.compact
  def __call__(self, params):
    copy = self.variable(NON_TRAINABLE, 'params', lambda: params)
    ready = self.variable(NON_TRAINABLE, 'ready', lambda: nn.LogicallyPartitioned(jnp.zeros([], jnp.int32), ()))
    if self.is_initializing():
      return None
    current = jax.lax.stop_gradient(nn.meta.unbox(params))
    stored = nn.meta.unbox(copy.value)
    reference = jax.lax.cond(nn.meta.unbox(ready.value) > 0, lambda: stored, lambda: current)
    if self.is_mutable_collection(NON_TRAINABLE):   # a train step: the copy is kept from the first one on
      copy.value = _like(copy.value, reference)
      ready.value = _like(ready.value, jnp.ones([], jnp.int32))
    return reference


def _like(old, value):
  """`value` boxed as `old` is (the train step's variables are plain arrays; init's carry logical names)."""
  return old.replace_boxed(value) if isinstance(old, nn.meta.AxisMetadata) else value


def without_adapters(params):
  """The params with every LoRA adapter's B at zero: the base model's function exactly (B A x = 0)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.zeros_like(x) if str(path[-1].key).endswith(lora.SUFFIX_B) else x, params)


def pair_rows(batch: dict) -> dict:
  """The chosen and rejected rows of a batch as one [2B, L] batch, a pair's two sides next to each other."""
  return {k: jnp.stack([batch[f'chosen_{k}'], batch[f'rejected_{k}']], axis=1).reshape(
      (-1,) + batch[f'chosen_{k}'].shape[1:]) for k in ROW_FEATURES}


def reference_nll(model: LanguageModel, params, rows: dict):
  """Each label's negative log-likelihood [rows, L] under `params` (the reference), without gradient: the
  model's own network applied to other weights, deterministically."""
  params = jax.lax.stop_gradient(params)
  plain = model.clone(parent=None)
  x, head = plain.apply({'params': params}, rows['ids'], rows['segment_ids'], None, deterministic=True,
                        features=True, method=LanguageModel.__call__)
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
  n_c, n_r = jnp.maximum(jnp.sum(w_c, -1), 1.0), jnp.maximum(jnp.sum(w_r, -1), 1.0)
  beta = model.beta
  if model.loss_type in REFERENCE_FREE:   # padding pairs read -1 (log 1 - e^0 would be -inf, and its gradient NaN)
    logps_c, logps_r = jnp.where(real > 0, sum_c / n_c, -1.0), jnp.where(real > 0, sum_r / n_r, -1.0)
    loss, extra = _reference_free(model, logps_c, logps_r, logp_c, w_c, batch, mean)
    rewards_c, rewards_r = beta * logps_c, beta * logps_r
  else:
    if predictions['ref_logp'] is None:   # precomputed: in the batch
      ref_c, ref_r = batch['ref_chosen_logps'].astype(jnp.float32), batch['ref_rejected_logps'].astype(jnp.float32)
    else:
      ref_c, ref_r = (jnp.sum(r * w, -1) for r, w in zip(_sides(predictions['ref_logp']), (w_c, w_r)))
    ratio_c, ratio_r = sum_c - ref_c, sum_r - ref_r
    loss = mean(_with_reference(model.loss_type, beta, model.label_smoothing, ratio_c, ratio_r, n_c, n_r))
    logps_c, logps_r, extra = sum_c, sum_r, {}
    rewards_c, rewards_r = beta * ratio_c, beta * ratio_r
  rewards_c, rewards_r = jax.lax.stop_gradient(rewards_c), jax.lax.stop_gradient(rewards_r)
  tokens = jnp.sum(batch['chosen_segment_ids'] > 0) + jnp.sum(batch['rejected_segment_ids'] > 0)
  correct_c = _sides(predictions['correct'])[0].astype(jnp.float32)
  metrics = {
      'loss': (loss, pairs),
      'rewards/chosen': (mean(rewards_c), pairs), 'rewards/rejected': (mean(rewards_r), pairs),
      'rewards/accuracies': (mean((rewards_c > rewards_r).astype(jnp.float32)), pairs),
      'rewards/margins': (mean(rewards_c - rewards_r), pairs),
      'logps/chosen': (mean(jax.lax.stop_gradient(logps_c)), pairs),
      'logps/rejected': (mean(jax.lax.stop_gradient(logps_r)), pairs),
      'mean_token_accuracy': (jnp.sum(correct_c * w_c) / jnp.maximum(jnp.sum(w_c), 1.0), jnp.sum(w_c)),
      'tokens_per_pair': (tokens / jnp.maximum(pairs, 1.0), pairs),
  }
  metrics.update({k: (jax.lax.stop_gradient(v), pairs) for k, v in extra.items()})
  return loss, metrics


def _with_reference(kind: str, beta: float, smoothing: float, ratio_c, ratio_r, n_c, n_r):
  """Per-pair loss of the losses against a reference (TRL's DPOTrainer._compute_loss); sigmoid's label smoothing
  is conservative DPO's (TRL's CPOTrainer's sigmoid, and DPOTrainer's before TRL 1.0)."""
  delta = ratio_c - ratio_r
  if kind == 'sigmoid':
    return -jax.nn.log_sigmoid(beta * delta) * (1 - smoothing) - jax.nn.log_sigmoid(-beta * delta) * smoothing
  if kind == 'robust':
    clean = -(1 - smoothing) * jax.nn.log_sigmoid(beta * delta)
    flipped = -smoothing * jax.nn.log_sigmoid(-beta * delta)
    return (clean - flipped) / (1 - 2 * smoothing)
  if kind == 'hinge':
    return jax.nn.relu(1 - beta * delta)
  # ipo: the log-ratios per completion token (TRL's normalisation, agreed with IPO's authors)
  return (ratio_c / n_c - ratio_r / n_r - 1 / (2 * beta)) ** 2


def _reference_free(model: PreferenceLm, logps_c, logps_r, logp_c, w_c, batch, mean):
  """(loss, extra metrics) of SimPO (TRL's CPOTrainer, loss_type='simpo') and ORPO (ORPOTrainer), from the
  completions' mean log-probabilities, with no reference."""
  beta, smoothing = model.beta, model.label_smoothing
  if model.loss_type == 'simpo':
    logits = logps_c - logps_r - model.simpo_gamma / beta
    per_pair = -jax.nn.log_sigmoid(beta * logits) * (1 - smoothing) - jax.nn.log_sigmoid(-beta * logits) * smoothing
    nll = -jnp.sum(logp_c * w_c) / jnp.maximum(jnp.sum(w_c), 1.0)   # over the chosen completions' tokens
    return mean(per_pair) + model.cpo_alpha * nll, {'nll_loss': nll if model.cpo_alpha else jnp.zeros([])}
  # orpo: the chosen side's NLL over all its tokens, prompt included, less beta x log sigmoid(log odds)
  log_odds = (logps_c - logps_r) - (log1mexp(logps_c) - log1mexp(logps_r))
  ratio = jax.nn.log_sigmoid(log_odds)
  every = (batch['chosen_segment_ids'] > 0).astype(jnp.float32)
  nll = -jnp.sum(logp_c * every) / jnp.maximum(jnp.sum(every), 1.0)
  return nll - mean(beta * ratio), {'nll_loss': nll, 'log_odds_ratio': mean(ratio), 'log_odds_chosen': mean(log_odds)}


def log1mexp(x):
  """log(1 - exp(x)) for x < 0, without cancellation (TRL's branch at -ln 2)."""
  t = -0.6931471805599453
  return jnp.where(x < t, jnp.log1p(-jnp.exp(jnp.minimum(x, t))), jnp.log(-jnp.expm1(jnp.maximum(x, t))))
