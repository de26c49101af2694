"""Knob tables: each model knob of a family declared once, with the config fields it sets.

A row names the knob (UPPERCASE, as recipes set it), its type and default, and the fields
of the model config it lands in (dotted paths under `task.model`). Everything else reads
the table: the family's experiment declares its knobs from it (`declare`), the model
config is filled from it (`fill`), and an existing model config is read back under the
knobs' flat names (`read`: paxcli.models.lm.flat_view, the FLOPs count, the converters). So a new
LM knob is two edits: a row in LM_KNOBS and its use in the layer.

The flat name of a knob is the keyword `paxcli.models.lm.lm_config` takes and the attribute
`flat_view` gives (num_heads, norm_type, scan_layers, ...): the last part of its
first field unless the row says otherwise. A knob whose fields take a value computed from
other knobs (NUM_KV_HEADS None: as many as NUM_HEADS) says how in `value`.

A knob may swap a whole template (NUM_EXPERTS > 0 puts the mixture-of-experts layer where the dense
MLP was): its `template` names the template's path and the layer class from all settings, set before
any field. Such a knob must come before the knobs that set fields inside that template in its table
(fill sets them in table order), and a field only the swapped-in layer has is set `when` it is there.

This module imports no jax or flax: experiments import it when their class is created and
recipes must stay importable without them (`pax experiments` lists them quickly).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

from paxcli.errors import UserError, did_you_mean
from paxcli.options import (ActivationName, AttentionImplName, CapacityRuleName, CheckpointPolicyName, DTypeName,
                            Fp8Name, MlaDecodeName, MoeDispatchName, NormName, PositionName, RotaryScalingName,
                            RouterSoftmaxName)
from paxcli.values import coerce

Settings = Mapping[str, Any]   # flat name -> value, every knob of a table present

# The largest value a model knob may have (Knob.maximum), checked wherever settings become a model (`complete`),
# whatever gave them: --set, a job's record, a recipe, a Hugging Face, paxml or MaxText config. An integer
# knob is a size or a count, and JAX indexes arrays with 32-bit integers; a float knob is used in float32 (or
# less), where a larger number is infinity. Layers and experts are counts a model is built from one by one:
# more than MAX_COUNT cannot be built here, and a config that says so is refused before anything is listed.
MAX_INT32 = 2**31 - 1
MAX_FLOAT32 = 3.4028234663852886e38
MAX_COUNT = 1 << 16


@dataclasses.dataclass(frozen=True)
class Knob:
  """One knob: its type and default, and the model-config fields it sets."""
  name: str
  type: Any
  default: Any
  fields: tuple[str, ...]
  doc: str = ''
  flat: str = ''
  # The fields' value from all settings (flat names); None: the knob's own value.
  value: Optional[Callable[[Settings], Any]] = None
  # Further fields that follow from this knob: (path, value from all settings).
  derived: tuple[tuple[str, Callable[[Settings], Any]], ...] = ()
  # The fields are set only where this holds (from all settings): fields of a layer another knob's
  # template swaps in. None: always.
  when: Optional[Callable[[Settings], bool]] = None
  # A whole template this knob swaps: (path, a Template from all settings), set before its fields.
  template: Optional[tuple[str, Callable[[Settings], 'Template']]] = None
  # The largest value (see MAX_INT32); None: the bound of the knob's type (none for other types).
  maximum: Optional[float] = None

  def __post_init__(self):
    if isinstance(self.fields, str):
      object.__setattr__(self, 'fields', (self.fields,))
    if not self.flat:
      object.__setattr__(self, 'flat', self.fields[0].rsplit('.', 1)[-1])

  def field_value(self, settings: Settings) -> Any:
    return self.value(settings) if self.value else settings[self.flat]

  def applies(self, settings: Settings) -> bool:
    """Whether the fields are set at all with these settings (`when`)."""
    return self.when is None or bool(self.when(settings))

  def check(self, value: Any, label: str = '') -> None:
    """UserError when `value` is over the knob's bound (MAX_INT32, MAX_FLOAT32, or its own `maximum`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      return
    limit = self.maximum if self.maximum is not None else MAX_INT32 if isinstance(value, int) else MAX_FLOAT32
    if abs(value) <= limit:
      return
    why = ('more cannot be built here' if self.maximum is not None else 'JAX indexes arrays with 32-bit integers'
           if isinstance(value, int) else 'the model computes in float32, where a larger number is infinity')
    shown = (lambda x: f'{x:,}' if isinstance(x, int) else f'{x:.3g}')
    raise UserError(f'{label}{self.name} is {shown(value)}; paxcli builds models with {self.name} of at most '
                    f'{shown(limit)}{"" if isinstance(limit, int) else " in magnitude"} ({why}).')


@dataclasses.dataclass(frozen=True)
class Template:
  """A knob's value that swaps a whole template: the layer class, set as a fresh fiddle config of it
  wherever it lands (so that no two layers share one config object)."""
  cls: type

  def config(self):
    import fiddle as fdl  # pure Python; kept out of the module's imports like everything a table does not need
    return fdl.Config(self.cls)


