"""Stage 2 of save: which process writes which box of which array. Pure.

Nothing here touches devices, files or the network: every function takes
shapes, device-to-index maps and process numbers, and every process computes
the same plan from the same (global) information, so no communication is
needed to agree on it.

Rules:
- A shard held by one process is written whole by that process.
- A shard held by several processes (replicated across hosts) is cut into
  chunks and the chunks are spread over those processes, largest first, each
  to the holder with the fewest bytes so far. So a fully replicated leaf is
  not written entirely by process 0, and no process writes much more than an
  equal share.
- The chunk shape divides every shard's extent and offset (so no chunk is
  written by two processes) and is cut down towards ``chunk_bytes``, and for
  a shard replicated over k processes towards a k-th of the shard (not below
  MIN_SPLIT_CHUNK_BYTES), so that each holder has a part to write.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Hashable, Mapping, Sequence

DEFAULT_CHUNK_BYTES = 64 << 20
# A shard replicated over k processes is cut into at least k chunks (so each
# holder writes a part) unless that would make chunks smaller than this.
MIN_SPLIT_CHUNK_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Box:
  """A half-open box ``[start, stop)`` in an array's index space."""
  start: tuple[int, ...]
  stop: tuple[int, ...]

  def __post_init__(self):
    if len(self.start) != len(self.stop) or any(
        a < 0 or b < a for a, b in zip(self.start, self.stop)):
      raise ValueError(f"invalid box {self.start} .. {self.stop}")

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

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(b - a for a, b in zip(self.start, self.stop))

  @property
  def size(self) -> int:
    return math.prod(self.shape)

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


@dataclasses.dataclass(frozen=True)
class Write:
  """Process ``process`` writes ``box``, reading it from ``shard`` on ``device``."""
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


def replicated_shards(shape: Sequence[int], process_count: int) -> list[Shard]:
  """A value every process holds whole (a host numpy array, no partitioner)."""
  box = Box((0,) * len(shape), tuple(shape))
  return [Shard(box, tuple((p, None) for p in range(process_count)))]


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
  ranges = [range(a, b, c) for a, b, c in zip(box.start, box.stop, chunk)]
  out = []
  for corner in _product(ranges):
    out.append(Box(tuple(corner),
                   tuple(min(c + k, b) for c, k, b in
                         zip(corner, chunk, box.stop))))
  return out


def _product(ranges):
  if not ranges:
    yield ()
    return
  for head in ranges[0]:
    for tail in _product(ranges[1:]):
      yield (head,) + tail


@dataclasses.dataclass(frozen=True)
class LeafLayout:
  shape: tuple[int, ...]
  itemsize: int
  shards: tuple[Shard, ...]
  chunks: tuple[int, ...]


def leaf_layout(shape: Sequence[int], itemsize: int, shards: Sequence[Shard],
                target_bytes: int = DEFAULT_CHUNK_BYTES) -> LeafLayout:
  shape = tuple(int(d) for d in shape)
  unit = grid_unit(shape, shards)
  for shard in shards:
    k = len(shard.processes)
    if k > 1:
      per_holder = shard.box.size * itemsize // k
      target_bytes = min(target_bytes, max(per_holder, MIN_SPLIT_CHUNK_BYTES))
  return LeafLayout(shape, itemsize, tuple(shards),
                    chunk_shape(unit, itemsize, target_bytes))


def assign_writes(layouts: Sequence[LeafLayout], process_count: int,
                  max_item_bytes: int | None = None) -> list[Write]:
  """Every box of every leaf, each with the one process that writes it.

  A shard larger than ``max_item_bytes`` (the byte budget) is written chunk
  by chunk, so that no single write item needs more host memory than that.
  """
  load = [0] * process_count
  writes: list[Write] = []
  shared: list[tuple[int, Shard, Box]] = []
  for leaf, lay in enumerate(layouts):
    for shard in lay.shards:
      procs = shard.processes
      n = shard.box.size * lay.itemsize
      if len(procs) == 1:
        p = procs[0]
        load[p] += n
        boxes = [shard.box]
        if max_item_bytes is not None and n > max_item_bytes:
          boxes = chunk_boxes(shard.box, lay.chunks)
        writes.extend(Write(leaf, b, shard.box, p, shard.device_on(p),
                            b.size * lay.itemsize) for b in boxes)
      else:
        shared.extend((leaf, shard, b) for b in chunk_boxes(shard.box, lay.chunks))
  shared.sort(key=lambda t: (-t[2].size * layouts[t[0]].itemsize, t[0], t[2].start))
  for leaf, shard, box in shared:
    n = box.size * layouts[leaf].itemsize
    p = min(shard.processes, key=lambda q: (load[q], q))
    load[p] += n
    writes.append(Write(leaf, box, shard.box, p, shard.device_on(p), n))
  writes.sort(key=lambda w: (w.leaf, w.box.start))
  return writes
