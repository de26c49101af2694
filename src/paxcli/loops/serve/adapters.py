"""What `pax serve` serves: a job's model, and LoRA adapters of one base beside it, each under its own name.

    models = load(resolved, job_dir, name=None, loras=[('sql', '/runs/lora_sql')], step=None, log=print,
                  resolve_with=lambda overrides: ...)
    models.names     # {'base': 0, 'sql': 1}: the `model` a request names -> the adapter its rows use

The served model is the job's (its latest checkpoint, or --step). A job that is a LoRA run serves as
two models: its base (named as the base's job directory) and the run with its adapters (named as its
own directory, or --served-model-name). Each `--lora [NAME=]DIR` adds a LoRA run whose checkpoint
names the same base (by the digest of its weights: another base is refused in one line); it is named
NAME, else its directory's name. A request names one of them in `model` (none: the job's).

All the adapters run in one batch: the model is built with LoRA on at the largest rank and every
target any adapter has (alpha = rank: a scale of 1), each adapter's A and B zero-padded to that rank,
its own alpha / rank folded into B and zeros for the projections it does not adapt, then stacked
(adapter 0 is all zeros: the base alone). paxcli.loops.serve.slots gives every row its own.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec

from paxcli.errors import UserError, shorten
from paxcli.jobdir import layout, restore
from paxcli.layers import lora
from paxcli.runtime import engine as engine_lib
from paxcli.runtime import train_state
from paxcli.values import saved_literal


@dataclasses.dataclass
class Models:
  setup: object                 # the served model, on its mesh (LoRA on when adapters are served)
  params: dict                  # the base's params (adapter weights zero)
  adapters: Optional[dict]      # 'path/to/query_lora_a' -> every adapter's, stacked on axis leads[path]
  leads: dict
  names: dict                   # served name -> adapter index (0: the base)
  default: str                  # the model of a request that names none
  parents: dict                 # adapter name -> its base's name
  step: int                     # the job's checkpoint step


@dataclasses.dataclass
class _Adapter:
  name: str
  job_dir: str
  step: int
  rank: int
  alpha: float
  targets: tuple
  params: dict                  # flat 'path' -> numpy array (its own rank)


def load(resolved, job_dir: str, name: Optional[str], loras, step: Optional[int], log: Callable[[str], None],
         resolve_with: Callable[[list], object]) -> Models:
  """The models to serve (module docstring); every check before any array of the base is read."""
  setup = engine_lib.build(resolved)
  own = getattr(setup.model, 'lora', {}) or {}
  chosen = restore.choose_step(job_dir, step, purpose='serve')
  own_name = name or _dir_name(job_dir)
  if not own.get('rank') and not loras:
    params, got = restore.weights(setup, resolved, job_dir, chosen, 'serve', fallback=step is None, log=log)
    return Models(setup, params, None, {}, {own_name: 0}, own_name, {}, got)
  meta = restore.read_meta(job_dir, chosen)
  if own.get('rank'):   # a LoRA run: its base is served beside it
    base = restore.checked_base(setup, meta)
    base_name = _dir_name(base.job_dir)
    found = [_read_adapter(own_name, job_dir, chosen, meta, setup.mesh, base.digest, base_name, _shown(job_dir))]
  else:
    base, base_name, found = restore.base_ref(layout.step_dir(job_dir, chosen)), own_name, []
  for given, directory in loras:
    lora_name = given or _dir_name(directory)
    lora_step = restore.choose_step(directory, None, purpose='serve')
    found.append(_read_adapter(lora_name, directory, lora_step, restore.read_meta(directory, lora_step), setup.mesh,
                               base.digest, base_name, f'--lora {_shown(directory)}'))
  names = [base_name] + [a.name for a in found]
  doubled = next((n for n in names if names.count(n) > 1), None)
  if doubled:
    raise UserError(f'Two served models are named {doubled!r}: name the adapters apart (--lora NAME=DIR, '
                    '--served-model-name).')
  rank = max(a.rank for a in found)
  targets = tuple(t for t in lora.TARGETS if any(t in a.targets for a in found))
  served = resolve_with([f'LORA_RANK={rank}', f'LORA_ALPHA={float(rank)}', f'LORA_TARGETS={targets!r}'])
  setup = engine_lib.build(served)
  base_params = restore.base_params(setup, base, frozen_only=True)
  stacked, leads = _stack(setup, found, rank)
  adapters_abs = train_state.split_trainable(setup.model, setup.abstract_state['params'])[0]
  zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), adapters_abs)
  params = train_state.join_params(base_params, zeros)
  parents = {a.name: base_name for a in found}
  for a in found:
    log(f'Adapter {a.name}: {_shown(a.job_dir)} step {a.step} (rank {a.rank}, alpha {a.alpha:g}, '
        f'{", ".join(a.targets)}) on the base {base_name}.')
  return Models(setup, params, stacked, leads, {n: i for i, n in enumerate(names)},
                own_name, parents, chosen)


def _dir_name(path: str) -> str:
  return os.path.basename(os.path.normpath(path)) or path


def _shown(path: str) -> str:
  relative = os.path.relpath(path)
  return path if relative.startswith('..') else relative


def _read_adapter(name: str, job_dir: str, step: int, meta: dict, mesh, digest: str, base_name: str,
                  where: str) -> _Adapter:
  """A LoRA run's adapters at `step`, verified against their checksums, after its settings (from the
  checkpoint's own record) and its base are checked; `where` names it in errors."""
  named = meta.get('base') if isinstance(meta.get('base'), dict) else None
  if not named:
    raise UserError(f'{where}: its checkpoint at step {step} names no base: it is not a LoRA run (LORA_RANK > 0).')
  if named.get('digest') != digest:
    raise UserError(f'{where}: its adapters were trained on the base {shorten(str(named.get("job_dir")), 120)} '
                    f'(content {str(named.get("digest"))[:12]}), not on {base_name} (content {digest[:12]}): '
                    'one server serves the adapters of one base.')
  config = meta.get('config') if isinstance(meta.get('config'), dict) else {}
  rank, alpha, targets = (saved_literal(config.get(f'knobs.{k}')) for k in ('LORA_RANK', 'LORA_ALPHA', 'LORA_TARGETS'))
  if not (isinstance(rank, int) and 0 < rank <= 65536 and isinstance(alpha, (int, float)) and math.isfinite(alpha)
          and isinstance(targets, (list, tuple)) and targets and all(t in lora.TARGETS for t in targets)):
    raise UserError(f'{where}: its checkpoint at step {step} does not record LORA_RANK, LORA_ALPHA and LORA_TARGETS '
                    'as a LoRA run writes them.')
  shapes = meta.get('state_shapes') if isinstance(meta.get('state_shapes'), dict) else {}
  wanted = {k: v for k, v in shapes.items() if k.startswith('params/') and lora.is_adapter(k)}
  if not wanted or not all(isinstance(v, list) and all(isinstance(d, int) and 0 < d <= 1 << 20 for d in v)
                           for v in wanted.values()):
    raise UserError(f'{where}: its checkpoint at step {step} records no adapter weights.')
  dtypes = restore.saved_dtypes(restore.saved_metadata(job_dir, step))
  rep = NamedSharding(mesh, PartitionSpec())
  abstract = traverse_util.unflatten_dict({
      tuple(k.split('/')[1:]): jax.ShapeDtypeStruct(tuple(v), dtypes.get(k, np.float32), sharding=rep)
      for k, v in wanted.items()})
  only = types.SimpleNamespace(mesh=mesh, abstract_state={
      'step': jax.ShapeDtypeStruct((), jnp.int32, sharding=rep), 'params': abstract})
  got = restore.restore(only, job_dir, step, params_only=True, action='read the adapters of', join_base=False)
  flat = {'/'.join(k): np.asarray(v, np.float32)
          for k, v in traverse_util.flatten_dict(got.state['params']).items()}
  return _Adapter(name, job_dir, step, rank, float(alpha), tuple(targets), flat)