def settable(value: Any) -> Any:
  """What a field is set to for a knob's value: a Template becomes a fresh config of its class."""
  return value.config() if isinstance(value, Template) else value


def declare(table: tuple[Knob, ...]):
  """Class decorator: declares the table's knobs (annotation and default) on an experiment class. They are
  model knobs (each sets fields of the model's config and nothing else), so a job's record may set them
  (Experiment.replayed)."""
  def apply(cls):
    annotations = cls.__dict__.get('__annotations__')
    if annotations is None:
      annotations = cls.__annotations__ = {}
    for knob in table:
      annotations[knob.name] = knob.type
      setattr(cls, knob.name, knob.default)
    cls.replayed = frozenset(cls.__dict__.get('replayed', ())) | {knob.name for knob in table}
    return cls
  return apply


def flat_settings(knob_values: Mapping[str, Any], table: tuple[Knob, ...]) -> dict[str, Any]:
  """Flat name -> value for the table's knobs, from knob values by UPPERCASE name (others ignored)."""
  return {k.flat: knob_values[k.name] for k in table if k.name in knob_values}


def complete(settings: Settings, table: tuple[Knob, ...]) -> dict[str, Any]:
  """The settings with the table's defaults where they are missing; a TypeError for an unknown name."""
  known = {k.flat: k.default for k in table}
  unknown = sorted(set(settings) - set(known))
  if unknown:
    raise TypeError(f'unexpected model settings {unknown}; the knob table has {sorted(known)}')
  for knob in table:
    if knob.flat in settings:
      knob.check(settings[knob.flat])
  return {**known, **settings}


def assignments(settings: Settings, table: tuple[Knob, ...]) -> list[tuple[str, Any]]:
  """(field path, value) for every field the table sets, from complete settings."""
  out = []
  for knob in table:
    if knob.template:
      out.append((knob.template[0], knob.template[1](settings)))
    if not knob.applies(settings):
      continue
    value = knob.field_value(settings)
    out += [(path, value) for path in knob.fields]
    out += [(path, fn(settings)) for path, fn in knob.derived]
  return out


def effective(knob_values: Mapping[str, Any], table: tuple[Knob, ...]) -> dict[str, Any]:
  """Flat name -> the value its fields get (NUM_KV_HEADS None reads as NUM_HEADS; None for a knob whose
  fields are not set, as `read` finds them), from knob values by UPPERCASE name (defaults for the
  missing): a model's settings without building it."""
  settings = complete(flat_settings(knob_values, table), table)
  return {k.flat: k.field_value(settings) if k.applies(settings) else None for k in table}


def fill(config, table: tuple[Knob, ...], settings: Settings):
  """`config` (a tree of fiddle configs) with the table's fields set from `settings` (flat names,
  defaults for missing ones). Returns the config."""
  for path, value in assignments(complete(settings, table), table):
    *parents, name = path.split('.')
    node = config
    for part in parents:
      node = getattr(node, part)
    setattr(node, name, settable(value))
  return config


def get_path(obj, path: str) -> Any:
  """The field at a dotted path of a config or model, None where a step is missing."""
  for part in path.split('.'):
    obj = getattr(obj, part, None)
    if obj is None:
      return None
  return obj


def read(model, table: tuple[Knob, ...]) -> dict[str, Any]:
  """Flat name -> the value at each knob's first field of a model (or its config); None where a
  swapped-in layer has no such field."""
  return {k.flat: get_path(model, k.fields[0]) for k in table}


# ---- the decoder-only LM (paxcli.models.lm.LanguageModel; paxcli.models.lm_experiment.LmExperiment) ---

LM = 'lm_tpl.'
BLOCK = LM + 'block_tpl.'
ATTENTION = BLOCK + 'attention_tpl.'
FFN = BLOCK + 'ffn_tpl.'
NORM = BLOCK + 'norm_tpl.'
FINAL_NORM = LM + 'final_norm_tpl.'

def _layers():
  """paxcli.layers' mla, moe and transformer modules (flax: imported only where a model config is filled)."""
  from paxcli.layers import mla, moe, transformer
  return mla, moe, transformer


def _feed_forward(settings: Settings) -> Template:
  """The feed-forward layer NUM_EXPERTS picks: the dense Mlp, or the mixture of experts."""
  _, moe, transformer = _layers()
  return Template(moe.MoeFeedForward if settings['num_experts'] else transformer.Mlp)


def _moe(settings: Settings) -> bool:
  return bool(settings['num_experts'])


