"""What the mixture-of-experts families (paxcli.models.mixtral, qwen3_moe) share: a Llama-shaped layer whose
MLP is NUM_EXPERTS gated SiLU experts behind a router (paxcli.layers.moe), every layer sparse.

Weight map of one layer's feed-forward (paxcli unrolled names; HF's nn.Linear weights are [out, in]):
  params/layer_i/mlp/router [D, E]          {moe}.gate.weight [E, D]
  params/layer_i/mlp/wi_0 [E, D, F], row e  {moe}.experts.e.{gate}.weight [F, D]   (E arrays joined: Piece(0, e))
  params/layer_i/mlp/wi_1 [E, D, F], row e  {moe}.experts.e.{up}.weight [F, D]
  params/layer_i/mlp/wo [E, F, D], row e    {moe}.experts.e.{down}.weight [D, F]
({moe}: model.layers.i.block_sparse_moe for Mixtral, model.layers.i.mlp for Qwen3-MoE; {gate, up, down}:
w1, w3, w2 for Mixtral, gate_proj, up_proj, down_proj for Qwen3-MoE.) That per-expert spelling is what
released checkpoints hold and what transformers' save_pretrained writes (5.x too: it fuses the experts
as it loads and splits them again as it saves), so `--to hf` writes it. Inside transformers 5 the
experts are fused 3-D tensors, model.layers.i.mlp.experts.gate_up_proj [E, 2F, D] (the gate's F rows,
then the up projection's) and mlp.experts.down_proj [E, D, F], beside mlp.gate.weight; a directory
holding that spelling is read too (hf_read_weights; one array, two pieces: paxcli.models.weight_map.fuse).
"""

from __future__ import annotations

import math

import numpy as np

from paxcli.errors import UserError
from paxcli.models import hf_config
from paxcli.models.family import Piece, Weight, fuse

# The fused spelling: the first array's name ends so.
FUSED_SUFFIX = '.mlp.experts.gate_up_proj'
# Keys of config.json that steer training only (transformers' router aux loss), moot for the function.
TRAINING_ONLY_KEYS = frozenset({'output_router_logits', 'router_aux_loss_coef'})


# (to_hf, from_hf) of one expert's nn.Linear weight [out, in] and its row [in, out] of a kernel [E, in, out].
_EXPERT_ROW = (lambda x: np.ascontiguousarray(x.T), lambda w, shape: np.ascontiguousarray(w.T))
# The same for all experts at once: transformers 5's [E, out, in] and the kernel [E, in, out].
_EXPERT_ROWS = (lambda x: np.ascontiguousarray(np.swapaxes(x, 1, 2)),
                lambda w, shape: np.ascontiguousarray(np.swapaxes(w, 1, 2)))


