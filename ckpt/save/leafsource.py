"""Leaves that a save reads box by box while it writes them (``ckpt import``).

A ``LeafSource`` is a leaf of the state given to ``Checkpointer.save`` that
stands for an array stored elsewhere (an Orbax checkpoint's zarr array,
opened with TensorStore): its shape, dtype and saved sharding are known, its
data is read only when the save writes it. The save reads each box it writes
after the box's bytes are granted by its byte limiter and drops it once the
box is written (ckpt/save/write.py), so an import holds at most
``concurrent_bytes`` of data, not the whole state.

- ``sharding``: the sharding the source was saved with, as a
  ``NamedSharding`` over a ``jax.sharding.AbstractMesh`` (axis names and
  sizes; no devices needed, so it is the same whatever devices the importing
  host has), or None for a host value. The save records it as the leaf's
  saved sharding and cuts the leaf along it: each box written is one saved
  shard, i.e. one source chunk (Orbax writes a chunk per shard), or a part of
  one when a shard is larger than the budget.
- A box that cuts a source chunk (a replicated leaf larger than the budget is
  one Orbax chunk) cannot be read alone: TensorStore decodes the whole chunk.
  Such reads go through ``RegionCache``: one decoded region (the chunks
  covering the box) at a time for the whole import, so each chunk is decoded
  once and host memory holds at most the budget plus that region.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from ckpt.shards import placement as placement_lib
from ckpt.shards import plan as plan_lib
from ckpt.errors import CheckpointError


class RegionCache:
  """The last decoded region of a source, shared by every LeafSource of one
  import (one region at a time: memory holds one, not one per leaf)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._key: tuple | None = None
    self._data: np.ndarray | None = None
    self.decodes = 0  # regions read (tests check that a chunk is read once)

  def read(self, source: "LeafSource", hull: plan_lib.Box) -> np.ndarray:
    with self._lock:
      key = self._key
      if key is None or key[0] is not source or key[1] != hull:
        self._key, self._data = None, None  # dropped before the next is read
        self._data = source.read_now(hull.slices())
        self._key = (source, hull)
        self.decodes += 1
      return self._data


class PendingRead:
  """One box of a LeafSource being read: ``result()`` is the box as a new
  numpy array (the save's own: nothing else refers to it)."""

  def __init__(self, source: "LeafSource", box: plan_lib.Box):
    self.source, self.box = source, box
    self._hull = source.hull(box)
    # A box of whole chunks is read at once (reads overlap, like the device
    # copies of a jax.Array's shards); one cutting a chunk waits for the cache.
    self._future = (source.store[box.slices()].read()
                    if self._hull == box else None)

  def result(self) -> np.ndarray:
    if self._future is not None:
      try:
        return self._future.result()
      except Exception as e:
        raise self.source.error(self.box, e) from e
    region = self.source.cache.read(self.source, self._hull)
    return np.array(region[self.box.relative_to(self._hull)], copy=True)


class LeafSource:
  """An array leaf read box by box by the save that writes it."""

  def __init__(self, store: ts.TensorStore, *, describe: str,
               sharding: Any = None, prng_impl: str = "",
               cache: RegionCache | None = None):
    self.store = store
    self.describe = describe  # for errors: where the data comes from
    self.shape = tuple(int(n) for n in store.shape)
    self.dtype = np.dtype(store.dtype.numpy_dtype)
    self.sharding = sharding
    self.prng_impl = prng_impl
    self.cache = cache if cache is not None else RegionCache()
    chunk = store.chunk_layout.read_chunk.shape
    self.chunks = tuple(max(1, min(int(c or n), n) if n else 1)
                        for c, n in zip(chunk or self.shape, self.shape))

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.dtype.itemsize

  @property
  def inline_ok(self) -> bool:
    """Whether a small one may be stored inline, as a small jax.Array is
    when it is fully replicated (inline values record no sharding)."""
    return self.sharding is None or self.sharding.is_fully_replicated

  def error(self, box: plan_lib.Box, e: Exception) -> CheckpointError:
    return CheckpointError(
        f"reading {box.start}..{box.stop} of {self.describe} failed: {e}")

  def read_now(self, slices: tuple[slice, ...]) -> np.ndarray:
    try:
      return self.store[slices].read().result()
    except Exception as e:
      raise self.error(plan_lib.Box.from_index(slices, self.shape), e) from e

  def read_all(self) -> np.ndarray:
    return self.read_now(tuple(slice(0, n) for n in self.shape))

  def read(self, box: plan_lib.Box) -> PendingRead:
    return PendingRead(self, box)

  def hull(self, box: plan_lib.Box) -> plan_lib.Box:
    """The smallest box of whole source chunks that holds ``box``."""
    start = tuple(a - a % c for a, c in zip(box.start, self.chunks))
    stop = tuple(min(n, -(-b // c) * c)
                 for b, c, n in zip(box.stop, self.chunks, self.shape))
    return plan_lib.Box(start, stop)

  def placement(self, process: int, process_count: int) -> plan_lib.Placement:
    """Where the save cuts this leaf: along its saved sharding (a box per
    saved shard; the saved mesh's positions spread over the processes of
    the job that imports, in order), else as a host value."""
    s = self.sharding
    if isinstance(s, jax.sharding.NamedSharding):
      axes = placement_lib.spec_axes(tuple(s.spec), len(self.shape))
      if axes is not None:
        info = _mesh_info(tuple(s.mesh.axis_names), tuple(s.mesh.axis_sizes),
                          process, process_count)
        got = info.named(axes, self.shape)
        if got is not None:
          return got
    return placement_lib.host_replicated(self.shape, process, process_count)


@functools.lru_cache(maxsize=64)
def _mesh_info(names: tuple[str, ...], sizes: tuple[int, ...], process: int,
               process_count: int) -> placement_lib.MeshInfo:
  n = math.prod(sizes)
  positions = np.arange(n, dtype=np.int64)
  return placement_lib.make_mesh_info(
      names, positions.reshape(sizes),
      (positions * process_count // max(n, 1)).reshape(sizes), process)