# The mixture-of-experts feed-forward (paxcli.layers.moe). NUM_EXPERTS swaps the template, so it comes
# before every knob that sets a feed-forward field (HIDDEN_DIMS, ACTIVATION, USE_BIAS, LORA_*), whose
# fields the MoE layer has too; the rest exist only in the MoE layer (`when`).
MOE_KNOBS: tuple[Knob, ...] = (
    Knob('NUM_EXPERTS', int, 0, FFN + 'num_experts', '0: a dense MLP; E > 0: E expert MLPs of HIDDEN_DIMS each, '
         'EXPERTS_PER_TOKEN of them per token (per layer kind with LAYER_KINDS)', when=_moe,
         template=(BLOCK + 'ffn_tpl', _feed_forward), maximum=MAX_COUNT),
    Knob('EXPERTS_PER_TOKEN', int, 2, FFN + 'experts_per_token', 'k of top-k routing', when=_moe),
    Knob('MOE_DISPATCH', MoeDispatchName, 'dropless', FFN + 'dispatch',
         "'dropless': tokens sorted by expert, grouped matmuls (ragged_dot); 'capacity': GShard's dispatch and "
         'combine einsums, tokens over EXPERT_CAPACITY_FACTOR dropped (what Pax trained with)', flat='moe_dispatch',
         when=_moe),
    Knob('EXPERT_CAPACITY_FACTOR', float, 1.25, FFN + 'capacity_factor',
         "'capacity' only: each expert takes ceil(factor x sequence length x k / E) tokens of a sequence",
         flat='capacity_factor', when=_moe),
    Knob('MOE_GROUPS', int, 0, FFN + 'capacity_groups',
         "'capacity' only: the batch's tokens in this many routing groups, each with its own expert capacity "
         "(praxis' num_groups); 0: each sequence is a group", flat='capacity_groups', when=_moe),
    Knob('EXPERT_CAPACITY_RULE', CapacityRuleName, 'paxcli', FFN + 'capacity_rule',
         "'capacity' only: 'paxcli' ceil(factor x group x k / E) slots an expert; 'praxis' int(factor x group / E) "
         "rounded up to a multiple of 4 (praxis' unadjusted_expert_capacity_factor)", flat='capacity_rule',
         when=_moe),
    Knob('ROUTER_SOFTMAX', RouterSoftmaxName, 'before_topk', FFN + 'router_softmax',
         "'after_topk': softmax over the k chosen logits (Mixtral); 'before_topk': over all experts, then the "
         "k largest (Qwen3-MoE, GShard); 'sigmoid': a sigmoid score per expert, the k of largest score + "
         'ROUTER_BIAS chosen, weighted by their scores (DeepSeek-V3)', when=_moe),
    Knob('ROUTER_NORMALIZE_TOPK', bool, True, FFN + 'normalize_topk',
         "'before_topk' and 'sigmoid': rescale the k weights to sum to 1 (norm_topk_prob)", flat='normalize_topk',
         when=_moe),
    Knob('ROUTER_BIAS', bool, False, FFN + 'router_bias',
         "'sigmoid': a load-balancing bias per expert added to the scores for the choice only (DeepSeek-V3's "
         'e_score_correction_bias); no gradient or optimizer changes it', when=_moe),
    Knob('ROUTER_GROUPS', int, 1, FFN + 'router_groups',
         "group-limited routing: the experts in this many equal groups, a token's experts from its "
         "ROUTER_TOPK_GROUPS best (a group's score: its two best); 1: off (DeepSeek's n_group)", when=_moe),
    Knob('ROUTER_TOPK_GROUPS', int, 1, FFN + 'router_group_k',
         'group-limited routing: how many groups a token may take experts from (DeepSeek\'s topk_group)',
         flat='router_group_k', when=_moe),
    Knob('ROUTED_SCALING_FACTOR', float, 1.0, FFN + 'routed_scale',
         "the routed experts' weights x this (DeepSeek's routed_scaling_factor)", flat='routed_scale', when=_moe),
    Knob('LOAD_BALANCE_LOSS_WEIGHT', float, 0.01, FFN + 'load_balance_weight',
         'weight of the Switch/GShard load-balancing loss (1 when balanced); 0: off', flat='load_balance_weight',
         when=_moe),
    Knob('ROUTER_Z_LOSS_WEIGHT', float, 0.0, FFN + 'z_loss_weight', 'weight of the router z-loss; 0: off',
         flat='z_loss_weight', when=_moe),
    Knob('SHARED_EXPERT_HIDDEN_DIMS', int, 0, FFN + 'shared_hidden_dims',
         'a dense MLP of this width beside the experts, for every token; 0: none', flat='shared_hidden_dims',
         when=_moe),
    Knob('SHARED_EXPERT_GATE', bool, False, FFN + 'shared_gate',
         "the shared expert's output scaled by a learned sigmoid gate per token (Qwen2-MoE)", flat='shared_gate',
         when=_moe),
)

def _attention(settings: Settings) -> Template:
  """The attention layer KV_LORA_RANK picks: paxcli's Attention, or multi-head latent attention."""
  mla, _, transformer = _layers()
  return Template(mla.LatentAttention if settings['kv_lora_rank'] else transformer.Attention)


def _mla(settings: Settings) -> bool:
  return bool(settings['kv_lora_rank'])


