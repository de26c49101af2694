"""TrainingExperiment: the optimizer, schedule and loop knobs every model trains with.

A model's experiment base (paxcli.models.lm_experiment.LmExperiment,
paxcli.models.classifier_experiment.ClassifierExperiment) derives from it and supplies
`model()` (the model's fiddle config) and `datasets()`; `task()` puts the model beside the
TrainConfig these knobs fill. A base adds loop settings of its own by extending
`train_config()` (the LM adds decoding during training).
"""

from __future__ import annotations

from typing import Optional

import fiddle as fdl

from paxcli import files
from paxcli.experiment import Experiment
from paxcli.options import OptimizerName, ScheduleName, TrackerName
from paxcli.tasks import OptimizerConfig, ScheduleConfig, Task, TrackersConfig, TrainConfig


class TrainingExperiment(Experiment):
  """An experiment trained by paxcli's loop: optimizer, learning-rate schedule, steps and intervals."""

  OPTIMIZER: OptimizerName = 'adamw'          # optax's optimizer of that name
  LEARNING_RATE: float = 1e-3                 # the peak learning rate LR_SCHEDULE scales
  ADAM_BETA1: float = 0.9                     # Adam's first-moment decay
  ADAM_BETA2: float = 0.99                    # Adam's second-moment decay
  ADAM_EPSILON: float = 1e-8                  # added to Adam's denominator
  WEIGHT_DECAY: float = 0.0                   # decoupled weight decay (AdamW), times the learning rate
  CLIP_GRADIENT_NORM_TO_VALUE: float = 1.0    # the global gradient norm is clipped to this; 0: no clipping
  LR_SCHEDULE: ScheduleName = 'constant'      # how the learning rate moves over the steps
  LR_WARMUP_STEPS: int = 0                    # steps of linear warm-up from 0
  LR_DECAY_START: int = 0                     # the step a decay starts at (0: after the warm-up)
  LR_DECAY_END: int = 0                       # the step a decay ends at (0: NUM_TRAIN_STEPS)
  LR_MIN_RATIO: float = 0.1                   # the decay's floor, a fraction of LEARNING_RATE

  NUM_TRAIN_STEPS: int = 100                  # the step training stops at (a resume continues to it)
  # Gradient accumulation: each step's global batch (PERCORE_BATCH_SIZE x devices) runs as this many
  # microbatches, scanned inside the one compiled step; the gradient is the whole batch's, the
  # activations one microbatch's. It must divide PERCORE_BATCH_SIZE's rows per data-parallel shard.
  GRAD_ACCUM_STEPS: int = 1
  SAVE_INTERVAL_STEPS: int = 100              # steps between checkpoints (and one at the last step)
  SUMMARY_INTERVAL_STEPS: int = 10            # steps between the printed and logged train metrics
  EVAL_INTERVAL_STEPS: int = 0  # 0: no eval during training
  # Start a fresh run from these weights (fine-tuning): a paxcli job directory (its latest checkpoint) or
  # one checkpoint step, e.g. what `pax checkpoint convert HF_DIR OUT --from hf` wrote. LoRA runs also
  # read their frozen base from it. None: random initialisation.
  INIT_FROM: Optional[str] = None
  # Trackers beside TensorBoard (docs/guides/trackers.md): the same scalars at the same steps, the config and
  # the run's identity; a resume continues the run. None settings: the library's environment variable.
  TRACKERS: list[TrackerName] = []
  TRACKER_RUN_NAME: Optional[str] = None      # None: the job directory's name
  WANDB_PROJECT: Optional[str] = None         # None: $WANDB_PROJECT, else 'paxcli'
  WANDB_ENTITY: Optional[str] = None          # None: $WANDB_ENTITY, else your W&B default
  MLFLOW_TRACKING_URI: Optional[str] = None   # None: $MLFLOW_TRACKING_URI, else MLflow's default
  MLFLOW_EXPERIMENT: Optional[str] = None     # None: $MLFLOW_EXPERIMENT_NAME, else 'paxcli'
  # A fast tier of checkpoints on each host's local disk (paxcli/jobdir/fast_tier.py;
  # docs/guides/goodput-and-restarts.md): each process saves its own shards there beside the persistent
  # checkpoints, and a restart resumes from the newest step complete on every process in either tier.
  LOCAL_CHECKPOINT_DIR: Optional[str] = None  # a host-local directory, one per job; None: no fast tier
  LOCAL_CHECKPOINT_EVERY: int = 0             # steps between fast-tier saves (with the directory set); 0: none
  LOCAL_CHECKPOINT_KEEP: int = 2              # the newest fast-tier steps kept on each host
  # What a job's record may set (Experiment.replayed): the optimizer, the schedule, the loop and the weights a
  # run starts from. Not the trackers' destinations and run name, nor the fast tier (a path on this machine).
  replayed = frozenset({
      'OPTIMIZER', 'LEARNING_RATE', 'ADAM_BETA1', 'ADAM_BETA2', 'ADAM_EPSILON', 'WEIGHT_DECAY',
      'CLIP_GRADIENT_NORM_TO_VALUE', 'LR_SCHEDULE', 'LR_WARMUP_STEPS', 'LR_DECAY_START', 'LR_DECAY_END', 'LR_MIN_RATIO',
      'NUM_TRAIN_STEPS', 'GRAD_ACCUM_STEPS', 'SAVE_INTERVAL_STEPS', 'SUMMARY_INTERVAL_STEPS', 'EVAL_INTERVAL_STEPS',
      'INIT_FROM'})

  def model(self) -> fdl.Config:
    """The model's fiddle config (a paxcli.models.base.BaseModel)."""
    raise NotImplementedError(f'{type(self).__name__} must define model().')

  def train_config(self) -> fdl.Config:
    """TrainConfig from the knobs: the learner (optimizer, schedule, clipping) and the loop's intervals."""
    return fdl.Config(
        TrainConfig,
        num_train_steps=self.NUM_TRAIN_STEPS,
        save_interval_steps=self.SAVE_INTERVAL_STEPS,
        summary_interval_steps=self.SUMMARY_INTERVAL_STEPS,
        eval_interval_steps=self.EVAL_INTERVAL_STEPS,
        init_from=files.path_knob(self.INIT_FROM) if self.INIT_FROM else None,
        local_checkpoint_dir=files.path_knob(self.LOCAL_CHECKPOINT_DIR) if self.LOCAL_CHECKPOINT_DIR else None,
        local_checkpoint_interval_steps=self.LOCAL_CHECKPOINT_EVERY,
        local_checkpoint_max_to_keep=self.LOCAL_CHECKPOINT_KEEP,
        learning_rate=self.LEARNING_RATE,
        grad_accum_steps=self.GRAD_ACCUM_STEPS,
        clip_gradient_norm_to_value=self.CLIP_GRADIENT_NORM_TO_VALUE,
        optimizer=fdl.Config(OptimizerConfig, name=self.OPTIMIZER, beta1=self.ADAM_BETA1,
                             beta2=self.ADAM_BETA2, epsilon=self.ADAM_EPSILON,
                             weight_decay=self.WEIGHT_DECAY),
        lr_schedule=fdl.Config(ScheduleConfig, kind=self.LR_SCHEDULE, warmup_steps=self.LR_WARMUP_STEPS,
                               decay_start=self.LR_DECAY_START, decay_end=self.LR_DECAY_END,
                               min_ratio=self.LR_MIN_RATIO),
        trackers=fdl.Config(TrackersConfig, names=list(self.TRACKERS), run_name=self.TRACKER_RUN_NAME,
                            wandb_project=self.WANDB_PROJECT, wandb_entity=self.WANDB_ENTITY,
                            mlflow_tracking_uri=self.MLFLOW_TRACKING_URI, mlflow_experiment=self.MLFLOW_EXPERIMENT),
    )

  def task(self) -> fdl.Config:
    return fdl.Config(Task, model=self.model(), train=self.train_config())
