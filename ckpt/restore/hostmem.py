"""Host memory for restored data: huge pages or base pages.

A restore reads each box into fresh host memory (``assemble.materialize``;
on CPU devices jax adopts that memory as the restored array). numpy asks the
kernel for transparent huge pages on every allocation of 4 MiB or more, so
each first touch of that memory faults in (and zeroes) a 2 MiB page.

On a virtual machine whose balloon device reports free pages to the
hypervisor (virtio-balloon's free page reporting, VIRTIO_BALLOON_F_REPORTING:
Firecracker, cloud-hypervisor, QEMU with ``free-page-reporting=on``), the
guest hands every free block of ``page_reporting_order`` (2 MiB by default)
back to the host a few seconds after it is freed, and a huge page is exactly
such a block: the host must then back all of it again on the first touch.
Measured on such a VM (2 cores, 1 GiB): touching fresh huge pages costs
2.2-3.0 s of system time when the memory had been free for a few seconds,
0.1 s when it was freed just before (the reason the first restore of a
process was 4x slower than the next ones), and base (4 KiB) pages 0.5-0.7 s
either way. There, restore buffers are allocated with base pages
(``MADV_NOHUGEPAGE``); elsewhere numpy's huge pages stay (on bare metal a
huge page is the cheaper fault).

``HUGE_PAGES``: None (default) decides from the machine as above; True or
False forces the choice (set it before restoring).

``check_fits`` refuses, before allocating, a read of one box larger than
this host's memory (``host_memory_bytes``).
"""

from __future__ import annotations

import functools
import glob
import math
import mmap
import os
from typing import Sequence

import numpy as np

from ckpt.errors import CheckpointError

HUGE_PAGES: bool | None = None

_REPORTING_BIT = 5  # VIRTIO_BALLOON_F_REPORTING
_HUGE_PAGE_ORDER = 9  # a 2 MiB transparent huge page in 4 KiB pages
_MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", 15)
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
  """Whether restore buffers get transparent huge pages (``HUGE_PAGES``)."""
  if HUGE_PAGES is not None:
    return bool(HUGE_PAGES)
  return not _machine_reports_huge_pages()


def empty(nbytes: int) -> np.ndarray:
  """``nbytes`` of uninitialized, page-aligned (when large) host memory as
  uint8; base pages when ``use_huge_pages()`` is false. The memory is
  unmapped when the last view of the array goes."""
  if nbytes < _MIN_BYTES or use_huge_pages():
    return np.empty(nbytes, np.uint8)
  size = math.ceil(nbytes / mmap.PAGESIZE) * mmap.PAGESIZE
  m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  m.madvise(_MADV_NOHUGEPAGE)
  # The array's base keeps the mapping alive; it is unmapped with it.
  return np.frombuffer(m, np.uint8, count=nbytes)


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
