"""Host memory for restored data: huge pages or base pages.

A restore reads each box into fresh host memory (``assemble.materialize``;
on CPU devices jax adopts that memory as the restored array). numpy asks the
kernel for transparent huge pages on every allocation of 4 MiB or more, so
each first touch of that memory faults in (and zeroes) a 2 MiB page.

On a virtual machine whose balloon device reports free pages to the
hypervisor (virtio-balloon's free page reporting, VIRTIO_BALLOON_F_REPORTING:
Firecracker, cloud-hypervisor, QEMU with ``free-page-reporting=on``), the
guest hands every free block of ``page_reporting_order`` (2 MiB by default)
back to the host about two seconds after it is freed, and a huge page is
exactly such a block: the host must then back all of it again on the first
touch. Measured on such a VM (2 cores, 1 GiB, system time of the faulting
thread): fresh huge pages 0.2 s when the memory was freed just before,
1.0-1.9 s when it had been free for seconds; base (4 KiB) pages 0.7 s
either way. Which one a restore meets depends on what the process did just
before (a job that restores right after it freed its arrays, or another
system's restore, gets just-freed memory; a fresh process gets reported
memory), and the kernel hands out just-freed blocks first (reported ones go
to the tail of the free lists), so neither choice alone is right.

There, each buffer is decided by what its first huge page cost
(``_Chooser``): the buffer asks for huge pages and the thread that allocates
it touches its first aligned 2 MiB, timed in that thread's CPU time (the
host's backing of a reported block shows there, other threads' load does
not). Cheaper than ``SLOW_HUGE_FAULT_S`` (base pages' cost for the same
2 MiB): the block was not reported and the buffer keeps huge pages; slower:
the rest of the buffer gets base pages (``MADV_NOHUGEPAGE``), and so do the
next ``BASE_BYTES`` of buffers before the next probe. Elsewhere numpy's
huge pages stay (on bare metal a huge page is the cheaper fault).

``HUGE_PAGES``: None (default) decides as above; True or False forces the
choice (set it before restoring).

The mapping of a freed buffer is kept for the next buffer of its size
(ckpt/restore/hostpool.py): resident pages, no fault, as glibc's heap gives
``np.empty`` back the memory the process freed.

``check_fits`` refuses, before allocating, a read of one box larger than
this host's memory (``host_memory_bytes``).
"""

from __future__ import annotations

import functools
import glob
import math
import mmap
import os
import threading
import time
from typing import Callable, Sequence

import numpy as np

from ckpt.errors import CheckpointError
from ckpt.restore import hostpool

HUGE_PAGES: bool | None = None

_REPORTING_BIT = 5  # VIRTIO_BALLOON_F_REPORTING
_HUGE_PAGE_ORDER = 9  # a 2 MiB transparent huge page in 4 KiB pages
_MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", 15)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_HUGE_PAGE = 2 << 20
# A huge page whose first touch costs more CPU than this (base pages for
# the same 2 MiB: 512 faults, ~1.4 ms measured) was handed to the host.
SLOW_HUGE_FAULT_S = 1e-3
# After a slow probe, this many bytes of buffers get base pages unprobed.
BASE_BYTES = 64 << 20
# Below numpy's own huge-page threshold an allocation gets base pages
# anyway: leave it to numpy's allocator (and its small-buffer cache).
_MIN_BYTES = 4 << 20


def reports_huge_pages(sys_root: str = "/sys") -> bool:
  """Whether this kernel hands free huge-page-sized blocks back to a
  hypervisor (a virtio-balloon device with free page reporting, at an order
  no larger than a huge page's)."""
  reporting = False
  for path in glob.glob(os.path.join(
      sys_root, "bus/virtio/drivers/virtio_balloon/*/features")):
    try:
      with open(path) as f:
        bits = f.read().strip()
    except OSError:
      continue
    # One character per feature bit, bit 0 first.
    if len(bits) > _REPORTING_BIT and bits[_REPORTING_BIT] == "1":
      reporting = True
  if not reporting:
    return False
  try:
    with open(os.path.join(sys_root, "module/page_reporting/parameters/"
                           "page_reporting_order")) as f:
      order = int(f.read().strip())
  except (OSError, ValueError):
    return True  # the kernel's default order is the huge page's
  return order <= _HUGE_PAGE_ORDER


@functools.lru_cache(maxsize=None)
def _machine_reports_huge_pages() -> bool:
  return reports_huge_pages()


def use_huge_pages() -> bool:
  """Whether restore buffers get transparent huge pages without a probe
  (``HUGE_PAGES``, else: this machine does not report free pages)."""
  if HUGE_PAGES is not None:
    return bool(HUGE_PAGES)
  return not _machine_reports_huge_pages()


