"""Stages 3 to 9 of a save, on the Checkpointer's background thread.

The save was agreed already (ckpt/multihost/agreement.py): every process knows the
step, the attempt token and the work directory process 0 prepared. Then:

3-4. stage and write this process's boxes under one byte budget (save.py)
5.   barrier "written": every process has stopped writing; failures travel
     with it, so one failed process fails the save on all of them at once
     (process 0 reads them and, unless the step has OCDBT merge groups,
     relays them in the outcome: one call per process fewer)
     Before it, each process writes its own small files into the attempt
     (index.process_file): its host_state and, for format "zarr", the
     crc32c of each box it wrote; nothing per process goes through the
     coordinator or into the index
6.   process 0 merges OCDBT databases, writes the index
7.   process 0 commits (storage.py knows how)
9.   the outcome: process 0 says how the save ended (one key); every
     other process reads it with one blocking get (no barrier: process 0
     waits for nobody, the others only wait for it)
8.   retention, on process 0, after the save is complete everywhere (see
     ``Retention``): a failure there is logged, never a failed save

A save that fails after the "written" barrier is removed by process 0 (every
process has said it stopped writing into it), so a job that ran out of space
gets it back; but not one that stalled past its bound (``save_timeout_s``,
ckpt/store/deadline.py): writes abandoned then may still land, so that attempt
stays, recorded under ``pending/``, for cleanup. Its coordination keys are
deleted once no process needs them: after a failure at the barrier
"removed", after a success at the next save of the directory (every
process read the outcome before it joined that save's round).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from typing import Any, Awaitable, Callable, TypeVar

from absl import logging
import msgpack

from ckpt.commit import protocol as commit_lib
from ckpt.commit import cleanup as cleanup_lib
from ckpt.commit import strategy
from ckpt.store import deadline as deadline_lib
from ckpt.format import index as index_lib
from ckpt.format import seal
from ckpt.commit import renewal as renewal_lib
from ckpt.multihost import process as multihost
from ckpt.store import ocdbt
from ckpt.save import durable
from ckpt.save import handed
from ckpt.save import outcome
from ckpt.save import polite
from ckpt.save.outcome import Attempt
from ckpt.commit import retention as retention_lib
from ckpt.save import leaves as leaves_lib
from ckpt.save import write as save_lib
from ckpt.store import storage as storage_lib
from ckpt.shards import tiling
from ckpt.errors import BarrierTimeoutError, CheckpointError
from ckpt.store.limiter import ByteLimiter

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class SaveJob:
  """What this process brings to an agreed save, and where it goes (built
  by the Saver, ckpt/face/saver.py, once per save)."""
  plan: leaves_lib.SavePlan
  storage: storage_lib.Storage
  context: Any                   # the save's TensorStore context
  budget: int                    # bytes staged at once (concurrent_bytes)
  host_files: dict[int, bytes]   # the host_state file(s) this process writes
  stats: save_lib.SaveStats      # filled in as the save goes
  on_staged: Callable[[], None]  # the caller's arrays are free again
  reuse: Any = None  # a ckpt/save/reuse.py SaveReuse (reuse_unchanged=True)
  # writer="process": this host's writer process writes (ckpt/save/handed.py)
  writer: Any = None
  storage_options: dict | None = None
  # reuse_unchanged=True with the writer process: the copies its writer
  # keeps (ckpt/save/writer_reuse.py); 0: off
  reuse_copies: int = 0


@dataclasses.dataclass(frozen=True)
class IndexFacts:
  """What process 0's index records beyond the plan."""
  metrics: dict
  clock: Callable[[], float] = time.time  # the save time (time retention)
  custom_metadata: str | None = None
  temporary: bool = False


