"""The save of a Checkpointer, from its agreement round to its commit.

``Saver`` owns what a save needs besides the save in flight: the save's
options, the plan cache (the last save's plan, reused while the state keeps
its layout), the chunks reused from the last committed step, the leases seen
by cleanups, the stats of the last save. ``save`` is the body of
``Checkpointer.save`` after its schedule said yes: the agreement round (in
which process 0 refuses a step lower than the newest committed one and makes
a fresh attempt), then the save's run on the background loop
(ckpt/save/runner.py) and the cleanup of abandoned attempts alongside it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any, Callable, Sequence

from absl import logging

from ckpt.multihost import agreement
from ckpt.commit import protocol as commit_lib
from ckpt.commit import lease as lease_lib
from ckpt.commit import steps as steps_lib
from ckpt.commit import cleanup as cleanup_lib
from ckpt.commit import deletion
from ckpt.face import inflight as inflight_lib
from ckpt.face import history as history_lib
from ckpt.face import known as known_lib
from ckpt.face import loop as loop_lib
from ckpt.face import retention as retention_lib
from ckpt.face import root_meta
from ckpt.face import rounds as rounds_lib
from ckpt.store import deadline as deadline_lib
from ckpt.store import gcpause
from ckpt.store import names as names_lib
from ckpt.store import progress as progress_lib
from ckpt.store.progress import rate_text, size_text
from ckpt.save import runner as finalize
from ckpt.save import outcome
from ckpt.multihost import process as multihost
from ckpt.multihost import coordination
from ckpt.multihost import posts as posts_lib
from ckpt.save import leaves as save_leaves
from ckpt.save import plan_cache
from ckpt.save import polite
from ckpt.save import reuse as reuse_lib
from ckpt.store import storage as storage_lib
from ckpt.save import write as save_lib
from ckpt.save import writer_client
from ckpt.format import extras as save_extras
from ckpt.format import tree


@dataclasses.dataclass(frozen=True)
class SaveSettings:
  """A Checkpointer's save options (see its docstring)."""
  options: save_leaves.SaveOptions
  concurrent_bytes: int
  async_save: bool
  partitioner: Callable | None
  lease_s: float
  clock: Callable[[], Any]
  writer: str = "thread"  # or "process" (ckpt/save/handed.py)
  storage_options: dict | None = None


