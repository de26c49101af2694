"""Train-step measurements the benchmarks share: a tree's bytes, a step's compiled plan (nothing run), and the
seconds of steps after one untimed step that compiles.

  import steps   # benchmarks/steps.py
  setup, analysis, compile_s = steps.plan('bench.Llama1B', overrides)    # XLA's memory_analysis of the step
  setup, state, seconds = steps.timed('bench.Llama1B', overrides, 10)   # seconds a step, the same batch each
"""

from __future__ import annotations

import time


def nbytes(tree) -> int:
  """The bytes of every array (or ShapeDtypeStruct) in `tree`."""
  import jax
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def plan(experiment: str, overrides: list[str]):
  """(setup, memory_analysis of the compiled train step, seconds to compile), on abstract state and batch."""
  import jax

  from paxcli import config
  from paxcli.loops.train import make_train_step
  from paxcli.runtime import engine, sharding
  setup = engine.build(config.resolve(experiment, overrides))
  batch_sharding = sharding.batch_sharding(setup.mesh)
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding)
           for k, v in setup.model.dummy_batch(setup.global_batch, setup.seq_len).items()}
  t0 = time.perf_counter()
  compiled = make_train_step(setup, batch_sharding, 0).lower(setup.abstract_state, batch).compile()
  return setup, compiled.memory_analysis(), time.perf_counter() - t0


def timed(experiment: str, overrides: list[str], steps: int):
  """(setup, state after the steps, seconds a step): the experiment's first batch stepped `steps` times after
  one untimed step."""
  import jax

  from paxcli import config
  from paxcli.loops.train import ready_step
  from paxcli.runtime.sharding import to_global
  setup, state, step, batch_sharding, data = ready_step(config.resolve(experiment, overrides))
  batch = to_global(data.get_next(), batch_sharding, setup.global_batch)
  state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  t0 = time.perf_counter()
  for _ in range(steps):
    state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  return setup, state, (time.perf_counter() - t0) / steps
