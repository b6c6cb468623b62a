"""Python's cyclic GC paused while ckpt makes many short-lived objects.

A save or restore of 10,000 small leaves makes hundreds of thousands of
Python objects (the plan's, the staged views, a task and a few pieces per
leaf) and keeps them until it ends, so the collector ran generation-2
passes over the whole process inside it: measured on the limit's 10,000
leaves (python -m scripts.bench_small_leaves --limits), 2-5 of them in a
first save (a third of its CPU time), one in a later save (a quarter),
2-3 in a restore (a sixth), and in an async save of 5,000 leaves one every
few saves, most of the 50 ms ``save()`` may block. Nothing made there is
cyclic garbage (what is freed goes by reference counting); the collector
runs again, as it would have, once the work is done. A GC the caller had
disabled stays disabled. The index's encode and decode pause it the same
way (ckpt/format/index.py: half the CPU time of decoding 100,000 leaves).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator


class Pause:
  """The GC paused from now until ``resume()`` (from any thread; only the
  first call does anything)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._paused = gc.isenabled()
    gc.disable()

  def resume(self) -> None:
    with self._lock:
      if self._paused:
        self._paused = False
        gc.enable()


@contextlib.contextmanager
def paused() -> Iterator[Pause]:
  """A ``Pause`` for the block (resumed when it ends, or earlier)."""
  pause = Pause()
  try:
    yield pause
  finally:
    pause.resume()
