"""Runtime set-up shared by train, eval, decode and benchmarks: model, optimizer, state shapes.

The engine knows models only through paxcli.models.BaseModel's methods (fprop,
dummy_batch, validate, ...); it never names a model family or its loss.

The train state is a dict {'step', 'params', 'opt_state'}, plus 'non_trainable' when the
model declares non-trainable variables and 'fp8' for fp8 delayed scaling's state (paxcli.layers.fp8). Its shardings are derived
from shapes: `jax.eval_shape(init)` gives the abstract state with logical axis names
on params; one table (sharding.py) turns names and shapes into NamedShardings; `init`
is then jitted with those out_shardings, so no array ever exists unsharded. Which
process reads which rows of a batch is runtime/infeed.py; the platform's environment
is runtime/platform.py.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Optional

import fiddle as fdl
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from paxcli import optim, options
from paxcli.errors import UserError, at_least
from paxcli.layers import activation_sharding
from paxcli.layers.base import NON_TRAINABLE, RANDOM, instantiate, mean_sync_mask
from paxcli.layers.fp8 import FP8_STATE
from paxcli.models import flops, pattern, registry
from paxcli.models.lm import flat_view
from paxcli.runtime import platform, sharding, train_state
from paxcli.runtime.infeed import global_batch_size, plan_infeed
from paxcli.runtime.train_state import (cast_frozen, has_frozen, join_params, param_count,  # noqa: F401
                                        saved_state, shape_signature, split_trainable, unbox)


@dataclasses.dataclass
class Setup:
  """Everything a loop needs, built from a Resolved config on the current devices."""
  mesh: Any
  model: Any
  train: Any
  tx: Any
  rules: dict
  abstract_state: Any       # ShapeDtypeStructs with shardings
  state_shardings: Any
  logical: Any              # logical axis names of params (tuples or None)
  seq_len: int
  global_batch: int         # rows of the global batch array (padding rows included)
  process_batch: int        # rows this process feeds into it
  infeed: Any = None        # Infeed: who reads which rows (Pax's multihost infeed)
  mean_sync: Any = None     # per non-trainable variable: tagged REQUIRES_MEAN_SYNC (None: none)
  activation_rules: Optional[dict] = None  # overrides of layers.activation_sharding.ACTIVATION_RULES
  pipeline: Any = None      # layers.pipeline.Schedule of a pipelined model (None: not pipelined)

  def activation_sharding(self):
    """The context to trace a train or eval step in: layers' `constrain` calls apply the
    activation rules on this mesh (see paxcli.layers.activation_sharding)."""
    return activation_sharding.rules(self.mesh, self.activation_rules)


def build(resolved, mesh=None) -> Setup:
  """Mesh, model, optimizer and abstract sharded state for a resolved experiment."""
  exp = resolved.experiment
  task = validate(resolved)
  mesh = mesh or sharding.make_mesh(exp.ICI_MESH_SHAPE, exp.DCN_MESH_SHAPE)
  model, train = task.model, task.train
  if hasattr(model, 'validate_mesh'):
    model.validate_mesh(dict(mesh.shape))   # a -1 filled in: the sizes are now known
  gbs = global_batch_size(exp.PERCORE_BATCH_SIZE, mesh.size)
  infeed = plan_infeed(mesh, gbs)
  check_host_batch(model, infeed.process_rows, _seq_len(resolved, model))
  accum = check_accumulation(train, infeed.rows, mesh)
  schedule = plan_pipeline(model, mesh, infeed.rows // accum)
  tx = optim.make_optimizer(train)
  seq_len = getattr(resolved.train_dataset(), 'seq_len', None) or getattr(model, 'max_seq_len', None)
  rules = dict(task.sharding_rules or {})
  boxed = jax.eval_shape(make_init(model, tx, seq_len), jax.random.key(0))
  is_box = lambda x: hasattr(x, 'names') and hasattr(x, 'unbox')
  logical = jax.tree.map(lambda b: tuple(b.names), boxed['params'], is_leaf=is_box)
  abstract_unboxed = unbox(boxed)  # the same shapes without the logical-name boxes
  param_shardings = sharding.logical_to_sharding(logical, abstract_unboxed['params'], mesh, rules)
  opt_shardings = _opt_state_shardings(abstract_unboxed['opt_state'], abstract_unboxed['params'],
                                       param_shardings, mesh)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  state_shardings = {'step': replicated, 'params': param_shardings, 'opt_state': opt_shardings}
  mean_sync = None
  if 'non_trainable' in boxed:
    nt_logical = jax.tree.map(lambda b: tuple(b.names), boxed['non_trainable'], is_leaf=is_box)
    state_shardings['non_trainable'] = sharding.logical_to_sharding(
        nt_logical, abstract_unboxed['non_trainable'], mesh, rules)
    mean_sync = mean_sync_mask(boxed['non_trainable'])
  if 'fp8' in boxed:   # fp8 scaling state (paxcli.layers.fp8): scales and amax histories, replicated
    state_shardings['fp8'] = jax.tree.map(lambda _: replicated, abstract_unboxed['fp8'])
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract_unboxed, state_shardings)
  return Setup(mesh, model, train, tx, rules, abstract, state_shardings, logical, seq_len, infeed.rows,
               infeed.process_rows, infeed, mean_sync, dict(task.activation_sharding_rules or {}), schedule)


def validate(resolved):
  """The built task, after every check that needs no devices: the mesh shapes, the model's and
  task.train's settings, and the sizes init would trace (check_buildable). `pax train` and `pax
  describe` run it first, so that both refuse the same settings in the same one line."""
  exp = resolved.experiment
  sharding.check_mesh_shapes(exp.ICI_MESH_SHAPE, exp.DCN_MESH_SHAPE)
  if not 0 <= exp.RANDOM_SEED <= MAX_SEED:
    raise UserError(f'RANDOM_SEED must be from 0 to {MAX_SEED:,} (a 64-bit seed), got {exp.RANDOM_SEED:,}.')
  task = build_task(resolved.task)
  validate_model(task.model)
  validate_mesh(task.model, exp.ICI_MESH_SHAPE, exp.DCN_MESH_SHAPE)
  validate_train(task.train)
  check_buildable(task.model, _seq_len(resolved, task.model))
  return task


def validate_mesh(model, ici, dcn) -> None:
  """The model's checks against the mesh the shapes make (model.validate_mesh), before any device is used."""
  if hasattr(model, 'validate_mesh'):
    model.validate_mesh({sharding.EXPERT_AXIS: sharding.expert_axis_size(ici, dcn)})


def _seq_len(resolved, model) -> Optional[int]:
  return getattr(resolved.train_dataset(), 'seq_len', None) or getattr(model, 'max_seq_len', None)


# Unrolled layers are each built in Python when a model is traced (about 35 ms a layer for a small
# model on a CPU): more than this would take minutes to describe and longer to compile. A scanned
# stack (USE_REPEATED_LAYER=True) is traced once whatever its depth.
MAX_UNROLLED_LAYERS = 1024
# Init traces the model on a dummy batch of one sequence, made on the host: one sequence longer than
# fits this share of the host's memory is refused (an LM's takes 12 bytes a token).
HOST_SHARE_FOR_ONE_SEQUENCE = 16
HOST_SHARE_FOR_ONE_BATCH = 4      # the batch a process reads a step, on the host, against its memory


def check_buildable(model, seq_len: Optional[int]) -> None:
  """UserError, before anything is traced or allocated, for sizes that cannot be built on this
  machine: more unrolled layers than MAX_UNROLLED_LAYERS, or a sequence whose dummy batch would not
  fit in 1/HOST_SHARE_FOR_ONE_SEQUENCE of the host's memory."""
  for where, cfg in _layer_configs(model):
    layers = getattr(cfg, 'num_layers', None)
    if isinstance(layers, int) and layers > MAX_UNROLLED_LAYERS and not getattr(cfg, 'scan_layers', False):
      scan = ' set USE_REPEATED_LAYER=True to scan them (traced once at any depth), or' if hasattr(
          cfg, 'scan_layers') else ''
      raise UserError(f'{where}.num_layers (NUM_LAYERS) is {layers:,} unrolled layers; paxcli builds at most '
                      f'{MAX_UNROLLED_LAYERS:,} unrolled layers (each is traced on its own, so this would not '
                      f'finish):{scan} lower NUM_LAYERS.')
  if seq_len and hasattr(model, 'dummy_batch'):
    per_token = sum(np.asarray(x).nbytes for x in jax.tree.leaves(model.dummy_batch(1, 1)))
    check_sequence(seq_len, per_token, f'The sequence length {seq_len:,} (MAX_SEQ_LEN, or the train input\'s '
                   'seq_len)', 'Lower MAX_SEQ_LEN.')


def check_host_batch(model, rows: int, seq_len: Optional[int]) -> None:
  """UserError when the batch this process reads each step (`rows` sequences of `seq_len` tokens) would take
  more than 1/HOST_SHARE_FOR_ONE_BATCH of the host's memory, before any input is read."""
  if not seq_len or not hasattr(model, 'dummy_batch'):
    return
  per_token = sum(np.asarray(x).nbytes for x in jax.tree.leaves(model.dummy_batch(1, 1)))
  host = platform.host_memory_bytes()
  if host and rows * seq_len * per_token > host // HOST_SHARE_FOR_ONE_BATCH:
    raise UserError(f'The batch this process reads each step ({rows:,} rows of {seq_len:,} tokens) takes '
                    f'{_gib(rows * seq_len * per_token)}, more than 1/{HOST_SHARE_FOR_ONE_BATCH} of this machine\'s '
                    f'{_gib(host)} of memory. Lower PERCORE_BATCH_SIZE (or MAX_SEQ_LEN).')


def check_sequence(seq_len: int, per_token: int, what: str, fix: str) -> None:
  """UserError `what ... fix` when one sequence of `seq_len` tokens of `per_token` bytes each (the dummy
  batch init traces) would take more than 1/HOST_SHARE_FOR_ONE_SEQUENCE of the host's memory."""
  host = platform.host_memory_bytes()
  if host and per_token * seq_len > host // HOST_SHARE_FOR_ONE_SEQUENCE:
    raise UserError(f'{what} cannot be built here: one sequence of the batch the model is traced on takes '
                    f'{_gib(per_token * seq_len)}, more than 1/{HOST_SHARE_FOR_ONE_SEQUENCE} of this machine\'s '
                    f'{_gib(host)} of memory. {fix}')


def check_fits(setup, params_only: bool = False) -> None:
  """UserError before any array of the state is made when the state alone cannot fit: its bytes on
  one device (sharded as the mesh shards it) against what a device holds (platform.device_memory_bytes).
  Commands that only compile (describe, bench --compile-only) never call it."""
  state = {k: v for k, v in setup.abstract_state.items() if not (params_only and k == 'opt_state')}
  leaves = jax.tree.leaves(state)
  per_device = sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)
  limit, source = platform.device_memory_bytes()
  if limit and per_device > limit:
    what = 'parameters' if params_only else 'parameters and optimizer state'
    raise UserError(f'The model\'s {what} alone take {_gib(per_device)} on each device '
                    f'({param_count(setup.abstract_state):,} parameters, sharded over the mesh '
                    f'{sharding.describe_mesh(setup.mesh)}), and a device here holds {_gib(limit)} ({source}). '
                    'Shard the model over more devices (ICI_MESH_SHAPE) or make it smaller; `pax bench mfu '
                    '--compile-only --num-devices N` checks a mesh without allocating it.')


