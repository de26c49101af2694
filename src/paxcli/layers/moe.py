"""Mixture-of-experts feed-forward: a router sends each token to EXPERTS_PER_TOKEN of NUM_EXPERTS expert MLPs.

The layer (MoeFeedForward) takes the dense Mlp's place in a block (the knob NUM_EXPERTS swaps the
template, paxcli.models.knobs) and keeps its fields (hidden_dims per expert, activation, gated,
use_bias), so a LAYER_PATTERN kind can make every other layer sparse.

Router: logits = x W_router in float32 [tokens, E]; the k experts of a token are its top-k logits.
Their weights are, by `router_softmax`:
  'after_topk'   softmax over the k chosen logits (Mixtral)
  'before_topk'  softmax over all E experts, then the k largest probabilities (Qwen3-MoE, GShard,
                 Switch), rescaled to sum to 1 when `normalize_topk` (Qwen3's norm_topk_prob; GShard's top-2)
  'sigmoid'      DeepSeek-V3's: a score sigmoid(logit) per expert; the k experts are chosen by score +
                 router_bias (the load-balancing bias, e_score_correction_bias: it steers the choice only),
                 their weights are their scores, rescaled to sum to 1 when `normalize_topk`
('after_topk' is 'before_topk' with normalize_topk, up to rounding.) Group-limited routing (`router_groups`
G > 1, DeepSeek's n_group): the experts are G groups of E / G; a group's score is the sum of its two best
choice scores, and only the `router_group_k` best groups' experts can be chosen (topk_group). The weights are
then multiplied by `routed_scale` (routed_scaling_factor). `router_bias` is a weight [E] no gradient reaches
(it enters the choice only) and the optimizer leaves alone (LanguageModel.decays): it stays as imported.

Dispatch, by `dispatch`:
  'dropless'  every choice is computed: the token copies are sorted by expert and each expert's
              run is one group of `jax.lax.ragged_dot` (a grouped matmul; XLA:CPU computes it as a
              dense matmul per group). Under a mesh the work is a shard_map: tokens stay where the
              batch is sharded, experts are sharded over the `expert` mesh axis and the token copies
              travel there and back by all-to-all, in buffers sized for the worst case (all of a
              device's tokens on one device's experts), so that nothing is ever dropped.
  'capacity'  GShard's: each sequence is one group (or, with `capacity_groups` G, the batch's B x L
              tokens in G groups, praxis' num_groups); expert e takes at most
              C = ceil(capacity_factor x L x k / E) of a group's tokens (`capacity_rule` 'praxis':
              int(capacity_factor x L / E) rounded up to 4), first choices before second
              ones, in token order; the rest are dropped (they pass through the residual alone) and
              counted. A decoding step (one token a sequence) routes each sequence alone. Dispatch
              and combine are einsums over one-hot [B, L, E, C] masks, and the expert inputs
              [E, B, C, D] are constrained to the `expert` axis, which GSPMD lowers to all-to-all. This is what Pax's GShard layers (praxis TransformerFeedForwardMoe) train with.

Aux losses (layers.base AUX_LOSS; each weighted by its knob, 0: not added):
  load_balance_loss  E x sum_e f_e P_e, f_e the share of the token choices routed to e and P_e the
                     mean router probability of e (Switch / GShard; 1 when balanced)
  router_z_loss      mean over tokens of logsumexp(logits)^2 (ST-MoE)
Summaries per layer (layers.base SUMMARIES): expert_load_min / expert_load_max, the smallest and the
largest fraction of the tokens an expert received (k / E when balanced, 1 when every token chose it),
and dropped_fraction, the share of token choices over capacity (0 when dropless).

Weights (logical axes in brackets): router [embed, -], wi_0 (and wi_1 when gated) [exp, embed, mlp],
wo [exp, mlp, embed], biases bi_0/bi_1 [exp, mlp] and bo [exp, embed] with use_bias; a shared expert
(`shared_hidden_dims` > 0: an Mlp every token goes through, DeepSeek / Qwen2-MoE) is the child
`shared`, and with `shared_gate` its output is scaled by sigmoid(x w_shared_gate) (Qwen2-MoE).
Hugging Face's Mixtral `block_sparse_moe.experts.{i}.w1/w3/w2` + `gate` and Qwen3-MoE's
`mlp.experts.{i}.gate_proj/up_proj/down_proj` + `mlp.gate` are rows i of wi_0/wi_1/wo and router^T.
"""

