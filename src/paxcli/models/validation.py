"""Checks of an LM config that one layer alone cannot make: one line (UserError) each, before
anything is built or compiled."""

from __future__ import annotations

import fiddle as fdl

from paxcli.errors import UserError, at_least
from paxcli.layers import lora, moe
from paxcli.layers.mla import LatentAttention
from paxcli.layers.transformer import Attention, Mlp
from paxcli.models import pattern, registry


def validate_lm(lm) -> None:
  """Checks of a TransformerLm config that one layer alone cannot make."""
  at_least(1, 'task.model.lm_tpl', lm, 'vocab_size', 'num_layers', 'model_dims', 'max_seq_len')
  if not 0 <= lm.dropout_prob < 1:
    raise UserError(f'task.model.lm_tpl.dropout_prob must be in [0, 1), got {lm.dropout_prob}.')
  if getattr(getattr(lm, 'final_norm_tpl', None), 'epsilon', 1.0) <= 0:
    raise UserError(f'NORM_EPSILON must be positive, got {lm.final_norm_tpl.epsilon}.')
  if getattr(lm, 'softmax_cap_logits', 0.0) < 0:
    raise UserError(f'SOFTMAX_CAP_LOGITS must be 0 (off) or positive, got {lm.softmax_cap_logits}.')
  prefix = tuple(getattr(lm, 'layer_prefix', ()) or ())
  pattern.check(lm.num_layers, getattr(lm, 'layer_pattern', ()), prefix)
  if prefix and getattr(lm, 'num_stages', 1) > 1:
    raise UserError(f'LAYER_PREFIX {prefix} with NUM_STAGES {lm.num_stages}: pipeline stages hold whole groups of '
                    'the repeating layers, and the prefix layers are not in them. Set NUM_STAGES=1.')
  block = getattr(lm, 'block_tpl', None)
  kinds = dict(pattern.kinds_in_order(getattr(lm, 'layer_pattern', ()), getattr(lm, 'layer_kinds', ()))
               + pattern.prefix_kinds(prefix, getattr(lm, 'layer_kinds', ())))
  _validate_block(block, 'task.model.lm_tpl.block_tpl', '')
  for kind, fields in kinds.items():   # each kind's own block, where its knobs changed something
    if not fields:
      continue
    _validate_window_target(block, fields, kind)
    _validate_block(pattern.kind_template(block, fields), f"the {kind!r} layers' block", f'LAYER_KINDS[{kind!r}]: ')


def validate_family(name) -> None:
  """MODEL_FAMILY names a family paxcli has (or is None)."""
  if name is not None:
    registry.by_name(name, 'MODEL_FAMILY: ')


def _validate_window_target(block, fields, kind: str) -> None:
  """A kind's SLIDING_WINDOW needs paxcli's causal Attention: a swapped-in attention layer has no window."""
  window = dict(fields).get('attention_tpl.sliding_window', 0)
  attention = getattr(block, 'attention_tpl', None)
  if window and (attention is None or fdl.get_callable(attention) is not Attention):
    name = getattr(fdl.get_callable(attention), '__name__', 'none') if attention is not None else 'none'
    raise UserError(f'LAYER_KINDS[{kind!r}] sets SLIDING_WINDOW {window}, but the attention layer is {name}, not '
                    "paxcli's causal Attention: a sliding window needs causal attention.")


