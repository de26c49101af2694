"""Benchmark recipes: a llama-style 1B LM on synthetic data, and its CPU-sized sibling.

  pax bench mfu --exp bench.Llama1B                                  # one GPU: MFU, tokens/s, memory
  pax bench mfu --exp bench.Llama1B --sweep PERCORE_BATCH_SIZE=8,16 --plot mfu.png
  pax bench mfu --exp bench.LlamaTiny                                # the same code path on a CPU
  pax train --exp bench.Llama1B --set NUM_TRAIN_STEPS=50             # MFU in every summary line

Llama1B: 16 layers, MODEL_DIMS 2048, gated SiLU FFN 5632, 16 heads x 128, vocab 32768,
sequence 2048, global batch 8 on one device (PERCORE_BATCH_SIZE 8), bfloat16 activations
with float32 weights, RMSNorm, rotary positions, no biases, untied output layer, AdamW,
unrolled layers without rematerialisation. 0.96B parameters; 5.74 GFLOP per token by the
model's own count (LanguageModel.train_flops: 6 x 0.89e9 matmul weights + causal attention;
6.14 by PaLM's count), so 289 ms per step of 8 x 2048 tokens is 33% MFU on one H100 (989 TFLOP/s bf16). The target is
55% MFU at its best batch size (cuDNN flash attention, batch 8 or 16).

LlamaTiny keeps every structural choice (gated SiLU, RMSNorm, rotary, untied output,
bf16) at a size a laptop CPU runs in seconds per step.
"""

from paxcli.experiment import register
from paxcli.models import LmExperiment
from paxcli.models.llama import LLAMA


@LLAMA.preset   # gated SiLU, RMSNorm, rotary positions, no biases (paxcli.models.llama)
class _LlamaStyle(LmExperiment):
  """The structure the benchmark recipes share."""

  SEPARATE_EMBEDDING = True
  FPROP_DTYPE = 'bfloat16'
  USE_REPEATED_LAYER = False
  CHECKPOINT_POLICY = 'none'
  ATTENTION_IMPL = 'auto'
  OPTIMIZER = 'adamw'
  LEARNING_RATE = 3e-4
  WEIGHT_DECAY = 0.1
  LR_SCHEDULE = 'linear_rampup_cosine_decay'
  LR_WARMUP_STEPS = 100
  LR_DECAY_START = 100
  LR_DECAY_END = 10_000
  NUM_TRAIN_STEPS = 10_000
  SAVE_INTERVAL_STEPS = 1000
  SUMMARY_INTERVAL_STEPS = 50


@register
class Llama1B(_LlamaStyle):
  """Llama-style 0.96B LM for one GPU: 16 x 2048, FFN 5632, 16x128 heads, vocab 32768, seq 2048, batch 8."""

  NUM_LAYERS = 16
  MODEL_DIMS = 2048
  HIDDEN_DIMS = 5632
  NUM_HEADS = 16
  DIMS_PER_HEAD = 128
  VOCAB_SIZE = 32768
  MAX_SEQ_LEN = 2048
  PERCORE_BATCH_SIZE = 8


@register
class LlamaTiny(_LlamaStyle):
  """Llama1B's structure at CPU size: 2 x 64, FFN 176, 4x16 heads, vocab 256, seq 64, batch 8."""

  NUM_LAYERS = 2
  MODEL_DIMS = 64
  HIDDEN_DIMS = 176
  NUM_HEADS = 4
  DIMS_PER_HEAD = 16
  VOCAB_SIZE = 256
  MAX_SEQ_LEN = 64
  PERCORE_BATCH_SIZE = 8
  NUM_TRAIN_STEPS = 100
  SAVE_INTERVAL_STEPS = 100
  SUMMARY_INTERVAL_STEPS = 10
  LR_WARMUP_STEPS = 10
  LR_DECAY_START = 10
  LR_DECAY_END = 100


# ---- mixture-of-experts shapes at their real sizes, for planning (paxcli.layers.moe) ----------------
# Synthetic data; `pax bench mfu --exp bench.Mixtral8x7B --compile-only --num-devices 64 --device-memory 80GiB`
# plans the run on a CPU (docs/guides/moe.md). Scanned layers with full rematerialisation: the compiled
# program stays small, and activations are one layer's. The experts are sharded over the `expert` mesh
# axis and their model dimension over `data` (FSDP); every other weight over `data`.

