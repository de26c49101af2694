"""MaxText facts as data: scaling eras, dated base.yml defaults, model presets and tables.

Sources: MaxText's public history (google/maxtext, now AI-Hypercomputer/maxtext):
`MaxText/configs/base.yml` at several points, `configs/models/*.yml`, and `pyconfig.py`'s
scaling rules. Dates of base.yml snapshots are the first date each set of defaults is known
to be in force, to the month where the exact commit is not known; an import says which
snapshot it used, and `--base-config` reads a user's own base.yml instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from paxcli.models.family import MaxTextBlock


# ---- scaling eras ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Era:
  name: str
  start: Optional[str]   # ISO date the rule took effect (None: MaxText's first release)
  end: Optional[str]     # ISO date it was replaced (None: still in force)
  scale_key: str         # the key holding the size factor
  rule: str              # one line for humans


ERAS: dict[str, Era] = {
    'scale': Era('scale', None, '2023-07-21', 'scale',
                 'emb, heads, mlp and layers are each `scale` x base value'),
    'jul2023': Era('jul2023', '2023-07-21', '2023-07-31', 'global_parameter_scale',
                   'b, r = divmod(log2(scale), 3); multipliers emb = b+1+(r>0), '
                   'heads = mlp = b+1+(r>1), layers = b+1'),
    'aug2023': Era('aug2023', '2023-07-31', '2023-09-07', 'global_parameter_scale',
                   'b, r = divmod(log2(scale), 3); powers of two, emb = 2**(b+(r>0)), '
                   'heads = mlp = 2**(b+(r>1)), layers = 2**b'),
    'current': Era('current', '2023-09-07', None, 'global_parameter_scale',
                   'b, r = divmod(log2(scale), 3); powers of two, heads = mlp = 2**(b+(r>0)), '
                   'emb = 2**(b+(r>1)), layers = 2**b (query and kv heads both)'),
}
ERA_ORDER = ('scale', 'jul2023', 'aug2023', 'current')


def era_at(date: str) -> str:
  """The era in force on an ISO date (YYYY-MM-DD)."""
  for name in reversed(ERA_ORDER):
    start = ERAS[name].start
    if start is None or date >= start:
      return name
  return ERA_ORDER[0]


# ---- dated base.yml defaults -------------------------------------------------------

# Parallelism of the first base.yml: fixed sizes for a v4-8 (4 devices).
_MESH_FIXED_2023 = {
    'dcn_data_parallelism': 1, 'dcn_fsdp_parallelism': 1, 'dcn_tensor_parallelism': 1,
    'ici_data_parallelism': 1, 'ici_fsdp_parallelism': 4, 'ici_tensor_parallelism': 1,
}
# From mid 2023 one axis per network may be -1: fill the remaining devices / slices.
_MESH_FILL = {
    'dcn_data_parallelism': -1, 'dcn_fsdp_parallelism': 1, 'dcn_tensor_parallelism': 1,
    'ici_data_parallelism': 1, 'ici_fsdp_parallelism': -1, 'ici_tensor_parallelism': 1,
}
_MESH_FILL_LATE_2023 = dict(_MESH_FILL, dcn_sequence_parallelism=1, dcn_autoregressive_parallelism=1,
                            ici_sequence_parallelism=1, ici_autoregressive_parallelism=1)
_MESH_FILL_2024 = dict(_MESH_FILL_LATE_2023, dcn_fsdp_transpose_parallelism=1,
                       ici_fsdp_transpose_parallelism=1)

# The 2023 trainer: T5-derived decoder, relu MLP, tied logits, warm-up then rsqrt decay.
_MODEL_2023 = {
    'base_emb_dim': 2048, 'base_num_heads': 8, 'base_mlp_dim': 8192, 'base_num_decoder_layers': 16,
    'head_dim': 256, 'mlp_activations': ['relu'], 'dropout_rate': 0, 'logits_via_embedding': True,
    'remat_policy': 'minimal', 'scan_layers': True, 'param_scan_axis': 1, 'dtype': 'bfloat16',
    'vocab_size': 32768, 'per_device_batch_size': 32, 'max_target_length': 1024,
}
_TRAIN_2023 = {
    'steps': 150001, 'log_period': 10, 'save_period': 10000, 'learning_rate': 3e-5,
    'warmup_steps': 15000, 'adam_b1': 0.9, 'adam_b2': 0.95, 'adam_eps': 1e-8, 'adam_eps_root': 0.0,
    'enable_checkpointing': True, 'enable_dropout': True, 'enable_data_shuffling': True,
    'run_name': '', 'base_output_directory': '', 'dataset_path': '', 'load_parameters_path': '',
    'reuse_example_batch': 0, 'metrics_file': '', 'enable_profiler': False,
}
# Autumn 2023: ~1B parameters at scale 1, Llama-2-style cosine schedule and AdamW.
_MODEL_AUTUMN_2023 = dict(
    _MODEL_2023, base_emb_dim=2560, remat_policy='full', per_device_batch_size=12.0,
    max_target_length=2048)
_TRAIN_AUTUMN_2023 = {
    'steps': 150001, 'log_period': 100, 'checkpoint_period': 10000, 'learning_rate': 3e-5,
    'cosine_learning_rate_final_fraction': 0.1, 'warmup_steps_fraction': 0.1,
    'learning_rate_schedule_steps': -1, 'gradient_clipping_threshold': 1.0, 'adam_b1': 0.9,
    'adam_b2': 0.95, 'adam_eps': 1e-8, 'adam_eps_root': 0.0, 'adam_weight_decay': 0.1,
    'enable_checkpointing': True, 'async_checkpointing': True, 'enable_dropout': True,
    'enable_data_shuffling': True, 'data_shuffle_seed': 0, 'init_weights_seed': 0,
    'dataset_type': 'c4', 'run_name': '', 'base_output_directory': '', 'dataset_path': '',
    'load_parameters_path': '', 'load_full_state_path': '', 'reuse_example_batch': 0,
    'metrics_file': '', 'gcs_metrics': False, 'enable_profiler': False, 'int8_training': False,
    'attention': 'flash', 'fused_qkv': False, 'fused_mlp': False,
}


@dataclasses.dataclass(frozen=True)
class Snapshot:
  name: str
  start: str           # ISO date (or month) from which these defaults are known
  era: str
  description: str
  values: dict[str, Any]


SNAPSHOTS: tuple[Snapshot, ...] = (
    Snapshot('early-2023', '2023-04-01', 'scale',
             'first public base.yml: `scale`, base_num_heads, fixed mesh (ici_fsdp 4)',
             {'scale': 1, **_MODEL_2023, **_TRAIN_2023, **_MESH_FIXED_2023}),
    Snapshot('mid-2023', '2023-06-01', 'scale',
             '`scale`, base_num_heads; mesh axes may be -1 (ici_fsdp and dcn_data fill)',
             {'scale': 1, **_MODEL_2023, **_TRAIN_2023, **_MESH_FILL}),
    Snapshot('jul-2023', '2023-07-21', 'jul2023',
             '`global_parameter_scale` replaces `scale` (multiplier rule)',
             {'global_parameter_scale': 1, **_MODEL_2023, **_TRAIN_2023, 'gcs_metrics': False,
              'int8_training': False, **_MESH_FILL}),
    Snapshot('aug-2023', '2023-07-31', 'aug2023',
             '`global_parameter_scale` as powers of two, embedding first',
             {'global_parameter_scale': 1, **_MODEL_2023, **_TRAIN_2023, 'gcs_metrics': False,
              'int8_training': False, **_MESH_FILL}),
    Snapshot('autumn-2023', '2023-09-07', 'current',
             'heads/mlp first; emb 2560, batch 12, length 2048, remat full, cosine schedule',
             {'global_parameter_scale': 1, **_MODEL_AUTUMN_2023, **_TRAIN_AUTUMN_2023,
              'opt_type': 'adamw', **_MESH_FILL_LATE_2023}),
    Snapshot('end-2023', '2023-12-01', 'current',
             'base_num_query_heads / base_num_kv_heads (8 each) replace base_num_heads; '
             'decoder_block and model_name keys',
             {'global_parameter_scale': 1,
              **{k: v for k, v in _MODEL_AUTUMN_2023.items() if k != 'base_num_heads'},
              'base_num_query_heads': 8, 'base_num_kv_heads': 8, 'decoder_block': 'default',
              'model_name': 'default', 'normalization_layer_epsilon': 1e-6,
              'normalize_embedding_logits': True, 'logits_dot_in_fp32': True,
              'num_experts': 1, 'num_experts_per_tok': 1,
              **_TRAIN_AUTUMN_2023, 'opt_type': 'adamw', **_MESH_FILL_LATE_2023}),
    Snapshot('2024', '2024-03-01', 'current',
             'Llama-2-like defaults: emb 2048, 16 query/kv heads, mlp 7168, head_dim 128, '
             'gated silu, vocab 32000, float32 weights',
             {'global_parameter_scale': 1, 'base_emb_dim': 2048, 'base_num_query_heads': 16,
              'base_num_kv_heads': 16, 'base_mlp_dim': 7168, 'base_num_decoder_layers': 16,
              'head_dim': 128, 'mlp_activations': ['silu', 'linear'], 'dropout_rate': 0,
              'logits_via_embedding': False, 'normalize_embedding_logits': True,
              'remat_policy': 'full', 'scan_layers': True, 'param_scan_axis': 1,
              'dtype': 'bfloat16', 'weight_dtype': 'float32', 'decoder_block': 'llama2',
              'model_name': 'default', 'normalization_layer_epsilon': 1e-5,
              'num_experts': 1, 'num_experts_per_tok': 1, 'quantization': '',
              'vocab_size': 32000, 'per_device_batch_size': 12.0, 'max_target_length': 2048,
              'rope_max_timescale': 10000, 'attention': 'autoselected',
              **{k: v for k, v in _TRAIN_AUTUMN_2023.items() if k not in ('attention', 'int8_training')},
              'opt_type': 'adamw', **_MESH_FILL_2024}),
)
SNAPSHOT_BY_NAME = {s.name: s for s in SNAPSHOTS}


# MaxText's mixture-of-experts defaults by date (base.yml history; the dated snapshots above predate them):
# megablox False from 2024-06-05 and True from 2024-07-01 (it chose the sparse, dropless path until
# sparse_matmul did); capacity_factor -1.0 (no dropping) since 2024-08-14; load_balance_loss_weight 0.01
# from 2024-08-31 and 0.0 since 2025-12-26; sparse_matmul True since 2025-01-15.
MOE_DEFAULT_CHANGES: tuple[tuple[str, str, Any], ...] = (
    ('2024-06-05', 'megablox', False), ('2024-07-01', 'megablox', True),
    ('2024-08-14', 'capacity_factor', -1.0), ('2024-08-31', 'load_balance_loss_weight', 0.01),
    ('2025-01-15', 'sparse_matmul', True), ('2025-12-26', 'load_balance_loss_weight', 0.0),
)


def moe_defaults(date: Optional[str]) -> dict[str, Any]:
  """MaxText's MoE defaults on an ISO date (None: today's MaxText), the keys base.yml had then."""
  values: dict[str, Any] = {}
  for since, key, value in MOE_DEFAULT_CHANGES:
    if date is None or date >= since:
      values[key] = value
  return values


def snapshot_at(date: str) -> Snapshot:
  """The base.yml snapshot in force on an ISO date (the first one before its start)."""
  chosen = SNAPSHOTS[0]
  for snap in SNAPSHOTS:
    if date >= snap.start:
      chosen = snap
  return chosen


# ---- model presets (configs/models/<name>.yml) ----------------------------------

def _llama(emb, q, kv, mlp, layers, vocab, **extra):
  return {'base_emb_dim': emb, 'base_num_query_heads': q, 'base_num_kv_heads': kv,
          'base_mlp_dim': mlp, 'base_num_decoder_layers': layers, 'head_dim': 128,
          'mlp_activations': ['silu', 'linear'], 'vocab_size': vocab, 'enable_dropout': False,
          'logits_via_embedding': False, 'normalization_layer_epsilon': 1e-5,
          'decoder_block': 'llama2', **extra}


def _gemma(emb, q, kv, mlp, layers, head_dim, block, **extra):
  return {'base_emb_dim': emb, 'base_num_query_heads': q, 'base_num_kv_heads': kv,
          'base_mlp_dim': mlp, 'base_num_decoder_layers': layers, 'head_dim': head_dim,
          'mlp_activations': ['gelu', 'linear'], 'vocab_size': 256128, 'decoder_block': block,
          'normalization_layer_epsilon': 1e-6, 'logits_via_embedding': True, **extra}


_GEMMA2 = {'final_logits_soft_cap': 30.0, 'attn_logits_soft_cap': 50.0, 'sliding_window_size': 4096,
           'use_post_attn_norm': True, 'use_post_ffw_norm': True}
_GEMMA3 = {'vocab_size': 262_144, 'sliding_window_size': 1024, 'use_post_attn_norm': True, 'use_post_ffw_norm': True,
           'local_rope_max_timescale': 10_000, 'rope_max_timescale': 1_000_000, 'rope_linear_scaling_factor': 8.0}

PRESETS: dict[str, dict[str, Any]] = {
    'llama2-7b': _llama(4096, 32, 32, 11008, 32, 32000),
    'llama2-13b': _llama(5120, 40, 40, 13824, 40, 32000),
    'llama2-70b': _llama(8192, 64, 8, 28672, 80, 32000),
    'llama3-8b': _llama(4096, 32, 8, 14336, 32, 128256, rope_max_timescale=500_000),
    'llama3-70b': _llama(8192, 64, 8, 28672, 80, 128256, rope_max_timescale=500_000),
    'llama3.1-405b': _llama(16384, 128, 8, 53248, 126, 128256, rope_max_timescale=500_000),
    'mistral-7b': _llama(4096, 32, 8, 14336, 32, 32000, rope_max_timescale=1_000_000,
                         decoder_block='mistral'),
    'mixtral-8x7b': _llama(4096, 32, 8, 14336, 32, 32000, rope_max_timescale=1_000_000,
                           decoder_block='mixtral', base_moe_mlp_dim=14336, num_experts=8,
                           num_experts_per_tok=2),
    'mixtral-8x22b': _llama(6144, 48, 8, 16384, 56, 32768, rope_max_timescale=1_000_000,
                            decoder_block='mixtral', base_moe_mlp_dim=16384, num_experts=8,
                            num_experts_per_tok=2),
    'gemma-2b': _gemma(2048, 8, 1, 16384, 18, 256, 'gemma'),
    'gemma-7b': _gemma(3072, 16, 16, 24576, 28, 256, 'gemma'),
    # Gemma 2: MaxText counts a (local, global) attention pair as one decoder layer.
    'gemma2-2b': _gemma(2304, 8, 4, 9216, 13, 256, 'gemma2', **_GEMMA2),
    'gemma2-9b': _gemma(3584, 16, 8, 14336, 21, 256, 'gemma2', **_GEMMA2),
    'gemma2-27b': _gemma(4608, 32, 16, 36864, 23, 128, 'gemma2', **_GEMMA2),
    # Gemma 3 (text): one decoder layer each, five local to one global; rope per kind.
    'gemma3-4b': _gemma(2560, 8, 4, 10240, 34, 256, 'gemma3', **_GEMMA3),
    'gemma3-12b': _gemma(3840, 16, 8, 15360, 48, 256, 'gemma3', **_GEMMA3),
    'gemma3-27b': _gemma(5376, 32, 16, 21504, 62, 128, 'gemma3', **_GEMMA3),
    'gpt3-175b': {
        'base_emb_dim': 12288, 'base_num_query_heads': 96, 'base_num_kv_heads': 96,
        'base_mlp_dim': 49152, 'base_num_decoder_layers': 96, 'head_dim': 128,
        'trainable_position_size': 16384, 'mlp_activations': ['gelu'], 'vocab_size': 50304,
        'enable_dropout': False, 'logits_via_embedding': True, 'normalize_embedding_logits': False,
        'logits_dot_in_fp32': False, 'normalization_layer_epsilon': 1e-5, 'use_iota_embed': True,
        'fused_qkv': True, 'opt_type': 'adam_pax', 'decoder_block': 'gpt3',
        'gradient_clipping_threshold': 1.0, 'adam_b1': 0.9, 'adam_b2': 0.95, 'adam_eps': 1e-8,
        'adam_weight_decay': 0.1, 'checkpoint_period': 10000,
    },
}


# ---- decoder blocks ----------------------------------------------------------------

# Since 2024 MaxText's default decoder layer is attention and MLP in parallel from one RMSNorm
# with rotary positions (PARALLEL_BLOCK); the 2023 one differs in what DEFAULT_BLOCK_2023 says.
DEFAULT_BLOCK_SINCE = '2024-03-01'
DEFAULT_BLOCK_2023 = ("MaxText's 2023 default decoder layer also has T5 relative position biases and "
                      'query/key norms; paxcli builds a parallel layer with rotary positions')

# The decoder blocks a paxcli model family computes are that family's (paxcli.models.registry:
# llama2, mistral and default are the Llama family's, mixtral the Mixtral family's). These are the
# others: the knobs nearest to them, and why paxcli's layer would be a different model.
_NEAREST = {'NORM_TYPE': 'rmsnorm', 'USE_BIAS': False, 'POSITION_EMBEDDING': 'rotary'}
OTHER_DECODER_BLOCKS: dict[str, MaxTextBlock] = {
    'gemma': MaxTextBlock(_NEAREST, 'Gemma layers scale embeddings by sqrt(emb_dim) and store norm scales as 1+w'),
    'gpt3': MaxTextBlock({'NORM_TYPE': 'layernorm', 'USE_BIAS': True, 'POSITION_EMBEDDING': 'learned'}),
}


# ---- remat_policy -> CHECKPOINT_POLICY ------------------------------------------

# MaxText remat policy -> (CHECKPOINT_POLICY, None if exact else what differs).
# Remat changes memory and speed, never the numbers a step computes.
REMAT: dict[str, tuple[str, Optional[str]]] = {
    'full': ('save_nothing', None),
    'none': ('none', None),
    'minimal': ('save_dot_with_no_batch_dim', None),
    'minimal_with_context': ('save_dot_with_no_batch_dim', 'MaxText also saves the attention context'),
    'minimal_offloaded': ('save_dot_with_no_batch_dim', 'MaxText offloads them to host memory'),
    'save_dot_except_mlp': ('save_qkv_out_proj', None),
    'save_dot_except_mlpwi': ('save_qkv_out_proj', 'MaxText also saves the MLP output projection'),
    'save_dot_with_context_except_mlp': ('save_qkv_out_proj', 'MaxText also saves the attention context'),
    'save_qkv_proj': ('save_qkv_out_proj', 'MaxText saves only q/k/v, not the output projection'),
    'qkv_proj_offloaded': ('save_qkv_out_proj', 'MaxText offloads q/k/v to host memory'),
    'save_out_proj': ('save_qkv_out_proj', 'MaxText saves only the output projection'),
    'proj': ('save_qkv_out_proj', 'MaxText (2023) saved only q/k/v'),
    'custom': ('save_nothing', 'MaxText chooses per tensor (remat/device/offload)'),
}


# ---- TPU topologies -------------------------------------------------------------

# Generation -> (what the number in the name counts, JAX devices per counted unit,
# allowed counts or None for "a multiple of 8 up to max").
# v2/v3: each TensorCore is a JAX device. v4/v5p: names count TensorCores, but two cores
# form one megacore device. v5e (v5litepod) / v6e: names count chips, one core each.
TPU_GENERATIONS: dict[str, tuple[str, float, Optional[tuple[int, ...]], int]] = {
    'v2': ('TensorCores', 1, (8, 32, 128, 256, 512), 512),
    'v3': ('TensorCores', 1, (8, 32, 64, 128, 256, 512, 1024, 2048), 2048),
    'v4': ('TensorCores', 0.5, None, 8192),
    'v5p': ('TensorCores', 0.5, None, 17920),
    'v5e': ('chips', 1, (1, 4, 8, 16, 32, 64, 128, 256), 256),
    'v5litepod': ('chips', 1, (1, 4, 8, 16, 32, 64, 128, 256), 256),
    'v6e': ('chips', 1, (1, 4, 8, 16, 32, 64, 128, 256), 256),
}


def topology_devices(name: str) -> Optional[int]:
  """JAX devices of one slice of a TPU type like 'v4-128', or None if not a known name."""
  generation, _, count = name.strip().lower().partition('-')
  if generation not in TPU_GENERATIONS or not count.isdigit():
    return None
  _, per_unit, allowed, maximum = TPU_GENERATIONS[generation]
  n = int(count)
  if allowed is not None and n not in allowed:
    return None
  if allowed is None and (n < 8 or n % 8 or n > maximum):
    return None
  return int(n * per_unit)


def topology_examples() -> list[str]:
  return ['v2-8', 'v3-32', 'v4-8', 'v4-128', 'v5p-256', 'v5litepod-16', 'v5e-256', 'v6e-64']
