"""Packed leaves whose stored pieces are exactly the boxes a restore places
(the same sharding as saved: the usual restore), found for a whole group of
leaves that share those boxes with a few numpy passes over the pack tables,
and the byte ranges a restore reads, merged in numpy.

10,000 small leaves restored as saved made a ``Piece`` and a checked cover
per box, one at a time in Python: more CPU than their bytes' checksums and
copies. A leaf found here is read by table row (``PackSet.row_bytes``: its
crc32c checked as every piece's is); a leaf that is not (another sharding,
a piece missing, split or extra) takes the general path, whose checks name
it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ckpt.format import pack_table
from ckpt.shards.plan import Box


def exact_rows(table: pack_table.Table, bounds: tuple[np.ndarray, np.ndarray],
               leaves: np.ndarray, boxes: Sequence[Box], rank: int
               ) -> tuple[np.ndarray, np.ndarray]:
  """(the leaves among ``leaves`` whose stored pieces are ``boxes``, each
  box exactly one piece and no other piece; their rows in the tables, one
  per box in ``boxes``' order: shape (leaves, len(boxes))). ``boxes`` are
  distinct and disjoint (a sharding's), of rank ``rank``; ``bounds`` are
  each leaf's [lo, hi) rows (PackSet's)."""
  k = len(boxes)
  lo, hi = bounds
  if not k or not len(leaves):
    return leaves[:0], np.zeros((0, k), np.int64)
  leaves = leaves[(hi[leaves] - lo[leaves]) == k]  # as many pieces as boxes
  rows = lo[leaves][:, None] + np.arange(k)[None, :]  # (m, k)
  want_lo = np.asarray([b.start for b in boxes], np.int64).reshape(k, rank)
  want_hi = np.asarray([b.stop for b in boxes], np.int64).reshape(k, rank)
  got_lo = table.start[rows, :rank][:, :, None, :]  # (m, piece, 1, rank)
  got_hi = table.stop[rows, :rank][:, :, None, :]
  match = ((got_lo == want_lo) & (got_hi == want_hi)).all(axis=3)  # (m, i, j)
  # Every piece is one of the boxes and every box one of the pieces: the
  # boxes being disjoint, each is covered exactly once, by its piece.
  ok = ((match.sum(axis=1) == 1).all(axis=1) &
        (match.sum(axis=2) == 1).all(axis=1))
  order = match.argmax(axis=1)  # (m, box): the piece that is the box
  return leaves[ok], np.take_along_axis(rows, order, axis=1)[ok]


def merged_ranges(process: np.ndarray, pack: np.ndarray, start: np.ndarray,
                  stop: np.ndarray, gap: int
                  ) -> dict[tuple[int, int], list[list[int]]]:
  """(process, pack) -> the sorted byte ranges [start, stop) of its pieces
  read, those closer than ``gap`` merged."""
  if not len(start):
    return {}
  order = np.lexsort((start, pack, process))
  process, pack = process[order], pack[order]
  start, stop = start[order], stop[order]
  new_pack = np.ones(len(start), bool)
  new_pack[1:] = (process[1:] != process[:-1]) | (pack[1:] != pack[:-1])
  reach = _running_max(stop, new_pack)  # the furthest end so far, per pack
  begins = new_pack.copy()
  begins[1:] |= (start[1:] - reach[:-1]) > gap
  firsts = np.flatnonzero(begins)
  ends = np.append(firsts[1:], len(start)) - 1
  out: dict[tuple[int, int], list[list[int]]] = {}
  for p, k, a, b in zip(process[firsts].tolist(), pack[firsts].tolist(),
                        start[firsts].tolist(), reach[ends].tolist()):
    out.setdefault((p, k), []).append([a, b])
  return out


def _running_max(x: np.ndarray, restart: np.ndarray) -> np.ndarray:
  """The running maximum of ``x``, restarted where ``restart`` is set."""
  out = x.copy()
  firsts = np.flatnonzero(restart)
  for a, b in zip(firsts.tolist(), np.append(firsts[1:], len(x)).tolist()):
    out[a:b] = np.maximum.accumulate(x[a:b])
  return out
