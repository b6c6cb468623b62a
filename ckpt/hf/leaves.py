"""Safetensors tensors as lazy leaves (ckpt/restore/lazy.py): shape and dtype
from the header, data read only when a box of it is asked for.

A tensor is stored row-major and contiguous, so any run of whole rows
(indices of its first dimension) is one contiguous byte range: one ranged
read. What a read needs is first broken into parts, each a box of one
file's tensor and the view of the output it fills (``parts``: a
``Transposed`` leaf, ``.T`` in a name rule, gives its parent the reversed
box and the transposed view; a ``Stacked`` leaf, per-layer tensors under
``[i]``, gives each member its slice). Then, per tensor, the rows that the
parts need are merged into runs and each run is read in pieces of at most
``max(PIECE_BYTES, the largest part)`` bytes, each copied (and cast) into
every view it covers before the next piece is read (``read_parts``). So a
row block (what a sharding of a tensor's first axis asks) is one ranged
read, and any other box costs the fewest whole rows that cover it.

``place`` (what ``assemble.materialize`` calls for a leaf that has it)
does this for all the boxes a process's devices hold at once: rows that
several devices need (a tensor split over its columns) are fetched once per
process, not once per device. Its host memory, under the restore's byte
limiter: the boxes, plus ``CONCURRENCY`` pieces in flight.
"""

from __future__ import annotations

import asyncio
import math
from typing import NamedTuple

import jax
import numpy as np

from ckpt.hf import header as header_lib
from ckpt.restore import assemble
from ckpt.restore import readcount
from ckpt.restore.hostmem import check_fits
from ckpt.restore.lazy import LazyLeaf
from ckpt.restore.lazy_derived import LazyStack
from ckpt.restore.placed import placed_boxes
from ckpt.restore.tasks import gather_or_cancel
from ckpt.shards.plan import Box

PIECE_BYTES = 16 << 20
CONCURRENCY = 4  # tensors of one leaf read at once


class Part(NamedTuple):
  """``box`` of ``tensor``, to copy into ``view`` (of the box's shape)."""
  tensor: "Tensor"
  box: Box
  view: np.ndarray


def _flip(box: Box) -> Box:
  return Box(tuple(reversed(box.start)), tuple(reversed(box.stop)))


def parts(leaf: LazyLeaf, box: Box, out: np.ndarray | None
          ) -> list[Part] | None:
  """The tensor parts reading ``box`` of ``leaf`` into ``out`` (None: no
  views, for sizing); None when ``leaf`` is not made of safetensors
  tensors only."""
  if isinstance(leaf, Tensor):
    return [Part(leaf, box, out)] if box.size else []
  if isinstance(leaf, Transposed):
    return parts(leaf.parent, _flip(box), None if out is None else out.T)
  if isinstance(leaf, Stacked):
    a = leaf.axis
    inner = Box(box.start[:a] + box.start[a + 1:],
                box.stop[:a] + box.stop[a + 1:])
    found = []
    for i in range(box.start[a], box.stop[a]):
      view = (None if out is None else
              out[(slice(None),) * a + (i - box.start[a],)])
      got = parts(leaf.members[i], inner, view)
      if got is None:
        return None
      found += got
    return found
  return None


def row_dims(leaf: LazyLeaf) -> list[int]:
  """The dimensions of ``leaf`` along which a split is whole rows of its
  tensors (best first): a stack's layer axis, a tensor's first axis (a
  transposed one's last); [] for other leaves."""
  if isinstance(leaf, Tensor):
    return [0] if leaf.shape else []
  if isinstance(leaf, Transposed):
    return [len(leaf.shape) - 1 - d for d in row_dims(leaf.parent)]
  if isinstance(leaf, Stacked):
    inner = row_dims(leaf.members[0])
    return [0] + [d + 1 for d in inner]
  return []


def _runs(ps: list[Part]) -> list[tuple[int, int]]:
  """The row ranges ``ps`` need, merged where they overlap or touch."""
  spans = sorted((p.box.start[0], p.box.stop[0]) if p.box.start else (0, 1)
                 for p in ps)
  out: list[list[int]] = []
  for a, b in spans:
    if out and a <= out[-1][1]:
      out[-1][1] = max(out[-1][1], b)
    else:
      out.append([a, b])
  return [(a, b) for a, b in out]


