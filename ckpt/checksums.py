"""crc32c checksums of stored boxes: taken at save, checked on read."""

from __future__ import annotations

import asyncio

import crc32c
import numpy as np

from ckpt import lazy
from ckpt.errors import CorruptCheckpointError
from ckpt.limiter import ByteLimiter
from ckpt.plan import Box


def checksum(data: np.ndarray) -> int:
  """crc32c of an array's bytes in C order (hardware-accelerated)."""
  data = np.ascontiguousarray(data)
  return crc32c.crc32c(data.reshape(-1).view(np.uint8))


def _overlaps(a: Box, b: Box) -> bool:
  return all(x0 < y1 and y0 < x1
             for x0, x1, y0, y1 in zip(a.start, a.stop, b.start, b.stop))


async def check_boxes(leaf: lazy.LazyArray, wanted: list[Box] | None,
                      limiter: ByteLimiter) -> None:
  """Reads the recorded boxes of ``leaf`` overlapping ``wanted`` (all of
  them if None) and raises CorruptCheckpointError on the first mismatch."""
  sums = leaf.entry.checksums
  if not sums and leaf.size:
    raise CorruptCheckpointError(
        f"leaf {leaf.path!r}: the index records no checksums, so it cannot be "
        "verified (saved by a ckpt without checksums, or the index was edited)")
  covered = sum(Box(a, b).size for a, b, _ in sums)
  if covered != leaf.size:
    raise CorruptCheckpointError(
        f"leaf {leaf.path!r}: checksummed boxes cover {covered} of "
        f"{leaf.size} elements")

  async def one(box: Box, crc: int):
    grant = await limiter.acquire(box.size * leaf.dtype.itemsize)
    try:
      data = await leaf.read_box(box)
      found = await asyncio.to_thread(checksum, data)
    finally:
      limiter.release(grant)
    if found != crc:
      raise CorruptCheckpointError(
          f"leaf {leaf.path!r}: box {box.start}..{box.stop} has crc32c "
          f"{found:#010x}, expected {crc:#010x} (recorded when it was written)")

  boxes = [(Box(a, b), c) for a, b, c in sums]
  if wanted is not None:
    boxes = [(b, c) for b, c in boxes if any(_overlaps(b, w) for w in wanted)]
  await lazy.gather_or_cancel(*(one(b, c) for b, c in boxes))


def stored_bases(leaf: lazy.LazyLeaf) -> list[lazy.LazyArray]:
  """The stored arrays a (possibly derived) lazy leaf reads from."""
  if isinstance(leaf, lazy.LazyArray):
    return [leaf]
  if isinstance(leaf, lazy.LazyStack):
    return [b for m in leaf.members for b in stored_bases(m)]
  parent = getattr(leaf, "parent", None)
  return stored_bases(parent) if parent is not None else []


async def verify_leaf(leaf: lazy.LazyLeaf, sharding, limiter: ByteLimiter
                      ) -> None:
  """restore(verify=True): check what this process is about to read."""
  if isinstance(leaf, lazy.LazyArray) and sharding is not None:
    shape = tuple(leaf.shape)
    wanted = list({Box.from_index(i, shape) for i in
                   sharding.addressable_devices_indices_map(shape).values()})
    await check_boxes(leaf, wanted, limiter)
    return
  for base in stored_bases(leaf):  # whole leaf, or derived by a transform
    await check_boxes(base, None, limiter)
