"""Restore's last stage: read what this process needs of a lazy leaf under
the byte budget, cast it, and assemble the ``jax.Array`` (or host value).

``materialize`` reads each distinct box this process's devices hold once,
into 64-byte-aligned host memory that jax's CPU client adopts without a
copy, and places it on those devices with one batched ``device_put``.
It works on any lazy leaf by what it has (``read_box``, ``read_into``,
``place``, ``read_bytes``, ``scalar``), not by its type, so it imports none
of the leaf types (ckpt/restore/lazy.py imports it).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ckpt.restore import hostmem
from ckpt.format import prng
from ckpt.restore.hostmem import check_fits
from ckpt.restore.keyshape import logical_shape
from ckpt.restore.tasks import gather_or_cancel
from ckpt.store.limiter import ByteLimiter
from ckpt.shards.plan import Box


def is_floating(dtype) -> bool:
  return jnp.issubdtype(np.dtype(dtype), jnp.floating)


async def materialize(leaf, out_dtype: np.dtype,
                      sharding: jax.sharding.Sharding | None,
                      limiter: ByteLimiter):
  """Reads what this process needs of ``leaf`` and places it.

  With no sharding the whole value comes back as numpy; with a sharding each
  distinct box this process's devices hold is read once, cast and put on
  those devices.

  A key leaf (``leaf.prng_impl``) comes back as typed keys: with no
  sharding on jax's default device, else placed by ``sharding`` (a sharding
  of the keys' shape; each device's box spans the whole key data).
  """
  shape = tuple(leaf.shape)
  impl = leaf.prng_impl
  if sharding is None:
    data = await _read(leaf, Box((0,) * len(shape), shape), limiter, out_dtype)
    if impl:
      return prng.wrap(data, impl)
    if getattr(leaf, "scalar", False):  # a LazyValue of a numpy scalar
      return data[()]
    return data
  place = getattr(leaf, "place", None)
  if place is not None and not impl:  # a packed leaf: one call places it
    return await place(out_dtype, sharding, limiter)
  logical = logical_shape(leaf)
  tail = (slice(None),) * (len(shape) - len(logical))
  index_map = sharding.addressable_devices_indices_map(logical)
  by_box: dict[Box, list] = {}
  for device, index in index_map.items():
    by_box.setdefault(Box.from_index(tuple(index) + tail, shape),
                      []).append(device)
  placed: dict[Any, jax.Array] = {}

  async def one(box: Box, devices: list):
    grant = await limiter.acquire(box.size * np.dtype(out_dtype).itemsize
                                  + _extra_bytes(leaf, box))
    try:
      # Read into 64-byte-aligned memory: jax.device_put onto a CPU device
      # then adopts the buffer instead of copying it (jax's CPU client
      # aliases aligned host arrays); one batched call for all the devices.
      check_fits(leaf.path, box.shape, out_dtype)
      data = _aligned_empty(box.shape, out_dtype)
      await leaf.read_into(box, data)
      arrays = await put_on_devices(data, devices)
      if impl:  # a wrapper around each device's buffer: no copy, no program
        arrays = [prng.wrap(a, impl) for a in arrays]
      placed.update(zip(devices, arrays))
    finally:
      limiter.release(grant)

  await gather_or_cancel(*(one(b, ds) for b, ds in by_box.items()))
  # dtype: a process that holds no part of the target (a mesh of other
  # processes' devices) gets an array with no local shards.
  return jax.make_array_from_single_device_arrays(
      logical, sharding, [placed[d] for d in index_map],
      dtype=prng.info(impl).dtype if impl else out_dtype)


async def off_loop(devices: Sequence[Any], place: Callable[[], Any]) -> Any:
  """Runs ``place`` (a ``device_put`` or ``make_array_from_callback``)
  until its arrays are ready: inline on CPU devices, where jax adopts
  aligned host memory and nothing is copied, and on a worker thread on an
  accelerator, where the host-to-device copy takes as long as the read and
  would otherwise stop the event loop (every other read's completion and
  the next read's start) while it runs."""
  def run():
    return jax.block_until_ready(place())
  if all(d.platform == "cpu" for d in devices):
    return run()
  return await asyncio.to_thread(run)


async def from_callback(shape: tuple[int, ...], sharding: Any,
                        get: Callable[[Any], Any], dtype: Any) -> Any:
  """``jax.make_array_from_callback(shape, sharding, get)`` (``get``: a
  device's index to its host block), ready; off the event loop on an
  accelerator (``off_loop``)."""
  return await off_loop(
      list(sharding.addressable_devices),
      lambda: jax.make_array_from_callback(shape, sharding, get, dtype=dtype))


async def put_on_devices(data: np.ndarray, devices: Sequence[Any]) -> list:
  """``data`` on each of ``devices`` (one batched ``device_put``), ready;
  the copy off the event loop on an accelerator (``off_loop``)."""
  devices = list(devices)
  return await off_loop(devices, lambda: jax.device_put([data] * len(devices),
                                                        devices))


def _extra_bytes(leaf, box: Box) -> int:
  """Host bytes a read of ``box`` holds besides the box (a reshape's
  parent pieces); counted in the byte budget with it."""
  fn = getattr(leaf, "read_bytes", None)
  return int(fn(box)) if fn is not None else 0


_ALIGNMENT = 64  # what XLA's CPU client needs to alias a host buffer


# Below this, numpy's allocator never asks for huge pages: a buffer is a
# plain np.empty, aligned here (hostmem's per-buffer choice costs more than
# a small leaf's whole read).
_SMALL_BYTES = 1 << 20


def _aligned_empty(shape: Sequence[int], dtype, *, zeros: bool = False
                   ) -> np.ndarray:
  if not zeros:
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _SMALL_BYTES:
      raw = np.empty(nbytes + _ALIGNMENT, np.uint8)
      offset = -raw.__array_interface__["data"][0] % _ALIGNMENT
      return raw[offset:offset + nbytes].view(dtype).reshape(tuple(shape))
    # base pages where fresh huge pages are slow (ckpt.restore.hostmem)
    return hostmem.aligned_empty(shape, dtype, _ALIGNMENT)
  dtype = np.dtype(dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  raw = np.zeros(nbytes + _ALIGNMENT, np.uint8)
  offset = -raw.ctypes.data % _ALIGNMENT
  return raw[offset:offset + nbytes].view(dtype).reshape(tuple(shape))


def aligned_empty(shape: Sequence[int], dtype) -> np.ndarray:
  """Uninitialised 64-byte-aligned memory (see aligned_zeros)."""
  return _aligned_empty(shape, dtype)


def aligned_zeros(shape: Sequence[int], dtype) -> np.ndarray:
  """Zeros in 64-byte-aligned memory (a device_put onto a CPU device adopts
  it); the pages are the kernel's zero pages until written."""
  return _aligned_empty(shape, dtype, zeros=True)


async def _read(leaf, box: Box, limiter: ByteLimiter | None,
                out_dtype) -> np.ndarray:
  if limiter is None:
    data = await leaf.read_box(box)
  else:
    grant = await limiter.acquire(box.size * np.dtype(leaf.dtype).itemsize
                                  + _extra_bytes(leaf, box))
    try:
      data = await leaf.read_box(box)
    finally:
      limiter.release(grant)
  return np.asarray(data).astype(out_dtype, copy=False)
