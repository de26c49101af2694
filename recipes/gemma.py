"""Gemma at released sizes: the architecture of each released model, knob for knob, so `pax describe`
counts exactly its parameters and a checkpoint converted from its Hugging Face directory restores
into it.

  pax describe --exp gemma.Gemma3_4B                       # 3,880,263,168 parameters, as released
  pax checkpoint convert --from hf gemma-2-9b/ runs/gemma2-9b --recipe gemma2_9b.py
  pax train --exp gemma.Gemma2_9B --set INIT_FROM=runs/gemma2-9b --set LORA_RANK=16 \
      --set TRAIN_DATA=chat.jsonl --set TOKENIZER=gemma-2-9b/tokenizer.json

Gemma2_9B: gemma-2-9b (42 x 3584, 16 heads x 256, 8 KV heads, FFN 14336, vocab 256000; local window
           4096 alternating with global layers; soft caps 50 and 30), 9,241,705,984.
Gemma3_4B: the text model of gemma-3-4b-pt (34 x 2560, 8 heads x 256, 4 KV heads, FFN 10240, vocab
           262208; five local layers of window 1024 and rope base 10k to one global of base 1M with
           linear scaling 8; QK-norm), 3,880,263,168 (the released 4B adds a 417M vision tower).

Each takes its family's presets (paxcli.models.gemma, gemma3). 34 layers are not whole groups of six,
so Gemma 3 4B's LAYER_PATTERN lists all 34 layers (one group; the stack is scanned as one step), as
`--from hf` writes it. The sequence length is a training choice, not the model's: 4096 here.
"""

from paxcli.experiment import register
from paxcli.recipes._released import ReleasedLm
from paxcli.models.gemma import GEMMA2
from paxcli.models.gemma3 import GEMMA3


class _Gemma(ReleasedLm):
  """What the Gemma recipes share besides the family presets."""

  NORM_EPSILON = 1e-6
  QUERY_PRE_ATTN_SCALAR = 256.0
  DIMS_PER_HEAD = 256
  MAX_SEQ_LEN = 4096


@register
@GEMMA2.preset   # (1 + w) RMSNorm x 4, tanh GELU, sqrt(d) embeddings, caps 50/30, local 4096 / global
class Gemma2_9B(_Gemma):
  """gemma-2-9b: 42 x 3584, 16 heads x 256, 8 KV heads, FFN 14336, vocab 256000."""

  NUM_LAYERS = 42
  MODEL_DIMS = 3584
  HIDDEN_DIMS = 14336
  NUM_HEADS = 16
  NUM_KV_HEADS = 8
  VOCAB_SIZE = 256000


@register
@GEMMA3.preset   # Gemma 2's layer with (1 + w) QK-norm, no caps, rope per kind
class Gemma3_4B(_Gemma):
  """gemma-3-4b-pt's text model: 34 x 2560, 8 heads x 256, 4 KV heads, FFN 10240, vocab 262208."""

  NUM_LAYERS = 34
  MODEL_DIMS = 2560
  HIDDEN_DIMS = 10240
  NUM_HEADS = 8
  NUM_KV_HEADS = 4
  VOCAB_SIZE = 262208
  LAYER_PATTERN = (('local',) * 5 + ('global',)) * 5 + ('local',) * 4
