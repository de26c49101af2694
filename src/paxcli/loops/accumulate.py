"""Gradient accumulation: one train step's global batch run as GRAD_ACCUM_STEPS microbatches, scanned
inside the one compiled step, so that the activations of only one microbatch are alive at a time.

The step's gradient stays the gradient of the whole global batch's loss. A model's loss is the mean
over its loss weight (metrics['loss'] = (mean, weight): the LM's target tokens), so the global batch's
gradient is each microbatch's gradient times its share of the weight, sum_m W_m g_m / sum_m W_m, and
every metric (value, weight) combines the same way; the step then equals the unaccumulated one up to
float rounding. Not exactly equal where a model's numbers are not means over that weight: aux losses
are combined by the same weights, summaries by a plain mean, and non-trainable variables (and fp8
scaling state) are carried from one microbatch to the next, as if each were a step of its own.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from paxcli.runtime import sharding


class Pass(NamedTuple):
  """What a forward and backward pass over one (micro)batch gives the step."""
  grads: Any          # of the trainable params
  total: Any          # the loss with aux losses added: what the grads are of
  loss: Any           # the model's loss
  metrics: dict       # name -> (value, weight), as the model's compute_loss returns them
  aux: dict           # aux loss name -> value
  summaries: dict     # summary name -> value
  carried: dict       # state collections carried from pass to pass (non_trainable, fp8)


def run(one_pass: Callable[[dict, dict, dict], Pass], carried: dict, batch: dict, rngs: dict, steps: int,
        mesh) -> Pass:
  """`one_pass(carried, batch, rngs)` over the whole batch (steps 1), or over `steps` microbatches in a
  lax.scan, combined as the module docstring says. Each microbatch draws its own random streams."""
  if steps == 1:
    return one_pass(carried, batch, rngs)
  micro = split(batch, steps, mesh)
  first = jax.tree.map(lambda x: x[0], micro)
  shapes = jax.eval_shape(one_pass, carried, first, rngs)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes._replace(carried=None))

  def body(acc: Pass, xs):
    i, mb = xs
    p = one_pass(acc.carried, mb, {k: jax.random.fold_in(r, i) for k, r in rngs.items()})
    w = _weight(p)
    scaled = lambda total, x: total + w * x
    return Pass(jax.tree.map(scaled, acc.grads, p.grads), scaled(acc.total, p.total), scaled(acc.loss, p.loss),
                {k: (acc.metrics[k][0] + v * wk, acc.metrics[k][1] + wk) for k, (v, wk) in p.metrics.items()},
                jax.tree.map(scaled, acc.aux, p.aux), jax.tree.map(jnp.add, acc.summaries, p.summaries),
                p.carried), None

  acc, _ = jax.lax.scan(body, zeros._replace(carried=carried), (jnp.arange(steps), micro))
  weight = acc.metrics['loss'][1]
  share = lambda x: x / jnp.where(weight > 0, weight, 1.0).astype(x.dtype)
  return Pass(jax.tree.map(share, acc.grads), share(acc.total), share(acc.loss),
              {k: (v / jnp.where(wk > 0, wk, 1.0), wk) for k, (v, wk) in acc.metrics.items()},
              jax.tree.map(share, acc.aux), jax.tree.map(lambda x: x / steps, acc.summaries), acc.carried)


def _weight(p: Pass):
  return jnp.asarray(p.metrics['loss'][1], jnp.float32)


def split(batch: dict, steps: int, mesh) -> dict:
  """[B, ...] -> [steps, B / steps, ...]: microbatch m holds rows m, m + steps, m + 2 steps, ... so
  that every device gives each microbatch its own rows (no data moves between devices)."""
  spec = PartitionSpec(None, *sharding.batch_sharding(mesh).spec)

  def one(x):
    x = x.reshape(x.shape[0] // steps, steps, *x.shape[1:]).swapaxes(0, 1)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
  return jax.tree.map(one, batch)
