"""End-to-end integrity: crc32c checksums taken at save, checked on read.

- Formats "zarr3" and "ocdbt": every chunk carries a crc32c (zarr3's codec,
  last in the chain), checked by TensorStore whenever it decodes the chunk.
  ``verify`` reads every chunk; every restore is verified as it reads.
- Format "zarr" (v2): every box a process writes is checksummed from its
  staged host copy (no second pass over the data) into that process's file
  ``.checksums/<process>.msgpack`` in the step. ``verify`` reads those
  files and every box back and compares; ``restore(verify=True)`` checks
  the boxes that overlap what this process reads. A missing file leaves
  the boxes of its process unverifiable, which is reported.
- Indexes from before carry the box checksums in their entries; checked
  the same way.

(What a restore does with a damaged step: docs/everyday.md, "Every
restore is verified"; the ``ckpt verify`` command: docs/cli.md.)
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Callable

from ckpt.restore import checksums
from ckpt.restore import lazy
from ckpt.restore import tasks
from ckpt.restore import pack_leaf
from ckpt.restore import read as restore_lib
from ckpt.store import storage as storage_lib
from ckpt.restore.checksums import check_boxes
from ckpt.errors import CheckpointError
from ckpt.store.limiter import ByteLimiter

DEFAULT_BUDGET = 1 << 30


@dataclasses.dataclass(frozen=True)
class Problem:
  """One corrupt (or unverifiable) leaf.

  Fields: ``path`` (the leaf path) and ``message`` (what is wrong). Built by
  ``verify``; raises nothing.
  """
  path: str
  message: str


async def _verify(storage: storage_lib.Storage, step_dir: str, budget: int,
                  progress: Callable[[int, int], None] | None) -> list[Problem]:
  index = await asyncio.to_thread(restore_lib.read_index, storage, step_dir)
  leaves = restore_lib.step_leaves(
      index, storage, step_dir, storage.context(), budget)
  await checksums.attach(leaves, storage, step_dir, index)
  arrays = [v for v in leaves.values()
            if isinstance(v, (lazy.LazyArray, pack_leaf.LazyPacked))]
  limiter = ByteLimiter(budget)
  problems: list[Problem] = []
  done = 0

  async def one(leaf: lazy.LazyArray):
    nonlocal done
    try:
      await check_boxes(leaf, None, limiter)
    except CheckpointError as e:
      problems.append(Problem(leaf.path, str(e)))
    done += 1
    if progress:
      progress(done, len(arrays))

  await asyncio.gather(*(one(a) for a in arrays))
  return sorted(problems, key=lambda p: p.path)


def verify(path, *, step: int | None = None, storage_options: dict | None = None,
           progress: Callable[[int, int], None] | None = None,
           budget: int = DEFAULT_BUDGET) -> list[Problem]:
  """Reads every stored byte of a checkpoint and checks it against the
  checksums taken at save (its chunks' crc32c, or its checksum files). Returns the corrupt leaves (empty: all good).

  ``path`` is a checkpoint root (then ``step``, default latest) or one step
  directory. An unreadable index raises CorruptCheckpointError.

  Args:
    path: a checkpoint root or one step directory (path or URL).
    step: a committed step of the root, or None for the latest.
    storage_options: merged into the TensorStore kvstore spec.
    progress: ``fn(bytes_done, bytes_total)`` called as it reads.
    budget: the host-memory budget of the reads in flight.

  Raises:
    CorruptCheckpointError: an unreadable index.
    CheckpointNotFoundError: no such committed step.

  Not collective: one process reads everything (``ckpt verify`` runs it).
  """
  storage = storage_lib.Storage(path, storage_options)
  step_dir = restore_lib.locate_path(storage, step)
  return tasks.run_sync(_verify(storage, step_dir, budget, progress))
