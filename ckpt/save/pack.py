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
from typing import Any, Callable, Sequence

import crc32c
import jax
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
# One pack object holds at most this many bytes (and at most the budget).
MAX_PACK_OBJECT_BYTES = 64 << 20
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


class PackWriter:
  """This process's packed boxes of one save, into packs and their table.

  Call sequence: ``await stage(writes)`` (every box on the host, as views
  of CPU device buffers or copies, under the byte limiter; the caller's
  arrays are no longer needed once it returns), then ``flush()`` (each
  staged pack joined, its crc32c's taken and its write started: the work
  per box that needs no source any more, done after the caller was
  released), then ``finish()`` (the table, written once every pack is).
  ``stage`` flushes by itself when the budget is full, and a caller that
  needs the budget for something else calls ``flush`` first. ``track``
  is told of every write started, for the caller to wait for.
  """

  def __init__(self, host_boxes: Callable[[list], list[np.ndarray]],
               step_kvstore: dict, context: ts.Context, limiter: ByteLimiter,
               process: int, on_pack: Callable[[int, int], None],
               track: Callable[[asyncio.Future], None] = lambda t: None):
    self.host_boxes = host_boxes
    self.step_kvstore = step_kvstore
    self.context = context
    self.limiter = limiter
    self.process = process
    self.on_pack = on_pack  # (boxes, bytes) of each pack written
    self.track = track  # told of every write started
    self.kv: ts.KvStore | None = None
    self.staged: list[tuple[int, list, list, int]] = []  # k, writes, data, grant
    self.tasks: list[asyncio.Future] = []
    self.sizes: list[int] = []
    # The table's columns (ckpt/format/pack_table.py), a row per box.
    self.leaf: list[int] = []
    self.pack: list[int] = []
    self.offsets: list[int] = []
    self.crcs: list[int] = []
    self.box: list[int] = []

  async def stage(self, writes: Sequence[Any]) -> None:
    self.kv = await tsfuture.wait(ts.KvStore.open(self.step_kvstore,
                                                  context=self.context))
    limit = max(ALIGN, min(MAX_PACK_OBJECT_BYTES, self.limiter.budget))
    for k, batch in enumerate(group([w for w in writes if w.box.size],
                                    limit)):
      total = sum(_aligned(w.nbytes) for w in batch)
      grant = self.limiter.try_acquire(total)
      if grant is None:  # the packs staged so far free the budget
        self.flush()
        grant = await self.limiter.acquire(total)
      try:
        data = self.host_boxes(batch)
      except BaseException:
        self.limiter.release(grant)
        raise
      self.staged.append((k, batch, data, grant))

  def flush(self) -> None:
    """Every staged pack joined and its write started."""
    staged, self.staged = self.staged, []
    for i, (k, batch, data, grant) in enumerate(staged):
      try:
        buf = self._join(k, batch, data)
      except BaseException:
        for _, _, _, g in staged[i:]:
          self.limiter.release(g)
        raise
      self.sizes.append(len(buf))
      self._started(asyncio.ensure_future(self._put(
          k, buf, grant, len(batch), sum(w.nbytes for w in batch))))

  def _started(self, task: asyncio.Future) -> None:
    self.tasks.append(task)
    self.track(task)

  def _join(self, k: int, batch: list, data: list[np.ndarray]) -> bytes:
    parts, offset = [], 0
    for w, d in zip(batch, data):
      flat = np.ascontiguousarray(d).reshape(-1).view(np.uint8)
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
    try:
      await tsfuture.wait(self.kv.write(name, buf))
      self.on_pack(count, data_bytes)  # the boxes' bytes (not the alignment)
    except Exception as e:
      raise CheckpointError(
          f"writing pack {name!r} ({count} boxes of small leaves, "
          f"{len(buf)} bytes) failed: {e}") from e
    finally:
      self.limiter.release(grant)

  def abandon(self) -> None:
    """After a failure: the staged packs' bytes given back, unwritten."""
    for _, _, _, grant in self.staged:
      self.limiter.release(grant)
    self.staged = []

  def finish(self) -> None:
    """The rest flushed, and the table's write started (once every pack is
    written)."""
    self.flush()
    if not self.leaf:
      return
    table = seal.seal(pack_table.encode(self.process, self.sizes, self.leaf,
                                        self.pack, self.offsets, self.crcs,
                                        self.box))
    if len(table) > pack_index.MAX_TABLE_BYTES:
      raise CheckpointError(
          f"the pack table of process {self.process} is {len(table)} bytes; "
          f"readers accept at most {pack_index.MAX_TABLE_BYTES}: lower "
          "ckpt.save.pack.MAX_LEAF_BYTES")
    self._started(asyncio.ensure_future(self._put_table(
        table, list(self.tasks))))

  async def _put_table(self, table: bytes, packs: list) -> None:
    await asyncio.gather(*packs)  # the packs first
    name = pack_index.table_name(self.process)
    try:
      await tsfuture.wait(self.kv.write(name, table))
    except Exception as e:
      raise CheckpointError(
          f"writing the pack table {name!r} failed: {e}") from e


def host_boxes(plan: Any, writes: list,
               shards: staging.ShardLookup | None = None) -> list[np.ndarray]:
  """Stage 3 for a pack's boxes: every device-to-host copy started, then
  each box on the host (ckpt/save/staging.py), safe to join into its pack
  after the caller is released (a host numpy leaf copied unless
  ``plan.borrow``). A box of a CPU device buffer in its stored dtype is a
  view of it, taken at once (``ShardLookup.view``). ``plan``: a
  leaves.SavePlan; ``shards``: the save's ShardLookup (one per call if
  None)."""
  shards = shards or staging.ShardLookup()
  out: list[Any] = []
  pending = []  # (position, piece): copies started, landed below
  dtypes: dict[str, np.dtype] = {}
  for w in writes:
    leaf = plan.leaves[w.leaf]
    try:
      src = leaf.source
      if staging.is_array(src):
        name = leaf.entry.dtype
        dtype = dtypes.get(name) or dtypes.setdefault(name, np.dtype(name))
        view = shards.view(src, w, dtype)
        if view is not None:
          out.append(view)
          continue
        piece = shards.piece(src, w)
      else:
        piece = staging.device_piece(leaf, w)
    except Exception as e:
      raise CheckpointError(
          f"leaf {tree.path_str(leaf.parts)!r}: starting the copy of "
          f"{w.box.start}..{w.box.stop} to the host failed (was the array "
          f"deleted or donated before save() returned?): {e}") from e
    pending.append((len(out), piece))
    out.append(None)
  for i, piece in pending:
    w = writes[i]
    out[i] = staging.host_box(plan.leaves[w.leaf], w, piece, plan.borrow)
  return out