def _gib(n: int) -> str:
  return f'{n / 2**30:,.1f} GiB' if n >= 2**30 / 10 else f'{n / 2**20:,.1f} MiB'


def check_accumulation(train, global_batch: int, mesh) -> int:
  """GRAD_ACCUM_STEPS (task.train.grad_accum_steps), checked against the batch each data-parallel shard
  holds: a UserError, before anything compiles, unless it splits into that many equal microbatches."""
  steps = getattr(train, 'grad_accum_steps', 1)
  per_shard = global_batch // sharding.data_parallel_size(mesh)
  if steps < 1 or per_shard % steps:
    raise UserError(f'GRAD_ACCUM_STEPS={steps} must divide the batch of each data-parallel shard: {per_shard} '
                    f'rows (the global batch {global_batch} over {sharding.data_parallel_size(mesh)} shards of the '
                    f'mesh {sharding.describe_mesh(mesh)}). Choose a divisor of {per_shard}, or change '
                    'PERCORE_BATCH_SIZE.')
  return steps


def plan_pipeline(model, mesh, global_batch: int):
  """The model's pipeline Schedule, checked against the mesh's `stage` axis (None: no pipeline)."""
  schedule = model.pipeline_schedule(global_batch) if hasattr(model, 'pipeline_schedule') else None
  stages = schedule.stages if schedule else 1
  mesh_stages = sharding.num_stages(mesh)
  if stages != mesh_stages:
    raise UserError(f'NUM_STAGES is {stages} but the mesh has {mesh_stages} on its stage axis '
                    f'({sharding.describe_mesh(mesh)}); make the first entry of a four-entry ICI_MESH_SHAPE '
                    '[stage, replica, data, mdl] (times DCN_MESH_SHAPE\'s) equal NUM_STAGES.')
  return schedule


