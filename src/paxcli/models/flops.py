"""The FLOPs model: training FLOPs per token of a Transformer, as each model counts its own
(`train_flops(seq_len)`); paxcli.perf.flops divides them by time and a device's peak (MFU).

This module imports no jax: `pax describe` and the engine read it without the perf layer.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

# ---- training FLOPs ------------------------------------------------------------------------------
#
# Model FLOPs per token of a training step (forward + backward = 3 x forward, 2 FLOPs per
# multiply-add), as MaxText counts them since mid-2025:
#
#   6 x (per layer: QKV projections (grouped-query K/V heads) + output projection + MLP
#        (two input matrices when gated) ; plus the output head, D x V for an LM)
#   + per layer 12 x H x E x S attention (Q.K^T and probs.V, forward and backward),
#     halved for causal masking.
#
# A mixture-of-experts layer counts its active weights only: the router (D x E) and the k experts a
# token goes to (plus a shared expert), not all E. The token-embedding lookup, norms, softmax, biases,
# the optimizer, and the dispatch of tokens to experts (the capacity mode's one-hot einsums, the
# dropless mode's sorts) are not counted.
# PaLM's figure (appendix B) counts attention in full, without the causal halving; it is
# reported beside ours (`palm_per_token`) and is what XLA counts for the einsum attention,
# which computes every logit. paxcli.perf.flops turns these into MFU.


@dataclasses.dataclass(frozen=True)
class ModelFlops:
  """Training FLOPs per token of a Transformer model."""
  matmul_params: float        # weights that multiply activations, per token (no embedding lookup, norms, biases)
  attention_per_token: float  # 12 x layers x H x E x S, halved for causal masking
  palm_attention_per_token: float  # the same without halving

  @property
  def per_token(self) -> float:
    return 6.0 * self.matmul_params + self.attention_per_token

  @property
  def palm_per_token(self) -> float:
    return 6.0 * self.matmul_params + self.palm_attention_per_token

  def per_step(self, tokens: int) -> float:
    return self.per_token * tokens

  def __add__(self, other: 'ModelFlops') -> 'ModelFlops':
    """The FLOPs of two parts of one model (the kinds of a patterned stack)."""
    return ModelFlops(self.matmul_params + other.matmul_params, self.attention_per_token + other.attention_per_token,
                      self.palm_attention_per_token + other.palm_attention_per_token)


def stack_flops(layers, model_dims, heads, kv_heads, dims_per_head, hidden_dims, gated, seq_len: int,
                head_params_per_token: float = 0.0, causal: bool = True, num_experts: int = 0,
                experts_per_token: int = 1, shared_hidden_dims: int = 0,
                latent: Optional[tuple] = None) -> Optional[ModelFlops]:
  """The FLOPs of a stack of causal attention + MLP blocks and an output head; None when a
  setting is unknown (None: a swapped-in layer without it). num_experts > 0: each MLP is a mixture
  of experts of hidden_dims each, experts_per_token of them active (and a shared one of shared_hidden_dims).
  latent: multi-head latent attention's (q_lora_rank, kv_lora_rank, qk_nope, qk_rope, v head dims), counted as
  trained (keys and values expanded from the latent: its projections, then Q.K^T over nope + rope dims and
  probs.V over the value dims)."""
  if any(v is None for v in (layers, model_dims, heads, kv_heads, dims_per_head, hidden_dims, gated)):
    return None
  d, e = model_dims, dims_per_head
  qkv = d * e * (heads + 2 * kv_heads)
  out = heads * e * d
  mlp = d * hidden_dims * (3 if gated else 2)
  if num_experts:
    mlp = mlp * experts_per_token + d * num_experts + d * shared_hidden_dims * (3 if gated else 2)
  attention = 12.0 * layers * heads * e * seq_len
  if latent:
    q_rank, kv_rank, nope, rope, value = latent
    qkv = ((d * q_rank + q_rank * heads * (nope + rope)) if q_rank else d * heads * (nope + rope)) + \
        d * (kv_rank + rope) + kv_rank * heads * (nope + value)
    out = heads * value * d
    attention = 6.0 * layers * heads * (nope + rope + value) * seq_len
  return ModelFlops(matmul_params=layers * (qkv + out + mlp) + head_params_per_token,
                    attention_per_token=attention / 2 if causal else attention,
                    palm_attention_per_token=attention)


def for_model(model, seq_len: int) -> Optional[ModelFlops]:
  """The model's own training FLOPs at seq_len (its `train_flops`); None when it has no such
  method or cannot count this configuration (`unknown_flops` says which)."""
  count = getattr(model, 'train_flops', None)
  return count(seq_len) if count else None


def unknown_flops(model) -> str:
  """Why a model's MFU is not reported, in one line."""
  if getattr(model, 'train_flops', None) is None:
    return 'n/a: model has no FLOPs method'
  return f'n/a: {type(model).__name__}.train_flops() cannot count this configuration (a swapped-in layer?)'
