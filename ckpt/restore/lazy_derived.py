"""Lazy leaves derived from others by restore transforms, reading nothing
until read: ``LazyStack`` (leaves stacked along a new axis, read straight
into the output), ``LazySlice`` (one index of an axis: one layer of a
stack) and ``LazyReshape`` (a new shape of the same size, read as the few
contiguous parent boxes that cover each box). A key leaf stays one only
where the axis used is the keys' (``_derived_impl``).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ckpt.errors import TreeMismatchError
from ckpt.restore.keyshape import key_rank, logical_shape
from ckpt.restore.lazy import LazyArray, LazyLeaf, LazyValue
from ckpt.restore.tasks import gather_or_cancel
from ckpt.shards.plan import Box


def _derived_impl(what: str, path: str, parent: LazyLeaf, axis: int, *,
                  new_axis: bool) -> str | None:
  """The prng_impl a leaf derived from ``parent`` keeps; the axis it works
  on (``new_axis``: inserts) must be the keys', not the key data's."""
  if not parent.prng_impl:
    return None
  rank = len(logical_shape(parent))
  if not 0 <= axis < rank + new_axis:
    raise TreeMismatchError(
        f"{path}: cannot {what} {parent.path!r} on axis {axis}: it holds "
        f"{parent.prng_impl} keys of shape {logical_shape(parent)} (key data "
        f"{tuple(parent.shape)}); only the keys' axes can be used")
  return parent.prng_impl


def _dtype_text(leaf: LazyLeaf) -> str:
  if leaf.prng_impl:
    return f"{np.dtype(leaf.dtype)} data of {leaf.prng_impl} keys"
  return str(np.dtype(leaf.dtype))


class LazyStack(LazyLeaf):
  """Leaves of one shape and dtype stacked along a new ``axis``.

  A box is read straight into its output (``read_into``): each member
  reads its part into its slice of the output, so a read holds the box
  plus at most one member's box (``read_bytes``, counted in the byte
  budget), never every member's box next to a stacked copy."""

  def __init__(self, members: Sequence[LazyLeaf], axis: int = 0,
               path: str = "<stack>"):
    if not members:
      raise TreeMismatchError(f"{path}: nothing to stack")
    first = members[0]
    for m in members[1:]:
      if (tuple(m.shape) != tuple(first.shape) or
          np.dtype(m.dtype) != np.dtype(first.dtype) or
          m.prng_impl != first.prng_impl):
        raise TreeMismatchError(
            f"{path}: cannot stack {m.path!r} (shape {tuple(m.shape)}, dtype "
            f"{_dtype_text(m)}) with {first.path!r} (shape "
            f"{tuple(first.shape)}, dtype {_dtype_text(first)})")
    if not 0 <= axis <= len(first.shape):
      raise TreeMismatchError(f"{path}: stack axis {axis} out of range for "
                              f"rank {len(first.shape)}")
    self.prng_impl = _derived_impl("stack", path, first, axis, new_axis=True)
    self.members = list(members)
    self.axis = axis
    self.shape = (tuple(first.shape[:axis]) + (len(members),) +
                  tuple(first.shape[axis:]))
    self.dtype = np.dtype(first.dtype)
    self.path = path

  # Members that read straight into the output (stored arrays of the
  # output's dtype, values) are read at once; any other one at a time, its
  # box held until copied into place (read_bytes).
  def _inner(self, box: Box) -> Box:
    a = self.axis
    return Box(box.start[:a] + box.start[a + 1:],
               box.stop[:a] + box.stop[a + 1:])

  def _direct(self, member: LazyLeaf, dtype) -> bool:
    return isinstance(member, LazyValue) or (
        isinstance(member, LazyArray) and
        np.dtype(member.dtype) == np.dtype(dtype))

  def read_bytes(self, box: Box) -> int:
    """Host bytes one read of ``box`` holds beyond the box itself: one
    member's box (read before it is copied into place, for a member that
    cannot be read straight into the output, or one cast) and what that
    member's own read holds. Members are read into the output one at a
    time, so the parts are never all held next to a stacked copy."""
    inner = self._inner(box)
    members = self.members[box.start[self.axis]:box.stop[self.axis]]
    if not members:
      return 0
    extra = max(int(getattr(m, "read_bytes", lambda b: 0)(inner))
                for m in members)
    return inner.size * np.dtype(self.dtype).itemsize + extra

  async def read_box(self, box: Box) -> np.ndarray:
    out = np.empty(box.shape, self.dtype)
    await self.read_into(box, out)
    return out

  async def read_into(self, box: Box, out: np.ndarray) -> None:
    a, inner = self.axis, self._inner(box)
    lo = box.start[a]
    views = [(self.members[i], out[(slice(None),) * a + (i - lo,)])
             for i in range(lo, box.stop[a])]
    # A member whose read holds more than its box (a verified read of
    # recorded boxes straddling it: LazyArray.read_bytes) is read alone.
    direct = [self._direct(m, out.dtype) and
              not getattr(m, "read_bytes", lambda b: 0)(inner)
              for m, _ in views]
    await gather_or_cancel(*(m.read_into(inner, v)
                             for (m, v), d in zip(views, direct) if d))
    for (m, v), d in zip(views, direct):
      if not d:
        await m.read_into(inner, v)