def pipeline_note(resolved) -> Optional[str]:
  """'pipeline: S stages x M microbatches ...: bubble ...' for a pipelined experiment, else None.

  For `pax describe`: the global batch is PERCORE_BATCH_SIZE x the mesh's devices (the
  current devices when the mesh shape has a -1).
  """
  exp = resolved.experiment
  model = build_task(resolved.task).model
  if not hasattr(model, 'pipeline_schedule'):
    return None
  shape = list(exp.ICI_MESH_SHAPE or [1, -1, 1]) + list(exp.DCN_MESH_SHAPE or [])
  if -1 in shape:
    devices = jax.device_count()
  else:
    devices = math.prod(shape)
  try:
    schedule = model.pipeline_schedule(global_batch_size(exp.PERCORE_BATCH_SIZE, devices))
  except UserError as e:
    return f'pipeline: cannot be planned: {e}'
  return f'pipeline: {schedule.describe()}' if schedule else None


def build_task(task_cfg):
  """Builds the Task config; the model is built with layers.base.instantiate (templates stay configs)."""
  task_cfg = copy.copy(task_cfg)
  model_cfg = task_cfg.model
  task_cfg.model = None
  task = fdl.build(task_cfg)
  try:
    task.model = instantiate(model_cfg)
  except TypeError as e:
    raise UserError(f'Building task.model failed: {e}') from None
  return task


