"""What a Checkpointer knows of its committed steps without listing them.

``KnownSteps`` owns process 0's newest committed step and what it will be
once the save in flight commits (the refusal of a lower step rests on them:
``newest_bound``, ``newer_than``), the last listing (a resume reuses a recent
one) and the metrics, save times and temporary marks read (the retention
pass, ckpt/face/retention.py, and the queries share them). It reads the
storage only: the step of the save in flight (``flying``) and the steps a
resume found damaged are passed in by the caller.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Collection

from absl import logging

from ckpt.commit import records
from ckpt.commit import steps as steps_lib
from ckpt.commit import strategy
from ckpt.commit.retention import RetentionPolicy
from ckpt.multihost import process as multihost
from ckpt.restore import read as restore_lib
from ckpt.store import deadline as deadline_lib
from ckpt.store import storage as storage_lib
from ckpt.errors import CheckpointError

# A step not known yet (before a listing).
UNKNOWN = object()
# A listing this recent (seconds) is reused by a resume's choice of step;
# a step committed by another job in the meantime is seen by the next one.
RECENT_LISTING_S = 10.0


class KnownSteps:
  """The committed steps of one directory as this process knows them."""

  def __init__(self, storage: storage_lib.Storage):
    self.storage = storage
    # Process 0: the newest committed step (-1: none; UNKNOWN: list to
    # know), and what it will be once the save in flight commits.
    self._newest: Any = UNKNOWN
    self._after_commit: Any = UNKNOWN
    # Counts the changes of the two (a save begun or committed, a
    # forgetting): a listing notes its newest only if none came meanwhile.
    self._changes = 0
    self._lock = threading.Lock()
    self._listed: tuple[list[int], float] | None = None  # (steps, when)
    self._metrics: dict[int, dict[str, float]] = {}
    self._times: dict[int, float] = {}
    self._temporary: dict[int, bool] = {}  # marked temporary in the index
    self._said_no_root = False  # a missing root is logged once (INFO)

  # ---- process 0's newest step ------------------------------------------

  def newest_bound(self, flying: int | None,
                   damaged: Collection[int] = ()) -> int:
    """Process 0: a step that no committed step is above, the save in
    flight (``flying``: its step, None if none) counted (-1: none). No
    I/O once known: from the last listing and the saves committed since;
    listed when unknown (a fresh Checkpointer, a failed save, ``delete``,
    ``reload``). On an object store whose commit records are not complete
    yet, the migration that the save's prepare makes anyway comes first, so
    the one listing of the whole root is not made twice."""
    known = self._newest if flying is None else self._after_commit
    if known is not UNKNOWN:
      return known
    if not self.storage.is_posix and not records.records_complete(
        self.storage):
      try:
        strategy.for_storage(self.storage).ensure_records()
      except CheckpointError as e:
        logging.warning("ckpt: could not make the commit records of %s "
                        "complete: %s", self.storage.url, e)
    steps = self.committed_now(flying, damaged)
    return max(steps[-1] if steps else -1, -1 if flying is None else flying)

  def newer_than(self, step: int, flying: int | None,
                 deadline: deadline_lib.Deadline | None,
                 damaged: Collection[int] = (),
                 fresh: bool = False) -> list[int]:
    """Process 0: the committed steps above ``step``, and ``flying`` (the
    step of the save in flight) if above, within ``deadline``. No I/O when
    none is known to be (``newest_bound``); listed when one may be, or
    ``fresh`` (the caller names them all), so a refusal rests on a
    listing."""
    if not fresh and deadline_lib.call(
        deadline, self.newest_bound, flying, damaged) <= step:
      return []
    newer = [s for s in deadline_lib.call(deadline, self.committed_now,
                                          flying, damaged) if s > step]
    if flying is not None and flying > step:
      newer = sorted({*newer, flying})
    return newer

  def committed_now(self, flying: int | None,
                    damaged: Collection[int] = ()) -> list[int]:
    """Process 0: the committed steps, listed now; their newest (but the
    ``damaged`` steps) is noted when no save is in flight (``flying`` is
    None) and none began or committed while listing (one in flight commits
    on the background thread, and notes its step then)."""
    with self._lock:
      changes = self._changes
    steps = steps_lib.committed_steps(self.storage)
    self._listed = (list(steps), time.monotonic())
    if (not steps and not self._said_no_root and self.storage.is_posix and
        not self.storage.root.exists()):  # a typo in the path shows here
      self._said_no_root = True
      logging.info("ckpt: no checkpoint directory %s: starting from scratch",
                   self.storage.url)
    if flying is None:
      newest = max((s for s in steps if s not in damaged), default=-1)
      with self._lock:
        if self._changes == changes:
          self._newest = newest
    return steps

  def recent_steps(self, flying: int | None) -> list[int] | None:
    """Process 0: the committed steps of a listing made in the last
    ``RECENT_LISTING_S`` seconds (a restarted job's ``latest_step()`` just
    before its ``restore()``), if its newest step is still committed (one
    stat or record GET instead of a listing) and no save (``flying``: the
    step of the one in flight) or deletion of this Checkpointer changed the
    newest since; else None."""
    got = self._listed
    if got is None or time.monotonic() - got[1] > RECENT_LISTING_S:
      return None
    steps = got[0]
    if not steps or (self._newest is not UNKNOWN and
                     self._newest != steps[-1]):
      return None
    if flying is not None:
      return None
    return steps if steps_lib.is_committed(self.storage, steps[-1]) else None

  def will_commit(self, step: int, newest: int) -> None:
    """Process 0, in a save's round: ``step`` is saved over ``newest``."""
    with self._lock:
      self._changes += 1
      self._newest, self._after_commit = UNKNOWN, max(newest, step)

  def committed(self, step: int, metrics: dict,
                temporary: bool = False) -> None:
    """Process 0, on the loop, once its save of ``step`` committed."""
    with self._lock:
      self._changes += 1
      self._newest = self._after_commit  # committed: the newest known
    self._metrics[step] = dict(metrics)
    self._temporary[step] = temporary
    self._times.pop(step, None)  # read from the new index

  def forget_newest(self) -> None:
    """The newest step may have changed (a cancel, a deletion)."""
    with self._lock:
      self._changes += 1
      self._newest = self._after_commit = UNKNOWN

  def deleted(self, step: int) -> None:
    self._metrics.pop(step, None)
    self._times.pop(step, None)
    self._temporary.pop(step, None)

  def forget(self) -> None:
    """``Checkpointer.reload``: nothing cached is trusted any more."""
    self._metrics.clear()
    self._times.clear()
    self._temporary.clear()
    self.forget_newest()

  # ---- metrics and times ------------------------------------------------

  def read_metrics(self, step: int) -> dict[str, float]:
    if step not in self._metrics:
      if (multihost.process_index() != 0 and
          not steps_lib.is_committed(self.storage, step)):
        raise steps_lib.not_committed(self.storage, step)
      self._read_step_info(step)
    return dict(self._metrics[step])

  def read_time(self, step: int) -> float:
    """The save time recorded in ``step``'s index (the time rule)."""
    if step not in self._times:
      self._read_step_info(step)
    return self._times[step]

  def read_temporary(self, step: int) -> bool:
    """Whether ``step`` is marked temporary (temporary_time_saves)."""
    if step not in self._temporary:
      self._read_step_info(step)
    return self._temporary[step]

  def _read_step_info(self, step: int) -> None:
    """Process 0 (or one process alone): the step's metrics, save time and
    temporary mark, from its commit record on an object store (one GET),
    else its index."""
    info = records.read_info(self.storage, step)
    if info is not None and info[1] is not None:
      self._metrics[step], self._times[step], self._temporary[step] = info
      return
    index = restore_lib.read_index(self.storage,
                                   steps_lib.step_dir(self.storage, step))
    self._metrics[step] = dict(index.metrics)
    self._times[step] = index.time
    self._temporary[step] = index.temporary


def scored(policy: RetentionPolicy, steps: list[int],
           read_metrics: Callable[[int], dict]) -> int | None:
  """The best of ``steps`` by ``policy`` (ties: the newest; NaN never)."""
  scores = {}
  for s in steps:
    try:
      score = policy.score(read_metrics(s))
    except CheckpointError:  # deleted meanwhile, unreadable: no score
      continue
    if score is not None and score == score:  # not NaN
      scores[s] = score
  if not scores:
    return None
  sign = 1.0 if policy.best_mode == "min" else -1.0
  return min(scores, key=lambda s: (sign * scores[s], -s))
