"""Where a leaf's boxes go when it is placed by a sharding: the distinct
boxes of this process's devices, one aligned buffer for them all, and the
callback ``jax.make_array_from_callback`` asks with each device's index.
Worked out once per (sharding, shape): 10,000 small leaves share a few."""

from __future__ import annotations

import functools

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