def validate_model(model) -> None:
  """Allowed values (paxcli.options) on every layer config of the model, then its own checks."""
  for where, cfg in _layer_configs(model):
    for field, allowed in options.MODEL_FIELDS.items():
      value = getattr(cfg, field, None)
      if value is None or (field == 'fprop_dtype' and not isinstance(value, str)):
        continue
      options.check(field, value, allowed, where)
  if hasattr(model, 'validate'):
    model.validate()


def _layer_configs(model):
  """('task.model...', config or layer) for the model and every config reachable from its fields."""
  out, seen = [], set()

  def walk(where, obj):
    if id(obj) in seen:
      return
    seen.add(id(obj))
    if isinstance(obj, fdl.Buildable):
      out.append((where, obj))
      for name, value in obj.__arguments__.items():
        walk(f'{where}.{name}', value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
      out.append((where, obj))
      for f in dataclasses.fields(obj):
        if f.name not in ('parent', 'name'):
          walk(f'{where}.{f.name}', getattr(obj, f.name, None))

  walk('task.model', model)
  return out


MAX_STEP = 2**31 - 1   # the train state's step is an int32
MAX_SEED = 2**63 - 1
STEP_FIELDS = ('num_train_steps', 'save_interval_steps', 'summary_interval_steps', 'eval_interval_steps',
               'local_checkpoint_interval_steps', 'grad_accum_steps', 'decode_interval_steps')


def validate_train(train) -> None:
  """Settings of task.train that would divide by zero or train nothing."""
  at_least(1, 'task.train', train, 'num_train_steps', 'save_interval_steps', 'summary_interval_steps')
  at_least(0, 'task.train', train, 'eval_interval_steps', 'save_max_to_keep', 'learning_rate',
           'clip_gradient_norm_to_value', 'loss_spike_factor')
  at_least(1, 'task.train', train, 'loss_spike_window', 'router_collapse_steps', 'grad_accum_steps')
  if not 0 < train.router_collapse_fraction <= 1:
    raise UserError(f'task.train.router_collapse_fraction must be in (0, 1], got {train.router_collapse_fraction}.')
  at_least(0, 'task.train', train, 'local_checkpoint_interval_steps')
  at_least(1, 'task.train', train, 'local_checkpoint_max_to_keep')
  if bool(train.local_checkpoint_dir) != bool(train.local_checkpoint_interval_steps):
    given, missing = (('LOCAL_CHECKPOINT_DIR', 'LOCAL_CHECKPOINT_EVERY (steps between fast saves)')
                      if train.local_checkpoint_dir else ('LOCAL_CHECKPOINT_EVERY', 'LOCAL_CHECKPOINT_DIR (a local '
                                                                                    'directory on each host)'))
    raise UserError(f'{given} turns on the fast checkpoint tier, which also needs {missing}.')
  at_least(0, 'task.train.lr_schedule', train.lr_schedule, 'warmup_steps', 'decay_start', 'decay_end',
            'min_ratio')
  for node, prefix, fields in ((train, 'task.train', STEP_FIELDS), (train.lr_schedule, 'task.train.lr_schedule',
                                                                    ('warmup_steps', 'decay_start', 'decay_end'))):
    for field in fields:
      if getattr(node, field, 0) > MAX_STEP:
        raise UserError(f'{prefix}.{field} is {getattr(node, field):,}; paxcli counts steps in a 32-bit integer '
                        f'(the train state\'s step), at most {MAX_STEP:,}.')


def make_init(model, tx, seq_len: int):
  """rng -> boxed train state (params carry logical names); the optimizer state covers the
  trainable params only, and frozen ones are kept in the model's frozen_dtype."""
  def init(rng):
    variables = init_variables(model, rng, seq_len)
    params = cast_frozen(model, variables['params'])
    state = {'step': jnp.zeros([], jnp.int32), 'params': params,
             'opt_state': tx.init(split_trainable(model, unbox(params))[0])}
    if variables.get('non_trainable'):
      state['non_trainable'] = variables['non_trainable']
    if variables.get(FP8_STATE):
      state['fp8'] = variables[FP8_STATE]
    return state

  return init


def init_variables(model, rng, seq_len: int) -> dict:
  """The model's variables from one fprop of its dummy batch: params, non_trainable and fp8 state only."""
  check_buildable(model, seq_len)   # every trace of init comes here: nothing unbounded is built
  batch = jax.tree.map(jnp.asarray, model.dummy_batch(1, seq_len))
  variables = model.init({'params': rng, 'dropout': rng, RANDOM: rng}, batch, method='fprop')
  return {k: v for k, v in variables.items() if k in ('params', NON_TRAINABLE, FP8_STATE)}


def _opt_state_shardings(opt_abstract, params_abstract, param_shardings, mesh):
  """Optimizer leaves shaped like a param (Adam's mu, nu) share its sharding; others replicate.

  A leaf matches the param whose key path ends its own key path (optax nests param-
  shaped trees inside its state tuples), and must have the same shape.
  """
  by_path = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params_abstract)[0]:
    by_path[train_state.keys(path)] = leaf.shape
  shard_by_path = {train_state.keys(p): s for p, s in jax.tree_util.tree_flatten_with_path(param_shardings)[0]}
  replicated = NamedSharding(mesh, PartitionSpec())

  def one(path, leaf):
    keys = train_state.keys(path)
    for start in range(len(keys)):
      suffix = keys[start:]
      if suffix in by_path and by_path[suffix] == leaf.shape:
        return shard_by_path[suffix]
    return replicated

  return jax.tree_util.tree_map_with_path(one, opt_abstract)


