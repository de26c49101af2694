"""LmExperiment: the base for decoder-only Transformer language-model experiments."""

from __future__ import annotations

from typing import Optional, Union

import fiddle as fdl

from paxcli.errors import UserError
from paxcli.experiment import (ActivationName, AttentionImplName, CheckpointPolicyName, DTypeName, Experiment, NormName,
                               OptimizerName, PositionName, ScheduleName)


class LmExperiment(Experiment):
  """A decoder-only Transformer LM; knobs as in Pax's LmCloud and MaxText models.

  Subclasses set knobs and, where they need more, override `task()` (call super and
  edit the config, e.g. `task.train.num_train_steps = 300`) or `datasets()`.
  """

  NUM_LAYERS: int = 2
  MODEL_DIMS: int = 64
  HIDDEN_DIMS: int = 256
  NUM_HEADS: int = 4
  NUM_KV_HEADS: Optional[int] = None      # None: same as NUM_HEADS; fewer: grouped-query attention
  DIMS_PER_HEAD: Optional[int] = None     # None: MODEL_DIMS // NUM_HEADS
  VOCAB_SIZE: int = 256
  MAX_SEQ_LEN: int = 64
  ACTIVATION: ActivationName = 'gelu'
  USE_GATED_ACTIVATION: bool = False
  NORM_TYPE: NormName = 'layernorm'
  USE_BIAS: bool = True
  POSITION_EMBEDDING: PositionName = 'learned'
  ROTARY_MAX_TIMESCALE: float = 10000.0
  SEPARATE_EMBEDDING: bool = False        # False: output logits use the token embedding (tied)
  DROPOUT_PROB: float = 0.0
  FPROP_DTYPE: DTypeName = 'float32'      # activations; weights stay float32
  USE_REPEATED_LAYER: bool = False        # nn.scan over layers
  CHECKPOINT_POLICY: CheckpointPolicyName = 'save_nothing'
  # Options of Pax's lm_cloud/c4 models (what `pax checkpoint convert --from paxml` needs); all off
  # by default. POSITION_EMBEDDING 'sinusoidal' is Pax's fixed PositionalEmbedding.
  SCALE_EMBEDDING_SQRT_DEPTH: bool = False  # token embeddings x sqrt(MODEL_DIMS) (Pax scale_sqrt_depth)
  USE_SOFTMAX_BIAS: bool = False          # a bias on the output logits (Pax's softmax has one)
  SOFTMAX_CAP_LOGITS: float = 0.0         # > 0: logits = cap * tanh(logits / cap); 0: off
  ATTEN_LOGIT_CAP: float = 0.0            # the same for attention logits, before the mask
  USE_PER_DIM_SCALE: bool = False         # learned per-dimension query scale (Pax's PerDimScale)
  USE_ATTENTION_BIAS: Optional[bool] = None  # None: USE_BIAS; Pax's USE_BIAS is this one
  NORM_EPSILON: float = 1e-6
  # auto: jax.nn.dot_product_attention (cuDNN flash attention on GPUs in bf16/fp16, XLA
  # elsewhere); einsum: the plain reference with explicit float32 logits.
  ATTENTION_IMPL: AttentionImplName = 'auto'
  # Pipeline parallelism (Pax's LayerwiseShardablePipelined; paxcli.layers.pipeline): NUM_STAGES > 1
  # needs USE_REPEATED_LAYER and a four-entry ICI_MESH_SHAPE [stage, replica, data, mdl] whose stage
  # entry (times DCN's) equals it. Checkpoints are the same whatever the stage count.
  NUM_STAGES: int = 1
  NUM_MICROBATCHES: Optional[int] = None  # None: from MICROBATCH_SIZE, else NUM_STAGES
  MICROBATCH_SIZE: Optional[int] = None   # rows of the global batch per microbatch
  PIPELINE_CIRCULAR_REPEAT: int = 1       # R > 1: each stage holds R groups of layers, visited in turn

  OPTIMIZER: OptimizerName = 'adamw'
  LEARNING_RATE: float = 1e-3
  ADAM_BETA1: float = 0.9
  ADAM_BETA2: float = 0.99
  ADAM_EPSILON: float = 1e-8
  WEIGHT_DECAY: float = 0.0
  CLIP_GRADIENT_NORM_TO_VALUE: float = 1.0
  LR_SCHEDULE: ScheduleName = 'constant'
  LR_WARMUP_STEPS: int = 0
  LR_DECAY_START: int = 0
  LR_DECAY_END: int = 0
  LR_MIN_RATIO: float = 0.1

  NUM_TRAIN_STEPS: int = 100
  SAVE_INTERVAL_STEPS: int = 100
  SUMMARY_INTERVAL_STEPS: int = 10
  EVAL_INTERVAL_STEPS: int = 0  # 0: no eval during training
  DECODE_INTERVAL_STEPS: int = 0  # 0: no decoding during training; else greedy on DECODE_PROMPTS
  DECODE_PROMPTS: list = []       # texts, or lists of token ids for models without a tokenizer
  DECODE_MAX_STEPS: int = 32

  # Your own data (README "Your own data", paxcli.inputs.file_input): a glob, or {glob: weight} for a
  # mixture, of .txt, .jsonl, .parquet, TFRecord or ArrayRecord files; replaces the experiment's inputs.
  TRAIN_DATA: Optional[Union[str, dict[str, float]]] = None
  EVAL_DATA: Optional[Union[str, dict[str, float]]] = None  # None: 1 in 20 TRAIN_DATA documents (by text hash)
  TEXT_FIELD: str = 'text'        # the JSONL / Parquet / tf.train.Example field that holds the text
  TOKENIZER: Optional[str] = None  # a sentencepiece .model or a tokenizer.json; None: trained on TRAIN_DATA

  def model(self) -> fdl.Config:
    """LanguageModel built from templates the knobs fill; edit a template to swap a layer:

      task.model.lm_tpl.block_tpl.ffn_tpl = fdl.Config(MyFeedForward, ...)
      task.model.lm_tpl.block_tpl.attention_tpl.use_bias = False
      task.model.lm_tpl.block_tpl.norm_tpl = fdl.Config(MyNorm)
    """
    from paxcli.models import lm_config  # flax: imported only when configs are built
    return lm_config(
        vocab_size=self.VOCAB_SIZE,
        num_layers=self.NUM_LAYERS,
        model_dims=self.MODEL_DIMS,
        hidden_dims=self.HIDDEN_DIMS,
        num_heads=self.NUM_HEADS,
        num_kv_heads=self.NUM_KV_HEADS or self.NUM_HEADS,
        dims_per_head=self.DIMS_PER_HEAD or self.MODEL_DIMS // self.NUM_HEADS,
        max_seq_len=self.MAX_SEQ_LEN,
        activation=self.ACTIVATION,
        use_gated_activation=self.USE_GATED_ACTIVATION,
        norm_type=self.NORM_TYPE,
        use_bias=self.USE_BIAS,
        position_embedding=self.POSITION_EMBEDDING,
        rotary_max_timescale=self.ROTARY_MAX_TIMESCALE,
        separate_embedding=self.SEPARATE_EMBEDDING,
        dropout_prob=self.DROPOUT_PROB,
        fprop_dtype=self.FPROP_DTYPE,
        scan_layers=self.USE_REPEATED_LAYER,
        checkpoint_policy=self.CHECKPOINT_POLICY,
        scale_embedding_sqrt_depth=self.SCALE_EMBEDDING_SQRT_DEPTH,
        softmax_bias=self.USE_SOFTMAX_BIAS,
        softmax_cap_logits=self.SOFTMAX_CAP_LOGITS,
        atten_logit_cap=self.ATTEN_LOGIT_CAP,
        per_dim_scale=self.USE_PER_DIM_SCALE,
        attention_use_bias=self.USE_ATTENTION_BIAS,
        norm_epsilon=self.NORM_EPSILON,
        attention_impl=self.ATTENTION_IMPL,
        num_stages=self.NUM_STAGES,
        num_microbatches=self.NUM_MICROBATCHES,
        microbatch_size=self.MICROBATCH_SIZE,
        pipeline_repeats=self.PIPELINE_CIRCULAR_REPEAT,
    )

  def task(self) -> fdl.Config:
    from paxcli.tasks import OptimizerConfig, ScheduleConfig, Task, TrainConfig
    train = fdl.Config(
        TrainConfig,
        num_train_steps=self.NUM_TRAIN_STEPS,
        save_interval_steps=self.SAVE_INTERVAL_STEPS,
        summary_interval_steps=self.SUMMARY_INTERVAL_STEPS,
        eval_interval_steps=self.EVAL_INTERVAL_STEPS,
        decode_interval_steps=self.DECODE_INTERVAL_STEPS,
        decode_prompts=list(self.DECODE_PROMPTS),
        decode_max_steps=self.DECODE_MAX_STEPS,
        learning_rate=self.LEARNING_RATE,
        clip_gradient_norm_to_value=self.CLIP_GRADIENT_NORM_TO_VALUE,
        optimizer=fdl.Config(OptimizerConfig, name=self.OPTIMIZER, beta1=self.ADAM_BETA1,
                             beta2=self.ADAM_BETA2, epsilon=self.ADAM_EPSILON,
                             weight_decay=self.WEIGHT_DECAY),
        lr_schedule=fdl.Config(ScheduleConfig, kind=self.LR_SCHEDULE, warmup_steps=self.LR_WARMUP_STEPS,
                               decay_start=self.LR_DECAY_START, decay_end=self.LR_DECAY_END,
                               min_ratio=self.LR_MIN_RATIO),
    )
    return fdl.Config(Task, model=self.model(), train=train)

  def datasets(self) -> list:
    """The user's files when TRAIN_DATA is set, else synthetic LM data; override for real inputs
    (see recipes/default.py, which keeps TRAIN_DATA working by calling own_data_datasets first)."""
    from paxcli.inputs.synthetic import SyntheticLmInput
    return self.own_data_datasets() or [
        fdl.Config(SyntheticLmInput, name='train', is_training=True, seq_len=self.MAX_SEQ_LEN,
                   vocab_size=self.VOCAB_SIZE, seed=self.RANDOM_SEED),
        fdl.Config(SyntheticLmInput, name='eval', is_training=False, seq_len=self.MAX_SEQ_LEN,
                   vocab_size=self.VOCAB_SIZE, seed=self.RANDOM_SEED + 1, num_batches=2, repeat=False,
                   reset_for_eval=True),
    ]

  def own_data_datasets(self) -> list:
    """Inputs over TRAIN_DATA and EVAL_DATA (paxcli.inputs.file_input), or [] when neither is set."""
    if not (self.TRAIN_DATA or self.EVAL_DATA or self.TOKENIZER):
      return []
    if not self.TRAIN_DATA:
      raise UserError('EVAL_DATA and TOKENIZER need TRAIN_DATA (a glob of your training files).')
    from paxcli.inputs.file_input import FileLmInput
    common = dict(seq_len=self.MAX_SEQ_LEN, text_field=self.TEXT_FIELD, tokenizer=self.TOKENIZER,
                  tokenizer_data=self.TRAIN_DATA, vocab_size=self.VOCAB_SIZE, seed=self.RANDOM_SEED)
    return [
        fdl.Config(FileLmInput, name='train', is_training=True, data=self.TRAIN_DATA,
                   split='all' if self.EVAL_DATA else 'train', **common),
        fdl.Config(FileLmInput, name='eval', is_training=False, repeat=False, reset_for_eval=True,
                   data=self.EVAL_DATA or self.TRAIN_DATA, split='all' if self.EVAL_DATA else 'eval', **common),
    ]
