"""The lazy leaf of a packed entry (``LazyPacked``) and what a restore
asks of the packed leaves it places: which boxes each reads, their
positions, the PackSet they share. Its bytes come from the step's packs
through ``pack_read.PackSet``, checked as they are read."""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import jax
import numpy as np

from ckpt.format import index as index_lib
from ckpt.format import pack_index
from ckpt.format import tree
from ckpt.restore import assemble
from ckpt.restore import placed
from ckpt.restore.hostmem import check_fits
from ckpt.restore.lazy import LazyLeaf
from ckpt.restore.pack_read import PackSet, Piece
from ckpt.shards.plan import Box


class LazyPacked(LazyLeaf):
  """A packed leaf of a checkpoint (pack_index.PackedEntry)."""

  packed = True

  def __init__(self, entry: pack_index.PackedEntry, position: int,
               packs: PackSet, batch: placed.Batch | None = None):
    self.entry = entry
    self.position = position
    self.packs = packs
    self.batch = batch or placed.Batch()  # shared by a restore's leaves
    self.path = tree.path_str(entry.path)
    self.shape = tuple(entry.shape)
    self.dtype = np.dtype(entry.dtype)
    self.prng_impl = entry.prng_impl or None

  async def _pieces(self) -> list[Piece]:
    return await self.packs.pieces_async(self.position)

  async def _piece(self, pc: Piece) -> np.ndarray:
    data = await self.packs.piece_bytes(pc, self.path)
    return np.frombuffer(data, self.dtype).reshape(pc.box.shape)

  async def read_box(self, box: Box) -> np.ndarray:
    check_fits(self.path, box.shape, self.dtype)
    if not box.size:
      return np.empty(box.shape, self.dtype)
    pieces = await self.packs.cover_async(self.position, box)
    for pc in pieces:
      if pc.box == box:
        return await self._piece(pc)  # a read-only view, no copy
    out = np.empty(box.shape, self.dtype)
    await self.read_into(box, out)
    return out

  async def read_into(self, box: Box, out: np.ndarray) -> None:
    if not box.size:
      return
    pieces = await self.packs.cover_async(self.position, box)
    for pc in pieces:
      lo = tuple(max(a, b) for a, b in zip(box.start, pc.box.start))
      hi = tuple(min(a, b) for a, b in zip(box.stop, pc.box.stop))
      if any(a >= b for a, b in zip(lo, hi)):
        continue
      part = Box(lo, hi)
      src = await self._piece(pc)
      np.copyto(out[part.relative_to(box)], src[part.relative_to(pc.box)],
                casting="unsafe")

  async def place(self, out_dtype, sharding, limiter) -> jax.Array:
    """The leaf on ``sharding``'s devices (assemble.materialize, not for
    keys): each distinct box read once (from the prefetched packs, its
    crc32c checked) into one 64-byte-aligned buffer for the leaf's boxes,
    cast, and every device's buffer made by ONE
    ``jax.make_array_from_callback`` (one batched transfer per leaf, not
    one ``device_put`` per box); on CPU devices that are all this
    process's, the whole leaf placed with the restore's others
    (``_place_whole``)."""
    shape = self.shape
    out_dtype = np.dtype(out_dtype)
    where = placed.placement(sharding, shape)
    if where.whole:  # on CPU devices: the whole leaf, placed with others
      return await self._place_whole(where, out_dtype, sharding, limiter)
    offsets, total = where.offsets(out_dtype.itemsize)
    grant = await limiter.acquire(total)
    try:
      check_fits(self.path, (total,), np.uint8)
      arena = assemble.aligned_empty((total,), np.uint8)
      data: dict[Box, np.ndarray] = {}
      for box, at in zip(where.boxes, offsets):
        out = arena[at:at + box.size * out_dtype.itemsize].view(
            out_dtype).reshape(box.shape)
        await self._fill(box, out)
        data[box] = out
      return await assemble.from_callback(shape, sharding,
                                          where.getter(data), out_dtype)
    finally:
      limiter.release(grant)

  async def _place_whole(self, where: placed.Placement, out_dtype: np.dtype,
                         sharding, limiter) -> jax.Array:
    """``place`` on CPU devices: each distinct box read into the whole leaf
    (64-byte aligned), placed by the restore's ``batch`` with the others:
    one ``device_put`` of the list, as the limit does."""
    total = math.prod(self.shape) * out_dtype.itemsize
    grant = await limiter.acquire(total)
    try:
      check_fits(self.path, self.shape, out_dtype)
      whole = assemble.aligned_empty(self.shape, out_dtype)
      rows = self.packs.exact(self.position, where.boxes)
      if rows is None:
        for box, where_in in zip(where.boxes, where.slices):
          await self._fill(box, whole[where_in])
      else:  # each box is one piece (prefetch found them), no cover to work
        for r, box, where_in in zip(rows, where.boxes, where.slices):
          got = self.packs.row_bytes(r, self.path)
          if got is None:  # (not prefetched)
            await self._fill(box, whole[where_in])
          else:
            np.copyto(whole[where_in], np.frombuffer(got, self.dtype).reshape(
                box.shape), casting="unsafe")
      return await self.batch.put(whole, sharding)
    finally:
      limiter.release(grant)

  async def _fill(self, box: Box, out: np.ndarray) -> None:
    """``box`` of the leaf into ``out``, cast, its crc32c checked."""
    pieces = (await self.packs.cover_async(self.position, box)
              if box.size else ())
    if len(pieces) == 1 and pieces[0].box == box:  # the usual case
      pc = pieces[0]
      got = self.packs.cached_bytes(pc, self.path)
      src = (np.frombuffer(got, self.dtype).reshape(box.shape)
             if got is not None else await self._piece(pc))
      np.copyto(out, src, casting="unsafe")
    else:
      await self.read_into(box, out)

  async def verify(self, wanted: Sequence[Box] | None = None) -> None:
    """Reads the pieces overlapping ``wanted`` (all if None) and checks
    each one's crc32c."""
    for pc in await self._pieces():
      if wanted is None or any(
          all(a0 < b1 and b0 < a1 for a0, a1, b0, b1 in
              zip(pc.box.start, pc.box.stop, w.start, w.stop))
          for w in wanted):
        await self.packs.piece_bytes(pc, self.path)