def _stack(setup, found: list[_Adapter], rank: int) -> tuple[dict, dict]:
  """Every adapter weight of the served model, all adapters stacked (index 0: zeros), on the axis after the
  stacked layers' (its lead); each adapter padded to `rank` and scaled by its alpha / rank."""
  abstract = traverse_util.flatten_dict(setup.abstract_state['params'], sep='/')
  logical = traverse_util.flatten_dict(setup.logical, sep='/', is_leaf=lambda _, x: isinstance(x, tuple))
  rep = NamedSharding(setup.mesh, PartitionSpec())
  stacked, leads = {}, {}
  for path, a in abstract.items():
    if not lora.is_adapter(path):
      continue
    names = tuple(logical.get(path) or ())
    lead = next((i for i, n in enumerate(names) if n != 'layers'), len(names))
    is_a = path.endswith(lora.SUFFIX_A)
    rank_axis = a.ndim - 1 if is_a else lead
    layers = [np.zeros(a.shape, np.float32)]
    for adapter in found:
      mine = adapter.params.get(path)
      if mine is None:   # a projection this adapter does not adapt
        layers.append(np.zeros(a.shape, np.float32))
        continue
      expect = tuple(d if i != rank_axis else adapter.rank for i, d in enumerate(a.shape))
      if mine.shape != expect:
        raise UserError(f'{_shown(adapter.job_dir)}: its {path} has shape {list(mine.shape)}, where this '
                        f'base takes {list(expect)}.')
      pad = [(0, 0)] * a.ndim
      pad[rank_axis] = (0, rank - adapter.rank)
      scale = 1.0 if is_a else adapter.alpha / adapter.rank   # the served model's own scale is 1 (alpha = rank)
      layers.append(np.pad(mine, pad) * np.float32(scale))
    stacked[path] = jax.device_put(np.stack(layers, axis=lead).astype(a.dtype), rep)
    leads[path] = lead
  return stacked, leads