def _validate_block(block, where: str, label: str) -> None:
  """Checks of one block template's attention and feed-forward (label: which kind, in front of each message)."""
  attention = getattr(block, 'attention_tpl', None)
  if attention is None or not issubclass(fdl.get_callable(attention), Attention):
    return
  if issubclass(fdl.get_callable(attention), LatentAttention):
    _validate_latent(attention, f'{where}.attention_tpl', label)
  else:
    at_least(1, f'{where}.attention_tpl', attention, 'num_heads', 'num_kv_heads', 'dims_per_head')
    if attention.num_heads % attention.num_kv_heads:
      raise UserError(f'{label}NUM_HEADS {attention.num_heads} must be a multiple of NUM_KV_HEADS '
                      f'{attention.num_kv_heads}.')
    if attention.rotary and attention.dims_per_head % 2:
      raise UserError(f'{label}Rotary positions need an even DIMS_PER_HEAD, got {attention.dims_per_head}.')
  if getattr(attention, 'sliding_window', 0) < 0:
    raise UserError(f'{label}SLIDING_WINDOW must be 0 (full attention) or positive, got {attention.sliding_window}.')
  if attention.atten_logit_cap < 0:
    raise UserError(f'{label}ATTEN_LOGIT_CAP must be 0 (off) or positive, got {attention.atten_logit_cap}.')
  scalar = getattr(attention, 'query_pre_attn_scalar', None)
  if scalar is not None and scalar < 0:
    raise UserError(f'{label}QUERY_PRE_ATTN_SCALAR must be positive (queries x 1/sqrt of it), or None, got {scalar}.')
  _validate_fp8(attention, label)
  _validate_rotary_scaling(attention)
  validate_lora(attention)
  ffn = block.ffn_tpl
  _validate_fp8(ffn, label)
  if fdl.get_callable(ffn) is Mlp:
    at_least(1, f'{where}.ffn_tpl', ffn, 'hidden_dims')
  if fdl.get_callable(ffn) is moe.MoeFeedForward:
    moe.check_settings(ffn, label)


# Attention options latent attention has no use for: (field, its neutral value, the knob, why).
_NOT_LATENT = (('sliding_window', 0, 'SLIDING_WINDOW', 'a sliding window'), ('qk_norm', False, 'USE_QK_NORM', 'QK-norm'),
               ('qkv_bias', False, 'USE_QKV_BIAS', 'biases'), ('use_bias', False, 'USE_ATTENTION_BIAS', 'biases'),
               ('per_dim_scale', False, 'USE_PER_DIM_SCALE', 'a per-dimension scale'),
               ('query_pre_attn_scalar', None, 'QUERY_PRE_ATTN_SCALAR', 'another query scale'),
               ('norm_plus_one', False, 'NORM_PLUS_ONE', "Gemma's norms"), ('fp8', 'none', 'FP8', 'fp8 projections'),
               ('rotary_fraction', 1.0, 'ROTARY_FRACTION', 'a part of QK_ROPE_HEAD_DIMS unrotated'))


def _validate_latent(attention, where: str, label: str) -> None:
  """Multi-head latent attention's sizes, and the options of paxcli's Attention it does not compute."""
  at_least(1, where, attention, 'num_heads', 'kv_lora_rank', 'qk_nope_head_dim', 'qk_rope_head_dim', 'v_head_dim')
  if attention.q_lora_rank < 0:
    raise UserError(f'{label}Q_LORA_RANK must be 0 (queries projected directly) or positive, got '
                    f'{attention.q_lora_rank}.')
  if not attention.rotary or attention.qk_rope_head_dim % 2:
    raise UserError(f"{label}Latent attention (KV_LORA_RANK) rotates QK_ROPE_HEAD_DIMS of each head: it needs "
                    f"POSITION_EMBEDDING='rotary' and an even QK_ROPE_HEAD_DIMS (got {attention.qk_rope_head_dim}).")
  used = [f'{knob}={getattr(attention, field)!r} ({why})' for field, neutral, knob, why in _NOT_LATENT
          if getattr(attention, field, neutral) != neutral]
  if getattr(attention, 'rotary_scaling', 'none') == 'longrope':   # its cache of latents is not computed again
    used.append("ROTARY_SCALING='longrope' (LongRoPE's two sets of factors)")
  if used:
    raise UserError(f'{label}Latent attention (KV_LORA_RANK {attention.kv_lora_rank}) computes none of: '
                    + ', '.join(used) + '.')
  targets = set(getattr(attention, 'lora_targets', ()) or ()) if attention.lora_rank else set()
  if len(targets & {'key', 'value'}) == 1:
    raise UserError(f"{label}LORA_TARGETS {sorted(targets)}: latent attention's keys and values come from the same "
                    "projections (kv_down, kv_up): adapt 'key' and 'value' together, or neither.")


def _validate_fp8(layer, label: str) -> None:
  """FP8='delayed' scales from a history of at least one step."""
  if getattr(layer, 'fp8', 'none') == 'delayed' and getattr(layer, 'fp8_amax_history', 1) < 1:
    raise UserError(f'{label}FP8_AMAX_HISTORY must be at least 1 (the steps whose largest value sets a scale) with '
                    f"FP8='delayed', got {layer.fp8_amax_history}.")