def lazy_leaves(index: index_lib.Index, step_kvstore: dict, context
                ) -> dict[int, LazyPacked]:
  """Position in the index -> LazyPacked, for every packed entry (one
  PackSet for them all); empty if there are none."""
  positions = [i for i, e in enumerate(index.leaves)
               if isinstance(e, pack_index.PackedEntry)]
  if not positions:
    return {}
  packs = PackSet(index, step_kvstore, context)
  batch = placed.Batch()
  return {i: LazyPacked(index.leaves[i], i, packs, batch) for i in positions}


def boxes_placed(sources: Sequence[Any], targets: Sequence[Any]
                 ) -> dict[int, list[Box]]:
  """Packed leaf position -> the boxes this process places, for each packed
  source restored as it is onto a target with a sharding of the same shape
  (so a restore reads only the pieces it places; other leaves: all)."""
  out: dict[int, list[Box]] = {}
  for src, tgt in zip(sources, targets):
    sharding = getattr(tgt, "sharding", None)
    if (not isinstance(src, LazyPacked) or
        not isinstance(sharding, jax.sharding.Sharding) or
        tuple(getattr(tgt, "shape", ())) != src.shape):
      continue
    try:  # (a sharding on an abstract mesh is resolved later, by _resolve)
      boxes = placed.placement(sharding, src.shape).boxes
    except Exception:  # pylint: disable=broad-except
      continue
    # The placement's own tuple (shared by the leaves placed alike: the
    # PackSet matches them as a group); a leaf placed twice, a list.
    got = out.get(src.position)
    out[src.position] = boxes if got is None else [*got, *boxes]
  return out


def packset_of(leaves: Iterable[Any]) -> PackSet | None:
  for leaf in leaves:
    if isinstance(leaf, LazyPacked):
      return leaf.packs
  return None


def positions(leaves: Iterable[Any]) -> list[int]:
  """The index positions of the packed leaves among ``leaves`` (the ones
  a transform derived from them included)."""
  out = []
  stack = list(leaves)
  while stack:
    leaf = stack.pop()
    if isinstance(leaf, LazyPacked):
      out.append(leaf.position)
    elif isinstance(leaf, LazyLeaf):
      stack.extend(getattr(leaf, "members", ()))
      parent = getattr(leaf, "parent", None)
      if parent is not None:
        stack.append(parent)
  return out
