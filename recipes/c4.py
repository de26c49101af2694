"""Pax's C4 runs (paxml/tasks/lm/params/c4.py and c4_multislice.py), ported value by value.

  pax describe --exp c4.C4Spmd1BAdam4Replicas           # 1.10B parameters, as Pax's
  pax bench mfu --exp c4.C4Spmd16BAdam32Replicas --compile-only --topology v4-64   # XLA:TPU's memory, no TPU
  pax train --exp c4.C4Spmd1BAdam4Replicas --set C4_DATA_DIR=gs://my-bucket/tfds \\
      --set C4_VOCABULARY=/data/t5/sentencepiece.model --job-log-dir gs://...   # on a TPU v4-8

The four runs Pax's README headlines, each with the parents it derives from:

| class | Pax's machine | parameters | mesh (ICI x DCN) | global batch |
| --- | --- | --- | --- | --- |
| C4Spmd1BAdam4Replicas | v4-8 (4 chips) | 1.10B | [1,4,1] | 128 x 1024 |
| C4Spmd16BAdam32Replicas | v4-64 (32) | 16.5B | [1,16,2] | 512 x 1024 |
| C4SpmdPipelineGpt3SmallAdam64Replicas | v4-128 (64) | 2.92B | [4,1,4,4] | 64 x 2048 |
| C4Spmd22BAdam2xv4_128 | 2 x v4-128 (128) | 21.9B | [1,64,1] x [2,1,1] | 2048 x 1024 |

plus C4SpmdPipelineGpt3SmallAdam8Replicas, the 64-replica class's successor in paxml's HEAD.

Input (paxcli.inputs.c4): seqio over TFDS `c4/en:3.0.1`, tokenized with T5's sentencepiece
vocabulary (the GPT-3 classes: Pax's GPT vocabulary), documents concatenated and cut to
MAX_SEQ_LEN with EOS, packed for training; eval on the `validation` split. C4_DATA_DIR (a TFDS
data directory, local or gs://) and C4_VOCABULARY (a sentencepiece model, local or gs://) say
where they are; without them `pax train` stops at once with one line saying what to get.

Differences every class shares, with the reasons:
- Initializers are paxcli's (fan-in truncated normal, embeddings N(0, 1/MODEL_DIMS)); Pax's are
  Xavier (GPT-3 classes: N(0, 0.006^2)). paxcli's layers fix their initializers; no knob sets them.
- The learning-rate ramp is one step ahead: paxcli's multiplier at step s is (s + 1) / warmup,
  Pax's s / warmup (Pax's first step trains at learning rate 0).
- Pax also evaluates on the training input (its eval_skip_train default); paxcli evaluates the
  eval input only.
- Pax's input is a seqio task registered at import time reading gs://; here it is built when the
  run starts from the knobs above (so `pax describe` and `pax bench` need no data). Pax's HEAD
  moved its C4 task to MLPerf's private c4/en:3.0.4 and 3.0.5 builds with its GPT vocabulary;
  this port keeps c4/en:3.0.1, public through TFDS, as Pax's task read it when these runs were
  published (train split `train`, eval `validation`, concatenation batch 128, EOS appended).
"""

from typing import Optional

import fiddle as fdl

from paxcli.experiment import register
from paxcli.models import LmExperiment
from paxcli.inputs.c4 import GPT_VOCABULARY, T5_VOCABULARY, TFDS_NAME, C4Input


