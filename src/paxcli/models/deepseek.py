"""The DeepSeek-V3 family: Hugging Face `DeepseekV3ForCausalLM` (DeepSeek-V3, R1 and the models of its shape).

A DeepSeek-V3 layer is a Llama-shaped pre-norm layer (RMSNorm, gated SiLU, no biases) with two parts of its own:
  multi-head latent attention (paxcli.layers.mla: KV_LORA_RANK, Q_LORA_RANK, QK_NOPE_HEAD_DIMS, QK_ROPE_HEAD_DIMS,
    V_HEAD_DIMS), rotary positions on neighbouring pairs (rope_interleave: ROTARY_INTERLEAVE), YaRN scaling
    (rope_scaling yarn, read by paxcli.models.hf_config as every family's), whose mscale_all_dim also scales
    the attention logits;
  DeepSeekMoE (paxcli.layers.moe): n_routed_experts experts of moe_intermediate_size (NUM_EXPERTS, HIDDEN_DIMS)
    scored by a sigmoid (ROUTER_SOFTMAX='sigmoid'), num_experts_per_tok chosen by score + the load-balancing
    bias e_score_correction_bias (ROUTER_BIAS) among the topk_group best of n_group groups (ROUTER_GROUPS,
    ROUTER_TOPK_GROUPS), weighted by their scores renormalised (norm_topk_prob) times routed_scaling_factor
    (ROUTED_SCALING_FACTOR), beside n_shared_experts shared experts every token goes through (one dense MLP of
    n_shared_experts x moe_intermediate_size: SHARED_EXPERT_HIDDEN_DIMS).
The first first_k_dense_replace layers have a dense MLP of intermediate_size instead: LAYER_PREFIX ('dense',) x k,
LAYER_KINDS {'dense': {'NUM_EXPERTS': 0, 'HIDDEN_DIMS': intermediate_size}} (paxcli.models.pattern).

Weight map (paxcli unrolled names <- DeepseekV3ForCausalLM's; nn.Linear weights [out, in], paxcli kernels [in, ...]):
  params/layer_i/attention_norm/scale, mlp_norm/scale   model.layers.i.input_layernorm, post_attention_layernorm
  .../attention/query_down/kernel [D, Rq]                self_attn.q_a_proj.weight [Rq, D]
  .../attention/query_norm/scale [Rq]                    self_attn.q_a_layernorm.weight
  .../attention/query_up/kernel [Rq, H, Dn+Dr]           self_attn.q_b_proj.weight [H (Dn+Dr), Rq]
  .../attention/query/kernel [D, H, Dn+Dr]               self_attn.q_proj.weight (q_lora_rank null)
  .../attention/kv_down/kernel [D, R+Dr]                 self_attn.kv_a_proj_with_mqa.weight [R+Dr, D]
  .../attention/kv_norm/scale [R]                        self_attn.kv_a_layernorm.weight
  .../attention/kv_up/kernel [R, H, Dn+Dv]               self_attn.kv_b_proj.weight [H (Dn+Dv), R]
  .../attention/out/kernel [H, Dv, D]                    self_attn.o_proj.weight [D, H Dv]
  .../mlp/wi_0|wi_1|wo/kernel (dense layers)             mlp.gate_proj|up_proj|down_proj.weight
  .../mlp/router [D, E], router_bias [E]                 mlp.gate.weight [E, D], mlp.gate.e_score_correction_bias
  .../mlp/wi_0|wi_1|wo [E, ...], row e                   mlp.experts.e.gate_proj|up_proj|down_proj.weight
  .../mlp/shared/wi_0|wi_1|wo/kernel                     mlp.shared_experts.gate_proj|up_proj|down_proj.weight
(transformers 5's fused spelling of the experts, mlp.experts.gate_up_proj and down_proj, is read too.)

config.json: read as DeepseekV3Config reads it (its defaults where a key is missing). Moot: head_dim and
qk_head_dim (transformers derives them from qk_rope_head_dim and the two), num_nextn_predict_layers (the
multi-token-prediction module: DeepseekV3ForCausalLM builds none and leaves its weights, model.layers.<L>, out),
aux_loss_alpha, seq_aux and output_router_logits (training losses transformers does not compute), ep_size,
and an auto_map naming DeepSeek-V3's own classes (transformers without remote code runs its own
DeepseekV3ForCausalLM, which the certification runs too). Refused by name: quantization_config (the released
checkpoints hold FP8 weights in 128 x 128 blocks with their scales: dequantize to bfloat16 first), a
scoring_func other than sigmoid, a topk_method other than noaux_tc, moe_layer_freq other than 1,
num_key_value_heads other than num_attention_heads, biases and dropout.
"""

