"""Stages 3-4 of a save handed to this host's writer process (``writer="process"``).

On the trainer's background loop, in place of writing (ckpt/save/runner.py
calls ``write``): each owned box is staged straight into shared memory
under the save's byte budget (its grant given back when the writer says it
was written: the host holds at most ``concurrent_bytes`` of staged boxes,
counted once), handed over as a msgpack message (ckpt/save/handover.py),
then ``finish`` is sent, and only then (process 0: once its writer says
it holds the attempt's lease) is the caller released (``on_staged``):
once ``save()`` has returned, the writer holds all it needs, and a
restarted job's cleanup sees the attempt's holder alive. The writers commit through the storage
(ckpt/commit/through_storage.py: each writes its record, process 0's
commits once all are in; process 0's index and the tiling digests go with
``finish``), so the step commits even if every trainer dies; the trainers
then pass the runner's barriers, and none of them commits.

A failure of the writer comes back as the same exception class and
message (``handover.rebuild``); a writer that died fails the save with a
CheckpointError saying so, and its trainer writes the writer's record in
its place (failed) unless the writer wrote it, so that process 0's writer
stops waiting for it at once (``_record_death``); unless its record says
its part was durable and the step then commits (``_after_death``: the
save succeeds, with a warning; the next save starts a new writer); a
cancel stops the writer's writes before the task ends
(Checkpointer.cancel then removes the attempt).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Callable

from absl import logging
import numpy as np

from ckpt.commit import through_storage
from ckpt.errors import CheckpointError
from ckpt.format import tree
from ckpt.format import tsspec
from ckpt.multihost import process as multihost
from ckpt.save import handover
from ckpt.save import pack as pack_lib
from ckpt.save import staging
from ckpt.save import writer_client
from ckpt.save import writer_reuse
from ckpt.store import deadline as deadline_lib
from ckpt.store import ocdbt
from ckpt.store.limiter import ByteLimiter

INLINE_WORK_BYTES = 256 << 10  # staged on the loop, not on a worker thread


class Handing:
  """One save being handed to the writer: its replies, on the loop."""

  def __init__(self, writer: writer_client.WriterProcess, step: int,
               limiter: ByteLimiter, stats: Any):
    self.writer, self.step, self.limiter = writer, step, limiter
    self.stats = stats  # bytes_written grows as the writer frees boxes
    self.sizes: dict[int, int] = {}  # a box's (pack's) data bytes
    self.loop = asyncio.get_running_loop()
    self.result: asyncio.Future = self.loop.create_future()
    self.cancelled: asyncio.Future = self.loop.create_future()
    # Process 0: its writer holds the attempt's lease (writer_main "held").
    self.held: asyncio.Future = self.loop.create_future()
    self.grants: dict[int, int] = {}
    self.ids = itertools.count()
    self.failed = False  # a box failed: stop staging
    self.gone: str | None = None
    # The writer's progress is the save's (save_timeout_s counts stalls).
    self.deadline = deadline_lib.current()
    self.job = writer.begin(
        lambda m: self.loop.call_soon_threadsafe(self._got, m))

  def _got(self, m: dict | None) -> None:
    if m is None:
      self.gone = (f"the writer process (pid {self.writer.pid}) of this host "
                   f"ended ({self.writer.describe_end()}) while writing step "
                   f"{self.step}; the save failed")
      for grant in self.grants.values():
        self.limiter.release(grant)
      self.grants.clear()
      self.failed = True
      for fut in (self.result, self.cancelled, self.held):
        if not fut.done():
          fut.set_exception(CheckpointError(self.gone))
      return
    kind = m["kind"]
    if self.deadline is not None:
      self.deadline.progress()
    if kind == "freed":  # a box, or (format "ocdbt") a batch of them
      for gid in m["grants"] if "grants" in m else [m["grant"]]:
        grant = self.grants.pop(gid, None)
        if grant is not None:
          self.limiter.release(grant)
        nbytes = self.sizes.pop(gid, 0)
        if not m["failed"]:  # progress=, as the thread reports it
          self.stats.bytes_written += nbytes
      self.failed |= bool(m["failed"])
    elif kind == "done" and not self.result.done():
      self.result.set_result(m)
    elif kind == "held" and not self.held.done():
      self.held.set_result(m)
    elif kind == "failed" and not self.result.done():
      self.result.set_exception(handover.rebuild(m))
      if not self.held.done():
        self.held.set_exception(handover.rebuild(m))
    elif kind == "cancelled" and not self.cancelled.done():
      self.cancelled.set_result(m)

  def send(self, kind: str, **fields) -> None:
    if self.gone:
      raise CheckpointError(self.gone)
    self.writer.send(kind, job=self.job, **fields)

  def hand(self, grant: int, fields: dict, nbytes: int,
           kind: str = "box") -> None:
    gid = next(self.ids)
    self.grants[gid] = grant
    self.sizes[gid] = nbytes
    try:
      self.send(kind, grant=gid, **fields)
    except BaseException:
      self.grants.pop(gid, None)
      self.limiter.release(grant)
      handover.unlink(fields["shm"])
      raise

  def end(self) -> None:
    self.writer.end(self.job)
    for fut in (self.result, self.cancelled, self.held):
      if fut.done() and not fut.cancelled():
        fut.exception()  # retrieved: never logged as unhandled


def _arrays(plan: Any, kvstore: dict, pid: int, count: int) -> list[dict]:
  """The arrays this process's writer creates (one process each, dealt
  round-robin, as ckpt/save/write.py does) or opens (those it writes).
  Format "ocdbt", as the thread writes it: into this process's own
  database (of the array's merge group), every array created by process
  0 (its database holds the metadata of all of them)."""
  fmt = plan.options.storage_format
  if fmt == "ocdbt":
    count = 1
  arrays_in = [i for i, lp in enumerate(plan.leaves)
               if lp.layout is not None and not lp.packed]
  mine = {w.leaf for w in plan.writes}
  out = []
  for k, i in enumerate(arrays_in):
    create = k % count == pid
    if create or i in mine:
      e = plan.leaves[i].entry
      where = (ocdbt.process_database(kvstore, pid, e.ocdbt_group)
               if fmt == "ocdbt" else kvstore)
      out.append({"id": i, "create": create, "spec": tsspec.array_spec(
          fmt, where, e.relpath, e.shape, np.dtype(e.dtype), e.chunks,
          plan.options.codec)})
  return out


def _stage_into(leaf: Any, w: Any, piece: Any, name: str) -> None:
  """One box on the host (staging.host_box: a view on CPU devices) copied
  into the new shared-memory segment ``name``: the save's one copy (with
  write(2) when the box is contiguous: faster than faulting in a mapping
  page by page)."""
  data = staging.host_box(leaf, w, piece, True)
  if data.flags.c_contiguous:
    handover.write_segment(name, memoryview(data.reshape(-1).view(np.uint8)))
    return
  seg = handover.Segment(name, data.nbytes, create=True)
  try:
    out = seg.array(data.shape, data.dtype)
    out[...] = data
    del out
  except BaseException:
    seg.close()
    handover.unlink(name)
    raise
  seg.close()


async def write(attempt: Any, job: Any, index: Callable[[], bytes],
                digests: Callable[[], tuple[list, list]],
                ocdbt_groups: int = 0) -> bool:
  """Stages, hands over and waits for the writer (see the module
  docstring). ``index()``: the index (process 0); ``digests()``: this
  process's tiling digest and that of every array once; ``ocdbt_groups``:
  format "ocdbt", the step's merge groups (1: one database at its root),
  which process 0's writer merges once every record is in. Returns once
  the step is committed (True), or raises."""
  plan, stats, writer = job.plan, job.stats, job.writer
  pid, count = multihost.process_index(), multihost.process_count()
  await asyncio.to_thread(writer.ensure_started)
  limiter = ByteLimiter(job.budget)
  handing = Handing(writer, attempt.step, limiter, stats)
  arrays = sum(lp.layout is not None for lp in plan.leaves)
  stats.array_leaves, stats.inline_leaves = arrays, len(plan.leaves) - arrays
  kvstore = job.storage.step_spec(attempt.work_dir)
  try:
    try:
      handing.send(
          "begin", url=job.storage.url, storage_options=job.storage_options,
          step=attempt.step, token=attempt.token, work_dir=attempt.work_dir,
          arrays=_arrays(plan, kvstore, pid, count), process=pid,
          storage_format=plan.options.storage_format,
          reuse_copies=job.reuse_copies,
          reuse_leaves=(writer_reuse.leaves_message(plan)
                        if job.reuse_copies else None),
          reuse_checksum=plan.options.codec.resolved_checksum(
              plan.options.storage_format),
          take_sums=plan.options.codec.resolved_checksum(
              plan.options.storage_format) == "none",
          host_files=[{"process": p, "data": d}
                      for p, d in job.host_files.items()],
          processes=count, lease_s=attempt.lease_s,
          save_timeout_s=(None if handing.deadline is None
                          else handing.deadline.bound_s))
      packed, others = pack_lib.split_writes(plan)
      boxes = await _stage_packs(plan, packed, handing, writer)
      boxes += await _stage_all(plan, others, handing, writer)
      mine, whole = digests()
      handing.send("finish", tiling=mine, bound_s=attempt.timeout_s,
                   ocdbt_groups=ocdbt_groups,
                   index=index() if pid == 0 else None,
                   whole=whole if pid == 0 else None)
      if pid == 0:
        # Not before its writer holds the lease: a trainer killed once
        # save() returned leaves a lease naming a live process (a restarted
        # job's cleanup would remove an attempt its dead trainer holds).
        await asyncio.shield(handing.held)
    finally:
      for lp in plan.leaves:
        lp.source = None  # the caller's arrays are no longer needed
      job.on_staged()
    try:
      got = await asyncio.shield(handing.result)
    except asyncio.CancelledError:
      await _stop(handing, attempt.timeout_s)
      raise
    stats.bytes_written = got["bytes_written"]
    stats.bytes_reused = got["bytes_reused"]
    stats.chunks_reused = got["chunks_reused"]
    stats.boxes_written += boxes
    stats.peak_bytes_in_flight = limiter.peak_in_use
    return bool(got["committed"])
  except asyncio.CancelledError:
    if not handing.cancelled.done():
      await _stop(handing, attempt.timeout_s)
    raise
  except CheckpointError:
    if handing.gone and await _after_death(attempt, job, handing):
      return True  # its part was durable: committed all the same
    if not handing.result.done() and not handing.gone:
      await _stop(handing, attempt.timeout_s)  # no write goes on after
    raise
  except BaseException:
    if not handing.result.done() and not handing.gone:
      await _stop(handing, attempt.timeout_s)  # no write goes on after
    if handing.gone:
      await asyncio.to_thread(_record_death, job.storage, attempt, pid,
                              count, writer, handing.gone)
    raise
  finally:
    handing.end()


async def _after_death(attempt: Any, job: Any, handing: Handing) -> bool:
  """This host's writer died during the save: whether the step committed
  all the same. Its record says how far it got. Its part durable (the
  record is in and says so): process 0's writer commits once every record
  is in, so this waits for that (as a writer does: twice the bound; at
  once False when the attempt can no longer commit) and, committed, says
  with a warning that the writer died (the next save starts a new one).
  No record: this trainer writes it (``_record_death``), so process 0's
  writer stops waiting and commits nothing; False (the save fails)."""
  storage, step, token = job.storage, attempt.step, attempt.token
  pid, count = multihost.process_index(), multihost.process_count()

  def look() -> bool:
    said = through_storage.recorded(storage, step, token, pid, count)
    if said is None:
      _record_death(storage, attempt, pid, count, handing.writer,
                    handing.gone)
      return False
    return bool(said) and through_storage.wait_committed(
        storage, step, token, 2 * attempt.timeout_s)

  try:
    committed = await asyncio.to_thread(look)
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("ckpt: the writer process of this host died during the "
                    "save of step %d, and reading what it recorded failed: "
                    "%s", step, e)
    return False
  if committed:
    logging.warning(
        "ckpt: step %d is committed, but the writer process (pid %s) of "
        "this host died (%s) after its part was durable; the next save "
        "starts a new writer", step, handing.writer.pid,
        handing.writer.describe_end())
  return committed


async def _stage_packs(plan: Any, packed: list, handing: Handing,
                       writer: writer_client.WriterProcess) -> int:
  """This process's boxes of small leaves, cut into the packs the thread
  writer makes (ckpt/save/pack.py: the same packs, offsets and alignment),
  each joined straight into a shared-memory segment (its one copy) and
  handed over; the writer takes each box's crc32c, writes the pack and,
  at finish, the table. How many boxes."""
  limiter, n = handing.limiter, 0
  limit = max(pack_lib.ALIGN, min(pack_lib.MAX_PACK_OBJECT_BYTES,
                                  limiter.budget))
  shards = staging.ShardLookup()
  for p in pack_lib.batches(plan, packed, limit):
    if handing.failed:
      break
    grant = await limiter.acquire(p.total)
    if handing.gone:
      limiter.release(grant)
      raise CheckpointError(handing.gone)
    name = writer.segment_name()
    try:
      if p.recipes is None:
        p.recipes = pack_lib.recipes(plan, p.writes, shards)
      data = pack_lib.host_boxes(plan, p.writes, shards, p.recipes)
      parts, offsets, sizes, offset = [], [], [], 0
      for d in data:
        flat = np.ascontiguousarray(d).reshape(-1).view(np.uint8)
        parts.append(flat)
        if flat.nbytes % pack_lib.ALIGN:
          parts.append(np.zeros(pack_lib.ALIGN - flat.nbytes % pack_lib.ALIGN,
                                np.uint8))
        offsets.append(offset)
        sizes.append(flat.nbytes)
        offset += -(-flat.nbytes // pack_lib.ALIGN) * pack_lib.ALIGN
      handover.write_segment(name, parts)
      del data, parts
    except BaseException:
      limiter.release(grant)
      raise
    handing.hand(grant, {
        "shm": name, "nbytes": offset, "k": p.k,
        "leaves": [w.leaf for w in p.writes], "offsets": offsets,
        "sizes": sizes, "boxes": [[list(w.box.start), list(w.box.stop)]
                                  for w in p.writes],
        "data_bytes": sum(w.nbytes for w in p.writes)},
        sum(w.nbytes for w in p.writes), kind="pack")
    n += len(p.writes)
  return n


async def _stage_all(plan: Any, writes: list, handing: Handing,
                     writer: writer_client.WriterProcess) -> int:
  """Every owned array box staged into shared memory and handed over; how
  many. Format "ocdbt": the writer writes the boxes in batches, one
  transaction each, cut where the thread writer cuts them
  (ckpt/save/write.py): a ``flush`` when the budget is full (and the
  ``finish``), so both leave the same files."""
  n, batched = 0, plan.options.storage_format == "ocdbt"
  for w in writes:
    if w.box.size == 0:
      continue
    if handing.failed:
      break  # a write failed (the writer says which at finish) or it died
    grant = handing.limiter.try_acquire(w.nbytes)
    if grant is None:
      if batched:
        handing.send("flush")
      grant = await handing.limiter.acquire(w.nbytes)
    if handing.gone:
      handing.limiter.release(grant)
      raise CheckpointError(handing.gone)
    leaf = plan.leaves[w.leaf]
    name = writer.segment_name()
    try:
      piece = staging.device_piece(leaf, w)
      if w.nbytes <= INLINE_WORK_BYTES:
        _stage_into(leaf, w, piece, name)
      else:
        await asyncio.to_thread(_stage_into, leaf, w, piece, name)
    except BaseException as e:
      handing.limiter.release(grant)
      if isinstance(e, CheckpointError) or not isinstance(e, Exception):
        raise
      raise CheckpointError(
          f"leaf {tree.path_str(leaf.parts)!r}: staging {w.box.start}.."
          f"{w.box.stop} into shared memory failed: {e}") from e
    handing.hand(grant, {
        "shm": name, "nbytes": w.nbytes, "shape": list(w.box.shape),
        "dtype": leaf.entry.dtype, "start": list(w.box.start),
        "stop": list(w.box.stop), "array": w.leaf, "leaf_id": w.leaf,
        "leaf": tree.path_str(leaf.parts),
        "chunks": list(leaf.layout.chunks)}, w.nbytes)
    n += 1
  return n


def _record_death(storage: Any, attempt: Any, pid: int, count: int,
                  writer: writer_client.WriterProcess, why: str) -> None:
  """This host's writer died before its record: its trainer writes the
  record in its place, saying it failed, so that process 0's writer stops
  waiting for it at once (every record in, it removes the attempt) instead
  of waiting out its bound while every trainer waits for it. Never while
  the writer may still run, never over a record it wrote (its part is
  durable then: the step may commit)."""
  if not writer.exited():
    return
  try:
    key = through_storage.record_key(attempt.work_dir, pid)
    if storage.read_bytes(key, limit=through_storage.MAX_RECORD_BYTES) is None:
      through_storage.write_record(storage, attempt.step, attempt.token, pid,
                                   count, error=why)
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("ckpt: could not record that the writer of process %d "
                    "died (step %d): %s", pid, attempt.step, e)


async def _stop(handing: Handing, timeout_s: float) -> None:
  """The writer stops this save (its started writes end first); waits for
  its word, at most ``timeout_s``."""
  try:
    handing.send("cancel")
    await asyncio.wait_for(asyncio.shield(handing.cancelled), timeout_s)
  except (CheckpointError, asyncio.TimeoutError):
    pass  # gone, or not answering: its end says the rest
  except asyncio.CancelledError:
    pass