@register
class C4SpmdAdam(LmExperiment):
  """Pax's C4SpmdAdam, the base of the C4 runs: a 24 x 2048 decoder on [1, 4, 2].

  Ported with its parents TransformerLmSpmdAdam, TransformerLmSpmdAdafactor and
  C4UnsupervisedDataset. The model is Pax's StackedTransformer LM: pre-LayerNorm blocks (scale
  and bias, epsilon 1e-6), attention without biases but with Pax's per-dimension query scale and
  logits capped at 50,
  a GELU (tanh) feed-forward with biases, fixed sinusoidal positions, token embeddings tied to
  the softmax, scaled by sqrt(MODEL_DIMS), a softmax bias and output logits capped at 30.
  Adam (decoupled weight decay 1e-3, updates capped at RMS 1), gradients clipped at norm 5,
  learning rate 1e-3 ramped over 4000 steps then decayed exponentially to 0.1x at 300000.
  Pax's default of 1e7 train steps; checkpoints every 1000 steps (10 kept), eval and summaries
  every 100.

  Differences (besides the module docstring's):
  - CHECKPOINT_POLICY 'save_qkv_out_proj' for Pax's SAVE_DOT_FOR_MLPERF_200B, which also keeps
    the attention context: paxcli names no checkpoint for it. (Every run below uses
    SAVE_NOTHING, which is ported exactly.)
  - The query, key and value projections are three weights where Pax's COMBINE_QKV has one
    [3, D, N, H]: the same parameters and FLOPs, and the layout `pax checkpoint convert` maps.
  """

  NUM_LAYERS = 24
  MODEL_DIMS = 2048
  HIDDEN_DIMS = 2048 * 4
  NUM_HEADS = 32
  DIMS_PER_HEAD = None          # MODEL_DIMS // NUM_HEADS = 64
  VOCAB_SIZE = 32128            # T5's 32100 ids, padded
  MAX_SEQ_LEN = 1024
  PERCORE_BATCH_SIZE = 1
  ICI_MESH_SHAPE = [1, 4, 2]
  ACTIVATION = 'gelu'
  USE_GATED_ACTIVATION = False
  NORM_TYPE = 'layernorm'
  NORM_EPSILON = 1e-6
  USE_BIAS = True               # Pax's feed-forward and LayerNorm biases
  USE_ATTENTION_BIAS = False    # Pax's USE_BIAS = False is the attention's
  USE_PER_DIM_SCALE = True
  POSITION_EMBEDDING = 'sinusoidal'
  SEPARATE_EMBEDDING = False
  SCALE_EMBEDDING_SQRT_DEPTH = True
  USE_SOFTMAX_BIAS = True
  SOFTMAX_CAP_LOGITS = 30.0
  ATTEN_LOGIT_CAP = 50.0
  FPROP_DTYPE = 'float32'
  USE_REPEATED_LAYER = False
  CHECKPOINT_POLICY = 'save_qkv_out_proj'

  OPTIMIZER = 'adamw'           # praxis Adam: weight decay decoupled and scaled by the learning rate
  LEARNING_RATE = 1e-3
  ADAM_BETA1 = 0.9
  ADAM_BETA2 = 0.99
  ADAM_EPSILON = 1e-6
  ADAM_CLIP_THRESHOLD: float = 1.0  # Pax's knob: cap each update's RMS (tasks.OptimizerConfig.clip_threshold)
  WEIGHT_DECAY = 1e-3
  CLIP_GRADIENT_NORM_TO_VALUE = 5.0
  LR_SCHEDULE = 'linear_rampup_exponential_decay'
  LR_WARMUP_STEPS = 4000
  LR_DECAY_START = 4001
  LR_DECAY_END = 300_000
  LR_MIN_RATIO = 0.1

  NUM_TRAIN_STEPS = 10_000_000
  SAVE_INTERVAL_STEPS = 1000    # Pax's CHECKPOINT_EVERY_N_STEPS
  CHECKPOINT_MAX_TO_KEEP: int = 10
  SUMMARY_INTERVAL_STEPS = 100
  EVAL_INTERVAL_STEPS = 100

  # Where the input lives (paxcli.inputs.c4); Pax hard-codes gs:// paths instead.
  C4_TFDS_NAME: str = TFDS_NAME
  C4_DATA_DIR: Optional[str] = None   # holds c4/en/3.0.1; None: $TFDS_DATA_DIR or ~/tensorflow_datasets
  C4_VOCABULARY: Optional[str] = T5_VOCABULARY
  TRAINING_SEED: int = 9876     # Pax's train input seed (eval reads in order)
  # Pax's default: the residual stream's model dimension sharded over `mdl` between layers (a_bld
  # [batch, None, mdl]), which halves what a [*, *, 2] mesh keeps for the backward pass.
  TRAINING_OPTIMIZED_SHARDING: bool = True
  # What a job's record may set (Experiment.replayed): all of this class's knobs (C4 is read, never written).
  replayed = frozenset({'ADAM_CLIP_THRESHOLD', 'CHECKPOINT_MAX_TO_KEEP', 'C4_TFDS_NAME', 'C4_DATA_DIR', 'C4_VOCABULARY',
                        'TRAINING_SEED', 'TRAINING_OPTIMIZED_SHARDING'})

  def task(self) -> fdl.Config:
    task = super().task()
    task.train.save_max_to_keep = self.CHECKPOINT_MAX_TO_KEEP
    task.train.optimizer.clip_threshold = max(self.ADAM_CLIP_THRESHOLD, 0.0)  # Pax: -1 turns it off
    if self.TRAINING_OPTIMIZED_SHARDING:
      task.activation_sharding_rules = {'embed': ('mdl',)}
    return task

  def datasets(self) -> list:
    common = dict(tfds_name=self.C4_TFDS_NAME, data_dir=self.C4_DATA_DIR, spm_model=self.C4_VOCABULARY,
                  seq_len=self.MAX_SEQ_LEN, vocab_size=self.VOCAB_SIZE)
    return [
        fdl.Config(C4Input, name='C4Train', is_training=True, split_name='train', pack=True,
                   seed=self.TRAINING_SEED, **common),
        fdl.Config(C4Input, name='C4Validation', is_training=False, split_name='validation', pack=False,
                   repeat=False, reset_for_eval=True, seed=4321, **common),
    ]


