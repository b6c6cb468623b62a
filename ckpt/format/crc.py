"""The crc32c of an array's bytes: the checksum taken of every box at save
(format "zarr" per-process checksum files, packed pieces) and of the
agreement payloads between hosts, and checked again on read
(ckpt/restore/checksums.py). Depends on nothing in ckpt.
"""

from __future__ import annotations

import crc32c
import numpy as np
import xxhash


def checksum(data: np.ndarray) -> int:
  """crc32c of an array's bytes in C order (hardware-accelerated)."""
  data = np.ascontiguousarray(data)
  return crc32c.crc32c(data.reshape(-1).view(np.uint8))


# A strided view whose contiguous runs are at least this long is summed run
# by run (crc32c continues from one run to the next); shorter runs are
# copied into one contiguous buffer first.
_RUN_BYTES = 64 << 10


def _runs(view: np.ndarray):
  """The bytes of ``view`` in C order as uint8 runs: one when contiguous,
  its contiguous runs when they are at least _RUN_BYTES, else one copy."""
  if view.flags.c_contiguous:
    return [view.reshape(-1).view(np.uint8)]
  k, run = view.ndim, view.itemsize
  while k > 0 and view.strides[k - 1] == run:
    run *= view.shape[k - 1]
    k -= 1
  if run < _RUN_BYTES:
    return [np.ascontiguousarray(view).reshape(-1).view(np.uint8)]
  return (view[idx].reshape(-1).view(np.uint8)
          for idx in np.ndindex(*view.shape[:k]))


def checksum_view(view: np.ndarray) -> int:
  """``checksum`` of a view (strided or not) without copying it when its
  contiguous runs are long: the crc32c of its elements in C order."""
  crc = 0
  for part in _runs(view):
    crc = crc32c.crc32c(part, crc)
  return crc


def digest(view: np.ndarray) -> bytes:
  """The 128-bit xxh3 hash (16 bytes) of an array's bytes in C order, strided
  or not: the identity of a stored chunk (``reuse_unchanged``,
  ckpt/save/reuse.py). crc32c, 32 bits, is too short for identity: a
  collision there would restore another chunk's bytes unnoticed."""
  h = xxhash.xxh3_128()
  for part in _runs(view):
    h.update(part)
  return h.digest()
