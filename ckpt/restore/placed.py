"""Where a leaf's boxes go when it is placed by a sharding: the distinct
boxes of this process's devices, one aligned buffer for them all, and the
callback ``jax.make_array_from_callback`` asks with each device's index.
Worked out once per (sharding, shape): 10,000 small leaves share a few."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import jax
import numpy as np

from ckpt.shards.plan import Box


def placed_boxes(sharding, shape: tuple[int, ...]) -> dict[tuple, Box]:
  """The distinct boxes ``sharding`` puts on this process's devices, keyed
  by their index (``_key``): what a placement of the leaf reads. Worked
  out once per (sharding, shape) (10,000 small leaves share a few); the
  dict returned is shared: read it, never change it."""
  return placement(sharding, shape).by_key


class Placement:
  """What placing a leaf of ``shape`` by ``sharding`` needs, worked out
  once per pair (``placement``): the distinct boxes of this process's
  devices (``by_key``, ``boxes``), where each sits in one aligned buffer
  of them all, per itemsize, and the box of each index jax's
  ``make_array_from_callback`` asks for."""

  def __init__(self, sharding, shape: tuple[int, ...]):
    self.shape = shape
    # jax keeps this map (cached per sharding and shape) and passes its
    # index tuples to the callback: held here, so that their ids stay
    # theirs, each is found by id (a slice cannot be hashed before 3.12).
    self.indices = sharding.addressable_devices_indices_map(shape)
    self.by_key: dict[tuple, Box] = {}
    self.by_id: dict[int, Box] = {}
    for index in self.indices.values():
      key = _key(index)
      box = self.by_key.get(key)
      if box is None:
        box = self.by_key[key] = Box.from_index(index, shape)
      self.by_id[id(index)] = box
    self.boxes = tuple(dict.fromkeys(self.by_key.values()))
    self._offsets: dict[int, tuple[list[int], int]] = {}
    # Every device is this process's and a CPU device: the leaf is placed
    # whole, with the others of its restore (``Batch``); each box's place
    # in the whole.
    self.whole = (sharding.is_fully_addressable and
                  all(d.platform == "cpu" for d in self.indices))
    self.slices = [box.slices() for box in self.boxes]

  def offsets(self, itemsize: int) -> tuple[list[int], int]:
    """(each box's offset in the leaf's buffer, its size): 64-byte
    aligned, as jax's CPU client needs to adopt a buffer uncopied."""
    got = self._offsets.get(itemsize)
    if got is None:
      at, total = [], 0
      for box in self.boxes:
        at.append(total)
        total += -(-box.size * itemsize // 64) * 64
      got = self._offsets[itemsize] = (at, total)
    return got

  def getter(self, data: dict[Box, np.ndarray]):
    """The callback of ``make_array_from_callback`` over ``data``."""
    by_id, by_key, shape = self.by_id, self.by_key, self.shape

    def get(index):
      box = by_id.get(id(index))
      if box is None:
        box = by_key.get(_key(index)) or Box.from_index(index, shape)
      return data[box]
    return get


class Batch:
  """The whole leaves of one restore placed by one ``jax.device_put`` of
  their list onto their shardings (CPU devices: the host buffers are what
  jax keeps), as the limit does: 10,000 small leaves each placed by its own
  ``make_array_from_callback`` cost several times that. ``put`` queues a
  leaf; the queue is placed once the event loop has run what was ready
  when the first leaf of it came (the other leaves' reads), so a restore's
  leaves go in one or a few calls. A failure fails every leaf of its call."""

  def __init__(self):
    self._queue: list[tuple[np.ndarray, Any, asyncio.Future]] = []

  def put(self, value: np.ndarray, sharding) -> asyncio.Future:
    """``value`` (a whole leaf) on ``sharding``, ready, once placed."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    if not self._queue:
      loop.call_soon(self._place)
    self._queue.append((value, sharding, fut))
    return fut

  def _place(self) -> None:
    queue, self._queue = self._queue, []
    try:
      arrays = jax.block_until_ready(jax.device_put(
          [v for v, _, _ in queue], [s for _, s, _ in queue]))
    except BaseException as e:  # pylint: disable=broad-except
      for _, _, fut in queue:
        if not fut.done():
          fut.set_exception(e)
      return
    for a, (_, _, fut) in zip(arrays, queue):
      if not fut.done():  # (a cancelled restore)
        fut.set_result(a)


def placement(sharding, shape) -> Placement:
  shape = tuple(shape)
  try:
    return _cached(sharding, shape)
  except TypeError:  # a sharding that cannot be hashed
    return Placement(sharding, shape)


@functools.lru_cache(maxsize=1024)
def _cached(sharding, shape: tuple[int, ...]) -> Placement:
  return Placement(sharding, shape)


def _key(index) -> tuple:
  return tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s
               for s in index)
