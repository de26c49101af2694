"""A family's Hugging Face weight map, and the one place it is applied: import (`--from hf`), export
(`--to hf`), certification (transformers' model of a paxcli one) and PEFT export all go through WeightMap.

A map is a list of Weight rows. A row relates one Hugging Face array, or a piece of one, to one paxcli
array, or a piece of one:
  one-to-one    model.layers.0.self_attn.q_proj.weight   params/layer_0/attention/query/kernel
  one-to-many   a fused HF array whose pieces are several paxcli arrays: Phi-3's self_attn.qkv_proj (the
                query's, key's and value's rows, in that order, along axis 0) and mlp.gate_up_proj (wi_0,
                wi_1); transformers 5's experts.gate_up_proj [E, 2F, D] (wi_0, wi_1 along axis 1)
  many-to-one   several HF arrays joined into one paxcli array: expert e's weights are row e of the
                [E, ...] kernel (a piece along axis 0 whose axis is dropped)
A row's shapes are the whole arrays'; its transforms see only its own pieces (to_hf(paxcli piece) -> HF
piece, from_hf(HF piece, paxcli piece's shape) -> paxcli piece), and the map cuts and joins. `fuse` makes
the rows of a fused array out of ordinary ones, so a family writes its map as if the arrays were apart.

Nothing here imports jax: recipes and `pax experiments` read families.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class Piece:
  """Where a row's array sits in a joined one: indices start..stop along `axis`; stop None: the one index
  `start`, its axis dropped (expert e's row of a stacked kernel)."""
  axis: int
  start: int
  stop: Optional[int] = None

  def shape(self, whole: tuple) -> tuple:
    """The piece's shape inside an array of shape `whole`."""
    rest = () if self.stop is None else (self.stop - self.start,)
    return tuple(whole[:self.axis]) + rest + tuple(whole[self.axis + 1:])

  def index(self) -> tuple:
    at = self.start if self.stop is None else slice(self.start, self.stop)
    return (slice(None),) * self.axis + (at,)

  @property
  def end(self) -> int:
    return self.start + 1 if self.stop is None else self.stop


@dataclasses.dataclass(frozen=True)
class Weight:
  """One row of a weight map: names and whole shapes on both sides, the two transforms of the row's pieces
  (to_hf(paxcli piece) -> HF piece; from_hf(HF piece, paxcli piece shape) -> paxcli piece), and where each
  piece sits (None: the whole array)."""
  hf: str
  paxcli: str
  hf_shape: tuple
  paxcli_shape: tuple
  to_hf: Callable
  from_hf: Callable
  hf_piece: Optional[Piece] = None
  paxcli_piece: Optional[Piece] = None

  @property
  def hf_piece_shape(self) -> tuple:
    return self.hf_piece.shape(self.hf_shape) if self.hf_piece else tuple(self.hf_shape)

  @property
  def paxcli_piece_shape(self) -> tuple:
    return self.paxcli_piece.shape(self.paxcli_shape) if self.paxcli_piece else tuple(self.paxcli_shape)


def fuse(hf: str, axis: int, rows: Iterable[Weight]) -> list[Weight]:
  """`rows`, each a whole HF array as if it stood apart, as the pieces of the one HF array `hf`, joined in
  their order along `axis` (Phi-3's q, k and v rows in qkv_proj)."""
  rows = list(rows)
  sizes = [r.hf_shape[axis] for r in rows]
  whole = tuple(rows[0].hf_shape[:axis]) + (sum(sizes),) + tuple(rows[0].hf_shape[axis + 1:])
  out, start = [], 0
  for row, size in zip(rows, sizes):
    out.append(dataclasses.replace(row, hf=hf, hf_shape=whole, hf_piece=Piece(axis, start, start + size)))
    start += size
  return out


def fuse_named(rows: Iterable[Weight], fused: dict[str, tuple[str, ...]], axis: int = 0) -> list[Weight]:
  """`rows` with every group `<prefix><part>` of one entry of `fused` (fused name -> its parts, in order) made
  the pieces of the one HF array `<prefix><fused name>` (fuse), where the group's first row was; the other rows
  as they are. A family whose checkpoints fuse what another keeps apart (Phi-3's qkv_proj, gate_up_proj) is
  that family's map with this applied."""
  rows = list(rows)
  by_name = {r.hf: r for r in rows}
  firsts = {parts[0]: (name, parts) for name, parts in fused.items()}
  taken, out = set(), []
  for row in rows:
    if row.hf in taken:
      continue
    first = next((suffix for suffix in firsts if row.hf.endswith(suffix)), None)
    if first is None:
      out.append(row)
      continue
    name, parts = firsts[first]
    prefix = row.hf[:-len(first)]
    group = [by_name[prefix + part] for part in parts]
    taken.update(r.hf for r in group)
    out += fuse(prefix + name, axis, group)
  return out


def _check_tiles(name: str, rows: list, piece_of, shape_of) -> None:
  """The rows of one array cover it exactly: one whole row, or pieces along one axis without gap or overlap,
  all of one whole shape. A failure is a bug in a family's map (three rows naming one array whole would
  otherwise silently keep one of them)."""
  shapes = {tuple(shape_of(r)) for r in rows}
  assert len(shapes) == 1, f'{name}: rows disagree on its shape: {sorted(shapes)}'
  pieces = [piece_of(r) for r in rows]
  if len(rows) == 1 and pieces[0] is None:
    return
  assert None not in pieces, f'{name}: {len(rows)} rows name it, not all as pieces'
  axes = {p.axis for p in pieces}
  assert len(axes) == 1, f'{name}: pieces along several axes {sorted(axes)}'
  (axis,), (whole,) = axes, shapes
  spans = sorted((p.start, p.end) for p in pieces)
  ends = [0] + [end for _, end in spans]
  assert [start for start, _ in spans] == ends[:-1] and ends[-1] == whole[axis], \
      f'{name}: pieces {spans} do not tile its {whole[axis]} along axis {axis}'


class WeightMap:
  """A family's rows, indexed both ways and checked (_check_tiles); `to_hf` and `from_hf` build one array of
  either side from the arrays of the other."""

  def __init__(self, weights: Iterable[Weight]):
    self.weights = list(weights)
    self.by_hf: dict[str, list[Weight]] = {}
    self.by_paxcli: dict[str, list[Weight]] = {}
    for w in self.weights:
      self.by_hf.setdefault(w.hf, []).append(w)
      self.by_paxcli.setdefault(w.paxcli, []).append(w)
    for name, rows in self.by_hf.items():
      _check_tiles(name, rows, lambda r: r.hf_piece, lambda r: r.hf_shape)
    for name, rows in self.by_paxcli.items():
      _check_tiles(name, rows, lambda r: r.paxcli_piece, lambda r: r.paxcli_shape)
    # A source array several rows read (a fused HF array, a stacked paxcli kernel) is kept between them.
    self._shared = ({n for n, rows in self.by_hf.items() if len(rows) > 1},
                    {n for n, rows in self.by_paxcli.items() if len(rows) > 1})
    self._last: dict[str, np.ndarray] = {}

  @property
  def hf_shapes(self) -> dict[str, tuple]:
    return {name: tuple(rows[0].hf_shape) for name, rows in self.by_hf.items()}

  @property
  def paxcli_shapes(self) -> dict[str, tuple]:
    return {name: tuple(rows[0].paxcli_shape) for name, rows in self.by_paxcli.items()}

  def to_hf(self, name: str, read: Callable[[str], np.ndarray]) -> np.ndarray:
    """HF array `name` from the paxcli arrays it is made of (`read(paxcli name)` gives one whole)."""
    rows = self.by_hf[name]
    parts = [(w.hf_piece, w.to_hf(_cut(self._source(w.paxcli, read, 1), w.paxcli_piece))) for w in rows]
    return _join(parts, rows[0].hf_shape)

  def from_hf(self, name: str, read: Callable[[str], np.ndarray]) -> np.ndarray:
    """paxcli array `name` from the HF arrays it is made of (`read(HF name)` gives one whole)."""
    rows = self.by_paxcli[name]
    parts = [(w.paxcli_piece, w.from_hf(_cut(self._source(w.hf, read, 0), w.hf_piece), w.paxcli_piece_shape))
             for w in rows]
    return _join(parts, rows[0].paxcli_shape)

  def _source(self, name: str, read, side: int) -> np.ndarray:
    if name not in self._shared[side]:
      return read(name)
    if name not in self._last:
      self._last.clear()
      self._last[name] = read(name)
    return self._last[name]


def _cut(x: np.ndarray, piece: Optional[Piece]) -> np.ndarray:
  return x if piece is None else x[piece.index()]


def _join(parts: list, whole: tuple) -> np.ndarray:
  """One array of shape `whole` from (piece, value) pairs (a single whole value as it is)."""
  if len(parts) == 1 and parts[0][0] is None:
    return parts[0][1]
  out = np.empty(whole, np.asarray(parts[0][1]).dtype)
  for piece, value in parts:
    out[piece.index()] = value
  return out
