"""The Mixtral family: Hugging Face `MixtralForCausalLM` (Mixtral 8x7B, 8x22B and their fine-tunes).

A Mixtral layer is a Mistral layer (paxcli.models.mistral: Llama's attention, norms and rotary
convention) whose MLP is num_local_experts gated SiLU experts (NUM_EXPERTS) of intermediate_size
(HIDDEN_DIMS), num_experts_per_tok (EXPERTS_PER_TOKEN) of them per token, weighted by a softmax over
the chosen experts' router logits (ROUTER_SOFTMAX='after_topk'; the softmax over all experts with the
top k rescaled to sum to 1 is the same function, and exports as Mixtral too). Every layer is sparse.
Weight map: Llama's attention and norms, and the experts of paxcli.models.moe_family under
model.layers.i.block_sparse_moe (w1 gate, w3 up, w2 down).

config.json: sliding_window is null in every released Mixtral (full attention; SLIDING_WINDOW=0, also
where the key is missing, as in transformers' MixtralConfig); a number is read into SLIDING_WINDOW.
router_jitter_noise must be 0 (transformers adds noise to the router in training only, but refusing it
keeps a fine-tune from meaning another thing); output_router_logits and router_aux_loss_coef steer
transformers' training loss only and are read as moot.
"""

from __future__ import annotations

from typing import Optional

from paxcli.models import hf_config
from paxcli.models.family import MaxTextBlock
from paxcli.models.llama import MAXTEXT_LAYER, Llama
from paxcli.models.mistral import Mistral
from paxcli.models.moe_family import TRAINING_ONLY_KEYS, Experts, maxtext_moe_knobs


class Mixtral(Experts, Mistral):
  name = 'mixtral'
  title = 'Mixtral'
  description = ('Mixtral: a Mistral layer whose MLP is 8 experts, 2 per token, softmax over the chosen '
                 '(NUM_EXPERTS, EXPERTS_PER_TOKEN; HF MixtralForCausalLM)')
  knobs = {**Llama.knobs, 'NUM_EXPERTS': 8, 'EXPERTS_PER_TOKEN': 2, 'ROUTER_SOFTMAX': 'after_topk',
           'ROTARY_MAX_TIMESCALE': 1e6}
  hf_model_types = ('mixtral',)
  hf_architectures = ('MixtralForCausalLM',)
  hf_read_keys = Mistral.hf_read_keys | TRAINING_ONLY_KEYS | {'num_local_experts', 'num_experts_per_tok'}
  hf_neutral = {**Mistral.hf_neutral, 'router_jitter_noise': 0.0}
  # transformers' MixtralConfig defaults, for keys a config.json leaves out.
  hf_defaults = {'max_position_embeddings': 4096 * 32, 'rope_theta': 1e6, 'num_key_value_heads': 8,
                 'rms_norm_eps': 1e-5, 'sliding_window': None}
  sliding_window = None   # null (full attention) in the released models; a window converts too
  hf_moe_prefix = 'block_sparse_moe'
  hf_expert_names = ('w1', 'w3', 'w2')
  hf_experts_key = 'num_local_experts'
  # MaxText's mixtral decoder block: Llama's layer with routed experts (paxcli.models.moe_family:
  # maxtext_moe_knobs reads num_experts, num_experts_per_tok, capacity_factor, sparse_matmul and the
  # load-balancing weight). --from maxtext reads no MoE checkpoints yet: no layer parameters.
  maxtext_blocks = {'mixtral': MaxTextBlock(MAXTEXT_LAYER, from_config=maxtext_moe_knobs)}
  maxtext_layer_params = {}

  def router_misfit(self, model) -> list[str]:
    if model.router_softmax == 'before_topk' and not model.normalize_topk:
      return [f'the router\'s top-{model.experts_per_token} weights are not rescaled to sum to 1 (Mixtral\'s are a '
              'softmax over the chosen experts: ROUTER_SOFTMAX=\'after_topk\')']
    return []

  def from_hf_config(self, config: dict, path: str) -> tuple[dict, list[str]]:
    knobs, notes = Llama.from_hf_config(self, config, path)
    knobs['SLIDING_WINDOW'] = hf_config.sliding_window(config, path, self.hf_defaults['sliding_window'], self.title)
    get = hf_config.Reader(config, f'{path}/config.json', 'a Mixtral config')
    knobs.update(self.moe_knobs_from_hf(get, config), ROUTER_SOFTMAX='after_topk')
    return knobs, notes

  def to_hf_config(self, model, dtype: str = 'float32', token_ids: Optional[dict] = None) -> dict:
    return {**Llama.to_hf_config(self, model, dtype, token_ids), 'sliding_window': int(model.sliding_window) or None,
            'num_local_experts': int(model.num_experts), 'num_experts_per_tok': int(model.experts_per_token),
            'router_jitter_noise': 0.0, 'output_router_logits': False}


MIXTRAL = Mixtral()