from __future__ import annotations

from typing import Optional

from paxcli.errors import UserError
from paxcli.models import hf_config
from paxcli.models.family import Piece, Weight, fuse
from paxcli.models.knobs import BLOCK, LM_KNOB, LM_KNOBS
from paxcli.models.llama import NEUTRAL_VALUES, Llama
from paxcli.models.moe_family import _EXPERT_ROWS, FUSED_SUFFIX, Experts

DENSE = 'dense'   # the kind of the first layers (LAYER_PREFIX)
# config.json key -> the knob it is, both ways.
_HF_KNOBS = {'vocab_size': 'VOCAB_SIZE', 'hidden_size': 'MODEL_DIMS', 'moe_intermediate_size': 'HIDDEN_DIMS',
             'num_hidden_layers': 'NUM_LAYERS', 'num_attention_heads': 'NUM_HEADS',
             'max_position_embeddings': 'MAX_SEQ_LEN', 'rms_norm_eps': 'NORM_EPSILON',
             'rope_theta': 'ROTARY_MAX_TIMESCALE', 'kv_lora_rank': 'KV_LORA_RANK',
             'qk_nope_head_dim': 'QK_NOPE_HEAD_DIMS', 'qk_rope_head_dim': 'QK_ROPE_HEAD_DIMS',
             'v_head_dim': 'V_HEAD_DIMS', 'n_routed_experts': 'NUM_EXPERTS', 'num_experts_per_tok': 'EXPERTS_PER_TOKEN',
             'n_group': 'ROUTER_GROUPS', 'topk_group': 'ROUTER_TOPK_GROUPS',
             'routed_scaling_factor': 'ROUTED_SCALING_FACTOR'}
# Keys transformers derives or never computes with (the module docstring), and the ones read besides _HF_KNOBS.
_MOOT_KEYS = frozenset({'head_dim', 'qk_head_dim', 'num_nextn_predict_layers', 'num_mtp_layers', 'aux_loss_alpha',
                        'seq_aux', 'output_router_logits', 'ep_size', 'auto_map'})
READ_KEYS = frozenset(_HF_KNOBS) | _MOOT_KEYS | {
    'intermediate_size', 'num_key_value_heads', 'q_lora_rank', 'n_shared_experts', 'first_k_dense_replace',
    'norm_topk_prob', 'rope_interleave', 'tie_word_embeddings', 'rope_scaling', 'rope_parameters',
    'num_local_experts', 'quantization_config'}
NEUTRAL = {**{k: v for k, v in NEUTRAL_VALUES.items() if k != 'mlp_bias'}, 'scoring_func': 'sigmoid',
           'topk_method': 'noaux_tc', 'moe_layer_freq': 1}
# auto_map values of the released configs: DeepSeek-V3's own classes (the Hub may put the repository in front).
_OWN_CLASSES = ('configuration_deepseek.DeepseekV3Config', 'modeling_deepseek.DeepseekV3Model',
                'modeling_deepseek.DeepseekV3ForCausalLM')


