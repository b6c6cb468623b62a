"""Lazy leaves: shape and dtype known, data read only when asked, and then
only the boxes a process needs.

Restore transforms see checkpoint arrays as LazyLeaf objects, and may build
new ones from them (stack per-layer leaves, take one layer, reshape) without
reading anything. Only the leaves that end up in the result are read, and
only the boxes each process's devices hold.

Here: the base class ``LazyLeaf``, stored arrays (``LazyArray``), values in
memory (``LazyValue``) and arrays spanning processes (``LazyPlaced``); the
leaves transforms derive (stack, slice, reshape) are in
ckpt/restore/lazy_derived.py.
"""

from __future__ import annotations

import abc
import asyncio
import math
from typing import Any, Callable

import jax
import numpy as np
import tensorstore as ts

from ckpt.store import ocdbt
from ckpt.format import prng
from ckpt.restore import rawread
from ckpt.restore import readcount
from ckpt.restore import verified
from ckpt.format import tree
from ckpt.store import deadline as deadline_lib
from ckpt.store import tsfuture
from ckpt.format import tsspec
from ckpt.errors import CorruptCheckpointError, TreeMismatchError
from ckpt.restore.assemble import materialize
from ckpt.restore.hostmem import check_fits
# logical_shape: callers' lazy.logical_shape (ckpt/restore/keyshape.py).
from ckpt.restore.tasks import run_sync
from ckpt.store.limiter import ByteLimiter
from ckpt.shards.plan import Box
from ckpt.format import entries

DEFAULT_READ_BUDGET = 1 << 30


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

  Read once (``read_once``, see docs/read-once.md): a leaf returned by a
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
    """The read, its step checked before and after, under the restore's
    bound on stalls (``reads.deadline``)."""
    reads = self.reads
    return await deadline_lib.bounded(
        self._checked(dtype, sharding),
        reads.deadline() if reads is not None else None)

  async def _checked(self, dtype, sharding):
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
    limiter = ByteLimiter(self.budget)
    reads = self.reads

    def read():
      if hasattr(sharding, "read"):  # a readsplit split
        return sharding.read(self, dtype, limiter)
      return materialize(self, dtype, sharding, limiter)
    if reads is None:
      return await read()
    token = readcount.COUNTER.set(reads.counter)
    try:
      with reads.meter:
        return await read()
    finally:
      readcount.COUNTER.reset(token)
      reads.counter.note(limiter)
      reads.update()


def _copy(leaf: LazyLeaf) -> LazyLeaf:
  out = object.__new__(type(leaf))
  out.__dict__.update(leaf.__dict__)
  return out


class LazyArray(LazyLeaf):
  """One stored array of a checkpoint."""

  def __init__(self, entry: entries.ArrayEntry, storage_format: str,
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
    # Whole raw chunks are read from their files (ckpt/restore/rawread.py).
    self._files = rawread.ChunkFiles.of(storage_format, step_kvstore, entry)
    # The recorded checksums of its boxes (verified.BoxSums) when a restore
    # verifies: every read then checks what it read.
    self.sums: verified.BoxSums | None = None

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

  def read_bytes(self, box: Box) -> int:
    """Host bytes a read of ``box`` holds besides the box: with checksums
    (``sums``), the recorded boxes it straddles are read whole
    (ckpt/restore/verified.py)."""
    if self.sums is None:
      return 0
    return verified.hull_bytes(self.sums, box, self.dtype.itemsize)

  async def read_box(self, box: Box) -> np.ndarray:
    check_fits(self.path, box.shape, self.dtype)
    if self.sums is not None:
      out = np.empty(box.shape, self.dtype)
      await self.read_into(box, out)
      return out
    store = await self._open()
    self._count(box)
    try:
      return await tsfuture.wait(store[box.slices()].read())
    except Exception as e:
      raise CorruptCheckpointError(
          f"leaf {self.path!r}: reading {box.start}..{box.stop} failed: {e}"
      ) from e

  async def read_into(self, box: Box, out: np.ndarray) -> None:
    if self.sums is not None:  # each recorded box checked as it arrives
      return await verified.read_into(self.sums, box, out, self.path,
                                      self.dtype, self._read_stored)
    if out.dtype != self.dtype:
      return await super().read_into(box, out)
    await self._read_stored(box, out)

  async def _read_stored(self, box: Box, out: np.ndarray
                         ) -> dict[tuple, int] | None:
    """The stored data of ``box`` into ``out`` (of the stored dtype).
    Returns the crc32c of each stored chunk read, by (start, stop), when
    the chunks were read from their files with checksums on (``sums``):
    taken as each piece arrived (ckpt/restore/rawread.py); else None."""
    store = await self._open()  # checks the array's metadata either way
    self._count(box)
    parts = (self._files.parts(box) if self._files is not None and
             out.dtype == self.dtype and out.flags.c_contiguous else None)
    if parts is not None:
      crcs = await asyncio.to_thread(self._files.read, parts, box, out,
                                     self.sums is not None)
      if crcs is not None:
        return crcs or None
    try:
      # TensorStore decodes straight into ``out``: no intermediate array.
      await tsfuture.wait(ts.array(out, copy=False, write=True).write(
          store[box.slices()]))
    except Exception as e:
      raise CorruptCheckpointError(
          f"leaf {self.path!r}: reading {box.start}..{box.stop} failed: {e}"
      ) from e
    return None

  def _count(self, box: Box) -> None:
    """Counts the read in the restore's stats (readcount.COUNTER)."""
    readcount.count(box.start, box.stop, tuple(self.entry.chunks) or box.stop,
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


