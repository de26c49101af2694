"""optax optimizers and learning-rate schedules from TrainConfig."""

from __future__ import annotations

import jax.numpy as jnp
import optax

from paxcli.tasks import ScheduleConfig, TrainConfig


def schedule_multiplier(cfg: ScheduleConfig, num_train_steps: int):
  """step -> multiplier of the peak learning rate."""
  warmup = max(cfg.warmup_steps, 0)
  start = cfg.decay_start or warmup
  end = cfg.decay_end or num_train_steps
  span = max(end - start, 1)

  def fn(step):
    step = jnp.asarray(step, jnp.float32)
    ramp = jnp.minimum((step + 1) / warmup, 1.0) if warmup else 1.0
    frac = jnp.clip((step - start) / span, 0.0, 1.0)
    if cfg.kind == 'constant':
      decay = 1.0
    elif cfg.kind == 'linear_rampup_cosine_decay':
      decay = cfg.min_ratio + (1 - cfg.min_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * frac))
    elif cfg.kind == 'linear_rampup_exponential_decay':
      decay = jnp.power(cfg.min_ratio, frac)
    else:
      raise ValueError(f'unknown schedule {cfg.kind!r}')
    return ramp * decay

  return fn


def learning_rate_fn(train: TrainConfig):
  multiplier = schedule_multiplier(train.lr_schedule, train.num_train_steps)
  return lambda step: train.learning_rate * multiplier(step)


def make_optimizer(train: TrainConfig) -> optax.GradientTransformation:
  """The optimizer, with global-norm clipping first when configured."""
  lr = learning_rate_fn(train)
  opt = train.optimizer
  if opt.name in ('adam', 'adamw') and opt.clip_threshold:
    tx = capped_adam(lr, opt)
  elif opt.name == 'adamw':
    tx = optax.adamw(lr, b1=opt.beta1, b2=opt.beta2, eps=opt.epsilon, weight_decay=opt.weight_decay)
  elif opt.name == 'adam':
    tx = optax.chain(optax.add_decayed_weights(opt.weight_decay) if opt.weight_decay else optax.identity(),
                     optax.adam(lr, b1=opt.beta1, b2=opt.beta2, eps=opt.epsilon))
  elif opt.name == 'adafactor':
    tx = optax.adafactor(lr, weight_decay_rate=opt.weight_decay or None)
  elif opt.name == 'sgd':
    tx = optax.chain(optax.add_decayed_weights(opt.weight_decay) if opt.weight_decay else optax.identity(),
                     optax.sgd(lr, momentum=opt.momentum or None))
  else:
    raise ValueError(f'unknown optimizer {opt.name!r}')
  if train.clip_gradient_norm_to_value:
    tx = optax.chain(optax.clip_by_global_norm(train.clip_gradient_norm_to_value), tx)
  return tx


def capped_adam(lr, opt) -> optax.GradientTransformation:
  """Pax's Adam (praxis sharded_adam) with update capping: each weight's Adam update is scaled
  down to a root-mean-square of at most `clip_threshold`, then decoupled weight decay is added
  and the sum scaled by the learning rate. `adam` couples the decay into the gradient instead."""
  cap = [optax.scale_by_adam(b1=opt.beta1, b2=opt.beta2, eps=opt.epsilon), optax.clip_by_block_rms(opt.clip_threshold)]
  decay = [optax.add_decayed_weights(opt.weight_decay)] if opt.weight_decay else []
  if opt.name == 'adam':
    return optax.chain(*decay, *cap, optax.scale_by_learning_rate(lr))
  return optax.chain(*cap, *decay, optax.scale_by_learning_rate(lr))
