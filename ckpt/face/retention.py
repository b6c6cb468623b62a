"""The retention pass of a Checkpointer, as its other parts see it.

``Retention`` owns the pass (ckpt/commit/retention_pass.py: the deletion of
the steps the policy drops after each commit, on process 0, with the steps
protected by a restore and those a resume found damaged), the step of this
Checkpointer's last committed save and the last one whose pass is known
done, and the announcement by which process 0 tells the other processes
that a pass is done (their listings wait for it). It reads the metrics,
save times and temporary marks that ``KnownSteps`` caches.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from ckpt.commit import retention_pass
from ckpt.commit.retention import RetentionPolicy
from ckpt.face import known as known_lib
from ckpt.face import loop as loop_lib
from ckpt.multihost import process as multihost
from ckpt.store import deadline as deadline_lib
from ckpt.store import storage as storage_lib
from ckpt.errors import WaitTimeoutError


class Retention:
  """The retention pass of one directory (see the module docstring)."""

  def __init__(self, storage: storage_lib.Storage, policy: RetentionPolicy,
               known: known_lib.KnownSteps, key_base: str,
               save_timeout_s: float | None, loop: loop_lib.BackgroundLoop):
    self._policy = policy
    self._key_base = key_base
    self._loop = loop
    # The step of this Checkpointer's last committed save, and the last one
    # whose retention pass is known done (process 0 announces it: the other
    # processes' listings wait for it).
    self._committed_save: int | None = None
    self._retained: int | None = None
    self._pass = retention_pass.Retention(
        storage, policy, known.read_metrics, known.read_time,
        timeout_s=save_timeout_s, on_done=self._done,
        read_temporary=known.read_temporary)

  # ---- the steps the pass must not delete, or is deleting ---------------

  def damaged(self) -> frozenset[int]:
    """The steps a resume fell back past (never resumed again)."""
    return self._pass.damaged()

  def set_damaged(self, steps: Any) -> None:
    self._pass.set_damaged(steps)

  def deleting(self) -> frozenset[int]:
    """The steps the pass is deleting now."""
    return self._pass.deleting()

  def protect(self, step: int) -> None:
    """Process 0: ``step`` is not deleted until ``release(step)``."""
    self._pass.protect(step)

  def release(self, step: int) -> None:
    self._pass.release(step)

  def keepalive(self, step: int) -> Any:
    """``step`` protected for as long as what this returns lives."""
    return self._pass.keepalive(step)

  def delete(self, step: int) -> None:
    """Process 0: deletes ``step`` now (``Checkpointer.delete``)."""
    self._pass.delete(step)

  # ---- the pass after each save -----------------------------------------

  def committed(self, step: int) -> None:
    """On the loop, once this process's save of ``step`` committed:
    process 0 starts the pass."""
    self._committed_save = step
    if multihost.process_index() == 0:
      self._pass.start(step)

  def wait(self, left: float | None = None,
           timeout: float | None = None) -> None:
    """Waits (``left`` seconds at most) for the retention pass in flight
    (``timeout``: the caller's, named in the error)."""
    if self._loop.closed:
      return
    fut = self._loop.submit(self._pass.wait())
    try:
      fut.result(left)
    except concurrent.futures.TimeoutError:
      if fut.done():
        raise
      raise WaitTimeoutError(
          f"wait_until_finished(timeout={timeout}): the save is committed, "
          f"but retention (deleting the steps the policy drops) was still "
          f"running after {timeout} s; it goes on in the background") from None

  def settle(self) -> None:
    """Before a listing, within the query bound: the pass after the last
    save done (process 0: waited for, then listed anyway; the others: its
    announcement by process 0)."""
    left = deadline_lib.time_left()
    if multihost.process_index() == 0:
      try:
        self.wait(left)
      except WaitTimeoutError:  # within the query's bound: then list anyway
        pass
      return
    last = self._committed_save
    if (self._policy.deletes and last is not None and
        last != self._retained):
      # Process 0 signals when its pass after that save is done.
      if multihost.await_announced(self._key(last),
                                   60.0 if left is None else left):
        self._retained = last

  def _key(self, step: int) -> str:
    return f"{self._key_base}/retained/{step}"

  def _done(self, step: int) -> None:
    """Process 0, after the retention pass that followed ``step``'s save."""
    previous, self._retained = self._retained, step
    multihost.announce(self._key(step),
                       None if previous is None else self._key(previous))
