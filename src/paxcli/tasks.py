"""The task: the model plus how to train it. Plain dataclasses, configured with fiddle."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional


@dataclasses.dataclass
class OptimizerConfig:
  """An optax optimizer. `weight_decay` is decoupled (AdamW-style) for adamw/adafactor."""
  name: Literal['adam', 'adamw', 'adafactor', 'sgd'] = 'adamw'
  beta1: float = 0.9
  beta2: float = 0.99
  epsilon: float = 1e-8
  weight_decay: float = 0.0
  momentum: float = 0.9  # sgd only
  # adam/adamw: > 0 scales each weight's update down to this root-mean-square before weight decay
  # and the learning rate (Pax's Adam clip_threshold); 0: off.
  clip_threshold: float = 0.0


@dataclasses.dataclass
class ScheduleConfig:
  """Learning-rate multiplier over steps (the peak rate is TrainConfig.learning_rate).

  kind:
    constant: 1 after `warmup_steps` of linear ramp from 0.
    linear_rampup_cosine_decay: ramp to 1 over `warmup_steps`, cosine from
      `decay_start` to `decay_end` down to `min_ratio`, then constant.
    linear_rampup_exponential_decay: ramp to 1, exponential from `decay_start` to
      `decay_end` down to `min_ratio` (Pax's linear_rampup_exponential_decay).
  """
  kind: Literal['constant', 'linear_rampup_cosine_decay', 'linear_rampup_exponential_decay'] = 'constant'
  warmup_steps: int = 0
  decay_start: int = 0
  decay_end: int = 0
  min_ratio: float = 0.1


@dataclasses.dataclass
class TrackersConfig:
  """Trackers beside TensorBoard (paxcli.jobdir.trackers): which, and where their runs go. None: the
  library's environment variable (WANDB_PROJECT, WANDB_ENTITY, MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME),
  else on a resume the run's recorded setting, else 'paxcli' (project, experiment) or the library's default."""
  names: Any = ()                       # 'wandb', 'mlflow'
  run_name: Optional[str] = None        # None: the job directory's name
  wandb_project: Optional[str] = None
  wandb_entity: Optional[str] = None
  mlflow_tracking_uri: Optional[str] = None
  mlflow_experiment: Optional[str] = None


@dataclasses.dataclass
class TrainConfig:
  """Pax's task.train knobs, with the learner (optimizer, schedule, clipping) beside them."""
  num_train_steps: int = 100
  save_interval_steps: int = 100
  save_max_to_keep: int = 3
  summary_interval_steps: int = 10
  eval_interval_steps: int = 0  # 0: no eval during training
  decode_interval_steps: int = 0  # 0: no decoding during training (else greedy on decode_prompts)
  decode_prompts: Any = ()        # texts (or lists of ids for models without a tokenizer)
  decode_max_steps: int = 32
  learning_rate: float = 1e-3
  # The global batch run as this many microbatches inside each step (paxcli.loops.accumulate); the
  # gradient is the whole batch's. It must divide each data-parallel shard's rows.
  grad_accum_steps: int = 1
  clip_gradient_norm_to_value: float = 1.0  # 0: no clipping
  # A finite loss above loss_spike_factor x the median of the last loss_spike_window step losses
  # stops the run like a NaN (exit 3, no checkpoint of that state). 0: off.
  loss_spike_factor: float = 10.0
  loss_spike_window: int = 50
  optimizer: Any = dataclasses.field(default_factory=OptimizerConfig)
  lr_schedule: Any = dataclasses.field(default_factory=ScheduleConfig)
  # A checkpoint (job directory or step directory, absolute) whose params a fresh run starts from:
  # all of them, or under LoRA the frozen base beside new adapters. None: random initialisation.
  init_from: Optional[str] = None
  # LoRA: a PEFT adapter directory (adapter_config.json + adapter_model.safetensors, absolute) the
  # adapters of a fresh run start from instead of A random, B = 0.
  lora_init: Optional[str] = None
  # The fast checkpoint tier (paxcli/jobdir/fast_tier.py): a local directory (absolute) on each host, a
  # save every `local_checkpoint_interval_steps` (0: off) of each process's own shards, the newest
  # `local_checkpoint_max_to_keep` kept.
  local_checkpoint_dir: Optional[str] = None
  local_checkpoint_interval_steps: int = 0
  local_checkpoint_max_to_keep: int = 2
  trackers: Any = dataclasses.field(default_factory=TrackersConfig)
  # A mixture-of-experts layer whose busiest expert takes at least this fraction of the tokens in each of
  # router_collapse_steps consecutive steps gets a warning line naming it (paxcli.loops.router_watch).
  router_collapse_fraction: float = 0.9
  router_collapse_steps: int = 100


@dataclasses.dataclass
class Task:
  """What to train: a flax model (built from its fiddle config) and TrainConfig."""
  model: Any
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  # Logical axis name -> mesh axes, overriding entries of paxcli.runtime.sharding.DEFAULT_RULES (weights).
  sharding_rules: Optional[dict] = None
  # The same for activations, overriding paxcli.layers.activation_sharding.ACTIVATION_RULES,
  # e.g. {'embed': ('mdl',)} (sequence-parallel style) or {'batch': ('replica',)}.
  activation_sharding_rules: Optional[dict] = None
