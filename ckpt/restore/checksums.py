"""crc32c checksums of stored data: taken at save, checked on read.

Every restore, ``load`` and ``ckpt verify`` checks every stored box it reads
(``verify=False`` opts out): ``attach`` gives each stored leaf its recorded
checksums and ckpt/restore/verified.py checks each box as it is read.

Formats "zarr3" and "ocdbt": every chunk ends with zarr3's crc32c codec
(``"checksum": "crc32c"`` in the entry's codec map), which TensorStore
checks whenever it decodes the chunk, so every read is verified; verifying
such a leaf is reading it.

Format "zarr" (zarr v2 has no checksum codec): each process records the
crc32c of every box it wrote in its own file,
``<step dir>/.checksums/<process>.msgpack`` (index.process_file), read here
when a leaf is verified (``ProcessChecksums``).

Indexes written before either carry ``(start, stop, crc32c)`` per box in
each entry (``ArrayEntry.checksums``); those are checked as they always were.
"""

from __future__ import annotations

import array
import asyncio
import math
from typing import Any, Callable

from ckpt.format import index as index_lib
from ckpt.format import seal
from ckpt.format import tsspec
from ckpt.restore import lazy
from ckpt.restore import lazy_derived
from ckpt.restore import listed
from ckpt.restore import verified
from ckpt.restore.tasks import gather_or_cancel
from ckpt.format import tree
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.store.limiter import ByteLimiter
from ckpt.shards.plan import Box
from ckpt.format import checks
from ckpt.format import entries

# At most this many bytes per read when verifying a leaf by reading it.
READ_BOX_BYTES = 64 << 20
# Per-process checksum files read at once.
_FILE_READS = 32


def _overlaps(a: Box, b: Box) -> bool:
  return all(x0 < y1 and y0 < x1
             for x0, x1, y0, y1 in zip(a.start, a.stop, b.start, b.stop))


def codec_checked(leaf: lazy.LazyArray) -> bool:
  """Whether TensorStore checks every chunk of ``leaf`` as it reads it (a
  packed leaf's reads check each piece's crc32c: ckpt/restore/pack_read.py)."""
  if getattr(leaf, "packed", False):
    return True
  return (not leaf.entry.checksums and
          leaf.entry.codec.get("checksum") == "crc32c")


async def check_boxes(leaf: lazy.LazyArray, wanted: list[Box] | None,
                      limiter: ByteLimiter) -> None:
  """Reads the stored boxes of ``leaf`` overlapping ``wanted`` (all of
  them if None) and raises CorruptCheckpointError on the first mismatch.

  Every read of a leaf checks what it reads: a packed leaf its pieces, a
  leaf whose chunks carry a crc32c its codec, any other its recorded
  checksums (``leaf.sums``, given by ``attach``)."""
  if getattr(leaf, "packed", False):  # every piece read is checked
    await leaf.verify(wanted)
    return
  if not codec_checked(leaf) and leaf.sums is None:
    raise CorruptCheckpointError(
        f"leaf {leaf.path!r}: its checksums were not loaded, so it cannot be "
        "verified")
  await read_through(leaf, wanted, limiter)


def stored_bases(leaf: lazy.LazyLeaf) -> list[lazy.LazyArray]:
  """The stored arrays a (possibly derived) lazy leaf reads from."""
  if isinstance(leaf, lazy.LazyArray):
    return [leaf]
  if isinstance(leaf, lazy_derived.LazyStack):
    return [b for m in leaf.members for b in stored_bases(m)]
  parent = getattr(leaf, "parent", None)
  return stored_bases(parent) if parent is not None else []


# ---- verifying by reading (zarr3 / ocdbt: the codec checks) ----------------

