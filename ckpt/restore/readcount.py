"""What a restore read from storage: the bytes of the boxes asked of
TensorStore and of the whole stored chunks they touch (``ReadCounter``),
counted per restore through a context variable (``COUNTER``) that every
stored array's read adds to (``count``), and the byte limiters' peak
(``note_limiter``). Imports nothing of ckpt, so the lazy leaves and the
read-once machinery can both count.
"""

from __future__ import annotations

import contextvars
import math
import threading
from typing import Sequence


class ReadCounter:
  """Bytes this process read from stored arrays in one restore: the boxes
  asked of TensorStore (in the stored dtype) and the whole stored chunks
  those boxes touch (what an uncompressed store must fetch)."""

  def __init__(self):
    self._lock = threading.Lock()
    self.bytes_read = 0
    self.chunk_bytes_read = 0
    self.reads = 0
    self.peak_in_use = 0  # the most a byte limiter of the restore granted

  def add(self, nbytes: int, chunk_bytes: int) -> None:
    with self._lock:
      self.bytes_read += int(nbytes)
      self.chunk_bytes_read += int(chunk_bytes)
      self.reads += 1

  def note(self, limiter) -> None:
    """Records the peak of a ByteLimiter the restore used."""
    with self._lock:
      self.peak_in_use = max(self.peak_in_use, int(limiter.peak_in_use))


def note_limiter(limiter) -> None:
  """Records ``limiter``'s peak in the restore's counter (if counting)."""
  c = COUNTER.get()
  if c is not None:
    c.note(limiter)


# Set for the duration of a restore; asyncio tasks and to_thread inherit it.
COUNTER: contextvars.ContextVar[ReadCounter | None] = contextvars.ContextVar(
    "ckpt_read_counter", default=None)


async def counted(coro, counter: ReadCounter | None):
  """Runs ``coro`` with ``counter`` counting its storage reads."""
  COUNTER.set(counter)
  return await coro


def count(box_start: Sequence[int], box_stop: Sequence[int],
          chunks: Sequence[int], itemsize: int) -> None:
  c = COUNTER.get()
  if c is None:
    return
  n = math.prod(b - a for a, b in zip(box_start, box_stop)) * itemsize
  touched = 1
  for a, b, k in zip(box_start, box_stop, chunks):
    if b <= a:
      touched = 0
      break
    touched *= ((b - 1) // k - a // k + 1) * k
  c.add(n, touched * itemsize)
