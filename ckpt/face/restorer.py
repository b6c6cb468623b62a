"""The restore of a Checkpointer, and the agreement rounds of its reads.

``Restorer`` owns what a restore needs: its options (``restore_dtype``,
``read_once``, the byte budget), the restore in flight (``restore_async``'s
handle), the rounds of read-once lazy leaves, the stats and step of the last
restore. ``start(request)`` (a ckpt/restore/job.py RestoreRequest, as the
public call made it) is the body of ``Checkpointer.restore_async``, and
its handle's ``result()`` that of ``Checkpointer.restore``: the agreed
choice of the step (one read round, ckpt/face/rounds.py), the read on the
background loop, then the read-once exchange on the caller's thread
(ckpt/restore/readonce.py), and a resume's fall back past a damaged step.
Its reads stall at most ``query_timeout_s`` (ckpt/store/deadline.py).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
import weakref

from absl import logging
from typing import Any, Callable


from ckpt.multihost import posts as posts_lib
from ckpt.commit import steps as steps_lib
from ckpt.face import inflight as inflight_lib
from ckpt.face import known as known_lib
from ckpt.face import loop as loop_lib
from ckpt.face import retention as retention_lib
from ckpt.face import rounds as rounds_lib
from ckpt.store import deadline as deadline_lib
from ckpt.store import progress as progress_lib
from ckpt.store import storemeter
from ckpt.multihost import agreement
from ckpt.multihost import process as multihost
from ckpt.restore import handle as handle_lib
from ckpt.restore import job as job_lib
from ckpt.restore import readcount
from ckpt.restore import readonce
from ckpt.restore import read as restore_lib
from ckpt.store import storage as storage_lib
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.store.progress import rate_text, size_text


@dataclasses.dataclass(frozen=True)
class RestoreSettings:
  """A Checkpointer's restore options (see its docstring)."""
  restore_dtype: Any
  read_once: bool | None
  concurrent_bytes: int
  storage_options: dict | None


