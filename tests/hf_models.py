"""Reference models for the Hugging Face family tests: built by transformers' own model classes from a
family's released config.json at a reduced size, every weight random (norms around 1, biases around 0:
a weight left at its initial value could hide a mapping that drops it), saved with save_pretrained.

REFERENCES holds one entry per paxcli family with a Hugging Face layout; a family registers here (a
released config.json, the sizes to cut it to, lines its --from hf recipe must hold, what it refuses) and
tests/test_hf_families.py holds it against transformers: import, logits, greedy decoding, export,
LoRA through PEFT, certification; tests/test_family_contract.py holds its config.json defaults against
transformers' config class, its refusals, and its parameter count at the released size.
conftest's `hf_reference` fixture builds each once per session.
"""

import copy
import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Reference:
  family: str          # paxcli's family name (paxcli.models.registry)
  architecture: str    # transformers' class for it
  released: dict       # a released model's config.json: its function-defining keys as shipped
  sizes: dict          # what replaces the released sizes for a test
  recipe_lines: tuple  # lines the recipe `--from hf` writes must hold
  recipe_class: str    # the experiment class of that recipe
  # What the family refuses: (changes to `released`, the texts its one-line error must hold), one or more.
  refusals: tuple = ()
  experts: bool = False  # a mixture of experts: LoRA adapts attention only (experts take no adapters)

  @property
  def config(self) -> dict:
    # A copy all the way down: transformers' config classes fill rope_scaling in place.
    return copy.deepcopy({**self.released, **self.sizes})


