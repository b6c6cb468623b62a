"""A frozen base costs (almost) nothing to re-save (issue 47, item 5), and a
chunk damaged on disk is still never linked for long
(ckpt/save/reuse_source.py, ``Source.check``): before a link, one ``stat``
of the chunk file; its bytes are read again when the stat differs from the
one of their last read, and anyway at every ``REREAD_EVERY``-th link of
the file (the chunks take turns)."""

from __future__ import annotations

import os
import pathlib

import crc32c as crc32c_lib
import numpy as np

import ckpt
from ckpt.cli import integrity
from ckpt.save import reuse_source

CHUNK = 64 << 10
FROZEN = (512, 256)  # float32: 512 KiB, 8 chunks of 64 KiB
N_CHUNKS = 8


def _frozen() -> np.ndarray:
  return np.random.default_rng(99).standard_normal(FROZEN, np.float32)


def _train(step: int) -> np.ndarray:
  return np.random.default_rng(step).standard_normal((64, 256), np.float32)


class _FileReads:
  """Counts the chunk files whose bytes are read back and summed (the
  mapping reuse_source sums; a checksum of data in memory is not one)."""

  def __init__(self, monkeypatch):
    import mmap  # pylint: disable=g-import-not-at-top
    self.files = 0
    real = crc32c_lib.crc32c

    class Wrapped:
      @staticmethod
      def crc32c(data, *a):
        if isinstance(data, mmap.mmap):
          self.files += 1
        return real(data, *a)

    monkeypatch.setattr(reuse_source, "crc32c", Wrapped)


def _damage_keeping_stat(path: pathlib.Path) -> None:
  """One byte flipped in place, the mtime put back: the file's stat
  (inode, size, mtime) is what it was, as after bit rot on the medium."""
  st = path.stat()
  with open(path, "r+b") as f:
    f.seek(100)
    b = f.read(1)
    f.seek(100)
    f.write(bytes([b[0] ^ 1]))
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
  after = path.stat()
  assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
      st.st_ino, st.st_size, st.st_mtime_ns)


def test_linked_chunk_files_are_read_in_turns_not_at_every_save(
    tmp_path, monkeypatch):
  """The very same jax.Array saved again and again (keep=2: two copies
  alternate): on main every link read its file's bytes again (8 files per
  save); now about one in REREAD_EVERY links does, and every file is read
  at least once in its REREAD_EVERY links."""
  import jax  # pylint: disable=g-import-not-at-top
  frozen = jax.numpy.asarray(_frozen())
  reads = _FileReads(monkeypatch)
  saves = 2 * reuse_source.REREAD_EVERY  # every file linked REREAD_EVERY times
  with ckpt.Checkpointer(tmp_path / "run", reuse_unchanged=True, keep=2,
                         async_save=False, chunk_bytes=CHUNK) as c:
    for step in range(2):  # two copies written
      c.save(step, {"frozen": frozen, "train": _train(step)})
    reads.files = 0
    for step in range(2, 2 + saves):
      c.save(step, {"frozen": frozen, "train": _train(step)})
      assert c.last_save_stats.bytes_reused == _frozen().nbytes, step
  # 8 chunks x 2 copies, each read once in its REREAD_EVERY links.
  assert reads.files == 2 * N_CHUNKS, reads.files
  assert reads.files < N_CHUNKS * saves / 4  # main: N_CHUNKS * saves


def test_a_rewritten_chunk_file_is_read_at_the_next_link(tmp_path,
                                                         monkeypatch):
  """A byte flipped by a write (its mtime moves): the very next save that
  would link it reads it, finds it damaged and writes the chunk."""
  import jax  # pylint: disable=g-import-not-at-top
  frozen = jax.numpy.asarray(_frozen())
  reads = _FileReads(monkeypatch)
  root = tmp_path / "run"
  with ckpt.Checkpointer(root, reuse_unchanged=True, keep=2,
                         async_save=False, chunk_bytes=CHUNK) as c:
    for step in range(4):
      c.save(step, {"frozen": frozen, "train": _train(step)})
    damaged = root / "checkpoint_2" / "frozen" / "0.0"  # step 4 links it
    with open(damaged, "r+b") as f:
      f.seek(100)
      b = f.read(1)
      f.seek(100)
      f.write(bytes([b[0] ^ 1]))
    os.utime(damaged, ns=(0, damaged.stat().st_mtime_ns + 10**9))
    reads.files = 0
    c.save(4, {"frozen": frozen, "train": _train(4)})
    assert c.last_save_stats.bytes_reused == _frozen().nbytes - CHUNK
    assert reads.files >= 1
  assert integrity.verify(str(root), step=4) == []


def test_bit_rot_under_an_unchanged_stat_is_found_within_its_turns(tmp_path):
  """A byte flipped with the file's stat put back is linked until its turn
  comes (at most REREAD_EVERY links of that file), then found and written;
  the verified restore of a step that linked it meanwhile reports it (and
  a resume falls back); the steps kept at the end hold a good copy."""
  import jax  # pylint: disable=g-import-not-at-top
  frozen = jax.numpy.asarray(_frozen())
  root = tmp_path / "run"
  k = reuse_source.REREAD_EVERY
  with ckpt.Checkpointer(root, reuse_unchanged=True, keep=None,
                         async_save=False, chunk_bytes=CHUNK) as c:
    for step in range(4):
      c.save(step, {"frozen": frozen, "train": _train(step)})
    damaged = root / "checkpoint_3" / "frozen" / "0.0"
    inode = damaged.stat().st_ino
    _damage_keeping_stat(damaged)
    last = 4 + 2 * k + 1  # its file is linked every other save
    for step in range(4, last + 1):
      c.save(step, {"frozen": frozen, "train": _train(step)})
  holders = [s for s in range(3, last + 1) if (
      root / f"checkpoint_{s}" / "frozen" / "0.0").stat().st_ino == inode]
  assert holders[0] == 3 and len(holders) <= 1 + k, holders
  assert holders[-1] < last - 1  # found: neither of the newest two holds it
  for s in holders:  # a verified read reports every step that linked it
    assert integrity.verify(str(root), step=s), s
  for s in (last - 1, last):
    assert integrity.verify(str(root), step=s) == []
  with ckpt.Checkpointer(root) as c:
    got = c.restore(step=last)
  assert np.asarray(got["frozen"]).tobytes() == _frozen().tobytes()