class Restorer:
  """The restores of one Checkpointer (see the module docstring)."""

  def __init__(self, settings: RestoreSettings,
               storage: storage_lib.Storage, rounds: rounds_lib.Rounds,
               known: known_lib.KnownSteps,
               retention: retention_lib.Retention,
               inflight: inflight_lib.InFlightSave,
               loop: loop_lib.BackgroundLoop):
    self.settings = settings
    self.storage = storage
    self._context = storage.context()
    self._rounds = rounds
    self._known = known
    self._retention = retention
    self._inflight = inflight
    self._loop = loop
    self.last_restore_stats = readonce.RestoreStats()
    self.last_restore_step: int | None = None  # whose data came back
    # The keys of earlier attempts' rounds, forgotten once a later round
    # passed (_passed): every process has read their decisions by then.
    self._round_keys: list[str] = []
    # Read-once lazy leaves' rounds (made by the first restore needing them).
    self._lazy_rounds: readonce.LazyRounds | None = None
    # restore_async's handle in flight (weakly: one dropped without
    # result() releases its claim, _pending_handle), and what ends it then.
    self._pending: weakref.ref | None = None
    self._orphan: Callable[[], None] | None = None

  def cancel_pending(self, why: str) -> None:
    """close(): a restore_async whose result() was not taken is cancelled."""
    pending = self._pending_handle()
    if pending is not None and not pending.finished:
      pending.cancel(why)

  def _pending_handle(self) -> handle_lib.RestoreHandle | None:
    """restore_async's handle whose result() was not taken, or None. One
    no longer referenced anywhere (dropped without result()) is ended
    here: its reads cancelled, its step's claim released, with a WARNING;
    the caller (the next save, restore or close) goes on."""
    if self._pending is None:
      return None
    h = self._pending()
    if h is not None and not h.finished:
      del h
      gc.collect()  # one held only by a reference cycle is dropped too
      h = self._pending()
    if h is not None:
      if h.finished:
        h = self._pending = self._orphan = None
      return h
    orphan, self._pending, self._orphan = self._orphan, None, None
    if orphan is not None:
      orphan()
    return None

  def start(self, request: job_lib.RestoreRequest
            ) -> handle_lib.RestoreHandle:
    """The body of ``Checkpointer.restore_async`` (``restore`` is its
    ``result()``): the agreed choice of the step now, on the caller's
    thread; the reads start on the background loop; the rounds, the
    read-once exchange and a fallback happen in ``result()``, on the
    caller's thread (device collectives belong there)."""
    meter = storemeter.Meter()  # bytes fetched from the store, this process
    meter.__enter__()  # left by the handle, once it has finished
    try:
      job = self._begin(request, meter)
      fut = self._start_reads(job)
    except BaseException:
      meter.__exit__(None, None, None)
      raise

    def finish(timeout):
      return self._complete(job, fut, timeout)

    def cancel():
      if not fut.done():
        self._loop.run(job_lib.cancelled(job))
      self._release(job)

    ended = []  # once the handle has finished
    # [orphan] until the handle has finished: then leave and orphan no
    # longer hold each other, so the restored tree (fut's value, held by
    # cancel) goes with the handle, not at the next garbage collection.
    mine = []

    def leave():
      ended.append(True)
      meter.__exit__(None, None, None)
      if mine and self._orphan is mine[0]:  # holds the reads no longer
        self._pending = self._orphan = None
      mine.clear()

    what = f"restore_async of step {job.step}"

    def orphan():  # the handle was dropped without result()
      if ended:
        return
      logging.warning("ckpt: the handle of %s was dropped without its "
                      "result(); its reads are cancelled", what)
      try:
        cancel()
      finally:
        leave()

    mine.append(orphan)
    h = handle_lib.RestoreHandle(finish, fut, cancel, leave, what)
    self._pending, self._orphan = weakref.ref(h), orphan
    return h

  def check_no_pending(self, call: str) -> None:
    """save/restore while a restore_async's result() has not been taken:
    refused, on every process alike (each made the same calls)."""
    h = self._pending_handle()
    if h is not None:
      raise CheckpointError(
          f"{call} refused: {h.what} is in flight; call its result() "
          "first (restore_async is collective: every process takes its "
          "result() before its next save or restore)")

  def _begin(self, request: job_lib.RestoreRequest,
             meter: storemeter.Meter) -> job_lib.RestoreJob:
    """The agreed choice of the step (one round, on every process)."""
    # Both keys first: nothing below may shift them on one process only.
    read_key = self._rounds.read_key()
    key = self._rounds.key("readonce")  # every restore
    t_start = time.perf_counter()
    step, path, read_once = request.step, request.path, request.read_once
    if isinstance(read_once, str) and read_once == "default":
      read_once = self.settings.read_once
    got = {"storage": self.storage, "report": None}

    def own_checks() -> None:  # a failure joins the round below
      self._loop.check_open()
      self.check_no_pending("restore")
      readonce.min_replicas(read_once, "")  # validates it
      got["report"] = progress_lib.reporter(
          request.progress, "ckpt restore",
          lambda: job_lib.target_bytes(request.target))
      if path is not None:
        got["storage"] = storage_lib.Storage(path,
                                             self.settings.storage_options)
    error = posts_lib.failure_of(own_checks)
    storage, report = got["storage"], got["report"]
    self._inflight.settle()
    t_find = time.perf_counter()
    if path is not None:
      # Processes may each read their own copy (a path on a local disk):
      # then each finds its own step directory.
      step_dir = self._rounds.agreed(
          f"restore(path=..., step={step!r}, read_once={read_once!r}, "
          f"store={readonce.storage_kind(storage.url)})",
          lambda: restore_lib.locate_path(storage, step),
          f"the step directory under {os.fspath(path)!r}",
          where=storage.url, key=read_key, error=error)
      is_resuming, protected = False, None
    else:
      step, step_dir, is_resuming = self._rounds.agreed(
          f"restore(step={step!r}, read_once={read_once!r})",
          lambda: self._choose_step(step),
          f"the step to restore from {self.storage.url!r}", key=read_key,
          error=error)
      protected = step if multihost.process_index() == 0 else None
    return job_lib.RestoreJob(
        request=request, storage=storage, step=step, step_dir=step_dir,
        is_resuming=is_resuming, protected=protected, read_once=read_once,
        read_once_min=readonce.min_replicas(read_once, storage.url),
        key=key, run_key=key, t_start=t_start, meter=meter,
        find_s=time.perf_counter() - t_find, report=report)

  def _start_reads(self, job: job_lib.RestoreJob):
    """Starts this attempt's reads on the background loop; returns their
    future (a concurrent.futures.Future)."""
    request = job.request
    job.reading = (f"step {job.step}" if request.path is None else
                   f"{job.step_dir!r}")
    job.stats = readonce.RestoreStats(read_once=job.read_once)
    job.stats.find_s = job.find_s if job.attempt == 0 else 0.0
    job.counter = readcount.ReadCounter()
    self.last_restore_stats = job.stats
    # With read-once on (agreed: the same on every process), a process that
    # fails must say so before the others start an exchange it never joins.
    job.rounds = job.read_once_min is not None and multihost.is_multiprocess()
    lazy_reads = None
    if request.lazy:  # the leaves' later reads count here; read once: collectives
      if job.rounds and self._lazy_rounds is None:
        self._lazy_rounds = readonce.LazyRounds(f"{job.run_key}-lazy",
                                                self._rounds.barrier_s)
      lazy_reads = readonce.LazyReads(
          job.counter, job.stats, self._lazy_rounds if job.rounds else None,
          name=f"restore {job.run_key}", meter=job.meter,
          deadline=lambda: self._rounds.read_deadline(job.storage.url,
                                                      job.reading))
    guard = keepalive = None
    if request.lazy and request.path is None:
      guard = steps_lib.guard(job.storage, job.step)
      if job.protected is not None:  # the step outlives this call
        keepalive = self._retention.keepalive(job.step)
    args = restore_lib.RestoreArgs(
        target=request.target, restore_dtype=self.settings.restore_dtype,
        transforms=tuple(request.transforms),
        fallback_state=request.fallback_state, lazy=request.lazy,
        is_resuming=job.is_resuming, verify=request.verify,
        guard=guard, keepalive=keepalive, read_once_min=job.read_once_min,
        lazy_reads=lazy_reads)
    job.t_read = time.perf_counter()
    reads = job_lib.tracked(job, deadline_lib.bounded(
        readcount.counted(restore_lib.restore(
            job.storage, job.step_dir, args, self.settings.concurrent_bytes,
            self._context, job.stats), job.counter),
        self._rounds.read_deadline(job.storage.url, job.reading)))
    fut = self._loop.submit(progress_lib.reported(
        reads, job.report, lambda: job.counter.bytes_read))
    stats = job.stats

    def done(_):  # when the reads ended, whenever result() is called
      stats.read_s = max(0.0, time.perf_counter() - job.t_read -
                         stats.index_s)
    fut.add_done_callback(done)
    return fut

  def _complete(self, job: job_lib.RestoreJob, fut,
                timeout: float | None) -> Any:
    """Waits for the reads (``timeout``: WaitTimeoutError, the reads go
    on), then the rounds and the exchange; falls back past a damaged step
    on a resume."""
    job_lib.wait_reads(fut, timeout, job)
    may_fall_back = job.request.may_fall_back
    # An explicit step or path: one outcome round, so that a failure on one
    # process is every process's (a resume: _fallback_round).
    agree_outcome = multihost.is_multiprocess()
    while True:
      error = None
      try:
        result = self._finish_step(job, fut)
      except Exception as e:  # pylint: disable=broad-except
        if not may_fall_back and not agree_outcome:
          self._release(job)
          raise
        result, error = None, e
      self._release(job)
      if agree_outcome and not may_fall_back:
        # A failure on one process is every process's, named alike.
        t = time.perf_counter()
        try:
          agreement.outcome_round(f"{job.run_key}/outcome", error,
                                  f"restore of {job.reading}",
                                  timeout_s=self._rounds.barrier_s)
          self._passed(job.run_key)
        finally:
          job.stats.rounds_s += time.perf_counter() - t
      if may_fall_back:
        t = time.perf_counter()
        older = self._fallback_round(f"{job.run_key}/verified", error,
                                     job.step)
        self._passed(job.run_key)
        job.stats.rounds_s += time.perf_counter() - t
        if older is not None:
          job.damaged.append(job.step)
          self._retention.set_damaged(job.damaged)
          job.step, job.step_dir = older
          if multihost.process_index() == 0:
            job.protected = job.step  # _fallback_round protected it
          job.attempt += 1
          # Not under job.key: that attempt's keys go while this one's
          # rounds are still read (_passed).
          job.run_key = f"{job.key}-fallback{job.attempt}"
          fut = self._start_reads(job)
          job_lib.wait_reads(fut, None, job)
          continue
      if error is not None:
        raise error
      self.last_restore_step = job.step
      stats = job.stats
      stats.total_s = time.perf_counter() - job.t_start
      logging.info(
          "ckpt: restored step %s from %s: this process read %s in %.2f s "
          "(%s; %s)%s", job.step, job.storage.url,
          size_text(stats.bytes_read), stats.total_s,
          rate_text(stats.bytes_read, stats.total_s), stats.stages_text(),
          f"; fell back past damaged step(s) {job.damaged}"
          if job.damaged else "")
      return result

  def _passed(self, key: str) -> None:
    """A round of the attempt ``key`` passed its barrier on every process,
    so each has read the decisions of every earlier attempt's (and
    restore's) rounds: process 0 forgets those keys. Never ``key``'s own:
    a process may not have read this round's decision yet."""
    for k in self._round_keys:
      if k != key:
        multihost.forget(k)
    self._round_keys = [key]

  def _release(self, job: job_lib.RestoreJob) -> None:
    if job.protected is not None:
      self._retention.release(job.protected)
      job.protected = None

  def _finish_step(self, job: job_lib.RestoreJob, fut) -> Any:
    """The rest of one attempt, on the caller's thread: its outcome round
    (read once), the exchange, the stats."""
    stats, counter, key, rounds = job.stats, job.counter, job.run_key, job.rounds

    def check(i, e):
      """The round before exchange i: every process's outcome, and what
      it fetched so far (the last round's sum is fetched_bytes_all)."""
      if rounds:
        sums = multihost.all_ok(
            f"{key}/{i}", e, f"restore from {job.step_dir!r}",
            self._rounds.barrier_s, tally=job.meter.value)
        if sums:
          stats.fetched_bytes_all = sum(sums.values())
    t = time.perf_counter()
    try:
      result, error = None, None
      try:
        result = fut.result()
      except Exception as e:  # pylint: disable=broad-except
        if not rounds:
          raise
        error = e
      check("read", error)
      if rounds:
        # Every process reached this restore's first round, so each is done
        # with the previous restore's rounds: their keys can go.
        self._passed(key)
      # The exchange: collectives on this (the caller's) thread; the reads
      # of each batch on the background thread.
      result = readonce.finish(
          result, lambda batch: self._loop.run(deadline_lib.bounded(
              readcount.counted(restore_lib.read_parts(
                  batch, self.settings.concurrent_bytes), counter),
              self._rounds.read_deadline(job.storage.url, job.reading))),
          self.settings.concurrent_bytes, stats, check)
      return result
    finally:
      stats.finish_s += time.perf_counter() - t
      stats.add_reads(counter)
      stats.fetched_bytes = job.meter.value
      if not multihost.is_multiprocess():
        stats.fetched_bytes_all = stats.fetched_bytes
      stats.total_s = time.perf_counter() - job.t_start

  def _fallback_round(self, key: str, error: BaseException | None,
                      step: int) -> tuple[int, str] | None:
    """After a resume read ``step``: every process says whether it found
    damaged data. If any did, all get (the newest older step, its
    directory), chosen by process 0 and protected there from retention,
    and log one WARNING naming what failed; None if none did (or no older
    step is left: then the corrupt process raises its error and every
    other one a CorruptCheckpointError naming it)."""
    corrupt = isinstance(error, CorruptCheckpointError) or (
        isinstance(error, CheckpointError) and
        "CorruptCheckpointError" in str(error))  # another's, via all_ok
    verdict = (posts_lib.Verdict.CORRUPT if corrupt else
               posts_lib.Verdict.ERROR if error else posts_lib.Verdict.OK)
    post = [verdict.value, "" if error is None else str(error)[:2000]]
    retention = self._retention

    def decide(got: dict[int, list]) -> dict:
      bad = [(p, g[1]) for p, g in got.items()
             if g[0] == posts_lib.Verdict.CORRUPT.value]
      if not bad:
        failed = {p: g[1] for p, g in got.items()
                  if g[0] == posts_lib.Verdict.ERROR.value}
        return {"failed": failed} if failed else {}
      p, why = bad[0]
      try:
        older = [s for s in self._known.committed_now(
            self._inflight.step_running(), retention.damaged()) if s < step]
        choice = None
        if older:
          choice = older[-1]
          retention.protect(choice)
          choice = [choice, steps_lib.step_dir(self.storage, choice)]
      except Exception as e:  # pylint: disable=broad-except
        choice, why = None, f"{why}; and no older step could be chosen: {e}"
      return {"process": p, "why": why, "older": choice}

    out = self._rounds.agree(
        key, post, decide, f"whether step {step} verified on every process")
    if not out:
      return None
    if "failed" in out:  # every process ends alike
      if error is not None:
        raise error
      raise CheckpointError(
          f"restore of step {step} failed on process(es) "
          f"{sorted(int(p) for p in out['failed'])}: " + "; ".join(
              f"process {p}: {m}" for p, m in out["failed"].items()))
    if out["older"] is None:
      if error is not None:
        raise error
      raise CorruptCheckpointError(
          f"step {step} failed verification on process {out['process']} "
          f"and no older committed step is left: {out['why']}")
    older, older_dir = out["older"]
    logging.warning(
        "ckpt: step %d in %s failed verification (process %d: %s); resuming "
        "from step %d, the newest older step, instead", step,
        self.storage.url, out["process"], out["why"], older)
    return older, older_dir

  def _choose_step(self, step: int | None) -> list:
    """Process 0: [step, its directory, whether it is the latest], with the
    step protected from retention until the restore ends. A resume uses a
    listing made just before (``_recent_steps``): one listing per resume."""
    flying = self._inflight.step_running()
    steps = (self._known.recent_steps(flying) if step is None else None) or (
        self._known.committed_now(flying, self._retention.damaged()))
    step = restore_lib.resolve_step(self.storage, step, steps)
    retention = self._retention
    retention.protect(step)
    try:
      step_dir = steps_lib.step_dir(self.storage, step)  # gone if deleted meanwhile
    except BaseException:
      retention.release(step)
      raise
    return [step, step_dir, step == steps[-1]]
