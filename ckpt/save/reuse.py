"""Unchanged chunks are linked, not written (``Checkpointer(reuse_unchanged=True)``).

Fine-tuning with frozen towers, LoRA, many RL and distillation setups save
a state whose bytes mostly never change. With reuse on, each process keeps
in memory what it stored in the two newest steps this Checkpointer
committed (``Generation``, ckpt/save/reuse_source.py: per stored chunk its
128-bit xxh3 hash, its crc32c record and its stamp). A chunk is *unchanged*
when the same leaf (relative path) has the same format, shape, dtype, chunk
shape and codec, the chunk is the same box, and its bytes have the same
crc32c and the same 128-bit hash (the 32-bit crc32c alone could collide;
each chunk is read once in the steady state: a frozen chunk is hashed, a
changing one only checksummed, see ``SaveReuse.sort``). An unchanged
chunk's file is hard-linked (``os.link``) from that step's directory into
the new attempt, once the file is found still what was stored (its stamp);
its crc32c record is carried over, so ``verify`` checks it like any other.

Why keep=N keeps two copies: a save links only from the step before the
newest, and only where that step's file is another inode than the newest
step's (on a bucket: another holder), else it writes the chunk: every two
consecutive steps hold two physical copies (``Reuser(copies=1)``, with
``keep=1``, links from the newest step). Anything else is written in full:
another layout, a step of another Checkpointer or run, a failed or
uncommitted save, a step deleted or replaced since.

Why every step stays whole: a hard link is the same file under a second
name; removing, moving or copying one step's directory leaves the other's
name in place. Only chunk files are linked (each array's metadata is
written per step), and TensorStore never rewrites a file in place, so a
later step can never change an earlier one's bytes.

Why a link never names the wrong bytes: the source is this Checkpointer's
own step, recognised by its attempt token, read before the first link and
again after the last (``check_source``); a step deleted meanwhile only makes
its links fail (the chunk is then written), a step replaced meanwhile
fails the save. Paths come from the save's own plan, never a checkpoint.

Where it applies: formats "zarr" and "zarr3"; on a bucket (no links) a
whole unchanged leaf is held by reference instead (reuse_held.py); "ocdbt"
and packed small leaves are written in full (docs/format.md, "Reusing
unchanged chunks"). Each process writes ``<step dir>/.reuse/<process>.msgpack``
(index.process_file): ``[leaf, start, stop, xxh3-128 or nil, crc32c, stamp
or nil]`` of every chunk it stored, the step it linked from, and its bytes
written and reused (``ckpt inspect`` sums them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any, Callable

from absl import logging
import numpy as np

from ckpt.commit import steps as steps_lib
from ckpt.errors import CheckpointError
from ckpt.format import tsspec
from ckpt.format.crc import checksum_view, digest
from ckpt.multihost import process as multihost
from ckpt.save import reuse_held
from ckpt.save import reuse_records
from ckpt.save import reuse_source
from ckpt.save import reuse_unstaged
from ckpt.save.reuse_source import Generation, Outcome, Stored
from ckpt.save.write import INLINE_WORK_BYTES
from ckpt.shards import plan as plan_lib
from ckpt.store import tsfuture

# The formats whose chunks are files of their own (so a link reuses one).
LINKED_FORMATS = ("zarr", "zarr3")


def layout_of(storage_format: str, entry: Any, checksum: str) -> tuple:
  """Everything besides the bytes that makes a stored chunk file what it
  is: the same bytes under another layout are another file. (The checksum
  codec is ``checksum``, whether or not ``entry`` names it yet.)"""
  codec = tuple(sorted((k, repr(v)) for k, v in entry.codec.items()
                       if k != "checksum"))
  return (storage_format, tuple(entry.shape), str(entry.dtype),
          tuple(entry.chunks), codec, checksum)


class SaveReuse:
  """The reuse of one save on one process (see the module docstring).

  Call sequence, on the save's event loop: ``check_source`` (in a thread)
  before the first box; ``write`` for each box (instead of a plain write);
  ``check_source`` again once every box is written; ``record_file`` for the
  process's ``.reuse`` file; once the step is committed everywhere, the
  owner (``Reuser``) keeps ``generation`` for the next save.

  ``previous``: the step linked (held) from; ``last``: the newest step
  this job committed (the same one with ``copies=1``). With ``copies=2`` a
  chunk is linked only from ``previous`` (the step before the newest) and
  only where the newest step's chunk is another physical copy (another
  inode; on a bucket, another holder): so any two consecutive steps hold
  two copies of every chunk."""

  def __init__(self, previous: Generation | None, storage: Any,
               plan: Any, step: int, token: str, work_dir: str,
               last: Generation | None = None):
    fmt = plan.options.storage_format
    checksum = plan.options.codec.resolved_checksum(fmt)
    self.storage = storage
    self.format = fmt
    self.previous = previous
    self.last = last if last is not None else previous
    self.work_dir = work_dir
    self.layouts = {lp.entry.relpath: layout_of(fmt, lp.entry, checksum)
                    for lp in plan.leaves
                    if lp.layout is not None and not lp.packed}
    self.relpaths = [getattr(lp.entry, "relpath", None) for lp in plan.leaves]
    self.chunk_shapes = [None if lp.layout is None else tuple(lp.layout.chunks)
                         for lp in plan.leaves]
    self.generation = Generation(step, token, dict(self.layouts), {}, {},
                                 reuse_unstaged.objects(plan, self.layouts))
    # A disk: boxes of the very arrays the previous step stored, linked
    # without staging or hashing (reuse_unstaged.py).
    self.unstaged = (reuse_unstaged.Unstaged(self)
                     if storage.is_posix else None)
    self.bytes_reused = 0
    self.chunks_reused = 0
    self.damaged: list[str] = []  # stored chunks found not as recorded
    # A bucket (no links): whole boxes found unchanged wait here, and the
    # save's agreement (reuse_held.settle) says which leaves are held by
    # the previous step and which are written after all.
    self.held = None if storage.is_posix else reuse_held.Held(
        previous, token, None if plan.borrow else plan.options.max_item_bytes)

  def source(self) -> reuse_source.Source | None:
    if self.previous is None:
      return None
    return reuse_source.Source(self.previous, self.storage, self.format)

  def check_source(self) -> None:
    """Blocking: drops the previous step as a source if it is not the step
    this Checkpointer committed any more (before the first link); raises if
    it was replaced by another attempt while this save linked from it."""
    if self.previous is None:
      return
    linked = self.bytes_reused or self.chunks_reused
    try:
      token = steps_lib.committed_attempt(self.storage, self.previous.step)
    except CheckpointError:
      if linked:
        raise
      token = None  # unreadable: nothing is linked from it
    if token == self.previous.token:
      return
    if self.held is not None and linked:  # a bucket: nothing refers to it
      self.held.lost = True  # yet; settle writes what was held back
      return
    if linked:
      if token is not None:
        raise CheckpointError(
            f"step {self.previous.step}, whose unchanged chunks this save "
            f"of step {self.generation.step} linked (reuse_unchanged=True), "
            f"was replaced by another save (attempt {token}, not "
            f"{self.previous.token}) while it was read: nothing was "
            "committed; save again (it writes those chunks in full)")
      return  # deleted meanwhile: the links made before are its bytes
    self.previous = None  # not ours: write everything

  def record(self, gen: Generation | None, relpath: str,
              box: plan_lib.Box) -> Stored | None:
    """What this process stored for the same chunk of the same leaf, in
    the same layout, in step ``gen`` (None: nothing to compare)."""
    if gen is None or gen.layouts.get(relpath) != self.layouts[relpath]:
      return None
    if self.held is not None and gen.holders.get(
        relpath, (self.generation.step,))[0] >= self.generation.step:
      return None  # a bucket refers only to an earlier step's data
    return gen.chunks.get((relpath, box.start, box.stop))

  def other_copy(self, relpath: str, src: str, index) -> bool:
    """Whether the chunk at ``src`` (of ``previous``) is another physical
    copy than the newest step's same chunk: another inode on a disk,
    another holder on a bucket."""
    if self.last is self.previous:
      return True
    if self.held is not None:
      return (self.previous.holders.get(relpath) !=
              self.last.holders.get(relpath))
    newest = reuse_source.Source(self.last, self.storage,
                                 self.format).where(relpath, index)
    root = os.fspath(self.storage.root)
    try:
      return not os.path.samefile(os.path.join(root, src),
                                  os.path.join(root, newest))
    except OSError:  # the newest step has no such file: it is another
      return True

  def found_damaged(self, src: str) -> None:
    self.damaged.append(src)
    if len(self.damaged) == 1:
      logging.warning(
          "ckpt: %s/%s is not what step %d stored there (its %s differs or "
          "it is gone): not reused by step %d, written again; check step %d "
          "with `ckpt verify`", self.storage.url.rstrip("/"), src,
          self.previous.step, "crc32c" if self.held is None else
          "generation", self.generation.step, self.previous.step)

  def _link(self, relpath: str, box: plan_lib.Box, chunks: tuple[int, ...],
            rec: Stored) -> tuple[bool, tuple | None, int]:
    """Links (a bucket: may hold) the chunk ``box`` from ``previous``,
    whose record is ``rec``, if it is another copy than the newest step's
    and, on a disk, still what was recorded (``Source.check``); (linked,
    the file's ``seen`` and ``unread`` to record)."""
    index = [a // c for a, c in zip(box.start, chunks)]
    src = self.source().where(relpath, index)
    if not self.other_copy(relpath, src, index):
      return False, None, 0  # a fresh copy: two consecutive steps, two copies
    if self.held is not None:  # a bucket: checked, then held back
      return rec.stamp is not None, None, 0
    ok, seen, unread = self.source().check(src, rec)
    if not ok:
      self.found_damaged(src)
      return False, None, 0
    name = tsspec.chunk_key(self.format, index)
    target = os.path.join(os.fspath(self.storage.root), self.work_dir,
                          relpath, name)
    try:
      os.makedirs(os.path.dirname(target), exist_ok=True)
      os.link(os.path.join(os.fspath(self.storage.root), src), target)
    except OSError:  # gone (deleted), or a link not allowed: written
      return False, None, 0
    return True, seen, unread

  async def _held_intact(self, relpath: str,
                         outcomes: list[Outcome], chunks) -> bool:
    """A bucket: whether every chunk object that ``outcomes`` would hold
    is still the one recorded (one request each, without a body)."""
    src = self.source()
    wheres = [src.where(relpath, [a // c for a, c in zip(o.box.start, chunks)])
              for o in outcomes]
    meta = src.metadata(relpath)  # its array's metadata: still there?
    seen = await asyncio.gather(*(asyncio.to_thread(
        reuse_source.stamp_of, self.storage, w) for w in [*wheres, meta]))
    for w, want, s in zip([*wheres, meta],
                          [o.stamp for o in outcomes] + [seen[-1]], seen):
      if s is None or s != want:
        self.found_damaged(w)
        return False
    return True

  def _expects_unchanged(self, leaf: int, box: plan_lib.Box,
                         chunks: tuple[int, ...]) -> bool:
    """Whether a chunk of ``box`` was hashed at an earlier save (it was
    unchanged or new then): the box is then sorted before it is written;
    else (a box that changed) it is written at once, as without reuse, and
    summed while it is written (no pass over its bytes more)."""
    relpath = self.relpaths[leaf]
    for b in plan_lib.chunk_boxes(box, chunks):
      for gen in (self.previous, self.last):
        old = self.record(gen, relpath, b)
        if old is not None and old.digest is not None:
          return True
    return False

  def sort(self, leaf: int, box: plan_lib.Box, chunks: tuple[int, ...],
           data: np.ndarray, link: bool = True,
           sums: dict[plan_lib.Box, int] | None = None) -> list[Outcome]:
    """Blocking: sorts the stored chunks of ``box`` (its data ``data``)
    into unchanged ones, linked here, and the others, reading each chunk
    once where its history says what to expect:

    - it was unchanged (or new) at an earlier save, so it has a 128-bit
      hash: hashed first; equal to the previous step's, it is linked (if
      that copy is intact and another than the newest step's) and its
      crc32c record carried over; else its crc32c is taken (one more pass)
      and it is written;
    - it changed at the earlier saves (no hash kept): its crc32c is taken
      first (its record for verify, taken at every save anyway); a
      different one means changed, not hashed: dense training pays no
      hash; an equal one is hashed, for the next save to compare with;
    - nothing to compare with (the first save, a new layout): both.

    Only a chunk that was hashed and matched is linked: identity is the
    128-bit hash, never the 32-bit crc32c alone. Without ``link`` (the box
    is being written already) nothing is linked; ``sums`` are the chunks'
    crc32c where the box was written already as raw chunks (summed as they
    were written: no pass more)."""
    relpath = self.relpaths[leaf]
    out = []
    for b in plan_lib.chunk_boxes(box, chunks):
      view = data if b == box else data[b.relative_to(box)]
      src = self.record(self.previous, relpath, b)
      if src is not None and src.nbytes != view.nbytes:
        src = None
      newest = self.record(self.last, relpath, b)
      olds = [o for o in (src, newest)
              if o is not None and o.nbytes == view.nbytes]
      hashed = {o.digest for o in olds if o.digest is not None}
      if link and hashed:
        d = digest(view)
        linked, seen, unread = (
            (False, None, 0) if src is None or d != src.digest
            else self._link(relpath, b, chunks, src))
        if linked:
          out.append(Outcome(b, d, src.crc, True, src.stamp, seen, unread))
        else:  # written: as a copy (unchanged), or changed (compared
          crc = checksum_view(view)  # by its crc32c next time)
          same = d in hashed or any(o.crc == crc for o in olds)
          out.append(Outcome(b, d if same else None, crc, False))
        continue
      crc = checksum_view(view) if sums is None else sums[b]
      if olds and all(o.crc != crc for o in olds):
        out.append(Outcome(b, None, crc, False))  # changed, not hashed
      else:
        out.append(Outcome(b, digest(view), crc, False))
    return out

  async def _stamp(self, relpath: str, outcomes: list[Outcome],
                   chunks: tuple[int, ...]) -> list[Outcome]:
    """The stamps of the chunks just written that a later save may link
    (those hashed): read back once (ckpt/save/reuse_source.py)."""
    todo = [i for i, o in enumerate(outcomes)
            if not o.linked and o.digest is not None]
    if not todo:
      return outcomes

    def where(o):
      name = tsspec.chunk_key(self.format,
                              [a // c for a, c in zip(o.box.start, chunks)])
      return f"{self.work_dir}/{relpath}/{name}"

    def stamps():
      if self.storage.is_posix:  # the stamp and the stat of that read
        root = os.fspath(self.storage.root)
        return [reuse_source.file_stamp_seen(
            os.path.join(root, where(outcomes[i]))) for i in todo]
      return [(reuse_source.stamp_of(self.storage, where(outcomes[i])), None)
              for i in todo]

    got = await asyncio.to_thread(stamps)
    out = list(outcomes)
    for i, (s, seen) in zip(todo, got):
      out[i] = dataclasses.replace(out[i], stamp=s, seen=seen,
                                   unread=reuse_source.first_turn(
                                       (relpath, out[i].box.start)))
    return out

  def keep(self, relpath: str, outcomes: list[Outcome], itemsize: int) -> None:
    """Records ``outcomes`` in this save's generation."""
    for o in outcomes:
      self.generation.chunks[(relpath, o.box.start, o.box.stop)] = Stored(
          o.digest, o.crc, o.box.size * itemsize, o.stamp, o.seen, o.unread)

  async def write_box(self, store: Any, leaf: int, box: plan_lib.Box,
                  chunks: tuple[int, ...], data: np.ndarray,
                  take_sums: bool, raw: Callable[[], Any] | None = None
                  ) -> tuple[list[tuple[plan_lib.Box, int]], int]:
    """Writes the changed chunks of one box into ``store`` (the leaf's
    array in the attempt) and links the others. Returns the crc32c records
    of every chunk (format "zarr", else empty) and the bytes linked.
    ``raw()`` starts writing the whole box as raw chunk files
    (durable.Syncer.write_raw: the future of its chunks' crc32c) or returns
    None where TensorStore writes it."""
    link = self._expects_unchanged(leaf, box, chunks)
    relpath = self.relpaths[leaf]
    writes, sums, wrote_raw = [], None, False
    if not link:  # as without reuse: written at once, summed alongside
      job = raw() if raw is not None else None
      if job:  # summed while written: sorting takes no pass more
        sums, wrote_raw = dict(await asyncio.wrap_future(job)), True
      else:
        writes.append(store[box.slices()].write(
            data, can_reference_source_data_indefinitely=True))
    if data.nbytes <= INLINE_WORK_BYTES and (
        self.held is not None or not link):  # no file read
      outcomes = self.sort(leaf, box, chunks, data, link, sums)
    else:  # a disk reads the files it links
      outcomes = await asyncio.to_thread(self.sort, leaf, box, chunks, data,
                                         link, sums)
    if link and self.held is not None and not (
        all(o.linked for o in outcomes) and
        await self._held_intact(relpath, outcomes, chunks)):
      outcomes = [dataclasses.replace(o, linked=False, stamp=None,
                                      seen=None)
                  for o in outcomes]  # a bucket holds whole leaves only
    if link:
      fresh = [o.box for o in outcomes if not o.linked]
      if len(fresh) == len(outcomes):
        fresh = [box]  # nothing linked: one write, as without reuse
      elif self.held is not None:  # all unchanged: held back, or
        if self.held.defer(leaf, store, box, data, len(outcomes)):
          fresh = []
        else:  # past the memory budget: written now (its leaf is written)
          outcomes = [dataclasses.replace(o, linked=False, stamp=None,
                                          seen=None)
                      for o in outcomes]
          fresh = [box]
      job = fresh == [box] and raw is not None and raw()
      if job:  # the whole box changed: raw chunk files, as without reuse
        await asyncio.wrap_future(job)
        fresh, wrote_raw = [], True
      writes = [store[b.slices()].write(
          data if b == box else data[b.relative_to(box)],
          can_reference_source_data_indefinitely=True) for b in fresh]
    if (writes or wrote_raw) and self.held is not None:
      self.held.written(leaf)
    for w in writes:
      await tsfuture.wait(w)
    outcomes = await self._stamp(relpath, outcomes, chunks)
    self.keep(relpath, outcomes, data.itemsize)
    linked = sum(o.box.size * data.itemsize for o in outcomes if o.linked)
    self.bytes_reused += linked
    self.chunks_reused += sum(o.linked for o in outcomes)
    sums = [(o.box, o.crc) for o in outcomes] if take_sums else []
    return sums, linked

  async def written_after_all(self, leaf: int, box: plan_lib.Box,
                              itemsize: int) -> None:
    """A bucket: a box held back, then written (its leaf is this step's
    own after all): its chunks' stamps are this step's objects'."""
    relpath, chunks = self.relpaths[leaf], self.chunk_shapes[leaf]
    outcomes = [Outcome(b, old.digest, old.crc, False)
                for b in plan_lib.chunk_boxes(box, chunks)
                if (old := self.generation.chunks.get(
                    (relpath, b.start, b.stop))) is not None]
    self.keep(relpath, await self._stamp(relpath, outcomes, chunks), itemsize)

  async def settle(self, key: str, timeout_s: float, failed: bool,
                   stats: Any) -> None:
    """A bucket's agreement on the leaves held by the previous step, on
    every process once it stopped writing (``failed``: with an error);
    nothing on a disk (reuse_held.py)."""
    if self.held is not None:
      await self.held.settle(self, key, timeout_s, failed, stats)
      self.chunks_reused = max(self.chunks_reused, 0)

  def record_file(self, process: int, bytes_written: int) -> bytes:
    """This process's ``.reuse`` file (msgpack, sealed by the caller)."""
    return reuse_records.encode(
        process, self.relpaths, self.generation,
        None if self.previous is None else self.previous.step,
        bytes_written, self.bytes_reused)


class Reuser:
  """The part of a Checkpointer that owns reuse: whether it is on where it
  is saving, and the ``Generation`` of its newest committed saves.

  ``copies``: 2 (unless the Checkpointer keeps one step): a save links
  (holds) only from the step before the newest, and only a copy other than
  the newest step's (SaveReuse), so that every two consecutive steps hold
  two physical copies of every chunk; 1: from the newest step."""

  def __init__(self, enabled: bool, storage: Any, storage_format: str,
               copies: int = 2):
    self.why_not = None
    if enabled and storage_format not in LINKED_FORMATS:
      self.why_not = (f"format {storage_format!r} keeps chunks inside shared "
                      "data files")
    if self.why_not:  # once per Checkpointer
      logging.info("ckpt: reuse_unchanged=True writes every chunk in %s: %s",
                   storage.url, self.why_not)
    self.enabled = bool(enabled) and self.why_not is None
    self.copies = copies
    self._storage = storage
    self._last: Generation | None = None    # the newest committed save's
    self._before: Generation | None = None  # the one before it
    self._loaded = False  # from the checkpoint's records (a restart)

  def begin(self, plan: Any, step: int, token: str, work_dir: str,
            process: int | None = None,
            count: int | None = None) -> SaveReuse | None:
    """Blocking: the reuse of the save of ``step`` into ``work_dir`` (None:
    off). The first one starts from this process's records (``process`` of
    ``count``; None: jax's) of the newest committed steps (reuse_records)."""
    if not self.enabled:
      return None
    if not self._loaded:
      self._loaded = True
      gens = reuse_records.load(
          self._storage, plan.options.storage_format, layout_of,
          multihost.process_index() if process is None else process,
          multihost.process_count() if count is None else count, self.copies)
      if gens and gens[-1] is not None:  # else nothing known of the newest
        self._last = gens[-1]
        self._before = gens[0] if len(gens) == 2 else None
    source = self._last if self.copies == 1 else self._before
    return SaveReuse(source, self._storage, plan, step, token, work_dir,
                     last=self._last)

  def committed(self, reuse: SaveReuse | None) -> None:
    """The save ``reuse`` belonged to is committed on every process: the
    next save compares with it."""
    if reuse is not None:
      self._before, self._last = self._last, reuse.generation
