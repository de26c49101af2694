"""Checks of an LM config that one layer alone cannot make: one line (UserError) each, before
anything is built or compiled."""

from __future__ import annotations

import fiddle as fdl

from paxcli.errors import UserError, at_least
from paxcli.layers import attention_ops, lora, moe, quant
from paxcli.layers.mla import LatentAttention
from paxcli.layers.transformer import Attention, Mlp
from paxcli.models import pattern, registry

# The smallest block of the attention kernel a chunk of a context-parallel sequence may be cut into (a
# shorter chunk is one block): below it the kernel's loop of blocks costs more than the blocks' products.
MIN_CONTEXT_BLOCK = 64


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
  _validate_block(block, 'task.model.lm_tpl.block_tpl', '', lm.model_dims)
  for kind, fields in kinds.items():   # each kind's own block, where its knobs changed something
    if not fields:
      continue
    _validate_window_target(block, fields, kind)
    _validate_block(pattern.kind_template(block, fields), f"the {kind!r} layers' block", f'LAYER_KINDS[{kind!r}]: ',
                    lm.model_dims)


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


def _validate_block(block, where: str, label: str, model_dims: int) -> None:
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
  _validate_quant(attention, ffn, model_dims, label)


def _validate_quant(attention, ffn, model_dims: int, label: str) -> None:
  """WEIGHT_QUANT, AQT and FP8 are one product each; NF4 blocks fit every kernel's inputs."""
  for layer in (attention, ffn):
    chosen = [f'{knob}={value!r}' for knob, value in (('WEIGHT_QUANT', getattr(layer, 'weight_quant', 'none')),
                                                       ('AQT', getattr(layer, 'aqt', 'none')),
                                                       ('FP8', getattr(layer, 'fp8', 'none'))) if value != 'none']
    if len(chosen) > 1:
      raise UserError(f'{label}{" and ".join(chosen)}: each sets how the projections multiply (codes of a frozen '
                      'kernel, int8 or fp8 products of float ones); choose one.')
  if getattr(attention, 'weight_quant', 'none') != 'nf4':
    return
  block = attention.quant_block_size
  if block < 32 or block > 4096 or block & (block - 1):
    raise UserError(f'{label}QUANT_BLOCK_SIZE must be a power of two from 32 to 4096 (the block sizes bitsandbytes '
                    f'codes NF4 with), got {block}.')
  kernels = _attention_inputs(attention, model_dims)
  hidden = getattr(ffn, 'hidden_dims', None)
  if hidden:
    kernels += [("the MLP's wi_0 and wi_1", (model_dims,)), ("the MLP's wo", (hidden,))]
  shared = getattr(ffn, 'shared_hidden_dims', 0)
  if shared:
    kernels += [("the shared expert's wo", (shared,))]
  for where, in_shape in kernels:
    problem = quant.check_shape(in_shape, block, where)
    if problem:
      raise UserError(f'{label}WEIGHT_QUANT=nf4: {problem}; set QUANT_BLOCK_SIZE to a power of two that divides it, '
                      "or WEIGHT_QUANT='int8'.")


def _attention_inputs(attention, model_dims: int) -> list:
  """(which kernels, their input axes) of an attention layer's projections."""
  if isinstance(attention, fdl.Config) and issubclass(fdl.get_callable(attention), LatentAttention):
    out = [('the query and kv_down kernels', (model_dims,)), ('kv_up', (attention.kv_lora_rank,)),
           ('the attention output kernel', (attention.num_heads, attention.v_head_dim))]
    return out + ([('query_up', (attention.q_lora_rank,))] if attention.q_lora_rank else [])
  return [('the query, key and value kernels', (model_dims,)),
          ('the attention output kernel', (attention.num_heads, attention.dims_per_head))]


# Attention options latent attention has no use for: (field, its neutral value, the knob, why).
_NOT_LATENT = (('sliding_window', 0, 'SLIDING_WINDOW', 'a sliding window'), ('qk_norm', False, 'USE_QK_NORM', 'QK-norm'),
               ('qkv_bias', False, 'USE_QKV_BIAS', 'biases'), ('use_bias', False, 'USE_ATTENTION_BIAS', 'biases'),
               ('per_dim_scale', False, 'USE_PER_DIM_SCALE', 'a per-dimension scale'),
               ('query_pre_attn_scalar', None, 'QUERY_PRE_ATTN_SCALAR', 'another query scale'),
               ('norm_plus_one', False, 'NORM_PLUS_ONE', "Gemma's norms"), ('fp8', 'none', 'FP8', 'fp8 projections'),
               ('rotary_fraction', 1.0, 'ROTARY_FRACTION', 'a part of QK_ROPE_HEAD_DIMS unrotated'),
               ('aqt', 'none', 'AQT', 'int8 products'),
               ('kv_cache_quant', 'none', 'KV_CACHE_QUANT', 'an int8 cache (its cache holds the latents)'))


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