class LazySlice(LazyLeaf):
  """Index ``index`` of ``axis`` of another leaf (one layer of a stack)."""

  def __init__(self, parent: LazyLeaf, axis: int, index: int,
               path: str = "<slice>"):
    if not 0 <= axis < len(parent.shape) or not 0 <= index < parent.shape[axis]:
      raise TreeMismatchError(
          f"{path}: cannot take index {index} of axis {axis} of "
          f"{parent.path!r} with shape {tuple(parent.shape)}")
    self.prng_impl = _derived_impl("slice", path, parent, axis,
                                   new_axis=False)
    self.parent, self.axis, self.index = parent, axis, index
    self.shape = tuple(parent.shape[:axis]) + tuple(parent.shape[axis + 1:])
    self.dtype = np.dtype(parent.dtype)
    self.path = path

  async def read_box(self, box: Box) -> np.ndarray:
    a = self.axis
    outer = Box(box.start[:a] + (self.index,) + box.start[a:],
                box.stop[:a] + (self.index + 1,) + box.stop[a:])
    return np.take(await self.parent.read_box(outer), 0, axis=a)


class LazyReshape(LazyLeaf):
  """Another leaf with a new shape of the same size. A box is read as the
  few contiguous parent boxes that cover it (see ``pieces``), one at a time,
  and their bytes are counted in the byte budget (``read_bytes``)."""

  def __init__(self, parent: LazyLeaf, shape: Sequence[int],
               path: str = "<reshape>"):
    shape = tuple(int(d) for d in shape)
    if math.prod(shape) != math.prod(parent.shape):
      raise TreeMismatchError(
          f"{path}: cannot reshape {parent.path!r} from {tuple(parent.shape)} "
          f"to {shape}")
    k = key_rank(parent)
    tail = tuple(parent.shape[len(parent.shape) - k:])
    if k and shape[len(shape) - k:] != tail:
      raise TreeMismatchError(
          f"{path}: cannot reshape {parent.path!r} ({parent.prng_impl} key "
          f"data {tuple(parent.shape)}) to {shape}: the last {k} dimensions "
          "are the keys' implementation's and must stay")
    self.prng_impl = parent.prng_impl
    self.parent, self.shape = parent, shape
    self.dtype = np.dtype(parent.dtype)
    self.path = path

  # A piece is read as is when the contiguous parent box covering it holds
  # at most this many times its elements; else the piece is halved.
  MAX_WASTE = 2

  def pieces(self, box: Box) -> list[tuple[Box, Box, Box]]:
    """(piece of ``box``, the new-shape box covering it contiguously, the
    parent box covering that contiguously), tiling ``box``; together the
    parent boxes hold at most MAX_WASTE times ``box``'s elements, so the
    parent is read once, only where needed (not whole per box)."""
    out, todo = [], [box]
    while todo:
      b = todo.pop()
      if b.size == 0:
        continue
      near, lo, hi = _contiguous_cover(b, self.shape)
      far = _flat_cover(lo, hi, tuple(self.parent.shape))
      if far.size <= self.MAX_WASTE * b.size or b.size == 1:
        out.append((b, near, far))
        continue
      d = next(i for i, n in enumerate(b.shape) if n > 1)
      mid = b.start[d] + b.shape[d] // 2
      todo.append(Box(b.start, b.stop[:d] + (mid,) + b.stop[d + 1:]))
      todo.append(Box(b.start[:d] + (mid,) + b.start[d + 1:], b.stop))
    return out

  def read_bytes(self, box: Box) -> int:
    """Host bytes one read of ``box`` holds beyond the box itself: the
    largest parent piece (pieces are read one at a time)."""
    itemsize = np.dtype(self.dtype).itemsize
    return max((far.size for _, _, far in self.pieces(box)),
               default=0) * itemsize

  async def read_box(self, box: Box) -> np.ndarray:
    out = np.empty(box.shape, self.dtype)
    await self.read_into(box, out)
    return out

  async def read_into(self, box: Box, out: np.ndarray) -> None:
    shape = tuple(self.parent.shape)
    for piece, near, far in self.pieces(box):
      data = np.ravel(await self.parent.read_box(far))
      lo = int(np.ravel_multi_index(near.start, self.shape)) if near.size else 0
      base = int(np.ravel_multi_index(far.start, shape)) if shape else 0
      got = data[lo - base:lo - base + near.size].reshape(near.shape)
      np.copyto(out[piece.relative_to(box)], got[piece.relative_to(near)],
                casting="unsafe")
      del data, got


def _contiguous_cover(box: Box, shape: tuple[int, ...]
                      ) -> tuple[Box, int, int]:
  """The smallest box of ``shape`` that covers ``box`` and is one
  contiguous run in row-major order; and that run's [lo, hi) flat range."""
  k = next((i for i, n in enumerate(box.shape) if n > 1), len(shape))
  # Dimensions after the first one wider than 1 must be whole.
  inner = [i for i in range(k + 1, len(shape)) if box.shape[i] != shape[i]]
  if inner:
    start = box.start[:k + 1] + (0,) * (len(shape) - k - 1)
    stop = box.stop[:k + 1] + tuple(shape[k + 1:])
    near = Box(start, stop)
  else:
    near = box
  lo = int(np.ravel_multi_index(near.start, shape)) if shape else 0
  return near, lo, lo + near.size


def _flat_cover(lo: int, hi: int, shape: tuple[int, ...]) -> Box:
  """The smallest contiguous box of ``shape`` holding flat range [lo, hi)."""
  if not shape:
    return Box((), ())
  a = np.unravel_index(lo, shape)
  b = np.unravel_index(hi - 1, shape)
  k = next((i for i in range(len(shape)) if a[i] != b[i]), len(shape) - 1)
  start = tuple(int(x) for x in a[:k + 1]) + (0,) * (len(shape) - k - 1)
  stop = (tuple(int(x) + 1 for x in a[:k]) + (int(b[k]) + 1,) +
          tuple(shape[k + 1:]))
  return Box(start, stop)
