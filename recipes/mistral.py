"""Mistral at its released size: the architecture of Mistral-7B-v0.1, knob for knob, so `pax describe`
counts exactly its parameters and a checkpoint converted from its Hugging Face directory restores
into it.

  pax describe --exp mistral.Mistral7B                       # 7,241,732,096 parameters, as released
  pax checkpoint convert --from hf Mistral-7B-v0.1/ runs/mistral-7b --recipe mistral_7b.py
  pax train --exp mistral.Mistral7B --set INIT_FROM=runs/mistral-7b --set LORA_RANK=16 \
      --set TRAIN_DATA=chat.jsonl --set TOKENIZER=Mistral-7B-v0.1/tokenizer.json

Mistral7B: 32 x 4096, 32 heads x 128, 8 KV heads, FFN 14336, vocab 32000, untied output layer,
rotary base 10000, RMSNorm 1e-5, and a sliding window of 4096 tokens in every layer (the family's
preset, paxcli.models.mistral). With the window, a training step's attention costs O(L x 4096)
rather than O(L^2) and decoding keeps a rolling KV cache of 4096 tokens however long the text
(docs/guides/attention.md). The sequence length is a training choice (rotary positions have no
table): 8192 here, two windows. Data: synthetic unless TRAIN_DATA is set.
"""

from paxcli.experiment import register
from paxcli.recipes._released import ReleasedLm
from paxcli.models.mistral import MISTRAL


@register
@MISTRAL.preset   # Llama's layer with SLIDING_WINDOW = 4096 (paxcli.models.mistral)
class Mistral7B(ReleasedLm):
  """Mistral-7B-v0.1: 32 x 4096, 32 heads x 128, 8 KV heads, FFN 14336, vocab 32000, window 4096."""

  NUM_LAYERS = 32
  MODEL_DIMS = 4096
  HIDDEN_DIMS = 14336
  NUM_HEADS = 32
  NUM_KV_HEADS = 8
  DIMS_PER_HEAD = 128
  VOCAB_SIZE = 32000
  SEPARATE_EMBEDDING = True
  NORM_EPSILON = 1e-5
  ROTARY_MAX_TIMESCALE = 10000.0
  MAX_SEQ_LEN = 8192
