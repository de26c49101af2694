"""BaseLayer: Pax's layer verbs on flax.linen.

A layer is a flax module with hyperparameter fields (all with defaults), child layers
declared with `instance_field`, and layer templates (fiddle configs) declared with
`template_field`. `setup()` declares weights with `create_variable` and children with
`create_child` / `create_children`; `__call__` reads `self.theta.<name>` (trainable) and
`self.get_var(name)` (non-trainable), updates non-trainable weights with `update_var`,
draws randomness with `next_prng_key()` and reports with `add_summary` / `add_aux_loss`.

Variable collections (as in praxis):
  params          trainable weights (the optimizer updates them)
  non_trainable   weights a layer updates itself (moving averages); the train loop keeps
                  them in the train state and checkpoints them
  summaries       scalars for TensorBoard and train_metrics.jsonl
  aux_loss        terms added to the training loss and reported one by one
Random streams: `params` for initialisation, `random` for next_prng_key (and `dropout`
for flax's Dropout); the train step derives both from the seed and the step.

Templates and sharing follow fiddle: a template is a recipe (each `create_child` makes a
new layer from it); a config object used in two places of an instance field (or twice
inside one template) is built once, so both places hold the same layer and one set of
weights. Build a layer config with `instantiate(config)`, not `fdl.build`: it keeps
template fields as configs.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import weakref
from typing import Any, Callable, Optional, Sequence

import fiddle as fdl
import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

PARAMS = 'params'
NON_TRAINABLE = 'non_trainable'
SUMMARIES = 'summaries'
AUX_LOSS = 'aux_loss'
RANDOM = 'random'
# A collection tag (WeightHParams.collections): the train loop keeps this non-trainable
# variable equal on every data-parallel replica, the mean of what they computed.
REQUIRES_MEAN_SYNC = 'requires_mean_sync'


class WeightHParamsCollection:
  """praxis spelling: base_layer.WeightHParamsCollection.REQUIRES_MEAN_SYNC."""
  REQUIRES_MEAN_SYNC = REQUIRES_MEAN_SYNC


class Config(fdl.Config):
  """A fiddle Config with praxis's `clone()` and chainable `set(**fields)`."""

  def clone(self) -> 'Config':
    return copy.deepcopy(self)

  def set(self, **fields) -> 'Config':
    for name, value in fields.items():
      setattr(self, name, value)
    return self


LayerTpl = Config


def _as_config(value):
  """A plain fdl.Config template gets clone()/set() too (same arguments, same callable)."""
  if isinstance(value, fdl.Config) and not isinstance(value, Config):
    out = Config(fdl.get_callable(value))
    for name, arg in value.__arguments__.items():
      setattr(out, name, arg)
    return out
  return value


# ---- weight initialisation ------------------------------------------------------------

def _constructor(method: str, default_scale: float = 1.0) -> staticmethod:
  """A praxis-style named constructor, `WeightInit.<Name>(scale)`, for one method."""

  def make(scale: float = default_scale) -> 'WeightInit':
    return WeightInit(method, scale)

  make.__doc__ = f'WeightInit({method!r}, scale); scale defaults to {default_scale:g}.'
  return staticmethod(make)


@dataclasses.dataclass(frozen=True)
class WeightInit:
  """How a weight starts: method and scale. Build with the class methods (praxis names)."""
  method: str = 'xavier'
  scale: float = 1.0

  # praxis' constructors: WeightInit.Gaussian(0.02), WeightInit.Constant(), ...
  Gaussian = _constructor('gaussian')
  Uniform = _constructor('uniform')
  Constant = _constructor('constant', 0.0)
  Xavier = _constructor('xavier')
  GaussianSqrtFanIn = _constructor('gaussian_sqrt_fanin')
  # Our Transformer's projections: truncated normal with variance scale / fan_in.
  TruncatedGaussianSqrtFanIn = _constructor('truncated_gaussian_sqrt_fanin')

  def initializer(self, fan_in_axes: Optional[Sequence[int]] = None) -> Callable:
    """A flax initializer (key, shape, dtype) -> array."""
    m, s = self.method, self.scale
    if m == 'gaussian':
      return nn.initializers.normal(s)
    if m == 'uniform':
      return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -s, s)
    if m == 'constant':
      return lambda key, shape, dtype=jnp.float32: jnp.full(shape, s, dtype)
    if m == 'xavier':
      def xavier(key, shape, dtype=jnp.float32):
        fan_in, fan_out = _fans(shape, fan_in_axes)
        limit = s * math.sqrt(6.0 / (fan_in + fan_out))
        return jax.random.uniform(key, shape, dtype, -limit, limit)
      return xavier
    if m in ('gaussian_sqrt_fanin', 'truncated_gaussian_sqrt_fanin'):
      def fan_in_scaled(key, shape, dtype=jnp.float32):
        fan_in, _ = _fans(shape, fan_in_axes)
        std = s / math.sqrt(fan_in)
        if m == 'gaussian_sqrt_fanin':
          return std * jax.random.normal(key, shape, dtype)
        # The same distribution as variance_scaling(scale**2, 'fan_in', 'truncated_normal').
        return nn.initializers.variance_scaling(s * s, 'fan_in', 'truncated_normal',
                                                in_axis=tuple(fan_in_axes) if fan_in_axes else -2,
                                                out_axis=-1)(key, shape, dtype)
      return fan_in_scaled
    raise ValueError(f'Unknown WeightInit method {m!r}.')


