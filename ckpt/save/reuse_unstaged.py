"""The very same array, linked unstaged and unhashed (a disk, reuse on).

A ``jax.Array`` is immutable: when a save is given the very object (alive,
not deleted or donated) that the save of the step it links from stored,
its bytes are that step's bytes. Its boxes are then neither staged (no
device-to-host copy) nor hashed: each chunk is linked from that step
after the same checks as any link (its file is still what was stored,
``Source.check`` in reuse_source.py, and another copy than the newest
step's; ckpt/save/reuse.py). If one
chunk of a box cannot be linked, nothing of the box is, and it takes the
usual path (staged, sorted, written). A bucket holds whole leaves back
until the processes agree (reuse_held.py), which needs the bytes: there
every box is staged.

Only an in-memory weak reference is kept per leaf (``objects``): the
identity is never read from a checkpoint, so a restarted job hashes.
"""

from __future__ import annotations

import os
from typing import Any
import weakref

import jax

from ckpt.format import tsspec
from ckpt.save.reuse_source import Outcome
from ckpt.shards import plan as plan_lib


def objects(plan: Any, layouts: dict[str, tuple]) -> dict[str, Any]:
  """relpath -> weak reference of each stored leaf's jax.Array."""
  return {lp.entry.relpath: weakref.ref(lp.source) for lp in plan.leaves
          if isinstance(lp.source, jax.Array) and
          getattr(lp.entry, "relpath", None) in layouts}


class Unstaged:
  """The unstaged links of one save on one process (a disk); ``reuse`` is
  its ckpt/save/reuse.py ``SaveReuse``."""

  def __init__(self, reuse: Any):
    self.reuse = reuse

  def same_object(self, leaf: int) -> bool:
    """Whether the array of ``leaf`` is the very jax.Array object that the
    save of the step linked from stored (alive, not deleted or donated)."""
    r = self.reuse
    if r.previous is None:
      return False
    relpath = r.relpaths[leaf]
    then = r.previous.objects.get(relpath)
    now = r.generation.objects.get(relpath)
    obj = None if now is None else now()
    return (obj is not None and then is not None and then() is obj and
            not obj.is_deleted())

  def link_box(self, leaf: int, box: plan_lib.Box, chunks: tuple[int, ...],
               itemsize: int) -> list[Outcome] | None:
    """Blocking: links every chunk of ``box`` from the previous step, each
    checked like any link; None (and nothing linked) if one cannot be."""
    r = self.reuse
    relpath, root = r.relpaths[leaf], os.fspath(r.storage.root)
    src, todo = r.source(), []
    for b in plan_lib.chunk_boxes(box, chunks):
      rec = r.record(r.previous, relpath, b)
      index = [a // c for a, c in zip(b.start, chunks)]
      where = src.where(relpath, index)
      if (rec is None or rec.nbytes != b.size * itemsize or
          not r.other_copy(relpath, where, index)):
        return None
      ok, *seen = src.check(where, rec)
      if not ok:
        r.found_damaged(where)
        return None
      todo.append((b, rec, seen, where, os.path.join(
          root, r.work_dir, relpath, tsspec.chunk_key(r.format, index))))
    made = []
    try:
      for _, _, _, where, target in todo:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.link(os.path.join(root, where), target)
        made.append(target)
    except OSError:  # gone, or no links here: staged and written instead
      for t in made:
        os.unlink(t)
      return None
    return [Outcome(b, rec.digest, rec.crc, True, rec.stamp, *seen)
            for b, rec, seen, _, _ in todo]

  def linked(self, leaf: int, outcomes: list[Outcome], itemsize: int,
             take_sums: bool) -> tuple[list[tuple[plan_lib.Box, int]], int]:
    """Records the chunks ``link_box`` linked; (their crc32c records if
    ``take_sums``, the bytes linked)."""
    r = self.reuse
    r.keep(r.relpaths[leaf], outcomes, itemsize)
    n = sum(o.box.size for o in outcomes) * itemsize
    r.bytes_reused += n
    r.chunks_reused += len(outcomes)
    return ([(o.box, o.crc) for o in outcomes] if take_sums else []), n
