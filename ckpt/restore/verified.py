"""Reads that check every stored box they touch, as its bytes arrive.

At save, every box a process writes has its crc32c recorded (the
per-process checksum files, ckpt/restore/checksums.py; older indexes carry
them in the entry). A restore reads boxes of its target's shape, which are
not the saved boxes when the mesh changed. ``read_into`` reads the hull of
the recorded boxes that overlap the box asked for (the box itself when the
saved boxes lie inside it, which is the case on the same mesh or a coarser
one) and takes the crc32c of each recorded box from the memory it was just
read into, on the reading thread, before any of it is handed on. So
verification is one pass over data already in the cache, not a second read.
A recorded box that straddles the box asked for (a finer target sharding)
is read whole: TensorStore reads whole chunks anyway, and since ckpt records
one crc32c per stored chunk, that is no extra storage I/O; the target's
boxes that straddle the same recorded boxes share that one read while it
is in flight (each box read its hull alone before: twice the bytes onto a
2x finer mesh).

A mismatch raises CorruptCheckpointError naming the leaf, the box, the
chunk file, the expected and the found checksum.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
from typing import Awaitable, Callable

import numpy as np

from ckpt.errors import CorruptCheckpointError
from ckpt.format.crc import checksum_view
from ckpt.shards.plan import Box

# A box at most this large is checked on the event loop: a hop to a worker
# thread costs more than the checksum.
INLINE_BYTES = 256 << 10


@dataclasses.dataclass(frozen=True, eq=False)
class BoxSums:
  """The recorded boxes of one stored leaf: ``starts``/``stops`` (n, rank)
  and their ``crcs`` (n,), plus where the leaf's chunks live, for errors."""
  starts: np.ndarray
  stops: np.ndarray
  crcs: np.ndarray
  where: str                      # the leaf's array, as a URL
  chunk_key: Callable[[tuple[int, ...]], str]  # chunk grid index -> its key
  chunks: tuple[int, ...]
  error: str | None = None        # the records could not be read: why
  # Hull reads in flight (``read_into``), by (event loop, start, stop):
  # boxes of a finer target that share a stored chunk share its one read.
  reads: dict = dataclasses.field(default_factory=dict, repr=False)
  # Row of each recorded box by (start, stop), built on first use.
  by_box: dict = dataclasses.field(default_factory=dict, repr=False)

  @classmethod
  def broken(cls, error: str, rank: int, where: str, chunk_key, chunks
             ) -> "BoxSums":
    """No records: every read raises CorruptCheckpointError with ``error``."""
    empty = np.zeros((0, rank), dtype=np.int64)
    return cls(empty, empty, np.zeros(0, dtype=np.int64), where, chunk_key,
               tuple(chunks), error)

  @classmethod
  def of(cls, records, rank: int, where: str, chunk_key, chunks
         ) -> "BoxSums":
    """From ``((start, stop, crc32c), ...)``."""
    n = len(records)
    starts = np.array([r[0] for r in records], dtype=np.int64).reshape(n, rank)
    stops = np.array([r[1] for r in records], dtype=np.int64).reshape(n, rank)
    crcs = np.array([r[2] for r in records], dtype=np.int64)
    return cls(starts, stops, crcs, where, chunk_key, tuple(chunks))

  @classmethod
  def from_flat(cls, flat, rank: int, where: str, chunk_key, chunks
                ) -> "BoxSums":
    """From a flat int64 sequence of (start, stop, crc32c) records."""
    a = np.asarray(flat, dtype=np.int64).reshape(-1, 2 * rank + 1)
    return cls(a[:, :rank], a[:, rank:2 * rank], a[:, 2 * rank], where,
               chunk_key, tuple(chunks))

  def covered(self) -> int:
    """Elements covered by the recorded boxes (with overlaps counted
    twice)."""
    return int(np.prod(self.stops - self.starts, axis=1).sum())

  def overlapping(self, box: Box) -> np.ndarray:
    """Row numbers of the recorded boxes that overlap ``box``."""
    if not len(self.crcs):
      return np.zeros(0, dtype=np.int64)
    lo = np.asarray(box.start, dtype=np.int64)
    hi = np.asarray(box.stop, dtype=np.int64)
    hit = np.all((self.starts < hi) & (lo < self.stops), axis=1)
    return np.nonzero(hit)[0]

  def tiling(self, box: Box) -> np.ndarray | None:
    """Rows of the recorded boxes that are exactly the chunks of ``box``
    (the same mesh or a coarser one: one dict look-up a chunk), or None."""
    if not self.by_box and len(self.crcs):
      for i, (a, b) in enumerate(zip(self.starts.tolist(),
                                     self.stops.tolist())):
        self.by_box[(tuple(a), tuple(b))] = i
    ranges = []
    for a, b, c in zip(box.start, box.stop, self.chunks):
      if a % c or b <= a:
        return None
      ranges.append([(i, min(i + c, b)) for i in range(a, b, c)])
    rows = []
    for part in itertools.product(*ranges):
      row = self.by_box.get((tuple(p[0] for p in part),
                             tuple(p[1] for p in part)))
      if row is None:
        return None
      rows.append(row)
    return np.array(rows, dtype=np.int64)

  def box(self, i: int) -> Box:
    return Box(tuple(self.starts[i].tolist()), tuple(self.stops[i].tolist()))

  def describe(self, i: int) -> str:
    """The chunk file(s) of recorded box ``i``."""
    b = self.box(i)
    first = tuple(a // c for a, c in zip(b.start, self.chunks))
    last = tuple((z - 1) // c for z, c in zip(b.stop, self.chunks))
    key = self.chunk_key(first)
    if first != last:
      key += f" .. {self.chunk_key(last)}"
    return f"{self.where}/{key}"


def plan(sums: BoxSums, box: Box, path: str) -> tuple[Box, np.ndarray]:
  """(the box to read, the recorded boxes it checks) for a read of ``box``:
  ``box`` itself when every recorded box overlapping it lies inside it,
  else their hull. Raises CorruptCheckpointError when the recorded boxes do
  not cover ``box`` exactly once."""
  if sums.error is not None:
    raise CorruptCheckpointError(sums.error)
  if len(sums.chunks) == len(box.start) and box.size:
    rows = sums.tiling(box)  # each element exactly once, by construction
    if rows is not None:
      return box, rows
  rows = sums.overlapping(box)
  starts, stops = sums.starts[rows], sums.stops[rows]
  lo = np.asarray(box.start, dtype=np.int64)
  hi = np.asarray(box.stop, dtype=np.int64)
  inter = np.prod(np.minimum(stops, hi) - np.maximum(starts, lo), axis=1)
  if int(inter.sum()) != box.size:
    raise CorruptCheckpointError(
        f"leaf {path!r}: the checksummed boxes cover {int(inter.sum())} of "
        f"the {box.size} elements of {box.start}..{box.stop} (expected each "
        "element exactly once): the checksum records do not match the "
        "array, so it cannot be verified")
  if not len(rows) or (np.all(starts >= lo) and np.all(stops <= hi)):
    return box, rows
  hull = Box(tuple(np.minimum(starts.min(axis=0), lo).tolist()),
             tuple(np.maximum(stops.max(axis=0), hi).tolist()))
  return hull, rows


def check(sums: BoxSums, rows: np.ndarray, data: np.ndarray, at: Box,
          path: str, taken: dict[tuple, int] | None = None) -> None:
  """Checks each recorded box ``rows`` against ``data`` (the stored bytes
  of ``at``); CorruptCheckpointError on the first mismatch. ``taken``:
  the crc32c of stored chunks, by (start, stop), taken from those bytes as
  they were read (ckpt/restore/rawread.py); a recorded box among them is
  compared with it, any other is summed here."""
  for i in rows.tolist():
    b = sums.box(i)
    found = None if taken is None else taken.get((b.start, b.stop))
    if found is None:
      found = checksum_view(data[b.relative_to(at)])
    want = int(sums.crcs[i])
    if found != want:
      raise CorruptCheckpointError(
          f"leaf {path!r}: box {list(b.start)}..{list(b.stop)} (stored in "
          f"{sums.describe(i)}) has crc32c {found:#010x}, expected "
          f"{want:#010x} (recorded when it was written): the stored data "
          "was changed or damaged after the save. To resume from the newest "
          "step that verifies, restore without a step (restore(target=...)):"
          " it falls back past a damaged step")


async def read_into(sums: BoxSums, box: Box, out: np.ndarray, path: str,
                    dtype: np.dtype,
                    raw_read: Callable[[Box, np.ndarray],
                                       Awaitable[dict[tuple, int] | None]]
                    ) -> None:
  """Reads ``box`` of a leaf stored as ``dtype`` into ``out`` (any dtype:
  cast on the copy), checking every recorded box it reads.

  ``raw_read(box, buf)``: reads the stored data of ``box`` into ``buf``
  (of the stored dtype); it may return the crc32c it took of stored
  chunks as they arrived (``check``'s ``taken``)."""
  at, rows = plan(sums, box, path)
  if at == box:
    direct = out.dtype == dtype
    buf = out if direct else np.empty(at.shape, dtype)
    await _read_checked(sums, rows, at, buf, raw_read, path)
    if not direct:
      await _copy(out, buf)
    return
  # A hull: the recorded boxes straddle ``box`` (a finer target). The
  # target's other boxes that straddle the same records need the same
  # hull: one read, checked once, while it is in flight (else each box of a
  # 2x finer mesh read and checked every chunk twice: 2 GiB for 1 GiB).
  key = (asyncio.get_running_loop(), at.start, at.stop)
  task = sums.reads.get(key)
  if task is None:
    task = asyncio.ensure_future(_read_checked(
        sums, rows, at, np.empty(at.shape, dtype), raw_read, path))
    sums.reads[key] = task
    task.add_done_callback(lambda _: sums.reads.pop(key, None))
  buf = await asyncio.shield(task)  # one sharer cancelled: not the others
  await _copy(out, buf[box.relative_to(at)])


async def _read_checked(sums: BoxSums, rows: np.ndarray, at: Box,
                        buf: np.ndarray, raw_read, path: str) -> np.ndarray:
  """``buf`` filled with the stored data of ``at`` and checked."""
  taken = await raw_read(at, buf)
  if taken is not None and all(
      (b.start, b.stop) in taken for b in map(sums.box, rows.tolist())):
    check(sums, rows, buf, at, path, taken)  # compares numbers only
  elif buf.nbytes <= INLINE_BYTES:
    check(sums, rows, buf, at, path, taken)
  else:
    await asyncio.to_thread(check, sums, rows, buf, at, path, taken)
  return buf


async def _copy(out: np.ndarray, src: np.ndarray) -> None:
  """``out[...] = src`` (cast to ``out``'s dtype), off the loop if large."""
  if src.nbytes <= INLINE_BYTES:
    np.copyto(out, src, casting="unsafe")
  else:
    await asyncio.to_thread(np.copyto, out, src, casting="unsafe")


def hull_bytes(sums: BoxSums, box: Box, itemsize: int) -> int:
  """Host bytes a verified read of ``box`` holds besides ``box`` itself
  (0 when its records cannot be used: the read raises)."""
  try:
    at, _ = plan(sums, box, "<leaf>")
  except CorruptCheckpointError:
    return 0
  return 0 if at == box else math.prod(at.shape) * itemsize
