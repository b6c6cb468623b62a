"""A check, before the commit, that the processes' writes tile every array.

Each process plans its own writes (ckpt/shards/plan.py); nothing global says who
writes what. If processes planned differently (hosts running different ckpt
versions, a bug, a host whose view of the mesh differs), a chunk could be
written by nobody, and the step would commit with a hole that a restore
finds only when it reads there. So every process sends a digest of the
boxes it wrote, three numbers, and process 0 compares their sum with the
digest of every array tiled exactly once, computed from the index alone.

The digest of a box of a leaf is ``w * (count, sum of linear indices, sum
of squared linear indices)`` of its elements (C order), modulo the prime
2^61 - 1, where ``w`` is derived from the leaf's relative path. Each part
is a closed form in the box's corners (O(rank^2), never per element), so a
process pays O(its writes) and process 0 O(leaves + processes). A hole, an
element written twice, or a box written at the wrong place changes it
unless the errors cancel in all three sums at once for every leaf weight.
"""

from __future__ import annotations

import functools
import math
from typing import Iterable, Sequence

import crc32c

MOD = (1 << 61) - 1
Digest = tuple[int, int, int]


def _sum(a: int, b: int) -> int:
  """sum(range(a, b))"""
  return (a + b - 1) * (b - a) // 2


def _sum_squares(a: int, b: int) -> int:
  """sum(i * i for i in range(a, b))"""
  f = lambda x: (x - 1) * x * (2 * x - 1) // 6
  return f(b) - f(a)


def box_moments(shape: Sequence[int], start: Sequence[int],
                stop: Sequence[int]) -> Digest:
  """(count, sum of linear indices, sum of their squares) of the elements
  of the box ``[start, stop)`` of an array of ``shape``, exactly; worked
  out once per distinct (shape, box): the leaves of a model repeat a few
  shapes and shardings, and a save of 10,000 small leaves spent most of
  its digest here."""
  return _moments(tuple(map(int, shape)), tuple(map(int, start)),
                  tuple(map(int, stop)))


@functools.lru_cache(maxsize=1 << 14)
def _moments(shape: Sequence[int], start: Sequence[int],
             stop: Sequence[int]) -> Digest:
  rank = len(shape)
  strides = [math.prod(shape[d + 1:]) for d in range(rank)]
  n = [b - a for a, b in zip(start, stop)]
  count = math.prod(n)
  if count == 0:
    return 0, 0, 0
  sums = [_sum(a, b) for a, b in zip(start, stop)]
  squares = [_sum_squares(a, b) for a, b in zip(start, stop)]
  s1 = sum(strides[d] * sums[d] * (count // n[d]) for d in range(rank))
  s2 = sum(strides[d] ** 2 * squares[d] * (count // n[d]) for d in range(rank))
  for d in range(rank):
    for e in range(d + 1, rank):
      s2 += (2 * strides[d] * strides[e] * sums[d] * sums[e]
             * (count // (n[d] * n[e])))
  return count, s1, s2


def weight(relpath: str) -> int:
  return crc32c.crc32c(relpath.encode()) + 1


def digest(boxes: Iterable[tuple[str, Sequence[int], Sequence[int],
                                 Sequence[int]]]) -> Digest:
  """The digest of ``(relpath, shape, start, stop)`` boxes."""
  return weighted((weight(relpath), shape, start, stop)
                  for relpath, shape, start, stop in boxes)


def weighted(boxes: Iterable[tuple[int, Sequence[int], Sequence[int],
                                   Sequence[int]]]) -> Digest:
  """``digest`` of boxes given with their leaf's ``weight`` (worked out
  once per leaf, not once per box). The moments of each distinct (shape,
  start, stop) are looked up once per call."""
  c = s1 = s2 = 0
  seen: dict[tuple, Digest] = {}
  for w, shape, start, stop in boxes:
    key = (shape, start, stop)
    got = seen.get(key)
    if got is None:
      got = seen[key] = box_moments(shape, start, stop)
    a, b, q = got
    c, s1, s2 = c + w * a, s1 + w * b, s2 + w * q
  return c % MOD, s1 % MOD, s2 % MOD


def combine(digests: Iterable[Sequence[int]]) -> Digest:
  c = s1 = s2 = 0
  for a, b, q in digests:
    c, s1, s2 = c + a, s1 + b, s2 + q
  return c % MOD, s1 % MOD, s2 % MOD


def whole(arrays: Iterable[tuple[str, Sequence[int]]]) -> Digest:
  """The digest of every array ``(relpath, shape)`` tiled exactly once."""
  return whole_weighted((weight(relpath), shape) for relpath, shape in arrays)


def whole_weighted(arrays: Iterable[tuple[int, Sequence[int]]]) -> Digest:
  """``whole`` of arrays given with their ``weight``."""
  return weighted((w, shape, (0,) * len(shape), shape) for w, shape in arrays)
