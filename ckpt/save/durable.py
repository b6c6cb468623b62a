"""Each data file of a save made durable once, by the process that wrote it.

TensorStore's file driver, left to itself, makes every write durable on its
own: it writes the chunk into a temporary file, fsyncs it, renames it over
the chunk's name and fsyncs the directory, so a save of N chunk files paid
about 2N fsyncs, and the commit fsynced every directory of the attempt once
more. ``strace -f -c -e trace=fsync`` of one sync save of
``transformer_dp`` (1030 files, 270 directories): 2328 fsyncs, 47.9 s of
them summed over the threads; with this module 1304 (each file and
directory once, the root and the lease), 4.1 s.

Formats "zarr" and "zarr3" on a local file system write with the driver's
sync off (``deferred``); each process fsyncs every file it wrote, each once,
on several threads, as each write finishes (``Syncer``: the disk writes a
box back while the next ones are written, as with the driver's sync; all
of them at the end took 2.3-3.5 s more for those 1030 files), and waits for
them before the "written" barrier.

"As each write finishes" needs writes that finish one after another:
TensorStore runs every write it is given at once, and all 876 array writes
of ``transformer_dp`` ended together after 1.25 s, so their fsyncs (2.3 s)
started only then. An array write therefore starts only once its bytes fit
in the ``Syncer``'s ``window`` (``WINDOW_BYTES`` written and not yet
fsynced; ckpt/save/write.py ``write_owned``): writes, checksums and fsyncs
overlap, and that sync save took 2.97-3.43 s against 4.41-4.72 s without
the window, the same bytes as plain files 3.21-3.89 s (alternating, this
2-core machine under load). An asynchronous save also drops each file's
pages once it is synced (ckpt/save/polite.py). The commit (ckpt/commit/protocol.py)
then fsyncs every directory of the attempt once, the index and the marker,
renames, and fsyncs the root. The order
after a power loss is the one the driver's own fsyncs gave: no step is
renamed into place before all of its files and directory entries are on
disk, and nothing of an attempt that was not renamed is ever read.

A box of raw zarr v2 chunks is written by ckpt itself
(ckpt/save/rawwrite.py, ``Syncer.write_raw``) on the Syncer's threads:
each chunk file written, summed and fsynced on one thread, and not queued
again by ``written``.

Format "ocdbt" keeps the driver's sync (its database files are named by its
own manifest, not by the plan). ``DEFER_SYNC = False`` restores the
driver's per-write sync for every format.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any

from ckpt.format import pack_index
from ckpt.format import tsspec
from ckpt.save import rawwrite
from ckpt.shards import plan as plan_lib
from ckpt.store.limiter import ByteLimiter

DEFER_SYNC = True
_FORMATS = ("zarr", "zarr3")
_METADATA = {"zarr": ".zarray", "zarr3": "zarr.json"}
# fsyncs in flight at once: the journal commits concurrent ones together.
_THREADS = 16
# The bytes a process has written and not yet fsynced, at most (a larger
# write takes the whole window): see ``Syncer``.
WINDOW_BYTES = 128 << 20


def defers(storage_format: str, step_kvstore: dict[str, Any]) -> bool:
  """Whether this save's files are synced by a ``Syncer`` (not by the
  driver at each write)."""
  return (DEFER_SYNC and storage_format in _FORMATS
          and step_kvstore.get("driver") == "file")


def deferred(storage_format: str, step_kvstore: dict[str, Any]
             ) -> dict[str, Any]:
  """The step's kvstore spec, with the file driver's per-write sync off
  where ``defers``; a ``file_io_sync`` the user set is kept."""
  if not defers(storage_format, step_kvstore):
    return step_kvstore
  return {"file_io_sync": False, **step_kvstore}


def _chunk_files(plan: Any, w: plan_lib.Write, work: str) -> list[str]:
  """The chunk files of write ``w`` (none for a packed leaf)."""
  lp = plan.leaves[w.leaf]
  if lp.layout is None or lp.packed:
    return []
  fmt, chunks = plan.options.storage_format, lp.entry.chunks
  folder = os.path.join(work, lp.entry.relpath)
  return [os.path.join(folder, tsspec.chunk_key(
      fmt, [a // c for a, c in zip(b.start, chunks)]))
          for b in plan_lib.chunk_boxes(w.box, chunks)]


def _other_files(plan: Any, work: str, process: int,
                 process_count: int) -> list[str]:
  """The metadata of the arrays this process created (dealt round-robin
  over the processes, ckpt/save/write.py ``_open_arrays``) and its packs."""
  arrays = [lp for lp in plan.leaves if lp.layout is not None and not lp.packed]
  name = _METADATA[plan.options.storage_format]
  paths = [os.path.join(work, lp.entry.relpath, name)
           for lp in arrays[process::process_count]]
  packs = os.path.join(work, pack_index.PACK_DIR)
  try:
    names = os.listdir(packs)
  except FileNotFoundError:
    names = []
  return paths + [os.path.join(packs, n) for n in names
                  if n.startswith(f"{process}.")]


def _fsync(path: str, drop: bool = False) -> bool:
  try:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
  except FileNotFoundError:  # nothing written there: nothing to sync
    return False
  try:
    os.fsync(fd)
    if drop:  # its pages are clean now: free them for the next writes
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  finally:
    os.close(fd)
  return True


class Syncer:
  """fsyncs this process's files as their writes finish (``written``, from
  the event loop: it only queues, and returns the fsyncs' futures),
  ``_THREADS`` at a time, so the disk writes them back while the next boxes
  are staged and written, as the driver's own sync did; ``window`` bounds
  the bytes written and not yet synced (module docstring); ``finish`` adds
  the arrays' metadata and the packs and waits for all. Each file once;
  with ``drop`` its pages leave the page cache once it is synced."""

  def __init__(self, plan: Any, work: str, process: int, process_count: int,
               drop: bool = False):
    self._plan, self._work, self._drop = plan, work, drop
    self._process, self._count = process, process_count
    self._pool = concurrent.futures.ThreadPoolExecutor(
        _THREADS, thread_name_prefix="ckpt-fsync")
    self._futures: list[concurrent.futures.Future] = []
    self._queued: set[str] = set()
    self._raw: dict[int, rawwrite.RawChunks | None] = {}  # leaf -> its files
    # For write_owned: an array write starts once its bytes fit (WINDOW_BYTES).
    self.window = ByteLimiter(WINDOW_BYTES)

  @classmethod
  def start(cls, plan: Any, step_kvstore: dict[str, Any], work: str,
            process: int, process_count: int,
            drop: bool = False) -> "Syncer | None":
    """A Syncer where ``defers`` (else None: the driver syncs)."""
    if not defers(plan.options.storage_format, step_kvstore):
      return None
    return cls(plan, work, process, process_count, drop)

  def _queue(self, paths: list[str]) -> list[concurrent.futures.Future]:
    out = []
    for p in paths:
      if p not in self._queued:  # a chunk two writes share: once
        self._queued.add(p)
        out.append(self._pool.submit(_fsync, p, self._drop))
    self._futures.extend(out)
    return out

  def write_raw(self, w: plan_lib.Write, data: Any
                ) -> concurrent.futures.Future | None:
    """Starts writing box ``w`` (``data``: its bytes in the stored dtype)
    as raw chunk files, each fsynced once on the thread that wrote it
    (ckpt/save/rawwrite.py), on this Syncer's threads; returns the future
    of its [(chunk box, crc32c)], or None where the box is not raw chunks
    (TensorStore writes it, and ``written`` queues its fsyncs)."""
    raw = self._raw.get(w.leaf, False)
    if raw is False:
      lp = self._plan.leaves[w.leaf]
      raw = self._raw[w.leaf] = (
          None if lp.layout is None or lp.packed else rawwrite.RawChunks.of(
              self._plan.options.storage_format, self._work, lp.entry))
    parts = raw and raw.parts(w.box)
    if not parts:
      return None
    self._queued.update(map(raw.path, parts))  # synced there: not again
    return self._pool.submit(raw.write, parts, w.box, data, self._drop)

  def written(self, w: plan_lib.Write) -> list[concurrent.futures.Future]:
    """Write ``w`` is done: its chunk files are queued for their fsync;
    returns their futures."""
    return self._queue(_chunk_files(self._plan, w, self._work))

  def finish(self) -> int:
    """Blocking: every file of this process synced (the first error is
    raised); returns how many were."""
    self._queue(_other_files(self._plan, self._work, self._process,
                             self._count))
    try:
      return sum(f.result() for f in self._futures)
    finally:
      self.close()

  def close(self) -> None:
    """Drops what has not started (a failed save) and ends the threads."""
    self._pool.shutdown(wait=False, cancel_futures=True)