def _fans(shape, fan_in_axes) -> tuple[int, int]:
  """(fan_in, fan_out): by default all axes but the last are the input, as in a matmul."""
  if len(shape) == 0:
    return 1, 1
  if len(shape) == 1:
    return shape[0], shape[0]
  axes = tuple(fan_in_axes) if fan_in_axes else tuple(range(len(shape) - 1))
  fan_in = math.prod(shape[a] for a in axes)
  fan_out = math.prod(d for i, d in enumerate(shape) if i not in {a % len(shape) for a in axes})
  return fan_in, fan_out


@dataclasses.dataclass
class WeightHParams:
  """A weight's declaration: shape, init, dtype, collections and logical axis names.

  `tensor_split_dims_mapping` holds logical axis names (e.g. ('embed', 'mlp')), mapped
  onto the mesh by paxcli.runtime.sharding's rules; None leaves the weight replicated.
  """
  shape: Sequence[int] = ()
  init: Optional[WeightInit] = None
  dtype: Any = None
  collections: Sequence[str] = ()
  tensor_split_dims_mapping: Optional[Sequence[Optional[str]]] = None
  fan_in_axes: Optional[Sequence[int]] = None


@flax.struct.dataclass
class SyncedVar(nn.LogicallyPartitioned):
  """A boxed non-trainable variable that carries its REQUIRES_MEAN_SYNC tag."""
  mean_sync: bool = flax.struct.field(pytree_node=False, default=False)


# ---- fields and instantiation -----------------------------------------------------------

def template_field(factory: Optional[Callable] = None):
  """A layer template: a fiddle Config of `factory`, to be built by `create_child`."""
  return dataclasses.field(default_factory=lambda: Config(factory) if factory is not None else None,
                           metadata={'paxcli_template': True})


def instance_field(factory: Callable):
  """A child layer (or other object) built from `factory` when the parent is made."""

  def make():
    if isinstance(factory, type) and issubclass(factory, nn.Module):
      return factory(parent=None)
    return factory()

  return dataclasses.field(default_factory=make)


def _template_names(fn) -> frozenset:
  if not dataclasses.is_dataclass(fn):
    return frozenset()
  return frozenset(f.name for f in dataclasses.fields(fn) if f.metadata.get('paxcli_template'))


def instantiate(config, memo: Optional[dict] = None):
  """Builds a layer (or any object) from a fiddle config; template fields stay configs.

  A config object that appears several times is built once (fiddle's sharing), so two
  instance fields given the same child config hold one layer with one set of weights.
  """
  memo = {} if memo is None else memo
  key = id(config)
  if key in memo:
    return memo[key][1]
  if isinstance(config, fdl.Buildable):
    fn = fdl.get_callable(config)
    templates = _template_names(fn)
    kwargs = {name: (value if name in templates else instantiate(value, memo))
              for name, value in config.__arguments__.items()}
    if isinstance(config, fdl.Partial):
      out = functools.partial(fn, **kwargs)
    elif isinstance(fn, type) and issubclass(fn, nn.Module):
      out = fn(**kwargs, parent=kwargs.pop('parent', None))
    else:
      out = fn(**kwargs)
  elif isinstance(config, (list, tuple)):
    out = type(config)(instantiate(v, memo) for v in config)
  elif isinstance(config, dict):
    out = {k: instantiate(v, memo) for k, v in config.items()}
  else:
    return config
  memo[key] = (config, out)  # keeps the config alive so that its id stays unique
  return out


_MEMOS: 'weakref.WeakKeyDictionary' = weakref.WeakKeyDictionary()


def _root_memo(module: Optional[nn.Module]) -> dict:
  """One instantiate memo per flax root scope, so sharing holds across the whole model."""
  scope = getattr(module, 'scope', None) if module is not None else None
  if scope is None:
    return {}
  return _MEMOS.setdefault(scope.root, {})


def build_arguments(config, module: nn.Module) -> dict:
  """The constructor arguments of a layer config, built (template fields stay configs).

  For making a child of `module` inline in an `@nn.compact` method:
  `cls(**build_arguments(tpl, self), name=...)`.
  """
  memo = _root_memo(module)
  templates = _template_names(fdl.get_callable(config))
  return {name: (value if name in templates else instantiate(value, memo))
          for name, value in config.__arguments__.items()}


class _Theta:
  """`self.theta.<name>`: a layer's trainable weights by attribute."""

  def __init__(self, values: dict):
    self.__dict__.update(values)

  def __getitem__(self, name):
    return self.__dict__[name]


# ---- the layer ---------------------------------------------------------------------------

