"""What a reuse save compares with and links (holds) from: earlier steps of
this job, each chunk checked against what was recorded when it was stored.

``Generation``: what one process stored in one committed step, per chunk
its 128-bit xxh3 hash, its crc32c record and its *stamp*: what the stored
chunk itself was when it was written, checked again before anything links
or holds it (ckpt/save/reuse.py):

- on a disk, the crc32c of the chunk file's bytes (as stored: encoded,
  compressed), read back once the file is written. Before a link the file
  is checked again (``Source.check``), in two ways: at every save its
  ``stat`` (inode, size, mtime in ns) must be what it was when its bytes
  were last read, else its bytes are read again and must give the same
  crc32c; and its bytes are read again anyway at every ``REREAD_EVERY``-th
  link of the file (the chunks take turns: about 1/``REREAD_EVERY`` of the
  linked bytes per save), and at the first link after a restart (the
  ``stat`` and the count are kept in memory only). So a file replaced,
  truncated, rewritten or written into is never linked into a new step; a
  byte that changed on the medium under an unchanged ``stat`` (bit rot, a
  tool that writes in place and puts the mtime back) is found within
  ``REREAD_EVERY`` links of its file (as many saves with ``keep=1``, twice
  as many with two copies, which alternate), and by every verified restore
  of a step that holds it (docs/format.md, "Reusing unchanged chunks");
- on a bucket, the object's storage generation (S3 ETag, GCS generation),
  seen once it is written; before a leaf is held its every chunk object is
  asked for its generation again (one request without a body) and must
  give the same one (an object deleted, by an operator or a lifecycle rule,
  or overwritten is never held by a new step).

A chunk whose stamp is unknown (records of an older ckpt) is never linked
or held: it is written.

``Source``: a Generation as a place to link (hold) from, and its checks.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
from typing import Any, Hashable

import crc32c

from ckpt.format import entries
from ckpt.format import tsspec
from ckpt.store import names

# A linked chunk file's bytes are read again at every this-many-th link of
# it (each chunk in its own turn), whatever its ``stat`` says.
REREAD_EVERY = 8


@dataclasses.dataclass(frozen=True)
class Stored:
  """One chunk a process stored in a step."""
  digest: bytes | None  # xxh3-128 of its stored bytes (after the save_dtype
                        # cast); None: it changed (compared by crc32c first)
  crc: int              # crc32c of the same bytes (carried when reused)
  nbytes: int
  stamp: bytes | None = None  # what the stored chunk was (module docstring)
  # A disk, in memory only: the file's stat (inode, size, mtime_ns) when its
  # bytes were last read and found to give ``stamp`` (None: unknown), and
  # the links of it since (its turn comes at REREAD_EVERY).
  seen: tuple[int, int, int] | None = None
  unread: int = 0


@dataclasses.dataclass
class Generation:
  """What this process stored in one step: a later save compares with it
  once the step is committed."""
  step: int
  token: str
  layouts: dict[str, tuple]                      # relpath -> layout
  chunks: dict[tuple[str, tuple, tuple], Stored]  # (relpath, start, stop)
  # A bucket's: relpath -> (step, "attempt-<hex>") whose data directory
  # holds the array (its own, or the one it was held by).
  holders: dict[str, tuple[int, str]] = dataclasses.field(
      default_factory=dict)
  # relpath -> weakref of the jax.Array this save stored (in memory only).
  objects: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Outcome:
  """One chunk of a box in this save."""
  box: Any
  digest: bytes | None
  crc: int
  linked: bool
  stamp: bytes | None = None  # linked: the source's; else taken once written
  seen: tuple[int, int, int] | None = None  # as Stored's
  unread: int = 0


def _seen(st: os.stat_result) -> tuple[int, int, int]:
  return (st.st_ino, st.st_size, st.st_mtime_ns)


def file_seen(path: str) -> tuple[int, int, int] | None:
  """A chunk file's (inode, size, mtime_ns), one ``stat`` (None: gone)."""
  try:
    return _seen(os.stat(path))
  except OSError:
    return None


def file_stamp_seen(path: str) -> tuple[bytes | None,
                                         tuple[int, int, int] | None]:
  """The crc32c of a chunk file's bytes and its ``stat`` taken before they
  were read ((None, None): it cannot be read), summed through a read-only
  mapping of the file: no copy out of the page cache (a third less CPU
  than reading it into buffers). A write into the file during or after
  the read changes its mtime: the next check reads it again."""
  try:
    with open(path, "rb") as f:
      seen = _seen(os.fstat(f.fileno()))
      if not seen[1]:
        return (0).to_bytes(4, "big"), seen
      with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return crc32c.crc32c(m).to_bytes(4, "big"), seen
  except (OSError, ValueError):
    return None, None


def file_stamp(path: str) -> bytes | None:
  """The crc32c of a chunk file's bytes (None: it cannot be read)."""
  return file_stamp_seen(path)[0]


def first_turn(key: Hashable) -> int:
  """The ``unread`` count of a chunk file just written and read: spread
  over 0..REREAD_EVERY-1 by the chunk, so that the chunks of one save take
  their turns at different later saves."""
  return hash(key) % REREAD_EVERY


def object_stamp(storage: Any, key: str) -> bytes | None:
  """Blocking: the storage generation of the object ``key`` (None:
  missing, or the store did not answer), one request without a body."""
  try:
    return storage.generation(key)
  except Exception:  # pylint: disable=broad-except
    return None


def stamp_of(storage: Any, where: str) -> bytes | None:
  """Blocking: the stamp of the stored chunk at ``where`` (a path relative
  to the root)."""
  if storage.is_posix:
    return file_stamp(os.path.join(os.fspath(storage.root), where))
  return object_stamp(storage, where)


class Source:
  """An earlier committed step of this job that a save may link (hold)
  chunks from, by its ``Generation``."""

  def __init__(self, gen: Generation, storage: Any, fmt: str):
    self.gen = gen
    self.storage = storage
    self.format = fmt

  @property
  def step(self) -> int:
    return self.gen.step

  def where(self, relpath: str, chunk_index) -> str:
    """The chunk's file (object) relative to the root: built from the
    step number, the checked holder and the save's own plan, never read
    from a checkpoint as a path."""
    name = tsspec.chunk_key(self.format, chunk_index)
    if self.storage.is_posix:
      return f"{names.step_dirname(self.gen.step)}/{relpath}/{name}"
    return f"{entries.held_dir(self.gen.holders[relpath])}/{relpath}/{name}"

  def metadata(self, relpath: str) -> str:
    """A bucket: the metadata object of the array that holds ``relpath``
    (only its presence is checked: a reader refuses other metadata)."""
    name = ".zarray" if self.format == "zarr" else "zarr.json"
    return f"{entries.held_dir(self.gen.holders[relpath])}/{relpath}/{name}"

  def check(self, where: str, rec: Stored
            ) -> tuple[bool, tuple[int, int, int] | None, int]:
    """Blocking, a disk: (whether the chunk file at ``where`` is still what
    ``rec`` recorded; its ``seen`` and ``unread`` for the new step's record,
    which links it). Its bytes are read again at its turn (``unread``
    reaching REREAD_EVERY), when its ``stat`` is not known or differs from
    the one of its last read; else it costs one ``stat``."""
    if rec.stamp is None:
      return False, None, 0
    path = os.path.join(os.fspath(self.storage.root), where)
    if rec.seen is not None and rec.unread + 1 < REREAD_EVERY:
      seen = file_seen(path)
      if seen == rec.seen:
        return True, seen, rec.unread + 1
    stamp, seen = file_stamp_seen(path)
    return stamp == rec.stamp, seen, 0