@register
class C4Spmd1BAdam4Replicas(C4SpmdAdam):
  """Pax's C4Spmd1BAdam4Replicas: 1.10B parameters on a TPU v4-8 (4 chips, FSDP over `data`).

  13 layers x 2560, FFN 10240, 20 heads x 128, vocabulary 32000 (T5's), sequence 1024, 32 per
  chip (global batch 128), bfloat16 activations, scanned layers rematerialised saving nothing,
  summaries every 10 steps. Differences: only the shared ones (C4SpmdAdam, module docstring).
  """

  NUM_LAYERS = 13
  MODEL_DIMS = 2560
  HIDDEN_DIMS = 2560 * 4
  NUM_HEADS = 20
  DIMS_PER_HEAD = 128
  PERCORE_BATCH_SIZE = 32
  MAX_SEQ_LEN = 1024
  VOCAB_SIZE = 32000
  FPROP_DTYPE = 'bfloat16'
  USE_REPEATED_LAYER = True
  SUMMARY_INTERVAL_STEPS = 10
  CHECKPOINT_POLICY = 'save_nothing'
  ICI_MESH_SHAPE = [1, 4, 1]


@register
class C4Spmd16BAdam32Replicas(C4SpmdAdam):
  """Pax's C4Spmd16BAdam32Replicas: 16.5B parameters on a TPU v4-64 (32 chips, [1, 16, 2]).

  36 layers x 6144, FFN 24576, 48 heads x 128, vocabulary 32000, sequence 1024, 16 per chip
  (global batch 512), bfloat16, scanned, saving nothing, summaries every 10 steps.
  Differences: only the shared ones (C4SpmdAdam, module docstring).
  """

  NUM_LAYERS = 36
  MODEL_DIMS = 6144
  HIDDEN_DIMS = 6144 * 4
  NUM_HEADS = 48
  DIMS_PER_HEAD = 128
  PERCORE_BATCH_SIZE = 16
  MAX_SEQ_LEN = 1024
  VOCAB_SIZE = 32000
  FPROP_DTYPE = 'bfloat16'
  USE_REPEATED_LAYER = True
  SUMMARY_INTERVAL_STEPS = 10
  CHECKPOINT_POLICY = 'save_nothing'
  ICI_MESH_SHAPE = [1, 16, 2]


@register
class C4Spmd22BAdamMaxText(C4SpmdAdam):
  """Pax's C4Spmd22BAdamMaxText (c4_multislice.py): 21.9B parameters, MaxText's 22B shape.

  48 layers x 6144, FFN 24576, 24 heads x 256, vocabulary 32768, sequence 1024, 16 per chip,
  bfloat16, scanned, saving nothing; the mesh stays C4SpmdAdam's [1, 4, 2] (its subclasses set
  theirs). Differences: only the shared ones (C4SpmdAdam, module docstring).
  """

  NUM_LAYERS = 48
  MODEL_DIMS = 6144
  HIDDEN_DIMS = 6144 * 4
  NUM_HEADS = 24
  DIMS_PER_HEAD = 256
  PERCORE_BATCH_SIZE = 16
  MAX_SEQ_LEN = 1024
  VOCAB_SIZE = 32768
  FPROP_DTYPE = 'bfloat16'
  USE_REPEATED_LAYER = True
  SUMMARY_INTERVAL_STEPS = 10
  CHECKPOINT_POLICY = 'save_nothing'


