"""The rounds and bounds of the local tier's partner exchange (ckpt/tiers/local_tier.py):
``TierRounds``, the processes' layout (who is whose partner) and the keys of
the tier's collective calls; ``Budget``, the bytes a save stages on the host
for its writer thread; and ``wait_ready``, which waits for the arrays a
``ppermute`` with every process makes at most ``barrier_timeout_s``
(BarrierTimeoutError past it).
"""

from __future__ import annotations

import threading
import time

from ckpt.multihost import process as multihost
from ckpt.tiers import partner
from ckpt.errors import BarrierTimeoutError


class TierRounds:
  """The local tier's processes and the keys of its collective calls."""

  def __init__(self, key_base: str, timeout_s: float):
    self.key_base = key_base  # the same on every process
    self.timeout_s = timeout_s
    self._layout: partner.Layout | None = None
    self._round_keys: list[str] = []  # deleted at the next round

  @property
  def layout(self) -> partner.Layout:
    if self._layout is None:
      # Collective (the hosts' round): built at the first save or restore,
      # which every process calls.
      self._layout = partner.Layout(self.key_base, self.timeout_s)
    return self._layout

  def call_key(self, name: str, *parts) -> str:
    """The coordination key of this tier's next collective call ``name``
    (the same on every process: calls are made in the same order)."""
    return multihost.call_key(self.key_base, name, *parts)

  def settle_keys(self, key: str) -> None:
    """The round of the collective call ``key`` passed here, so every
    process has entered that call and is done with the keys of the calls
    before it (each waits for its writer before a round): process 0
    deletes those. ``key``'s own go at the next call's round, so the
    coordination service does not grow with every call."""
    done, self._round_keys = self._round_keys, [key]
    for k in done:
      multihost.forget(k)

  def defer(self, key: str) -> None:
    """A round of ``key`` failed: its keys go at the next round that passes."""
    self._round_keys.append(key)

# ---- a byte budget for the caller and the writer thread ------------------------

class Budget:
  """Bytes staged on the host and not yet written. An item larger than the
  budget waits until nothing else is held, then proceeds alone."""

  def __init__(self, budget: int):
    self.budget, self.used, self.peak = int(budget), 0, 0
    self._cv = threading.Condition()

  def acquire(self, n: int, failed: threading.Event) -> bool:
    """Takes ``n`` bytes once they fit; False, taking nothing, once the save
    has failed: the caller then stages nothing more (it still joins the
    partner exchange, a collective), so a failed save drains within the
    budget too, and never waits for a writer that stopped."""
    with self._cv:
      while self.used and self.used + n > self.budget:
        if failed.is_set():
          return False
        self._cv.wait(0.1)
      if failed.is_set():
        return False
      self.used += n
      self.peak = max(self.peak, self.used)
      return True

  def release(self, n: int) -> None:
    with self._cv:
      self.used -= n
      self._cv.notify_all()


def wait_ready(arrays, deadline: float, timeout_s: float, what: str) -> None:
  """Returns once every array is ready; BarrierTimeoutError at
  ``deadline`` (time.monotonic()): a process did not join the collective
  that makes them."""
  pending, pause = list(arrays), 1e-4
  while True:
    pending = [a for a in pending if not a.is_ready()]
    if not pending:
      return
    now = time.monotonic()
    if now >= deadline:
      raise BarrierTimeoutError(
          f"{what} (a ppermute with every process) did not complete within "
          f"barrier_timeout_s = {timeout_s:g} s of its dispatch on process "
          f"{multihost.process_index()} of {multihost.process_count()}: a "
          "process did not join it (stuck, stopped, dead, or still busy "
          "with its previous work); look at the logs of the other processes")
    time.sleep(min(pause, deadline - now))
    pause = min(2 * pause, 0.01)
