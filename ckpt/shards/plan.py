"""Stage 2 of save: which process writes which box of which array. Pure.

Nothing here touches devices, files or the network. Each process plans
only its own writes, from what concerns it (its boxes, and for each the set
of processes holding the same box: ``Placement``, built by
ckpt/shards/placement.py), so planning costs grow with what a host holds, never
with the number of devices in the job; no communication is needed to agree.

Rules:
- A shard held by one process is written whole by that process.
- A shard held by several processes (replicated across hosts) is cut into
  chunks and the chunks are spread over those processes, largest first, each
  to the holder with the fewest bytes of that set's chunks so far (every
  holder computes the same spread). So a fully replicated leaf is not
  written entirely by process 0, and no process writes much more than an
  equal share.
- The chunk shape divides every shard's extent and offset (so no chunk is
  written by two processes) and is cut down towards ``chunk_bytes``, and for
  a shard replicated over k processes towards a k-th of the shard, and at
  most an eighth of it (READ_SPLIT; neither below MIN_SPLIT_CHUNK_BYTES):
  each holder has a part to write, and a restore that reads the leaf once
  over R = 2, 4 or 8 replicas (ckpt/restore/readsplit.py) deals each of them whole
  chunks of an even split (cuts halve a dimension while it is even).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
from typing import Hashable, Mapping, NamedTuple, Sequence

import numpy as np

DEFAULT_CHUNK_BYTES = 64 << 20
# A shard replicated over k processes is cut into at least k chunks (so each
# holder writes a part) unless that would make chunks smaller than this.
MIN_SPLIT_CHUNK_BYTES = 1 << 20
# ... and into at least this many (the replica counts a read-once restore
# most often splits it over: 2, 4, 8), within the same floor.
READ_SPLIT = 8


@dataclasses.dataclass(frozen=True)
class Box:
  """A half-open box ``[start, stop)`` in an array's index space."""
  start: tuple[int, ...]
  stop: tuple[int, ...]
  # Derived once (planning reads them for every box of 100,000 leaves).
  shape: tuple[int, ...] = dataclasses.field(init=False, compare=False,
                                             repr=False)
  size: int = dataclasses.field(init=False, compare=False, repr=False)

  def __post_init__(self):
    shape = tuple(b - a for a, b in zip(self.start, self.stop))
    if len(self.start) != len(self.stop) or any(
        a < 0 or n < 0 for a, n in zip(self.start, shape)):
      raise ValueError(f"invalid box {self.start} .. {self.stop}")
    object.__setattr__(self, "shape", shape)
    object.__setattr__(self, "size", math.prod(shape))
    # Hashed once (a restore of 10,000 small leaves looks boxes up in
    # dicts several times per leaf); equal boxes hash alike, as before.
    object.__setattr__(self, "_hash", hash((self.start, self.stop)))

  def __hash__(self) -> int:
    return self._hash

  @classmethod
  def from_index(cls, index: Sequence[slice], shape: Sequence[int]) -> "Box":
    start, stop = [], []
    for s, n in zip(index, shape):
      a, b, step = s.indices(n)
      if step != 1:
        raise ValueError(f"strided index {s} is not a shard")
      start.append(a)
      stop.append(b)
    return cls(tuple(start), tuple(stop))

  def slices(self) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in zip(self.start, self.stop))

  def relative_to(self, outer: "Box") -> tuple[slice, ...]:
    return tuple(slice(a - o, b - o)
                 for a, b, o in zip(self.start, self.stop, outer.start))


@dataclasses.dataclass(frozen=True)
class Shard:
  """One distinct box of an array and the (process, device) pairs holding it."""
  box: Box
  holders: tuple[tuple[int, Hashable], ...]

  def __post_init__(self):
    if not self.holders:
      raise ValueError(f"shard {self.box} has no holder")

  @property
  def processes(self) -> tuple[int, ...]:
    return tuple(sorted({p for p, _ in self.holders}))

  def device_on(self, process: int) -> Hashable:
    return min((d for p, d in self.holders if p == process), key=repr)


class Write(NamedTuple):
  """Process ``process`` writes ``box``, reading it from ``shard`` on ``device``.
  (A tuple: a plan makes one per box of 100,000 leaves.)"""
  leaf: int
  box: Box
  shard: Box
  process: int
  device: Hashable
  nbytes: int


