"""ckpt/shards/tiling.py: the closed forms equal brute force, and the digest tells
an exact tiling from a hole, a double write and a misplaced box."""

import itertools

import numpy as np
import pytest

from ckpt.shards import plan
from ckpt.shards import tiling


def _brute(shape, start, stop):
  idx = np.arange(int(np.prod(shape)), dtype=object).reshape(shape)
  part = np.asarray(idx[tuple(slice(a, b) for a, b in zip(start, stop))]).ravel()
  return len(part), int(sum(part)), int(sum(i * i for i in part))


def test_box_moments_match_brute_force(rng):
  for _ in range(200):
    rank = int(rng.integers(0, 4))
    shape = tuple(int(d) for d in rng.integers(1, 9, size=rank))
    start = tuple(int(rng.integers(0, d + 1)) for d in shape)
    stop = tuple(int(rng.integers(a, d + 1)) for a, d in zip(start, shape))
    assert tiling.box_moments(shape, start, stop) == _brute(shape, start, stop)


def _tiles(shape, chunk):
  return [(b.start, b.stop) for b in plan.chunk_boxes(
      plan.Box((0,) * len(shape), tuple(shape)), chunk)]


@pytest.mark.parametrize("shape,chunk", [((12, 10), (4, 5)), ((7,), (2,)),
                                         ((4, 6, 3), (2, 3, 1))])
def test_exact_tiling_matches_whole_and_faults_do_not(shape, chunk):
  tiles = _tiles(shape, chunk)
  want = tiling.whole([("a/w", shape), ("b", (3,))])
  ok = [("a/w", shape, a, b) for a, b in tiles] + [("b", (3,), (0,), (3,))]
  assert tiling.digest(ok) == want
  # In any order, split over processes.
  halves = [tiling.digest(ok[::2]), tiling.digest(ok[1::2])]
  assert tiling.combine(halves) == want
  hole = ok[:1] + ok[2:]
  twice = ok + ok[1:2]
  swapped = ok[:1] + [ok[-1]] + ok[1:]  # the hole filled by another leaf's box
  one_for_another = ok[:1] + ok[:1] + ok[2:]  # a box written twice, one missing
  for bad in (hole, twice, one_for_another):
    assert tiling.digest(bad) != want
  assert tiling.digest(swapped) != want or len(tiles) < 2


def test_same_size_box_in_the_wrong_place_is_caught():
  shape = (8, 8)
  tiles = _tiles(shape, (4, 4))
  want = tiling.whole([("w", shape)])
  for i, j in itertools.permutations(range(len(tiles)), 2):
    bad = [("w", shape, a, b) for a, b in tiles]
    bad[i] = bad[j]  # process planned tile j where tile i belonged
    assert tiling.digest(bad) != want, (i, j)
