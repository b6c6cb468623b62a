"""Stage 3 of a save, staging off the devices: where one owned box comes from (its
device-to-host copy started, or a host leaf's view, or a LeafSource's read), and the box on the
host in its stored dtype, safe to write after save() returns. Used by the writing of array
boxes (ckpt/save/write.py) and of packs (ckpt/save/pack.py).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ckpt.errors import CheckpointError
from ckpt.format import tree
from ckpt.save import leafsource
from ckpt.shards import plan as plan_lib

def device_piece(leaf: Any, write: plan_lib.Write) -> Any:
  """Stage 3a: where one owned box comes from, its device-to-host copy
  started.

  A jax.Array's box is its device buffer, or on an accelerator a slice of
  it cut on the device (so only the box moves); ``start_host_copy``
  starts the transfer (into pinned host memory) without waiting, so the
  transfers of every box that fits in the budget (of all local devices)
  overlap and ``_host_box`` only waits for them. On CPU devices nothing is
  copied (``_host_box`` takes a view of the buffer, cut on the host). A
  host numpy leaf is cut as a view.
  """
  src = leaf.source
  if isinstance(src, leafsource.LeafSource):
    return src.read(write.box)  # started now, waited for by _host_box
  if not isinstance(src, jax.Array):
    return src[write.box.slices()]
  shard = next(s for s in src.addressable_shards if s.device.id == write.device)
  piece = shard.data
  if not cut_on_device(shard.device):
    return piece  # CPU: nothing to copy (np.asarray is a view)
  return _box_to_host(piece, write)


def _box_to_host(piece: jax.Array, write: plan_lib.Write) -> jax.Array:
  """The box of an accelerator shard buffer (cut on the device first when
  it is part of the shard: only the box moves), its copy to the host
  started."""
  if write.box != write.shard:
    piece = piece[write.box.relative_to(write.shard)]
  return start_host_copy(piece)


# Whether each accelerator device has pinned host memory, asked once.
_PINNED: dict[Any, bool] = {}

# Stage accelerator boxes in pinned host memory (True) or let
# ``copy_to_host_async`` fill fresh pageable memory (False).
PINNED_STAGING = True


def start_host_copy(piece: jax.Array) -> jax.Array:
  """Start the device-to-host copy of one accelerator buffer; returns what
  ``np.asarray`` waits for.

  Into pinned host memory where the device has it: a copy into fresh
  pageable memory faults in every 4 KiB page as the DMA lands (an H100 ran
  at 1.8 GB/s: 2.4 s for 4 GiB, one minor fault per page), while XLA keeps
  pinned host buffers in its own pool once freed, so every save after the
  first copies at the link's speed (0.08 s for 4 GiB: ``python -m
  scripts.gpu_d2h``). ``np.asarray`` of the result is a view of the pinned
  buffer that keeps it alive; dropping the view returns it to the pool.
  Elsewhere, or if the pinned copy cannot start, ``copy_to_host_async``.
  """
  device = next(iter(piece.devices()))
  pinned = _PINNED.get(device)
  if pinned is None:
    pinned = _PINNED[device] = any(
        m.kind == "pinned_host" for m in device.addressable_memories())
  if pinned and PINNED_STAGING:
    try:
      return jax.device_put(piece,
                            piece.sharding.with_memory_kind("pinned_host"))
    except Exception:  # pylint: disable=broad-except
      _PINNED[device] = False  # e.g. no pinned memory left: pageable from now
  piece.copy_to_host_async()
  return piece


# Leaf types known to be jax.Arrays: ``isinstance(x, jax.Array)`` goes
# through jax's metaclass, a few us a call; a set lookup by type does not.
_ARRAY_TYPES: set[type] = set()


def is_array(x: Any) -> bool:
  """``isinstance(x, jax.Array)``, cached by type (10,000 leaves a save)."""
  if type(x) in _ARRAY_TYPES:
    return True
  if isinstance(x, jax.Array):
    _ARRAY_TYPES.add(type(x))
    return True
  return False


class ShardLookup:
  """One save's way from a write's device to the device buffer it reads.

  ``addressable_shards`` builds a Shard object per device of every array
  (over 100 us a leaf on 8 devices, the largest per-leaf cost of saving
  10,000 small leaves); ``addressable_data(i)`` costs about 1 us. Where each
  device sits in that list, and whether the buffers are host views (CPU
  devices), depend on the sharding and the shape only: worked out once per
  pair, from the first array that has them.

  A view of a CPU device buffer is taken with the buffer protocol
  (``memoryview``, about 1 us): ``np.asarray`` goes through jax's
  ``__array__`` and costs several times that, which an async save of
  thousands of small leaves pays while the caller waits. Dtypes the
  protocol refuses (bfloat16, the float8 types) take ``np.asarray``. Both
  hold the buffer alive when the caller deletes or donates its array
  (tests/save/test_zero_copy.py).
  """

  def __init__(self):
    self._by_layout: dict[tuple, tuple[dict, bool]] = {}
    self._protocol: dict[np.dtype, bool] = {}  # dtype -> memoryview works

  def _layout(self, src: jax.Array) -> tuple[dict, bool]:
    key = (src.sharding, src.shape)
    got = self._by_layout.get(key)
    if got is None:
      shards = src.addressable_shards
      got = self._by_layout[key] = (
          {s.device.id: i for i, s in enumerate(shards)},
          all(not cut_on_device(s.device) for s in shards))
    return got

  def recipe(self, leaf: Any, write: plan_lib.Write) -> tuple[int, int]:
    """How ``take`` stages ``write``'s box of ``leaf`` (a LeafPlan): (the
    buffer's position in ``addressable_data``, or -1; one of the kinds
    below). It depends on the layout only (the source's type, sharding,
    shape and dtype, the stored dtype), so a save plan keeps it while the
    state keeps its layout (ckpt/save/pack.py)."""
    return self.box_recipe(self.leaf_recipe(leaf), write)

  def leaf_recipe(self, leaf: Any) -> tuple[dict | None, int]:
    """The part of ``recipe`` that is the same for every box of ``leaf``:
    (where each device's buffer is, or None; the kind of a whole-buffer
    box: PIECE, VIEW_BUFFER or VIEW_ARRAY, or OTHER)."""
    src = leaf.source
    if not is_array(src):
      return None, OTHER
    where, on_host = self._layout(src)
    if not on_host or src.dtype != _dtype(leaf.entry.dtype):
      return where, PIECE
    protocol = self._protocol.get(src.dtype)
    if protocol is None:
      protocol = self._protocol[src.dtype] = _has_protocol(
          src.addressable_data(0))
    return where, VIEW_BUFFER if protocol else VIEW_ARRAY

  @staticmethod
  def box_recipe(of_leaf: tuple[dict | None, int],
                 write: plan_lib.Write) -> tuple[int, int]:
    """``recipe`` of ``write`` from its leaf's ``leaf_recipe``."""
    where, kind = of_leaf
    if where is None:
      return -1, kind
    i = where[write.device]
    if kind != PIECE and write.box is not write.shard and (
        write.box != write.shard):
      return i, VIEW_CUT
    return i, kind

  def piece(self, src: jax.Array, write: plan_lib.Write) -> Any:
    """The device buffer ``write`` reads (cut on the device first on an
    accelerator when the box is part of it, its copy to the host started)."""
    where, on_host = self._layout(src)
    if on_host:  # a view of the buffer: any replica holds the same bytes
      return src.addressable_data(where[write.device])
    # (addressable_data: no Shard objects)
    return _box_to_host(src.addressable_data(where[write.device]), write)