def init_state(setup: Setup, seed: int):
  check_fits(setup)
  init = _init_through_scan(setup) or (lambda r: unbox(make_init(setup.model, setup.tx, setup.seq_len)(r)))
  fn = jax.jit(init, out_shardings=setup.state_shardings)
  return fn(jax.random.key(seed))


def _init_through_scan(setup: Setup):
  """For an LM with unrolled layers, an init that builds them with `nn.scan` and unstacks them.

  Initialising N unrolled layers compiles N copies of every initializer (42 s for a
  16-layer 1B model on a GPU, against 4 s scanned); the scanned twin compiles one. The
  values come from the twin's random streams. None when the model has no scanned twin
  whose unstacked variables match the unrolled shapes (the caller then inits directly).
  """
  model = setup.model
  lm = getattr(model, 'lm_tpl', None)
  if lm is None or getattr(lm, 'scan_layers', True) or getattr(lm, 'num_layers', 1) < 2:
    return None
  try:
    twin_lm = copy.deepcopy(lm)
    twin_lm.scan_layers = True
    twin = model.clone(lm_tpl=twin_lm)
  except (TypeError, AttributeError, ValueError):
    return None
  n = lm.num_layers

  def unstack(tree):
    tree = dict(tree)
    stacked = tree.pop('layers', None)
    if stacked is not None:   # [L, ...], or [groups, ...] per position of a patterned stack's group
      tree.update(pattern.unstack(stacked, n, lambda x, row: x[row], pattern.prefix_of(lm)))
    return tree

  def init(rng):
    variables = {k: unstack(unbox(v)) for k, v in init_variables(twin, rng, setup.seq_len).items()}
    params = cast_frozen(model, variables['params'])
    state = {'step': jnp.zeros([], jnp.int32), 'params': params,
             'opt_state': setup.tx.init(split_trainable(model, params)[0])}
    if variables.get('non_trainable'):
      state['non_trainable'] = variables['non_trainable']
    if variables.get(FP8_STATE):
      state['fp8'] = variables[FP8_STATE]
    return state

  try:
    shapes = jax.eval_shape(init, jax.random.key(0))
  except Exception:  # a model whose scanned twin does not build
    return None
  same = jax.tree.structure(shapes) == jax.tree.structure(setup.abstract_state) and all(
      a.shape == b.shape and a.dtype == b.dtype
      for a, b in zip(jax.tree.leaves(shapes), jax.tree.leaves(setup.abstract_state)))
  return init if same else None


