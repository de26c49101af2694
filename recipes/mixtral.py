"""Mixtral at its released size: the architecture of Mixtral-8x7B-v0.1, knob for knob, so `pax describe`
counts exactly its parameters and a checkpoint converted from its Hugging Face directory restores
into it.

  pax describe --exp mixtral.Mixtral8x7B                   # 46,702,792,704 parameters, as released
  pax checkpoint convert --from hf Mixtral-8x7B-v0.1/ runs/mixtral --recipe mixtral_8x7b.py
  pax train --exp mixtral.Mixtral8x7B --set INIT_FROM=runs/mixtral --set LORA_RANK=16 \
      --set TRAIN_DATA=chat.jsonl --set TOKENIZER=Mixtral-8x7B-v0.1/tokenizer.json

Mixtral8x7B: 32 x 4096, 32 heads x 128, 8 KV heads, 8 experts of FFN 14336 with 2 per token (softmax
over the chosen two), vocab 32000, untied output layer, rotary base 1e6, RMSNorm 1e-5, full attention
(the family's presets, paxcli.models.mixtral). LoRA adapts attention (the default LORA_TARGETS); the
experts take no adapters. Dropless dispatch, the function the checkpoint computes. The sequence length
is a training choice (rotary positions have no table): 4096 here. Data: synthetic unless TRAIN_DATA is set.
bench.Mixtral8x7B is the same shape with a plan for 64 devices (docs/guides/moe.md).
"""

from paxcli.experiment import register
from paxcli.recipes._released import ReleasedLm
from paxcli.models.mixtral import MIXTRAL


@register
@MIXTRAL.preset   # Llama's attention, 8 experts top-2 with the softmax after top-k (paxcli.models.mixtral)
class Mixtral8x7B(ReleasedLm):
  """Mixtral-8x7B-v0.1: 32 x 4096, 32 heads x 128, 8 KV heads, 8 experts of FFN 14336 (2 per token), vocab 32000."""

  NUM_LAYERS = 32
  MODEL_DIMS = 4096
  HIDDEN_DIMS = 14336
  NUM_HEADS = 32
  NUM_KV_HEADS = 8
  DIMS_PER_HEAD = 128
  VOCAB_SIZE = 32000
  SEPARATE_EMBEDDING = True
  NORM_EPSILON = 1e-5
  SLIDING_WINDOW = 0
  MOE_DISPATCH = 'dropless'
  MAX_SEQ_LEN = 4096
  ICI_MESH_SHAPE = None   # all devices data-parallel; set an expert axis for your hosts (docs/guides/moe.md)