_DTYPES: dict[str, np.dtype] = {}


def _dtype(name: str) -> np.dtype:
  """``np.dtype(name)``, parsed once per name."""
  got = _DTYPES.get(name)
  if got is None:
    got = _DTYPES[name] = np.dtype(name)
  return got


def _has_protocol(buf: jax.Array) -> bool:
  """Whether the buffer protocol exports ``buf`` (a CPU device buffer) in
  its own dtype, as ``np.asarray`` would see it."""
  try:
    view = memoryview(buf)
  except (BufferError, TypeError, ValueError):  # bfloat16: BufferError
    return False
  return np.asarray(view).dtype == buf.dtype and view.shape == buf.shape


# How a box is staged (``ShardLookup.recipe``): a view of a CPU device buffer
# (the whole buffer through the buffer protocol, as an ndarray, or a box cut
# from it), its device-to-host copy started (``ShardLookup.piece``), or
# another source (``device_piece``).
VIEW_BUFFER, VIEW_ARRAY, VIEW_CUT, PIECE, OTHER = range(5)


def take(leaf: Any, write: plan_lib.Write, where: int, kind: int) -> Any:
  """The box of a view kind (``ShardLookup.recipe``): a read-only view of
  the CPU device buffer at position ``where`` of ``leaf.source``."""
  buf = leaf.source.addressable_data(where)
  if kind == VIEW_BUFFER:
    return memoryview(buf)
  host = np.asarray(buf)
  return host if kind == VIEW_ARRAY else host[
      write.box.relative_to(write.shard)]