# Multi-head latent attention (paxcli.layers.mla; DeepSeek-V2/V3). KV_LORA_RANK swaps the attention template, so
# it comes before every knob that sets an attention field (NUM_HEADS, ROTARY_*, LORA_*), which latent attention
# has too; the rest exist only there (`when`).
MLA_KNOBS: tuple[Knob, ...] = (
    Knob('KV_LORA_RANK', int, 0, ATTENTION + 'kv_lora_rank',
         '0: attention with key and value heads; R > 0: multi-head latent attention, keys and values made from '
         'a latent of R numbers a token, which the KV cache holds (DeepSeek\'s kv_lora_rank)', when=_mla,
         template=(BLOCK + 'attention_tpl', _attention)),
    Knob('Q_LORA_RANK', int, 0, ATTENTION + 'q_lora_rank',
         'latent attention: queries through a latent of this many numbers (with its RMSNorm); 0: projected '
         'directly', when=_mla),
    Knob('QK_NOPE_HEAD_DIMS', int, 128, ATTENTION + 'qk_nope_head_dim',
         "latent attention: each head's query and key dims without rotary positions", when=_mla),
    Knob('QK_ROPE_HEAD_DIMS', int, 64, ATTENTION + 'qk_rope_head_dim',
         "latent attention: each head's rotated query dims, and the rotary key every head shares", when=_mla),
    Knob('V_HEAD_DIMS', int, 128, ATTENTION + 'v_head_dim', "latent attention: each head's value dims",
         when=_mla),
    Knob('MLA_DECODE', MlaDecodeName, 'auto', ATTENTION + 'decode',
         "latent attention's decoding over its cache: 'absorbed' (queries into the latent space), 'expanded' "
         "(keys and values made from it), 'auto' the one of fewer multiply-adds per call", flat='mla_decode',
         when=_mla),
)

