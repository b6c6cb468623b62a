"""One way to time a block of code and one way to measure the memory it adds.

``with measure() as m: ...`` gives, for the block:

- ``m.wall_s``: wall seconds (``time.perf_counter``);
- ``m.cpu_s`` (``user_s + sys_s``): CPU seconds of this process, every
  thread (``getrusage``): the figure to compare on a shared machine, where
  other work inflates wall time but not CPU time;
- ``m.minor_faults``: pages first touched (fresh host memory shows here);
- ``m.extra_rss``: the peak resident set size during the block minus the RSS
  just before it (taken after ``gc.collect`` and ``malloc_trim``, so garbage
  of earlier blocks does not count). The peak is the larger of the kernel's
  high-water mark (``VmHWM``, reset on entry through
  ``/proc/self/clear_refs``) and a thread's samples of ``/proc/self/statm``
  every ``interval_s`` (0: no thread; the kernel's mark alone where it can
  be reset).

``m.lap()`` is the wall time so far (an async save's blocking time).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import re
import resource
import threading
import time

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
  """This process's resident set size now (bytes)."""
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * _PAGE


def malloc_trim() -> None:
  """Returns glibc's free heap pages to the kernel (where glibc is)."""
  with contextlib.suppress(Exception):
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def drop_page_cache() -> bool:
  """``sync; echo 3 > /proc/sys/vm/drop_caches`` (root only): whether the
  page cache was dropped. ``CKPT_KEEP_PAGE_CACHE=1`` (the test suite's
  smoke runs) drops nothing, as for a user who is not root: the drop is the
  whole machine's, and a test running beside it that counts its disk reads
  (tests/multiprocess/test_readonce_fetch.py: every process's libraries
  read again, 43x its bound with a drop every 0.3 s) would fail."""
  if os.environ.get("CKPT_KEEP_PAGE_CACHE"):
    return False
  os.sync()
  return _write_proc("/proc/sys/vm/drop_caches", "3\n")


def _write_proc(path: str, text: str) -> bool:
  """Writes ``text`` to a /proc file: whether it was allowed."""
  try:
    with open(path, "w") as f:
      f.write(text)
    return True
  except OSError:
    return False


def _reset_peak() -> bool:
  return _write_proc("/proc/self/clear_refs", "5")


def _peak() -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024
  return 0


class measure:  # pylint: disable=invalid-name
  """Context manager: wall, CPU and extra peak RSS of its block."""

  def __init__(self, interval_s: float = 0.002):
    self.interval_s = interval_s

  def __enter__(self) -> "measure":
    gc.collect()
    malloc_trim()
    self.rss_before = rss()
    self._peak_ok = _reset_peak()
    self._sampled = self.rss_before
    self._stop = threading.Event()
    self._thread = None
    if self.interval_s > 0 or not self._peak_ok:
      self._thread = threading.Thread(target=self._sample, daemon=True,
                                      name="bench-rss")
      self._thread.start()
    self._usage = resource.getrusage(resource.RUSAGE_SELF)
    self._t0 = time.perf_counter()
    return self

  def _sample(self) -> None:
    interval = self.interval_s or 0.002
    while not self._stop.wait(interval):
      self._sampled = max(self._sampled, rss())

  def lap(self) -> float:
    return time.perf_counter() - self._t0

  def __exit__(self, *exc) -> None:
    self.wall_s = time.perf_counter() - self._t0
    usage = resource.getrusage(resource.RUSAGE_SELF)
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    self.user_s = usage.ru_utime - self._usage.ru_utime
    self.sys_s = usage.ru_stime - self._usage.ru_stime
    self.cpu_s = self.user_s + self.sys_s
    self.minor_faults = usage.ru_minflt - self._usage.ru_minflt
    self.peak_rss = max(self._sampled, rss(),
                        _peak() if self._peak_ok else 0)
    self.extra_rss = self.peak_rss - self.rss_before

  def figures(self) -> dict[str, float]:
    """The figures as a JSON-ready dict."""
    return {"wall_s": self.wall_s, "cpu_s": self.cpu_s, "user_s": self.user_s,
            "sys_s": self.sys_s, "minor_faults": self.minor_faults,
            "extra_rss": self.extra_rss, "rss_before": self.rss_before}


def best_cpu(fn, repeat: int):
  """(the least CPU seconds of ``repeat`` calls of ``fn``, its last result)."""
  best, out = float("inf"), None
  for _ in range(repeat):
    with measure(interval_s=0) as m:
      out = fn()
    best = min(best, m.cpu_s)
  return best, out


def disk_usage(path: str) -> tuple[int, int]:
  """(bytes, files) under ``path`` (apparent file sizes)."""
  n = size = 0
  for root, _, files in os.walk(path):
    for name in files:
      size += os.lstat(os.path.join(root, name)).st_size
      n += 1
  return size, n


def evict(path: str) -> None:
  """Asks the kernel to drop the page cache of every file under ``path``."""
  for root, _, files in os.walk(path):
    for name in files:
      fd = os.open(os.path.join(root, name), os.O_RDONLY)
      try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu() -> dict[int, tuple[str, float, float]]:
  """Every thread of this process now: {thread id: (name, user s, system
  s)} (Linux /proc/self/task; empty elsewhere)."""
  out = {}
  try:
    tids = os.listdir("/proc/self/task")
  except OSError:
    return out
  for tid in tids:
    try:
      with open(f"/proc/self/task/{tid}/stat") as f:
        stat = f.read()
    except OSError:  # ended meanwhile
      continue
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    out[int(tid)] = (name, int(fields[11]) / _TICK, int(fields[12]) / _TICK)
  return out


def python_threads() -> dict[int, str]:
  """{native thread id: label} of this process's Python threads: "main"
  for the main thread, ``py:<name>`` for the others (their name, digits
  dropped), so that ``thread_cpu_by_name`` tells them from native threads
  (gRPC's, XLA's), which all inherit the OS name "python" before Python
  3.14."""
  out = {}
  for t in threading.enumerate():
    if t.native_id is None:
      continue
    out[t.native_id] = ("main" if t is threading.main_thread() else
                        "py:" + (re.sub(r"[0-9_]+", "", t.name) or t.name))
  return out


def thread_cpu_by_name(before: dict, after: dict,
                       labels: dict[int, str] | None = None
                       ) -> dict[str, dict]:
  """CPU seconds each group of threads (by name, trailing digits dropped:
  ``ts_pool_worker``, ``ckpt-fsync_``) used between two ``thread_cpu()``;
  threads that ended in between are not in ``after`` (their CPU is in the
  process's total only). ``labels``: {thread id: group} that replaces the
  OS name of those threads (``python_threads``)."""
  groups: dict[str, dict] = {}
  labels = labels or {}
  for tid, (name, user, sys_) in after.items():
    _, user0, sys0 = before.get(tid, (name, 0.0, 0.0))
    if user - user0 + sys_ - sys0 <= 0:
      continue
    if tid in labels:
      name = labels[tid]
    g = groups.setdefault(name.rstrip("0123456789") or name,
                          {"threads": 0, "user_s": 0.0, "sys_s": 0.0})
    g["threads"] += 1
    g["user_s"] += user - user0
    g["sys_s"] += sys_ - sys0
  return groups
