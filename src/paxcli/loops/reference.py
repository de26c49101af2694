"""REFERENCE='precomputed' (paxcli.models.preference): each pair's reference log-probabilities, computed once with
the starting params before the first step, kept in the job directory (one JSON file an input, pair key ->
[chosen, rejected]: layout.reference_logps) and handed to the inputs that feed them in their batches
(paxcli.inputs.preference). A resumed run and `pax eval` read them back; a fresh start computes them again.
No model weights beside the trained ones stay on the devices, and no step runs a reference forward pass.

An input takes part when it has `precomputed_reference` set and the methods `reference_batches` and
`set_reference`; any other input is left alone. One process computes them (several would each need the others'
pairs).
"""

from __future__ import annotations

import json
import math
import time

import jax
import numpy as np

from paxcli import files
from paxcli.errors import UserError
from paxcli.jobdir import layout, storage
from paxcli.runtime import infeed, sharding
from paxcli.runtime.sharding import to_global

MAX_FILE_BYTES = 1 << 30   # ~15 million pairs of 64-byte entries


def asking(inputs) -> list:
  return [inp for inp in inputs if getattr(inp, 'precomputed_reference', False) and hasattr(inp, 'set_reference')]


def prepare(resolved, setup, params, train_input, job_dir: str, fresh: bool, log) -> None:
  """The train input's and the eval inputs' reference log-probabilities: computed with `params` (the starting
  ones) and saved when `fresh`, else read from the job; the train input gets its values here, the eval inputs
  (built again by the Evaluator) read theirs with `attach_saved`."""
  if not asking([train_input]):
    return
  evaluated = fresh and setup.train.eval_interval_steps   # the Evaluator's inputs, as it builds them
  evals = [infeed.build_input(cfg, setup) for cfg in resolved.eval_datasets()] if evaluated else []
  wanting = asking([train_input] + evals)
  if jax.process_count() > 1:
    raise UserError("REFERENCE='precomputed' computes the reference log-probabilities on one process; with several, "
                    "use REFERENCE='copy' (or LoRA, whose reference is its base).")
  for inp in wanting if fresh else ():
    path, t0 = layout.reference_logps(job_dir, inp.name), time.perf_counter()
    values = compute(setup, params, inp)
    storage.write_text(path, json.dumps(values))
    log(f"Reference log-probabilities (REFERENCE='precomputed') of the {len(values):,} distinct pairs of input "
        f'{inp.name!r}, computed with the starting weights in {time.perf_counter() - t0:.1f} s: {path}')
  attach_saved([train_input], job_dir)


def attach_saved(inputs, job_dir: str) -> None:
  """The saved values for each input that asks for them (the Evaluator's, `pax eval`'s)."""
  for inp in asking(inputs):
    path = layout.reference_logps(job_dir, inp.name) if job_dir else None
    if path is None or not storage.isfile(path):
      raise UserError(f"Input {inp.name!r} reads its pairs' reference log-probabilities (REFERENCE='precomputed') "
                      f'from {path or "the job directory"}, which pax train writes before its first step; there is none.')
    inp.set_reference(read(path), path)


def compute(setup, params, inp) -> dict:
  """pair key -> [chosen, rejected] log-probabilities of the completions under `params`, over the input's pairs."""
  batch_sharding = sharding.batch_sharding(setup.mesh)
  replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())

  def logps(params, batch):
    with setup.activation_sharding():
      return setup.model.apply({'params': params}, batch, method='sequence_logps')
  fn = jax.jit(logps, in_shardings=(setup.state_shardings['params'], batch_sharding), out_shardings=replicated)
  values = {}
  for keys, batch in inp.reference_batches():
    out = np.asarray(jax.device_get(fn(params, to_global(batch, batch_sharding, setup.global_batch))))
    values.update({k: [float(c), float(r)] for k, (c, r) in zip(keys, out) if k is not None})
  return values


def read(path: str) -> dict:
  """The saved values, checked: an object of pair keys -> two finite numbers."""
  values = files.parse_json(storage.read_text(path, MAX_FILE_BYTES), path)
  if not isinstance(values, dict) or not all(
      isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) and math.isfinite(x) for x in v)
      for v in values.values()):
    raise UserError(f'{path}: not the reference log-probabilities paxcli writes (pair key -> [chosen, rejected]).')
  return values