@register
class C4Spmd22BAdam1xv4_128(C4Spmd22BAdamMaxText):
  """Pax's C4Spmd22BAdam1xv4_128: the 22B model on one v4-128 slice, [1, 64, 1], batch 1024.

  Differences: only the shared ones (C4SpmdAdam, module docstring).
  """

  ICI_MESH_SHAPE = [1, 64, 1]
  PERCORE_BATCH_SIZE = 16


@register
class C4Spmd22BAdam2xv4_128(C4Spmd22BAdam1xv4_128):
  """Pax's C4Spmd22BAdam2xv4_128: two v4-128 slices, DCN [2, 1, 1] (global batch 2048).

  The DCN axis is `replica`: each slice holds a whole FSDP copy of the weights over its 64
  chips, and only gradients cross the slices. Differences: only the shared ones (C4SpmdAdam,
  module docstring).
  """

  DCN_MESH_SHAPE = [2, 1, 1]


@register
class C4SpmdPipelineGpt3AdamOrgHP(C4SpmdAdam):
  """Pax's C4SpmdPipelineGpt3AdamOrgHP: GPT-3 175B with the paper's hyper-parameters, 2 stages.

  Ported with its parent C4SpmdPipelineAdam and configure_gpt3_task; mesh [2, 1, 2, 2]. 96 layers
  x 12288, 96 heads x 128, vocabulary 50257 (Pax's GPT vocabulary), sequence 2048, learned
  positions in a 16384-row table, LayerNorm epsilon 1e-5, attention with biases and
  neither per-dimension scale nor logit cap, tied embeddings unscaled, no softmax bias or cap.
  Adam beta2 0.95, epsilon 1e-8, weight decay 0.1, no update capping, gradients clipped at 1,
  learning rate 6e-5 ramped over 265 steps, cosine decay to 0.1x from 266 to 108600. Microbatches
  of 2 rows; eval every 100 steps, checkpoints every 100 (10 kept), summaries every 10. The
  stages' remat policy is SAVE_NOTHING, per pipeline iteration as in Pax.

  Differences (besides the module docstring's):
  - USE_REPEATED_LAYER True where Pax's is False: paxcli's pipeline runs the scanned layer stack
    (weights [layers, ...]) so that a checkpoint does not depend on the stage count; each stage
    computes the same layers either way.
  - EMB_W_DATA_DIMS ('replica', 'data') is not ported: paxcli shards the embedding's model axis
    over `data`; the meshes here have replica 1, where the two agree.
  - No early stop at eval log-perplexity 2.69 (Pax's TARGET_LOG_PPLX): paxcli has no early-stopping
    hook; the eval log_pplx is in the summaries.
  - The checkpoint policy is 'save_nothing' from the start (Pax sets SAVE_DOT_FOR_MLPERF_200B in
    C4SpmdPipelineAdam and SAVE_NOTHING here).
  """

  MAX_SEQ_LEN = 2048
  NUM_LAYERS = 96
  NUM_HEADS = 96
  MODEL_DIMS = 12288
  HIDDEN_DIMS = 12288 * 4
  DIMS_PER_HEAD = None
  VOCAB_SIZE = 50257
  USE_REPEATED_LAYER = True
  FPROP_DTYPE = 'float32'
  NUM_STAGES = 2
  MICROBATCH_SIZE = 2
  ICI_MESH_SHAPE = [2, 1, 2, 2]

  POSITION_EMBEDDING = 'learned'
  TRAINABLE_PE_MAX_SEQ_LEN: int = 16384
  replayed = frozenset({'TRAINABLE_PE_MAX_SEQ_LEN'})   # a model knob: a job's record may set it
  NORM_EPSILON = 1e-5
  USE_ATTENTION_BIAS = True
  USE_PER_DIM_SCALE = False
  ATTEN_LOGIT_CAP = 0.0
  SCALE_EMBEDDING_SQRT_DEPTH = False
  USE_SOFTMAX_BIAS = False
  SOFTMAX_CAP_LOGITS = 0.0
  CHECKPOINT_POLICY = 'save_nothing'

  LEARNING_RATE = 6e-5
  WEIGHT_DECAY = 0.1
  ADAM_BETA1 = 0.9
  ADAM_BETA2 = 0.95
  ADAM_EPSILON = 1e-8
  ADAM_CLIP_THRESHOLD = -1.0
  CLIP_GRADIENT_NORM_TO_VALUE = 1.0
  LR_SCHEDULE = 'linear_rampup_cosine_decay'
  LR_WARMUP_STEPS = 265
  LR_DECAY_START = 266
  LR_DECAY_END = 108_600
  LR_MIN_RATIO = 0.1

  EVAL_INTERVAL_STEPS = 100
  SUMMARY_INTERVAL_STEPS = 10
  SAVE_INTERVAL_STEPS = 100
  CHECKPOINT_MAX_TO_KEEP = 10
  C4_VOCABULARY = GPT_VOCABULARY

  def task(self) -> fdl.Config:
    task = super().task()
    task.model.lm_tpl.max_seq_len = self.TRAINABLE_PE_MAX_SEQ_LEN  # the position table's rows
    return task