def cut_on_device(device) -> bool:
  """Whether a box that is part of a shard is sliced on the device before
  its transfer (accelerators), not on the host (CPU: a view, no copy)."""
  return device.platform != "cpu"


def is_view(leaf: Any, piece: Any) -> bool:
  """Whether ``_host_box`` of ``piece`` only takes a view (a CPU device
  buffer in the stored dtype): work too small for a worker thread."""
  return (isinstance(piece, jax.Array)
          and piece.dtype == np.dtype(leaf.entry.dtype)
          and all(d.platform == "cpu" for d in piece.devices()))


def _host_box(leaf: Any, write: plan_lib.Write, piece: Any,
              borrow: bool = False) -> np.ndarray:
  """Stage 3b: one owned box on the host, in the stored dtype, safe to
  write after save() returns (the caller may then delete, donate or
  overwrite its arrays).

  From a CPU device the box is a read-only view of the device buffer, not
  a copy, in async mode too: the view keeps the buffer alive when the
  caller deletes its array or drops the last reference, and XLA does not
  donate a buffer that has outside references (a jitted step that donates
  it allocates its output instead, with no error), so the data cannot
  change under the write; tests/save/test_zero_copy.py shows each case. From an
  accelerator ``np.asarray`` waits for the transfer ``device_piece``
  started and is ckpt's own copy; a cast makes a new array anyway. A host
  numpy leaf is mutable, so it is copied unless the caller waits for the
  whole save (``borrow``).
  """
  if isinstance(piece, leafsource.PendingRead):
    host, owned = piece.result(), True  # a new array, ckpt's own
  elif isinstance(piece, jax.Array):
    host = np.asarray(piece)  # CPU: a view; accelerator: the host copy
    if host.shape != write.box.shape:  # a CPU device's whole buffer
      host = host[write.box.relative_to(write.shard)]  # a view of the box
    owned = True
  else:
    host, owned = piece, borrow
  dtype = np.dtype(leaf.entry.dtype)
  if host.dtype != dtype:
    return host.astype(dtype, order="C")
  return host if owned else np.array(host, order="C", copy=True)


def host_box(leaf: Any, write: plan_lib.Write, piece: Any,
             borrow: bool) -> np.ndarray:
  """``_host_box``, a failure raised as a CheckpointError naming the leaf and
  the box (a deleted or donated array is the usual cause)."""
  try:
    return _host_box(leaf, write, piece, borrow)
  except CheckpointError as e:  # a LeafSource's read: it says what failed
    raise CheckpointError(f"leaf {tree.path_str(leaf.parts)!r}: {e}") from e
  except Exception as e:
    raise CheckpointError(
        f"leaf {tree.path_str(leaf.parts)!r}: copying {write.box.start}.."
        f"{write.box.stop} to the host failed (was the array deleted or "
        f"donated before save() returned?): {e}") from e
