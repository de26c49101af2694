"""What the mixture-of-experts families (paxcli.models.mixtral, qwen3_moe) share: a Llama-shaped layer whose
MLP is NUM_EXPERTS gated SiLU experts behind a router (paxcli.layers.moe), every layer sparse.

Weight map of one layer's feed-forward (paxcli unrolled names; HF's nn.Linear weights are [out, in]):
  params/layer_i/mlp/router [D, E]          {moe}.gate.weight [E, D]
  params/layer_i/mlp/wi_0 [E, D, F], row e  {moe}.experts.e.{gate}.weight [F, D]
  params/layer_i/mlp/wi_1 [E, D, F], row e  {moe}.experts.e.{up}.weight [F, D]
  params/layer_i/mlp/wo [E, F, D], row e    {moe}.experts.e.{down}.weight [D, F]
({moe}: model.layers.i.block_sparse_moe for Mixtral, model.layers.i.mlp for Qwen3-MoE; {gate, up, down}:
w1, w3, w2 for Mixtral, gate_proj, up_proj, down_proj for Qwen3-MoE.) That per-expert spelling is what
released checkpoints hold and what transformers' save_pretrained writes (5.x too: it fuses the experts
as it loads and splits them again as it saves), so `--to hf` writes it. Inside transformers 5 the
experts are fused 3-D tensors, model.layers.i.mlp.experts.gate_up_proj [E, 2F, D] (the gate's F rows,
then the up projection's) and mlp.experts.down_proj [E, D, F], beside mlp.gate.weight; a directory
holding that spelling is read too (hf_read_weights).
"""

from __future__ import annotations

import numpy as np

from paxcli.errors import UserError
from paxcli.models import hf_config
from paxcli.models.family import Weight

# The fused spelling: the first array's name ends so.
FUSED_SUFFIX = '.mlp.experts.gate_up_proj'
# Keys of config.json that steer training only (transformers' router aux loss), moot for the function.
TRAINING_ONLY_KEYS = frozenset({'output_router_logits', 'router_aux_loss_coef'})


def _row(e: int):
  """(to_hf, from_hf) of expert e's nn.Linear weight [out, in] and row e [in, out] of a kernel [E, in, out]."""
  return (lambda x: np.ascontiguousarray(x[e].T), lambda w, shape: np.ascontiguousarray(w.T))


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
      out += [Weight(f'{mp}experts.{x}.{hf}.weight', f'{pp}mlp/{pax}', hf_shape, pax_shape, *_row(x), part=x)
              for x in range(e)]
    return out

  def hf_read_weights(self, model, names) -> list[Weight]:
    if not any(str(n).endswith(FUSED_SUFFIX) for n in names):
      return self.hf_weights(model)
    fused = {}
    for i in range(model.num_layers):
      fused[f'params/layer_{i}/mlp/'] = self.hf_fused_weights(model, f'model.layers.{i}.mlp.', f'params/layer_{i}/mlp/')
    return [w for w in self.hf_weights(model) if not _in_mlp(w, fused)] + [w for ws in fused.values() for w in ws]

  def hf_fused_weights(self, model, mp: str, pp: str) -> list[Weight]:
    """The fused spelling of one layer's experts (transformers 5's modules), read only."""
    d, f, e = model.model_dims, model.hidden_dims, model.num_experts
    to_nowhere = _written_per_expert

    def rows(lo, hi):
      return lambda w, shape: np.ascontiguousarray(np.swapaxes(w[:, lo:hi], 1, 2))
    return [Weight(mp + 'gate.weight', pp + 'router', (e, d), (d, e), *hf_config.linear(d)),
            Weight(mp + 'experts.gate_up_proj', pp + 'wi_0', (e, 2 * f, d), (e, d, f), to_nowhere, rows(0, f)),
            Weight(mp + 'experts.gate_up_proj', pp + 'wi_1', (e, 2 * f, d), (e, d, f), to_nowhere, rows(f, 2 * f)),
            Weight(mp + 'experts.down_proj', pp + 'wo', (e, d, f), (e, f, d), to_nowhere,
                   lambda w, shape: np.ascontiguousarray(np.swapaxes(w, 1, 2)))]

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


def _written_per_expert(x):
  raise AssertionError('the fused expert spelling is read only; --to hf writes the per-expert one')