class BaseLayer(nn.Module):
  """Pax's BaseLayer on flax.linen (see the module docstring)."""
  dtype: Any = jnp.float32                # weights
  fprop_dtype: Any = None                 # activations; None: same as dtype
  params_init: WeightInit = dataclasses.field(default_factory=WeightInit.Xavier)

  def __post_init__(self):
    for name in _template_names(type(self)):
      object.__setattr__(self, name, _as_config(getattr(self, name)))
    super().__post_init__()

  # -- variables --

  def create_variable(self, name: str, var_hparams: WeightHParams, trainable: bool = True):
    """Declares a weight in setup(); trainable ones appear as self.theta.<name>."""
    hp = var_hparams
    dtype = hp.dtype or self.dtype
    init = (hp.init or self.params_init).initializer(hp.fan_in_axes)
    shape = tuple(int(d) for d in hp.shape)
    names = tuple(hp.tensor_split_dims_mapping) if hp.tensor_split_dims_mapping is not None else (None,) * len(shape)
    if len(names) != len(shape):
      raise ValueError(f'{name}: tensor_split_dims_mapping {names} does not match shape {shape}.')
    theta = self.__dict__.setdefault('_paxcli_theta', {})
    if trainable:
      theta[name] = self.param(name, nn.with_logical_partitioning(init, names), shape, dtype)
      return theta[name]
    mean_sync = REQUIRES_MEAN_SYNC in tuple(hp.collections or ())

    def make():
      return SyncedVar(init(self.make_rng(PARAMS), shape, dtype), names, mean_sync=mean_sync)

    var = self.variable(NON_TRAINABLE, name, make)
    self.__dict__.setdefault('_paxcli_vars', {})[name] = var
    return var

  @property
  def theta(self) -> _Theta:
    self._try_setup()
    return _Theta(self.__dict__.get('_paxcli_theta', {}))

  def _var(self, name: str):
    self._try_setup()
    variables = self.__dict__.get('_paxcli_vars', {})
    if name not in variables:
      raise KeyError(f'{type(self).__name__} has no non-trainable variable {name!r} '
                     f'(it has {sorted(variables)}); declare it with create_variable(..., trainable=False).')
    return variables[name]

  def get_var(self, name: str):
    """The current value of a non-trainable variable."""
    return nn.meta.unbox(self._var(name).value)

  def update_var(self, name: str, value) -> None:
    """Sets a non-trainable variable; a no-op where the collection is not mutable (eval)."""
    var = self._var(name)
    if self.is_initializing() or not self.is_mutable_collection(NON_TRAINABLE):
      return  # init returns the declared initial values
    boxed = var.value
    var.value = boxed.replace_boxed(value) if isinstance(boxed, nn.meta.AxisMetadata) else value

  # -- children --

  def create_child(self, name: str, params: Any) -> nn.Module:
    """Creates child layer `self.<name>` from a template (a fiddle config) in setup()."""
    if isinstance(params, fdl.Buildable):
      memo = _root_memo(self)
      params = copy.copy(params)  # the template itself is a recipe: each call makes a new layer
      child = instantiate(params, memo)
    else:
      child = params
    setattr(self, name, child)
    return getattr(self, name)

  def create_children(self, name: str, params: Sequence[Any]) -> Sequence[nn.Module]:
    """Creates a list of child layers `self.<name>[i]` from a list of templates."""
    memo = _root_memo(self)
    children = [instantiate(copy.copy(p), memo) if isinstance(p, fdl.Buildable) else p for p in params]
    setattr(self, name, children)
    return getattr(self, name)

  # -- randomness, summaries, aux losses --

  def next_prng_key(self):
    """A new key on every call (and every train step), from the `random` stream."""
    return self.make_rng(RANDOM)

  def add_summary(self, name: str, value) -> None:
    """A scalar for TensorBoard and train_metrics.jsonl (at summary steps)."""
    self.sow(SUMMARIES, name, jnp.asarray(value, jnp.float32), init_fn=lambda: jnp.zeros([], jnp.float32),
             reduce_fn=lambda _, new: new)

  def add_aux_loss(self, name: str, value, weight: float = 1.0) -> None:
    """A term added to the training loss (weight x value), reported by its own name too."""
    term = jnp.asarray(value, jnp.float32) * weight
    self.sow(AUX_LOSS, name, term, init_fn=lambda: jnp.zeros([], jnp.float32),
             reduce_fn=lambda prev, new: prev + new)

  @property
  def hparams(self):
    """praxis spelling: `self.hparams.has_bias` is `self.has_bias`."""
    return self


def flatten_collection(tree, sep: str = '/') -> dict[str, Any]:
  """{'a': {'b': x}} -> {'a/b': x}; the names summaries and aux losses are reported under."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    keys = [getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k))) for k in path]
    out[sep.join(str(k) for k in keys)] = leaf
  return out


def mean_sync_mask(boxed_non_trainable):
  """True for every non-trainable leaf tagged REQUIRES_MEAN_SYNC (from a boxed tree)."""
  return jax.tree.map(lambda v: bool(getattr(v, 'mean_sync', False)), boxed_non_trainable,
                      is_leaf=lambda v: isinstance(v, nn.meta.AxisMetadata))