class _Chooser:
  """Huge or base pages, buffer by buffer, from what the last probe cost
  (module docstring). Its counts: ``probes``, ``slow`` (probes that found
  a reported block), ``huge_bytes`` and ``base_bytes`` handed out."""

  def __init__(self, clock: Callable[[], float] = time.thread_time):
    self._clock = clock
    self._lock = threading.Lock()
    self._base_left = 0
    self.probes = self.slow = self.huge_bytes = self.base_bytes = 0

  def allocate(self, size: int) -> tuple[mmap.mmap, int]:
    """A mapping of at least ``size`` bytes (a multiple of the page size)
    and the offset of the buffer in it: a huge page's boundary when huge
    pages were tried (a 4 MiB buffer is then two huge pages, not one and
    2 MiB of base pages)."""
    with self._lock:
      probe = self._base_left <= 0
      if not probe:
        self._base_left -= size
        self.base_bytes += size
    if not probe:
      m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
      m.madvise(_MADV_NOHUGEPAGE)
      return m, 0
    # Room to start on a huge page's boundary (address space only: pages
    # never touched cost nothing).
    m = mmap.mmap(-1, size + _HUGE_PAGE - mmap.PAGESIZE,
                  flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(_MADV_HUGEPAGE)
    view = np.frombuffer(m, np.uint8)
    first = -view.ctypes.data % _HUGE_PAGE
    end = first + size
    if size < _HUGE_PAGE:
      del view
      return m, first
    start = self._clock()
    view[first] = 0  # faults in (and zeroes) the whole huge page
    slow = self._clock() - start > SLOW_HUGE_FAULT_S
    del view
    rest = first + _HUGE_PAGE
    if slow and end > rest:  # what follows it gets base pages
      m.madvise(_MADV_NOHUGEPAGE, rest, len(m) - rest)
    with self._lock:
      self.probes += 1
      if slow:
        self.slow += 1
        self._base_left = BASE_BYTES
        self.base_bytes += max(0, end - rest)
        self.huge_bytes += min(size, _HUGE_PAGE)
      else:
        self.huge_bytes += size
    return m, first


CHOOSER = _Chooser()


def empty(nbytes: int) -> np.ndarray:
  """``nbytes`` of uninitialized, page-aligned (when large) host memory as
  uint8; huge or base pages as the module docstring says, or the resident
  mapping of a freed buffer of the same size (``POOL``). The mapping goes
  back to ``POOL`` (or is unmapped) when the last view of the array goes."""
  if nbytes < _MIN_BYTES or use_huge_pages():
    return np.empty(nbytes, np.uint8)
  size = math.ceil(nbytes / mmap.PAGESIZE) * mmap.PAGESIZE
  kept = POOL.take(size)
  if kept is not None:
    m, offset = kept
  elif HUGE_PAGES is None:
    m, offset = CHOOSER.allocate(size)
  else:
    m, offset = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE
                          | mmap.MAP_ANONYMOUS), 0
    m.madvise(_MADV_NOHUGEPAGE)
  # The array's base keeps the mapping alive.
  return POOL.adopt(np.frombuffer(m, np.uint8, count=nbytes, offset=offset),
                    m, offset, size)


def aligned_empty(shape: Sequence[int], dtype, alignment: int) -> np.ndarray:
  """Uninitialized memory of ``shape`` and ``dtype`` whose first byte is
  ``alignment``-aligned (``alignment`` divides the page size)."""
  dtype = np.dtype(dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  raw = empty(nbytes + alignment)
  offset = -raw.ctypes.data % alignment
  return raw[offset:offset + nbytes].view(dtype).reshape(tuple(shape))


@functools.lru_cache(maxsize=1)
def host_memory_bytes() -> int:
  """This host's physical memory (a large number where unknown); asked of
  the system once (a restore of 10,000 small leaves asked it 40,000 times)."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return 1 << 62


POOL = hostpool.Pool(lambda: host_memory_bytes())


def check_fits(path: str, shape: Sequence[int], dtype) -> None:
  """Refuses, before allocating, a read of more bytes than this host has:
  shapes come from an index (index.check_extent bounds them far above any
  real leaf), and one box is allocated whole."""
  nbytes = math.prod(shape) * np.dtype(dtype).itemsize
  if nbytes > host_memory_bytes():
    raise CheckpointError(
        f"leaf {path!r}: reading a box of shape {tuple(shape)} needs "
        f"{nbytes} bytes at once, more than this host's "
        f"{host_memory_bytes()} bytes of memory; restore it with a target "
        "sharding so that each process reads only its part (or the index "
        "is not what was saved)")
