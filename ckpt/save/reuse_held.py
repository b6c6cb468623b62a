"""Reuse on a bucket: leaves held by an earlier step (index version 6).

A bucket has no links. With ``reuse_unchanged=True`` there, a stored leaf
whose every chunk, on every process, is unchanged since the previous step
this Checkpointer committed is not written: the new step's index records
``held_by: [step, "attempt-<hex>"]``, the step whose data directory holds
the array (the previous step's own, or the one the previous step was held
by: a reference never chains). Restore and ``ckpt verify`` read it there
and check its chunks' crc32c like any other (the records are carried into
the new step's ``.checksums``; "zarr3" chunks carry their own).

The unit is the leaf, so a reader opens one array per leaf, as always:
each process holds back the boxes it found unchanged (``Held.defer``), the
processes agree (one round, ``settle``) on the leaves that nobody wrote a
box of, and each then writes the boxes it held back of every other leaf.

Deletion never removes what a kept step holds: ckpt/commit/held.py marks
from the indexes of the committed steps and of the saves in flight. The
save closes the race with a deletion of the step it refers to: process 0
checks, after its commit, that the previous step is still committed with
the attempt it refers to (``check_committed``). Still committed then, any
deletion of it begins after this commit and marks from this index; gone,
the new step is deleted again and the save fails (saving again writes
every leaf in full).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import msgpack

from ckpt.commit import attempt
from ckpt.commit import deletion
from ckpt.commit import steps as steps_lib
from ckpt.errors import CheckpointError
from ckpt.format import entries
from ckpt.format import index as index_lib
from ckpt.multihost import process as multihost
from ckpt.store import tsfuture


class Held:
  """The boxes one process held back in one save, and the outcome."""

  def __init__(self, previous: Any, token: str, cap: int | None):
    self.previous = previous       # the reuse.Generation compared with
    self.own = f"{attempt.ATTEMPT_PREFIX}{token}"
    # Staged copies held back (async saves): at most ``cap`` bytes, the
    # save's host-memory budget, beyond the boxes in flight; None: the
    # boxes are the caller's own arrays (a sync save), nothing is copied.
    self.cap, self._held_bytes = cap, 0
    self.lost = False              # the previous step is not ours any more
    self._deferred: dict[int, list] = {}   # leaf -> [(store, box, data)]
    self._written: set[int] = set()        # leaves this process wrote to
    self.reused: dict[str, tuple[int, str]] = {}  # relpath -> held_by

  def defer(self, leaf: int, store: Any, box: Any, data: Any,
            chunks: int) -> bool:
    """Holds back an unchanged box; False (write it now) past ``cap``."""
    if self.cap is not None and self._held_bytes + data.nbytes > self.cap:
      return False
    self._held_bytes += data.nbytes
    self._deferred.setdefault(leaf, []).append((store, box, data, chunks))
    return True

  def written(self, leaf: int) -> None:
    self._written.add(leaf)

  def _post(self, failed: bool) -> bytes:
    return msgpack.packb({"lost": failed or self.lost,
                          "reuse": sorted(self._deferred),
                          "veto": sorted(self._written)})

  async def settle(self, reuse: Any, key: str, timeout_s: float,
                   failed: bool, stats: Any) -> None:
    """Every process, after its boxes are written (or it failed): agrees
    on the leaves held by the previous step, then writes the boxes it held
    back of the others. ``reuse``: its SaveReuse; ``stats`` its SaveStats."""
    def decide(posts: dict[int, str]) -> str:
      reuse_, veto, lost = set(), set(), False
      for p in posts.values():
        doc = msgpack.unpackb(bytes.fromhex(p))
        lost = lost or doc["lost"]
        reuse_.update(doc["reuse"])
        veto.update(doc["veto"])
      return msgpack.packb([] if lost else sorted(reuse_ - veto)).hex()

    agreed = set(msgpack.unpackb(bytes.fromhex(await asyncio.to_thread(
        multihost.agree, key, self._post(failed).hex(), decide,
        timeout_s=timeout_s, what="the leaves reused (reuse_unchanged)"))))
    if failed:
      return
    for leaf, boxes in self._deferred.items():
      if leaf in agreed:
        continue
      for store, box, data, chunks in boxes:  # written after all
        await tsfuture.wait(store[box.slices()].write(
            data, can_reference_source_data_indefinitely=True))
        await reuse.written_after_all(leaf, box, data.itemsize)
        stats.bytes_written += data.nbytes
        stats.bytes_reused -= data.nbytes
        stats.boxes_written += 1
        reuse.bytes_reused -= data.nbytes
        reuse.chunks_reused -= chunks
    self._deferred.clear()
    self._held_bytes = 0
    prev = reuse.previous
    holders = reuse.generation.holders
    for leaf, relpath in enumerate(reuse.relpaths):
      if relpath not in reuse.layouts:
        continue
      if leaf in agreed:
        holders[relpath] = self.reused[relpath] = prev.holders[relpath]
      else:
        holders[relpath] = (reuse.generation.step, self.own)

  def apply(self, index: index_lib.Index) -> index_lib.Index:
    """Process 0: ``index`` with the agreed leaves held by their step."""
    if not self.reused:
      return index
    leaves = tuple(
        dataclasses.replace(e, held_by=self.reused[e.relpath])
        if isinstance(e, entries.ArrayEntry) and e.relpath in self.reused
        else e for e in index.leaves)
    return dataclasses.replace(index, leaves=leaves)

  def check_committed(self, storage: Any, step: int) -> None:
    """Process 0, once ``step`` is committed: raises (having deleted
    ``step`` again) if the previous step, which its held leaves were
    found through, is no longer committed by the attempt compared with."""
    if not self.reused:
      return
    prev = self.previous
    if steps_lib.committed_attempt(storage, prev.step) == prev.token:
      return
    deletion.remove_step(storage, step)
    raise CheckpointError(
        f"step {prev.step}, whose unchanged leaves step {step} refers to "
        "(reuse_unchanged=True on a bucket), was deleted or replaced while "
        f"step {step} was committed: step {step} was removed again; save "
        "again (it writes those leaves in full)")

