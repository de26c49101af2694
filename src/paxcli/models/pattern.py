"""Layer patterns: a stack of NUM_LAYERS layers as groups of LAYER_PATTERN's kinds, and where each
layer's weights live.

A pattern is a tuple of kind names, the layers of one group in order: ('local', 'global') alternates
two kinds, ('local',) * 5 + ('global',) is five local layers then one global. The stack is
NUM_LAYERS / len(pattern) groups, scanned group by group and cut into pipeline stages by groups. A
LAYER_PREFIX names the kinds of the first layers, before the groups (DeepSeek-V3's three dense layers
before its mixture-of-experts ones): ('dense',) * 3 with the pattern () makes layers 0-2 the dense kind and
the rest the plain layer; NUM_LAYERS counts them, and NUM_LAYERS minus the prefix is a multiple of the
pattern's length.
Each kind is a block template: the LM's block_tpl with the kind's field overrides (LAYER_KINDS:
knob values per kind, turned into block fields by paxcli.models.knobs.kind_fields). The kinds are
where families differ layer by layer: attention windows, rotary bases, QK-norm, post-norms, an
MoE feed-forward are each a field (or a swapped template) of one kind.

Layouts (names under params/, and the same under every other collection):
  unscanned                 layer_<i>/...                 every layer by its index, whatever its kind
  scanned, one kind         layers/...          [L, ...]  (the uniform stack, as before patterns)
  scanned, P kinds          layers/block_<j>/... [G, ...] position j of every group: layer i is
                                                          block_<i % P> at row i // P
  a prefix of N layers      layer_<i>/...                 the first N layers by their index in either
                                                          layout; the scanned stack holds the rest, its
                                                          rows counted from layer N

No jax or flax here: converters and the LoRA exporter read layouts with it.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any, Callable, Optional

from paxcli.errors import UserError
from paxcli.models.knobs import settable

_BLOCK = re.compile(r'^block_(\d+)$')


def period(pattern) -> int:
  """Layers per group: the pattern's length, 1 for no pattern (a uniform stack)."""
  return max(len(pattern or ()), 1)


def prefix_of(lm) -> int:
  """How many layers a TransformerLm (config, layer or flat view) has before its repeating groups (LAYER_PREFIX)."""
  return len(getattr(lm, 'layer_prefix', None) or ())


def kinds_in_order(pattern, kinds) -> list[tuple[str, tuple]]:
  """[(kind, field overrides)] for each position of one group (one entry for no pattern: no overrides)."""
  own = dict(kinds or ())
  return [(kind, tuple(own.get(kind, ()))) for kind in pattern] if pattern else [('', ())]


def prefix_kinds(prefix, kinds) -> list[tuple[str, tuple]]:
  """[(kind, field overrides)] of each layer of the prefix, in order."""
  own = dict(kinds or ())
  return [(kind, tuple(own.get(kind, ()))) for kind in prefix or ()]


def kind_template(block_tpl, overrides):
  """A copy of block_tpl with a kind's overrides ((dotted field below the block, value), ...) set."""
  tpl = block_tpl.clone() if hasattr(block_tpl, 'clone') else copy.deepcopy(block_tpl)
  for path, value in overrides:
    *parents, name = path.split('.')
    node = tpl
    for part in parents:
      node = getattr(node, part)
    setattr(node, name, settable(value))
  return tpl


def check(num_layers: int, pattern, prefix=()) -> None:
  """One line for a pattern (and prefix) the stack cannot take."""
  if any(not isinstance(k, str) or not k for k in tuple(pattern or ()) + tuple(prefix or ())):
    raise UserError(f'LAYER_PATTERN {tuple(pattern or ())} and LAYER_PREFIX {tuple(prefix or ())} must name each '
                    'kind with a non-empty string.')
  if prefix and num_layers <= len(prefix):
    raise UserError(f'NUM_LAYERS {num_layers} must be more than the {len(prefix)} layers of LAYER_PREFIX '
                    f'{tuple(prefix)}: the layers after it repeat LAYER_PATTERN.')
  if (num_layers - len(prefix or ())) % period(pattern):
    after = f' after the {len(prefix)} of LAYER_PREFIX' if prefix else ''
    raise UserError(f'NUM_LAYERS {num_layers} is not a multiple of the {period(pattern)} kinds of LAYER_PATTERN '
                    f'{tuple(pattern)}{after}: the stack repeats whole groups.')


def stacked_path(i: int, rest: str, pattern_period: int, prefix: int = 0) -> tuple[str, Optional[int]]:
  """Where layer i's `rest` (a name below the layer) lives in the scanned layout, and its row; a layer of the
  prefix (i < `prefix`, LAYER_PREFIX's length) is never stacked: its own name, and None."""
  if i < prefix:
    return (f'layer_{i}/{rest}' if rest else f'layer_{i}'), None
  i -= prefix
  if pattern_period == 1:
    return f'layers/{rest}' if rest else 'layers', i
  prefix_path = f'layers/block_{i % pattern_period}'
  return (f'{prefix_path}/{rest}' if rest else prefix_path), i // pattern_period


def period_of(layers_tree: dict) -> int:
  """The period of a scanned stack from its tree under `layers`: its block_<j> count, 1 for a uniform one."""
  names = list(layers_tree)
  return len(names) if names and all(_BLOCK.match(str(n)) for n in names) else 1


def unstack(layers_tree: dict, num_layers: int, take: Callable[[Any, int], Any], prefix: int = 0) -> dict:
  """{'layer_<i>': layer i's subtree} from a scanned stack's tree under `layers` (either layout), for the layers
  after a prefix of `prefix` (theirs are not in it); take(leaf, row) reads one row of a stacked leaf."""
  p = period_of(layers_tree)
  out = {}
  for i in range(num_layers - prefix):
    tree = layers_tree if p == 1 else layers_tree[f'block_{i % p}']
    out[f'layer_{prefix + i}'] = _map(tree, lambda x, row=i // p: take(x, row))
  return out


def per_layer(tree: dict, pattern_period: int = 1, prefix: int = 0) -> dict:
  """A collection's tree (summaries, aux losses) with a scanned stack's `layers` entry, whose leaves hold one
  row per layer or group, spread into `layer_<i>` entries of one value each: reported alike, scanned or not.
  pattern_period: the model's layers per group (a group's kinds without entries here are simply absent);
  prefix: the layers before the stack (LAYER_PREFIX), whose entries are already `layer_<i>`."""
  if not isinstance(tree, Mapping) or not isinstance(tree.get('layers'), Mapping):
    return tree
  stacked = tree['layers']
  leaves = _leaves(stacked)
  if not leaves or any(getattr(x, 'ndim', 0) != 1 for x in leaves):
    return tree
  out = {k: v for k, v in tree.items() if k != 'layers'}
  grouped = pattern_period > 1 and all(_BLOCK.match(str(n)) for n in stacked)
  blocks = {int(_BLOCK.match(str(n)).group(1)): sub for n, sub in stacked.items()} if grouped else {0: stacked}
  step = pattern_period if grouped else 1
  for j, sub in blocks.items():   # group `row`, position j: layer prefix + row x period + j (as `unstack`)
    for row in range(_leaves(sub)[0].shape[0]):
      out[f'layer_{prefix + row * step + j}'] = _map(sub, lambda x, row=row: x[row])
  return out


def _leaves(tree) -> list:
  return [x for v in tree.values() for x in _leaves(v)] if isinstance(tree, Mapping) else [tree]


def _map(tree, fn):
  return {k: _map(v, fn) for k, v in tree.items()} if isinstance(tree, Mapping) else fn(tree)