@register
class C4SpmdPipelineGpt3SmallAdam64Replicas(C4SpmdPipelineGpt3AdamOrgHP):
  """Pax's C4SpmdPipelineGpt3SmallAdam64Replicas: 2.92B in 4 pipeline stages on a TPU v4-128.

  The class Pax's README names (paxml at b96c1e9^, early 2023); 64 chips, [4, 1, 4, 4]. 24 layers
  x 3072, FFN 12288, 24 heads x 128, vocabulary 50257, sequence 2048, microbatches of 16 rows,
  bfloat16, learning rate 2e-4, eval every 100 steps, summaries every step, checkpoints
  every 200 (1000 kept). Pax's docstring calls it GPT-3 XL with 1.3B parameters and a global
  batch of 512; its dims make 2.92B (GPT-3 XL is 2048 wide with 16 heads), and its batch is 64:
  the class sets PER_CORE_BATCH_SIZE = 8, a knob no class declares, which Pax ignores silently,
  so the run keeps C4UnsupervisedDataset's PERCORE_BATCH_SIZE 1 (global batch 64: 4 microbatches,
  bubble 3/7). This port keeps what Pax ran, PERCORE_BATCH_SIZE 1 (paxcli refuses the
  misspelling); `--set PERCORE_BATCH_SIZE=8` is what the docstring meant (32 microbatches), which
  needs VOCAB_SIZE 51200 and more than 32 GB per chip (README, "Pax's C4 runs").

  Differences: those of C4SpmdPipelineGpt3AdamOrgHP; none of its own.
  """

  NUM_STAGES = 4
  NUM_LAYERS = 24
  NUM_HEADS = 24
  MODEL_DIMS = 3072
  HIDDEN_DIMS = 3072 * 4
  DIMS_PER_HEAD = 128
  PERCORE_BATCH_SIZE = 1
  MICROBATCH_SIZE = 16
  FPROP_DTYPE = 'bfloat16'
  LEARNING_RATE = 2e-4
  ICI_MESH_SHAPE = [4, 1, 4, 4]
  CHECKPOINT_MAX_TO_KEEP = 1000
  EVAL_INTERVAL_STEPS = 100
  SUMMARY_INTERVAL_STEPS = 1
  SAVE_INTERVAL_STEPS = 200


@register
class C4SpmdPipelineGpt3SmallAdam8Replicas(C4SpmdPipelineGpt3SmallAdam64Replicas):
  """Pax's C4SpmdPipelineGpt3SmallAdam8Replicas (paxml HEAD): the same model on 8 chips.

  [2, 1, 2, 2], 2 stages, 64 per chip (global batch 512) in microbatches of 8 (64 of them),
  vocabulary padded to 51200, eval every 10 steps, summaries every 5.

  Differences: those of C4SpmdPipelineGpt3AdamOrgHP; none of its own.
  """

  NUM_STAGES = 2
  VOCAB_SIZE = 51200
  PERCORE_BATCH_SIZE = 64
  MICROBATCH_SIZE = 8
  ICI_MESH_SHAPE = [2, 1, 2, 2]
  EVAL_INTERVAL_STEPS = 10
  SUMMARY_INTERVAL_STEPS = 5
