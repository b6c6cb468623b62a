"""reuse_unchanged=True (ckpt/save/reuse.py): unchanged chunks are hard
links into the previous step of the same Checkpointer, every step stays
whole (retention, a moved root, verify), and anything else is written."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt
from ckpt.cli import integrity
from ckpt.cli import main as cli_main
from ckpt.errors import CorruptCheckpointError
from ckpt.save import reuse as reuse_lib

CHUNK = 64 << 10
FROZEN = (512, 256)  # float32: 512 KiB, 8 chunks of 64 KiB
TRAIN = (256, 256)   # float32: 256 KiB, changes every step


def _state(step: int, frozen: np.ndarray, mesh=None) -> dict:
  rng = np.random.default_rng(step)
  train = rng.standard_normal(TRAIN, dtype=np.float32)
  if mesh is None:
    return {"frozen": jax.numpy.asarray(frozen), "train": train}
  sh = NamedSharding(mesh, P("x"))
  return {"frozen": jax.device_put(frozen, sh),
          "train": jax.device_put(train, sh)}


@pytest.fixture(name="frozen")
def _frozen() -> np.ndarray:
  return np.random.default_rng(99).standard_normal(FROZEN, dtype=np.float32)


def _chunk_files(step_dir: pathlib.Path, leaf: str) -> dict[str, os.stat_result]:
  base = step_dir / leaf
  return {str(p.relative_to(base)): p.stat() for p in base.rglob("*")
          if p.is_file() and not p.name.startswith((".z", "zarr.json"))}


@pytest.mark.parametrize("fmt", ["zarr", "zarr3"])
def test_unchanged_chunks_are_linked_and_every_step_stays_whole(
    tmp_path, frozen, fmt):
  root = tmp_path / "root"
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
  stats = []
  with ckpt.Checkpointer(root, format=fmt, reuse_unchanged=True, keep=2,
                         async_save=False, chunk_bytes=CHUNK) as c:
    for step in range(4):
      c.save(step, _state(step, frozen, mesh))
      stats.append(c.last_save_stats)
    assert c.all_steps() == [2, 3]  # retention removed steps 0 and 1
  # Step 1 writes a second copy of the frozen leaf; from step 2 on each
  # step links the copy of the step before the newest.
  assert stats[0].bytes_reused == stats[1].bytes_reused == 0
  for s in stats[2:]:  # the frozen leaf linked, the changing one written
    assert s.bytes_reused == frozen.nbytes
    assert s.chunks_reused == frozen.nbytes // CHUNK
    assert s.bytes_written == np.prod(TRAIN) * 4
  # Step 3's frozen chunks are the files step 1 wrote, step 2's those of
  # step 0: the two kept steps hold two physical copies, each whole once
  # the steps that wrote them were deleted.
  three = _chunk_files(root / "checkpoint_3", "frozen")
  two = _chunk_files(root / "checkpoint_2", "frozen")
  assert len(three) == frozen.nbytes // CHUNK
  for name, st in three.items():
    assert st.st_ino != two[name].st_ino and st.st_nlink == 1
  assert not set(_chunk_files(root / "checkpoint_3", "train")) & {
      n for n, st in _chunk_files(root / "checkpoint_2", "train").items()
      if st.st_nlink > 1}
  # A moved root: every kept step restores bit-exact and verifies.
  moved = tmp_path / "moved"
  shutil.move(root, moved)
  for step in (2, 3):
    got = ckpt.load(str(moved), step)
    assert got["frozen"].tobytes() == frozen.tobytes()
    assert got["train"].tobytes() == np.asarray(
        _state(step, frozen)["train"]).tobytes()
  assert cli_main.main(["verify", "--all", str(moved)]) == 0
  # Deleting step 2 leaves step 3 whole.
  shutil.rmtree(moved / "checkpoint_2")
  assert ckpt.load(str(moved), 3)["frozen"].tobytes() == frozen.tobytes()


def test_inspect_shows_own_and_reused_bytes(tmp_path, frozen, capsys):
  with ckpt.Checkpointer(tmp_path, reuse_unchanged=True, async_save=False,
                         chunk_bytes=CHUNK) as c:
    for step in range(3):
      c.save(step, _state(step, frozen))
  assert cli_main.main(["inspect", str(tmp_path), "--step", "2",
                        "--json"]) == 0
  doc = json.loads(capsys.readouterr().out)
  assert doc["reuse"] == {"own_bytes": np.prod(TRAIN) * 4,
                          "reused_bytes": frozen.nbytes,
                          "reused_from": {"0": frozen.nbytes},
                          "how": "hard links", "unknown_processes": []}
  assert cli_main.main(["inspect", str(tmp_path), "--step", "2"]) == 0
  assert "512.0 KiB reused (512.0 KiB from step 0, hard links)" in (
      capsys.readouterr().out)


def test_another_layout_or_dtype_is_written_in_full(tmp_path, frozen):
  with ckpt.Checkpointer(tmp_path / "a", reuse_unchanged=True,
                         async_save=False, chunk_bytes=CHUNK) as c:
    c.save(0, _state(0, frozen))
    c.save(1, _state(1, frozen[:, :128]))  # another shape
    assert c.last_save_stats.bytes_reused == 0
    c.save(2, _state(2, frozen[:, :128]))  # its second copy
    assert c.last_save_stats.bytes_reused == 0
    c.save(3, _state(3, frozen[:, :128]))
    assert c.last_save_stats.bytes_reused == frozen.nbytes // 2
  with ckpt.Checkpointer(tmp_path / "b", reuse_unchanged=True,
                         async_save=False, chunk_bytes=CHUNK,
                         save_dtype="bfloat16") as c:
    c.save(0, _state(0, frozen))
    flipped = frozen[::-1].copy()
    # Other bytes: written (their crc32c differs, so they are not hashed);
    # then the same bytes again: written, now hashed; then a second copy;
    # then linked.
    for step, reused in ((1, 0), (2, 0), (3, 0),
                         (4, frozen.nbytes // 2)):  # bf16
      c.save(step, {**_state(step, frozen), "frozen": flipped})
      assert c.last_save_stats.bytes_reused == reused, step


def test_a_step_of_another_checkpointer_is_never_linked(tmp_path, frozen):
  """Step 0 replaced by another job (delete, save again): a save of this
  Checkpointer writes in full, never linking the other job's files."""
  other = np.random.default_rng(7).standard_normal(FROZEN, dtype=np.float32)
  with ckpt.Checkpointer(tmp_path, reuse_unchanged=True, async_save=False,
                         chunk_bytes=CHUNK) as a:
    a.save(0, _state(0, frozen))
    with ckpt.Checkpointer(tmp_path, reuse_unchanged=True,
                           async_save=False, chunk_bytes=CHUNK) as b:
      b.delete(0)
      b.save(0, _state(0, other))
    a.save(1, _state(1, frozen))  # bytes equal to a's step 0
    assert a.last_save_stats.bytes_reused == 0
    a.save(2, _state(2, frozen))  # would link step 0: b's, written
    assert a.last_save_stats.bytes_reused == 0
    a.save(3, _state(3, frozen))
    assert a.last_save_stats.bytes_reused == frozen.nbytes
  for step, want in ((0, other), (1, frozen), (2, frozen), (3, frozen)):
    assert ckpt.load(str(tmp_path), step)["frozen"].tobytes() == \
        want.tobytes()


