"""The barrier a save's thread waits at, as ``Checkpointer.cancel`` must see
it (ckpt/face/inflight.py).

A save's barrier runs on a worker thread (``asyncio.to_thread``). When the
save is cancelled there, the thread waits on inside the coordination
service, and ``cancel`` has the other processes arrive at that barrier to
release it. That is only right if the thread is really in the barrier: a
barrier call still queued in the loop's executor when its task is cancelled
never runs (asyncio cancels the queued work item), and a process that
joined such a barrier to release it would wait there alone for
``barrier_timeout_s`` and be late for every call after it (the flake of
tests/tiers/test_mesh_context.py: process 0 posted "waiting at written",
its barrier call was still queued, process 1 waited 60 s at "written" and
missed the next round).

So the thread itself takes the seat, right before it calls the barrier, and
``cancel`` closes it: under one lock, either the thread took the seat first
(it is in the barrier, or about to call it: releasing it is right), or
``close`` came first and the thread never calls the barrier.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

from ckpt.errors import CheckpointError

T = TypeVar("T")


class BarrierSeat:
  """The barrier this process's save thread is in, if any (one at a time)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._at: str | None = None
    self._closed = False

  def wait(self, key: str, barrier: Callable[[], T]) -> T:
    """On the worker thread: takes the seat at ``key``, calls ``barrier()``
    (a barrier, or a wait for a key) and returns what it returns, leaving
    the seat once it returns. Raises CheckpointError without calling it
    once the seat is closed (the save was cancelled)."""
    with self._lock:
      if self._closed:
        raise CheckpointError(
            f"barrier {key!r} not entered: the save was cancelled")
      self._at = key
    try:
      return barrier()
    finally:
      with self._lock:
        self._at = None

  def at(self) -> list[str]:
    """The barrier the thread is in now ([] if none)."""
    with self._lock:
      return [] if self._at is None else [self._at]

  def close(self) -> str | None:
    """No barrier is entered from now on; the one the thread is in (it
    stays there until the other processes arrive), or None."""
    with self._lock:
      self._closed = True
      return self._at
