"""Lazy leaves: a stored array whose shape and dtype are known and whose data
is read only when asked, and then only the boxes a process needs."""

from __future__ import annotations

import asyncio
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from ckpt import index as index_lib
from ckpt import tree
from ckpt import tsspec
from ckpt.errors import CorruptCheckpointError
from ckpt.limiter import ByteLimiter
from ckpt.plan import Box


class LazyArray:
  """One array leaf of a checkpoint, not read yet."""

  def __init__(self, entry: index_lib.ArrayEntry, storage_format: str,
               step_kvstore: dict[str, Any], context: ts.Context):
    self.entry = entry
    self.path = tree.path_str(entry.path)
    self.shape = entry.shape
    self.dtype = np.dtype(entry.dtype)
    self._spec = tsspec.open_spec(storage_format, step_kvstore, entry.relpath)
    self._context = context
    self._store: ts.TensorStore | None = None

  def __repr__(self) -> str:
    return f"LazyArray({self.path!r}, shape={self.shape}, dtype={self.dtype})"

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape)) * self.dtype.itemsize

  async def _open(self) -> ts.TensorStore:
    if self._store is None:
      try:
        store = await ts.open(self._spec, open=True, read=True,
                              context=self._context)
      except Exception as e:
        raise CorruptCheckpointError(
            f"leaf {self.path!r}: cannot open its array at "
            f"{self.entry.relpath!r}: {e}") from e
      found = (tuple(store.shape), np.dtype(store.dtype.numpy_dtype))
      if found != (self.shape, self.dtype):
        raise CorruptCheckpointError(
            f"leaf {self.path!r}: the index says shape {self.shape} dtype "
            f"{self.dtype}, the stored array has shape {found[0]} dtype "
            f"{found[1]}")
      self._store = store
    return self._store

  async def read_box(self, box: Box) -> np.ndarray:
    store = await self._open()
    try:
      return await store[box.slices()].read()
    except Exception as e:
      raise CorruptCheckpointError(
          f"leaf {self.path!r}: reading {box.start}..{box.stop} failed: {e}"
      ) from e


def is_floating(dtype) -> bool:
  return jnp.issubdtype(np.dtype(dtype), jnp.floating)


async def materialize(leaf: LazyArray | np.ndarray, out_dtype: np.dtype,
                      sharding: jax.sharding.Sharding | None,
                      limiter: ByteLimiter):
  """Reads what this process needs of ``leaf`` and places it.

  With no sharding the whole value comes back as numpy; with a sharding each
  distinct box this process's devices hold is read once, cast and put on
  those devices.
  """
  shape = tuple(leaf.shape)
  if sharding is None:
    data = await _read(leaf, Box((0,) * len(shape), shape), limiter, out_dtype)
    return data
  index_map = sharding.addressable_devices_indices_map(shape)
  by_box: dict[Box, list] = {}
  for device, index in index_map.items():
    by_box.setdefault(Box.from_index(index, shape), []).append(device)
  placed: dict[Any, jax.Array] = {}

  async def one(box: Box, devices: list):
    grant = await limiter.acquire(box.size * np.dtype(out_dtype).itemsize)
    try:
      data = await _read(leaf, box, None, out_dtype)
      for d in devices:
        placed[d] = jax.device_put(data, d)
      for d in devices:
        placed[d].block_until_ready()
    finally:
      limiter.release(grant)

  await asyncio.gather(*(one(b, ds) for b, ds in by_box.items()))
  return jax.make_array_from_single_device_arrays(
      shape, sharding, [placed[d] for d in index_map])


async def _read(leaf, box: Box, limiter: ByteLimiter | None, out_dtype):
  if isinstance(leaf, LazyArray):
    if limiter is None:
      data = await leaf.read_box(box)
    else:
      grant = await limiter.acquire(box.size * leaf.dtype.itemsize)
      try:
        data = await leaf.read_box(box)
      finally:
        limiter.release(grant)
  else:
    # np.asarray again: indexing a 0-d array with () gives a numpy scalar.
    data = np.asarray(np.asarray(leaf)[box.slices()])
  return data.astype(out_dtype, copy=False)
