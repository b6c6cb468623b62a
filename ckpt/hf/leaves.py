"""Safetensors tensors as lazy leaves (ckpt/restore/lazy.py): shape and dtype
from the header, data read only when a box of it is asked for.

A tensor is stored row-major and contiguous, so a box whose every dimension
after the first is whole (a row block: what a sharding of the leading axis
asks) is one contiguous byte range: one ranged read. Any other box is read
as the fewest whole rows (index of the first dimension) that cover it, in
pieces of at most ``max(the box's bytes, PIECE_BYTES)``, each copied into
place before the next is read; those pieces are the host bytes a read holds
besides the box (``read_bytes``, which the restore's byte limiter counts).

``Transposed`` is a leaf's axes reversed (``.T`` in a name rule): a box of
it reads the reversed box of its parent, so a target sharded on its last
axis reads row blocks of a Hugging Face (out, in) weight.
"""

from __future__ import annotations

import math

import numpy as np

from ckpt.hf import header as header_lib
from ckpt.restore import readcount
from ckpt.restore.lazy import LazyLeaf
from ckpt.shards.plan import Box

PIECE_BYTES = 16 << 20


class Tensor(LazyLeaf):
  """One tensor of one safetensors file of a ``files.Source``."""

  def __init__(self, source, name: str, t: header_lib.Tensor,
               data_start: int):
    self.source, self.file = source, name
    self.path = t.key
    self.shape, self.dtype = t.shape, t.dtype
    self.offset = data_start + t.begin  # in the file
    self._le = t.dtype.newbyteorder("<")

  def __repr__(self) -> str:
    return (f"safetensors {self.path!r} ({self.file}, shape {self.shape}, "
            f"{np.dtype(self.dtype).name})")

  @property
  def row_bytes(self) -> int:
    return math.prod(self.shape[1:]) * self.dtype.itemsize

  def _rows_per_piece(self, box: Box) -> int:
    """Rows (first-dimension indices) read in one request for ``box``."""
    if not self.shape:
      return 1
    rows = box.stop[0] - box.start[0]
    whole = tuple(box.shape[1:]) == tuple(self.shape[1:])
    if whole:
      return max(1, rows)  # a row block: one contiguous read
    cap = max(box.size * self.dtype.itemsize, PIECE_BYTES)
    return max(1, min(rows, cap // max(1, self.row_bytes)))

  def read_bytes(self, box: Box) -> int:
    """Host bytes a read of ``box`` holds besides the box: one piece of
    whole rows (the bytes requested, then copied into place)."""
    if box.size == 0:
      return 0
    if not self.shape:
      return self.dtype.itemsize
    return self._rows_per_piece(box) * self.row_bytes

  async def read_box(self, box: Box) -> np.ndarray:
    out = np.empty(box.shape, self.dtype)
    await self.read_into(box, out)
    return out

  async def read_into(self, box: Box, out: np.ndarray) -> None:
    if box.size == 0:
      return
    item = self.dtype.itemsize
    if not self.shape:
      data = await self.source.read(self.file, self.offset,
                                    self.offset + item)
      readcount.count((), (), (), item)
      np.copyto(out, np.frombuffer(data, self._le).reshape(()),
                casting="unsafe")
      return
    r0, r1 = box.start[0], box.stop[0]
    step = self._rows_per_piece(box)
    inner = box.slices()[1:]
    chunks = (1,) + tuple(self.shape[1:])
    for a in range(r0, r1, step):
      b = min(r1, a + step)
      data = await self.source.read(self.file, self.offset + a * self.row_bytes,
                                    self.offset + b * self.row_bytes)
      rows = np.frombuffer(data, self._le).reshape((b - a,) + self.shape[1:])
      # Counted as the restore counts: the box asked, the rows fetched.
      readcount.count((a,) + box.start[1:], (b,) + box.stop[1:], chunks,
                      item)
      np.copyto(out[a - r0:b - r0], rows[(slice(None),) + inner],
                casting="unsafe")
      del data, rows


class Transposed(LazyLeaf):
  """``parent`` with its axes reversed (a 2-D weight's ``.T``)."""

  def __init__(self, parent: LazyLeaf, path: str = "<transposed>"):
    self.parent = parent
    self.shape = tuple(reversed(parent.shape))
    self.dtype = np.dtype(parent.dtype)
    self.path = path

  @staticmethod
  def _flip(box: Box) -> Box:
    return Box(tuple(reversed(box.start)), tuple(reversed(box.stop)))

  def read_bytes(self, box: Box) -> int:
    """The parent's box (read, then copied transposed) and what its read
    holds."""
    inner = self._flip(box)
    extra = getattr(self.parent, "read_bytes", lambda b: 0)(inner)
    return box.size * self.dtype.itemsize + int(extra)

  async def read_box(self, box: Box) -> np.ndarray:
    return (await self.parent.read_box(self._flip(box))).T
