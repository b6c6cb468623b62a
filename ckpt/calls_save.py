"""The save of a Checkpointer, from its agreement round to its commit.

``SaveCalls`` holds the bodies of ``Checkpointer.save`` and what it needs on
process 0: the refusal of a step lower than the newest committed one (the
bound kept without a listing, ``_newest_bound``), the fresh attempt made in
the save round, the deadlines of a save and of a query, the save's run on the
background loop (ckpt/save/runner.py) and the cleanup of abandoned attempts
that runs alongside it. A mixin of ``ckpt.Checkpointer``: it uses the
Checkpointer's fields, made in its ``__init__``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable, Sequence

from absl import logging

from ckpt.multihost import agreement
from ckpt.commit import protocol as commit_lib
from ckpt.commit import steps as steps_lib
from ckpt.commit import strategy
from ckpt.commit import cleanup as cleanup_lib
from ckpt.commit import deletion
from ckpt.store import deadline as deadline_lib
from ckpt.store import progress as progress_lib
from ckpt.save import runner as finalize
from ckpt.multihost import process as multihost
from ckpt.multihost import coordination
from ckpt.save import polite
from ckpt import queries
from ckpt.commit import records
from ckpt.save import write as save_lib
from ckpt.format import extras as save_extras
from ckpt.format import tree
from ckpt.errors import CheckpointError
from ckpt.store import names as names_lib

_UNKNOWN = queries.UNKNOWN  # Checkpointer._newest before a listing


class SaveCalls:
  """The save of ``ckpt.Checkpointer`` (a mixin; see the module docstring)."""

  def _save(self, step: int, state: Any, **kwargs) -> bool:
    """The body of ``Checkpointer.save`` (see its docstring); a close()
    begun meanwhile on another thread waits for it (calls_lifecycle.py)."""
    step = queries.check_step(step)
    try:
      self._enter_save(step)
    except CheckpointError as e:
      entered = e  # told to every process in the save round
    else:
      entered = None
    try:
      return self._save_entered(step, state, entered, **kwargs)
    finally:
      if entered is None:
        self._leave_save()

  def _save_entered(self, step: int, state: Any,
                    refused: CheckpointError | None, *,
                    metrics: dict | None = None,
                    transforms: Sequence[Callable] = (),
                    host_state: Any = None, force: bool = False,
                    custom_metadata: dict | None = None,
                    progress: Any = None) -> bool:
    if not force and not self._should_save(step, agreed=True):
      # should_save decided from agreed facts only (no I/O and no round,
      # but for its one first-step round). A skip does not wait for the
      # save in flight either, so its failure comes from the next save that
      # writes (the same one on every process).
      return False
    # The key first: whatever fails below on one process goes into the
    # round, so every process raises and no later key drifts.
    key = multihost.call_key(self._key_base, "save", step)
    coord0 = coordination.coordination_stats()
    t0 = time.perf_counter()
    plan, host_files, values, error, plan_s = None, {}, [], None, 0.0
    claim = None  # this process's host_state claim (extras.host_state_files)
    report = None
    planned = 0
    custom = None
    try:
      if refused is not None:
        raise refused
      self._check_open()
      self._check_no_pending_restore(f"save({step})")
      self._wait_for_save()  # the previous save's failure, if any
      metrics = save_extras.check_metrics(metrics)
      custom = save_extras.check_custom_metadata(custom_metadata)
      state = tree.transformed(state, transforms)
      host_files, claim = save_extras.host_state_files(
          host_state, multihost.process_index(), multihost.process_count())
      t_plan = time.perf_counter()
      plan, planned = self._plan_cache.plan(state, self._options,
                                            self.partitioner)
      plan_s = time.perf_counter() - t_plan
      plan.borrow = not self.async_save
      values = agreement.host_values(plan.leaves)
      report = progress_lib.reporter(
          progress, f"ckpt save step {step}",
          lambda: sum(w.nbytes for w in plan.writes))
    except Exception as e:  # pylint: disable=broad-except
      error = e  # every process hears of it in the round below
    started: list = []  # process 0: the save's deadline, set at prepare
    decision = agreement.save_round(
        key, step, error, values, lambda: self._prepare_attempt(step, started),
        timeout_s=self.barrier_timeout_s, host_claim=claim)
    self._has_checkpoint = True  # agreed: committed already, or about to be
    self._last_saved = step
    if decision.action == "skip":
      logging.warning("ckpt: step %d is already committed in %s; not saving "
                      "it again", step, self.storage.url)
      self.last_save_stats = save_lib.SaveStats(step=step, skipped=True)
      return False
    attempt = finalize.Attempt(
        step=step, key=key, token=decision.token,
        work_dir=steps_lib.work_dir(self.storage, step, decision.token),
        timeout_s=self.barrier_timeout_s, lease_s=self.lease_s,
        host_states=decision.value)
    stats = save_lib.SaveStats(step=step, plan_s=plan_s,
                               planned_leaves=planned)
    self.last_save_stats = stats
    staged = threading.Event()
    fut = asyncio.run_coroutine_threadsafe(progress_lib.reported(
        deadline_lib.bounded(
            self._save_async(attempt, plan, metrics, host_files, stats,
                             staged, t0, coord0, custom),
            started[0] if started else self._save_deadline(step)),
        report, lambda: stats.bytes_written), self._loop)
    with self._lock:
      self._inflight, self._inflight_step = fut, step
      self._attempt = attempt
    if self.async_save:
      staged.wait()
      stats.blocking_s = time.perf_counter() - t0
      if fut.done():
        self._wait_for_save()
    else:
      self._wait_for_save()
      stats.blocking_s = stats.total_s
    return True

  def _prepare_attempt(self, step: int, started: list) -> str | None:
    """Process 0, in the save round: None if ``step`` is committed, else the
    token of a fresh, empty attempt directory. The save's deadline starts
    here (appended to ``started``): its first request.

    A step lower than the newest committed one is refused here
    (``agreement.SaveRefused``, raised on every process), before anything
    is written: see ``save``."""
    deadline = self._save_deadline(step)
    started.append(deadline)
    with deadline_lib.scope(deadline):
      newest = self._newest_bound()
      damaged = self._retention.damaged()  # a resume fell back past them
      if newest > step:  # confirmed by a fresh listing (then refused)
        steps = self._committed_now()
        newer = [s for s in steps if s > step and s not in damaged]
        if newer:  # committed or not, it would not be the step resumed
          raise agreement.SaveRefused(refusal(step, newer,
                                              f"in {self.storage.url!r}"))
        newest = max((s for s in steps if s not in damaged), default=-1)
      if step in damaged:  # a resume found it damaged: saved again, anew
        logging.warning("ckpt: replacing step %d in %s, which failed "
                        "verification when this job resumed", step,
                        self.storage.url)
        cleanup_lib.remove(self.storage, names_lib.step_dirname(step))
        self._retention.set_damaged(damaged - {step})
      elif steps_lib.is_committed(self.storage, step):
        return None
      token = multihost.unique_token()
      commit_lib.prepare(self.storage, step, token, self.lease_s,
                         self.lease_seen)
      self._newest, self._after_commit = _UNKNOWN, max(newest, step)
      return token

  def _newest_bound(self) -> int:
    """Process 0: a step that no committed step is above, the save in
    flight counted (-1: none). No I/O once known: from the last listing
    and the saves committed since; listed when unknown (a fresh
    Checkpointer, a failed save, ``delete``, ``reload``). On an object
    store whose commit records are not complete yet, the migration that
    the save's prepare makes anyway comes first, so the one listing of the
    whole root is not made twice."""
    with self._lock:
      flying = self._inflight is not None and not self._inflight.done()
      flying_step = self._inflight_step if flying else -1
    known = self._after_commit if flying else self._newest
    if known is not _UNKNOWN:
      return known
    if not self.storage.is_posix and not records.records_complete(
        self.storage):
      try:
        strategy.MARKER.ensure_records(self.storage)
      except CheckpointError as e:
        logging.warning("ckpt: could not make the commit records of %s "
                        "complete: %s", self.storage.url, e)
    steps = self._committed_now()
    return max(steps[-1] if steps else -1, flying_step)

  def _committed_now(self) -> list[int]:
    """Process 0: the committed steps, listed now; their newest is noted
    when no save is in flight (one in flight commits on the background
    thread, and notes its step then)."""
    with self._lock:
      idle = self._inflight is None or self._inflight.done()
    steps = steps_lib.committed_steps(self.storage)
    self._listed = (list(steps), time.monotonic())
    if (not steps and not self._said_no_root and self.storage.is_posix and
        not self.storage.root.exists()):  # a typo in the path shows here
      self._said_no_root = True
      logging.info("ckpt: no checkpoint directory %s: starting from scratch",
                   self.storage.url)
    if idle:
      with self._lock:
        idle = self._inflight is None or self._inflight.done()
        if idle:
          damaged = self._retention.damaged()
          self._newest = max((s for s in steps if s not in damaged),
                             default=-1)
    return steps

  def _save_deadline(self, step: int, doing: str = "writing step {} to"
                     ) -> deadline_lib.Deadline | None:
    """The deadline of saving (or deleting) ``step``, from now."""
    return deadline_lib.Deadline.start(
        self.save_timeout_s, "save_timeout_s",
        f"{doing.format(step)} {self.storage.url!r}")

  def _query_deadline(self) -> deadline_lib.Deadline | None:
    """The deadline of a query, from now; the store call in flight names
    the operation ("listing the steps of 's3://...'")."""
    return deadline_lib.Deadline.start(self.query_timeout_s, "query_timeout_s")

  async def _save_async(self, attempt: finalize.Attempt, plan, metrics,
                        host_files: dict[int, bytes],
                        stats: save_lib.SaveStats,
                        staged: threading.Event, t0: float,
                        coord0: coordination.CoordinationStats,
                        custom: str | None = None) -> None:
    cleanup = None
    self._task = asyncio.current_task()  # what cancel() cancels
    if self.async_save:  # the training job's cores first (ckpt/save/polite.py)
      polite.lower_tensorstore_threads()
    try:
      if multihost.process_index() == 0:
        # Abandoned work of crashed jobs and failed saves goes at every save
        # (one listing of the root, or of pending/ on a bucket; never when a
        # Checkpointer opens: a reader must not delete anything).
        cleanup = asyncio.ensure_future(  # alongside, not ahead of staging
            asyncio.to_thread(self._remove_abandoned, attempt.work_dir))
      try:
        reuse = self._reuser.begin(plan, attempt.step, attempt.token,
                                   attempt.work_dir)
        await finalize.run_save(attempt, plan, self.storage, self._context,
                                self.concurrent_bytes, metrics, host_files,
                                stats, staged.set, clock=self._clock,
                                custom_metadata=custom, reuse=reuse)
      except BaseException:
        # A failed save (its tiling found wrong, say) is planned afresh
        # next time, never from the plan it failed with.
        self._plan_cache.clear()
        raise
      _log_saved(attempt.step, self.storage.url, stats,
                 time.perf_counter() - t0, self.async_save)
      self._committed_save = attempt.step
      self._reuser.committed(reuse)  # the next save compares with it
      if multihost.process_index() == 0:
        self._newest = self._after_commit  # committed: the newest known
        self._metrics_cache[attempt.step] = dict(metrics)
        self._time_cache.pop(attempt.step, None)  # read from the new index
        self._retention.start(attempt.step)
    finally:
      if cleanup is not None:
        await asyncio.gather(cleanup, return_exceptions=True)
      staged.set()
      stats.total_s = time.perf_counter() - t0
      # Every call of this process in the meantime (the caller's other
      # collective calls during an async save would count too).
      coord = coordination.coordination_stats() - coord0
      stats.coordination_s = coord.seconds
      stats.barriers, stats.kv_calls = coord.barriers, coord.kv_calls

  def _remove_abandoned(self, own: str) -> None:
    reasons: dict[str, str] = {}
    # The steps our retention deletes while we list, or after: their
    # half-deleted leftovers are its to finish, not abandoned.
    deleting = self._retention.deleting()
    try:
      names = cleanup_lib.abandoned(self.storage, self.lease_s, reasons,
                                    self.lease_seen)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("ckpt: could not look for abandoned saves in %s: %s",
                      self.storage.url, e)
      return
    deleting |= self._retention.deleting()
    busy = {names_lib.step_dirname(s) for s in deleting}
    for name in names:
      if name == own or name.split(".tmp-del-")[0] in busy or (
          deletion.parse_name(name) in deleting):
        continue  # our own attempt, or a step our retention is deleting
      logging.info("ckpt: removing abandoned %s in %s: %s", name,
                   self.storage.url, reasons.get(name, "an unfinished deletion"))
      try:
        cleanup_lib.remove_abandoned(self.storage, name)
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("ckpt: could not remove abandoned %s: %s", name, e)


def size_text(n: float) -> str:
  """``n`` bytes for a log line: "1.50 GiB"."""
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  return f"{n:.2f} TiB"


def _log_saved(step: int, url: str, stats: save_lib.SaveStats,
               total_s: float, async_save: bool) -> None:
  """One INFO line per committed save, on every process (its own bytes)."""
  rate = stats.bytes_written / total_s / 1e9 if total_s > 0 else 0.0
  blocked = (f"; the caller was blocked {stats.blocking_s:.3f} s"
             if async_save and stats.blocking_s else "")
  logging.info("ckpt: saved step %d to %s: this process wrote %s in %.2f s "
               "(%.2f GB/s)%s", step, url, size_text(stats.bytes_written),
               total_s, rate, blocked)


def refusal(step: int, newer: list[int], where: str) -> str:
  """The message of a refused save of ``step``, lower than the committed
  ``newer`` steps (``where``: in which directory or tier); the same for a
  Checkpointer and both tiers of a MultiTierCheckpointer."""
  shown = newer if len(newer) <= 20 else [*newer[:10], "...", *newer[-10:]]
  return (
      f"cannot save step {step}: newer committed step(s) {shown} exist "
      f"({where}). A save of an older step would start a new timeline while "
      "the newer steps stay, and latest_step()/restore() (a restarted job) "
      "would resume them. To roll back deliberately, call delete(s) for each "
      f"of {shown} (collective), then save step {step} again. Nothing was "
      "written.")