def shards_from_index_map(
    shape: Sequence[int],
    index_map: Mapping[Hashable, Sequence[slice]],
    process_of: Mapping[Hashable, int],
) -> list[Shard]:
  """Groups devices by the box they hold (``sharding.devices_indices_map``)."""
  by_box: dict[Box, list[tuple[int, Hashable]]] = {}
  for device, index in index_map.items():
    by_box.setdefault(Box.from_index(index, shape), []).append(
        (process_of[device], device))
  return [Shard(box, tuple(sorted(h, key=repr)))
          for box, h in sorted(by_box.items(), key=lambda kv: kv[0].start)]


def _smallest_factor(n: int) -> int:
  for f in range(2, math.isqrt(n) + 1):
    if n % f == 0:
      return f
  return n


@functools.lru_cache(maxsize=4096)
def chunk_shape(unit: tuple[int, ...], itemsize: int,
                target_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[int, ...]:
  """Largest-dim-first cut of ``unit`` until a chunk is at most target_bytes.

  Each cut divides a dimension by its smallest prime factor, so the result
  always divides ``unit``. A dimension that is prime is cut to 1 only when
  needed. Never returns a zero extent.
  """
  chunk = [max(1, d) for d in unit]
  while math.prod(chunk) * itemsize > target_bytes:
    candidates = [i for i, d in enumerate(chunk) if d > 1]
    if not candidates:
      break
    i = max(candidates, key=lambda j: (chunk[j], -j))
    chunk[i] //= _smallest_factor(chunk[i])
  return tuple(chunk)


def grid_unit(shape: Sequence[int], shards: Sequence[Shard]) -> tuple[int, ...]:
  """Per dimension, the gcd of every shard offset and extent (and the shape).

  A chunk shape that divides this never straddles two shards.
  """
  unit = []
  for d, n in enumerate(shape):
    g = 0
    for s in shards:
      g = math.gcd(g, s.box.start[d])
      g = math.gcd(g, s.box.stop[d] - s.box.start[d])
    unit.append(g or max(n, 1))
  return tuple(unit)


def chunk_boxes(box: Box, chunk: Sequence[int]) -> list[Box]:
  """The chunk-aligned boxes tiling ``box`` (whose offset chunk divides)."""
  if all(map(operator.le, box.shape, chunk)):
    return [box]  # one chunk: the common case, without the product
  ranges = [range(a, b, c) for a, b, c in zip(box.start, box.stop, chunk)]
  return [Box(tuple(corner), tuple(min(c + k, b) for c, k, b in
                                   zip(corner, chunk, box.stop)))
          for corner in itertools.product(*ranges)]


@dataclasses.dataclass(frozen=True)
class LocalShard:
  """A box of a leaf that this process holds, the local device it is read
  from, and every process that holds the same box (sorted)."""
  box: Box
  device: Hashable
  holders: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Placement:
  """What one process needs to know of a leaf's sharding to plan its writes.

  ``unit``: per dimension, the gcd of every shard's offset and extent (a
  chunk shape dividing it never straddles two shards); ``split_elems``: the
  smallest share of a replicated box per holder, in elements (None if no
  box is held by several processes); ``local``: this process's boxes. All
  three are the same on every process except ``local``, which has only what
  concerns this process: nothing here grows with the number of devices.
  """
  unit: tuple[int, ...]
  split_elems: int | None
  local: tuple[LocalShard, ...]
  # leaf_layout's results for this placement (many leaves share one).
  layouts: dict = dataclasses.field(default_factory=dict, compare=False,
                                    repr=False)


def placement_from_shards(shape: Sequence[int], shards: Sequence[Shard],
                          process: int) -> Placement:
  """The Placement from a global list of shards (any sharding: the
  ``devices_indices_map`` path, which costs O(devices) per leaf)."""
  split = [s.box.size // len(s.processes) for s in shards
           if len(s.processes) > 1]
  local = tuple(LocalShard(s.box, s.device_on(process), s.processes)
                for s in shards if process in s.processes)
  return Placement(grid_unit(shape, shards), min(split) if split else None,
                   local)


@dataclasses.dataclass(frozen=True, eq=False)
class LeafLayout:
  shape: tuple[int, ...]
  itemsize: int
  chunks: tuple[int, ...]
  local: tuple[LocalShard, ...]
  # assign_writes' expansion of ``local``, per max_item_bytes.
  parts: dict = dataclasses.field(default_factory=dict, repr=False)


def leaf_layout(shape: Sequence[int], itemsize: int, placement: Placement,
                target_bytes: int = DEFAULT_CHUNK_BYTES) -> LeafLayout:
  """The chunk shape (the same on every process: it depends on the
  placement's global parts only) and this process's boxes. Leaves with the
  same placement, itemsize and target share one LeafLayout."""
  key = (itemsize, target_bytes)
  got = placement.layouts.get(key)
  if got is not None:
    return got
  shape = tuple(int(d) for d in shape)
  if placement.split_elems is not None:
    per_holder = min(placement.split_elems,
                     math.prod(placement.unit) // READ_SPLIT) * itemsize
    target_bytes = min(target_bytes, max(per_holder, MIN_SPLIT_CHUNK_BYTES))
  got = placement.layouts[key] = LeafLayout(
      shape, itemsize, chunk_shape(placement.unit, itemsize, target_bytes),
      placement.local)
  return got


def _parts(lay: LeafLayout, max_item_bytes: int | None):
  """(boxes only this process holds: [(box, shard, device, nbytes)],
  [(holders, [(box, shard)], their sizes in bytes)] for the others), once
  per layout."""
  got = lay.parts.get(max_item_bytes)
  if got is not None:
    return got
  mine, shared = [], {}
  for s in lay.local:
    if len(s.holders) > 1:
      shared.setdefault(id(s.holders), (s.holders, []))[1].extend(
          (b, s) for b in chunk_boxes(s.box, lay.chunks))
      continue
    boxes = [s.box]
    if max_item_bytes is not None and s.box.size * lay.itemsize > max_item_bytes:
      boxes = chunk_boxes(s.box, lay.chunks)
    mine.extend((b, s.box, s.device, b.size * lay.itemsize) for b in boxes)
  got = lay.parts[max_item_bytes] = (mine, [
      (holders, chunks, np.array([b.size * lay.itemsize for b, _ in chunks],
                                 dtype=np.int64))
      for holders, chunks in shared.values()])
  return got


def spread(sizes: np.ndarray, members: int) -> np.ndarray:
  """Which of ``members`` writes each item (in an order every member
  knows): contiguous runs of about equal bytes, each item to the member
  whose share holds the item's midpoint. Every member gets within one item
  of an equal share."""
  total = int(sizes.sum())
  if total == 0:
    return np.zeros(len(sizes), dtype=np.int64)
  twice_mid = 2 * np.cumsum(sizes) - sizes
  return np.minimum(twice_mid * members // (2 * total), members - 1)


def assign_writes(layouts: Sequence[LeafLayout], process: int,
                  max_item_bytes: int | None = None,
                  leaves: Sequence[int] | None = None) -> list[Write]:
  """The boxes ``process`` writes, computed from its own boxes only.

  A box only this process holds is written by it, whole, or chunk by chunk
  if it is larger than ``max_item_bytes`` (the byte budget). The chunks of
  the boxes held by a set H of processes, in (leaf, box) order, are spread
  over H by bytes (``spread``). Every member of H holds exactly the same
  boxes with holders H, so each computes the same spread with no
  communication and keeps its part; the work is per chunk in numpy, and
  Python objects are made for this process's writes only. ``leaves``:
  the leaf number each layout's writes carry, increasing (default: its
  position in ``layouts``).
  """
  writes: list[Write] = []
  # Grouped by the identity of the holders tuple first: hashing a tuple of
  # thousands of processes once per box would cost more than the plan.
  by_id: dict[int, tuple[tuple[int, ...], list]] = {}
  for leaf, lay in zip(range(len(layouts)) if leaves is None else leaves,
                       layouts):
    mine, shared = _parts(lay, max_item_bytes)
    if mine:
      writes.extend(Write(leaf, b, shard, process, device, n)
                    for b, shard, device, n in mine)
    for holders, chunks, sizes in shared:
      got = by_id.get(id(holders))
      if got is None:
        got = by_id[id(holders)] = (holders, [])
      got[1].append((leaf, chunks, sizes))
  groups: dict[tuple[int, ...], list] = {}
  for holders, items in by_id.values():
    groups.setdefault(holders, []).extend(items)
  for holders, items in groups.items():
    owner = spread(np.concatenate([sizes for _, _, sizes in items]),
                   len(holders))
    firsts = np.cumsum([0] + [len(sizes) for _, _, sizes in items])
    picked = np.nonzero(owner == holders.index(process))[0]
    item = (np.searchsorted(firsts, picked, side="right") - 1).tolist()
    offset = (picked - firsts[item]).tolist()
    for i, j in zip(item, offset):
      leaf, chunks, sizes = items[i]
      b, s = chunks[j]
      writes.append(Write(leaf, b, s.box, process, s.device, int(sizes[j])))
  writes.sort(key=lambda w: (w.leaf, w.box.start))
  return writes
