"""Small leaves, packed: written into a few objects per process.

A leaf of a few KB stored as a TensorStore array costs a metadata file, a
directory, a chunk file and their fsyncs, and a future or two per box: with
10,000 such leaves that per-array work, not the bytes, is the save (see
scripts/bench.py's small_leaves_10k). torch DCP, OLMo-core and Megatron all
aggregate small tensors; ckpt does too:

- An array leaf whose stored bytes are at most ``MAX_LEAF_BYTES`` is packed
  (its index entry is ckpt/pack_index.PackedEntry). 64 KiB: at that size a
  TensorStore array's fixed costs (a few files and fsyncs, several ms) are
  ten to a hundred times the time its bytes take to write, and a pack of
  such leaves stays a few MB per thousand leaves, cheap to read whole.
- Each process concatenates the boxes it owns of packed leaves (the same
  boxes the plan gives it to write, ckpt/shards/plan.py) into packs of at most
  ``MAX_PACK_OBJECT_BYTES`` (and the save's byte budget), each written with
  ONE kvstore write (``ts.KvStore`` on the step's kvstore: disk, gs://,
  s3://, memory; on disk TensorStore's file driver fsyncs it and the commit
  fsyncs the directories, as for arrays). Then its table (pack_index).
- The crc32c of every box is in the table; readers check it on every read
  (ckpt/restore/pack_read.py), so verifying a packed leaf is reading it.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Callable, Sequence

import crc32c
import numpy as np
import tensorstore as ts

from ckpt.format import pack_index
from ckpt.format import seal
from ckpt.format import pack_table
from ckpt.format import tree
from ckpt.save import staging
from ckpt.store import tsfuture
from ckpt.errors import CheckpointError
from ckpt.store.limiter import ByteLimiter

# Leaves of at most this many stored bytes are packed (0: none).
DEFAULT_MAX_LEAF_BYTES = 64 << 10
MAX_LEAF_BYTES = DEFAULT_MAX_LEAF_BYTES
# One pack object holds at most this many bytes (and at most the budget),
# and at most PACKS_IN_FLIGHT packs are joined and being written at once.
# A pack being written costs the host three to four times its size (the
# joined bytes, then TensorStore's copies of them, which ``KvStore.write``
# takes only as bytes): 20 MiB of packs written as one cost 59 MiB, as
# packs of 4 MiB two at a time 16 MiB, in the same CPU time.
MAX_PACK_OBJECT_BYTES = 4 << 20
PACKS_IN_FLIGHT = 2
# Each box starts at a multiple of this in its pack (aligned reads, views).
ALIGN = 64


def packable(nbytes: int) -> bool:
  return nbytes <= min(MAX_LEAF_BYTES, pack_index.MAX_PACKED_LEAF_BYTES)


_PADDING = bytes(ALIGN)


def _aligned(n: int) -> int:
  return -(-n // ALIGN) * ALIGN


def group(writes: Sequence[Any], limit: int) -> list[list[Any]]:
  """``writes`` (each with ``nbytes``) cut into packs of at most ``limit``
  aligned bytes (a larger box alone), in order."""
  out: list[list[Any]] = []
  size = limit + 1
  for w in writes:
    n = _aligned(w.nbytes)
    if size + n > limit:
      out.append([])
      size = 0
    out[-1].append(w)
    size += n
  return out


def split_writes(plan: Any) -> tuple[list, list]:
  """(packed writes, the others) of ``plan`` (a leaves.SavePlan), in order;
  worked out once per layout (``plan.memo``)."""
  got = plan.memo.get("packed")
  if got is None:
    leaves = plan.leaves
    packed = [w for w in plan.writes if leaves[w.leaf].packed]
    got = plan.memo["packed"] = (packed, [
        w for w in plan.writes if not leaves[w.leaf].packed]
                                 if packed else plan.writes)
  return got


class _Pack:
  """One pack of a layout (``batches``): its number, boxes, aligned size,
  and how each box is staged (``staging.ShardLookup.recipe``; None until
  the first save that stages it)."""

  def __init__(self, k: int, writes: list, total: int):
    self.k, self.writes, self.total = k, writes, total
    self.recipes: list[tuple[int, int]] | None = None


def batches(plan: Any, writes: list, limit: int) -> list[_Pack]:
  """``writes`` (this process's packed boxes) cut into packs of at most
  ``limit`` bytes, once per layout and limit (``plan.memo``)."""
  key = ("packs", limit)
  got = plan.memo.get(key)
  if got is None:
    got = plan.memo[key] = [
        _Pack(k, batch, sum(_aligned(w.nbytes) for w in batch))
        for k, batch in enumerate(group([w for w in writes if w.box.size],
                                        limit))]
  return got


class PackWriter:
  """This process's packed boxes of one save, into packs and their table.

  Call sequence: ``await stage(writes)`` (every box on the host, as views
  of CPU device buffers or copies, under the byte limiter; the caller's
  arrays are no longer needed once it returns), then ``flush()`` (the
  staged packs queued to be joined, their crc32c's taken and written, in
  order, at most ``PACKS_IN_FLIGHT`` at once: the work per box that needs
  no source any more, done after the caller was released), then
  ``finish()`` (the table, written once every pack is). ``stage`` flushes
  by itself when the budget is full, and a caller that needs the budget
  for something else calls ``flush`` first. ``track`` is told of every
  task started, for the caller to wait for.
  """

  def __init__(self, plan: Any, shards: staging.ShardLookup,
               step_kvstore: dict, context: ts.Context, limiter: ByteLimiter,
               process: int, on_pack: Callable[[int, int], None],
               track: Callable[[asyncio.Future], None] = lambda t: None):
    self.plan = plan  # a leaves.SavePlan
    self.shards = shards
    self.step_kvstore = step_kvstore
    self.context = context
    self.limiter = limiter
    self.process = process
    self.on_pack = on_pack  # (boxes, bytes) of each pack written
    self.track = track  # told of every task started
    self.opening: asyncio.Future | None = None  # the step's ts.KvStore
    self.staged: collections.deque[tuple[int, list, list, int]] = (
        collections.deque())  # k, writes, data, grant: staged, then queued
    self.queued = 0  # how many of the first ``staged`` are flushed
    self.pump: asyncio.Future | None = None  # joins and writes the queued
    self.slots = asyncio.Semaphore(PACKS_IN_FLIGHT)
    self.failed = False  # a pack's write failed: join no more
    self.tasks: list[asyncio.Future] = []
    self.sizes: list[int] = []
    # The table's columns (ckpt/format/pack_table.py), a row per box.
    self.leaf: list[int] = []
    self.pack: list[int] = []
    self.offsets: list[int] = []
    self.crcs: list[int] = []
    self.box: list[int] = []

  async def stage(self, writes: list) -> None:
    # Opened while the boxes are staged: the caller does not wait for it.
    self.opening = asyncio.ensure_future(tsfuture.wait(ts.KvStore.open(
        self.step_kvstore, context=self.context)))
    self._started(self.opening)
    limit = max(ALIGN, min(MAX_PACK_OBJECT_BYTES, self.limiter.budget))
    for p in batches(self.plan, writes, limit):
      if self.failed:
        break  # a pack's write failed: raised at finish
      grant = self.limiter.try_acquire(p.total)
      if grant is None:  # the packs staged so far free the budget
        self.flush()
        grant = await self.limiter.acquire(p.total)
      try:
        if p.recipes is None:
          p.recipes = recipes(self.plan, p.writes, self.shards)
        data = host_boxes(self.plan, p.writes, self.shards, p.recipes)
      except BaseException:
        self.limiter.release(grant)
        raise
      self.staged.append((p.k, p.writes, data, grant))

  def flush(self) -> None:
    """Every staged pack queued to be joined and written."""
    self.queued = len(self.staged)
    if self.queued and (self.pump is None or self.pump.done()):
      self.pump = asyncio.ensure_future(self._pump())
      self._started(self.pump)

  async def _pump(self) -> None:
    """The queued packs, in order: each joined once a slot is free (at
    most PACKS_IN_FLIGHT joined and not yet written), then written."""
    while self.queued and not self.failed:
      await self.slots.acquire()
      if not self.queued or self.failed:  # abandoned, or a write failed
        self.slots.release()
        break
      k, batch, data, grant = self.staged.popleft()
      self.queued -= 1
      try:
        buf = self._join(k, batch, data)
      except BaseException:
        self.failed = True
        self.slots.release()
        self.limiter.release(grant)
        self.abandon()
        raise
      del data  # the views: their buffers may go once written
      self.sizes.append(len(buf))
      self._started(asyncio.ensure_future(self._put(
          k, buf, grant, len(batch), sum(w.nbytes for w in batch))))
      del buf
    if self.failed:
      self.abandon()

  def _started(self, task: asyncio.Future) -> None:
    self.tasks.append(task)
    self.track(task)

  def _join(self, k: int, batch: list, data: list) -> bytes:
    parts, offset = [], 0
    for w, d in zip(batch, data):
      # A view of a CPU device buffer (host_boxes' common case) is joined
      # and checksummed as it is: numpy's array-from-buffer per box cost
      # more than the box's checksum and copy together.
      flat = (d if type(d) is memoryview and d.c_contiguous else
              np.ascontiguousarray(d).reshape(-1).view(np.uint8))
      n = flat.nbytes
      parts.append(flat)
      if n % ALIGN:
        parts.append(_PADDING[:ALIGN - n % ALIGN])
      self.leaf.append(w.leaf)
      self.offsets.append(offset)
      self.crcs.append(crc32c.crc32c(flat))
      self.box += w.box.start
      self.box += w.box.stop
      offset += _aligned(n)
    self.pack += [k] * len(batch)
    return b"".join(parts)  # the pack's one copy

  async def _put(self, k: int, buf: bytes, grant: int, count: int,
                 data_bytes: int) -> None:
    name = pack_index.pack_name(self.process, k)
    size = len(buf)
    try:
      kv = await self.opening
      written = kv.write(name, buf)
      del buf  # TensorStore has its copy
      await tsfuture.wait(written)
      self.on_pack(count, data_bytes)  # the boxes' bytes (not the alignment)
    except Exception as e:
      self.failed = True
      raise CheckpointError(
          f"writing pack {name!r} ({count} boxes of small leaves, "
          f"{size} bytes) failed: {e}") from e
    finally:
      self.slots.release()
      self.limiter.release(grant)

  def abandon(self) -> None:
    """After a failure: the bytes of the packs not yet joined given back,
    unwritten."""
    for _, _, _, grant in self.staged:
      self.limiter.release(grant)
    self.staged.clear()
    self.queued = 0

  def finish(self) -> None:
    """The rest flushed, and the table's write started (once every pack is
    written)."""
    self.flush()
    if self.tasks:
      table = asyncio.ensure_future(self._put_table())
      self.track(table)

  async def _put_table(self) -> None:
    done = 0
    while done < len(self.tasks):  # the packs first (the pump adds them)
      done = len(self.tasks)
      await asyncio.gather(*self.tasks[:done])
    if not self.leaf:
      return
    name, table = sealed_table(self.process, self.sizes, self.leaf,
                               self.pack, self.offsets, self.crcs, self.box)
    try:
      await tsfuture.wait(self.opening.result().write(name, table))
    except Exception as e:
      raise CheckpointError(
          f"writing the pack table {name!r} failed: {e}") from e


def sealed_table(process: int, sizes, leaf, pack, offsets, crcs,
                 box) -> tuple[str, bytes]:
  """A process's pack table (its name and its sealed bytes), written by the
  thread (``Packer``) and by the writer process (writer_packs.py) alike;
  CheckpointError if readers would refuse its size."""
  table = seal.seal(pack_table.encode(process, sizes, leaf, pack, offsets,
                                      crcs, box))
  if len(table) > pack_index.MAX_TABLE_BYTES:
    raise CheckpointError(
        f"the pack table of process {process} is {len(table)} bytes; "
        f"readers accept at most {pack_index.MAX_TABLE_BYTES}: lower "
        "ckpt.save.pack.MAX_LEAF_BYTES")
  return pack_index.table_name(process), table


def _copy_failed(leaf: Any, w: Any, e: BaseException) -> CheckpointError:
  """The error of a box whose staging could not start, naming its leaf."""
  return CheckpointError(
      f"leaf {tree.path_str(leaf.parts)!r}: starting the copy of "
      f"{w.box.start}..{w.box.stop} to the host failed (was the array "
      f"deleted or donated before save() returned?): {e}")


def recipes(plan: Any, writes: list,
            shards: staging.ShardLookup) -> list[tuple[int, int]]:
  """``ShardLookup.recipe`` of each write of a pack (a deleted array fails
  here, named by its leaf, on the first save of a layout)."""
  out = []
  last, of_leaf = -1, None  # a leaf's boxes are consecutive: its part once
  for w in writes:
    leaf = plan.leaves[w.leaf]
    try:
      if w.leaf != last:
        of_leaf, last = shards.leaf_recipe(leaf), w.leaf
      out.append(shards.box_recipe(of_leaf, w))
    except Exception as e:
      raise _copy_failed(leaf, w, e) from e
  return out


def host_boxes(plan: Any, writes: list, shards: staging.ShardLookup,
               recipes: list[tuple[int, int]]) -> list[Any]:
  """Stage 3 for a pack's boxes, each staged as its recipe says
  (``ShardLookup.recipe``): a box of a CPU device buffer in its stored
  dtype is a view of it, taken at once (about 3 us: what an async save of
  thousands of small leaves costs its caller per box); the others'
  device-to-host copies are started, then each box landed on the host
  (ckpt/save/staging.py, a host numpy leaf copied unless ``plan.borrow``).
  Every box is safe to join into its pack after the caller is released.
  ``plan``: a leaves.SavePlan."""
  leaves = plan.leaves
  out: list[Any] = []
  pending = []  # (position, piece): copies started, landed below
  for w, (where, kind) in zip(writes, recipes):
    leaf = leaves[w.leaf]
    try:
      if kind == staging.VIEW_BUFFER:  # the common case, inline
        out.append(memoryview(leaf.source.addressable_data(where)))
        continue
      if kind < staging.PIECE:
        out.append(staging.take(leaf, w, where, kind))
        continue
      piece = (shards.piece(leaf.source, w) if kind == staging.PIECE else
               staging.device_piece(leaf, w))
    except Exception as e:
      raise _copy_failed(leaf, w, e) from e
    pending.append((len(out), piece))
    out.append(None)
  for i, piece in pending:
    w = writes[i]
    out[i] = staging.host_box(leaves[w.leaf], w, piece, plan.borrow)
  return out
