"""Raw chunks read straight from their files into the restore's memory.

A leaf of format "zarr" (v2) without compression on a local disk stores
each chunk as one file of exactly its bytes in C order (little-endian: the
dtypes ckpt writes), so a box made of whole chunks needs no decoder: each
chunk file is read with ``preadv`` into the memory the caller places on
its devices, the limit's ``np.fromfile`` without the fresh array. Where the
chunk's place in the box is short strided runs (chunks side by side, as
onto another mesh), a piece of it at a time goes through a small scratch
buffer of the reading thread and is copied into place: the only copy, and
only where the box differs from the chunk. Through
TensorStore the same read maps the file and copies it out, a second pass
over the bytes.

When the leaf is verified, each chunk's crc32c is taken on the reading
thread piece by piece (``PIECE_BYTES``) right after the piece arrives,
while it is in the CPU's cache: verification is then one pass over data
already there, not a second walk over the whole box in memory. The caller
compares those against the recorded checksums (ckpt/restore/verified.py)
exactly as it compares the ones it takes itself.

Anything else goes through TensorStore as before (``ChunkFiles.of`` is
None, or ``read`` returns None): another format or compression, an object
store, a box that is not whole chunks (an edge chunk, padded in zarr v2, or
a finer target), a chunk file missing or of the wrong size (TensorStore
then raises its error, naming the leaf). The array is still opened with
TensorStore first, which checks its metadata against the index.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from typing import Any

import crc32c
import numpy as np

from ckpt.format import tsspec
from ckpt.shards.plan import Box

# crc32c over at most this many bytes just read (half of a 2 MiB L2).
PIECE_BYTES = 1 << 20
# A chunk placed in runs shorter than this (its rows side by side with
# another chunk's) is read through a scratch buffer and copied into place.
LONG_RUN_BYTES = 64 << 10


class ChunkFiles:
  """The chunk files of one raw zarr v2 array in a local directory."""

  def __init__(self, directory: str, shape: tuple[int, ...],
               chunks: tuple[int, ...], dtype: np.dtype):
    self.directory = directory
    self.shape, self.chunks, self.dtype = shape, chunks, np.dtype(dtype)
    self.chunk_bytes = math.prod(chunks) * self.dtype.itemsize

  @classmethod
  def of(cls, storage_format: str, kvstore: dict[str, Any], entry
         ) -> "ChunkFiles | None":
    """The chunk files of ``entry`` under ``kvstore`` (the step's), or None
    when its chunks are not raw files on a local disk."""
    dtype = np.dtype(entry.dtype)
    if (storage_format != "zarr" or kvstore.get("driver") != "file" or
        tsspec.codec_of(entry.codec).compression is not None or
        dtype.byteorder == ">" or dtype.hasobject or not entry.chunks or
        len(entry.chunks) != len(entry.shape) or not entry.shape):
      return None
    directory = os.path.join(kvstore["path"], entry.relpath.strip("/"))
    return cls(directory, tuple(entry.shape), tuple(entry.chunks), dtype)

  def parts(self, box: Box) -> list[Box] | None:
    """The chunks that make up ``box`` exactly (None: it is not whole
    chunks lying inside the array; a zarr v2 edge chunk is stored padded)."""
    ranges = []
    for a, b, c, s in zip(box.start, box.stop, self.chunks, self.shape):
      if a % c or (b - a) % c or b > s or b <= a:
        return None
      ranges.append(range(a // c, b // c))
    return [Box(tuple(i * c for i, c in zip(idx, self.chunks)),
                tuple((i + 1) * c for i, c in zip(idx, self.chunks)))
            for idx in itertools.product(*ranges)]

  def read(self, parts: list[Box], box: Box, out: np.ndarray,
           summed: bool) -> dict[tuple, int] | None:
    """Reads each chunk of ``parts`` into its place in ``out`` (the data of
    ``box``, C-contiguous, of the stored dtype), on this thread. Returns
    {(start, stop): crc32c} of each chunk when ``summed`` (else {}), or
    None when a chunk file cannot be read this way (missing, not exactly
    one chunk's bytes): the caller reads through TensorStore then."""
    crcs = {}
    for part in parts:
      key = tsspec.chunk_key("zarr", tuple(
          a // c for a, c in zip(part.start, self.chunks)))
      try:
        fd = os.open(os.path.join(self.directory, key), os.O_RDONLY)
      except OSError:
        return None
      try:
        if os.fstat(fd).st_size != self.chunk_bytes:
          return None
        crc = _read_chunk(fd, out[part.relative_to(box)], summed)
      finally:
        os.close(fd)
      if crc is None:
        return None
      crcs[(part.start, part.stop)] = crc
    return crcs if summed else {}


def _run(view: np.ndarray) -> tuple[int, int]:
  """(k, bytes): the dimensions from ``k`` on of a view of a C-contiguous
  array are contiguous, ``bytes`` long (k = 0: the whole view is)."""
  k, run = view.ndim, view.itemsize
  while k > 0 and view.strides[k - 1] == run:
    run *= view.shape[k - 1]
    k -= 1
  return k, run


def _read_chunk(fd: int, view: np.ndarray, summed: bool) -> int | None:
  """The file's bytes into ``view`` (its crc32c when ``summed``; None on
  a short read)."""
  k, run = _run(view)
  if k and run < LONG_RUN_BYTES:
    return _read_through_scratch(fd, view, summed, k, run)
  runs = ([memoryview(view.reshape(-1).view(np.uint8))] if not k else
          [memoryview(view[idx].reshape(-1).view(np.uint8))
           for idx in np.ndindex(*view.shape[:k])])
  crc, offset = 0, 0
  for whole in runs:
    # In pieces, each summed while it is in the cache.
    for lo in range(0, len(whole), PIECE_BYTES):
      piece = whole[lo:lo + PIECE_BYTES]
      if os.preadv(fd, [piece], offset) != len(piece):
        return None
      if summed:
        crc = crc32c.crc32c(piece, crc)
      offset += len(piece)
  return crc


def _read_through_scratch(fd: int, view: np.ndarray, summed: bool, k: int,
                          run: int) -> int | None:
  """A chunk whose place is short strided runs (its rows side by side with
  another chunk's): read a piece of whole runs contiguously into this
  thread's scratch buffer, summed there, and copied into place (one
  ``preadv`` per 4 KiB row cost more in Python than the copy)."""
  rows = max(1, PIECE_BYTES // run)
  scratch = _scratch(rows * run)
  inner = view.shape[k:]
  crc, offset = 0, 0
  for idx in np.ndindex(*view.shape[:k - 1]):
    block = view[idx]  # (n, *inner), its rows strided
    for lo in range(0, block.shape[0], rows):
      hi = min(block.shape[0], lo + rows)
      piece = scratch[:(hi - lo) * run]
      if os.preadv(fd, [memoryview(piece)], offset) != len(piece):
        return None
      if summed:
        crc = crc32c.crc32c(memoryview(piece), crc)
      np.copyto(block[lo:hi],
                piece.view(view.dtype).reshape((hi - lo,) + inner))
      offset += len(piece)
  return crc


_LOCAL = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
  """This thread's scratch buffer of at least ``nbytes``."""
  buf = getattr(_LOCAL, "buf", None)
  if buf is None or len(buf) < nbytes:
    buf = _LOCAL.buf = np.empty(nbytes, np.uint8)
  return buf