def validate_context(lm, size: int, settings, lengths=()) -> None:
  """One line for what cannot follow sequences split over a context axis of `size` devices
  (paxcli.layers.context_parallel) as `settings` (activation_sharding.ContextParallel) split them. In load-balanced
  order (each device holds an early and a late chunk) a layer of any kind (the block, a LAYER_PATTERN or
  LAYER_PREFIX kind's) whose attention is not paxcli's (it would take the order of the array for the order of the
  text) or whose experts fill their buffers by GShard's capacity (in the order of the text). For each of `lengths`
  ((what, tokens) of the inputs), a chunk the attention kernel cannot cut into blocks (context_chunk_blocks)."""
  block = getattr(lm, 'block_tpl', None)
  if block is None:
    return
  for what, length in lengths:
    if length:
      _validate_chunk_blocks(what, length, size, settings.load_balance)
  if not settings.load_balance:
    return
  prefix = tuple(getattr(lm, 'layer_prefix', ()) or ())
  kinds = (pattern.kinds_in_order(getattr(lm, 'layer_pattern', ()), getattr(lm, 'layer_kinds', ()))
           + pattern.prefix_kinds(prefix, getattr(lm, 'layer_kinds', ())))
  blocks = [('The ', block)] + [(f"The {kind!r} layers' ", pattern.kind_template(block, fields))
                                for kind, fields in kinds if fields]
  fix = f'set CONTEXT_LOAD_BALANCE=False (each of the {size} devices then holds one contiguous share), or no context axis.'
  for label, b in blocks:
    attention = getattr(b, 'attention_tpl', None)
    if attention is not None and fdl.get_callable(attention) not in (Attention, LatentAttention):
      name = getattr(fdl.get_callable(attention), '__name__', 'a swapped-in layer')
      raise UserError(f"{label}attention layer is {name}, which cannot follow the load-balanced order of a "
                      f'sequence split over the context axis (it would take the order of the array for the order '
                      f"of the text, which only paxcli's attention layers know apart): {fix}")
    ffn = getattr(b, 'ffn_tpl', None)
    if ffn is not None and fdl.get_callable(ffn) is moe.MoeFeedForward and ffn.dispatch == 'capacity':
      raise UserError(f"{label}mixture of experts has MOE_DISPATCH='capacity', which fills each expert's "
                      'buffer in the order of the text; a sequence split over the context axis with load balancing is '
                      f"in another order on each device: use MOE_DISPATCH='dropless', or {fix}")


def _validate_chunk_blocks(what: str, length: int, size: int, balanced: bool) -> None:
  """The chunks of a sequence (length / size, or / 2 size with load balancing) cut into blocks of the attention
  kernel (at most FLASH_BLOCK, dividing a chunk) no smaller than MIN_CONTEXT_BLOCK, or one block a chunk: a chunk
  of a prime 521 tokens would be cut in blocks of one token, a loop of 521 x 521 steps a pair of chunks."""
  chunks = size * (2 if balanced else 1)
  if length % chunks:
    return   # the caller's divisibility line says it
  chunk = length // chunks
  block = attention_ops.flash_block(chunk)
  if block < min(chunk, MIN_CONTEXT_BLOCK):
    good = -(-length // (chunks * MIN_CONTEXT_BLOCK)) * chunks * MIN_CONTEXT_BLOCK
    raise UserError(f'The {length:,} tokens of {what} make {chunks} chunks of {chunk:,} over the context axis, which '
                    f'the attention kernel cuts only into blocks of {block} (the largest divisor of a chunk up to '
                    f'{attention_ops.FLASH_BLOCK}): choose a length whose chunks are a multiple of {MIN_CONTEXT_BLOCK} '
                    f'tokens (a multiple of {chunks * MIN_CONTEXT_BLOCK:,}, such as {good:,}), or another context size.')