# huggingface.co/meta-llama/Llama-3.2-1B/config.json. At head_dim 8 and rope_theta 5e5 the llama3 rope
# scaling puts rotated pairs in all three of its bands (kept, smoothed, divided by factor).
LLAMA32_1B = {
    'architectures': ['LlamaForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0, 'bos_token_id': 128000,
    'eos_token_id': 128001, 'head_dim': 64, 'hidden_act': 'silu', 'hidden_size': 2048, 'initializer_range': 0.02,
    'intermediate_size': 8192, 'max_position_embeddings': 131072, 'mlp_bias': False, 'model_type': 'llama',
    'num_attention_heads': 32, 'num_hidden_layers': 16, 'num_key_value_heads': 8, 'pretraining_tp': 1,
    'rms_norm_eps': 1e-05, 'rope_scaling': {'factor': 32.0, 'high_freq_factor': 4.0, 'low_freq_factor': 1.0,
                                            'original_max_position_embeddings': 8192, 'rope_type': 'llama3'},
    'rope_theta': 500000.0, 'tie_word_embeddings': True, 'torch_dtype': 'bfloat16',
    'transformers_version': '4.45.0.dev0', 'use_cache': True, 'vocab_size': 128256}
# huggingface.co/Qwen/Qwen2.5-0.5B/config.json (tied embeddings, as the small Qwen 2.5 sizes are).
QWEN25_05B = {
    'architectures': ['Qwen2ForCausalLM'], 'attention_dropout': 0.0, 'bos_token_id': 151643, 'eos_token_id': 151643,
    'hidden_act': 'silu', 'hidden_size': 896, 'initializer_range': 0.02, 'intermediate_size': 4864,
    'max_position_embeddings': 32768, 'max_window_layers': 24, 'model_type': 'qwen2', 'num_attention_heads': 14,
    'num_hidden_layers': 24, 'num_key_value_heads': 2, 'rms_norm_eps': 1e-06, 'rope_theta': 1000000.0,
    'sliding_window': 32768, 'tie_word_embeddings': True, 'torch_dtype': 'bfloat16', 'transformers_version': '4.40.1',
    'use_cache': True, 'use_sliding_window': False, 'vocab_size': 151936}
# huggingface.co/Qwen/Qwen3-0.6B/config.json.
QWEN3_06B = {
    'architectures': ['Qwen3ForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0, 'bos_token_id': 151643,
    'eos_token_id': 151645, 'head_dim': 128, 'hidden_act': 'silu', 'hidden_size': 1024, 'initializer_range': 0.02,
    'intermediate_size': 3072, 'max_position_embeddings': 40960, 'max_window_layers': 28, 'model_type': 'qwen3',
    'num_attention_heads': 16, 'num_hidden_layers': 28, 'num_key_value_heads': 8, 'rms_norm_eps': 1e-06,
    'rope_scaling': None, 'rope_theta': 1000000, 'sliding_window': None, 'tie_word_embeddings': True,
    'torch_dtype': 'bfloat16', 'transformers_version': '4.51.0', 'use_cache': True, 'use_sliding_window': False,
    'vocab_size': 151936}
# huggingface.co/mistralai/Mistral-7B-v0.1/config.json: a window of 4096 tokens in every layer.
MISTRAL_7B = {
    'architectures': ['MistralForCausalLM'], 'bos_token_id': 1, 'eos_token_id': 2, 'hidden_act': 'silu',
    'hidden_size': 4096, 'initializer_range': 0.02, 'intermediate_size': 14336, 'max_position_embeddings': 32768,
    'model_type': 'mistral', 'num_attention_heads': 32, 'num_hidden_layers': 32, 'num_key_value_heads': 8,
    'rms_norm_eps': 1e-05, 'rope_theta': 10000.0, 'sliding_window': 4096, 'tie_word_embeddings': False,
    'torch_dtype': 'bfloat16', 'transformers_version': '4.34.0.dev0', 'use_cache': True, 'vocab_size': 32000}
# huggingface.co/google/gemma-2-9b/config.json.
GEMMA2_9B = {
    'architectures': ['Gemma2ForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
    'attn_logit_softcapping': 50.0, 'bos_token_id': 2, 'cache_implementation': 'hybrid', 'eos_token_id': 1,
    'final_logit_softcapping': 30.0, 'head_dim': 256, 'hidden_act': 'gelu_pytorch_tanh',
    'hidden_activation': 'gelu_pytorch_tanh', 'hidden_size': 3584, 'initializer_range': 0.02,
    'intermediate_size': 14336, 'max_position_embeddings': 8192, 'model_type': 'gemma2', 'num_attention_heads': 16,
    'num_hidden_layers': 42, 'num_key_value_heads': 8, 'pad_token_id': 0, 'query_pre_attn_scalar': 256,
    'rms_norm_eps': 1e-06, 'rope_theta': 10000.0, 'sliding_window': 4096, 'sliding_window_size': 4096,
    'torch_dtype': 'float32', 'transformers_version': '4.42.0.dev0', 'use_cache': True, 'vocab_size': 256000}
# The text model of huggingface.co/google/gemma-3-4b-pt (config.json's text_config, with the defaults of
# transformers' Gemma3TextConfig it leaves out spelled as the released Gemma 3 1B's config.json spells them).
GEMMA3_4B = {
    'architectures': ['Gemma3ForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
    'attn_logit_softcapping': None, 'bos_token_id': 2, 'cache_implementation': 'hybrid', 'eos_token_id': 1,
    'final_logit_softcapping': None, 'head_dim': 256, 'hidden_activation': 'gelu_pytorch_tanh', 'hidden_size': 2560,
    'initializer_range': 0.02, 'intermediate_size': 10240, 'max_position_embeddings': 131072,
    'model_type': 'gemma3_text', 'num_attention_heads': 8, 'num_hidden_layers': 34, 'num_key_value_heads': 4,
    'pad_token_id': 0, 'query_pre_attn_scalar': 256, 'rms_norm_eps': 1e-06, 'rope_local_base_freq': 10000.0,
    'rope_scaling': {'factor': 8.0, 'rope_type': 'linear'}, 'rope_theta': 1000000.0, 'sliding_window': 1024,
    'sliding_window_pattern': 6, 'torch_dtype': 'bfloat16', 'transformers_version': '4.50.0.dev0',
    'use_cache': True, 'vocab_size': 262208}

# huggingface.co/mistralai/Mixtral-8x7B-v0.1/config.json: 8 experts, 2 per token, no sliding window.
MIXTRAL_8X7B = {
    'architectures': ['MixtralForCausalLM'], 'attention_dropout': 0.0, 'bos_token_id': 1, 'eos_token_id': 2,
    'hidden_act': 'silu', 'hidden_size': 4096, 'initializer_range': 0.02, 'intermediate_size': 14336,
    'max_position_embeddings': 32768, 'model_type': 'mixtral', 'num_attention_heads': 32, 'num_experts_per_tok': 2,
    'num_hidden_layers': 32, 'num_key_value_heads': 8, 'num_local_experts': 8, 'output_router_logits': False,
    'rms_norm_eps': 1e-05, 'rope_theta': 1e6, 'router_aux_loss_coef': 0.02, 'sliding_window': None,
    'tie_word_embeddings': False, 'torch_dtype': 'bfloat16', 'transformers_version': '4.36.0.dev0', 'use_cache': True,
    'vocab_size': 32000}
# huggingface.co/Qwen/Qwen3-30B-A3B/config.json: 128 experts of 768, 8 per token, renormalised; QK-norm.
QWEN3_30B_A3B = {
    'architectures': ['Qwen3MoeForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
    'bos_token_id': 151643, 'decoder_sparse_step': 1, 'eos_token_id': 151645, 'head_dim': 128, 'hidden_act': 'silu',
    'hidden_size': 2048, 'initializer_range': 0.02, 'intermediate_size': 6144, 'max_position_embeddings': 40960,
    'max_window_layers': 48, 'mlp_only_layers': [], 'model_type': 'qwen3_moe', 'moe_intermediate_size': 768,
    'norm_topk_prob': True, 'num_attention_heads': 32, 'num_experts': 128, 'num_experts_per_tok': 8,
    'num_hidden_layers': 48, 'num_key_value_heads': 4, 'output_router_logits': False, 'rms_norm_eps': 1e-06,
    'rope_scaling': None, 'rope_theta': 1000000.0, 'router_aux_loss_coef': 0.001, 'sliding_window': None,
    'tie_word_embeddings': False, 'torch_dtype': 'bfloat16', 'transformers_version': '4.51.0', 'use_cache': True,
    'use_sliding_window': False, 'vocab_size': 151936}

# huggingface.co/microsoft/Phi-3.5-mini-instruct/config.json: LongRoPE (48 short and 48 long factors, one per rotated
# pair of a 96-dimension head) over an original context of 4096, fused qkv_proj and gate_up_proj.
PHI35_MINI_LONG = [1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115,
                   1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863,
                   4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
                   17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
                   32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156,
                   50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457,
                   62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457,
                   63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
                   64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938, 64.4800033569336,
                   64.51000213623047, 64.52999877929688, 64.83999633789062]
PHI35_MINI_SHORT = [1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842,
                    1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0699999332427979,
                    1.0999999046325684, 1.1099998950958252, 1.1599998474121094, 1.1599998474121094, 1.1699998378753662,
                    1.2899998426437378, 1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083,
                    1.8499997854232788, 1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745,
                    2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
                    2.0199997425079346, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
                    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
                    2.0799996852874756, 2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533,
                    2.729999542236328, 2.749999523162842, 2.8399994373321533]
PHI35_MINI = {
    'architectures': ['Phi3ForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
    'auto_map': {'AutoConfig': 'microsoft/Phi-3.5-mini-instruct--configuration_phi3.Phi3Config',
                 'AutoModelForCausalLM': 'microsoft/Phi-3.5-mini-instruct--modeling_phi3.Phi3ForCausalLM'},
    'bos_token_id': 1, 'embd_pdrop': 0.0, 'eos_token_id': 32000, 'hidden_act': 'silu', 'hidden_size': 3072,
    'initializer_range': 0.02, 'intermediate_size': 8192, 'max_position_embeddings': 131072, 'model_type': 'phi3',
    'num_attention_heads': 32, 'num_hidden_layers': 32, 'num_key_value_heads': 32,
    'original_max_position_embeddings': 4096, 'pad_token_id': 32000, 'resid_pdrop': 0.0, 'rms_norm_eps': 1e-05,
    'rope_scaling': {'long_factor': PHI35_MINI_LONG, 'short_factor': PHI35_MINI_SHORT, 'type': 'longrope'},
    'rope_theta': 10000.0, 'sliding_window': 262144, 'tie_word_embeddings': False, 'torch_dtype': 'bfloat16',
    'transformers_version': '4.46.3', 'use_cache': True, 'vocab_size': 32064}
# huggingface.co/allenai/OLMo-2-1124-7B/config.json: post-norms, QK-norm over the whole projections.
OLMO2_7B = {
    'architectures': ['Olmo2ForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0, 'eos_token_id': 100257,
    'hidden_act': 'silu', 'hidden_size': 4096, 'initializer_range': 0.02, 'intermediate_size': 11008,
    'max_position_embeddings': 4096, 'model_type': 'olmo2', 'num_attention_heads': 32, 'num_hidden_layers': 32,
    'num_key_value_heads': 32, 'pad_token_id': 100277, 'rms_norm_eps': 1e-06, 'rope_scaling': None,
    'rope_theta': 500000, 'tie_word_embeddings': False, 'torch_dtype': 'float32',
    'transformers_version': '4.47.0.dev0', 'use_cache': True, 'vocab_size': 100352}
# huggingface.co/ibm-granite/granite-3.1-2b-base/config.json: muP multipliers, tied embeddings, attention dropout
# in training.
GRANITE31_2B = {
    'architectures': ['GraniteForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.1,
    'attention_multiplier': 0.015625, 'bos_token_id': 0, 'embedding_multiplier': 12.0, 'eos_token_id': 0,
    'hidden_act': 'silu', 'hidden_size': 2048, 'initializer_range': 0.02, 'intermediate_size': 8192,
    'logits_scaling': 8.0, 'max_position_embeddings': 131072, 'mlp_bias': False, 'model_type': 'granite',
    'num_attention_heads': 32, 'num_hidden_layers': 40, 'num_key_value_heads': 8, 'pad_token_id': 0,
    'residual_multiplier': 0.22, 'rms_norm_eps': 1e-05, 'rope_scaling': None, 'rope_theta': 5000000.0,
    'tie_word_embeddings': True, 'torch_dtype': 'bfloat16', 'transformers_version': '4.47.0', 'use_cache': True,
    'vocab_size': 49155}

# huggingface.co/deepseek-ai/DeepSeek-V3/config.json less its quantization_config (the released weights are FP8
# blocks, which paxcli refuses by name: the bfloat16 copies' config.json is this): multi-head latent attention,
# YaRN, 256 experts in 8 groups behind a sigmoid router with its bias, a shared expert, the first 3 layers dense.
DEEPSEEK_V3 = {
    'architectures': ['DeepseekV3ForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
    'auto_map': {'AutoConfig': 'configuration_deepseek.DeepseekV3Config',
                 'AutoModel': 'modeling_deepseek.DeepseekV3Model',
                 'AutoModelForCausalLM': 'modeling_deepseek.DeepseekV3ForCausalLM'},
    'aux_loss_alpha': 0.001, 'bos_token_id': 0, 'eos_token_id': 1, 'ep_size': 1, 'first_k_dense_replace': 3,
    'hidden_act': 'silu', 'hidden_size': 7168, 'initializer_range': 0.02, 'intermediate_size': 18432,
    'kv_lora_rank': 512, 'max_position_embeddings': 163840, 'model_type': 'deepseek_v3', 'moe_intermediate_size': 2048,
    'moe_layer_freq': 1, 'n_group': 8, 'n_routed_experts': 256, 'n_shared_experts': 1, 'norm_topk_prob': True,
    'num_attention_heads': 128, 'num_experts_per_tok': 8, 'num_hidden_layers': 61, 'num_key_value_heads': 128,
    'num_nextn_predict_layers': 1, 'q_lora_rank': 1536, 'qk_nope_head_dim': 128, 'qk_rope_head_dim': 64,
    'rms_norm_eps': 1e-06, 'rope_scaling': {'beta_fast': 32, 'beta_slow': 1, 'factor': 40, 'mscale': 1.0,
                                            'mscale_all_dim': 1.0, 'original_max_position_embeddings': 4096,
                                            'type': 'yarn'},
    'rope_theta': 10000, 'routed_scaling_factor': 2.5, 'scoring_func': 'sigmoid', 'seq_aux': True,
    'tie_word_embeddings': False, 'topk_group': 4, 'topk_method': 'noaux_tc', 'torch_dtype': 'bfloat16',
    'transformers_version': '4.33.1', 'use_cache': True, 'v_head_dim': 128, 'vocab_size': 129280}
# The released FP8 checkpoints' quantization_config.
DEEPSEEK_V3_FP8 = {'activation_scheme': 'dynamic', 'fmt': 'e4m3', 'quant_method': 'fp8', 'weight_block_size': [128, 128]}

TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128)
REFERENCES = {r.family: r for r in (
    Reference('llama', 'LlamaForCausalLM', LLAMA32_1B, dict(TINY, head_dim=8),
              ("ROTARY_SCALING = 'llama3'", 'ROTARY_MAX_TIMESCALE = 500000.0', 'SEPARATE_EMBEDDING = False',
               "MODEL_FAMILY = 'llama'"), 'HfLlama',
              refusals=(({'mlp_bias': True, 'rope_scaling': {'rope_type': 'dynamic', 'factor': 4.0}},
                         ('mlp_bias true (paxcli\'s Llama: false)', 'rope_scaling {"rope_type": "dynamic"')),)),
    Reference('qwen2', 'Qwen2ForCausalLM', QWEN25_05B, TINY,
              ('USE_QKV_BIAS = True', 'ROTARY_MAX_TIMESCALE = 1000000.0', 'SEPARATE_EMBEDDING = False'), 'HfQwen2',
              refusals=(({'use_sliding_window': True}, ('use_sliding_window true with sliding_window',)),)),
    # Qwen3's head_dim stays its own setting (4 heads x 16 = 64 != hidden 32), as in the released sizes; untied
    # here, so both layouts of the output layer are held somewhere.
    Reference('qwen3', 'Qwen3ForCausalLM', QWEN3_06B, dict(TINY, head_dim=16, tie_word_embeddings=False),
              ('USE_QK_NORM = True', 'DIMS_PER_HEAD = 16', 'SEPARATE_EMBEDDING = True'), 'HfQwen3',
              refusals=(({'attention_bias': True}, ('attention_bias true (paxcli\'s Qwen3: false)',)),)),
    # A window of 6 tokens, so that the tests' 33- to 64-token texts reach far beyond it.
    Reference('mistral', 'MistralForCausalLM', MISTRAL_7B, dict(TINY, head_dim=8, sliding_window=6),
              ('SLIDING_WINDOW = 6', 'ROTARY_MAX_TIMESCALE = 10000.0', 'SEPARATE_EMBEDDING = True'), 'HfMistral',
              refusals=(({'layer_types': ['sliding_attention', 'full_attention']}, ('layer_types (unknown',)),)),
    # Phi-3.5's LongRoPE with Phi-4-mini's partial rotary (0.75: 6 of a head's 8 dimensions, 3 pairs, each with a
    # released short and long factor), over an original context of 12 positions: the tests' 33- to 64-token texts
    # take the long factors, and a decoded text crosses over (its cache computed again). Fused qkv_proj with GQA,
    # and a window of 6 tokens as Mistral's.
    Reference('phi3', 'Phi3ForCausalLM', PHI35_MINI,
              dict(TINY, sliding_window=6, pad_token_id=0, eos_token_id=2, partial_rotary_factor=0.75,
                   original_max_position_embeddings=12, max_position_embeddings=128,
                   rope_scaling={'type': 'longrope', 'short_factor': PHI35_MINI_SHORT[::16],
                                 'long_factor': PHI35_MINI_LONG[::16]}),
              ('SLIDING_WINDOW = 6', "MODEL_FAMILY = 'phi3'", 'SEPARATE_EMBEDDING = True', 'NORM_EPSILON = 1e-05',
               "ROTARY_SCALING = 'longrope'", 'ROTARY_FRACTION = 0.75', 'ROTARY_ORIGINAL_MAX_LEN = 12'),
              'HfPhi3',
              refusals=(({'partial_rotary_factor': 0.7}, ('partial_rotary_factor 0.7 rotates 67',)),
                        ({'partial_rotary_factor': 0.75}, ('short_factor is [1.0, ',
                                                           'it must be a list of 36 positive numbers')),
                        ({'rope_scaling': {'type': 'linear', 'factor': 2.0}}, ('rope_scaling {"type": "linear"',)),
                        ({'auto_map': {'AutoModelForCausalLM': 'modeling_mine.Mine'}}, ('auto_map {"AutoModelFor',)))),
    # OLMo 2's post-norms and whole-projection QK-norm, with GQA (2 key/value heads: a key norm of 2 x 8).
    Reference('olmo2', 'Olmo2ForCausalLM', OLMO2_7B, dict(TINY, pad_token_id=0, eos_token_id=2),
              ('PRE_NORMS = False', 'POST_NORMS = True', 'USE_QK_NORM = True', 'QK_NORM_PER_HEAD = False',
               'ROTARY_MAX_TIMESCALE = 500000.0', "MODEL_FAMILY = 'olmo2'"), 'HfOLMo2',
              refusals=(({'attention_bias': True}, ('attention_bias true (paxcli\'s OLMo 2: false)',)),)),
    # Granite's released multipliers, the attention one 1/head_dim as released (1/64 there, 1/8 here).
    Reference('granite', 'GraniteForCausalLM', GRANITE31_2B, dict(TINY, attention_multiplier=0.125),
              ('EMBEDDING_MULTIPLIER = 12.0', 'RESIDUAL_MULTIPLIER = 0.22', 'ATTENTION_MULTIPLIER = 0.125',
               'LOGITS_SCALING = 8.0', 'SEPARATE_EMBEDDING = False', "MODEL_FAMILY = 'granite'"), 'HfGranite',
              refusals=(({'mlp_bias': True}, ('mlp_bias true (paxcli\'s Granite: false)',)),
                        ({'logits_scaling': 0}, ('logits_scaling is 0; it must be a positive number',)))),
    # Windows of 5 and 7 tokens, shorter than the tests' prompts, so that the local layers differ from global ones.
    Reference('gemma2', 'Gemma2ForCausalLM', GEMMA2_9B, dict(TINY, head_dim=16, num_hidden_layers=4, sliding_window=5,
                                                              sliding_window_size=5),
              ("LAYER_PATTERN = ('local', 'global')", "LAYER_KINDS = {'local': {'SLIDING_WINDOW': 5}}",
               'ATTEN_LOGIT_CAP = 50.0', 'SOFTMAX_CAP_LOGITS = 30.0', 'QUERY_PRE_ATTN_SCALAR = 256.0',
               'NORM_PLUS_ONE = True', 'POST_NORMS = True'), 'HfGemma2',
              refusals=(({'hidden_activation': 'gelu'}, ('hidden_activation "gelu"',)),)),
    Reference('gemma3', 'Gemma3ForCausalLM', GEMMA3_4B, dict(TINY, head_dim=16, num_hidden_layers=6, sliding_window=7),
              ("LAYER_PATTERN = ('local', 'local', 'local', 'local', 'local', 'global')", 'USE_QK_NORM = True',
               "ROTARY_SCALING = 'linear'", 'ROTARY_MAX_TIMESCALE = 1000000.0'), 'HfGemma3',
              refusals=(({'attn_logit_softcapping': 50.0}, ('attn_logit_softcapping 50.0',)),)),
    Reference('mixtral', 'MixtralForCausalLM', MIXTRAL_8X7B, dict(TINY, head_dim=8, num_local_experts=4),
              ('NUM_EXPERTS = 4', 'EXPERTS_PER_TOKEN = 2', "ROUTER_SOFTMAX = 'after_topk'", 'SLIDING_WINDOW = 0',
               'SEPARATE_EMBEDDING = True'), 'HfMixtral', experts=True,
              refusals=(({'router_jitter_noise': 0.1}, ('router_jitter_noise 0.1 (paxcli\'s Mixtral: 0.0)',)),)),
    # 8 experts, 4 per token: the renormalised top-k weights differ from the softmax's (norm_topk_prob matters).
    Reference('qwen3_moe', 'Qwen3MoeForCausalLM', QWEN3_30B_A3B,
              dict(TINY, head_dim=8, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=24),
              ('NUM_EXPERTS = 8', 'EXPERTS_PER_TOKEN = 4', 'HIDDEN_DIMS = 24', "ROUTER_SOFTMAX = 'before_topk'",
               'ROUTER_NORMALIZE_TOPK = True', 'USE_QK_NORM = True'), 'HfQwen3MoE', experts=True,
              refusals=(({'decoder_sparse_step': 2}, ('decoder_sparse_step 2 (paxcli\'s Qwen3-MoE: 1)',)),)),
    # DeepSeek-V3 cut down with its parts kept: 3 layers, the first dense; 8 experts in 4 groups, 3 per token from
    # the best 2 groups; latents of 16 (kv) and 12 (queries); YaRN from 16 positions, which the tests' texts pass.
    Reference('deepseek_v3', 'DeepseekV3ForCausalLM', DEEPSEEK_V3,
              dict(TINY, num_key_value_heads=4, num_hidden_layers=3, first_k_dense_replace=1, moe_intermediate_size=16,
                   kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                   n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, max_position_embeddings=64,
                   rope_scaling=dict(DEEPSEEK_V3['rope_scaling'], factor=4, original_max_position_embeddings=16)),
              ('KV_LORA_RANK = 16', 'Q_LORA_RANK = 12', "ROTARY_SCALING = 'yarn'", 'ROTARY_INTERLEAVE = True',
               "ROUTER_SOFTMAX = 'sigmoid'", 'ROUTER_GROUPS = 4', 'ROUTER_TOPK_GROUPS = 2', "LAYER_PREFIX = ('dense',)",
               'ROUTED_SCALING_FACTOR = 2.5', 'ROTARY_MSCALE_ALL_DIM = 1.0', "MODEL_FAMILY = 'deepseek_v3'"),
              'HfDeepSeekV3', experts=True,
              refusals=(({'quantization_config': DEEPSEEK_V3_FP8}, ('quantization_config {"activation_scheme"',
                                                                     'dequantize the checkpoint first')),
                        ({'scoring_func': 'softmax', 'num_key_value_heads': 16},
                         ('scoring_func "softmax" (paxcli\'s DeepSeek-V3: "sigmoid")', 'num_key_value_heads 16')))),
)}


def build(config: dict, seed: int = 0):
  """transformers' model of config.json `config` (its own class for model_type), float32, random weights."""
  import torch
  import transformers
  torch.manual_seed(seed)
  settings = dict(config)
  model = transformers.AutoModelForCausalLM.from_config(
      transformers.AutoConfig.for_model(settings.pop('model_type'), **settings), dtype=torch.float32,
      attn_implementation='eager')
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith('norm.weight'):
        p.copy_(1 + 0.3 * torch.randn_like(p))
      else:
        p.copy_((0.3 if name.endswith('bias') else 0.2) * torch.randn_like(p))
    saved = model.state_dict()
    for name, b in model.named_buffers():   # saved buffers are weights too (DeepSeek's router bias)
      if name in saved and b.is_floating_point() and not name.endswith('inv_freq'):
        b.copy_(0.2 * torch.randn_like(b))
  return model.eval()


def save(model, directory: str) -> str:
  import transformers
  transformers.utils.logging.disable_progress_bar()   # its bars would land in a test's captured stderr
  model.save_pretrained(directory)
  return str(directory)


def with_config(made, directory, **changes) -> str:
  """A copy of a reference's save_pretrained directory whose config.json has `changes` (None removes a key)."""
  import json
  import os
  import shutil
  shutil.copytree(made.hf, directory)
  path = os.path.join(directory, 'config.json')
  with open(path) as f:
    config = json.load(f)
  config.update(changes)
  with open(path, 'w') as f:
    json.dump({k: v for k, v in config.items() if v is not None}, f)
  return str(directory)


def load(directory: str):
  import torch
  import transformers
  return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                           attn_implementation='eager').eval()


def parameter_count(config: dict) -> int:
  """transformers' count of a config.json's parameters (built on the meta device: no memory, no weights): its
  parameters() (tied weights once), and the buffers its checkpoints hold beside them (DeepSeek-V3's router bias,
  e_score_correction_bias: a weight paxcli keeps as a parameter no gradient reaches)."""
  import torch
  import transformers
  settings = dict(config)
  with torch.device('meta'):
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(settings.pop('model_type'), **settings))
  saved = set(model.state_dict())
  buffers = sum(b.numel() for name, b in model.named_buffers() if name in saved)
  return sum(p.numel() for p in model.parameters()) + buffers


def logits(model, ids) -> np.ndarray:
  import torch
  with torch.no_grad():
    return model(input_ids=torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()


def generate(model, prompt: list, steps: int) -> list:
  """transformers' greedy generate() of `steps` new tokens (no end-of-text stop)."""
  import torch
  out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=steps, min_new_tokens=steps,
                       eos_token_id=None, pad_token_id=0)
  return out[0, len(prompt):].tolist()


def log_likelihood(model, context: list, continuation: list) -> float:
  """sum log p(continuation | context) under `model` (float64 softmax of its float32 logits)."""
  x = logits(model, [context + continuation])[0].astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
  n = len(context)
  return float(sum(logp[n - 1 + j, t] for j, t in enumerate(continuation)))


def check_decoding(pax_main, capsys, exp: str, job: str, model, prompts: list, steps: int) -> None:
  """`pax decode --json` of `prompts` (lists of token ids) from job `job` picks, token by token, what transformers'
  greedy generate() of `model` picks (`steps` new tokens, no end-of-text stop)."""
  import json
  argv = ['decode', '--exp', exp, '--job-log-dir', job, '--max-decode-steps', str(steps), '--ignore-eos', '--json']
  for prompt in prompts:
    argv += ['--prompt-ids', ','.join(map(str, prompt))]
  code, out, err = pax_main(argv, capsys)
  assert code == 0, err
  rows = [json.loads(line) for line in out.splitlines() if line.startswith('{')]
  assert [r['prompt_ids'] for r in rows] == prompts
  for row, prompt in zip(rows, prompts):
    assert row['decoded_ids'] == generate(model, prompt, steps), prompt