LM_KNOBS: tuple[Knob, ...] = (
    Knob('VOCAB_SIZE', int, 256, LM + 'vocab_size',
         "rows of the embedding and the output softmax: at least the tokenizer's pieces (a tokenizer trained on "
         'TRAIN_DATA gets at most this many)'),
    Knob('NUM_LAYERS', int, 2, LM + 'num_layers', 'Transformer layers (blocks) in the stack', maximum=MAX_COUNT),
    Knob('MODEL_DIMS', int, 64, LM + 'model_dims', 'the width of the residual stream (embedding size)'),
    *MOE_KNOBS,
    *MLA_KNOBS,
    Knob('HIDDEN_DIMS', int, 256, FFN + 'hidden_dims', 'the MLP hidden units; per expert with NUM_EXPERTS'),
    Knob('NUM_HEADS', int, 4, ATTENTION + 'num_heads', 'attention (query) heads per layer'),
    Knob('NUM_KV_HEADS', Optional[int], None, ATTENTION + 'num_kv_heads',
         'None: same as NUM_HEADS; fewer: grouped-query attention',
         value=lambda s: s['num_kv_heads'] or s['num_heads']),
    Knob('DIMS_PER_HEAD', Optional[int], None, ATTENTION + 'dims_per_head', 'None: MODEL_DIMS // NUM_HEADS',
         value=lambda s: s['dims_per_head'] or s['model_dims'] // s['num_heads']),
    Knob('MAX_SEQ_LEN', int, 64, LM + 'max_seq_len',
         'tokens per training row (own data is packed into rows this long), and the longest decode'),
    Knob('ACTIVATION', ActivationName, 'gelu', FFN + 'activation', "the MLP's nonlinearity ('gelu' is the tanh "
         'approximation)'),
    Knob('USE_GATED_ACTIVATION', bool, False, FFN + 'gated', 'act(x W0) * (x W1) in the MLP (SwiGLU with silu, '
         'GeGLU with gelu)', flat='use_gated_activation'),
    Knob('NORM_TYPE', NormName, 'layernorm', (NORM + 'kind', FINAL_NORM + 'kind'),
         "every norm of the stack and the final one ('rmsnorm': Llama's and most released models')", flat='norm_type'),
    Knob('USE_BIAS', bool, True, (FFN + 'use_bias', NORM + 'use_bias', FINAL_NORM + 'use_bias'),
         'biases in the MLP and the norms, and in attention unless USE_ATTENTION_BIAS says otherwise'),
    Knob('USE_ATTENTION_BIAS', Optional[bool], None, ATTENTION + 'use_bias',
         "None: USE_BIAS; Pax's USE_BIAS is this one", flat='attention_use_bias',
         value=lambda s: s['use_bias'] if s['attention_use_bias'] is None else s['attention_use_bias']),
    Knob('USE_QKV_BIAS', bool, False, ATTENTION + 'qkv_bias',
         "a bias on the query, key and value projections only, whatever USE_ATTENTION_BIAS says (Qwen 2's)"),
    Knob('USE_QK_NORM', bool, False, ATTENTION + 'qk_norm',
         "RMSNorm over each head's query and key before rotary (Qwen 3's QK-norm; epsilon NORM_EPSILON)"),
    Knob('QK_NORM_PER_HEAD', bool, True, ATTENTION + 'qk_norm_per_head',
         "USE_QK_NORM over each head apart (Qwen 3's, Gemma 3's: scales of DIMS_PER_HEAD); False: over the whole "
         "query projection and the whole key projection (OLMo 2's: scales of NUM_HEADS x DIMS_PER_HEAD and "
         'NUM_KV_HEADS x DIMS_PER_HEAD)'),
    Knob('POSITION_EMBEDDING', PositionName, 'learned', LM + 'position_embedding',
         "'sinusoidal' is Pax's fixed PositionalEmbedding",
         derived=((ATTENTION + 'rotary', lambda s: s['position_embedding'] == 'rotary'),)),
    Knob('ROTARY_MAX_TIMESCALE', float, 10000.0, ATTENTION + 'rotary_max_timescale',
         "rotary positions' base wavelength (Hugging Face's rope_theta)"),
    Knob('ROTARY_FRACTION', float, 1.0, ATTENTION + 'rotary_fraction',
         "the share of each head's dimensions rotary positions rotate: the first int(DIMS_PER_HEAD x this), the "
         "rest pass unrotated (Hugging Face's partial_rotary_factor: 0.75 in Phi-4-mini)"),
    # Hugging Face's rope_scaling (one row per rope type: layers.transformer.ROTARY_SCALINGS, read and written by
    # models.hf_config.ROPE_KEYS): 'linear', Llama 3.1's 'llama3', Phi-3's 'longrope', 'yarn'.
    Knob('ROTARY_SCALING', RotaryScalingName, 'none', ATTENTION + 'rotary_scaling',
         "'linear': positions / factor; 'llama3': long wavelengths x factor, short ones kept; 'longrope': "
         'wavelengths x a factor per rotated pair, ROTARY_SHORT_FACTORS or ROTARY_LONG_FACTORS by the length of '
         "the text; 'yarn': YaRN's ramp between kept and x factor (DeepSeek-V3, long Qwen)"),
    Knob('ROTARY_SCALING_FACTOR', float, 1.0, ATTENTION + 'rotary_scaling_factor',
         "ROTARY_SCALING's factor (rope_scaling's factor; 'longrope': the context it reaches over "
         'ROTARY_ORIGINAL_MAX_LEN, which sets the attention factor); 1: none'),
    Knob('ROTARY_LOW_FREQ_FACTOR', float, 1.0, ATTENTION + 'rotary_low_freq_factor', "'llama3' only"),
    Knob('ROTARY_HIGH_FREQ_FACTOR', float, 4.0, ATTENTION + 'rotary_high_freq_factor', "'llama3' only"),
    Knob('ROTARY_ORIGINAL_MAX_LEN', int, 8192, ATTENTION + 'rotary_original_max_len',
         "'llama3', 'longrope' and 'yarn': the context length the model was first trained for ('longrope': a "
         'text longer than this rotates with ROTARY_LONG_FACTORS)'),
    Knob('ROTARY_SHORT_FACTORS', tuple[float, ...], (), ATTENTION + 'rotary_short_factors',
         "'longrope' (Hugging Face's short_factor): per rotated pair of a head, the factor its wavelength is "
         'stretched by in a text of at most ROTARY_ORIGINAL_MAX_LEN tokens',
         value=lambda s: tuple(s['rotary_short_factors'])),
    Knob('ROTARY_LONG_FACTORS', tuple[float, ...], (), ATTENTION + 'rotary_long_factors',
         "'longrope' (long_factor): the same for a longer text, every position of it (decoding turns the cached "
         'keys over to these when a text grows past ROTARY_ORIGINAL_MAX_LEN)',
         value=lambda s: tuple(s['rotary_long_factors'])),
    Knob('ROTARY_BETA_FAST', float, 32.0, ATTENTION + 'rotary_beta_fast',
         "'yarn' only: pairs turning more often than this over ROTARY_ORIGINAL_MAX_LEN keep their wavelength"),
    Knob('ROTARY_BETA_SLOW', float, 1.0, ATTENTION + 'rotary_beta_slow',
         "'yarn' only: pairs turning less often than this get the whole factor"),
    Knob('ROTARY_MSCALE', Optional[float], None, ATTENTION + 'rotary_mscale',
         "'yarn' only (rope_scaling's mscale): with ROTARY_MSCALE_ALL_DIM, the attention factor is "
         '(0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim ln(factor) + 1); None: 0.1 ln(factor) + 1'),
    Knob('ROTARY_MSCALE_ALL_DIM', Optional[float], None, ATTENTION + 'rotary_mscale_all_dim',
         "'yarn' only (rope_scaling's mscale_all_dim); latent attention (KV_LORA_RANK) also multiplies its logits "
         "by (0.1 mscale_all_dim ln(factor) + 1)^2, as DeepSeek's"),
    Knob('ROTARY_ATTENTION_FACTOR', Optional[float], None, ATTENTION + 'rotary_attention_factor',
         "rotated queries and keys x this (Hugging Face's attention_factor); None: the scaling's own rule "
         "('longrope': sqrt(1 + ln(ROTARY_SCALING_FACTOR) / ln(ROTARY_ORIGINAL_MAX_LEN)), 1 at factor 1; 'yarn': "
         'from ROTARY_MSCALE and ROTARY_MSCALE_ALL_DIM; else 1)'),
    Knob('ROTARY_INTERLEAVE', bool, False, ATTENTION + 'rotary_interleave',
         "rotary pairs are neighbours (x0, x1), (x2, x3), ... (DeepSeek's rope_interleave) rather than the two "
         'halves of a head'),
    Knob('SEPARATE_EMBEDDING', bool, False, LM + 'separate_embedding',
         'False: output logits use the token embedding (tied)'),
    Knob('DROPOUT_PROB', float, 0.0, LM + 'dropout_prob', 'dropout on the residual branches, in training only'),
    Knob('FPROP_DTYPE', DTypeName, 'float32', LM + 'fprop_dtype', 'activations; weights stay float32'),
    Knob('USE_REPEATED_LAYER', bool, False, LM + 'scan_layers', 'nn.scan over layers'),
    Knob('CHECKPOINT_POLICY', CheckpointPolicyName, 'save_nothing', LM + 'checkpoint_policy',
         "what a layer keeps for the backward pass (jax.checkpoint's policies; 'none': everything, no recompute)"),
    # Options of Pax's lm_cloud/c4 models (what `pax checkpoint convert --from paxml` needs); all off.
    Knob('SCALE_EMBEDDING_SQRT_DEPTH', bool, False, LM + 'scale_embedding_sqrt_depth',
         'token embeddings x sqrt(MODEL_DIMS) (Pax scale_sqrt_depth)'),
    Knob('USE_SOFTMAX_BIAS', bool, False, LM + 'softmax_bias', "a bias on the output logits (Pax's softmax has one)"),
    Knob('SOFTMAX_CAP_LOGITS', float, 0.0, LM + 'softmax_cap_logits',
         '> 0: logits = cap * tanh(logits / cap), inside the loss (LOSS_CHUNK_TOKENS); 0: off'),
    Knob('ATTEN_LOGIT_CAP', float, 0.0, ATTENTION + 'atten_logit_cap',
         "the same for attention logits, before the mask (Gemma 2's attn_logit_softcapping)"),
    Knob('SLIDING_WINDOW', int, 0, ATTENTION + 'sliding_window',
         '0: full causal attention; w > 0: each token attends to the w most recent tokens, itself included '
         "(Hugging Face's sliding_window); per layer kind through LAYER_KINDS"),
    Knob('USE_PER_DIM_SCALE', bool, False, ATTENTION + 'per_dim_scale', "learned per-dimension query scale (Pax's PerDimScale)"),
    Knob('TIED_LOGITS_BFLOAT16', bool, False, LM + 'tied_logits_bfloat16',
         "tied output logits against the embedding table rounded to bfloat16 (MaxText's attend_on_embedding)"),
    Knob('PARALLEL_BLOCK', bool, False, BLOCK + 'parallel',
         "attention and MLP from one norm, added together (MaxText's default decoder_block); no mlp_norm",
         flat='parallel_block'),
    Knob('NORM_EPSILON', float, 1e-6, (NORM + 'epsilon', FINAL_NORM + 'epsilon', ATTENTION + 'norm_epsilon'),
         "added to the variance in every norm (Hugging Face's rms_norm_eps)", flat='norm_epsilon'),
    # Gemma 2 and 3's layer (paxcli.models.gemma); off by default.
    Knob('NORM_PLUS_ONE', bool, False, (NORM + 'plus_one', FINAL_NORM + 'plus_one', ATTENTION + 'norm_plus_one'),
         "norms (QK-norm too) multiply by (1 + scale), scale stored as it is and starting at 0 (Gemma's RMSNorm)",
         flat='norm_plus_one'),
    Knob('POST_NORMS', bool, False, BLOCK + 'post_norms',
         'attention and MLP outputs normalised too before the residual (four norms a layer, as Gemma 2 and 3)',
         flat='post_norms'),
    # praxis' own layer variants (`pax checkpoint convert --from paxml`); off by default.
    Knob('PRE_NORMS', bool, True, BLOCK + 'pre_norms',
         "False: attention and MLP read the residual stream unnormalised (praxis' norm_policy 'post', "
         'with POST_NORMS)', flat='pre_norms'),
    Knob('QK_NORM_AFTER_ROTARY', bool, False, ATTENTION + 'qk_norm_after_rotary',
         "USE_QK_NORM after rotary positions rather than before (praxis' ln_tpl on attention)"),
    Knob('QUERY_PRE_ATTN_SCALAR', Optional[float], None, ATTENTION + 'query_pre_attn_scalar',
         "queries x 1/sqrt(this) instead of 1/sqrt(DIMS_PER_HEAD) (Gemma's query_pre_attn_scalar); None: off"),
    # Granite's multipliers (paxcli.models.granite); 1 (None) is off.
    Knob('EMBEDDING_MULTIPLIER', float, 1.0, LM + 'embedding_multiplier',
         "token embeddings x this (Granite's embedding_multiplier)"),
    Knob('RESIDUAL_MULTIPLIER', float, 1.0, BLOCK + 'residual_multiplier',
         "attention's and the MLP's outputs x this where they join the residual stream (Granite's "
         'residual_multiplier)'),
    Knob('ATTENTION_MULTIPLIER', Optional[float], None, ATTENTION + 'attention_multiplier',
         "attention logits are queries . keys x this (Granite's attention_multiplier); None: "
         '1/sqrt(QUERY_PRE_ATTN_SCALAR or DIMS_PER_HEAD)'),
    Knob('LOGITS_SCALING', float, 1.0, LM + 'logits_scaling',
         "output logits divided by this, before SOFTMAX_CAP_LOGITS (Granite's logits_scaling)"),
    Knob('ATTENTION_IMPL', AttentionImplName, 'auto', ATTENTION + 'attention_impl',
         'auto: jax.nn.dot_product_attention (cuDNN flash attention on GPUs in bf16/fp16, XLA elsewhere), the '
         'blockwise kernel for capped logits; blockwise: a block of queries at a time, logits never whole; '
         'einsum: the plain reference with explicit float32 logits'),
    # Pipeline parallelism (paxcli.layers.pipeline): NUM_STAGES > 1 needs USE_REPEATED_LAYER and a
    # four-entry ICI_MESH_SHAPE [stage, replica, data, mdl] whose stage entry (times DCN's) equals it.
    # Checkpoints are the same whatever the stage count.
    Knob('NUM_STAGES', int, 1, LM + 'num_stages', 'pipeline stages the layers are split into; 1: no pipeline'),
    Knob('NUM_MICROBATCHES', Optional[int], None, LM + 'num_microbatches', 'None: from MICROBATCH_SIZE, else NUM_STAGES'),
    Knob('MICROBATCH_SIZE', Optional[int], None, LM + 'microbatch_size', 'rows of the global batch per microbatch'),
    Knob('PIPELINE_CIRCULAR_REPEAT', int, 1, LM + 'pipeline_repeats',
         'R > 1: each stage holds R groups of layers, visited in turn'),
    # LoRA (paxcli.layers.lora): adapters beside the frozen kernels; only they train. Start from base
    # weights with INIT_FROM (a checkpoint, e.g. one `pax checkpoint convert --from hf` wrote).
    Knob('LORA_RANK', int, 0, (ATTENTION + 'lora_rank', FFN + 'lora_rank'), '0: off; r > 0: rank-r adapters'),
    Knob('LORA_ALPHA', float, 16.0, (ATTENTION + 'lora_alpha', FFN + 'lora_alpha'), 'adapters scaled by alpha / rank'),
    Knob('LORA_TARGETS', tuple, ('query', 'value'), (ATTENTION + 'lora_targets', FFN + 'lora_targets'),
         'projections adapted, among query, key, value, output, mlp (wi_0, wi_1, wo)',
         value=lambda s: tuple(s['lora_targets'])),
    Knob('LORA_DROPOUT', float, 0.0, (ATTENTION + 'lora_dropout', FFN + 'lora_dropout'),
         "dropout on the adapters' input, in training"),
    # The loss (paxcli.models.losses.head_lm_loss): logits made a chunk of positions at a time, so that the
    # [batch, length, vocab] logits never exist whole; the same loss and gradients.
    # fp8 projections (paxcli.layers.fp8): attention q/k/v/out and the MLP multiply in fp8 (e4m3 forward,
    # e5m2 gradients); weights stay as they are. 'delayed': scales from an amax history kept in the train
    # state; 'current': from each tensor itself. On devices without fp8 units it is emulated (one warning).
    Knob('FP8', Fp8Name, 'none', (ATTENTION + 'fp8', FFN + 'fp8'), "'none', 'delayed' or 'current' scaling"),
    Knob('FP8_AMAX_HISTORY', int, 1024, (ATTENTION + 'fp8_amax_history', FFN + 'fp8_amax_history'),
         "FP8='delayed': the steps whose largest |value| sets each tensor's scale"),
    Knob('LOSS_CHUNK_TOKENS', int, 0, 'loss_chunk_tokens',
         'the loss makes the logits of at most this many tokens per device at a time (proportionally fewer above '
         'a 32k vocabulary; 2048 a good start); 0 (default): all at once'),
    Knob('MODEL_FAMILY', Optional[str], None, 'family',
         "the model family the model is (paxcli.models.registry: 'llama', 'qwen3', ...), which --to hf and --to "
         'peft write and pax describe names; the family presets and every import set it. None: placed by its '
         'function where exactly one family computes it', flat='family'),
    Knob('LORA_BASE_DTYPE', DTypeName, 'float32', 'lora_base_dtype',
         'dtype the frozen base weights are kept in with LORA_RANK > 0 (bfloat16 halves their memory)'),
    # Layer kinds (paxcli.models.pattern): the stack repeats a group of kinds, each kind the block with
    # its own knob values. Checkpoints of a one-kind stack (the default) keep the uniform layout.
    Knob('LAYER_PATTERN', tuple[str, ...], (), LM + 'layer_pattern',
         "the kinds of one group of layers in order, e.g. ('local', 'global'); NUM_LAYERS is a multiple of its "
         'length; (): every layer alike', value=lambda s: tuple(s['layer_pattern'])),
    Knob('LAYER_PREFIX', tuple[str, ...], (), LM + 'layer_prefix',
         "the kinds of the first layers, before LAYER_PATTERN's groups, e.g. ('dense',) * 3 (DeepSeek's "
         'first_k_dense_replace); NUM_LAYERS counts them; (): none', value=lambda s: tuple(s['layer_prefix'])),
    Knob('LAYER_KINDS', dict[str, dict[str, Any]], {}, LM + 'layer_kinds',
         "per kind, the knobs of its layers that differ, e.g. {'local': {'ROTARY_MAX_TIMESCALE': 1e4}}; a kind "
         'not listed is the plain layer', value=lambda s: kind_fields(s)),
)
LM_KNOB = {k.name: k for k in LM_KNOBS}


def kind_fields(settings: Settings) -> tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]:
  """LAYER_KINDS as TransformerLm.layer_kinds: (kind, ((field below block_tpl, value), ...)) for every kind of
  LAYER_PATTERN (and LAYER_PREFIX), in order of first appearance: the block fields whose value the kind's knobs
  change (NUM_HEADS also moves DIMS_PER_HEAD when that follows it). A kind's knob that is unknown, sets no block
  field or has a wrong type, and a kind neither names, are one-line UserErrors."""
  pattern, kinds = tuple(settings['layer_pattern']), dict(settings['layer_kinds'] or {})
  used = pattern + tuple(settings.get('layer_prefix') or ())
  stray = [k for k in kinds if k not in used]
  if stray:
    prefix = f' or LAYER_PREFIX {tuple(settings["layer_prefix"])}' if settings.get('layer_prefix') else ''
    raise UserError(f'LAYER_KINDS names {stray[0]!r}, which LAYER_PATTERN {pattern}{prefix} does not use.'
                    f'{did_you_mean(str(stray[0]), used)}')
  base = dict(_block_assignments(settings))
  out = []
  for kind in dict.fromkeys(used):
    own = {**settings, **_kind_settings(kind, kinds.get(kind) or {})}
    out.append((kind, _changed(_block_assignments(own), base)))
  return tuple(out)