def test_verify_checks_reused_chunks(tmp_path, frozen):
  with ckpt.Checkpointer(tmp_path, reuse_unchanged=True, async_save=False,
                         chunk_bytes=CHUNK) as c:
    for step in range(3):
      c.save(step, _state(step, frozen))
  chunk = tmp_path / "checkpoint_2" / "frozen" / "0.0"
  data = bytearray(chunk.read_bytes())
  data[100] ^= 1
  chunk.unlink()  # a new file: step 0's link keeps the good bytes
  chunk.write_bytes(bytes(data))
  assert integrity.verify(str(tmp_path), step=0) == []
  problems = integrity.verify(str(tmp_path), step=2)
  assert [p.path for p in problems] == ["frozen"]
  with pytest.raises(CorruptCheckpointError):
    ckpt.load(str(tmp_path), 2)


def test_ocdbt_writes_everything(tmp_path, frozen):
  with ckpt.Checkpointer(tmp_path, format="ocdbt", reuse_unchanged=True,
                         async_save=False, chunk_bytes=CHUNK) as c:
    for step in range(2):
      c.save(step, _state(step, frozen))
    assert c.last_save_stats.bytes_reused == 0
    assert ckpt.load(str(tmp_path), 1)["frozen"].tobytes() == frozen.tobytes()