class _MoeShape(_LlamaStyle):
  """What the MoE planning shapes share: bf16 activations, scanned and rematerialised layers."""

  USE_REPEATED_LAYER = True
  CHECKPOINT_POLICY = 'save_nothing'
  ROTARY_MAX_TIMESCALE = 1_000_000.0
  MAX_SEQ_LEN = 4096
  PERCORE_BATCH_SIZE = 1
  MOE_DISPATCH = 'dropless'
  LOAD_BALANCE_LOSS_WEIGHT = 0.01


@register
class Mixtral8x7B(_MoeShape):
  """Mixtral 8x7B's shape: 32 x 4096, 8 experts of FFN 14336, top-2 (softmax after top-k), GQA 32/8
  heads, vocab 32000; 46.7B parameters, 12.9B active; on 64 devices as data 8 x expert 8."""

  NUM_LAYERS = 32
  MODEL_DIMS = 4096
  HIDDEN_DIMS = 14336
  NUM_HEADS = 32
  NUM_KV_HEADS = 8
  DIMS_PER_HEAD = 128
  VOCAB_SIZE = 32000
  NUM_EXPERTS = 8
  EXPERTS_PER_TOKEN = 2
  ROUTER_SOFTMAX = 'after_topk'
  ICI_MESH_SHAPE = [1, 1, 8, 8, 1]


@register
class Qwen3Moe30BA3B(_MoeShape):
  """Qwen3-30B-A3B's shape: 48 x 2048, 128 experts of FFN 768, top-8 (softmax before top-k, the 8 renormalised),
  GQA 32/4 heads of 128 with QK-norm, vocab 151936; 30.5B parameters, 3.3B active; on 16 devices as data 4 x
  expert 4, capacity-factor dispatch."""

  NUM_LAYERS = 48
  MODEL_DIMS = 2048
  HIDDEN_DIMS = 768
  NUM_HEADS = 32
  NUM_KV_HEADS = 4
  DIMS_PER_HEAD = 128
  VOCAB_SIZE = 151936
  NUM_EXPERTS = 128
  EXPERTS_PER_TOKEN = 8
  ROUTER_SOFTMAX = 'before_topk'
  ROUTER_NORMALIZE_TOPK = True
  USE_QK_NORM = True
  # Capacity dispatch: XLA:CPU computes ragged_dot as a dense product per group, so dropless with 32 experts
  # per device plans about 130 GiB of temporaries on CPU (docs/guides/moe.md); capacity plans 46.5 GiB.
  MOE_DISPATCH = 'capacity'
  EXPERT_CAPACITY_FACTOR = 1.25
  ICI_MESH_SHAPE = [1, 1, 4, 4, 1]


# ---- long context at its real size, for planning (paxcli.layers.context_parallel) -------------------
# `pax bench mfu --exp bench.Llama3_8B_128k --compile-only --topology v5p-16` plans one 128k-token sequence a
# step on 8 chips (docs/guides/long-context.md).

@register
class Llama3_8B_128k(_LlamaStyle):
  """Llama 3.1 8B's shape at 131,072 tokens: 32 x 4096, FFN 14336, GQA 32/8 heads of 128, vocab 128256, Llama 3's
  rope scaling (x8 from 8192); 8.03B parameters. One sequence a step on 8 devices, split over a context axis of 8
  (ring, load-balanced), weights FSDP over it; scanned layers, full rematerialisation, the flash kernel."""

  NUM_LAYERS = 32
  MODEL_DIMS = 4096
  HIDDEN_DIMS = 14336
  NUM_HEADS = 32
  NUM_KV_HEADS = 8
  DIMS_PER_HEAD = 128
  VOCAB_SIZE = 128256
  MAX_SEQ_LEN = 131072
  ROTARY_MAX_TIMESCALE = 500_000.0
  ROTARY_SCALING = 'llama3'
  ROTARY_SCALING_FACTOR = 8.0
  ROTARY_LOW_FREQ_FACTOR = 1.0
  ROTARY_HIGH_FREQ_FACTOR = 4.0
  ROTARY_ORIGINAL_MAX_LEN = 8192
  USE_REPEATED_LAYER = True
  CHECKPOINT_POLICY = 'save_nothing'
  ATTENTION_IMPL = 'flash'
  PERCORE_BATCH_SIZE = 0.125
  ICI_MESH_SHAPE = [1, 1, 1, 1, 8, 1]
  CONTEXT_PARALLEL_STRATEGY = 'ring'
