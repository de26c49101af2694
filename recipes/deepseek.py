"""DeepSeek-V3 at its released size: the architecture of DeepSeek-V3 (and R1, V3.1: the same shape), knob for
knob, so `pax describe` counts exactly the parameters transformers' DeepseekV3ForCausalLM has and a checkpoint
converted from its Hugging Face directory (dequantized to bfloat16) restores into it.

  pax describe --exp deepseek.DeepSeekV3                   # 671,026,419,200 parameters, 37.6B active
  pax bench mfu --exp deepseek.DeepSeekV3 --compile-only --topology v5p-1024  # the plan below, XLA:TPU

DeepSeekV3: 61 x 7168, 128 heads of multi-head latent attention (q latent 1536, kv latent 512, per head 128
without and 64 with rotary positions, values 128), YaRN x40 from 4096 positions; the first 3 layers dense (FFN
18432), the other 58 DeepSeekMoE: 256 routed experts of FFN 2048, 8 per token chosen among the 4 best of 8
groups by a sigmoid score plus the load-balancing bias, times 2.5, and one shared expert of 2048; vocab 129280,
untied (the family's presets, paxcli.models.deepseek). The multi-token-prediction layer of the release
(num_nextn_predict_layers) is not part of the model, as in transformers.

The mesh is a plan for a v5p-1024 slice (512 chips of 95 GiB), sharded as MaxText shards DeepSeek-V3: experts
over `expert` 8 (32 experts a chip), every weight's model dimension and the latents over `data` 32 (FSDP),
heads and FFN over `mdl` 2 (tensor parallel); the batch over data x expert, one sequence of 4096 a pair of
`mdl` chips (PERCORE_BATCH_SIZE 0.5: 256 sequences, 1M tokens a step). XLA:TPU plans 88.4 GiB a chip
(17.6 state, 70.7 temporaries); on a v5p-512 the same per-chip batch needs 111.9 (docs/guides/model-families.md).
Another slice: set ICI_MESH_SHAPE for it. Sequence 4096 (the length YaRN scales from).
"""

from paxcli.experiment import register
from paxcli.recipes._released import ReleasedLm
from paxcli.models.deepseek import DEEPSEEK_V3


@register
@DEEPSEEK_V3.preset   # latent attention, YaRN, the sigmoid router with its bias, dropless (paxcli.models.deepseek)
class DeepSeekV3(ReleasedLm):
  """DeepSeek-V3: 61 x 7168, 128 latent-attention heads, 3 dense layers then 58 of 256 experts (8 per token) and
  a shared one, vocab 129280; 671B parameters, 37B active."""

  NUM_LAYERS = 61
  MODEL_DIMS = 7168
  HIDDEN_DIMS = 2048              # each routed expert's FFN (moe_intermediate_size)
  SHARED_EXPERT_HIDDEN_DIMS = 2048
  LAYER_PREFIX = ('dense',) * 3   # first_k_dense_replace
  LAYER_KINDS = {'dense': {'NUM_EXPERTS': 0, 'HIDDEN_DIMS': 18432}}
  NUM_HEADS = 128
  VOCAB_SIZE = 129280
  SEPARATE_EMBEDDING = True
  NORM_EPSILON = 1e-6
  ROTARY_MAX_TIMESCALE = 10000.0
  ROTARY_SCALING = 'yarn'
  ROTARY_SCALING_FACTOR = 40.0
  ROTARY_ORIGINAL_MAX_LEN = 4096
  ROTARY_BETA_FAST = 32.0
  ROTARY_BETA_SLOW = 1.0
  ROTARY_MSCALE = 1.0
  ROTARY_MSCALE_ALL_DIM = 1.0
  MAX_SEQ_LEN = 4096
  PERCORE_BATCH_SIZE = 0.5            # one sequence a data x expert shard (the mdl pair shares it)
  ICI_MESH_SHAPE = [1, 1, 32, 8, 2]   # [stage, replica, data, expert, mdl]: 512 devices, a v5p-1024
