"""Stage 8 of a save, on process 0: the retention pass after a commit
(which steps the policy drops, deleted in the background), and the steps
being restored that it must never delete.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any, Callable

from absl import logging

from ckpt.commit import cleanup as cleanup_lib
from ckpt.commit import steps as steps_lib
from ckpt.commit.retention import RetentionPolicy
from ckpt.errors import CheckpointError
from ckpt.store import deadline as deadline_lib
from ckpt.store import storage as storage_lib
from ckpt.store import names


class Retention:
  """Stage 8, on process 0 only, after a save is complete everywhere.

  Deleting old steps can take long on a bucket (one DELETE per key), so it
  runs in the background: the next ``save()`` does not wait for it (and so
  no other process's barrier does), while ``wait_until_finished``, ``close``
  and the queries do. A failure is logged with the step and its cause; the
  save it followed stays committed. A step whose metrics cannot be read
  counts as a step without metrics.

  What a pass reads: the committed steps (on a bucket one listing of the
  flat ``commits/`` prefix, never the steps' keys) and, for a policy that
  ranks by metrics or keeps by time, each step's metrics or save time once
  per Checkpointer (``read_metrics``/``read_time`` cache them: one GET of
  the step's commit record on a bucket, its index on a disk).

  Steps being restored (``protect``) are never deleted: each deletion
  checks them under a lock at the moment it happens.

  Steps a resume found damaged (``set_damaged``: they failed verification
  and the restore fell back to an older one) are neither counted nor
  deleted: the newest step that verifies is the newest retention sees, so
  it is never deleted because a newer one is damaged, and the damaged one
  stays for a person to look at (or ``delete``).

  Each pass has its own bound, ``timeout_s`` from its start (the
  Checkpointer's ``save_timeout_s``; ckpt/store/deadline.py), not what is left of
  the save's: a store that dies after a commit holds ``wait_until_finished``
  at most that long more. A pass cut short is logged like any failure; a
  deletion it began is finished by cleanup (its ``pending/`` record).
  """

  def __init__(self, storage: storage_lib.Storage, policy: RetentionPolicy,
               read_metrics: Callable[[int], dict],
               read_time: Callable[[int], float] | None = None,
               timeout_s: float | None = None,
               on_done: Callable[[int], None] | None = None,
               read_temporary: Callable[[int], bool] | None = None):
    self.storage = storage
    self.timeout_s = timeout_s
    self.policy = policy
    self.read_metrics = read_metrics
    self.read_time = read_time  # the save time of a step (the time rule)
    self.read_temporary = read_temporary  # its temporary mark
    # Called with the step after each pass (whatever its outcome): the
    # other processes' queries wait for it (Checkpointer._list_steps).
    self.on_done = on_done
    self._lock = threading.Lock()
    self._protected: dict[int, int] = {}
    self._damaged: frozenset[int] = frozenset()
    self._deleting: set[int] = set()  # steps a pass is deleting now
    self._deleting_lock = threading.Lock()
    self._task: asyncio.Task | None = None

  def set_damaged(self, steps) -> None:
    """The steps that failed verification on this job's resume."""
    with self._lock:
      self._damaged = frozenset(steps)

  def damaged(self) -> frozenset[int]:
    with self._lock:
      return self._damaged

  def deleting(self) -> frozenset[int]:
    """The steps a pass is deleting at this moment (their half-deleted
    leftovers are not abandoned: cleanup leaves them to the pass)."""
    with self._deleting_lock:
      return frozenset(self._deleting)

  def protect(self, step: int) -> None:
    with self._lock:
      self._protected[step] = self._protected.get(step, 0) + 1

  def keepalive(self, step: int) -> "_Keepalive":
    """An object that protects ``step`` until it is garbage collected (held
    by every lazy leaf of one restore)."""
    return _Keepalive(self, step)

  def release(self, step: int) -> None:
    with self._lock:
      self._protected[step] -= 1
      if not self._protected[step]:
        del self._protected[step]

  def start(self, newest: int) -> None:
    """On the event loop: queue a pass after the one in flight."""
    previous = self._task

    async def run():
      if previous is not None:
        await asyncio.gather(previous, return_exceptions=True)
      deadline = deadline_lib.Deadline.start(
          self.timeout_s, "save_timeout_s", on_wire=not self.storage.is_posix)
      try:
        await asyncio.to_thread(deadline_lib.call, deadline, self.apply,
                                newest)
      finally:
        if self.on_done is not None:
          self.on_done(newest)
    self._task = asyncio.ensure_future(run())

  async def wait(self) -> None:
    if self._task is not None:
      await asyncio.gather(self._task, return_exceptions=True)

  def apply(self, newest: int) -> list[int]:
    """Deletes what the policy drops; returns the deleted steps."""
    if not self.policy.deletes:
      return []
    try:
      damaged = self.damaged()
      steps = [s for s in steps_lib.committed_steps(self.storage)
               if s not in damaged]
      metrics, times = {}, {}
      if self.policy.ranks_by_metrics:
        metrics = self._read_each(steps, self.read_metrics, "metrics",
                                  "it counts as a step without metrics")
      if self.policy.uses_times and self.read_time is not None:
        times = self._read_each(steps, self.read_time, "save time",
                                "the time rule does not keep it")
      temporary = frozenset()
      if self.policy.temporary_time_saves and self.read_temporary is not None:
        temporary = frozenset(s for s, t in self._read_each(
            steps, self.read_temporary, "temporary mark",
            "it counts as permanent").items() if t)
      with self._lock:
        protected = frozenset(self._protected) | {newest}
      doomed = self.policy.to_delete(steps, metrics, protected, times,
                                     temporary)
    except Exception as e:  # pylint: disable=broad-except
      logging.error("ckpt: retention after step %d in %s failed: %s",
                    newest, self.storage.url, e)
      return []
    deleted = []
    for s in doomed:
      with self._lock:  # held: a restore cannot protect it meanwhile
        if s in self._protected:
          continue
        with self._deleting_lock:
          self._deleting.add(s)
        try:
          logging.info("ckpt: retention deletes step %d", s)
          cleanup_lib.remove(self.storage, names.step_dirname(s))
          deleted.append(s)
        except Exception as e:  # pylint: disable=broad-except
          logging.error("ckpt: retention could not delete step %d in %s: %s",
                        s, self.storage.url, e)
        finally:
          with self._deleting_lock:
            self._deleting.discard(s)
    return deleted

  def _read_each(self, steps: list[int], read: Callable[[int], Any],
                 what: str, then: str) -> dict[int, Any]:
    """``{step: read(step)}``; a step that cannot be read is left out (and
    logged): one unreadable index never stops retention."""
    out = {}
    for s in steps:
      try:
        out[s] = read(s)
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("ckpt: retention: the %s of step %d in %s are "
                        "unreadable (%s); %s", what, s, self.storage.url, e,
                        then)
    return out

  def delete(self, step: int) -> None:
    """Deletes the committed ``step`` now (``Checkpointer.delete``, process
    0), under the lock retention deletes under: never a protected step."""
    with self._lock:
      if step in self._protected:
        raise CheckpointError(
            f"cannot delete step {step} in {self.storage.url!r}: it is being "
            "read (a restore in progress, or live leaves of "
            "restore(lazy=True)); delete it once they are done")
      if not steps_lib.is_committed(self.storage, step):
        raise steps_lib.not_committed(self.storage, step,
                                       f"cannot delete step {step}")
      logging.info("ckpt: deleting step %d (delete())", step)
      cleanup_lib.remove(self.storage, names.step_dirname(step))


class _Keepalive:
  """While it lives, its Retention does not delete its step."""

  def __init__(self, retention: Retention, step: int):
    retention.protect(step)
    weakref.finalize(self, retention.release, step)