class DeepseekV3(Experts, Llama):
  name = 'deepseek_v3'
  title = 'DeepSeek-V3'
  description = ('DeepSeek-V3: multi-head latent attention, YaRN, DeepSeekMoE (a sigmoid router with its '
                 'load-balancing bias, group-limited top-k, shared experts), the first layers dense '
                 '(HF DeepseekV3ForCausalLM)')
  # DeepSeek-V3's shape: what every member shares, at the released sizes where a size is meant (its shared expert,
  # n_shared_experts x HIDDEN_DIMS wide, and its dense first layers are a recipe's: recipes/deepseek.py).
  knobs = {**Llama.knobs, 'KV_LORA_RANK': 512, 'Q_LORA_RANK': 1536, 'QK_NOPE_HEAD_DIMS': 128, 'QK_ROPE_HEAD_DIMS': 64,
           'V_HEAD_DIMS': 128, 'ROTARY_INTERLEAVE': True, 'NUM_EXPERTS': 256, 'EXPERTS_PER_TOKEN': 8,
           'ROUTER_SOFTMAX': 'sigmoid', 'ROUTER_NORMALIZE_TOPK': True, 'ROUTER_BIAS': True, 'ROUTER_GROUPS': 8,
           'ROUTER_TOPK_GROUPS': 4, 'ROUTED_SCALING_FACTOR': 2.5, 'MOE_DISPATCH': 'dropless',
           'LOAD_BALANCE_LOSS_WEIGHT': 0.0}
  hf_model_types = ('deepseek_v3',)
  hf_architectures = ('DeepseekV3ForCausalLM',)
  hf_read_keys = READ_KEYS
  hf_neutral = NEUTRAL
  # transformers' DeepseekV3Config defaults, for keys a config.json leaves out (tests/test_family_contract.py).
  hf_defaults = {'max_position_embeddings': 4096, 'rope_theta': 10000.0, 'rms_norm_eps': 1e-6,
                 'moe_intermediate_size': 2048, 'kv_lora_rank': 512, 'q_lora_rank': 1536, 'qk_nope_head_dim': 128,
                 'qk_rope_head_dim': 64, 'v_head_dim': 128, 'n_routed_experts': 256, 'num_experts_per_tok': 8,
                 'n_group': 8, 'topk_group': 4, 'routed_scaling_factor': 2.5, 'n_shared_experts': 1,
                 'first_k_dense_replace': 3, 'norm_topk_prob': True, 'rope_interleave': True,
                 'intermediate_size': 18432, 'vocab_size': 129280, 'hidden_size': 7168, 'num_hidden_layers': 61,
                 'num_attention_heads': 128, 'num_key_value_heads': 128}
  attention_features = {'qkv_bias': False, 'qk_norm': False}
  hf_moe_prefix = 'mlp'
  hf_expert_names = ('gate_proj', 'up_proj', 'down_proj')
  hf_experts_key = 'n_routed_experts'
  maxtext_blocks = {}
  maxtext_layer_params = {}

  # ---- what a DeepSeek-V3 is ----

  def attention_misfit(self, model) -> list[str]:
    if not getattr(model, 'kv_lora_rank', None):
      return [f'attention has key and value heads (a {self.title}\'s is multi-head latent attention: KV_LORA_RANK='
              f'{self.knobs["KV_LORA_RANK"]}, ...)']
    return []

  def mlp_misfit(self, model) -> list[str]:
    title, e = self.title, getattr(model, 'num_experts', 0)
    if not e:
      return [f'the MLP is dense (a {title}\'s, after its dense first layers, is a mixture of experts: NUM_EXPERTS)']
    reasons = []
    if model.router_softmax != 'sigmoid' or not model.router_bias:
      reasons.append(f'the router is {model.router_softmax!r}{"" if model.router_bias else " without a bias"} '
                     f'({title}\'s scores experts by a sigmoid, chosen with a bias: ROUTER_SOFTMAX=\'sigmoid\', '
                     'ROUTER_BIAS=True)')
    shared, f = getattr(model, 'shared_hidden_dims', 0) or 0, model.hidden_dims
    if shared % f:
      reasons.append(f'the shared expert\'s {shared} units are not a whole number of experts of {f} '
                     f'({title}\'s are n_shared_experts x HIDDEN_DIMS: SHARED_EXPERT_HIDDEN_DIMS)')
    if getattr(model, 'shared_gate', False):
      reasons.append(f'the shared expert is gated (SHARED_EXPERT_GATE; {title}\'s is not)')
    if getattr(model, 'moe_dispatch', 'dropless') != 'dropless':
      reasons.append(f'capacity dispatch drops tokens (MOE_DISPATCH={model.moe_dispatch!r}; {title} computes every '
                     'choice: MOE_DISPATCH=\'dropless\')')
    return reasons

  def kinds_misfit(self, model) -> list[str]:
    """Dense first layers (a prefix of one kind that makes the MLP dense) and the same layer after them."""
    if tuple(model.layer_pattern or ()):
      return [f'LAYER_PATTERN {tuple(model.layer_pattern)} repeats several kinds ({self.title}\'s layers after '
              'its dense first ones are all alike: LAYER_PATTERN=())']
    prefix, kinds = tuple(getattr(model, 'layer_prefix', ()) or ()), dict(model.layer_kinds or ())
    if set(prefix) - {DENSE} or any(kind != DENSE for kind, fields in kinds.items() if fields):
      return [f'LAYER_PREFIX {prefix} with LAYER_KINDS {sorted(kinds)} (a {self.title}\'s first layers are of '
              f'the kind {DENSE!r}, a dense MLP: LAYER_KINDS={{{DENSE!r}: {{\'NUM_EXPERTS\': 0, \'HIDDEN_DIMS\': '
              '...}})']
    fields = dict(kinds.get(DENSE, ()))
    swapped = getattr(fields.get('ffn_tpl'), 'cls', None)
    changed = sorted(_differing(model, fields))
    if prefix and (getattr(swapped, '__name__', '') != 'Mlp' or changed):
      return [f'LAYER_KINDS[{DENSE!r}] changes {changed or ["ffn_tpl"]} (a {self.title}\'s first layers differ only '
              "in a dense MLP: {'NUM_EXPERTS': 0, 'HIDDEN_DIMS': intermediate_size})"]
    return []

  # ---- config.json ----

  def hf_problems(self, config: dict) -> list[str]:
    problems = []
    if config.get('quantization_config') is not None:
      problems.append(f'quantization_config {hf_config.shown(config["quantization_config"])} (quantized weights: '
                      'paxcli reads bfloat16 or float32 ones; dequantize the checkpoint first, e.g. DeepSeek\'s '
                      'fp8_cast_bf16.py for its FP8 blocks)')
    auto_map = config.get('auto_map')
    if auto_map is not None and not (isinstance(auto_map, dict) and all(
        isinstance(v, str) and v.split('--')[-1] in _OWN_CLASSES for v in auto_map.values())):
      problems.append(f'auto_map {hf_config.shown(auto_map)} (custom code other than DeepSeek-V3\'s own classes: it '
                      'may compute another function)')
    heads = config.get('num_attention_heads', self.hf_defaults['num_attention_heads'])
    kv_heads = config.get('num_key_value_heads', self.hf_defaults['num_key_value_heads'])   # null: as many
    if kv_heads is not None and kv_heads != heads:
      problems.append(f'num_key_value_heads {hf_config.shown(kv_heads)} (latent attention makes a key and value for '
                      f'each of the {hf_config.shown(heads)} heads: num_attention_heads)')
    return problems

  def from_hf_config(self, config: dict, path: str) -> tuple[dict, list[str]]:
    """paxcli knobs for a DeepSeek-V3 config.json, and notes; a UserError naming every key paxcli cannot express."""
    problems = hf_config.function_changing(config, self.hf_read_keys, self.hf_neutral, self.title)
    problems += self.hf_problems(config)
    rope = hf_config.rope_scaling(config, problems)
    if problems:
      raise UserError(f'{path}: this {self.title} config cannot be expressed in paxcli: ' + '; '.join(problems) + '.')
    defaults = self.hf_defaults
    get = hf_config.Reader({**config, 'rope_theta': config.get('rope_theta', rope.pop('rope_theta', None))},
                           f'{path}/config.json', f'a {self.title} config')
    knobs = dict(self.knobs)
    for key, knob in _HF_KNOBS.items():
      knobs[knob] = (get.float if LM_KNOB[knob].type is float else get.int)(key, defaults.get(key))
    q_rank = config['q_lora_rank'] if 'q_lora_rank' in config else defaults['q_lora_rank']   # null: no latent
    knobs.update(
        Q_LORA_RANK=0 if q_rank is None else get.int('q_lora_rank', q_rank), USE_REPEATED_LAYER=False,
        SEPARATE_EMBEDDING=not get.bool('tie_word_embeddings', False),
        ROUTER_NORMALIZE_TOPK=get.bool('norm_topk_prob', defaults['norm_topk_prob']),
        ROTARY_INTERLEAVE=get.bool('rope_interleave', defaults['rope_interleave']),
        SHARED_EXPERT_HIDDEN_DIMS=knobs['HIDDEN_DIMS'] * _count(get, 'n_shared_experts', defaults))
    knobs.update(self._dense_first(get, knobs['NUM_LAYERS'], defaults))
    knobs.update(hf_config.rope_knobs(rope, hf_config.Reader(rope, f'{path}/config.json rope_scaling'),
                                      knobs['MAX_SEQ_LEN']))
    experts, groups, k = knobs['NUM_EXPERTS'], knobs['ROUTER_GROUPS'], knobs['EXPERTS_PER_TOKEN']
    if experts % groups or knobs['ROUTER_TOPK_GROUPS'] > groups or knobs['ROUTER_TOPK_GROUPS'] * (experts // groups) < k:
      raise UserError(f'{path}/config.json: n_group {groups} must divide n_routed_experts {experts}, and topk_group '
                      f'{knobs["ROUTER_TOPK_GROUPS"]} of them hold at least num_experts_per_tok {k} experts.')
    return knobs, []

  def _dense_first(self, get: hf_config.Reader, layers: int, defaults: dict) -> dict:
    """The knobs of first_k_dense_replace: the dense first layers (every layer dense when it is all of them)."""
    dense, width = _count(get, 'first_k_dense_replace', defaults), get.int('intermediate_size', defaults['intermediate_size'])
    if dense >= layers:
      return {'NUM_EXPERTS': 0, 'HIDDEN_DIMS': width, 'SHARED_EXPERT_HIDDEN_DIMS': 0}
    if not dense:
      return {'LAYER_PREFIX': (), 'LAYER_KINDS': {}}
    return {'LAYER_PREFIX': (DENSE,) * dense, 'LAYER_KINDS': {DENSE: {'NUM_EXPERTS': 0, 'HIDDEN_DIMS': width}}}

  def to_hf_config(self, model, dtype: str = 'float32', token_ids: Optional[dict] = None) -> dict:
    """config.json of a DeepseekV3ForCausalLM."""
    # A model without experts (every layer dense) has no router settings: transformers' defaults, which it ignores.
    settings = {key: _plain(getattr(model, LM_KNOB[knob].flat, None), self.hf_defaults[key])
                for key, knob in _HF_KNOBS.items()}
    dense = self._dense(model, 0) or model.hidden_dims
    first = model.num_layers if not model.num_experts else len(tuple(getattr(model, 'layer_prefix', ()) or ()))
    return {
        'architectures': [self.hf_architectures[0]], 'model_type': self.hf_model_types[0], **settings,
        'num_key_value_heads': int(model.num_heads), 'intermediate_size': int(dense), 'first_k_dense_replace': first,
        'n_shared_experts': int((model.shared_hidden_dims or 0) // model.hidden_dims),
        'q_lora_rank': int(model.q_lora_rank) or None, 'norm_topk_prob': _plain(model.normalize_topk, True),
        'rope_interleave': bool(model.rotary_interleave), 'rms_norm_eps': float(settings['rms_norm_eps']),
        'rope_theta': float(settings['rope_theta']), 'rope_scaling': hf_config.rope_scaling_of(model),
        'hidden_act': 'silu',
        'attention_bias': False, 'attention_dropout': 0.0, 'scoring_func': 'sigmoid', 'topk_method': 'noaux_tc',
        'moe_layer_freq': 1, 'num_nextn_predict_layers': 0, 'tie_word_embeddings': not model.separate_embedding,
        'initializer_range': 0.02, 'torch_dtype': dtype, 'use_cache': True,
        **(token_ids or {'bos_token_id': None, 'eos_token_id': None, 'pad_token_id': None}),
    }

  # ---- weights ----

  def hf_weights(self, model) -> list[Weight]:
    """The weight map of an unrolled model (the module docstring's table)."""
    d, v, same = model.model_dims, model.vocab_size, hf_config.SAME
    out = [Weight('model.embed_tokens.weight', 'params/embedding/embedding', (v, d), (v, d), *same)]
    for i in range(model.num_layers):
      hp, pp = f'model.layers.{i}.', f'params/layer_{i}/'
      out += [Weight(hp + 'input_layernorm.weight', pp + 'attention_norm/scale', (d,), (d,), *same),
              *self._attention_weights(model, hp, pp),
              Weight(hp + 'post_attention_layernorm.weight', pp + 'mlp_norm/scale', (d,), (d,), *same),
              *self.hf_mlp_weights(model, i, hp, pp)]
    out.append(Weight('model.norm.weight', 'params/final_norm/scale', (d,), (d,), *same))
    if model.separate_embedding:
      out.append(Weight('lm_head.weight', 'params/logits/kernel', (v, d), (d, v), *hf_config.linear(d)))
    return out

  def _attention_weights(self, model, hp: str, pp: str) -> list[Weight]:
    d, h, r = model.model_dims, model.num_heads, model.kv_lora_rank
    dn, dr, dv, rq = model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim, model.q_lora_rank or 0
    linear, same, ap, hs = hf_config.linear, hf_config.SAME, pp + 'attention/', hp + 'self_attn.'
    if rq:
      query = [Weight(hs + 'q_a_proj.weight', ap + 'query_down/kernel', (rq, d), (d, rq), *linear(d)),
               Weight(hs + 'q_a_layernorm.weight', ap + 'query_norm/scale', (rq,), (rq,), *same),
               Weight(hs + 'q_b_proj.weight', ap + 'query_up/kernel', (h * (dn + dr), rq), (rq, h, dn + dr),
                      *linear(rq))]
    else:
      query = [Weight(hs + 'q_proj.weight', ap + 'query/kernel', (h * (dn + dr), d), (d, h, dn + dr), *linear(d))]
    return query + [
        Weight(hs + 'kv_a_proj_with_mqa.weight', ap + 'kv_down/kernel', (r + dr, d), (d, r + dr), *linear(d)),
        Weight(hs + 'kv_a_layernorm.weight', ap + 'kv_norm/scale', (r,), (r,), *same),
        Weight(hs + 'kv_b_proj.weight', ap + 'kv_up/kernel', (h * (dn + dv), r), (r, h, dn + dv), *linear(r)),
        Weight(hs + 'o_proj.weight', ap + 'out/kernel', (d, h * dv), (h, dv, d), *hf_config.out_proj(d))]

  def _dense(self, model, layer: int) -> Optional[int]:
    """The MLP width of layer `layer` when it is dense (a layer of the prefix, or every layer without experts)."""
    if layer < len(tuple(getattr(model, 'layer_prefix', ()) or ())):
      return dict(dict(model.layer_kinds or ()).get(DENSE, ())).get('ffn_tpl.hidden_dims', model.hidden_dims)
    return None if model.num_experts else model.hidden_dims

  def hf_mlp_weights(self, model, layer: int, hp: str, pp: str) -> list[Weight]:
    d, f, linear = model.model_dims, self._dense(model, layer), hf_config.linear
    if f is not None:
      return [Weight(hp + 'mlp.gate_proj.weight', pp + 'mlp/wi_0/kernel', (f, d), (d, f), *linear(d)),
              Weight(hp + 'mlp.up_proj.weight', pp + 'mlp/wi_1/kernel', (f, d), (d, f), *linear(d)),
              Weight(hp + 'mlp.down_proj.weight', pp + 'mlp/wo/kernel', (d, f), (f, d), *linear(f))]
    return Experts.hf_mlp_weights(self, model, layer, hp, pp) + self._router_and_shared(model, hp, pp)

  def _router_and_shared(self, model, hp: str, pp: str) -> list[Weight]:
    d, e, s, linear = model.model_dims, model.num_experts, model.shared_hidden_dims or 0, hf_config.linear
    out = [Weight(hp + 'mlp.gate.e_score_correction_bias', pp + 'mlp/router_bias', (e,), (e,), *hf_config.SAME)]
    if s:
      sp, mp = hp + 'mlp.shared_experts.', pp + 'mlp/shared/'
      out += [Weight(sp + 'gate_proj.weight', mp + 'wi_0/kernel', (s, d), (d, s), *linear(d)),
              Weight(sp + 'up_proj.weight', mp + 'wi_1/kernel', (s, d), (d, s), *linear(d)),
              Weight(sp + 'down_proj.weight', mp + 'wo/kernel', (d, s), (s, d), *linear(s))]
    return out

  def hf_read_weights(self, model, names) -> list[Weight]:
    """hf_weights, or with transformers 5's fused experts (mlp.experts.gate_up_proj, down_proj) in their place."""
    if not any(str(n).endswith(FUSED_SUFFIX) for n in names):
      return self.hf_weights(model)
    d, f, e = model.model_dims, model.hidden_dims, model.num_experts
    out = []
    for w in self.hf_weights(model):
      if '.mlp.experts.' not in w.hf:
        out.append(w)
      elif w.paxcli_piece == Piece(0, 0) and w.hf.endswith('.gate_proj.weight'):   # once per layer: the fused rows
        mp, pp = w.hf.split('experts.')[0], w.paxcli.rsplit('/', 1)[0] + '/'
        out += [*fuse(mp + 'experts.gate_up_proj', 1, [Weight('', pp + 'wi_0', (e, f, d), (e, d, f), *_EXPERT_ROWS),
                                                       Weight('', pp + 'wi_1', (e, f, d), (e, d, f), *_EXPERT_ROWS)]),
                Weight(mp + 'experts.down_proj', pp + 'wo', (e, d, f), (e, f, d), *_EXPERT_ROWS)]
    return out


def _differing(model, fields: dict) -> list[str]:
  """The block fields of a kind that differ from the model's own settings, other than the dense MLP and its width.
  Swapping the MLP in repeats every field of its template (activation, LoRA, fp8...): those equal to the knob
  they come from are the other layers' settings, not a change."""
  out = []
  for field, value in fields.items():
    if field in ('ffn_tpl', 'ffn_tpl.hidden_dims'):
      continue
    sources = [k for k in LM_KNOBS if BLOCK + field in k.fields]
    if not sources or any(getattr(model, k.flat, None) != value for k in sources):
      out.append(field)
  return out


def _count(get: hf_config.Reader, key: str, defaults: dict) -> int:
  """A count of config.json that may be 0 (shared experts, dense first layers): the class's default where missing."""
  return 0 if get.config.get(key) == 0 else get.int(key, defaults[key])


def _plain(value, default):
  """A setting as config.json holds it (a float as a float, None as the default)."""
  if value is None:
    return default
  return float(value) if isinstance(default, float) else (bool(value) if isinstance(default, bool) else int(value))


DEEPSEEK_V3 = DeepseekV3()
