"""Restore buffers' memory, kept for the next restore once freed.

A restore buffer (ckpt/restore/hostmem.py) is a mapping of its own, and on
CPU devices the restored array is that memory. Unmapped when the array
goes, every restore after it faulted its memory in afresh: 262,144 base-page
faults per GiB, ~0.9 s of system CPU on a 2-core VM, where a restore into
``np.empty`` (glibc's heap, as the limit's ``np.fromfile`` does) reuses
pages the process already holds and faults almost nothing.

Here a buffer's mapping comes back to a free list when the last array that
views it goes (a ``weakref.finalize`` on the buffer), and a later buffer of
the same size takes it instead of a new mapping: its pages are resident, no
fault, no zeroing. Bounded: at most ``MAX_BYTES`` are kept (beyond, a freed
mapping is unmapped as before), and a mapping unused for ``IDLE_S``
seconds is unmapped by a daemon thread that runs only while the list is
not empty, so a process that restored once and freed the arrays gives the
memory back to the system within seconds. ``MAX_BYTES = 0`` turns it off.

A reused mapping holds the bytes of the buffer it was (another restore's
data, of this process): every restore read writes the whole of its buffer
before it is placed, as with ``np.empty``.
"""

from __future__ import annotations

import collections
import mmap
import threading
import time
import weakref
from typing import Callable

import numpy as np

# The most bytes of freed buffers kept (None: an eighth of the host's
# memory, set on first use).
MAX_BYTES: int | None = None
# A kept mapping unused this long is unmapped.
IDLE_S = 10.0


class Pool:
  """Freed mappings by size, each with when it was freed."""

  def __init__(self, host_bytes: Callable[[], int],
               clock: Callable[[], float] = time.monotonic):
    self._host_bytes = host_bytes
    self._clock = clock
    # RLock: a finalizer can run on this thread while it holds the lock.
    self._lock = threading.RLock()
    self._free: dict[int, collections.deque] = {}
    self.kept_bytes = 0
    self.reused = 0
    self._reaper: threading.Thread | None = None

  def _max_bytes(self) -> int:
    return (self._host_bytes() // 8 if MAX_BYTES is None else
            int(MAX_BYTES))

  def take(self, size: int) -> tuple[mmap.mmap, int] | None:
    """A kept mapping and its buffer's offset for a buffer of ``size``
    bytes, or None."""
    with self._lock:
      free = self._free.get(size)
      if not free:
        return None
      _, m, offset = free.pop()  # the most recently freed: warmest
      self.kept_bytes -= size
      self.reused += 1
      return m, offset

  def adopt(self, view: np.ndarray, m: mmap.mmap, offset: int,
            size: int) -> np.ndarray:
    """``view`` (of ``m``) whose mapping comes back here when it goes."""
    weakref.finalize(view, self._give, m, offset, size)
    return view

  def _give(self, m: mmap.mmap, offset: int, size: int) -> None:
    # No m.close(): the dying view may still export m; dropping the last
    # reference unmaps it once nothing views it.
    with self._lock:
      if self.kept_bytes + size > self._max_bytes():
        return
      self._free.setdefault(size, collections.deque()).append(
          (self._clock(), m, offset))
      self.kept_bytes += size
      if self._reaper is None:
        self._reaper = threading.Thread(target=self._reap, daemon=True,
                                        name="ckpt-hostpool")
        self._reaper.start()

  def trim(self, older_than: float) -> None:
    """Drops every kept mapping freed more than ``older_than`` s ago."""
    now = self._clock()
    with self._lock:
      for size in list(self._free):
        free = self._free[size]
        while free and now - free[0][0] >= older_than:
          free.popleft()
          self.kept_bytes -= size
        if not free:
          del self._free[size]

  def _reap(self) -> None:
    while True:
      time.sleep(IDLE_S / 4)
      self.trim(IDLE_S)
      with self._lock:
        if not self._free:
          self._reaper = None
          return
