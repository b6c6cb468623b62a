"""One host-memory byte budget for everything a save or restore has in flight.

Made once per save (or restore) and shared by every leaf, unlike T5X's
per-array limiter, which limits nothing across arrays. Waiters are served in
FIFO order, so a large item is not starved by a stream of small ones. An item
larger than the whole budget waits until nothing else is in flight, then takes
the whole budget and proceeds alone: it never deadlocks (T5X waits for
``available > n``, which never holds when ``n`` is the whole budget).
"""

from __future__ import annotations

import asyncio
import collections


class ByteLimiter:

  def __init__(self, budget: int):
    if budget <= 0:
      raise ValueError(f"concurrent_bytes must be positive, got {budget}")
    self.budget = int(budget)
    self._available = self.budget
    self._waiters: collections.deque[tuple[int, asyncio.Future]] = (
        collections.deque())
    self.peak_in_use = 0

  @property
  def in_use(self) -> int:
    return self.budget - self._available

  def grant_for(self, nbytes: int) -> int:
    return max(0, min(int(nbytes), self.budget))

  def try_acquire(self, nbytes: int) -> int | None:
    """The grant if it is available now without waiting, else None."""
    grant = self.grant_for(nbytes)
    if self._waiters or self._available < grant:
      return None
    self._take(grant)
    return grant

  async def acquire(self, nbytes: int) -> int:
    """Waits for ``nbytes`` (capped at the budget); returns the grant."""
    grant = self.try_acquire(nbytes)
    if grant is not None:
      return grant
    grant = self.grant_for(nbytes)
    fut = asyncio.get_running_loop().create_future()
    self._waiters.append((grant, fut))
    try:
      await fut
    except BaseException:
      if fut.done() and not fut.cancelled():
        self.release(grant)  # granted just as we were cancelled
      else:
        try:
          self._waiters.remove((grant, fut))
        except ValueError:
          pass  # cancelled, and _wake already dropped it from the queue
        self._wake()
      raise
    return grant

  def release(self, grant: int) -> None:
    self._available += grant
    if self._available > self.budget:
      raise RuntimeError("ByteLimiter released more than it granted")
    self._wake()

  def _take(self, grant: int) -> None:
    self._available -= grant
    self.peak_in_use = max(self.peak_in_use, self.in_use)

  def _wake(self) -> None:
    while self._waiters and self._available >= self._waiters[0][0]:
      grant, fut = self._waiters.popleft()
      if fut.cancelled():
        continue
      self._take(grant)
      fut.set_result(None)