def test_default_is_off(tmp_path, frozen):
  with ckpt.Checkpointer(tmp_path, async_save=False, chunk_bytes=CHUNK) as c:
    for step in range(2):
      c.save(step, _state(step, frozen))
    assert c.last_save_stats.bytes_reused == 0
  assert not (tmp_path / "checkpoint_1" / ".reuse").exists()


def test_multitier_persistent_tier_reuses(tmp_path, frozen):
  mt = ckpt.MultiTierCheckpointer(
      str(tmp_path / "p"), local=str(tmp_path / "l"), local_interval=1,
      persistent_interval=1, reuse_unchanged=True, async_save=False,
      chunk_bytes=CHUNK)
  try:
    for step in range(3):
      mt.save(step, _state(step, frozen))
    mt.wait_until_finished(timeout=60)
    assert mt.persistent.last_save_stats.bytes_reused == frozen.nbytes
  finally:
    mt.close()
  assert ckpt.load(str(tmp_path / "p"), 2)["frozen"].tobytes() == \
      frozen.tobytes()


def test_a_reuse_file_too_large_keeps_its_totals(tmp_path, monkeypatch,
                                                 capsys):
  """64 chunks: their hashes pass a (lowered) bound on per-process files,
  their crc32c records do not; the save goes on, the totals stay."""
  from ckpt.format import index as index_lib  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(index_lib, "MAX_PROCESS_FILE_BYTES", 1500)
  leaf = np.random.default_rng(5).standard_normal((640, 64), np.float32)
  with ckpt.Checkpointer(tmp_path, reuse_unchanged=True, async_save=False,
                         chunk_bytes=4 << 10) as c:
    for step in range(3):
      c.save(step, {"frozen": leaf})
    assert c.last_save_stats.chunks_reused == 64
  assert (tmp_path / "checkpoint_2" / ".reuse" / "0.msgpack").stat().st_size \
      < 1500
  assert cli_main.main(["inspect", str(tmp_path), "--json"]) == 0
  assert json.loads(capsys.readouterr().out)["reuse"]["reused_bytes"] == \
      leaf.nbytes


def test_a_save_failing_between_links_leaves_the_steps_whole(
    tmp_path, frozen, monkeypatch):
  """The 4th link raises: the save fails and its attempt (with the links
  made) is removed; steps 0 and 1 are whole, and the next save links from
  step 0."""
  real_link, calls = os.link, []

  def link(src, dst):
    calls.append(dst)
    if len(calls) == 4:
      raise RuntimeError("the disk went away")
    real_link(src, dst)

  with ckpt.Checkpointer(tmp_path, reuse_unchanged=True, async_save=False,
                         chunk_bytes=CHUNK) as c:
    c.save(0, _state(0, frozen))
    c.save(1, _state(1, frozen))
    monkeypatch.setattr(reuse_lib.os, "link", link)
    with pytest.raises(ckpt.CheckpointError, match="the disk went away"):
      c.save(2, _state(2, frozen))
    monkeypatch.setattr(reuse_lib.os, "link", real_link)
    assert c.all_steps() == [0, 1]
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    assert integrity.verify(str(tmp_path), step=0) == []
    c.save(2, _state(2, frozen))
    assert c.last_save_stats.bytes_reused == frozen.nbytes
  assert ckpt.load(str(tmp_path), 2)["frozen"].tobytes() == frozen.tobytes()
  assert integrity.verify(str(tmp_path), step=2) == []


def test_inline_leaves_beside_reused_ones(tmp_path, frozen):
  """Values stored in the index (no relative path) next to linked arrays."""
  with ckpt.Checkpointer(tmp_path, reuse_unchanged=True, async_save=False,
                         chunk_bytes=CHUNK) as c:
    for step in range(3):
      c.save(step, {**_state(step, frozen), "step": step,
                    "lr": np.float32(0.5)})
    assert c.last_save_stats.bytes_reused == frozen.nbytes
  got = ckpt.load(str(tmp_path), 2)
  assert got["step"] == 2 and got["frozen"].tobytes() == frozen.tobytes()
