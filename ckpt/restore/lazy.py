"""Lazy leaves: shape and dtype known, data read only when asked, and then
only the boxes a process needs.

Restore transforms see checkpoint arrays as LazyLeaf objects, and may build
new ones from them (stack per-layer leaves, take one layer, reshape) without
reading anything. Only the leaves that end up in the result are read, and
only the boxes each process's devices hold.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import math
import os
from typing import Any, Callable, Sequence

import jax
import numpy as np
import tensorstore as ts

from ckpt.format import index as index_lib
from ckpt.store import ocdbt
from ckpt.format import prng
from ckpt.restore import readonce
from ckpt.format import tree
from ckpt.store import tsfuture
from ckpt.format import tsspec
from ckpt.errors import (CheckpointError, CorruptCheckpointError,
                         TreeMismatchError)
from ckpt.store.limiter import ByteLimiter
from ckpt.shards.plan import Box

DEFAULT_READ_BUDGET = 1 << 30


def run_sync(coro):
  """Runs a coroutine to completion from synchronous code.

  A private thread with its own event loop, so it works even when the caller
  already runs an event loop (never nests asyncio.run in the caller's thread).
  """
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(asyncio.run, coro).result()


class LazyLeaf(abc.ABC):
  """An array not read yet. Subclasses implement ``read_box``.

  ``read()`` / ``read_async()`` materialize it: with no sharding as a host
  numpy array, with a sharding as a ``jax.Array`` of which this process reads
  only the boxes its devices hold. A leaf returned by ``restore(lazy=True)``
  carries its target's sharding and dtype, so a bare ``read()`` places it
  where the target said.

  A typed PRNG key leaf holds its key data: ``shape`` and ``dtype`` are the
  data's (uint32, with the implementation's trailing dimensions) and
  ``prng_impl`` names the implementation; ``read()`` returns typed keys
  (a ``jax.Array`` of key dtype, on jax's default device when no sharding
  is given, else placed by that sharding of the keys' shape).

  Read once (``read_once``, see ckpt/restore/readonce.py): a leaf returned by a
  multi-process ``Checkpointer.restore(lazy=True)`` that restore would have
  read once, read with the sharding it was bound to (a bare ``read()``),
  reads only this process's distinct part of each replicated box and
  all-gathers the parts over the replicas. Such a read is a collective
  call, like a jitted function over global arrays: every process must read
  the same leaves, in the same order (a process that fails to read its part
  makes every process raise, naming it). Read with another sharding, or
  with read once off, a leaf reads its boxes on each process as usual (not
  collective).
  """

  shape: tuple[int, ...]
  dtype: np.dtype
  path: str = "<lazy>"
  sharding: jax.sharding.Sharding | None = None  # where read() puts it
  target_dtype: np.dtype | None = None          # what read() casts to
  budget: int = DEFAULT_READ_BUDGET
  prng_impl: str | None = None  # a key leaf: its implementation's name
  # restore(lazy=True): raises if the step this leaf reads was deleted or
  # replaced since the leaf was made (checked around every read), and an
  # object that keeps the step from this Checkpointer's retention while
  # any leaf of that restore is alive.
  guard: Callable[[], None] | None = None
  keepalive: Any = None
  # restore(lazy=True) from a Checkpointer: the restore's stats, which this
  # leaf's reads add to (readonce.LazyReads), and, for a leaf that reads
  # once, its plan (readonce.LazyPlan).
  reads: Any = None
  read_once: Any = None

  @abc.abstractmethod
  async def read_box(self, box: Box) -> np.ndarray:
    """The data in ``box`` (in this leaf's dtype).

    Args:
      box: the region to read (a ``Box`` of this leaf's shape).

    Raises ``CorruptCheckpointError`` when the stored data cannot be read.
    Not collective: the building block of transforms of your own.
    """

  async def read_into(self, box: Box, out: np.ndarray) -> None:
    """Reads ``box`` into ``out`` (of the box's shape), cast to its dtype.

    Args:
      box: the region to read.
      out: a numpy array of the box's shape.

    Raises what ``read_box`` raises. Not collective.
    """
    np.copyto(out, await self.read_box(box), casting="unsafe")

  @property
  def ndim(self) -> int:
    """The number of dimensions of ``shape``."""
    return len(self.shape)

  @property
  def size(self) -> int:
    """The number of elements."""
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    """The bytes of the stored data (``size`` times the stored dtype's)."""
    return self.size * np.dtype(self.dtype).itemsize

  def __repr__(self) -> str:
    return (f"{type(self).__name__}({self.path!r}, shape={self.shape}, "
            f"dtype={np.dtype(self.dtype).name})")

  def bind(self, sharding, dtype) -> "LazyLeaf":
    """A shallow copy whose read() targets ``sharding`` and ``dtype``.

    Args:
      sharding: where ``read()`` puts the leaf.
      dtype: what ``read()`` casts to (None: the stored dtype).

    Never raises. Not collective (no I/O).
    """
    out = _copy(self)
    out.sharding, out.target_dtype = sharding, (
        None if dtype is None or prng.is_key_dtype(dtype) else np.dtype(dtype))
    return out

  def _args(self, sharding, dtype):
    """(sharding, dtype, read-once plan or None) of one read."""
    sharding = sharding if sharding is not None else self.sharding
    dtype = np.dtype(dtype if dtype is not None else
                     (self.target_dtype or self.dtype))
    plan = self.read_once
    return sharding, dtype, (plan if plan is not None and
                             plan.applies(sharding) else None)

  async def read_async(self, sharding=None, dtype=None):
    """``read()`` for asyncio code: the same arguments, result and errors.

    Reads that overlap (``asyncio.gather`` of several) issue their read-once
    collectives in the order they were called.

    Args:
      sharding: as ``read``.
      dtype: as ``read``.

    Raises what ``read`` raises; collective when ``read`` is.
    """
    sharding, dtype, plan = self._args(sharding, dtype)
    if plan is None:
      return await self._guarded(dtype, sharding)
    ticket = plan.rounds.ticket()
    part, error = await self._read_part(plan, dtype, ticket)
    # The collective part on a thread of its own (not blocking the loop).
    return await asyncio.to_thread(plan.finish, ticket, part, error,
                                   self.path, self.shape, dtype)

  def read(self, sharding=None, dtype=None):
    """Reads the leaf now.

    Args:
      sharding: where the result goes: a ``jax.sharding.Sharding`` (this
        process reads only the boxes its devices hold), or None for the
        sharding the leaf was bound to (``restore(lazy=True)``: the
        target's), else a host numpy array.
      dtype: cast to this dtype (None: the bound target dtype, else the
        stored one).

    Returns:
      A ``jax.Array`` with that sharding, or a numpy array.

    Raises:
      CheckpointError: the step was deleted or saved again since the leaf
        was made (it never returns other data), or a read failed.
      CorruptCheckpointError: the stored data does not match its index.

    Collective only when the leaf reads once (a multi-process restore with
    read once on, read with the sharding it was bound to): then every
    process must read the same leaves in the same order. Otherwise local.
    """
    sharding, dtype, plan = self._args(sharding, dtype)
    if plan is None:
      return run_sync(self.read_async(sharding, dtype))
    ticket = plan.rounds.ticket()
    try:
      part, error = run_sync(self._read_part(plan, dtype, ticket))
    except BaseException as e:  # interrupted: the others must not wait for us
      plan.rounds.abandon(ticket, e, f"read of lazy leaf {self.path!r}")
      raise
    return plan.finish(ticket, part, error, self.path, self.shape,
                       dtype)  # on the caller's thread

  async def _read_part(self, plan, dtype, ticket: int):
    """Read once: (this process's part of the leaf's split, None) or
    (None, the error)."""
    try:
      return await self._guarded(dtype, plan.split), None
    except Exception as e:  # pylint: disable=broad-except
      return None, e
    except BaseException as e:  # cancelled: the others must not wait for us
      plan.rounds.abandon(ticket, e, f"read of lazy leaf {self.path!r}")
      raise

  async def _guarded(self, dtype, sharding):
    if self.guard is None:
      return await self._counted(dtype, sharding)
    await asyncio.to_thread(self.guard)
    try:
      out = await self._counted(dtype, sharding)
    except Exception:
      await asyncio.to_thread(self.guard)  # a vanished step explains it
      raise
    # Checked again: data of a step replaced while it was read is refused.
    await asyncio.to_thread(self.guard)
    return out

  async def _counted(self, dtype, sharding):
    """materialize (or, given a read-once split, read this process's part
    of it), counted in the restore's stats (``reads``) if any."""
    # assemble imports this module (the leaf types): imported here.
    from ckpt.restore.assemble import materialize
    limiter = ByteLimiter(self.budget)
    reads = self.reads

    def read():
      if hasattr(sharding, "read"):  # a readsplit split
        return sharding.read(self, dtype, limiter)
      return materialize(self, dtype, sharding, limiter)
    if reads is None:
      return await read()
    token = readonce.COUNTER.set(reads.counter)
    try:
      with reads.meter:
        return await read()
    finally:
      readonce.COUNTER.reset(token)
      reads.counter.note(limiter)
      reads.update()


def _copy(leaf: LazyLeaf) -> LazyLeaf:
  out = object.__new__(type(leaf))
  out.__dict__.update(leaf.__dict__)
  return out


def key_rank(leaf: LazyLeaf) -> int:
  """How many trailing dimensions of a key leaf's data are the key
  implementation's (0 for any other leaf)."""
  if not leaf.prng_impl:
    return 0
  key = prng.info(leaf.prng_impl)
  if key is None:
    raise TreeMismatchError(
        f"leaf {leaf.path!r}: holds PRNG keys of implementation "
        f"{leaf.prng_impl!r}, which this jax does not know")
  return len(key.key_shape)


def logical_shape(leaf: LazyLeaf) -> tuple[int, ...]:
  """The shape of what ``leaf`` reads as: for a key leaf the key array's
  shape (its data's without the trailing implementation dimensions)."""
  shape = tuple(leaf.shape)
  return shape[:len(shape) - key_rank(leaf)]


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


class LazyArray(LazyLeaf):
  """One stored array of a checkpoint."""

  def __init__(self, entry: index_lib.ArrayEntry, storage_format: str,
               step_kvstore: dict[str, Any], context: ts.Context):
    self.entry = entry
    self.path = tree.path_str(entry.path)
    self.shape = tuple(entry.shape)
    self.dtype = np.dtype(entry.dtype)
    self.prng_impl = getattr(entry, "prng_impl", "") or None
    group = getattr(entry, "ocdbt_group", None)
    if storage_format == "ocdbt" and group is not None:
      step_kvstore = ocdbt.group_database(step_kvstore, group)  # its merge group
    self._spec = tsspec.open_spec(
        storage_format, step_kvstore, entry.relpath, self.shape, self.dtype,
        tuple(entry.chunks), tsspec.codec_of(entry.codec))
    self._context = context
    self._store: ts.TensorStore | None = None

  async def _open(self) -> ts.TensorStore:
    if self._store is None:
      try:
        store = await tsfuture.wait(ts.open(
            self._spec, open=True, read=True, context=self._context))
      except Exception as e:
        raise CorruptCheckpointError(
            f"leaf {self.path!r}: cannot open its array at "
            f"{self.entry.relpath!r} as the index describes it (shape "
            f"{self.shape}, dtype {self.dtype}, chunks "
            f"{tuple(self.entry.chunks)}, codec {self.entry.codec}): {e}"
        ) from e
      found = (tuple(store.shape), np.dtype(store.dtype.numpy_dtype))
      if found != (self.shape, self.dtype):
        raise CorruptCheckpointError(
            f"leaf {self.path!r}: the index says shape {self.shape} dtype "
            f"{self.dtype}, the stored array has shape {found[0]} dtype "
            f"{found[1]}")
      self._store = store
    return self._store

  async def read_box(self, box: Box) -> np.ndarray:
    check_fits(self.path, box.shape, self.dtype)
    store = await self._open()
    self._count(box)
    try:
      return await tsfuture.wait(store[box.slices()].read())
    except Exception as e:
      raise CorruptCheckpointError(
          f"leaf {self.path!r}: reading {box.start}..{box.stop} failed: {e}"
      ) from e

  async def read_into(self, box: Box, out: np.ndarray) -> None:
    if out.dtype != self.dtype:
      return await super().read_into(box, out)
    store = await self._open()
    self._count(box)
    try:
      # TensorStore decodes straight into ``out``: no intermediate array.
      await tsfuture.wait(ts.array(out, copy=False, write=True).write(
          store[box.slices()]), abandonable=False)
    except Exception as e:
      raise CorruptCheckpointError(
          f"leaf {self.path!r}: reading {box.start}..{box.stop} failed: {e}"
      ) from e

  def _count(self, box: Box) -> None:
    """Counts the read in the restore's stats (readonce.COUNTER)."""
    readonce.count(box.start, box.stop, tuple(self.entry.chunks) or box.stop,
                   self.dtype.itemsize)


class LazyValue(LazyLeaf):
  """A value already in memory (an inline leaf, a fallback, a user array).

  With ``prng_impl`` the value is key data (see LazyLeaf)."""

  def __init__(self, value: Any, path: str = "<value>", *,
               prng_impl: str | None = None):
    self.value = np.asarray(value)
    self.scalar = isinstance(value, np.generic)
    self.shape = tuple(self.value.shape)
    self.dtype = self.value.dtype
    self.path = path
    self.prng_impl = prng_impl or None

  async def read_box(self, box: Box) -> np.ndarray:
    return np.asarray(self.value[box.slices()])


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
    direct = [(m, v) for m, v in views if self._direct(m, out.dtype)]
    await gather_or_cancel(*(m.read_into(inner, v) for m, v in direct))
    for m, v in views:
      if not self._direct(m, out.dtype):
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


class LazyPlaced(LazyLeaf):
  """A jax.Array that spans processes (a fallback leaf): it is never read
  box by box; read() places (reshards) it on the caller's thread."""

  def __init__(self, array: jax.Array, path: str = "<array>"):
    self.array, self.path = array, path
    if prng.is_key_dtype(array.dtype):  # described by its key data
      data = jax.eval_shape(jax.random.key_data, array)
      self.shape, self.dtype = tuple(data.shape), np.dtype(data.dtype)
      self.prng_impl = prng.impl_name(array)
    else:
      self.shape, self.dtype = tuple(array.shape), np.dtype(array.dtype)

  async def read_box(self, box: Box) -> np.ndarray:
    raise TreeMismatchError(
        f"{self.path}: spans processes and cannot be read box by box; "
        "read() it whole")

  def read(self, sharding=None, dtype=None):
    sharding = sharding if sharding is not None else self.sharding
    dtype = dtype if dtype is not None else self.target_dtype
    x = self.array if sharding is None else jax.device_put(self.array, sharding)
    if dtype is None or x.dtype == dtype or self.prng_impl:
      return x  # keys are never cast
    return x.astype(dtype)

  async def read_async(self, sharding=None, dtype=None):
    return self.read(sharding, dtype)


async def gather_or_cancel(*coros):
  """asyncio.gather that, on the first failure, cancels and awaits the rest
  (so no read keeps running after a restore has failed)."""
  tasks = [asyncio.ensure_future(c) for c in coros]
  try:
    return await asyncio.gather(*tasks)
  except BaseException:
    for t in tasks:
      t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    raise


def host_memory_bytes() -> int:
  """This host's physical memory (a large number where unknown)."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return 1 << 62


def check_fits(path: str, shape: Sequence[int], dtype) -> None:
  """Refuses, before allocating, a read of more bytes than this host has:
  shapes come from an index (index.check_extent bounds them far above any
  real leaf), and one box is allocated whole."""
  nbytes = math.prod(shape) * np.dtype(dtype).itemsize
  if nbytes > host_memory_bytes():
    raise CheckpointError(
        f"leaf {path!r}: reading a box of shape {tuple(shape)} needs "
        f"{nbytes} bytes at once, more than this host's "
        f"{host_memory_bytes()} bytes of memory; restore it with a target "
        "sharding so that each process reads only its part (or the index "
        "is not what was saved)")