def summary(resolved) -> dict:
  """What a run of the resolved experiment needs, without devices: parameters (from the model's
  abstract init), training FLOPs per token (the model's train_flops), the global batch and the devices the mesh
  asks for. A figure that cannot be known is None, with the reason under '<name>_note'."""
  exp = resolved.experiment
  model = validate(resolved).model   # what `pax train` refuses, refused here in the same line
  out: dict = {}
  ici, dcn = exp.ICI_MESH_SHAPE, exp.DCN_MESH_SHAPE
  dcn_size = math.prod(dcn) if dcn is not None else 1
  if ici is None or -1 in list(ici) or (dcn is not None and -1 in list(dcn)):
    fixed = math.prod(abs(x) for x in list(ici or [1]) + list(dcn or [1]))
    out['devices'] = None
    out['devices_note'] = ('any number: the mesh fills its -1 (or, with no ICI_MESH_SHAPE, the data) axis'
                           if fixed == 1 else f'any multiple of {fixed}: the mesh fills its -1 axis')
  else:
    out['devices'] = math.prod(ici) * dcn_size
  seq_len = getattr(resolved.train_dataset(), 'seq_len', None) or getattr(model, 'max_seq_len', None)
  out['seq_len'] = seq_len
  percore = exp.PERCORE_BATCH_SIZE
  out['global_batch'] = None
  if out['devices']:
    out['global_batch'] = global_batch_size(percore, out['devices'])
  else:
    per_device = f' x {seq_len:,} tokens' if seq_len else ''
    out['global_batch_note'] = (f'{percore:g} sequences{per_device} per device (PERCORE_BATCH_SIZE) x the number '
                                'of devices')
  params = jax.eval_shape(lambda rng: init_variables(model, rng, seq_len)['params'], jax.random.key(0))
  out['parameters'] = param_count({'params': unbox(params)})
  active = getattr(model, 'active_parameters', None)
  out['active_parameters'] = active(out['parameters']) if active else None
  per_token = flops.for_model(model, seq_len) if seq_len else None
  out['flops_per_token'] = per_token.per_token if per_token else None
  if per_token is None:
    out['flops_per_token_note'] = flops.unknown_flops(model)
  out.update(family_of(model))
  return out


