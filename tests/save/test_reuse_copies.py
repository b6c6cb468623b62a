"""reuse_unchanged=True on a disk never costs the redundancy of keep=N
(ckpt/save/reuse.py, ckpt/save/reuse_source.py): a stored chunk is
re-checked against the crc32c of its file before it is linked, so damage
found once is never linked into a new step, and two consecutive steps hold
two physical copies of every chunk, so one damaged file never leaves a job
with no restorable step."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

import ckpt
from ckpt.cli import integrity

CHUNK = 64 << 10
FROZEN = (512, 256)  # float32: 512 KiB, 8 chunks of 64 KiB


def _frozen() -> np.ndarray:
  return np.random.default_rng(99).standard_normal(FROZEN, np.float32)


def _state(step: int) -> dict:
  return {"frozen": _frozen(),
          "train": np.random.default_rng(step).standard_normal(
              (256, 256), np.float32),
          "step": step}


def _flip(path: pathlib.Path, at: int = 100) -> None:
  """One byte flipped in place: every name of the file (hard links) sees it."""
  with open(path, "r+b") as f:
    f.seek(at)
    b = f.read(1)
    f.seek(at)
    f.write(bytes([b[0] ^ 1]))


def _restores_exactly(root: pathlib.Path) -> int:
  """A restarted job's resume: the step it restores is bit-exact."""
  with ckpt.Checkpointer(root) as c:
    got = c.restore()
  want = _state(int(got["step"]))
  for k in ("frozen", "train"):
    assert np.asarray(got[k]).tobytes() == want[k].tobytes(), k
  return int(got["step"])


def test_a_byte_flipped_in_a_frozen_chunk_is_never_linked_again(tmp_path):
  """Issue 44, item 1: one byte flipped in a frozen chunk of step 3 while
  the job runs; saves 4..8 with keep=2 all succeed, none of them links the
  damaged file, and a restarted job restores step 8 bit-exact."""
  root = tmp_path / "run"
  with ckpt.Checkpointer(root, reuse_unchanged=True, keep=2,
                         async_save=False, chunk_bytes=CHUNK) as c:
    for step in range(4):
      c.save(step, _state(step))
    damaged = root / "checkpoint_3" / "frozen" / "0.0"
    inode = damaged.stat().st_ino
    _flip(damaged)
    for step in range(4, 9):
      c.save(step, _state(step))
    assert c.all_steps() == [7, 8]
  for step in (7, 8):  # neither kept step holds the damaged file
    assert (root / f"checkpoint_{step}" / "frozen" / "0.0").stat().st_ino \
        != inode
    assert integrity.verify(str(root), step=step) == []
  assert _restores_exactly(root) == 8


@pytest.mark.parametrize("keep", [2, 3])
def test_keep_n_spans_two_physical_copies(tmp_path, keep):
  """No damage in flight: the kept steps hold two copies of every frozen
  chunk, so a bad sector in the newest step's file (every step linking
  that inode sees it) leaves an older kept step that restores exactly."""
  root = tmp_path / "run"
  with ckpt.Checkpointer(root, reuse_unchanged=True, keep=keep,
                         async_save=False, chunk_bytes=CHUNK) as c:
    for step in range(6):
      c.save(step, _state(step))
      assert c.last_save_stats.bytes_reused == (
          _frozen().nbytes if step >= 2 else 0)
    kept = c.all_steps()
  inodes = {(root / f"checkpoint_{s}" / "frozen" / "0.0").stat().st_ino
            for s in kept}
  assert len(inodes) == 2
  _flip(root / f"checkpoint_{kept[-1]}" / "frozen" / "0.0")
  assert _restores_exactly(root) == kept[-2]


def test_a_missing_source_chunk_is_written(tmp_path):
  """The file a link would come from is gone (removed by hand): the chunk
  is written, the save succeeds and the new step restores exactly."""
  root = tmp_path / "run"
  with ckpt.Checkpointer(root, reuse_unchanged=True, async_save=False,
                         chunk_bytes=CHUNK) as c:
    for step in range(2):
      c.save(step, _state(step))
    os.remove(root / "checkpoint_0" / "frozen" / "0.0")
    c.save(2, _state(2))
    assert c.last_save_stats.bytes_reused == _frozen().nbytes - CHUNK
  assert integrity.verify(str(root), step=2) == []
  assert _restores_exactly(root) == 2