class Experts:
  """Mixed into a Llama-shaped family (before it: class Mixtral(Experts, Mistral)): the MLP is experts."""
  hf_moe_prefix = 'mlp'                                   # below model.layers.i.
  hf_expert_names = ('gate_proj', 'up_proj', 'down_proj')  # wi_0, wi_1, wo
  hf_experts_key = 'num_experts'                           # config.json's expert count (and its other spellings)
  hf_experts_aliases: tuple[str, ...] = ()

  def mlp_misfit(self, model) -> list[str]:
    title, e = self.title, getattr(model, 'num_experts', 0)
    if not e:
      return [f'the MLP is dense (a {title} MLP is a mixture of experts: NUM_EXPERTS={self.knobs["NUM_EXPERTS"]}, '
              f'EXPERTS_PER_TOKEN={self.knobs["EXPERTS_PER_TOKEN"]})']
    reasons = self.router_misfit(model)
    if getattr(model, 'router_softmax', None) == 'sigmoid':
      reasons.append(f'the router scores experts by a sigmoid (ROUTER_SOFTMAX=\'sigmoid\'; {title}\'s takes a softmax)')
    if (getattr(model, 'router_groups', 1) or 1) > 1:
      reasons.append(f'routing is group-limited (ROUTER_GROUPS {model.router_groups}; {title}\'s is not: 1)')
    if (getattr(model, 'routed_scale', 1.0) or 1.0) != 1.0:
      reasons.append(f'the routed weights are scaled (ROUTED_SCALING_FACTOR {model.routed_scale}; {title}: 1.0)')
    if getattr(model, 'shared_hidden_dims', 0):
      reasons.append(f'a shared expert of {model.shared_hidden_dims} units (SHARED_EXPERT_HIDDEN_DIMS; {title} has '
                     'none: 0)')
    if getattr(model, 'moe_dispatch', 'dropless') != 'dropless':
      reasons.append(f'capacity dispatch drops tokens (MOE_DISPATCH={model.moe_dispatch!r}; {title} computes every '
                     'choice: MOE_DISPATCH=\'dropless\')')
    return reasons

  def router_misfit(self, model) -> list[str]:
    return []

  def hf_mlp_weights(self, model, layer: int, hp: str, pp: str) -> list[Weight]:
    d, f, e = model.model_dims, model.hidden_dims, model.num_experts
    mp = f'{hp}{self.hf_moe_prefix}.'
    out = [Weight(mp + 'gate.weight', pp + 'mlp/router', (e, d), (d, e), *hf_config.linear(d))]
    shapes = {'wi_0': ((f, d), (e, d, f)), 'wi_1': ((f, d), (e, d, f)), 'wo': ((d, f), (e, f, d))}
    for pax, hf in zip(('wi_0', 'wi_1', 'wo'), self.hf_expert_names):
      hf_shape, pax_shape = shapes[pax]
      out += [Weight(f'{mp}experts.{x}.{hf}.weight', f'{pp}mlp/{pax}', hf_shape, pax_shape, *_EXPERT_ROW,
                     paxcli_piece=Piece(0, x)) for x in range(e)]
    return out

  def hf_read_weights(self, model, names) -> list[Weight]:
    if not any(str(n).endswith(FUSED_SUFFIX) for n in names):
      return self.hf_weights(model)
    fused = {}
    for i in range(model.num_layers):
      fused[f'params/layer_{i}/mlp/'] = self.hf_fused_weights(model, f'model.layers.{i}.mlp.', f'params/layer_{i}/mlp/')
    return [w for w in self.hf_weights(model) if not _in_mlp(w, fused)] + [w for ws in fused.values() for w in ws]

  def hf_fused_weights(self, model, mp: str, pp: str) -> list[Weight]:
    """The fused spelling of one layer's experts (transformers 5's modules): gate_up_proj holds the gate's F
    rows, then the up projection's, of every expert."""
    d, f, e = model.model_dims, model.hidden_dims, model.num_experts
    return [Weight(mp + 'gate.weight', pp + 'router', (e, d), (d, e), *hf_config.linear(d)),
            *fuse(mp + 'experts.gate_up_proj', 1, [Weight('', pp + 'wi_0', (e, f, d), (e, d, f), *_EXPERT_ROWS),
                                                   Weight('', pp + 'wi_1', (e, f, d), (e, d, f), *_EXPERT_ROWS)]),
            Weight(mp + 'experts.down_proj', pp + 'wo', (e, d, f), (e, f, d), *_EXPERT_ROWS)]

  def moe_knobs_from_hf(self, get: hf_config.Reader, config: dict) -> dict:
    """NUM_EXPERTS and EXPERTS_PER_TOKEN of config.json (under any spelling of the expert count)."""
    key = next((k for k in (self.hf_experts_key, *self.hf_experts_aliases) if config.get(k) is not None),
               self.hf_experts_key)
    experts, k = get.int(key), get.int('num_experts_per_tok')
    if k > experts:
      raise UserError(f'{get.where}: num_experts_per_tok {k} is more than {key} {experts}.')
    return {'NUM_EXPERTS': experts, 'EXPERTS_PER_TOKEN': k}


def _in_mlp(w: Weight, fused: dict) -> bool:
  return any(w.paxcli.startswith(prefix) for prefix in fused)


# ---- MaxText's routed MoE (decoder_block=mixtral; MaxText layers/moe.py RoutedMoE) ------------------------

def _maxtext_number(get, key: str, fallback, whole: bool):
  value = get(key, fallback)
  if value is None or value == '':
    value = fallback
  if isinstance(value, bool) or not isinstance(value, (int, float)) or (whole and not float(value).is_integer()):
    raise UserError(f'{key}={value!r} must be a {"whole " if whole else ""}number.')
  return int(value) if whole else float(value)


def _maxtext_flag(get, key: str, fallback: bool) -> bool:
  value = get(key, fallback)
  if not isinstance(value, bool):
    raise UserError(f'{key}={value!r} must be true or false.')
  return value


def maxtext_capacity(length: int, num_experts: int, k: int, factor: float) -> int:
  """MaxText's expert capacity per sequence (RoutedMoE.generate_masks): int(max(ceil(L k / E) x factor, factor))."""
  return int(max(math.ceil(length * k / num_experts) * factor, factor))


def _expert_capacity(length: int, num_experts: int, k: int, factor: float) -> int:
  """paxcli's capacity rounding (paxcli.layers.moe: flax, imported only where a capacity run needs it)."""
  from paxcli.layers.moe import expert_capacity
  return expert_capacity(length, num_experts, k, factor)


def capacity_factor_for(length: int, num_experts: int, k: int, capacity: int) -> float:
  """The EXPERT_CAPACITY_FACTOR that gives paxcli `capacity` slots at sequence length `length`: capacity x E / (L k)
  where that rounds back, else half a slot less (ceil then lands on `capacity` whatever the float rounding)."""
  exact = capacity * num_experts / (length * k)
  if _expert_capacity(length, num_experts, k, exact) == capacity:
    return exact
  return (capacity - 0.5) * num_experts / (length * k)