async def run_save(attempt: Attempt, job: SaveJob, facts: IndexFacts) -> None:
  """Stages 3-7 and 9 on every process; returns once the step is committed
  everywhere, or raises the agreed failure. A stage's failure is kept
  (``_outcome``) for the next barrier, which tells every process."""
  pid = multihost.process_index()
  # The driver's per-write fsyncs off; synced once (durable.py).
  kvstore = durable.deferred(job.plan.options.storage_format,
                             job.storage.step_spec(attempt.work_dir))
  stopped_writing = []  # non-empty once every process stopped writing
  # Process 0 renews the lease on a thread of its own (ckpt/commit/renewal.py);
  # with writer="process", process 0's writer does (and commits).
  lease = (renewal_lib.Renewal(job.storage, attempt.step, attempt.token,
                               attempt.lease_s).start()
           if pid == 0 and job.writer is None else None)
  committed = False
  committed_everywhere = False  # process 0: the outcome says so
  try:
    # 3-4. This process's boxes under one byte budget, its host_state file
    # alongside, then its other small files.
    if job.writer is not None:  # written by the writer process (handed.py)
      committed, error = await _outcome(handed.write(
          attempt, job, lambda: index_lib.encode(_index(attempt, job, facts)),
          lambda: _digests(job.plan), _ocdbt_groups(job.plan)))
      late = None
    else:
      host_files = _write_host_files(attempt, job)
      sums, error = await _outcome(_write_boxes(attempt, job, kvstore))
      _, late = await _outcome(
          _write_own_files(attempt, job, host_files, sums, error is None))
    # 5. Every process has written (or stopped writing, having failed).
    # Only process 0 reads the failures reported there, and relays them in
    # the outcome (one call per process fewer: each call is one more for the
    # coordination service process 0 runs); with OCDBT merge groups every
    # process merges after "written", so all hear of failures there.
    # (writer="process": process 0's writer merged them, then committed)
    groups = _ocdbt_groups(job.plan) if job.writer is None else 0
    relay = groups <= 1
    own = error or late
    await outcome.barrier(attempt, "written", outcome.WRITTEN, own,
                          on_arrival=lambda: stopped_writing.append(True),
                          heard=not relay)
    # 6. A large OCDBT step: its merge groups, on every process at once.
    if groups > 1:
      _, error = await _outcome(_merge_groups(kvstore, job, groups))
      await outcome.barrier(attempt, "merged",
                            "every OCDBT merge group was merged", error)
    # 6-7. Process 0: the index written, the commit, unless a process
    # failed to write (then relayed to the others in the outcome).
    error, report, relayed = (own if relay else None), True, {}
    if pid == 0:
      relayed, failure = (await _outcome(asyncio.to_thread(
          multihost.reported_failures, f"{attempt.key}/written/failed",
          attempt.timeout_s))) if relay else ({}, None)
      if failure is not None:  # (the service did not answer: in the outcome)
        error = own or failure
      elif relayed or own is not None:
        error = own or outcome.failed(attempt, outcome.WRITTEN, relayed)
        report = not relayed  # (relayed: the others read them in the outcome)
      elif not committed:  # (writer="process": process 0's writer did)
        _, error = await _outcome(
            _commit(attempt, job, facts, kvstore, groups == 1, lease))
    elif error is not None:
      report = False  # process 0 relays what it reported at "written"
    # 9. The outcome, from process 0.
    await outcome.done(attempt, error, report, relayed)
    committed_everywhere = True
  except BaseException as e:
    if not committed:  # (a step the writers committed stays)
      await _after_failure(attempt, job.storage, e, bool(stopped_writing))
    elif stopped_writing:
      # writer="process": the writers committed, yet a process failed (its
      # writer died after its record): the others, who do not know it
      # committed, wait for the removal at this barrier; nothing to remove.
      await _removed_barrier(attempt, e)
    raise
  finally:
    if lease is not None:
      lease.stop()
    if stopped_writing and pid == 0:
      outcome.forget(attempt, read=not committed_everywhere)


async def _outcome(stage: Awaitable[T]) -> tuple[T | None, Exception | None]:
  """One stage's result, or its failure, kept for the next barrier to tell
  every process (a cancel, or any other BaseException, goes on at once)."""
  try:
    return await stage, None
  except Exception as e:  # pylint: disable=broad-except
    return None, e


def _write_host_files(attempt: Attempt, job: SaveJob) -> asyncio.Future:
  """Starts writing this process's host_state file (its own, or its share
  of EveryProcess), alongside its boxes; ``_write_own_files`` awaits it."""
  return asyncio.gather(*(_write_process_file(
      job.storage, attempt, index_lib.HOST_STATE_DIR, p, data)
      for p, data in job.host_files.items()), return_exceptions=True)