from __future__ import annotations

import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from paxcli.errors import UserError
from paxcli.layers import activation_sharding
from paxcli.layers.activation_sharding import constrain, spec_for
from paxcli.layers.base import BaseLayer, SUMMARIES
from paxcli.layers.transformer import _ACTIVATIONS, Mlp

EXPERT_AXIS = 'expert'   # the mesh axis experts are sharded over (paxcli.runtime.sharding)
MODEL_AXIS = 'mdl'
SUMMARY_NAMES = ('expert_load_min', 'expert_load_max', 'dropped_fraction')


def _expert_init(in_axis: int, names):
  """Fan-in scaled truncated normal per expert: the fan-in is the input axis alone, not experts x inputs."""
  return nn.with_logical_partitioning(
      nn.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal', in_axis=in_axis, out_axis=-1,
                                       batch_axis=(0,)), names)


class MoeFeedForward(BaseLayer):
  """The mixture-of-experts feed-forward (see the module docstring). __call__(x [B, L, D]) -> [B, L, D]."""
  num_experts: int = 8
  experts_per_token: int = 2
  hidden_dims: int = 256
  activation: str = 'silu'
  gated: bool = True
  use_bias: bool = False
  dispatch: str = 'dropless'
  capacity_factor: float = 1.25
  capacity_groups: int = 0          # 'capacity': 0, each sequence a group; G, the batch's tokens in G groups
  capacity_rule: str = 'paxcli'     # 'paxcli' or 'praxis' (expert_capacity)
  router_softmax: str = 'before_topk'
  normalize_topk: bool = True
  load_balance_weight: float = 0.01
  z_loss_weight: float = 0.0
  shared_hidden_dims: int = 0
  shared_gate: bool = False
  router_bias: bool = False       # the load-balancing bias of the choice (router_softmax 'sigmoid')
  router_groups: int = 1          # group-limited routing: G groups of experts (1: off)
  router_group_k: int = 1         # ... of which a token's experts come from this many
  routed_scale: float = 1.0       # the routed experts' weights x this
  # The dense Mlp's LoRA fields, so that the LORA_* knobs fill either; experts take no adapters
  # (paxcli.models.validation refuses LORA_TARGETS 'mlp' with experts).
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple = ('query', 'value')
  lora_dropout: float = 0.0
  deterministic: bool = True
  # The dense Mlp's fp8 fields, so that FP8 fills either: the shared expert takes them; the experts' grouped
  # products stay in the compute dtype.
  fp8: str = 'none'
  fp8_amax_history: int = 1024

  def _kernels(self, d: int) -> dict:
    e, f = self.num_experts, self.hidden_dims
    out = {'wi_0': self.param('wi_0', _expert_init(-2, ('exp', 'embed', 'mlp')), (e, d, f), self.dtype)}
    if self.gated:
      out['wi_1'] = self.param('wi_1', _expert_init(-2, ('exp', 'embed', 'mlp')), (e, d, f), self.dtype)
    out['wo'] = self.param('wo', _expert_init(-2, ('exp', 'mlp', 'embed')), (e, f, d), self.dtype)
    if self.use_bias:
      zeros = nn.initializers.zeros
      out['bi_0'] = self.param('bi_0', nn.with_logical_partitioning(zeros, ('exp', 'mlp')), (e, f), self.dtype)
      if self.gated:
        out['bi_1'] = self.param('bi_1', nn.with_logical_partitioning(zeros, ('exp', 'mlp')), (e, f), self.dtype)
      out['bo'] = self.param('bo', nn.with_logical_partitioning(zeros, ('exp', 'embed')), (e, d), self.dtype)
    return out

  @nn.compact
  def __call__(self, x_BxLxD):
    compute = self.fprop_dtype or jnp.float32
    b, l, d = x_BxLxD.shape
    router = self.param('router', nn.with_logical_partitioning(
        nn.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal'), ('embed', None)),
        (d, self.num_experts), self.dtype)
    logits_BxLxE = jnp.einsum('bld,de->ble', x_BxLxD.astype(jnp.float32), router.astype(jnp.float32))
    bias_E = None
    if self.router_bias:
      bias_E = self.param('router_bias', nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
                          (self.num_experts,), jnp.float32).astype(jnp.float32)
    weights_BxLxK, experts_BxLxK, probs_BxLxE = route(logits_BxLxE, self.experts_per_token, self.router_softmax,
                                                      self.normalize_topk, bias_E, self.router_groups,
                                                      self.router_group_k)
    if self.routed_scale != 1.0:
      weights_BxLxK = weights_BxLxK * self.routed_scale
    self._report(logits_BxLxE, probs_BxLxE, experts_BxLxK)
    kernels = {k: v.astype(compute) for k, v in self._kernels(d).items()}
    act = _ACTIVATIONS[self.activation]
    if self.dispatch == 'capacity':
      groups = routing_groups(b, l, self.capacity_groups)
      as_groups = lambda t: t.reshape((groups, b * l // groups) + t.shape[2:])
      capacity = expert_capacity(b * l // groups, self.num_experts, self.experts_per_token, self.capacity_factor,
                                 self.capacity_rule)
      y_GxSxD, kept_BxLxK = capacity_dispatch(as_groups(x_BxLxD.astype(compute)), as_groups(experts_BxLxK),
                                              as_groups(weights_BxLxK), kernels, act, self.gated, capacity)
      y_BxLxD = y_GxSxD.reshape(b, l, d)
      dropped = jnp.mean(jnp.logical_not(kept_BxLxK).astype(jnp.float32))
    else:
      y_BxLxD = dropless(x_BxLxD.astype(compute), experts_BxLxK, weights_BxLxK, kernels, act, self.gated)
      dropped = jnp.zeros([], jnp.float32)
    self.add_summary('dropped_fraction', dropped)
    y_BxLxD = y_BxLxD.astype(compute)
    if self.shared_hidden_dims:
      y_BxLxD = y_BxLxD + self._shared(x_BxLxD.astype(compute), compute)
    return constrain(y_BxLxD, ('batch', 'length', 'embed'))

  def _shared(self, x_BxLxD, compute):
    """The shared expert every token goes through, sigmoid-gated per token with shared_gate."""
    out = Mlp(self.shared_hidden_dims, self.activation, self.gated, self.use_bias, compute, fp8=self.fp8,
              fp8_amax_history=self.fp8_amax_history, name='shared')(x_BxLxD)
    if self.shared_gate:
      w = self.param('shared_gate', nn.with_logical_partitioning(
          nn.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal'), ('embed', None)),
          (x_BxLxD.shape[-1], 1), self.dtype)
      out = out * jax.nn.sigmoid(jnp.einsum('bld,do->blo', x_BxLxD, w.astype(compute)))
    return out

  def _report(self, logits_BxLxE, probs_BxLxE, experts_BxLxK) -> None:
    """The aux losses (where their weight is not 0) and the load summaries."""
    e, k = self.num_experts, self.experts_per_token
    chosen_E = jnp.sum(jax.nn.one_hot(experts_BxLxK, e, dtype=jnp.float32), axis=(0, 1, 2))
    tokens = experts_BxLxK.shape[0] * experts_BxLxK.shape[1]
    if self.load_balance_weight:
      share_E = chosen_E / (tokens * k)
      mean_prob_E = jnp.mean(probs_BxLxE, axis=(0, 1))
      self.add_aux_loss('load_balance_loss', e * jnp.sum(share_E * mean_prob_E), self.load_balance_weight)
    if self.z_loss_weight:
      z = jax.nn.logsumexp(logits_BxLxE, axis=-1)
      self.add_aux_loss('router_z_loss', jnp.mean(z * z), self.z_loss_weight)
    if self.is_mutable_collection(SUMMARIES):
      load_E = chosen_E / tokens
      self.add_summary('expert_load_min', jnp.min(load_E))
      self.add_summary('expert_load_max', jnp.max(load_E))


def route(logits_BxLxE, k: int, softmax: str, normalize: bool, bias_E=None, groups: int = 1, group_k: int = 1):
  """(weights [B, L, k] float32, experts [B, L, k] int32, probabilities [B, L, E]) of a router's logits (the
  module docstring; for 'sigmoid' the probabilities are the scores scaled to sum to 1, what the load-balancing
  loss reads)."""
  if softmax == 'sigmoid':
    scores_BxLxE = jax.nn.sigmoid(logits_BxLxE)
    choice_BxLxE = scores_BxLxE if bias_E is None else scores_BxLxE + bias_E[None, None, :]
    experts_BxLxK = jax.lax.top_k(_within_groups(choice_BxLxE, groups, group_k), k)[1]
    weights_BxLxK = jnp.take_along_axis(scores_BxLxE, experts_BxLxK, axis=-1)
    if normalize:
      weights_BxLxK = weights_BxLxK / (jnp.sum(weights_BxLxK, axis=-1, keepdims=True) + 1e-20)
    return weights_BxLxK, experts_BxLxK, scores_BxLxE / jnp.sum(scores_BxLxE, axis=-1, keepdims=True)
  probs_BxLxE = jax.nn.softmax(logits_BxLxE, axis=-1)
  choice_BxLxE = _within_groups(logits_BxLxE if softmax == 'after_topk' else probs_BxLxE, groups, group_k)
  if softmax == 'after_topk':
    experts_BxLxK = jax.lax.top_k(choice_BxLxE, k)[1]
    top_BxLxK = jnp.take_along_axis(logits_BxLxE, experts_BxLxK, axis=-1)
    return jax.nn.softmax(top_BxLxK, axis=-1), experts_BxLxK, probs_BxLxE
  experts_BxLxK = jax.lax.top_k(choice_BxLxE, k)[1]
  weights_BxLxK = jnp.take_along_axis(probs_BxLxE, experts_BxLxK, axis=-1)
  if normalize:
    weights_BxLxK = weights_BxLxK / jnp.sum(weights_BxLxK, axis=-1, keepdims=True)
  return weights_BxLxK, experts_BxLxK, probs_BxLxE


def _within_groups(choice_BxLxE, groups: int, group_k: int):
  """The choice scores with every expert outside a token's `group_k` best groups at -inf (a group's score: the
  sum of its two best); as they are with one group."""
  if groups <= 1:
    return choice_BxLxE
  b, l, e = choice_BxLxE.shape
  grouped_BxLxGxM = choice_BxLxE.reshape(b, l, groups, e // groups)
  group_scores_BxLxG = jnp.sum(jax.lax.top_k(grouped_BxLxGxM, min(2, e // groups))[0], axis=-1)
  best_BxLxJ = jax.lax.top_k(group_scores_BxLxG, group_k)[1]
  kept_BxLxG = jnp.sum(jax.nn.one_hot(best_BxLxJ, groups, dtype=jnp.int32), axis=-2) > 0
  return jnp.where(kept_BxLxG[..., None], grouped_BxLxGxM, -jnp.inf).reshape(b, l, e)


def _ffn(h_in, kernels: dict, act, gated: bool, matmul, bias):
  """act(h W0 + b0) [* (h W1 + b1)] Wo + bo through `matmul(h, name)` and `bias(name)` (0 without biases)."""
  h = act(matmul(h_in, 'wi_0') + bias('bi_0'))
  if gated:
    h = h * (matmul(h_in, 'wi_1') + bias('bi_1'))
  return matmul(h, 'wo') + bias('bo')


# ---- capacity-factor dispatch (GShard) -------------------------------------------------------------

def expert_capacity(length: int, num_experts: int, k: int, factor: float, rule: str = 'paxcli') -> int:
  """Slots per expert in a group of `length` tokens, at least 1 and at most the group: 'paxcli' ceil(factor x
  length x k / E); 'praxis' int(factor x length / E) rounded up to a multiple of 4 (praxis' top-2 gating with
  unadjusted_expert_capacity_factor; where that is 0, praxis leaves an expert no slot and this gives it one)."""
  if rule == 'praxis':
    slots = int(length * factor / num_experts)
    return max(1, min(length, (slots + 3) // 4 * 4))
  return max(1, min(length, math.ceil(factor * length * k / num_experts)))


def routing_groups(batch: int, length: int, groups: int) -> int:
  """How many groups the capacity dispatch routes the batch's tokens in: `groups` (praxis' num_groups), or one
  group a sequence where it is 0 or one token a sequence is decoded (each sequence's capacity is then its own)."""
  if not groups or length == 1:
    return batch
  if (batch * length) % groups:
    raise UserError(f'MOE_GROUPS {groups} does not divide the {batch} x {length} tokens of a batch into equal '
                    'routing groups; pick a divisor of the batch\'s tokens, or 0 (a group each sequence).')
  return groups


def capacity_masks(experts_BxLxK, weights_BxLxK, num_experts: int, capacity: int):
  """(dispatch [B, L, E, C] 0/1, combine [B, L, E, C] router weights, kept [B, L, K] bool).

  A token's place in its expert's buffer counts the earlier claims on that expert in its sequence,
  every first choice before any second one (GShard's priority); places >= capacity are dropped.
  """
  b, l, k = experts_BxLxK.shape
  onehot_BxLxKxE = jax.nn.one_hot(experts_BxLxK, num_experts, dtype=jnp.int32)
  by_choice_BxKLxE = jnp.swapaxes(onehot_BxLxKxE, 1, 2).reshape(b, k * l, num_experts)
  place_BxKLxE = jnp.cumsum(by_choice_BxKLxE, axis=1) - 1
  place_BxLxK = jnp.swapaxes(jnp.sum(place_BxKLxE * by_choice_BxKLxE, axis=-1).reshape(b, k, l), 1, 2)
  kept_BxLxK = place_BxLxK < capacity
  dispatch = jnp.zeros((b, l, num_experts, capacity), jnp.float32)
  combine = jnp.zeros((b, l, num_experts, capacity), jnp.float32)
  for j in range(k):   # k is small: one outer product per choice, never a [B, L, K, E, C] array
    slot_BxLxC = jax.nn.one_hot(jnp.where(kept_BxLxK[..., j], place_BxLxK[..., j], capacity), capacity)
    mask = onehot_BxLxKxE[:, :, j, :, None].astype(jnp.float32) * slot_BxLxC[:, :, None, :]
    dispatch = dispatch + mask
    combine = combine + mask * weights_BxLxK[:, :, j, None, None]
  return dispatch, combine, kept_BxLxK


def capacity_dispatch(x_BxLxD, experts_BxLxK, weights_BxLxK, kernels: dict, act, gated: bool, capacity: int):
  """(y [B, L, D], kept [B, L, K]): the experts' outputs by GShard's dispatch and combine einsums."""
  dispatch, combine, kept = capacity_masks(experts_BxLxK, weights_BxLxK, kernels['wo'].shape[0], capacity)
  names = ('batch', 'length', None, None)
  dispatch, combine = constrain(dispatch.astype(x_BxLxD.dtype), names), constrain(combine, names)
  x_ExBxCxD = constrain(jnp.einsum('blec,bld->ebcd', dispatch, x_BxLxD), ('exp', 'batch', None, 'embed'))

  def matmul(h, name):
    out = jnp.einsum('ebci,eio->ebco', h, kernels[name])
    return constrain(out, ('exp', 'batch', None, 'embed' if name == 'wo' else 'mlp'))

  def bias(name):
    return kernels[name][:, None, None, :] if name in kernels else 0

  y_ExBxCxD = _ffn(x_ExBxCxD, kernels, act, gated, matmul, bias)
  y_BxLxD = jnp.einsum('blec,ebcd->bld', combine.astype(y_ExBxCxD.dtype), y_ExBxCxD)
  return constrain(y_BxLxD, ('batch', 'length', 'embed')), kept


# ---- dropless dispatch (sorted tokens, ragged_dot) ---------------------------------------------------

def dropless(x_BxLxD, experts_BxLxK, weights_BxLxK, kernels: dict, act, gated: bool):
  """The experts' outputs [B, L, D] with every choice computed: under a mesh (a train or eval step) a
  shard_map over it, with the expert axis's all-to-all; elsewhere (init, decoding) on the whole batch."""
  kernels = dict(kernels)
  bo = kernels.pop('bo', None)   # added where the tokens are, once (the experts' devices hold partial sums)
  context = activation_sharding.active()
  if context is None:
    y_BxLxD = _dropless_local(x_BxLxD, experts_BxLxK, weights_BxLxK, kernels, act, gated, None, None)
  else:
    y_BxLxD = _dropless_sharded(x_BxLxD, experts_BxLxK, weights_BxLxK, kernels, act, gated, *context)
  if bo is not None:
    y_BxLxD = y_BxLxD + jnp.einsum('blk,blkd->bld', weights_BxLxK.astype(bo.dtype), bo[experts_BxLxK])
  return y_BxLxD


def _dropless_sharded(x_BxLxD, experts_BxLxK, weights_BxLxK, kernels: dict, act, gated: bool, mesh, table):
  """`_dropless_local` as a shard_map: tokens where the batch is sharded, experts over the expert axis,
  hidden units over mdl (where those axes divide them)."""
  shape = dict(mesh.shape)
  batch = spec_for(('batch',), (x_BxLxD.shape[0],), shape, table)[0]
  e, f = kernels['wo'].shape[:2]
  expert = EXPERT_AXIS if shape.get(EXPERT_AXIS, 1) > 1 and e % shape[EXPERT_AXIS] == 0 else None
  model = MODEL_AXIS if shape.get(MODEL_AXIS, 1) > 1 and f % shape[MODEL_AXIS] == 0 else None
  P = jax.sharding.PartitionSpec
  specs = {'wi_0': P(expert, None, model), 'wi_1': P(expert, None, model), 'wo': P(expert, model, None),
           'bi_0': P(expert, model), 'bi_1': P(expert, model)}
  token = P(batch, None, None)

  def body(x, experts, weights, local):
    return _dropless_local(x, experts, weights, local, act, gated, expert, model)

  fn = jax.shard_map(body, mesh=mesh, in_specs=(token, token, token, {k: specs[k] for k in kernels}),
                     out_specs=token, check_vma=False)
  return fn(x_BxLxD, experts_BxLxK, weights_BxLxK, kernels)


def _dropless_local(x_BxLxD, experts_BxLxK, weights_BxLxK, kernels: dict, act, gated: bool,
                    expert_axis: Optional[str], model_axis: Optional[str]):
  """One device's (or, with no axes, the whole batch's) dropless MoE without the output bias: the
  [T x K] token copies sorted by expert; with an expert axis they go to the experts' devices and back
  (`_exchange`); with a model axis each device's hidden units give a partial sum."""
  b, l, d = x_BxLxD.shape
  k = experts_BxLxK.shape[-1]
  x_TxD = x_BxLxD.reshape(b * l, d)
  experts_A, weights_A = experts_BxLxK.reshape(-1), weights_BxLxK.reshape(-1)
  num_experts = kernels['wo'].shape[0] * (jax.lax.axis_size(expert_axis) if expert_axis else 1)
  order_A = jnp.argsort(experts_A, stable=True)
  sorted_experts_A = experts_A[order_A]
  rows_AxD = x_TxD[order_A // k]
  if expert_axis:
    y_sorted_AxD = _exchange(rows_AxD, sorted_experts_A, num_experts, k, kernels, act, gated, expert_axis)
  else:
    group_sizes = jnp.bincount(experts_A, length=num_experts).astype(jnp.int32)
    y_sorted_AxD = _grouped_ffn(rows_AxD, sorted_experts_A, group_sizes, kernels, act, gated)
  y_AxD = jnp.zeros_like(y_sorted_AxD).at[order_A].set(y_sorted_AxD)
  y_TxD = jnp.sum(y_AxD.reshape(b * l, k, d) * weights_A.reshape(b * l, k, 1).astype(y_AxD.dtype), axis=1)
  if model_axis:
    y_TxD = jax.lax.psum(y_TxD, model_axis)
  return y_TxD.reshape(b, l, d)


def _grouped_ffn(rows_AxD, experts_A, group_sizes, kernels: dict, act, gated: bool):
  """The expert MLPs (no output bias) on rows sorted by (local) expert, `group_sizes` rows each; the rows
  past their sum are not any expert's (their outputs are never read)."""
  def matmul(h, name):
    return jax.lax.ragged_dot(h, kernels[name], group_sizes)

  def bias(name):
    if name not in kernels:
      return 0
    index = jnp.clip(experts_A, 0, kernels[name].shape[0] - 1)
    return kernels[name][index]

  return _ffn(rows_AxD, kernels, act, gated, matmul, bias)


def _exchange(rows_AxD, sorted_experts_A, num_experts: int, k: int, kernels: dict, act, gated: bool,
              expert_axis: str):
  """The sorted token copies [A, D] through the experts of every device on `expert_axis` and back.

  Copies for device s go into slot s of a send buffer [ep, cap, D] (cap: the most this device can
  send to one device, tokens x min(k, local experts)); one all-to-all delivers each device the copies
  for its experts from every device, which it sorts by expert, computes and sends back the same way.
  """
  ep = jax.lax.axis_size(expert_axis)
  local = num_experts // ep
  a, d = rows_AxD.shape
  cap = (a // k) * min(k, local)
  counts_SxEl = jnp.bincount(sorted_experts_A, length=num_experts).astype(jnp.int32).reshape(ep, local)
  sent_S = jnp.sum(counts_SxEl, axis=1)
  dest_A = sorted_experts_A // local
  slot_A = jnp.arange(a) - (jnp.cumsum(sent_S) - sent_S)[dest_A]
  send = jnp.zeros((ep, cap, d), rows_AxD.dtype).at[dest_A, slot_A].set(rows_AxD)
  recv = jax.lax.all_to_all(send, expert_axis, 0, 0)
  recv_counts_SxEl = jax.lax.all_to_all(counts_SxEl, expert_axis, 0, 0)
  # Row r from device s holds local expert u where the running count of s first exceeds r (u = local: empty).
  ends_SxEl = jnp.cumsum(recv_counts_SxEl, axis=1)
  local_ids = jax.vmap(lambda ends: jnp.searchsorted(ends, jnp.arange(cap), side='right'))(ends_SxEl).reshape(-1)
  order = jnp.argsort(local_ids, stable=True)
  y_sorted = _grouped_ffn(recv.reshape(ep * cap, d)[order], local_ids[order], jnp.sum(recv_counts_SxEl, axis=0),
                          kernels, act, gated)
  y_recv = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(ep, cap, d)
  back = jax.lax.all_to_all(y_recv, expert_axis, 0, 0)
  return back[dest_A, slot_A]


# ---- checks -----------------------------------------------------------------------------------------

def check_settings(ffn, label: str = '') -> None:
  """One line for MoE settings that cannot work (an MoE feed-forward config or layer)."""
  e, k = ffn.num_experts, ffn.experts_per_token
  if e < 1:
    raise UserError(f'{label}NUM_EXPERTS must be positive for a mixture-of-experts layer, got {e}.')
  if not 1 <= k <= e:
    raise UserError(f'{label}EXPERTS_PER_TOKEN is {k}, but each token must pick between 1 and NUM_EXPERTS '
                    f'({e}) experts.')
  if not ffn.capacity_factor > 0:
    raise UserError(f'{label}EXPERT_CAPACITY_FACTOR must be positive (each expert takes capacity factor x '
                    f'tokens x k / E tokens of a sequence), got {ffn.capacity_factor}.')
  if getattr(ffn, 'capacity_groups', 0) < 0:
    raise UserError(f'{label}MOE_GROUPS must be 0 (a routing group each sequence) or positive, got '
                    f'{ffn.capacity_groups}.')
  if ffn.hidden_dims < 1 or ffn.shared_hidden_dims < 0:
    raise UserError(f'{label}HIDDEN_DIMS must be positive and SHARED_EXPERT_HIDDEN_DIMS 0 or positive, got '
                    f'{ffn.hidden_dims} and {ffn.shared_hidden_dims}.')
  if ffn.load_balance_weight < 0 or ffn.z_loss_weight < 0:
    raise UserError(f'{label}LOAD_BALANCE_LOSS_WEIGHT and ROUTER_Z_LOSS_WEIGHT must be 0 (off) or positive, got '
                    f'{ffn.load_balance_weight} and {ffn.z_loss_weight}.')
  groups, group_k = getattr(ffn, 'router_groups', 1), getattr(ffn, 'router_group_k', 1)
  if groups < 1 or e % groups or not 1 <= group_k <= groups or group_k * (e // groups) < k:
    raise UserError(f'{label}ROUTER_GROUPS {groups} must divide NUM_EXPERTS {e} into equal groups, and '
                    f'ROUTER_TOPK_GROUPS {group_k} (1 to the groups) of them must hold at least EXPERTS_PER_TOKEN {k} '
                    'experts.')
  if not getattr(ffn, 'routed_scale', 1.0) > 0:
    raise UserError(f'{label}ROUTED_SCALING_FACTOR must be positive, got {ffn.routed_scale}.')
  if getattr(ffn, 'router_bias', False) and ffn.router_softmax != 'sigmoid':
    raise UserError(f"{label}ROUTER_BIAS steers the choice of a sigmoid router: set ROUTER_SOFTMAX='sigmoid', or "
                    'ROUTER_BIAS=False.')
  if ffn.lora_rank and 'mlp' in tuple(ffn.lora_targets):
    raise UserError(f"{label}LORA_TARGETS 'mlp' adapts dense MLPs; a mixture-of-experts layer's experts take no "
                    "adapters (they stay frozen). Adapt attention only, e.g. LORA_TARGETS=('query', 'value').")


def check_expert_axis(num_experts: int, axis_size: Optional[int], label: str = '') -> None:
  """One line when the mesh's expert axis does not divide a layer's experts."""
  if axis_size and num_experts % axis_size:
    raise UserError(f'{label}The expert mesh axis ({axis_size}, the 4th entry of a 5-entry ICI_MESH_SHAPE times '
                    f"DCN_MESH_SHAPE's) does not divide NUM_EXPERTS {num_experts}: every device on it holds the "
                    'same number of experts.')