def maxtext_moe_knobs(get, knobs) -> list:
  """What a MaxText decoder block of routed experts (mixtral) takes from the run's config, as rows
  (knob, value, MaxText keys[, how it was computed]); one line for settings MaxText would compute otherwise or
  refuse. `knobs` holds the sizes so far (NUM_LAYERS, HIDDEN_DIMS, MAX_SEQ_LEN).

  num_experts 1 (base.yml's) is a dense MLP: a softmax over one expert weighs it 1. MaxText's dispatch:
  sparse_matmul (megablox or ragged_dot grouped matmuls) computes every choice, and so does its dense path with
  capacity_factor < 0; the dense path with capacity_factor > 0 drops what overflows a capacity per sequence.
  Its load-balancing loss is k when balanced and averaged over layers; paxcli's is 1 when balanced and summed
  over layers, so the weight is scaled by k / layers for the same total."""
  experts = _maxtext_number(get, 'num_experts', 1, whole=True)
  k = _maxtext_number(get, 'num_experts_per_tok', 1, whole=True)
  moe_mlp = _maxtext_number(get, 'base_moe_mlp_dim', -1, whole=True)
  if experts < 1 or k < 1:
    raise UserError(f'num_experts={experts} and num_experts_per_tok={k} must be at least 1.')
  if k > experts:
    raise UserError(f'num_experts_per_tok={k} is more than num_experts={experts}: each token picks k of the experts.')
  factor = _maxtext_number(get, 'capacity_factor', -1.0, whole=False)
  sparse = _maxtext_flag(get, 'sparse_matmul', _maxtext_flag(get, 'megablox', True))
  weight = _maxtext_number(get, 'load_balance_loss_weight', 0.0, whole=False)
  if experts == 1:
    return []
  if moe_mlp > 0 and moe_mlp != get('base_mlp_dim'):
    raise UserError(f'base_moe_mlp_dim={moe_mlp} differs from base_mlp_dim={get("base_mlp_dim")}: MaxText refuses '
                    'that in a model whose every layer is a mixture of experts (set them equal).')
  if not sparse and factor == 0:
    raise UserError('capacity_factor=0 with sparse_matmul=false: a capacity of 0 tokens per expert (MaxText reads '
                    'only a negative factor as dropless). Set capacity_factor=-1 for dropless, or a positive factor.')
  if weight < 0:
    raise UserError(f'load_balance_loss_weight={weight} must be 0 (off) or positive.')
  layers = knobs['NUM_LAYERS']
  out = [('NUM_EXPERTS', experts, 'num_experts'), ('EXPERTS_PER_TOKEN', k, 'num_experts_per_tok'),
         ('ROUTER_SOFTMAX', 'after_topk', 'decoder_block', 'softmax over the chosen k router logits, as MaxText'),
         ('LOAD_BALANCE_LOSS_WEIGHT', weight * k / layers, 'load_balance_loss_weight',
          f'{weight * k / layers:g} (= {weight:g} x k {k} / {layers} layers: MaxText averages over layers a loss of '
          'k when balanced, paxcli sums one of 1)' if weight else '')]
  if sparse or factor < 0:
    how = 'sparse_matmul=true: grouped matmuls' if sparse else 'capacity_factor < 0: no dropping'
    return out + [('MOE_DISPATCH', 'dropless', 'sparse_matmul, capacity_factor', f'dropless ({how})')]
  length = knobs['MAX_SEQ_LEN']
  capacity = maxtext_capacity(length, experts, k, factor)
  if capacity < 1:
    raise UserError(f'capacity_factor={factor:g} gives each expert {capacity} tokens of a {length}-token sequence '
                    f'(MaxText: int(max(ceil({length} x {k} / {experts}) x {factor:g}, {factor:g}))): every token '
                    'would be dropped. Raise it, or set capacity_factor=-1 for dropless.')
  slots = min(capacity, length)   # an expert takes at most every token of a sequence
  ours = factor if _expert_capacity(length, experts, k, factor) == slots else capacity_factor_for(length, experts, k,
                                                                                                  slots)
  after = f'{slots} tokens per expert per {length}-token sequence, as MaxText'
  if ours != factor:
    after = f'{ours:.6g} ({after}; paxcli rounds ceil(factor x L k / E), MaxText int(ceil(L k / E) x factor))'
  return out + [('MOE_DISPATCH', 'capacity', 'sparse_matmul, capacity_factor', 'capacity (sparse_matmul=false)'),
                ('EXPERT_CAPACITY_FACTOR', ours, 'capacity_factor', after)]
