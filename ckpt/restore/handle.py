"""The handle ``restore_async`` returns: the reads run on the
Checkpointer's background loop while the caller compiles; ``result()``
finishes the restore on the caller's thread (its agreement rounds and the
read-once exchange are collectives, which belong to the caller's thread in
the order of its other collective calls).

Imports nothing of ckpt: the Checkpointer gives it the calls it makes.
"""

from __future__ import annotations

import threading
from typing import Any, Callable


class RestoreHandle:
  """What ``Checkpointer.restore_async`` returns.

  ``done()``: whether the reads have ended (then ``result()`` only runs the
  rounds and exchanges). ``result(timeout=None)``: the restored tree, or
  the restore's error; the same on every call after the first. With a
  ``timeout``, ``WaitTimeoutError`` if the reads are not done by then (they
  go on: call ``result()`` again). Collective like ``restore``: every
  process calls ``result()`` before its next save or restore, or drops the
  handle (no reference left): then the next save, restore or close()
  cancels its reads, with a WARNING, and goes on.
  """

  def __init__(self, finish: Callable[[float | None], Any], reads,
               cancel: Callable[[], None], leave: Callable[[], None],
               what: str):
    self._finish, self._reads = finish, reads
    self._cancel, self._leave = cancel, leave
    self.what = what
    self._lock = threading.Lock()
    self._outcome: tuple[bool, Any] | None = None  # (ok, value or error)

  @property
  def finished(self) -> bool:
    """Whether ``result()`` has returned or raised (or it was cancelled)."""
    return self._outcome is not None

  def done(self) -> bool:
    """Whether the reads have ended (successfully or not). Never raises."""
    return self._outcome is not None or self._reads.done()

  def result(self, timeout: float | None = None) -> Any:
    """The restored tree (as ``restore`` returns it).

    Args:
      timeout: seconds to wait for the reads; None waits.

    Raises:
      WaitTimeoutError: the reads were not done within ``timeout`` (they go
        on; call again).
      What ``restore`` raises, on every process alike.
    """
    with self._lock:
      if self._outcome is None:
        from ckpt.errors import WaitTimeoutError  # pylint: disable=g-import-not-at-top
        try:
          value = self._finish(timeout)
        except WaitTimeoutError:
          raise
        except BaseException as e:
          self._outcome = (False, e)
          self._leave()
          raise
        self._outcome = (True, value)
        self._leave()
    ok, value = self._outcome
    if not ok:
      raise value
    return value

  def cancel(self, why: str) -> None:
    """Stops the reads and drops them (``close()`` while it is in flight):
    ``result()`` then raises CheckpointError saying ``why``."""
    with self._lock:
      if self._outcome is not None:
        return
      from ckpt.errors import CheckpointError  # pylint: disable=g-import-not-at-top
      try:
        self._cancel()
      finally:
        self._outcome = (False, CheckpointError(
            f"{self.what} was cancelled: {why}"))
        self._leave()