class Saver:
  """The saves of one Checkpointer (see the module docstring)."""

  def __init__(self, settings: SaveSettings, storage: storage_lib.Storage,
               reuser: reuse_lib.Reuser, rounds: rounds_lib.Rounds,
               known: known_lib.KnownSteps,
               retention: retention_lib.Retention,
               history: history_lib.SaveHistory,
               inflight: inflight_lib.InFlightSave,
               loop: loop_lib.BackgroundLoop,
               lease_seen: Callable[[], lease_lib.Sightings],
               root_metadata: root_meta.RootMetadataFile):
    self.settings = settings
    self._root_metadata = root_metadata
    self.storage = storage
    self._context = storage.context()
    self._reuser = reuser
    self._rounds = rounds
    self._known = known
    self._retention = retention
    self._history = history
    self._inflight = inflight
    self._loop = loop
    self._plan_cache = plan_cache.PlanCache()
    self._lease_seen = lease_seen  # the Checkpointer's (it may replace it)
    # Process 0: this Checkpointer's failed attempts, removed at its next
    # save (ckpt/commit/cleanup.py).
    self._own_failures = cleanup_lib.OwnFailures()
    self.last_save_stats = save_lib.SaveStats()
    self._writer = None
    if settings.writer == "process":
      if storage.spec.get("driver") == "memory":
        raise ValueError(f"writer='process' cannot write to {storage.url!r}: "
                         "memory:// lives inside one process")
      if reuser.enabled and not storage.is_posix:
        raise ValueError(
            f"writer='process' with reuse_unchanged=True cannot save to "
            f"{storage.url!r}: on a bucket unchanged leaves are held by an "
            "earlier step once the processes agree on them in a round "
            "through jax.distributed, which writer processes do not join; "
            "use writer='thread' there, or reuse_unchanged=False")
      self._writer = writer_client.WriterProcess()

  def close(self) -> None:
    """The writer process, if any, finishes what it holds and ends."""
    if self._writer is not None:
      self._writer.close()

  def forget_plan(self) -> None:
    """The next save plans afresh (not from the cached plan)."""
    self._plan_cache.clear()

  def save(self, step: int, state: Any, refused: Exception | None,
           check: Callable[[], None], **kwargs) -> bool:
    """``_save``, with Python's cyclic GC paused until the caller's arrays
    are staged (ckpt/store/gcpause.py: full collections of the whole
    process ran there, a third of a first save of 10,000 small leaves and
    most of an async save's blocking time when one did)."""
    with gcpause.paused() as pause:
      return self._save(step, state, refused, check, pause, **kwargs)

  def _save(self, step: int, state: Any,
            refused: Exception | None, check: Callable[[], None],
            pause: gcpause.Pause, *,
                    metrics: dict | None = None,
                    transforms: Sequence[Callable] = (),
                    host_state: Any = None, force: bool = False,
                    custom_metadata: dict | None = None,
                    progress: Any = None, temporary: bool = False) -> bool:
    """The save of ``step`` the schedule accepted; ``refused``: this
    process refuses it (a close begun), ``check()``: this process's own
    checks (open, no restore in flight). Their failure joins the round.
    ``temporary``: the index marks the step temporary (saved by time)."""
    # The key first: whatever fails below on one process goes into the
    # round, so every process raises and no later key drifts.
    key = self._rounds.key("save", step)
    coord0 = coordination.coordination_stats()
    t0 = time.perf_counter()
    plan, host_files, values, error, plan_s = None, {}, [], None, 0.0
    tiling = None  # the digests of this process's writes and of the whole
    claim = None  # this process's host_state claim (extras.host_state_files)
    report = None
    planned = 0
    custom = None
    try:
      if refused is not None:
        raise refused
      check()
      self._inflight.wait()  # the previous save's failure, if any
      metrics = save_extras.check_metrics(metrics)
      custom = save_extras.check_custom_metadata(custom_metadata)
      state = tree.transformed(state, transforms)
      host_files, claim = save_extras.host_state_files(
          host_state, multihost.process_index(), multihost.process_count())
      t_plan = time.perf_counter()
      plan, planned = self._plan_cache.plan(state, self.settings.options,
                                            self.settings.partitioner)
      plan_s = time.perf_counter() - t_plan
      plan.borrow = not self.settings.async_save
      values = agreement.host_values(plan.agreed_leaves())
      tiling = (finalize.tiling_digest(plan), finalize.whole_digest(plan))
      report = progress_lib.reporter(
          progress, f"ckpt save step {step}",
          lambda: sum(w.nbytes for w in plan.writes))
    except Exception as e:  # pylint: disable=broad-except
      error = e  # every process hears of it in the round below
    started: list = []  # process 0: the save's deadline, set at prepare
    decision = agreement.save_round(
        key, step, error, values, lambda: self._prepare_attempt(step, started),
        timeout_s=self._rounds.barrier_s, host_claim=claim, tiling=tiling,
        memory=self._rounds.key_base)
    self._history.saved(step)  # agreed: committed already, or about to be
    if decision.action == "skip":
      logging.warning("ckpt: step %d is already committed in %s; not saving "
                      "it again", step, self.storage.url)
      self.last_save_stats = save_lib.SaveStats(step=step, skipped=True)
      return False
    attempt = outcome.Attempt(
        step=step, key=key, token=decision.token,
        work_dir=steps_lib.work_dir(self.storage, step, decision.token),
        timeout_s=self._rounds.barrier_s, lease_s=self.settings.lease_s,
        host_states=decision.value)
    stats = save_lib.SaveStats(step=step, plan_s=plan_s,
                               planned_leaves=planned)
    self.last_save_stats = stats
    staged = threading.Event()
    if self._writer is not None:
      # Started from the caller's thread: at its priority, which the writer
      # lowers to its own (ckpt/save/polite.py), never from the loop's
      # lowered threads. (A failure is the save's, raised on the loop.)
      try:
        self._writer.ensure_started()
      except Exception:  # pylint: disable=broad-except
        pass
    fut = self._loop.submit(progress_lib.reported(
        deadline_lib.bounded(
            self._save_async(attempt, plan, metrics, host_files, stats,
                             staged, t0, coord0, custom, temporary,
                             pause.resume),
            started[0] if started else self._rounds.save_deadline(step)),
        report, lambda: stats.bytes_written))
    self._inflight.start(fut, step, attempt)
    if self.settings.async_save:
      staged.wait()
      stats.blocking_s = time.perf_counter() - t0
      if fut.done():
        self._inflight.wait()
    else:
      self._inflight.wait()
      stats.blocking_s = stats.total_s
    return True

  def _prepare_attempt(self, step: int, started: list) -> str | None:
    """Process 0, in the save round: None if ``step`` is committed, else the
    token of a fresh, empty attempt directory. The save's deadline starts
    here (appended to ``started``): its first request.

    A step lower than the newest committed one is refused here
    (``agreement.SaveRefused``, raised on every process), before anything
    is written: see ``save``."""
    deadline = self._rounds.save_deadline(step)
    started.append(deadline)
    retention = self._retention
    with deadline_lib.scope(deadline):
      damaged = retention.damaged()  # a resume fell back past them
      newest = self._known.newest_bound(self._inflight.step_running(),
                                        damaged)
      if newest > step:  # confirmed by a fresh listing (then refused)
        steps = self._known.committed_now(self._inflight.step_running(),
                                          damaged)
        newer = [s for s in steps if s > step and s not in damaged]
        if newer:  # committed or not, it would not be the step resumed
          raise agreement.SaveRefused(posts_lib.refusal(
              step, newer, f"in {self.storage.url!r}"))
        newest = max((s for s in steps if s not in damaged), default=-1)
      if step in damaged:  # a resume found it damaged: saved again, anew
        logging.warning("ckpt: replacing step %d in %s, which failed "
                        "verification when this job resumed", step,
                        self.storage.url)
        cleanup_lib.remove(self.storage, names_lib.step_dirname(step))
        retention.set_damaged(damaged - {step})
      elif steps_lib.is_committed(self.storage, step):
        return None
      self._root_metadata.write_once()  # the first save writes it
      token = multihost.unique_token()
      commit_lib.prepare(self.storage, step, token, self.settings.lease_s,
                         self._lease_seen())
      self._known.will_commit(step, newest)
      return token

  async def _save_async(self, attempt: outcome.Attempt, plan, metrics,
                        host_files: dict[int, bytes],
                        stats: save_lib.SaveStats,
                        staged: threading.Event, t0: float,
                        coord0: coordination.CoordinationStats,
                        custom: str | None = None,
                        temporary: bool = False,
                        on_staged: Callable[[], None] = lambda: None) -> None:
    cleanup = None
    ended = threading.Event()  # this save no longer runs
    self._inflight.running_as(asyncio.current_task())  # what cancel() cancels
    async_save = self.settings.async_save
    if async_save:  # the training job's cores first (ckpt/save/polite.py)
      polite.lower_tensorstore_threads()
    try:
      if multihost.process_index() == 0:
        # Abandoned work of crashed jobs and failed saves goes at every save
        # (one listing of the root, or of pending/ on a bucket; never when a
        # Checkpointer opens: a reader must not delete anything).
        cleanup = asyncio.ensure_future(  # alongside, not ahead of staging
            asyncio.to_thread(self.remove_abandoned, attempt.work_dir,
                              lambda: not ended.is_set()))
      try:
        # (writer="process": its writer links; ckpt/save/writer_reuse.py)
        reuse = None if not self._reuser.enabled or self._writer else (
            await asyncio.to_thread(
                self._reuser.begin, plan, attempt.step, attempt.token,
                attempt.work_dir))  # its first reads the steps' records
        await finalize.run_save(attempt, finalize.SaveJob(
            plan, self.storage, self._context, self.settings.concurrent_bytes,
            host_files, stats, lambda: (staged.set(), on_staged()), reuse,
            self._writer, self.settings.storage_options,
            self._reuser.copies if self._reuser.enabled else 0),
            finalize.IndexFacts(
                metrics, self.settings.clock, custom, temporary))
      except BaseException as e:
        # A failed save (its tiling found wrong, say) is planned afresh
        # next time, never from the plan it failed with.
        self._plan_cache.clear()
        self._failed(attempt, e)
        raise
      _log_saved(attempt.step, self.storage.url, stats,
                 time.perf_counter() - t0, async_save)
      self._reuser.committed(reuse)  # the next save compares with it
      if multihost.process_index() == 0:
        self._known.committed(attempt.step, metrics, temporary)
      self._retention.committed(attempt.step)
    finally:
      ended.set()
      if cleanup is not None:
        await asyncio.gather(cleanup, return_exceptions=True)
      if async_save:  # workers the pool started mid-save (polite.py)
        polite.lower_tensorstore_threads()
      staged.set()
      stats.total_s = time.perf_counter() - t0
      # Every call of this process in the meantime (the caller's other
      # collective calls during an async save would count too).
      coord = coordination.coordination_stats() - coord0
      stats.coordination_s = coord.seconds
      stats.barriers, stats.kv_calls = coord.barriers, coord.kv_calls

  def _failed(self, attempt: outcome.Attempt, error: BaseException) -> None:
    """Process 0: the save of ``attempt`` failed; the next saves remove
    what is left of it (ckpt/commit/cleanup.py ``OwnFailures``), until
    the writes a deadline abandoned on this process have ended too; not
    when another process's deadline may have left writes of its own in
    flight, which this one cannot see end (the lease rule then, as for
    any other job's attempt)."""
    if multihost.process_index() != 0:
      return
    if not deadline_lib.abandoned(error):
      self._own_failures.failed(attempt.step, attempt.token)
      return
    deadline = deadline_lib.current()
    if multihost.process_count() == 1 and deadline is not None:
      self._own_failures.failed(attempt.step, attempt.token,
                                deadline.settled)

  def remove_abandoned(self, own: str,
                       running: Callable[[], bool] = lambda: False) -> None:
    """Process 0, alongside the save of ``own``: this Checkpointer's own
    failed attempts, at once and again once the save is no longer
    ``running()`` (the late writes of the failed save, see
    cleanup_lib.OwnFailures), and in between the attempts of other jobs
    the lease rule finds abandoned."""
    self._own_failures.sweep(self.storage)
    try:
      self._remove_others(own)
    finally:
      self._own_failures.sweep_after(self.storage, running)

  def _remove_others(self, own: str) -> None:
    reasons: dict[str, str] = {}
    # The steps our retention deletes while we list, or after: their
    # half-deleted leftovers are its to finish, not abandoned.
    retention = self._retention
    deleting = retention.deleting()
    try:
      names = cleanup_lib.abandoned(self.storage, self.settings.lease_s, reasons,
                                    self._lease_seen())
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("ckpt: could not look for abandoned saves in %s: %s",
                      self.storage.url, e)
      return
    deleting |= retention.deleting()
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


def _log_saved(step: int, url: str, stats: save_lib.SaveStats,
               total_s: float, async_save: bool) -> None:
  """One INFO line per committed save, on every process (its own bytes)."""
  rate = rate_text(stats.bytes_written, total_s)
  blocked = (f"; the caller was blocked {stats.blocking_s:.3f} s"
             if async_save and stats.blocking_s else "")
  logging.info("ckpt: saved step %d to %s: this process wrote %s in %.2f s "
               "(%s)%s", step, url, size_text(stats.bytes_written),
               total_s, rate, blocked)

