"""What a Checkpointer knows of its committed steps without listing them.

``KnownSteps`` owns process 0's newest committed step and what it will be
once the save in flight commits (the refusal of a lower step rests on them:
``newest_bound``, ``newer_than``), the last listing (a resume reuses a recent
one), the metrics and save times read (retention and the queries share
them), the step of the last save (``should_save_fn``'s second argument) and
the retention pass (ckpt/commit/retention_pass.py) that reads them, with the
announcement by which the other processes learn that a pass is done.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Callable

from absl import logging

from ckpt.commit import records
from ckpt.commit import retention_pass
from ckpt.commit import steps as steps_lib
from ckpt.commit import strategy
from ckpt.commit.retention import RetentionPolicy
from ckpt.face import inflight as inflight_lib
from ckpt.face import loop as loop_lib
from ckpt.face import rounds as rounds_lib
from ckpt.multihost import process as multihost
from ckpt.restore import read as restore_lib
from ckpt.store import deadline as deadline_lib
from ckpt.store import storage as storage_lib
from ckpt.errors import CheckpointError, WaitTimeoutError

# A step not known yet (before a listing).
UNKNOWN = object()
# A listing this recent (seconds) is reused by a resume's choice of step;
# a step committed by another job in the meantime is seen by the next one.
RECENT_LISTING_S = 10.0


class KnownSteps:
  """The committed steps of one directory as this process knows them."""

  def __init__(self, storage: storage_lib.Storage, policy: RetentionPolicy,
               inflight: inflight_lib.InFlightSave,
               rounds: rounds_lib.Rounds):
    self.storage = storage
    self._inflight = inflight
    self._rounds = rounds
    # Process 0: the newest committed step (-1: none; UNKNOWN: list to
    # know), and what it will be once the save in flight commits.
    self._newest: Any = UNKNOWN
    self._after_commit: Any = UNKNOWN
    self._listed: tuple[list[int], float] | None = None  # (steps, when)
    self._metrics: dict[int, dict[str, float]] = {}
    self._times: dict[int, float] = {}
    self._temporary: dict[int, bool] = {}  # marked temporary in the index
    self._said_no_root = False  # a missing root is logged once (INFO)
    # The step of the last save of this Checkpointer (agreed: saves are
    # collective), or the newest committed one before it; UNKNOWN until
    # asked. Whether the directory holds a checkpoint (None: not asked).
    self._last_saved: Any = UNKNOWN
    self._has_checkpoint: bool | None = None
    # The step of this Checkpointer's last committed save, and the last one
    # whose retention pass is known done (process 0 announces it: the other
    # processes' listings wait for it).
    self._committed_save: int | None = None
    self._retained: int | None = None
    self.retention = retention_pass.Retention(
        storage, policy, self.read_metrics, self.read_time,
        timeout_s=rounds.timeouts.save_s, on_done=self._retention_done,
        read_temporary=self.read_temporary)
    self._policy = policy

  # ---- process 0's newest step ------------------------------------------

  def newest_bound(self) -> int:
    """Process 0: a step that no committed step is above, the save in
    flight counted (-1: none). No I/O once known: from the last listing
    and the saves committed since; listed when unknown (a fresh
    Checkpointer, a failed save, ``delete``, ``reload``). On an object
    store whose commit records are not complete yet, the migration that
    the save's prepare makes anyway comes first, so the one listing of the
    whole root is not made twice."""
    flying = self._inflight.step_running()
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
    steps = self.committed_now()
    return max(steps[-1] if steps else -1, -1 if flying is None else flying)

  def newer_than(self, step: int, fresh: bool = False) -> list[int]:
    """Process 0: the committed steps above ``step``, and the step of the
    save in flight if above, within the query bound. No I/O when none is
    known to be (``newest_bound``); listed when one may be, or ``fresh``
    (the caller names them all), so a refusal rests on a listing."""
    deadline = self._rounds.timeouts.query_deadline()
    if not fresh and deadline_lib.call(deadline, self.newest_bound) <= step:
      return []
    flying = self._inflight.step_running()
    newer = [s for s in deadline_lib.call(deadline, self.committed_now)
             if s > step]
    if flying is not None and flying > step:
      newer = sorted({*newer, flying})
    return newer

  def committed_now(self) -> list[int]:
    """Process 0: the committed steps, listed now; their newest is noted
    when no save is in flight (one in flight commits on the background
    thread, and notes its step then)."""
    idle = not self._inflight.running()
    steps = steps_lib.committed_steps(self.storage)
    self._listed = (list(steps), time.monotonic())
    if (not steps and not self._said_no_root and self.storage.is_posix and
        not self.storage.root.exists()):  # a typo in the path shows here
      self._said_no_root = True
      logging.info("ckpt: no checkpoint directory %s: starting from scratch",
                   self.storage.url)
    if idle:
      damaged = self.retention.damaged()

      def note():
        self._newest = max((s for s in steps if s not in damaged), default=-1)
      self._inflight.if_idle(note)
    return steps

  def recent_steps(self) -> list[int] | None:
    """Process 0: the committed steps of a listing made in the last
    ``RECENT_LISTING_S`` seconds (a restarted job's ``latest_step()`` just
    before its ``restore()``), if its newest step is still committed (one
    stat or record GET instead of a listing) and no save or deletion of
    this Checkpointer changed the newest since; else None."""
    got = self._listed
    if got is None or time.monotonic() - got[1] > RECENT_LISTING_S:
      return None
    steps = got[0]
    if not steps or (self._newest is not UNKNOWN and
                     self._newest != steps[-1]):
      return None
    if self._inflight.running():
      return None
    return steps if steps_lib.is_committed(self.storage, steps[-1]) else None

  def will_commit(self, step: int, newest: int) -> None:
    """Process 0, in a save's round: ``step`` is saved over ``newest``."""
    self._newest, self._after_commit = UNKNOWN, max(newest, step)

  def committed(self, step: int, metrics: dict,
                temporary: bool = False) -> None:
    """On the loop, once this process's save of ``step`` committed."""
    self._committed_save = step
    if multihost.process_index() == 0:
      self._newest = self._after_commit  # committed: the newest known
      self._metrics[step] = dict(metrics)
      self._temporary[step] = temporary
      self._times.pop(step, None)  # read from the new index
      self.retention.start(step)

  def saved(self, step: int) -> None:
    """Agreed in a save round: ``step`` is committed, or about to be."""
    self._has_checkpoint = True
    self._last_saved = step

  @property
  def last_saved(self) -> Any:
    """The step of the last save (None: none), UNKNOWN until known."""
    return self._last_saved

  @property
  def has_checkpoint(self) -> bool | None:
    """Whether the directory holds a checkpoint (None: not known)."""
    return self._has_checkpoint

  def agreed_last_saved(self, step: int | None) -> None:
    """Every process agreed that ``step`` is the newest step (a listing)."""
    self._last_saved = step
    if step is not None:
      self._has_checkpoint = True

  def agreed_not_empty(self) -> None:
    """Every process agreed that the directory holds a checkpoint."""
    self._has_checkpoint = True

  def cancelled(self) -> None:
    """The save in flight was cancelled: its step was not saved."""
    self._last_saved = UNKNOWN

  def forget_newest(self) -> None:
    """The newest step may have changed (a cancel, a deletion)."""
    self._newest = self._after_commit = UNKNOWN

  def delete(self, step: int) -> bool:
    """Process 0, in a delete round (within the query bound, as the
    round's answer): deletes ``step`` within ``save_timeout_s`` (a step of
    many keys may take longer than a query); refused for the step of the
    save in flight."""
    if self._inflight.step_running() == step:
      raise CheckpointError(
          f"cannot delete step {step} in {self.storage.url!r}: it is being "
          "saved (call wait_until_finished() first)")
    with deadline_lib.scope(self._rounds.save_deadline(
        step, "deleting step {} from")):
      try:
        self.retention.delete(step)
      finally:  # it may have been the newest: list again to know
        self.forget_newest()
    return True

  def bounded(self, answer: Callable[[], Any]) -> Any:
    """``answer()`` within ``query_timeout_s`` (as a read round's)."""
    return self._rounds.local(answer)

  def settle(self) -> None:
    """Lets the save in flight end (its failure stays for the next save
    or wait): a restore of the latest step wants its commit."""
    self._inflight.settle()

  def deleted(self, step: int) -> None:
    self._metrics.pop(step, None)
    self._times.pop(step, None)
    self._temporary.pop(step, None)
    self._last_saved = UNKNOWN  # (it may have been the step deleted)

  def forget(self) -> None:
    """``Checkpointer.reload``: nothing cached is trusted any more."""
    self._metrics.clear()
    self._times.clear()
    self._temporary.clear()
    self.forget_newest()
    self._last_saved = UNKNOWN

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

  # ---- retention ----------------------------------------------------------

  def list_steps(self, loop: loop_lib.BackgroundLoop) -> list[int]:
    """The committed steps, as retention left them after the last save."""
    if multihost.process_index() == 0:
      try:
        self.wait_for_retention(loop, deadline_lib.time_left())
      except WaitTimeoutError:  # within the query's bound: then list anyway
        pass
      return self.committed_now()
    last = self._committed_save
    if (self._policy.deletes and last is not None and
        last != self._retained):
      # Process 0 signals when its pass after that save is done.
      left = deadline_lib.time_left()
      if multihost.await_announced(self._retained_key(last),
                                   60.0 if left is None else left):
        self._retained = last
    return steps_lib.committed_steps(self.storage)

  def wait_for_retention(self, loop: loop_lib.BackgroundLoop,
                         left: float | None = None,
                         timeout: float | None = None) -> None:
    """Waits (``left`` seconds at most) for the retention pass in flight."""
    if loop.closed:
      return
    fut = loop.submit(self.retention.wait())
    try:
      fut.result(left)
    except concurrent.futures.TimeoutError:
      if fut.done():
        raise
      raise WaitTimeoutError(
          f"wait_until_finished(timeout={timeout}): the save is committed, "
          f"but retention (deleting the steps the policy drops) was still "
          f"running after {timeout} s; it goes on in the background") from None

  def _retained_key(self, step: int) -> str:
    return f"{self._rounds.key_base}/retained/{step}"

  def _retention_done(self, step: int) -> None:
    """Process 0, after the retention pass that followed ``step``'s save."""
    previous, self._retained = self._retained, step
    multihost.announce(self._retained_key(step),
                       None if previous is None else self._retained_key(previous))


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
