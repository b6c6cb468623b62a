"""A background save that stays out of the training job's way.

While an asynchronous save writes, the training loop runs on the same host:
its input pipeline and step dispatch (and, on CPU devices, the step itself)
compete with the save for cores and page cache. Two measures:

- Priority: the threads that do a save's work (ckpt's background thread,
  the worker threads it starts, and TensorStore's worker threads, which
  copy, encode, write and fsync the chunks) run at a lower priority:
  ``BACKGROUND_NICE`` above the nice value of the thread that made the
  Checkpointer (TensorStore's threads: of the main thread), at most 19, so
  the scheduler gives a busy training thread the cores first and the save
  the rest, also in a job niced as a whole (``nice -n 10 python train.py``:
  at a fixed nice 10 its save would have run level with its training).
  On Linux a priority is per thread (``setpriority`` on its thread id); a
  thread inherits its creator's.
  Lowering is one-way for an unprivileged process, and TensorStore's pool
  is shared by the process: its restores run at that priority too (which
  costs nothing when nothing else wants the cores).
- Page cache: an asynchronous save drops each file's pages from the page
  cache (``posix_fadvise(DONTNEED)``) as soon as it is fsynced (each file
  once: ckpt/save/durable.py, which starts an array write only while the
  bytes written and not yet fsynced fit in its window, ``WINDOW_BYTES``).
  The save then keeps at most about that much of the page cache, the next
  writes reuse the pages the last ones freed, and a checkpoint the job
  will not read again does not push the job's own cached files (its
  dataset, say) out of memory. Local files only; format "ocdbt" (synced by
  its driver) has its pages dropped once all are written.

  On this VM (whose balloon takes back free memory) a fresh page-cache
  page is slow to fault in: writing 1 GiB as 64 files of 16 MiB, each
  fsynced, took 1.96 s of system CPU keeping the pages and 0.58 s dropping
  each file's after its fsync; the save of ``large_f32_1g`` during
  ``scripts/bench_train.py``: TensorStore's writer threads 1.0-1.4 CPU s
  with the pages dropped at the end, 0.46-0.57 with the window.

Measured with ``scripts/bench.py --preset large_f32_1g --ops train`` (a
jitted MLP on 8 CPU devices over 2 shared cores, an async save of 1 GiB):
the training step's p90 during the save went from 1.3 s to 0.41 s (median
slowdown 2.0x -> 1.15x), the save itself from 4.2 s to 5.6 s. The page
cache drop made no difference to the step time there (it is about memory,
not cores); bounding TensorStore's threads (``data_copy_concurrency`` 1,
``file_io_concurrency`` 2) helped little or made the save 6x longer, so
neither is set (``storage_options`` sets them).

``BACKGROUND_NICE = 0`` and ``DROP_WRITTEN_PAGES = False`` turn them off
(set before the Checkpointer is made / the save starts). With
``writer="process"`` the writer process runs wholly at the lowered
priority (``background_nice``, taken when it starts: set
``BACKGROUND_NICE`` before the first save).
"""

from __future__ import annotations

import logging
import os
import threading

BACKGROUND_NICE = 10
DROP_WRITTEN_PAGES = True

_MAX_NICE = 19
_TS_THREAD_NAME = "ts_pool_worker"
_lock = threading.Lock()
_reniced: set[int] = set()  # thread ids already lowered (by this module)


def _lower(tid: int, nice: int) -> bool:
  """Sets thread ``tid``'s nice value to at least ``nice``; never raises
  a priority. False if the thread is gone or it cannot be read."""
  try:
    current = os.getpriority(os.PRIO_PROCESS, tid)
    if current < nice:
      os.setpriority(os.PRIO_PROCESS, tid, nice)
    return True
  except OSError:  # the thread ended meanwhile, or no permission
    return False


def _below(tid: int) -> int:
  """The nice value ``BACKGROUND_NICE`` below thread ``tid``'s (max 19)."""
  try:
    return min(_MAX_NICE, os.getpriority(os.PRIO_PROCESS, tid)
               + BACKGROUND_NICE)
  except OSError:
    return min(_MAX_NICE, BACKGROUND_NICE)


def background_nice() -> int:
  """The nice value of the writer process (``writer="process"``):
  ``BACKGROUND_NICE`` below this process's main thread (the training
  loop's, as a rule; at most 19), or the main thread's own when that is
  0. A process never raises its priority: the writer is started from the
  thread that calls ``save()``, not from the save's lowered threads."""
  if BACKGROUND_NICE <= 0 or not hasattr(os, "getpriority"):
    try:
      return os.getpriority(os.PRIO_PROCESS, os.getpid())
    except (OSError, AttributeError):
      return 0
  return _below(os.getpid())


def lower_this_thread() -> None:
  """Lowers the calling thread's priority (and so that of every thread it
  starts from now on) by ``BACKGROUND_NICE``, from the one it was started
  with (its creator's)."""
  if BACKGROUND_NICE <= 0 or not hasattr(os, "setpriority"):
    return
  tid = threading.get_native_id()
  _lower(tid, _below(tid))


def lower_tensorstore_threads() -> int:
  """Lowers the priority of TensorStore's worker threads of this process
  (Linux: found by name in /proc/self/task); returns how many it lowered
  now. The pool grows on demand, and TensorStore starts its new workers
  from a thread of its own, made by the process's first TensorStore call
  and so at that caller's priority (shown with TensorStore 0.1.86: workers
  started while a thread at nice 10 submitted work came out at nice 0), so
  a worker started mid-save runs at the job's priority until the next call
  of this: an asynchronous save calls it as it starts, once its writes
  started and once it ended."""
  if BACKGROUND_NICE <= 0 or not hasattr(os, "setpriority"):
    return 0
  try:
    tids = [int(t) for t in os.listdir("/proc/self/task")]
  except OSError:
    return 0
  nice = _below(os.getpid())  # the main thread's id is the process's
  lowered = 0
  with _lock:
    _reniced.intersection_update(tids)  # thread ids are reused
    for tid in tids:
      if tid in _reniced:
        continue
      try:
        with open(f"/proc/self/task/{tid}/comm") as f:
          name = f.read().strip()
      except OSError:
        continue
      if name == _TS_THREAD_NAME and _lower(tid, nice):
        _reniced.add(tid)
        lowered += 1
  return lowered


def drop_cached_pages(root: str) -> int:
  """Drops the page cache of every regular file under ``root`` (written and
  fsynced: their pages are clean); returns how many files it advised.
  Best effort: a file that cannot be opened is skipped."""
  if not DROP_WRITTEN_PAGES or not hasattr(os, "posix_fadvise"):
    return 0
  flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
  n = 0
  for dirpath, _, files in os.walk(root):
    for name in files:
      try:
        fd = os.open(os.path.join(dirpath, name), flags)
      except OSError:
        continue
      try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        n += 1
      except OSError as e:
        logging.debug("ckpt: posix_fadvise on %s: %s", name, e)
      finally:
        os.close(fd)
  return n