def expert_counts(lm) -> list[tuple[str, int]]:
  """(label, NUM_EXPERTS) of every kind of layer of a TransformerLm config whose feed-forward is a mixture
  of experts (label: '' for the model's own block, "LAYER_KINDS['moe']: " for a kind's)."""
  block = getattr(lm, 'block_tpl', None)
  if block is None:
    return []
  kinds = (pattern.kinds_in_order(getattr(lm, 'layer_pattern', ()), getattr(lm, 'layer_kinds', ()))
           + pattern.prefix_kinds(getattr(lm, 'layer_prefix', ()), getattr(lm, 'layer_kinds', ())))
  blocks = [('', block)] + [(f'LAYER_KINDS[{kind!r}]: ', pattern.kind_template(block, fields))
                            for kind, fields in dict(kinds).items() if fields]
  return [(label, b.ffn_tpl.num_experts) for label, b in blocks
          if fdl.get_callable(b.ffn_tpl) is moe.MoeFeedForward]


def validate_expert_axis(lm, axis_size) -> None:
  """One line when the mesh's expert axis (None: not known yet) does not divide a layer's experts."""
  for label, experts in expert_counts(lm):
    moe.check_expert_axis(experts, axis_size, label)


def _validate_rotary_scaling(attention) -> None:
  if getattr(attention, 'rotary_scaling', 'none') == 'none':
    return
  if not attention.rotary_scaling_factor >= 1:
    raise UserError(f'ROTARY_SCALING_FACTOR must be at least 1, got {attention.rotary_scaling_factor}.')
  if attention.rotary_scaling == 'llama3' and not (
      0 < attention.rotary_low_freq_factor < attention.rotary_high_freq_factor and attention.rotary_original_max_len > 0):
    raise UserError('ROTARY_SCALING llama3 needs 0 < ROTARY_LOW_FREQ_FACTOR < ROTARY_HIGH_FREQ_FACTOR and a positive '
                    f'ROTARY_ORIGINAL_MAX_LEN; got {attention.rotary_low_freq_factor}, '
                    f'{attention.rotary_high_freq_factor}, {attention.rotary_original_max_len}.')
  if attention.rotary_scaling == 'yarn' and not (
      0 < attention.rotary_beta_slow <= attention.rotary_beta_fast and attention.rotary_original_max_len > 0):
    raise UserError('ROTARY_SCALING yarn needs 0 < ROTARY_BETA_SLOW <= ROTARY_BETA_FAST and a positive '
                    f'ROTARY_ORIGINAL_MAX_LEN; got {attention.rotary_beta_slow}, {attention.rotary_beta_fast}, '
                    f'{attention.rotary_original_max_len}.')
  for name in ('rotary_mscale', 'rotary_mscale_all_dim'):   # 0, as None: not set (transformers' reading)
    if (getattr(attention, name, None) or 0) < 0:
      raise UserError(f'{name.upper()} must be 0 or more, or None, got {getattr(attention, name)}.')
  factor = getattr(attention, 'rotary_attention_factor', None)
  if factor is not None and not factor > 0:
    raise UserError(f'ROTARY_ATTENTION_FACTOR must be positive, or None, got {factor}.')


def validate_lora(attention) -> None:
  """LORA_* knobs that cannot work (read from the attention template, which the knobs fill)."""
  rank = getattr(attention, 'lora_rank', 0)
  if rank < 0:
    raise UserError(f'LORA_RANK must be 0 (off) or positive, got {rank}.')
  if not rank:
    return
  unknown = [t for t in attention.lora_targets if t not in lora.TARGETS]
  if unknown or not attention.lora_targets:
    raise UserError(f'LORA_TARGETS {list(attention.lora_targets)}: choose some of {", ".join(lora.TARGETS)}.')
  if attention.lora_alpha <= 0:
    raise UserError(f'LORA_ALPHA must be positive, got {attention.lora_alpha}.')
  if not 0 <= attention.lora_dropout < 1:
    raise UserError(f'LORA_DROPOUT must be in [0, 1), got {attention.lora_dropout}.')