async def _write_boxes(attempt: Attempt, job: SaveJob, kvstore) -> list:
  """3-4. Stages and writes this process's boxes under one byte budget,
  durable before the "written" barrier (durable.py); with ``reuse``, the
  step linked from checked to be still ours before and after, and what
  was linked recorded. Returns the crc32c of each box (format "zarr")."""
  plan, storage, reuse, stats = job.plan, job.storage, job.reuse, job.stats
  pid = multihost.process_index()
  step_dir = (os.path.join(os.fspath(storage.root), attempt.work_dir)
              if storage.is_posix else None)  # (a root on POSIX only)
  if reuse is not None:  # is the step linked from still ours?
    await asyncio.to_thread(reuse.check_source)
  polite_drop = (not plan.borrow and storage.is_posix  # async (polite.py)
                 and polite.DROP_WRITTEN_PAGES)
  syncer = (durable.Syncer.start(plan, kvstore, step_dir, pid,
                                 multihost.process_count(), drop=polite_drop)
            if storage.is_posix else None)
  try:
    sums = await save_lib.write_owned(
        plan, kvstore, job.context, ByteLimiter(job.budget), stats,
        job.on_staged, reuse, syncer and syncer.written,
        syncer and syncer.window, syncer and syncer.write_raw)
    if syncer is not None:  # durable before the "written" barrier
      await asyncio.to_thread(syncer.finish)
    if reuse is not None:  # and still, now that every link is made?
      await asyncio.to_thread(reuse.check_source)
  except Exception:  # a bucket: which leaves are held by the previous
    if reuse is not None:  # step (every process, failed or not)
      await reuse.settle(f"{attempt.key}/reuse", attempt.timeout_s, True,
                         stats)
    raise
  finally:
    if syncer is not None:
      syncer.close()
  if reuse is not None:
    await reuse.settle(f"{attempt.key}/reuse", attempt.timeout_s, False, stats)
    stats.chunks_reused = reuse.chunks_reused
    await _write_process_file(storage, attempt, index_lib.REUSE_DIR, pid,
                              reuse.record_file(pid, stats.bytes_written))
  if polite_drop and syncer is None:  # else dropped as each is synced
    await asyncio.to_thread(polite.drop_cached_pages, step_dir)
  return sums


async def _write_own_files(attempt: Attempt, job: SaveJob,
                           host_files: asyncio.Future, sums: list | None,
                           wrote: bool) -> None:
  """The host_state file awaited, even after a failure: past the "written"
  barrier this process writes nothing into the attempt. If its boxes were
  written (``wrote``): their crc32c (zarr v2). (The tiling of every array
  was checked in the save round: agreement.save_round.)"""
  if failed := [r for r in await host_files if isinstance(r, Exception)]:
    raise failed[0]
  if not wrote:
    return
  plan, pid = job.plan, multihost.process_index()
  if plan.options.codec.resolved_checksum(
      plan.options.storage_format) == "none":  # zarr v2: its checksums
    await _write_process_file(
        job.storage, attempt, index_lib.CHECKSUMS_DIR, pid,
        msgpack.packb({"process": pid, "boxes": sums}, use_bin_type=True))


def _digests(plan: leaves_lib.SavePlan) -> tuple[list, list]:
  """writer="process": this process's tiling digest and that of every
  array once, which process 0's writer checks (through_storage.py)."""
  return list(tiling_digest(plan)), list(whole_digest(plan))


async def _merge_groups(kvstore, job: SaveJob, groups: int) -> None:
  """6, a large OCDBT step: this process's share of its merge groups."""
  n = multihost.process_count()
  for g in ocdbt.merges_of(multihost.process_index(), n, groups):
    await ocdbt.merge(kvstore, n, job.context, g)


async def _commit(attempt: Attempt, job: SaveJob, facts: IndexFacts, kvstore,
                  merge: bool, lease) -> None:
  """6-7, process 0: one OCDBT database (``merge``), the index, then the
  commit (that every array is written exactly once was checked in the save
  round). encode() refuses an index readers would refuse: the save then
  fails everywhere in its outcome, and nothing is committed."""
  storage, step, reuse = job.storage, attempt.step, job.reuse
  if merge:  # one database from the per-process ones (ckpt/store/ocdbt.py)
    await ocdbt.merge(kvstore, multihost.process_count(), job.context)
  data = index_lib.encode(_index(attempt, job, facts))
  # Not cut by a cancel (Checkpointer.cancel): the task ends once the
  # commit has, so what cancel finds is committed or not.
  committing = asyncio.ensure_future(asyncio.to_thread(
      commit_lib.commit, storage, step, attempt.token, data, lease))
  try:
    await asyncio.shield(committing)
  except asyncio.CancelledError:
    await asyncio.gather(committing, return_exceptions=True)
    raise
  if reuse is not None and reuse.held is not None:  # still held?
    await asyncio.to_thread(reuse.held.check_committed, storage, step)


def _index(attempt: Attempt, job: SaveJob,
           facts: IndexFacts) -> index_lib.Index:
  index = save_lib.make_index(job.plan, attempt.step, facts.metrics,
                              multihost.process_count())
  index = dataclasses.replace(index, time=retention_lib.now_s(facts.clock),
                              custom_metadata=facts.custom_metadata,
                              host_states=attempt.host_states,
                              temporary=facts.temporary)
  if job.reuse is not None and job.reuse.held is not None:
    index = job.reuse.held.apply(index)  # leaves held by an earlier step
  return index


