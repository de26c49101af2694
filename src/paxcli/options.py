"""Allowed values of every model and training option, declared once.

Knob annotations (paxcli.experiment, paxcli.models.lm_experiment), the validators (engine.validate_model,
the layers' own checks) and the MaxText importer all read these; adding a value is one
edit here plus its use in the layer. No jax here: `pax --help` stays quick.
"""

from __future__ import annotations

import typing
from typing import Literal

from paxcli.errors import UserError, did_you_mean

ActivationName = Literal['gelu', 'relu', 'silu', 'swish']
NormName = Literal['layernorm', 'rmsnorm']
PositionName = Literal['learned', 'rotary', 'sinusoidal', 'none']
RotaryScalingName = Literal['none', 'linear', 'llama3', 'longrope', 'yarn']  # paxcli.layers.transformer.ROTARY_SCALINGS
DTypeName = Literal['float32', 'bfloat16', 'float16']
CheckpointPolicyName = Literal['none', 'save_nothing', 'save_dot_only', 'save_dot_with_no_batch_dim',
                               'save_qkv_out_proj', 'save_everything']
AttentionImplName = Literal['auto', 'dot_product', 'blockwise', 'einsum']  # paxcli.layers.attention_ops
Fp8Name = Literal['none', 'delayed', 'current']                # paxcli.layers.fp8
MoeDispatchName = Literal['dropless', 'capacity']               # paxcli.layers.moe
RouterSoftmaxName = Literal['before_topk', 'after_topk', 'sigmoid']        # paxcli.layers.moe.route
CapacityRuleName = Literal['paxcli', 'praxis']                   # paxcli.layers.moe.expert_capacity
MlaDecodeName = Literal['auto', 'absorbed', 'expanded']          # paxcli.layers.mla
OptimizerName = Literal['adam', 'adamw', 'adafactor', 'sgd']
TrackerName = Literal['wandb', 'mlflow']  # paxcli.jobdir.trackers.NAMES
ScheduleName = Literal['constant', 'linear_rampup_cosine_decay', 'linear_rampup_exponential_decay']

ACTIVATIONS: tuple[str, ...] = typing.get_args(ActivationName)
NORMS: tuple[str, ...] = typing.get_args(NormName)
POSITIONS: tuple[str, ...] = typing.get_args(PositionName)
ROTARY_SCALINGS: tuple[str, ...] = typing.get_args(RotaryScalingName)
DTYPES: tuple[str, ...] = typing.get_args(DTypeName)
CHECKPOINT_POLICIES: tuple[str, ...] = typing.get_args(CheckpointPolicyName)
ATTENTION_IMPLS: tuple[str, ...] = typing.get_args(AttentionImplName)
MOE_DISPATCHES: tuple[str, ...] = typing.get_args(MoeDispatchName)
ROUTER_SOFTMAXES: tuple[str, ...] = typing.get_args(RouterSoftmaxName)
CAPACITY_RULES: tuple[str, ...] = typing.get_args(CapacityRuleName)
MLA_DECODES: tuple[str, ...] = typing.get_args(MlaDecodeName)
FP8_MODES: tuple[str, ...] = typing.get_args(Fp8Name)
OPTIMIZERS: tuple[str, ...] = typing.get_args(OptimizerName)
SCHEDULES: tuple[str, ...] = typing.get_args(ScheduleName)

# Config field name (on any layer of a model) -> its allowed values; engine.validate_model
# checks every layer config of the model against this table.
MODEL_FIELDS: dict[str, tuple[str, ...]] = {
    'activation': ACTIVATIONS,
    'norm_type': NORMS,
    'kind': NORMS,  # Norm.kind
    'position_embedding': POSITIONS,
    'rotary_scaling': ROTARY_SCALINGS,
    'fprop_dtype': DTYPES,
    'checkpoint_policy': CHECKPOINT_POLICIES,
    'attention_impl': ATTENTION_IMPLS,
    'dispatch': MOE_DISPATCHES,          # MoeFeedForward.dispatch
    'router_softmax': ROUTER_SOFTMAXES,
    'capacity_rule': CAPACITY_RULES,
    'decode': MLA_DECODES,               # LatentAttention.decode
    'fp8': FP8_MODES,
}


def check(field: str, value, allowed: tuple[str, ...], where: str) -> None:
  if value not in allowed:
    hint = did_you_mean(str(value), allowed) if isinstance(value, str) else ''
    raise UserError(f'{where}.{field} = {value!r} is not one of {list(allowed)}.{hint}')