def _changed(assigned: list[tuple[str, Any]], base: dict) -> tuple[tuple[str, Any], ...]:
  """The assignments whose value differs from the base's, and every one inside a template that was swapped
  (the fresh template has none of the base's fields)."""
  out, swapped = [], []
  for path, value in assigned:
    if base.get(path) != value or any(path.startswith(p + '.') for p in swapped):
      out.append((path, value))
      if isinstance(value, Template):
        swapped.append(path)
  return tuple(out)


def _kind_settings(kind: str, knob_values: Mapping[str, Any]) -> dict[str, Any]:
  """Flat settings from one kind's knob values (UPPERCASE), each checked: a per-layer knob of LM_KNOBS, its type."""
  out = {}
  for name, raw in knob_values.items():
    knob = LM_KNOB.get(name)
    if knob is None:
      raise UserError(f'LAYER_KINDS[{kind!r}] sets {name!r}, which is not a model knob.'
                      f'{did_you_mean(str(name), LM_KNOB)}')
    if not any(f.startswith(BLOCK) for f in knob.fields) or name in ('LAYER_PATTERN', 'LAYER_KINDS'):
      per_layer = sorted(k.name for k in LM_KNOBS if any(f.startswith(BLOCK) for f in k.fields))
      raise UserError(f'LAYER_KINDS[{kind!r}] sets {name}, which is not a per-layer knob; a kind may set '
                      f'{", ".join(per_layer)}.')
    out[knob.flat] = coerce(raw, knob.type, f'LAYER_KINDS[{kind!r}][{name!r}]')
    knob.check(out[knob.flat], f'LAYER_KINDS[{kind!r}]: ')
  return out


def _block_assignments(settings: Settings) -> list[tuple[str, Any]]:
  """(field below block_tpl, value) of every block field the table sets from complete settings."""
  rows = tuple(k for k in LM_KNOBS if k.name != 'LAYER_KINDS')
  return [(path[len(BLOCK):], value) for path, value in assignments(settings, rows) if path.startswith(BLOCK)]