@pytest.mark.parametrize("fmt", ["zarr", "zarr3"])
def test_a_restarted_job_reuses_what_the_steps_hold(tmp_path, fmt):
  """Issue 45, item 5: a new Checkpointer on the same root (a restart)
  starts from the steps' .reuse records: its first save writes only the
  changed leaf, links the frozen one (checked against the recorded
  stamps, so a file damaged meanwhile is written) and restores exactly."""
  root = tmp_path / "run"
  kwargs = dict(format=fmt, reuse_unchanged=True, keep=2, async_save=False,
                chunk_bytes=CHUNK)
  with ckpt.Checkpointer(root, **kwargs) as c:
    for step in range(3):
      c.save(step, _state(step))
  train = _state(0)["train"].nbytes
  with ckpt.Checkpointer(root, **kwargs) as c:  # the restart
    c.save(3, _state(3))
    s = c.last_save_stats
    assert (s.bytes_reused, s.bytes_written) == (_frozen().nbytes, train)
    assert (root / "checkpoint_3" / "frozen" / _chunk(fmt)).stat().st_ino \
        != (root / "checkpoint_2" / "frozen" / _chunk(fmt)).stat().st_ino
  assert integrity.verify(str(root), step=3) == []
  assert _restores_exactly(root) == 3
  _flip(root / "checkpoint_2" / "frozen" / _chunk(fmt))  # the next source
  with ckpt.Checkpointer(root, **kwargs) as c:  # another restart
    c.save(4, _state(4))
    assert c.last_save_stats.bytes_reused == _frozen().nbytes - CHUNK
  assert integrity.verify(str(root), step=4) == []
  assert _restores_exactly(root) == 4


def _chunk(fmt: str) -> str:
  return "0.0" if fmt == "zarr" else "c/0/0"


def test_the_same_jax_array_is_linked_unstaged_and_unhashed(tmp_path,
                                                            monkeypatch):
  """Issue 47, item 5: the very jax.Array object the step linked from
  stored is neither staged nor hashed; each link is still checked (a
  byte flipped in the file it would link: staged, written); a new object
  with the same bytes is staged and hashed, and linked."""
  import jax  # pylint: disable=g-import-not-at-top
  from ckpt.format import crc as crc_lib  # pylint: disable=g-import-not-at-top
  from ckpt.save import reuse as reuse_lib  # pylint: disable=g-import-not-at-top
  from ckpt.save import staging  # pylint: disable=g-import-not-at-top
  frozen = jax.numpy.asarray(_frozen())
  staged, hashed = [], []
  real_piece, real_digest = staging.device_piece, crc_lib.digest

  def piece(leaf, w):
    if leaf.parts == ("frozen",):
      staged.append(w.box)
    return real_piece(leaf, w)

  def digest(view):
    hashed.append(view.nbytes)
    return real_digest(view)

  monkeypatch.setattr(staging, "device_piece", piece)
  monkeypatch.setattr(reuse_lib, "digest", digest)
  root = tmp_path / "run"

  def save(c, step, arr):
    staged.clear()
    hashed.clear()
    c.save(step, {**_state(step), "frozen": arr})
    return c.last_save_stats.bytes_reused

  with ckpt.Checkpointer(root, reuse_unchanged=True, keep=2,
                         async_save=False, chunk_bytes=CHUNK) as c:
    save(c, 0, frozen)
    save(c, 1, frozen)  # the second copy: staged, written
    assert staged
    train = _state(0)["train"].nbytes  # hashed or not, never frozen
    for step in (2, 3):
      assert save(c, step, frozen) == _frozen().nbytes
      assert not staged and sum(hashed) <= train, (step, staged, hashed)
    _flip(root / "checkpoint_2" / "frozen" / "0.0")  # step 4 links it
    assert save(c, 4, frozen) == _frozen().nbytes - CHUNK
    assert staged and sum(hashed) > train
    assert save(c, 5, jax.numpy.asarray(_frozen())) == _frozen().nbytes
    assert staged and sum(hashed) > train  # another object: staged, hashed
  for step in (4, 5):
    assert integrity.verify(str(root), step=step) == []
  assert _restores_exactly(root) == 5
