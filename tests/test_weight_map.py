"""The weight map (paxcli.models.weight_map) that import, export, certification and PEFT export all apply:
one-to-one rows, one HF array fused from several paxcli ones (fuse, fuse_named), several HF arrays joined into
one paxcli array (stacked experts); both ways, and a map whose rows do not tile an array refused where it is
made (three rows naming one array whole used to keep one of them silently)."""

import numpy as np
import pytest

from paxcli.models import hf_config
from paxcli.models.weight_map import Piece, Weight, WeightMap, fuse, fuse_named

D, Q, KV, F, EXPERTS = 4, 6, 2, 5, 3


def _linear(hf: str, paxcli: str, out: int) -> Weight:
  return Weight(hf, paxcli, (out, D), (D, out), *hf_config.linear(D))


def _apart() -> list:
  return [_linear('l.q_proj.weight', 'p/query', Q), _linear('l.k_proj.weight', 'p/key', KV),
          _linear('l.v_proj.weight', 'p/value', KV), _linear('l.o_proj.weight', 'p/out', D)]


def _arrays(shapes: dict, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  return {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}


def test_a_fused_array_is_its_pieces_joined_both_ways():
  apart = WeightMap(_apart())
  fused = WeightMap(fuse_named(_apart(), {'qkv_proj.weight': ('q_proj.weight', 'k_proj.weight', 'v_proj.weight')}))
  assert fused.hf_shapes == {'l.qkv_proj.weight': (Q + 2 * KV, D), 'l.o_proj.weight': (D, D)}
  assert fused.paxcli_shapes == apart.paxcli_shapes
  ours = _arrays(apart.paxcli_shapes)
  qkv = fused.to_hf('l.qkv_proj.weight', ours.__getitem__)
  np.testing.assert_array_equal(qkv, np.concatenate([apart.to_hf(f'l.{p}_proj.weight', ours.__getitem__)
                                                     for p in 'qkv']))
  back = {name: fused.from_hf(name, {'l.qkv_proj.weight': qkv, 'l.o_proj.weight': ours['p/out'].T}.__getitem__)
          for name in fused.paxcli_shapes}
  for name, x in ours.items():
    np.testing.assert_array_equal(back[name], x)


def test_stacked_experts_are_one_paxcli_array_both_ways():
  rows = [Weight(f'e.{e}.w', 'p/wi', (F, D), (EXPERTS, D, F), lambda x: x.T, lambda w, shape: w.T,
                 paxcli_piece=Piece(0, e)) for e in range(EXPERTS)]
  wmap = WeightMap(rows)
  kernel = _arrays({'p/wi': (EXPERTS, D, F)})['p/wi']
  reads = []
  theirs = {name: wmap.to_hf(name, lambda n: reads.append(n) or kernel) for name in wmap.hf_shapes}
  assert reads == ['p/wi']   # read once for all its rows
  np.testing.assert_array_equal(theirs['e.1.w'], kernel[1].T)
  np.testing.assert_array_equal(wmap.from_hf('p/wi', theirs.__getitem__), kernel)


@pytest.mark.parametrize('rows, says', [
    ([_linear('l.qkv.weight', 'p/query', Q), _linear('l.qkv.weight', 'p/key', Q)], 'not all as pieces'),
    (fuse('l.qkv.weight', 0, _apart()[:3])[:2], 'do not tile'),
    ([Weight('e.0', 'p/wi', (F, D), (2, D, F), *hf_config.SAME, paxcli_piece=Piece(0, 0)),
      Weight('e.0b', 'p/wi', (F, D), (2, D, F), *hf_config.SAME, paxcli_piece=Piece(0, 0))], 'do not tile'),
    ([Weight('a', 'p/x', (2, D), (D, 2), *hf_config.SAME, hf_piece=Piece(0, 0, 2)),
      Weight('a', 'p/y', (3, D), (D, 3), *hf_config.SAME, hf_piece=Piece(0, 2, 5))], 'disagree on its shape'),
])
def test_rows_that_do_not_tile_an_array_are_refused_where_the_map_is_made(rows, says):
  with pytest.raises(AssertionError, match=says):
    WeightMap(rows)
