"""Unchanged chunks are linked, not written (``Checkpointer(reuse_unchanged=True)``).

Fine-tuning with frozen towers, LoRA, many RL and distillation setups save
a state whose bytes mostly never change. With reuse on, each process keeps,
in memory, what it stored in the newest step this Checkpointer committed
(``Generation``: per stored chunk its 128-bit xxh3 hash and its crc32c
record). A chunk of the next save is *unchanged* when the same leaf (its
relative path) has the same format, shape, dtype, chunk shape and codec,
the chunk is the same box, and its stored bytes have the same crc32c and
the same 128-bit hash (each chunk is read once in the steady state: a
frozen chunk is hashed, a changing one only checksummed, as at every save;
see ``SaveReuse.sort``; the 32-bit crc32c alone could collide). An unchanged
chunk's file is hard-linked (``os.link``) from that step's directory into
the new attempt instead of being written; its crc32c record is carried over
into the new step's checksum file, so ``verify`` checks it like any other.
Anything else is written in full: another layout, a step of another
Checkpointer or run, a failed or uncommitted save, a step deleted or
replaced since.

Why every step stays whole: a hard link is the same file under a second
name; removing, moving or copying one step's directory leaves the other's
name, and so its bytes, in place. Only chunk files are linked: each array's
metadata (``.zarray`` / ``zarr.json``) is written per step as before, and
TensorStore never rewrites a file in place (it writes a new one and renames
it), so a later step can never change an earlier one's bytes.

Why a link never names the wrong bytes: the source is this Checkpointer's
own step, recognised by its attempt token. The token is read before the
first link and again after the last (``check_source``); a step deleted
meanwhile only makes its links fail (the chunk is then written), a step
replaced meanwhile by another attempt (another job on the root, a rollback)
fails the save, and nothing is committed. Paths are built from the save's
own plan and step numbers, never read from a checkpoint.

Where it applies: formats "zarr" and "zarr3"; on a bucket (no links) a
whole unchanged leaf is held by reference instead (ckpt/save/reuse_held.py).
With format "ocdbt" (chunks live inside shared data files) and for packed
small leaves everything is written in full; see docs/format.md, "Reusing
unchanged chunks".

Each process writes ``<step dir>/.reuse/<process>.msgpack``
(index.process_file): ``[leaf, start, stop, xxh3-128 or nil]`` of every
chunk it stored, the step it linked from, and its bytes written and reused
(``ckpt inspect`` sums them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any

from absl import logging
import msgpack
import numpy as np

from ckpt.commit import steps as steps_lib
from ckpt.errors import CheckpointError
from ckpt.format import index as index_lib
from ckpt.format import tsspec
from ckpt.format.crc import checksum_view, digest
from ckpt.save import reuse_held
from ckpt.save.write import INLINE_WORK_BYTES
from ckpt.shards import plan as plan_lib
from ckpt.store import storage as storage_lib
from ckpt.store import tsfuture

HASH_NAME = "xxh3_128"
# The formats whose chunks are files of their own (so a link reuses one).
LINKED_FORMATS = ("zarr", "zarr3")


@dataclasses.dataclass(frozen=True)
class Stored:
  """One chunk a process stored in a step."""
  digest: bytes | None  # xxh3-128 of its stored bytes (after the save_dtype
                        # cast); None: it changed (compared by crc32c first)
  crc: int              # crc32c of the same bytes (carried when reused)
  nbytes: int


@dataclasses.dataclass
class Generation:
  """What this process stored in one step: the next save compares with it
  once the step is committed."""
  step: int
  token: str
  layouts: dict[str, tuple]                      # relpath -> layout
  chunks: dict[tuple[str, tuple, tuple], Stored]  # (relpath, start, stop)
  # A bucket's: relpath -> (step, "attempt-<hex>") whose data directory
  # holds the array (its own, or the one it was held by).
  holders: dict[str, tuple[int, str]] = dataclasses.field(
      default_factory=dict)


def layout_of(storage_format: str, entry: Any, checksum: str) -> tuple:
  """Everything besides the bytes that makes a stored chunk file what it
  is: the same bytes under another layout are another file."""
  codec = tuple(sorted((k, repr(v)) for k, v in entry.codec.items()))
  return (storage_format, tuple(entry.shape), str(entry.dtype),
          tuple(entry.chunks), codec, checksum)


@dataclasses.dataclass
class Outcome:
  """One chunk of a box in this save."""
  box: plan_lib.Box
  digest: bytes | None
  crc: int
  linked: bool


class SaveReuse:
  """The reuse of one save on one process (see the module docstring).

  Call sequence, on the save's event loop: ``check_source`` (in a thread)
  before the first box; ``write`` for each box (instead of a plain write);
  ``check_source`` again once every box is written; ``record_file`` for the
  process's ``.reuse`` file; once the step is committed everywhere, the
  owner (``Reuser``) keeps ``generation`` for the next save."""

  def __init__(self, previous: Generation | None, storage: Any,
               plan: Any, step: int, token: str, work_dir: str):
    fmt = plan.options.storage_format
    checksum = plan.options.codec.resolved_checksum(fmt)
    self.storage = storage
    self.format = fmt
    self.previous = previous
    self.work = self.source = None  # POSIX: where links go, and from
    if storage.is_posix:
      self.work = os.path.join(os.fspath(storage.root), work_dir)
      self.source = (None if previous is None else os.path.join(
          os.fspath(storage.root), storage_lib.step_dirname(previous.step)))
    self.layouts = {lp.entry.relpath: layout_of(fmt, lp.entry, checksum)
                    for lp in plan.leaves
                    if lp.layout is not None and not lp.packed}
    self.relpaths = [getattr(lp.entry, "relpath", None) for lp in plan.leaves]
    self.generation = Generation(step, token, dict(self.layouts), {})
    self.bytes_reused = 0
    self.chunks_reused = 0
    self._records: list[list] = []
    # A bucket (no links): whole boxes found unchanged wait here, and the
    # save's agreement (reuse_held.settle) says which leaves are held by
    # the previous step and which are written after all.
    self.held = None if storage.is_posix else reuse_held.Held(
        previous, token, None if plan.borrow else plan.options.max_item_bytes)

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
    self.previous = self.source = None  # not ours: write everything

  def _previous(self, relpath: str, box: plan_lib.Box) -> Stored | None:
    """What this process stored for the same chunk of the same leaf, in
    the same layout, in the previous step (None: nothing to compare)."""
    prev = self.previous
    if prev is None or prev.layouts.get(relpath) != self.layouts[relpath]:
      return None
    if self.held is not None and prev.holders.get(
        relpath, (self.generation.step,))[0] >= self.generation.step:
      return None  # a bucket refers only to an earlier step's data
    return prev.chunks.get((relpath, box.start, box.stop))

  def _link(self, relpath: str, box: plan_lib.Box,
            chunks: tuple[int, ...]) -> bool:
    if self.held is not None:  # a bucket: held back (reuse_held.settle)
      return True
    name = tsspec.chunk_key(self.format,
                            [a // c for a, c in zip(box.start, chunks)])
    target = os.path.join(self.work, relpath, name)
    try:
      os.makedirs(os.path.dirname(target), exist_ok=True)
      os.link(os.path.join(self.source, relpath, name), target)
    except OSError:  # gone (deleted), or a link not allowed: written
      return False
    return True

  def _expects_unchanged(self, leaf: int, box: plan_lib.Box,
                         chunks: tuple[int, ...]) -> bool:
    """Whether a chunk of ``box`` was hashed at the previous save (it was
    unchanged or new then): the box is then sorted before it is written;
    else (a box that changed) it is written at once, as without reuse, and
    summed while it is written (no pass over its bytes more)."""
    relpath = self.relpaths[leaf]
    for b in plan_lib.chunk_boxes(box, chunks):
      old = self._previous(relpath, b)
      if old is not None and old.digest is not None:
        return True
    return False

  def sort(self, leaf: int, box: plan_lib.Box, chunks: tuple[int, ...],
           data: np.ndarray, link: bool = True) -> list[Outcome]:
    """Blocking: sorts the stored chunks of ``box`` (its data ``data``)
    into unchanged ones, linked here, and the others, reading each chunk
    once where its history says what to expect:

    - it was unchanged (or new) at the previous save, so it has a 128-bit
      hash: hashed first; equal, it is linked and its crc32c record carried
      over; else its crc32c is taken (one more pass) and it is written;
    - it changed at the previous save (no hash kept): its crc32c is taken
      first (its record for verify, taken at every save anyway); a
      different one means changed, not hashed: dense training pays no
      hash; an equal one is hashed, for the next save to compare with;
    - nothing to compare with (the first save, a new layout): both.

    Only a chunk that was hashed and matched is linked: identity is the
    128-bit hash, never the 32-bit crc32c alone. Without ``link`` (the box
    is being written already) nothing is linked."""
    relpath = self.relpaths[leaf]
    out = []
    for b in plan_lib.chunk_boxes(box, chunks):
      view = data if b == box else data[b.relative_to(box)]
      old = self._previous(relpath, b)
      if old is not None and old.nbytes != view.nbytes:
        old = None
      if link and old is not None and old.digest is not None:
        d = digest(view)
        if d == old.digest and self._link(relpath, b, chunks):
          out.append(Outcome(b, d, old.crc, True))
        else:  # changed: compared by its crc32c next time
          out.append(Outcome(b, None, checksum_view(view), False))
        continue
      crc = checksum_view(view)
      if old is not None and old.crc != crc:
        out.append(Outcome(b, None, crc, False))  # changed, not hashed
      else:
        out.append(Outcome(b, digest(view), crc, False))
    return out

  async def write_box(self, store: Any, leaf: int, box: plan_lib.Box,
                  chunks: tuple[int, ...], data: np.ndarray,
                  take_sums: bool) -> tuple[list[tuple[plan_lib.Box, int]], int]:
    """Writes the changed chunks of one box into ``store`` (the leaf's
    array in the attempt) and links the others. Returns the crc32c records
    of every chunk (format "zarr", else empty) and the bytes linked."""
    link = self._expects_unchanged(leaf, box, chunks)
    writes = []
    if not link:  # as without reuse: written at once, summed alongside
      writes.append(store[box.slices()].write(
          data, can_reference_source_data_indefinitely=True))
    if data.nbytes <= INLINE_WORK_BYTES:
      outcomes = self.sort(leaf, box, chunks, data, link)
    else:
      outcomes = await asyncio.to_thread(self.sort, leaf, box, chunks, data,
                                         link)
    if link and self.held is not None and not all(
        o.linked for o in outcomes):  # a bucket holds whole leaves only
      outcomes = [dataclasses.replace(o, linked=False) for o in outcomes]
    if link:
      fresh = [o.box for o in outcomes if not o.linked]
      if len(fresh) == len(outcomes):
        fresh = [box]  # nothing linked: one write, as without reuse
      elif self.held is not None:  # all unchanged: held back, or
        if self.held.defer(leaf, store, box, data, len(outcomes)):
          fresh = []
        else:  # past the memory budget: written now (its leaf is written)
          outcomes = [dataclasses.replace(o, linked=False) for o in outcomes]
          fresh = [box]
      writes = [store[b.slices()].write(
          data if b == box else data[b.relative_to(box)],
          can_reference_source_data_indefinitely=True) for b in fresh]
    if writes and self.held is not None:
      self.held.written(leaf)
    for w in writes:
      await tsfuture.wait(w)
    linked = 0
    relpath = self.relpaths[leaf]
    for o in outcomes:
      n = o.box.size * data.itemsize
      self.generation.chunks[(relpath, o.box.start, o.box.stop)] = Stored(
          o.digest, o.crc, n)
      self._records.append([leaf, list(o.box.start), list(o.box.stop),
                            o.digest])
      if o.linked:
        linked += n
    self.bytes_reused += linked
    self.chunks_reused += sum(o.linked for o in outcomes)
    sums = [(o.box, o.crc) for o in outcomes] if take_sums else []
    return sums, linked

  async def settle(self, key: str, timeout_s: float, failed: bool,
                   stats: Any) -> None:
    """A bucket's agreement on the leaves held by the previous step, on
    every process once it stopped writing (``failed``: with an error);
    nothing on a disk (reuse_held.py)."""
    if self.held is not None:
      await self.held.settle(self, key, timeout_s, failed, stats)
      self.chunks_reused = max(self.chunks_reused, 0)

  def record_file(self, process: int, bytes_written: int) -> bytes:
    """This process's ``.reuse`` file (msgpack, sealed by the caller).
    Its chunk list is left out (nil) where it would pass the size readers
    accept (a million chunks and more on one process): the totals stay."""
    doc = {"process": process, "hash": HASH_NAME,
           "from": None if self.previous is None else self.previous.step,
           "written": bytes_written, "reused": self.bytes_reused,
           "chunks": self._records}
    data = msgpack.packb(doc, use_bin_type=True)
    if len(data) > index_lib.MAX_PROCESS_FILE_BYTES - 64:
      data = msgpack.packb({**doc, "chunks": None}, use_bin_type=True)
    return data


class Reuser:
  """The part of a Checkpointer that owns reuse: whether it is on where it
  is saving, and the ``Generation`` of its newest committed save."""

  def __init__(self, enabled: bool, storage: Any, storage_format: str):
    self.why_not = None
    if enabled and storage_format not in LINKED_FORMATS:
      self.why_not = (f"format {storage_format!r} keeps chunks inside shared "
                      "data files")
    if self.why_not:  # once per Checkpointer
      logging.info("ckpt: reuse_unchanged=True writes every chunk in %s: %s",
                   storage.url, self.why_not)
    self.enabled = bool(enabled) and self.why_not is None
    self._storage = storage
    self._last: Generation | None = None

  def begin(self, plan: Any, step: int, token: str,
            work_dir: str) -> SaveReuse | None:
    """The reuse of the save of ``step`` into ``work_dir`` (None: off)."""
    if not self.enabled:
      return None
    return SaveReuse(self._last, self._storage, plan, step, token, work_dir)

  def committed(self, reuse: SaveReuse | None) -> None:
    """The save ``reuse`` belonged to is committed on every process: the
    next save compares with it."""
    if reuse is not None:
      self._last = reuse.generation
