"""Qwen at released sizes: the architecture of each released model, knob for knob, so `pax describe`
counts exactly its parameters and a checkpoint converted from its Hugging Face directory restores
into it.

  pax describe --exp qwen.Qwen3_8B                         # 8,190,735,360 parameters, as released
  pax checkpoint convert --from hf Qwen3-8B/ runs/qwen3-8b --recipe qwen3_8b.py
  pax train --exp qwen.Qwen3_8B --set INIT_FROM=runs/qwen3-8b --set LORA_RANK=16 \
      --set TRAIN_DATA=chat.jsonl --set TOKENIZER=Qwen3-8B/tokenizer.json

Qwen25_05B: Qwen2.5-0.5B (24 x 896, 14 heads, 2 KV heads, FFN 4864, tied embeddings), 494,032,768.
Qwen25_7B:  Qwen2.5-7B (28 x 3584, 28 heads, 4 KV heads, FFN 18944, vocab 152064, untied), 7,615,616,512.
Qwen3_8B:   Qwen3-8B (36 x 4096, 32 heads x 128, 8 KV heads, FFN 12288, QK-norm, untied), 8,190,735,360.
Qwen3Moe30BA3B: Qwen3-30B-A3B (48 x 2048, 32 heads x 128, 4 KV heads, QK-norm, 128 experts of FFN 768 with
            8 per token, renormalised, untied), 30,532,122,624 (3.3B active per token).

Each takes its family's presets (paxcli.models.qwen2, qwen3: gated SiLU, RMSNorm 1e-6, rotary base
1e6, Qwen 2's q/k/v biases or Qwen 3's QK-norm; paxcli.models.qwen3_moe's experts). LoRA on the MoE
model adapts attention (the default LORA_TARGETS); its experts take no adapters. The sequence length
is a training choice, not the model's (rotary positions have no table): 4096 here; the released models
were trained to 32k (Qwen 2.5) and 40k (Qwen 3). Data: synthetic unless TRAIN_DATA is set; with text, TOKENIZER should be
the model's own tokenizer.json (its chat template comes with it).
"""

from paxcli.experiment import register
from paxcli.recipes._released import ReleasedLm
from paxcli.models.qwen2 import QWEN2
from paxcli.models.qwen3 import QWEN3
from paxcli.models.qwen3_moe import QWEN3_MOE


class _Qwen(ReleasedLm):
  """What the Qwen recipes share besides the family presets."""

  NORM_EPSILON = 1e-6
  MAX_SEQ_LEN = 4096


@register
@QWEN2.preset   # biases on q/k/v only, rotary base 1e6 (paxcli.models.qwen2)
class Qwen25_05B(_Qwen):
  """Qwen2.5-0.5B: 24 x 896, 14 heads x 64, 2 KV heads, FFN 4864, vocab 151936, tied embeddings."""

  NUM_LAYERS = 24
  MODEL_DIMS = 896
  HIDDEN_DIMS = 4864
  NUM_HEADS = 14
  NUM_KV_HEADS = 2
  DIMS_PER_HEAD = 64
  VOCAB_SIZE = 151936
  SEPARATE_EMBEDDING = False


@register
@QWEN2.preset
class Qwen25_7B(_Qwen):
  """Qwen2.5-7B: 28 x 3584, 28 heads x 128, 4 KV heads, FFN 18944, vocab 152064, untied output layer."""

  NUM_LAYERS = 28
  MODEL_DIMS = 3584
  HIDDEN_DIMS = 18944
  NUM_HEADS = 28
  NUM_KV_HEADS = 4
  DIMS_PER_HEAD = 128
  VOCAB_SIZE = 152064
  SEPARATE_EMBEDDING = True


@register
@QWEN3.preset   # RMSNorm on each head's query and key, no biases, rotary base 1e6 (paxcli.models.qwen3)
class Qwen3_8B(_Qwen):
  """Qwen3-8B: 36 x 4096, 32 heads x 128, 8 KV heads, FFN 12288, vocab 151936, untied output layer."""

  NUM_LAYERS = 36
  MODEL_DIMS = 4096
  HIDDEN_DIMS = 12288
  NUM_HEADS = 32
  NUM_KV_HEADS = 8
  DIMS_PER_HEAD = 128
  VOCAB_SIZE = 151936
  SEPARATE_EMBEDDING = True


@register
@QWEN3_MOE.preset   # Qwen 3's layer, 128 experts top-8, softmax before top-k, renormalised (paxcli.models.qwen3_moe)
class Qwen3Moe30BA3B(_Qwen):
  """Qwen3-30B-A3B: 48 x 2048, 32 heads x 128, 4 KV heads, 128 experts of FFN 768 (8 per token), vocab 151936."""

  NUM_LAYERS = 48
  MODEL_DIMS = 2048
  HIDDEN_DIMS = 768
  NUM_HEADS = 32
  NUM_KV_HEADS = 4
  DIMS_PER_HEAD = 128
  VOCAB_SIZE = 151936
  SEPARATE_EMBEDDING = True
  MOE_DISPATCH = 'dropless'
