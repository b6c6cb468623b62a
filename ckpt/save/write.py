"""The save data path, stage by stage (see DESIGN.md):

1. flatten   state -> named leaves                      (caller thread)
2. plan      leaf kinds, array specs, who writes what   (caller thread, pure)
3. stage     device -> host copies of owned boxes       (background, bounded)
4. write     TensorStore writes under one ByteLimiter   (background)
5. barrier   every process has written
6. index     process 0 writes index.msgpack
7. commit    rename (POSIX) or commit marker (object stores)
8. retention process 0 deletes what the policy drops (checkpointer.py)
9. barrier   the save is complete everywhere

Stages 3 and 4 are one pipeline: an owned box takes its bytes from the
limiter before it is staged and gives them back once TensorStore has
committed it, so host memory held by a save stays within the budget. The
caller is released (``on_staged``) when the last box is staged, so it may
then donate or delete its arrays.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import time
from typing import Any, Callable

import numpy as np
import tensorstore as ts

from ckpt.format import index as index_lib
from ckpt.multihost import process as multihost
from ckpt.store import ocdbt
from ckpt.save import polite
from ckpt.save import pack as pack_lib
from ckpt.save import staging
from ckpt.save.leaves import SavePlan
from ckpt.shards import plan as plan_lib
from ckpt.format import tree
from ckpt.store import tsfuture
from ckpt.format import tsspec
from ckpt.format.crc import checksum, checksum_view
from ckpt.errors import CheckpointError
from ckpt.store.limiter import ByteLimiter
from ckpt.format import entries as entries_lib

# Staging and checksumming a box this small runs on the event loop: a hop to
# a worker thread and back (through the loop's self-pipe, under the GIL)
# costs more than the work itself, and with 10,000 leaves it dominates.
INLINE_WORK_BYTES = 256 << 10

@dataclasses.dataclass
class SaveStats:
  """What one process did in one save (``Checkpointer.last_save_stats``)."""
  step: int = -1
  bytes_written: int = 0
  boxes_written: int = 0
  array_leaves: int = 0
  inline_leaves: int = 0
  peak_bytes_in_flight: int = 0
  blocking_s: float = 0.0
  total_s: float = 0.0
  skipped: bool = False
  # reuse_unchanged=True (ckpt/save/reuse.py): the bytes and chunks this
  # process linked from the previous step instead of writing them (not
  # counted in bytes_written; boxes_written counts boxes written in part).
  bytes_reused: int = 0
  chunks_reused: int = 0
  # Where the time went (seconds, this process): plan_save on the caller's
  # thread, and the calls into the coordination service over the whole save
  # (the agreement round, barriers, posts; the wait for other processes at
  # barriers included), with how many barriers and key-value calls it made.
  plan_s: float = 0.0
  coordination_s: float = 0.0
  barriers: int = 0
  kv_calls: int = 0
  # Leaves this save planned anew: 0 when it reused the plan of the
  # previous save (the same tree, shapes, dtypes and shardings; see
  # ckpt/save/plan_cache.py).
  planned_leaves: int = 0


async def _open_arrays(plan: SavePlan, step_kvstore: dict, context: ts.Context,
                       process: int,
                       process_count: int = 1) -> dict[int, ts.TensorStore]:
  """Each array is created (its metadata written) by one process, the
  arrays dealt round-robin over the processes (``creates``), so no process
  creates more than its share of them; the others open the ones they write
  without reading anything (``assume_metadata``). Every array is created
  before the "written" barrier, whether or not anybody writes a box of it.

  With format "ocdbt" each process writes into its own database, merged at
  finalize (ckpt/store/ocdbt.py); process 0 creates every array, so its database
  holds the metadata of every array.
  """
  if plan.options.storage_format == "ocdbt":
    process_count = 1
  arrays_in = [i for i, lp in enumerate(plan.leaves)
               if lp.layout is not None and not lp.packed]
  mine = {w.leaf for w in plan.writes}
  creates = {i for k, i in enumerate(arrays_in)
             if k % process_count == process}
  wanted = [i for i in arrays_in if i in creates or i in mine]
  # In OCDBT every commit adds files: the metadata goes in one transaction,
  # atomic: nothing written back before its one commit (ocdbt.write_batch).
  txn = (ts.Transaction(atomic=True)
         if plan.options.storage_format == "ocdbt" else None)

  async def open_one(i: int):
    e = plan.leaves[i].entry
    kvstore = step_kvstore
    if plan.options.storage_format == "ocdbt":  # this process's database
      kvstore = ocdbt.process_database(step_kvstore, process, e.ocdbt_group)
    spec = tsspec.array_spec(plan.options.storage_format, kvstore,
                             e.relpath, e.shape, np.dtype(e.dtype), e.chunks,
                             plan.options.codec)
    if i in creates:
      return i, await tsfuture.wait(ts.open(spec, create=True,
                                            context=context, transaction=txn))
    return i, await tsfuture.wait(ts.open(spec, open=True, assume_metadata=True,
                                          context=context))

  arrays = dict(await asyncio.gather(*(open_one(i) for i in wanted)))
  if txn is not None:
    await tsfuture.wait(txn.commit_async())
    arrays = {i: a.with_transaction(None) for i, a in arrays.items()}
  return arrays


def chunk_sums(box: plan_lib.Box, chunks: tuple[int, ...], data: np.ndarray
               ) -> list[tuple[plan_lib.Box, int]]:
  """(chunk box, crc32c) of every stored chunk in ``box`` (whose data is
  ``data``): a restore then checks each chunk it fetches, whatever box it
  reads (ckpt/restore/verified.py)."""
  boxes = plan_lib.chunk_boxes(box, chunks)
  if len(boxes) == 1:
    return [(box, checksum(data))]
  return [(b, checksum_view(data[b.relative_to(box)])) for b in boxes]


async def write_owned(plan: SavePlan, step_kvstore: dict, context: ts.Context,
                      limiter: ByteLimiter, stats: SaveStats,
                      on_staged: Callable[[], None],
                      reuse: Any = None,
                      on_written: Callable[[plan_lib.Write], Any] | None = None,
                      window: ByteLimiter | None = None,
                      raw: Callable[[plan_lib.Write, Any], Any] | None = None
                      ) -> list[list]:
  """Stages 3 and 4 for this process's boxes (``OwnedWrites``).

  ``on_written(w)`` (on the event loop) once the array write ``w`` is done
  (ckpt/save/durable.py syncs its files then); it returns the futures of
  that durability (concurrent.futures), or None. With ``window`` an array
  write starts only once its bytes fit in it, and they stay in it until
  those futures are done: the bytes written but not yet durable (dirty in
  the page cache) stay within the window (ckpt/save/polite.py).

  With ``reuse`` (a ckpt/save/reuse.py ``SaveReuse``) each array box's
  unchanged chunks are linked from the previous step, not written.

  With ``plan.borrow`` (the caller waits for the whole save) boxes are
  written straight from its arrays, with no staging copy. ``raw(w, data)``
  (durable.Syncer.write_raw) writes a box of raw chunks itself, crc32c and
  fsync included, and returns its future, or None: TensorStore writes it.

  Returns ``[leaf, start, stop, crc32c]`` for every box written with
  format "zarr" (zarr v2 has no checksum codec; finalize writes them to this
  process's checksum file): checksums are taken of the staged data while
  TensorStore writes it, off the caller's path. Empty for "zarr3" and
  "ocdbt", whose chunks carry their own crc32c (tsspec.default_checksum).
  """
  writes = OwnedWrites(plan, step_kvstore, context, limiter, stats, reuse,
                       on_written, window, raw)
  return await writes.run(on_staged)


class OwnedWrites:
  """One save's stages 3 and 4 on this process: its packed boxes staged
  into packs (ckpt/save/pack.py), then its array boxes staged and written
  under the byte limiter. Call sequence: ``run(on_staged)`` once; it
  stages (``_stage_packs``, ``_stage_arrays``), calls ``on_staged``,
  then waits for every write (``_finish``).

  Staging runs ahead of writing while the budget allows, so that the
  caller (released once everything is staged) does not wait for writes
  competing for the same cores; when the budget is full, the staged boxes
  start writing and free it. Device-to-host copies of every box granted so
  far start together (``staging.device_piece``) and are waited for in
  order (``_land``), so the transfers of all local devices overlap.
  """

  def __init__(self, plan: SavePlan, step_kvstore: dict, context: ts.Context,
               limiter: ByteLimiter, stats: SaveStats, reuse: Any = None,
               on_written: Callable[[plan_lib.Write], Any] | None = None,
               window: ByteLimiter | None = None, raw: Any = None):
    self.plan = plan
    self.raw = raw  # writes raw chunk boxes (write_owned)
    self.step_kvstore = step_kvstore
    self.context = context
    self.limiter = limiter
    self.stats = stats
    self.reuse = reuse
    self.on_written = on_written  # told of each array write done
    self.window = window  # bytes written, not yet durable (write_owned)
    self.process = multihost.process_index()
    self.take_sums = (plan.options.codec.resolved_checksum(
        plan.options.storage_format) == "none")
    self.opening: asyncio.Future | None = None  # _open_arrays, while staging
    self.arrays: dict[int, ts.TensorStore] = {}
    self.tasks: list[asyncio.Future] = []  # every write started
    # Device copies in flight (oldest first), then staged boxes not yet
    # writing: (write, piece or host data, grant).
    self.started: collections.deque[tuple[plan_lib.Write, Any, int]] = (
        collections.deque())
    self.staged: list[tuple[plan_lib.Write, np.ndarray, int]] = []
    self.sums: list[list] = []
    self.packs: pack_lib.PackWriter | None = None  # small leaves (pack.py)
    self.failed = False  # set by the first write that fails: O(1) to check

  async def run(self, on_staged: Callable[[], None]) -> list[list]:
    plan = self.plan
    arrays = sum(lp.layout is not None for lp in plan.leaves)
    self.stats.array_leaves = arrays
    self.stats.inline_leaves = len(plan.leaves) - arrays
    # The arrays are created (metadata written) while staging runs, not
    # before it: in async mode the caller waits for staging only.
    self.opening = asyncio.ensure_future(_open_arrays(
        plan, self.step_kvstore, self.context, self.process,
        multihost.process_count()))
    packed, others = pack_lib.split_writes(plan)
    try:
      if packed:
        await self._stage_packs(packed)
      await self._stage_arrays(others)
    except BaseException:
      await self._abandon()
      raise
    finally:
      for lp in plan.leaves:
        lp.source = None  # the caller's arrays are no longer needed
      on_staged()
    try:
      if self.packs is not None:  # the packs' copies and sums, then the table
        self.packs.finish()
    except BaseException:
      await self._abandon()
      raise
    self._start_writes()
    if not plan.borrow:  # the pool has grown for these writes (polite.py)
      polite.lower_tensorstore_threads()
    await self._finish()
    return self.sums

  # ---- staging ---------------------------------------------------------

  async def _stage_packs(self, packed: list[plan_lib.Write]) -> None:
    """Small leaves: staged for a few packs (ckpt/save/pack.py), which are
    joined and written once the caller is released."""
    self.packs = pack_lib.PackWriter(
        self.plan, staging.ShardLookup(), self.step_kvstore, self.context,
        self.limiter, self.process, self._counted, lambda t: self._track([t]))
    await self.packs.stage(packed)

  async def _stage_arrays(self, writes: list[plan_lib.Write]) -> None:
    for w in writes:
      if w.box.size == 0:
        continue  # a zero-size shard: nothing to store
      if self.failed:
        break  # a write failed: stop staging, report it at _finish
      unstaged = self.reuse and self.reuse.unstaged
      if unstaged and unstaged.same_object(w.leaf) and (
          await self._link_unstaged(unstaged, w)):
        continue  # the very array its previous step stored: linked
      grant = self.limiter.try_acquire(w.nbytes)  # stored bytes, after cast
      if grant is None:
        await self._land()
        self._start_writes()
        grant = await self.limiter.acquire(w.nbytes)
      leaf = self.plan.leaves[w.leaf]
      try:
        self.started.append((w, staging.device_piece(leaf, w), grant))
      except Exception as e:
        self.limiter.release(grant)
        raise CheckpointError(
            f"leaf {tree.path_str(leaf.parts)!r}: starting the copy of "
            f"{w.box.start}..{w.box.stop} to the host failed (was the array "
            f"deleted or donated before save() returned?): {e}") from e
    await self._land()

  async def _link_unstaged(self, unstaged: Any, w: plan_lib.Write) -> bool:
    """Links box ``w`` of the very array object the previous step stored
    (ckpt/save/reuse_unstaged.py): neither staged nor hashed."""
    lp = self.plan.leaves[w.leaf]
    itemsize = w.nbytes // w.box.size
    outcomes = await asyncio.to_thread(unstaged.link_box, w.leaf, w.box,
                                       lp.layout.chunks, itemsize)
    if outcomes is None:
      return False
    crcs, linked = unstaged.linked(w.leaf, outcomes, itemsize, self.take_sums)
    self._add_sums(w, crcs)
    self.stats.bytes_reused += linked
    # No fsync of the linked files: their bytes were made durable by the
    # step that wrote them, and the new names are directory entries, which
    # the commit fsyncs (every directory of the attempt, commit/rename.py).
    return True

  async def _land(self) -> None:
    """Every started copy on the host, in order, staged for writing."""
    while self.started:
      w, piece, grant = self.started[0]
      leaf = self.plan.leaves[w.leaf]
      borrow = self.plan.borrow
      if w.nbytes <= INLINE_WORK_BYTES or staging.is_view(leaf, piece):
        data = staging.host_box(leaf, w, piece, borrow)
      else:
        data = await asyncio.to_thread(staging.host_box, leaf, w, piece,
                                       borrow)
      self.started.popleft()
      self.staged.append((w, data, grant))

  async def _abandon(self) -> None:
    """After a failure while staging: the bytes of what was not written
    given back. Writes already started finish (they hold at most the
    budget) instead of being cancelled mid-flight: once this process
    raises, it writes nothing more into the attempt, which is what the
    "written" barrier tells the others before process 0 removes it."""
    for _, _, grant in [*self.started, *self.staged]:
      self.limiter.release(grant)
    self.started.clear()
    self.staged.clear()
    if self.packs is not None:
      self.packs.abandon()
    await asyncio.gather(*self.tasks, self.opening, return_exceptions=True)

  # ---- writing ---------------------------------------------------------

  def _start_writes(self) -> None:
    if self.packs is not None:  # staged packs hold budget too
      self.packs.flush()
    if not self.staged:
      return
    if self.plan.options.storage_format == "ocdbt":
      self._track([asyncio.ensure_future(self._write_batch(self.staged))])
    else:
      self._track([asyncio.ensure_future(self._write_one(w, data, grant))
                   for w, data, grant in self.staged])
    self.staged = []

  def _track(self, tasks: list[asyncio.Future]) -> None:
    for t in tasks:
      t.add_done_callback(self._on_done)
    self.tasks.extend(tasks)

  def _on_done(self, t: asyncio.Future) -> None:
    if not t.cancelled() and t.exception() is not None:
      self.failed = True

  def _counted(self, boxes: int, nbytes: int) -> None:
    self.stats.boxes_written += boxes
    self.stats.bytes_written += nbytes

  async def _store(self, w: plan_lib.Write, txn=None) -> ts.TensorStore:
    if not self.arrays:
      self.arrays.update(await self.opening)
    store = self.arrays[w.leaf]
    return store if txn is None else store.with_transaction(txn)

  async def _write_box(self, w: plan_lib.Write, data: np.ndarray,
                       txn=None) -> int:
    """Writes one box; returns the bytes linked (reuse) instead."""
    try:
      store = await self._store(w, txn)
      chunks = self.plan.leaves[w.leaf].layout.chunks
      if self.reuse is not None:  # "zarr"/"zarr3" only, so never in a txn
        raw = (lambda: self.raw(w, data)) if self.raw else None
        crcs, linked = await self.reuse.write_box(store, w.leaf, w.box, chunks,
                                                  data, self.take_sums, raw)
        self._add_sums(w, crcs)
        return linked
      job = self.raw and txn is None and self.raw(w, data)
      if job:  # raw chunk files: summed, written and synced on one thread
        crcs = await asyncio.wrap_future(job)
        if self.take_sums:
          self._add_sums(w, crcs)
        return 0
      # ``data`` never changes from here on (a view of an immutable
      # jax.Array, or ckpt's own copy), so TensorStore may keep a reference
      # to it instead of copying it into its chunk cache.
      write = store[w.box.slices()].write(
          data, can_reference_source_data_indefinitely=True)
      crcs = None
      if self.take_sums:  # one per stored chunk: a read checks what it fetches
        crcs = (chunk_sums(w.box, chunks, data)
                if data.nbytes <= INLINE_WORK_BYTES else
                await asyncio.to_thread(chunk_sums, w.box, chunks, data))
      await tsfuture.wait(write)
      if crcs is not None:
        self._add_sums(w, crcs)
      return 0
    except Exception as e:
      raise CheckpointError(
          f"leaf {tree.path_str(self.plan.leaves[w.leaf].parts)!r}: writing "
          f"{w.box.start}..{w.box.stop} failed: {e}") from e

  def _add_sums(self, w: plan_lib.Write, crcs) -> None:
    self.sums.extend([w.leaf, list(b.start), list(b.stop), crc]
                     for b, crc in crcs)

  async def _write_one(self, w: plan_lib.Write, data: np.ndarray,
                       grant: int) -> None:
    held = None  # the write's share of the window
    try:
      if self.window is not None:
        held = await self.window.acquire(w.nbytes)
      linked = await self._write_box(w, data)
      durable = self.on_written(w) if self.on_written is not None else None
      self.stats.bytes_written += data.nbytes - linked
      self.stats.bytes_reused += linked
      self.stats.boxes_written += linked < data.nbytes
      if held is not None and durable:  # a failure is raised by its owner
        await asyncio.wait([asyncio.wrap_future(f) for f in durable])
    finally:
      if held is not None:
        self.window.release(held)
      self.limiter.release(grant)

  async def _write_batch(self, batch: list[tuple[plan_lib.Write, np.ndarray,
                                                 int]]) -> None:
    """format "ocdbt": the staged boxes in ONE transaction
    (``ocdbt.write_batch``); their bytes stay granted until it is
    committed (TensorStore holds its copy of them in the transaction; ours
    are dropped once it has it)."""
    grants = [grant for _, _, grant in batch]
    nbytes = sum(data.nbytes for _, data, _ in batch)
    writes = [w for w, _, _ in batch]
    boxes = [functools.partial(self._write_box, w, data)
             for w, data, _ in batch]
    batch.clear()

    def what() -> str:
      names = sorted({tree.path_str(self.plan.leaves[w.leaf].parts)
                      for w in writes})
      return (f"{len(writes)} boxes of leaves {names[:5]}"
              f"{' ...' if len(names) > 5 else ''} to the OCDBT database of "
              f"process {self.process}")

    try:
      await ocdbt.write_batch(boxes, what)
      self.stats.bytes_written += nbytes
      self.stats.boxes_written += len(writes)
    finally:
      for grant in grants:
        self.limiter.release(grant)

  async def _finish(self) -> None:
    """Every array exists (even with no box here) and every write ended;
    the first failure raised."""
    try:
      self.arrays.update(await self.opening)
    except BaseException:
      await asyncio.gather(*self.tasks, return_exceptions=True)
      raise
    results = await asyncio.gather(*self.tasks, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
      raise errors[0]
    self.stats.peak_bytes_in_flight = self.limiter.peak_in_use


def make_index(plan: SavePlan, step: int, metrics: dict | None,
               process_count: int) -> index_lib.Index:
  """The index. Its size depends on the leaves only, never on the number
  of processes: checksums and host states are in per-process files
  (index.process_file), and each array's entry records its checksum codec
  (crc32c for "zarr3" and "ocdbt", so a reader opens it with the same
  codec chain it was written with)."""
  fmt = plan.options.storage_format
  checksum = plan.options.codec.resolved_checksum(fmt)
  entries = []
  for lp in plan.leaves:
    e = lp.entry
    if (isinstance(e, entries_lib.ArrayEntry) and checksum != "none" and
        e.codec.get("checksum") != checksum):
      e = dataclasses.replace(e, codec={**e.codec, "checksum": checksum})
    entries.append(e)
  return index_lib.Index(
      step=step, time=time.time(), storage_format=plan.options.storage_format,
      process_count=process_count, structure=plan.structure,
      leaves=tuple(entries),
      # ints stay ints (the index has always accepted int or float values)
      metrics={k: v if type(v) is int else float(v)
               for k, v in (metrics or {}).items()})


# ---- the other arguments of save() -----------------------------------------