def read_boxes(box: Box, chunks: tuple[int, ...], itemsize: int,
               max_bytes: int) -> list[Box]:
  """Chunk-aligned boxes tiling ``box`` (aligned on the chunk grid), each of
  at most ``max_bytes`` unless one chunk is larger."""
  if box.size * itemsize <= max_bytes:
    return [box]
  for d, c in enumerate(chunks):
    if box.stop[d] - box.start[d] > c:
      break
  else:
    return [box]  # one chunk
  per_unit = box.size // (box.stop[d] - box.start[d]) * itemsize
  step = max(chunks[d], max_bytes // max(per_unit, 1) // chunks[d] * chunks[d])
  out = []
  a = box.start[d]
  while a < box.stop[d]:
    b = min(box.stop[d], (a // step + 1) * step)
    part = Box(box.start[:d] + (a,) + box.start[d + 1:],
               box.stop[:d] + (b,) + box.stop[d + 1:])
    out += read_boxes(part, chunks, itemsize, max_bytes) if (
        b - a <= chunks[d] and part.size * itemsize > max_bytes) else [part]
    a = b
  return out


async def read_through(leaf: lazy.LazyArray, wanted: list[Box] | None,
                       limiter: ByteLimiter) -> None:
  """Reads (and drops) the chunks of ``leaf`` overlapping ``wanted`` (all
  if None) under ``limiter``; TensorStore checks each chunk's crc32c."""
  whole = Box((0,) * len(leaf.shape), tuple(leaf.shape))
  if not whole.size:
    return
  # A quarter of the budget per read, so that several run at once.
  budget = max(1, min(READ_BOX_BYTES, limiter.budget // 4))
  boxes = read_boxes(whole, tuple(leaf.entry.chunks), leaf.dtype.itemsize,
                     budget)
  if wanted is not None:
    boxes = [b for b in boxes if any(_overlaps(b, w) for w in wanted)]

  async def one(box: Box):
    grant = await limiter.acquire(box.size * leaf.dtype.itemsize +
                                  leaf.read_bytes(box))
    try:
      await leaf.read_box(box)  # CorruptCheckpointError naming the leaf
    finally:
      limiter.release(grant)

  await gather_or_cancel(*(one(b) for b in boxes))


# ---- zarr v2: the per-process checksum files ------------------------------

class ProcessChecksums:
  """The checksum files of one zarr v2 step (one per saving process), read
  once, when the first leaf is verified; every leaf then finds its boxes.

  File names come from the index's process count (checked, and compared
  with one listing of the files before any is read: ckpt/restore/listed.py),
  never from the files; every record is checked against the index before
  it is used."""

  def __init__(self, storage: Any, step_dir: str, index: index_lib.Index):
    self.storage = storage
    self.step_dir = step_dir
    self.index = index
    self._lock: asyncio.Lock | None = None
    self._boxes: dict[str, list] | None = None
    self._error: CheckpointError | None = None

  async def boxes(self, leaf: lazy.LazyArray) -> tuple:
    """``((start, stop, crc32c), ...)`` of ``leaf``; CorruptCheckpointError
    naming the leaf if the files cannot be read."""
    flat = await self.flat(leaf)
    rank = len(leaf.entry.shape)
    n = 2 * rank + 1
    return tuple((tuple(flat[i:i + rank]), tuple(flat[i + rank:i + 2 * rank]),
                  flat[i + 2 * rank]) for i in range(0, len(flat), n))

  async def flat(self, leaf: lazy.LazyArray):
    """The records of ``leaf`` as one flat int64 array (start, stop,
    crc32c per box; empty if none)."""
    if self._lock is None:
      self._lock = asyncio.Lock()
    async with self._lock:
      if self._boxes is None and self._error is None:
        try:
          self._boxes = await self._load()
        except CheckpointError as e:
          self._error = e
    if self._error is not None:
      raise CorruptCheckpointError(
          f"leaf {leaf.path!r} cannot be verified: {self._error}")
    flat = self._boxes.get(leaf.entry.relpath)
    return array.array("q") if flat is None else flat

  async def _load(self) -> dict[str, array.array]:
    n = self.index.process_count
    if not 0 < n <= index_lib.MAX_PROCESSES:
      raise CorruptCheckpointError(
          f"the index says {n} processes saved the step; expected 1 to "
          f"{index_lib.MAX_PROCESSES}")
    # What the step holds first (one listing): a count the files do not
    # bear out is refused before any per-process work.
    rel_dir = f"{self.step_dir}/{index_lib.CHECKSUMS_DIR}".lstrip("/")
    present = listed.process_numbers(
        await asyncio.to_thread(listed.list_names, self.storage, rel_dir),
        ".msgpack", n)
    missing = listed.first_missing(present, n)
    if missing is not None:
      rel = index_lib.process_file(index_lib.CHECKSUMS_DIR, missing,
                                   self.step_dir)
      raise CorruptCheckpointError(
          f"the checksum file of process {missing} "
          f"({self.storage.url.rstrip('/')}/{rel}) is missing, so the boxes "
          f"that process wrote cannot be verified (the index says {n} "
          f"processes saved the step; {rel_dir!r} holds the files of "
          f"{len(present)})")
    sem = asyncio.Semaphore(_FILE_READS)
    out: dict[str, array.array] = {}
    chunk_counts: dict[str, int] = {}

    async def one(p: int):
      rel = index_lib.process_file(index_lib.CHECKSUMS_DIR, p, self.step_dir)
      async with sem:
        data = await asyncio.to_thread(
            self.storage.read_bytes, rel,
            limit=index_lib.MAX_PROCESS_FILE_BYTES)
      where = f"{self.storage.url.rstrip('/')}/{rel}"
      if data is None:
        raise CorruptCheckpointError(
            f"the checksum file of process {p} ({where}) is missing, so the "
            "boxes that process wrote cannot be verified")
      data = seal.maybe_unseal(data, where, self.index.sealed)
      self._add(out, chunk_counts, p, data, where)

    await gather_or_cancel(*(one(p) for p in range(n)))
    return out

  def _add(self, out: dict[str, array.array], chunk_counts: dict[str, int],
           p: int, data: bytes, where: str) -> None:
    """Checks process ``p``'s records and appends each to its leaf's flat
    int64 array (start, stop, crc32c): 8 bytes a number, not ~300 bytes of
    Python tuples a record, since every process holds every process's
    records (a 1,000-host step of 10,000 boxes a host: 10 million)."""
    try:
      doc = index_lib.unpack(data)  # bounded, as the index is
    except Exception as e:
      raise CorruptCheckpointError(
          f"{where} is not a valid msgpack document: {e}") from e
    if (not isinstance(doc, dict) or doc.get("process") != p or
        not isinstance(doc.get("boxes"), list)):
      raise CorruptCheckpointError(
          f"{where}: expected a map with 'process': {p} and a list of "
          f"'boxes', found {checks.SHORT_REPR.repr(doc)[:200]}")
    leaves = self.index.leaves
    for item in doc["boxes"]:
      if (not isinstance(item, list) or len(item) != 4 or
          type(item[0]) is not int or not 0 <= item[0] < len(leaves) or
          not isinstance(leaves[item[0]], entries.ArrayEntry) or
          type(item[3]) is not int or not 0 <= item[3] < 2**32):
        raise CorruptCheckpointError(
            f"{where}: expected a record [array leaf number, start, stop, "
            f"crc32c], found {checks.SHORT_REPR.repr(item)[:200]}")
      e = leaves[item[0]]
      name = f"{where}: leaf {item[0]} ({tree.path_str(e.path)})"
      start = checks.decode_shape(item[1], name)
      stop = checks.decode_shape(item[2], name)
      shape = tuple(e.shape)
      if (len(start) != len(shape) or len(stop) != len(shape) or
          any(not a < b <= s for a, b, s in zip(start, stop, shape))):
        raise CorruptCheckpointError(
            f"{name}: box {list(start)}..{list(stop)} is not inside the "
            f"leaf's shape {list(shape)}")
      boxes = out.get(e.relpath)
      if boxes is None:
        boxes = out[e.relpath] = array.array("q")
        chunk_counts[e.relpath] = math.prod(
            -(-s // c) for s, c in zip(shape, e.chunks))
      if len(boxes) >= chunk_counts[e.relpath] * (2 * len(shape) + 1):
        raise CorruptCheckpointError(
            f"{name}: more checksummed boxes than the leaf has chunks "
            f"({chunk_counts[e.relpath]})")
      boxes.extend(start)
      boxes.extend(stop)
      boxes.append(item[3])


def _chunk_key(storage_format: str) -> Callable[[tuple[int, ...]], str]:
  """How a chunk's grid index names its file in the leaf's array."""
  return lambda idx: tsspec.chunk_key(storage_format, idx)


async def attach(leaves: dict, storage: Any, step_dir: str,
                 index: index_lib.Index) -> None:
  """Gives every stored leaf whose chunks carry no crc32c codec its
  recorded checksums (``leaf.sums``), so that each of its reads checks what
  it read (ckpt/restore/verified.py). The per-process checksum files are
  read here, once per restore, if any leaf needs them."""
  need = [leaf for leaf in leaves.values()
          if isinstance(leaf, lazy.LazyArray) and not codec_checked(leaf)]
  if not need:
    return
  table = None
  root = storage.url.rstrip('/')
  base = f"{root}/{step_dir.strip('/')}".rstrip("/")
  key = _chunk_key(index.storage_format)
  for leaf in need:
    e = leaf.entry
    where = f"{base}/{e.relpath.strip('/')}"
    if getattr(e, "held_by", None) is not None:  # another step's objects
      where = f"{root}/{entries.held_dir(e.held_by)}/{e.relpath.strip('/')}"
    if index.storage_format == "ocdbt":
      where = f"{base} (OCDBT database) {e.relpath.strip('/')}"
    rank = len(e.shape)
    if e.checksums:
      leaf.sums = verified.BoxSums.of(e.checksums, rank, where, key, e.chunks)
      continue
    if table is None:
      table = ProcessChecksums(storage, step_dir, index)
    try:
      flat = await table.flat(leaf)
    except CorruptCheckpointError as err:  # raised when the leaf is read
      leaf.sums = verified.BoxSums.broken(str(err), rank, where, key, e.chunks)
      continue
    leaf.sums = verified.BoxSums.from_flat(flat, rank, where, key, e.chunks)
