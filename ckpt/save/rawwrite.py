"""Raw chunks written straight from the box's memory into their files.

A leaf of format "zarr" (v2) without compression on a local disk stores
each chunk as one file of exactly its bytes in C order (little-endian: the
dtypes ckpt writes; ``store_data_equal_to_fill_value``: every chunk has its
file), the bytes ckpt/restore/rawread.py reads back with ``preadv``. A box
made of whole chunks inside the array therefore needs no encoder: each
chunk is written with ``pwritev`` from the box's memory (on CPU devices a
view of the device buffer, no copy), its crc32c taken piece by piece
(``PIECE_BYTES``) right before the piece is written, while it is in the
CPU's cache, and the file fsynced on the same thread, as the limit does
(``tofile`` + ``fsync`` per file). Through TensorStore the same write
copies the box into a chunk of its own (fresh pages: one minor fault per
4 KiB, the first save most), writes it to a temporary file and renames it,
and the checksum and the fsync are further passes on other threads.

Only the chunk files are written here: the array's metadata (``.zarray``)
is still written by TensorStore when the array is created
(ckpt/save/write.py ``_open_arrays``), and anything else goes through
TensorStore as before (``RawChunks.of`` is None, or ``parts`` is None):
another format or compression, an object store, a box with an edge chunk
(stored padded in zarr v2). tests/save/test_rawwrite.py checks that the
files are byte for byte what TensorStore writes.

Durability is the Syncer's (ckpt/save/durable.py): these files are fsynced
here, once, before the "written" barrier, and the commit fsyncs every
directory of the attempt before its rename. A crash mid-write leaves a
short chunk file in an attempt that was never renamed into place, which
nothing reads and the next cleanup removes.
"""

from __future__ import annotations

import os

import crc32c
import numpy as np

from ckpt.format import tsspec
from ckpt.shards import plan as plan_lib

# crc32c over at most this many bytes right before they are written.
PIECE_BYTES = 1 << 20
# A chunk whose rows lie in runs shorter than this inside its box is copied
# out whole (one contiguous chunk) before it is written.
LONG_RUN_BYTES = 64 << 10
RAW_WRITES = True  # False: every chunk through TensorStore


class RawChunks:
  """Where the chunk files of one raw zarr v2 array go in a local
  directory (the attempt's), and how a box of it is written there."""

  def __init__(self, directory: str, shape: tuple[int, ...],
               chunks: tuple[int, ...], dtype: np.dtype):
    self.directory = directory
    self.shape, self.chunks, self.dtype = shape, chunks, np.dtype(dtype)

  @classmethod
  def of(cls, storage_format: str, step_dir: str | None, entry
         ) -> "RawChunks | None":
    """The chunk files of ``entry`` (an ArrayEntry) in ``step_dir`` (the
    attempt's directory on a local disk, or None), or None when its chunks
    are not raw files (the same conditions as rawread.ChunkFiles.of)."""
    if not RAW_WRITES or step_dir is None or storage_format != "zarr":
      return None
    dtype = np.dtype(entry.dtype)
    if (tsspec.codec_of(entry.codec).compression is not None or
        dtype.byteorder == ">" or dtype.hasobject or not entry.chunks or
        len(entry.chunks) != len(entry.shape) or not entry.shape):
      return None
    directory = os.path.join(step_dir, entry.relpath.strip("/"))
    return cls(directory, tuple(entry.shape), tuple(entry.chunks), dtype)

  def parts(self, box: plan_lib.Box) -> list[plan_lib.Box] | None:
    """The whole chunks that tile ``box``, or None when one of them is an
    edge chunk (shorter than the chunk shape: stored padded) or the box is
    not chunk-aligned."""
    if any(a % c for a, c in zip(box.start, self.chunks)):
      return None
    parts = plan_lib.chunk_boxes(box, self.chunks)
    if any(p.shape != self.chunks for p in parts):
      return None
    return parts

  def path(self, part: plan_lib.Box) -> str:
    return os.path.join(self.directory, tsspec.chunk_key("zarr", tuple(
        a // c for a, c in zip(part.start, self.chunks))))

  def write(self, parts: list[plan_lib.Box], box: plan_lib.Box,
            data: np.ndarray, drop: bool = False
            ) -> list[tuple[plan_lib.Box, int]]:
    """Blocking: each chunk of ``parts`` written from ``data`` (the box's
    bytes in the stored dtype) into its file and fsynced, on this thread
    (with ``drop`` its pages then leave the page cache: ckpt/save/polite.py);
    returns (chunk box, crc32c) of each. An OSError is raised as it comes
    (the save fails; the attempt is never committed)."""
    os.makedirs(self.directory, exist_ok=True)
    data = np.asarray(data)
    if data.dtype != self.dtype or data.shape != box.shape:
      raise ValueError(f"box {box.start}..{box.stop}: expected "
                       f"{box.shape} {self.dtype}, found {data.shape} "
                       f"{data.dtype}")
    out = []
    for part in parts:
      view = data if len(parts) == 1 else data[part.relative_to(box)]
      out.append((part, _write_file(self.path(part), view, drop)))
    return out


def _runs(view: np.ndarray) -> list[memoryview]:
  """The bytes of ``view`` in C order as runs: one when contiguous, its
  contiguous runs when they are long (``LONG_RUN_BYTES``), else one copy."""
  if view.flags.c_contiguous:
    return [memoryview(view.reshape(-1).view(np.uint8))]
  k, run = view.ndim, view.itemsize
  while k > 0 and view.strides[k - 1] == run:
    run *= view.shape[k - 1]
    k -= 1
  if run < LONG_RUN_BYTES:
    return [memoryview(np.ascontiguousarray(view).reshape(-1).view(np.uint8))]
  return [memoryview(view[idx].reshape(-1).view(np.uint8))
          for idx in np.ndindex(*view.shape[:k])]


def _write_file(path: str, view: np.ndarray, drop: bool) -> int:
  """One chunk file: its bytes written piece by piece, each summed first
  (hot in the cache for the write), then fsynced. Returns the crc32c."""
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC |
               getattr(os, "O_NOFOLLOW", 0), 0o666)
  try:
    crc, offset = 0, 0
    for run in _runs(view):
      for lo in range(0, len(run), PIECE_BYTES):
        piece = run[lo:lo + PIECE_BYTES]
        crc = crc32c.crc32c(piece, crc)
        while piece:  # a short write (a signal): the rest
          n = os.pwritev(fd, [piece], offset)
          if n <= 0:
            raise OSError(f"{path}: nothing written at offset {offset}")
          piece, offset = piece[n:], offset + n
    sync(fd)
    if drop:  # its pages are clean now: free them for the next writes
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  finally:
    os.close(fd)
  return crc


def sync(fd: int) -> None:
  """The file's bytes durable (a seam for tests that crash here)."""
  os.fsync(fd)