async def _after_failure(attempt: Attempt, storage: storage_lib.Storage,
                         error: BaseException, stopped_writing: bool) -> None:
  """Once every process has said (at "written") that it stopped writing,
  process 0 removes the failed attempt now, not at the next save, and
  every process waits for that; unless one gave up at the deadline,
  leaving writes in flight (ckpt/store/deadline.py). Else the attempt
  stays for the cleanup of a later save."""
  pid = multihost.process_index()
  if stopped_writing:
    if pid == 0 and not deadline_lib.abandoned(error):
      await asyncio.to_thread(_remove_failed, storage, attempt)
    await _removed_barrier(attempt, error)
  elif pid == 0 and not isinstance(error, asyncio.CancelledError):
    # (cancel() removes a cancelled save's attempt itself)
    logging.warning(
        "ckpt: the failed save of step %d leaves its attempt %s in %s: not "
        "every process said it stopped writing into it; its lease is no "
        "longer renewed, and the cleanup of the next save removes it once "
        "the lease is %g s old", attempt.step, attempt.work_dir, storage.url,
        attempt.lease_s)


async def _write_process_file(storage: storage_lib.Storage, attempt: Attempt,
                              kind: str, pid: int, data: bytes) -> None:
  """One of this process's files in the attempt's directory
  (index.process_file): its host_state, or (format "zarr") the crc32c of
  every box it wrote. Written before the "written" barrier, so the commit
  (rename or marker) covers it and a failed attempt is removed with it;
  nothing of it passes through the coordinator or grows the index."""
  rel = index_lib.process_file(kind, pid)
  what = f"the {kind.lstrip('.')} file of process {pid}, step {attempt.step},"
  await asyncio.to_thread(_write_file, storage, attempt.work_dir, rel,
                          seal.seal(data), what)


def _write_file(storage: storage_lib.Storage, work_dir: str, rel: str,
                data: bytes, what: str) -> None:
  if len(data) > index_lib.MAX_PROCESS_FILE_BYTES:
    raise CheckpointError(
        f"{what} is {len(data)} bytes; readers accept at most "
        f"{index_lib.MAX_PROCESS_FILE_BYTES}")
  strategy.for_storage(storage).write_into_attempt(work_dir, rel, data,
                                                   what)


def _ocdbt_groups(plan: leaves_lib.SavePlan) -> int:
  """Format "ocdbt": how many merge groups the step has (1: one database at
  the step's root); 0 for the other formats."""
  if plan.options.storage_format != "ocdbt":
    return 0
  groups = {getattr(lp.entry, "ocdbt_group", None) for lp in plan.leaves
            if lp.layout is not None}
  groups.discard(None)
  return max(groups) + 1 if groups else 1


def _weights(plan: leaves_lib.SavePlan) -> dict[int, int]:
  """``tiling.weight`` of each array leaf's relpath, by leaf (once per
  plan: plan.memo; both digests below use them)."""
  got = plan.memo.get("weights")
  if got is None:
    got = plan.memo["weights"] = {i: tiling.weight(lp.entry.relpath) for i, lp
                                  in enumerate(plan.leaves) if lp.layout}
  return got


def tiling_digest(plan: leaves_lib.SavePlan) -> tiling.Digest:
  """The digest of this process's writes (once per plan: plan.memo),
  posted in the save round (agreement.save_round), where process 0 checks
  that every array is written exactly once before anything is."""
  got = plan.memo.get("tiling")
  if got is None:
    weights, leaves = _weights(plan), plan.leaves
    got = plan.memo["tiling"] = tiling.weighted(
        (weights[w.leaf], leaves[w.leaf].entry.shape, w.box.start,
         w.box.stop) for w in plan.writes)
  return got


def whole_digest(plan: leaves_lib.SavePlan) -> tiling.Digest:
  """The digest of every array tiled once (once per plan: plan.memo)."""
  got = plan.memo.get("whole")
  if got is None:
    leaves = plan.leaves
    got = plan.memo["whole"] = tiling.whole_weighted(
        (w, leaves[i].entry.shape) for i, w in _weights(plan).items())
  return got


async def _removed_barrier(attempt: Attempt, error: BaseException) -> None:
  """After a failure every process heard at a barrier (all are alive and
  here): they raise only once process 0 removed the failed attempt, so no
  process sees a half-removed attempt after its save() raised. Skipped
  when a process may be missing (a barrier timed out, a cancel)."""
  if isinstance(error, (asyncio.CancelledError, BarrierTimeoutError)):
    return
  try:
    key = f"{attempt.key}/removed"
    await asyncio.to_thread(attempt.waiting.wait, key, lambda: (
        multihost.barrier(key, timeout_s=attempt.timeout_s, what=(
            f"the failed attempt removed, step {attempt.step}"))))
  except BarrierTimeoutError as e:  # the save's own error is the one raised
    logging.warning("ckpt: %s", e)


def _remove_failed(storage: storage_lib.Storage, attempt: Attempt) -> None:
  try:
    cleanup_lib.remove_attempt(storage, attempt.step, attempt.token)
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("ckpt: could not remove the failed attempt %s of step %d "
                    "in %s: %s", attempt.token, attempt.step, storage.url, e)