def family_of(model) -> dict:
  """registry.summary of a language model: {'family': the model family it records (MODEL_FAMILY), or the one
  whose function it computes, or None; 'family_recorded'; 'family_note': why --to hf would refuse it}."""
  if not hasattr(model, 'lm_tpl'):
    return {'family': None, 'family_note': f'{type(model).__name__} is not a language model of a family'}
  return registry.summary(flat_view(model))


def weights_table(setup: Setup) -> list[tuple[str, str, str, str, str]]:
  """(path, shape, dtype, logical axes, mesh sharding) for every weight."""
  rows = []
  flat_logical = {(train_state.keys(p)): v for p, v in jax.tree_util.tree_flatten_with_path(
      setup.logical, is_leaf=lambda x: isinstance(x, tuple))[0]}
  for path, leaf in jax.tree_util.tree_flatten_with_path(setup.abstract_state['params'])[0]:
    keys = train_state.keys(path)
    names = flat_logical.get(keys) or ()
    spec = tuple(leaf.sharding.spec) + (None,) * (len(leaf.shape) - len(leaf.sharding.spec))
    rows.append(('/'.join(map(str, keys)), 'x'.join(map(str, leaf.shape)), str(leaf.dtype),
                 ', '.join(str(n or '-') for n in names),
                 'replicated' if not any(spec) else ', '.join(_axes(a) for a in spec)))
  return rows


def _axes(entry) -> str:
  if entry is None:
    return '-'
  return '+'.join(entry) if isinstance(entry, tuple) else str(entry)


def abstract_params(resolved):
  """Parameter shapes of a resolved experiment via jax.eval_shape: no devices, no memory.

  This is how large recipes are checked on a small machine.
  """
  model = build_task(resolved.task).model
  validate_model(model)
  seq_len = getattr(model, 'max_seq_len', None) or 1
  boxed = jax.eval_shape(lambda r: init_variables(model, r, seq_len)['params'], jax.random.key(0))
  return unbox(boxed)
