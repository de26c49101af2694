"""The Qwen 3 mixture-of-experts family: Hugging Face `Qwen3MoeForCausalLM` (Qwen3-30B-A3B, Qwen3-235B-A22B).

A Qwen3-MoE layer is a Qwen 3 layer (paxcli.models.qwen3: QK-norm, no biases, head_dim its own
setting) whose MLP is num_experts gated SiLU experts (NUM_EXPERTS) of moe_intermediate_size
(HIDDEN_DIMS), num_experts_per_tok (EXPERTS_PER_TOKEN) per token. The router takes a softmax over all
experts, then the k largest (ROUTER_SOFTMAX='before_topk'), rescaled to sum to 1 when norm_topk_prob
(ROUTER_NORMALIZE_TOPK; true in the released models, false where config.json leaves it out, as in
transformers' Qwen3MoeConfig). Weight map: Qwen 3's attention and norms, and the experts of
paxcli.models.moe_family under model.layers.i.mlp (gate_proj, up_proj, down_proj).

Every layer is sparse in the released models: decoder_sparse_step 1 and mlp_only_layers []. Other
values (dense layers among the sparse ones, whose MLP is intermediate_size wide) are refused by name;
with every layer sparse, intermediate_size is moot (no layer uses it) and an export writes HIDDEN_DIMS
there. Sliding-window keys and the tokenizer as for Qwen 2 (paxcli.models.qwen2); output_router_logits
and router_aux_loss_coef steer transformers' training loss only and are read as moot.
"""

from __future__ import annotations

from typing import Optional

from paxcli.models import hf_config
from paxcli.models.moe_family import TRAINING_ONLY_KEYS, Experts
from paxcli.models.qwen3 import Qwen3


class Qwen3Moe(Experts, Qwen3):
  name = 'qwen3_moe'
  title = 'Qwen3-MoE'
  description = ('Qwen 3 MoE: a Qwen 3 layer whose MLP is 128 experts, 8 per token, softmax before top-k '
                 '(NUM_EXPERTS, EXPERTS_PER_TOKEN, ROUTER_NORMALIZE_TOPK; HF Qwen3MoeForCausalLM)')
  knobs = {**Qwen3.knobs, 'NUM_EXPERTS': 128, 'EXPERTS_PER_TOKEN': 8, 'ROUTER_SOFTMAX': 'before_topk',
           'ROUTER_NORMALIZE_TOPK': True}
  hf_model_types = ('qwen3_moe',)
  hf_architectures = ('Qwen3MoeForCausalLM',)
  hf_read_keys = Qwen3.hf_read_keys | TRAINING_ONLY_KEYS | {
      'num_experts', 'num_local_experts', 'num_experts_per_tok', 'moe_intermediate_size', 'norm_topk_prob'}
  hf_neutral = {**Qwen3.hf_neutral, 'decoder_sparse_step': 1, 'mlp_only_layers': []}
  # transformers' Qwen3MoeConfig defaults, for keys a config.json leaves out. It has no head_dim of its own (Qwen 3's
  # 128 is not inherited): transformers takes hidden_size // num_attention_heads where config.json has none.
  hf_defaults = {'max_position_embeddings': 32768, 'rope_theta': 10000.0, 'num_key_value_heads': 4,
                 'rms_norm_eps': 1e-6}
  hf_experts_key = 'num_experts'
  hf_experts_aliases = ('num_local_experts',)   # what transformers 5 writes

  def from_hf_config(self, config: dict, path: str) -> tuple[dict, list[str]]:
    knobs, notes = super().from_hf_config(config, path)
    get = hf_config.Reader(config, f'{path}/config.json', 'a Qwen3-MoE config')
    knobs.update(self.moe_knobs_from_hf(get, config), HIDDEN_DIMS=get.int('moe_intermediate_size'),
                 ROUTER_SOFTMAX='before_topk', ROUTER_NORMALIZE_TOPK=get.bool('norm_topk_prob', False))
    return knobs, notes

  def to_hf_config(self, model, dtype: str = 'float32', token_ids: Optional[dict] = None) -> dict:
    normalized = model.router_softmax == 'after_topk' or bool(model.normalize_topk)
    return {**super().to_hf_config(model, dtype, token_ids), 'moe_intermediate_size': int(model.hidden_dims),
            'num_experts': int(model.num_experts), 'num_experts_per_tok': int(model.experts_per_token),
            'norm_topk_prob': normalized, 'decoder_sparse_step': 1, 'mlp_only_layers': [],
            'output_router_logits': False}


QWEN3_MOE = Qwen3Moe()