def piece_rows(t: "Tensor", ps: list[Part]) -> int:
  """Rows read in one request for ``ps`` (parts of ``t``)."""
  largest = max(p.box.size for p in ps) * t.dtype.itemsize
  return max(1, max(PIECE_BYTES, largest) // max(1, t.row_bytes))


def extra_bytes(ps: list[Part]) -> int:
  """Host bytes ``read_parts(ps)`` holds besides the views: the pieces
  in flight."""
  by_tensor: dict[int, list[Part]] = {}
  for p in ps:
    by_tensor.setdefault(id(p.tensor), []).append(p)
  sizes = sorted((min(piece_rows(g[0].tensor, g), max(
      b - a for a, b in _runs(g))) * g[0].tensor.row_bytes
                  for g in by_tensor.values()), reverse=True)
  return sum(sizes[:CONCURRENCY])


async def read_parts(ps: list[Part]) -> None:
  """Reads every part into its view: per tensor, each merged run of rows
  in pieces, every piece copied into the views it covers."""
  by_tensor: dict[int, list[Part]] = {}
  for p in ps:
    by_tensor.setdefault(id(p.tensor), []).append(p)
  gate = asyncio.Semaphore(CONCURRENCY)

  async def one(group: list[Part]):
    async with gate:
      await group[0].tensor.read_runs(group)
  await gather_or_cancel(*(one(g) for g in by_tensor.values()))


async def read_into(leaf, box: Box, out: np.ndarray) -> bool:
  """Reads ``box`` of ``leaf`` into ``out`` through its parts; False when
  it has none (a member of another kind: the caller reads as usual)."""
  ps = parts(leaf, box, out)
  if ps is None:
    return False
  await read_parts(ps)
  return True


def read_bytes(leaf, box: Box) -> int:
  """Host bytes a read of ``box`` holds besides the box."""
  ps = parts(leaf, box, None) if box.size else []
  return 0 if not ps else extra_bytes(ps)


async def place(leaf, out_dtype, sharding, limiter) -> jax.Array:
  """``leaf`` on ``sharding``'s devices: each distinct box this process
  holds, read through one set of parts (rows several boxes need fetched
  once), then one ``jax.make_array_from_callback``."""
  shape, out_dtype = tuple(leaf.shape), np.dtype(out_dtype)
  by_key = placed_boxes(sharding, shape)
  boxes = sorted(set(by_key.values()), key=lambda b: b.start)
  data: dict[Box, np.ndarray] = {}
  for b in boxes:
    check_fits(leaf.path, b.shape, out_dtype)
    data[b] = assemble.aligned_empty(b.shape, out_dtype)
  ps, others = [], []
  for b in boxes:
    got = parts(leaf, b, data[b])
    if got is None:  # a member of another kind (a transform's stack)
      others.append(b)
    else:
      ps += got
  grant = await limiter.acquire(
      sum(b.size for b in boxes) * out_dtype.itemsize + extra_bytes(ps) +
      sum(int(leaf.read_bytes(b)) for b in others))
  try:
    await read_parts(ps)
    for b in others:
      await leaf.read_into(b, data[b])

    def get(index):
      return data[Box.from_index(index, shape)]
    return await assemble.from_callback(shape, sharding, get, out_dtype)
  finally:
    limiter.release(grant)


class _Composite(LazyLeaf):
  """A tensor or a transposed one: read through ``parts``."""

  async def read_box(self, box: Box) -> np.ndarray:
    out = np.empty(box.shape, self.dtype)
    await read_into(self, box, out)
    return out

  async def read_into(self, box: Box, out: np.ndarray) -> None:
    await read_into(self, box, out)

  def read_bytes(self, box: Box) -> int:
    return read_bytes(self, box)

  async def place(self, out_dtype, sharding, limiter) -> jax.Array:
    return await place(self, out_dtype, sharding, limiter)


class Tensor(_Composite):
  """One tensor of one safetensors file of a ``files.Source``."""

  def __init__(self, source, name: str, t: header_lib.Entry,
               data_start: int):
    self.source, self.file = source, name
    self.path = t.key
    self.shape, self.dtype = t.shape, t.dtype
    self.offset = data_start + t.begin  # in the file
    self._le = t.dtype.newbyteorder("<")

  @property
  def row_bytes(self) -> int:
    return math.prod(self.shape[1:]) * self.dtype.itemsize

  async def read_runs(self, ps: list[Part]) -> None:
    """Reads the rows ``ps`` (parts of this tensor) need, piece by piece."""
    counter = readcount.COUNTER.get()
    if not self.shape:  # a scalar
      data = await self.source.read_range(self.file, self.offset,
                                    self.offset + self.dtype.itemsize)
      value = np.frombuffer(data, self._le).reshape(())
      for p in ps:
        np.copyto(p.view, value, casting="unsafe")
      if counter is not None:
        counter.add(self.dtype.itemsize, self.dtype.itemsize)
      return
    step = piece_rows(self, ps)
    for lo, hi in _runs(ps):
      for a in range(lo, hi, step):
        b = min(hi, a + step)
        data = await self.source.read_range(
            self.file, self.offset + a * self.row_bytes,
            self.offset + b * self.row_bytes)
        rows = np.frombuffer(data, self._le).reshape((b - a,) + self.shape[1:])
        asked = 0
        for p in ps:
          r0, r1 = max(a, p.box.start[0]), min(b, p.box.stop[0])
          if r0 >= r1:
            continue
          src = rows[(slice(r0 - a, r1 - a),) + p.box.slices()[1:]]
          np.copyto(p.view[r0 - p.box.start[0]:r1 - p.box.start[0]], src,
                    casting="unsafe")
          asked += src.size * self.dtype.itemsize
        if counter is not None:  # as the restore counts: asked, fetched
          counter.add(asked, len(data))
        del data, rows


class Transposed(_Composite):
  """``parent`` with its axes reversed (a 2-D weight's ``.T``)."""

  def __init__(self, parent: LazyLeaf, path: str = "<transposed>"):
    self.parent = parent
    self.shape = tuple(reversed(parent.shape))
    self.dtype = np.dtype(parent.dtype)
    self.path = path


class Stacked(LazyStack):
  """Tensors stacked along a new leading axis (``[i]`` in a name rule):
  each member's part read straight into its slice of the output."""

  def __init__(self, members, path: str = "<stack>"):
    super().__init__(members, 0, path)

  async def read_box(self, box: Box) -> np.ndarray:
    out = np.empty(box.shape, self.dtype)
    await self.read_into(box, out)
    return out

  async def read_into(self, box: Box, out: np.ndarray) -> None:
    if not await read_into(self, box, out):
      await super().read_into(box, out)

  def read_bytes(self, box: Box) -> int:
    if parts(self, box, None) is None:
      return super().read_bytes(box)
    return read_bytes(self, box)

  async def place(self, out_dtype, sharding, limiter) -> jax.Array:
    return await place(self, out_dtype, sharding, limiter)
