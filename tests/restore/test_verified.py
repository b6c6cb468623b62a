"""Every restore verified as it reads (ckpt/restore/verified.py), the
sealed index and per-process files (ckpt/format/seal.py), and a resume that
falls back past a damaged step (ckpt/face/restorer.py)."""

from __future__ import annotations

import logging
import pathlib

import jax
import msgpack
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from ckpt.format import index as index_lib
from ckpt.format import seal
from ckpt.restore import verified
from ckpt.shards.plan import Box

SHAPE = (256, 512)  # float32: 512 KiB, stored (not packed)


def _mesh(rows: int, cols: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:rows * cols]).reshape(rows, cols),
              ("a", "b"))


def _flip(path: pathlib.Path, at: float = 0.5) -> None:
  data = bytearray(path.read_bytes())
  data[int(len(data) * at)] ^= 0x10
  path.write_bytes(bytes(data))


def _chunk_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
  return sorted(p for p in step_dir.rglob("*") if p.is_file() and
                p.stat().st_size >= 16 << 10)


@pytest.fixture
def value():
  return np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)


@pytest.mark.parametrize("fmt", ["zarr", "zarr3", "ocdbt"])
def test_flipped_chunk_byte_is_refused_by_default(tmp_path, value, fmt):
  """restore() and load() refuse a flipped byte in an array chunk of every
  format, naming the leaf, the box, the file and both checksums;
  verify=False returns what is stored."""
  x = jax.device_put(value, NamedSharding(_mesh(2, 4), P(None, "b")))
  with ckpt.Checkpointer(tmp_path, format=fmt, async_save=False) as c:
    c.save(1, {"w": x})
  _flip(_chunk_files(tmp_path / "checkpoint_1")[-1])
  target = {"w": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=x.sharding)}
  pattern = (r"leaf 'w': box \[\d+, \d+\]\.\.\[\d+, \d+\] \(stored in .*"
             r"checkpoint_1.*\) has crc32c 0x[0-9a-f]{8}, expected "
             r"0x[0-9a-f]{8}")
  with ckpt.Checkpointer(tmp_path) as c:
    with pytest.raises(ckpt.CorruptCheckpointError, match=pattern):
      c.restore(1, target=target)
    got = c.restore(1, target=target, verify=False)["w"]
    assert not np.array_equal(np.asarray(got), value)  # the damage, unchecked
  with pytest.raises(ckpt.CorruptCheckpointError, match=pattern):
    ckpt.load(tmp_path)


@pytest.mark.parametrize("saved,restored", [
    ((1, 8), (2, 4)),   # finer boxes saved: each read covers several
    ((2, 4), (4, 2)),   # another layout
    ((4, 2), (1, 8)),   # coarser boxes saved: each read inside one
])
def test_verified_restore_onto_other_meshes(tmp_path, value, saved, restored):
  """A verified restore onto another mesh returns the exact data whether the
  saved boxes lie inside the boxes read or straddle them, and reads each
  stored byte once: target boxes that straddle the same stored boxes share
  one read of them (each read and checked its own before: 2x the bytes
  for (2, 4) -> (4, 2))."""
  x = jax.device_put(value, NamedSharding(_mesh(*saved), P("a", "b")))
  with ckpt.Checkpointer(tmp_path, async_save=False) as c:
    c.save(1, {"w": x})
    sharding = NamedSharding(_mesh(*restored), P("a", "b"))
    got = c.restore(1, target={"w": jax.ShapeDtypeStruct(
        SHAPE, np.float32, sharding=sharding)})["w"]
    assert got.sharding == sharding
    assert np.array_equal(np.asarray(got), value)
    assert c.last_restore_stats.bytes_read == value.nbytes
    lazy = c.restore(1, target={"w": jax.ShapeDtypeStruct(
        SHAPE, np.float32, sharding=sharding)}, lazy=True)["w"]
    assert np.array_equal(np.asarray(lazy.read()), value)


@pytest.mark.parametrize("at", [0.2, 0.5, 0.8])
def test_damage_under_a_shared_read_fails_the_restore(tmp_path, value, at):
  """Onto a finer mesh, the boxes that share one read of a damaged stored
  box all fail: the restore raises, naming the box and its file."""
  x = jax.device_put(value, NamedSharding(_mesh(2, 4), P("a", "b")))
  with ckpt.Checkpointer(tmp_path, async_save=False) as c:
    c.save(1, {"w": x})
  for f in _chunk_files(tmp_path / "checkpoint_1"):
    _flip(f, at)
  sharding = NamedSharding(_mesh(4, 2), P("a", "b"))
  target = {"w": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=sharding)}
  with ckpt.Checkpointer(tmp_path) as c:
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"has crc32c"):
      c.restore(1, target=target)


def test_lazy_leaf_is_checked_when_read(tmp_path, value):
  with ckpt.Checkpointer(tmp_path, async_save=False) as c:
    c.save(1, {"w": value})
  _flip(_chunk_files(tmp_path / "checkpoint_1")[-1])
  with ckpt.Checkpointer(tmp_path) as c:
    leaf = c.restore(1, lazy=True)["w"]  # nothing read yet: no error
    with pytest.raises(ckpt.CorruptCheckpointError, match="crc32c"):
      leaf.read()


def test_plan_reads_the_hull_of_straddling_boxes():
  sums = verified.BoxSums.of(
      [((0, 0), (4, 8), 1), ((4, 0), (8, 8), 2)], 2, "x", str, (4, 8))
  assert verified.plan(sums, Box((0, 0), (8, 8)), "w")[0] == Box((0, 0), (8, 8))
  at, rows = verified.plan(sums, Box((2, 2), (6, 4)), "w")
  assert at == Box((0, 0), (8, 8)) and list(rows) == [0, 1]
  holey = verified.BoxSums.of([((0, 0), (4, 8), 1)], 2, "x", str, (4, 8))
  with pytest.raises(ckpt.CorruptCheckpointError, match="cover 16 of the 32"):
    verified.plan(holey, Box((2, 0), (6, 8)), "w")


# ---- the index and the per-process files, sealed ---------------------------

def _every_flip_is_refused(data: bytes, decode) -> int:
  """Flips each byte of ``data`` (one bit, the position's own) and checks
  that ``decode`` refuses every one; returns how many were tried."""
  for i in range(len(data)):
    bad = bytearray(data)
    bad[i] ^= 1 << (i % 8)
    with pytest.raises(ckpt.CorruptCheckpointError):
      decode(bytes(bad))
  return len(data)


def test_no_flipped_index_byte_decodes(tmp_path):
  with ckpt.Checkpointer(tmp_path, async_save=False) as c:
    c.save(3, {"lr": 0.5, "name": "run", "v": np.arange(6, dtype=np.int32)},
           metrics={"loss": 1.25})
  data = (tmp_path / "checkpoint_3" / "index.msgpack").read_bytes()
  assert index_lib.decode(data).version == index_lib.VERSION
  assert _every_flip_is_refused(data, index_lib.decode) == len(data)


def test_no_flipped_host_state_or_checksum_byte_goes_unnoticed(tmp_path,
                                                               value):
  with ckpt.Checkpointer(tmp_path, async_save=False) as c:
    c.save(1, {"w": value}, host_state=[1, 2, {"seed": 3}])
  step = tmp_path / "checkpoint_1"
  for kind in (index_lib.HOST_STATE_DIR, index_lib.CHECKSUMS_DIR):
    path = step / index_lib.process_file(kind, 0)
    good = path.read_bytes()
    for i in range(0, len(good), max(1, len(good) // 40)):
      bad = bytearray(good)
      bad[i] ^= 1
      path.write_bytes(bytes(bad))
      with ckpt.Checkpointer(tmp_path) as c:
        with pytest.raises(ckpt.CorruptCheckpointError):
          if kind == index_lib.HOST_STATE_DIR:
            c.host_state(1)
          else:
            c.restore(1)
    path.write_bytes(good)
  with ckpt.Checkpointer(tmp_path) as c:
    assert c.host_state(1) == [1, 2, {"seed": 3}]


def test_unsealed_file_of_a_sealed_step_is_refused(tmp_path, value):
  with ckpt.Checkpointer(tmp_path, async_save=False) as c:
    c.save(1, {"w": value}, host_state={"a": 1})
  path = tmp_path / "checkpoint_1" / index_lib.process_file(
      index_lib.HOST_STATE_DIR, 0)
  path.write_bytes(msgpack.packb({"a": 2}))  # valid msgpack, no trailer
  with ckpt.Checkpointer(tmp_path) as c:
    with pytest.raises(ckpt.CorruptCheckpointError,
                       match="expected a crc32c trailer"):
      c.host_state(1)
  path.write_bytes(seal.seal(msgpack.packb({"a": 2})))
  with ckpt.Checkpointer(tmp_path) as c:
    assert c.host_state(1) == {"a": 2}


# ---- a resume falls back to the newest step that verifies ------------------

def _two_steps(root, value):
  with ckpt.Checkpointer(root, async_save=False) as c:
    c.save(1, {"w": value})
    c.save(2, {"w": value + 1})


@pytest.mark.parametrize("damage", ["chunk", "index"])
def test_resume_falls_back_past_a_damaged_step(tmp_path, value, caplog,
                                               damage):
  _two_steps(tmp_path, value)
  if damage == "index":
    _flip(tmp_path / "checkpoint_2" / "index.msgpack", 0.3)
  else:
    _flip(_chunk_files(tmp_path / "checkpoint_2")[-1])
  with ckpt.Checkpointer(tmp_path, async_save=False, keep=1) as c:
    with caplog.at_level(logging.WARNING):
      got = c.restore()
    assert c.last_restore_step == 1
    assert np.array_equal(got["w"], value)
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and "verification" in
                r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "step 2" in warnings[0] and "resuming from step 1" in warnings[0]
    if damage == "chunk":
      assert "leaf 'w'" in warnings[0] and "checkpoint_2/w/" in warnings[0]
    # An explicit step raises.
    with pytest.raises(ckpt.CorruptCheckpointError):
      c.restore(2)
    # Training goes on from step 1; retention (keep=1) neither counts nor
    # deletes the damaged step 2, and never deletes the newest good step.
    c.save(3, {"w": value + 3})
    c.wait_until_finished()
    assert c.all_steps() == [2, 3]
    assert np.array_equal(c.restore()["w"], value + 3)
    assert c.last_restore_step == 3


def test_resume_with_no_step_that_verifies_raises(tmp_path, value):
  with ckpt.Checkpointer(tmp_path, async_save=False) as c:
    c.save(1, {"w": value})
  _flip(_chunk_files(tmp_path / "checkpoint_1")[-1])
  with ckpt.Checkpointer(tmp_path) as c:
    with pytest.raises(ckpt.CorruptCheckpointError, match="crc32c"):
      c.restore()


def test_saving_a_damaged_step_again_replaces_it(tmp_path, value, caplog):
  """After a resume fell back past damaged step 2, the job's save of step 2
  (training goes on from step 1) replaces it instead of being skipped as
  already committed."""
  _two_steps(tmp_path, value)
  _flip(_chunk_files(tmp_path / "checkpoint_2")[-1])
  with ckpt.Checkpointer(tmp_path, async_save=False) as c:
    assert np.array_equal(c.restore()["w"], value)
    with caplog.at_level(logging.WARNING):
      c.save(2, {"w": value + 20})
    assert any("replacing step 2" in r.getMessage() for r in caplog.records)
    assert c.all_steps() == [1, 2]
    assert np.array_equal(c.restore()["w"], value + 20)
    assert c.last_restore_step == 2


def test_multi_tier_resume_falls_back_in_the_persistent_tier(tmp_path, value):
  """With the local tier gone, a MultiTierCheckpointer resume reads the
  persistent tier and falls back past its damaged newest step;
  last_restore_step names the step whose data came back."""
  opts = dict(local=str(tmp_path / "local"), persistent_interval=1,
              async_save=False)
  with ckpt.MultiTierCheckpointer(str(tmp_path / "p"), **opts) as mt:
    mt.save(1, {"w": value})
    mt.save(2, {"w": value + 1})
    mt.wait_until_finished()
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.rmtree(tmp_path / "local")
  _flip(_chunk_files(tmp_path / "p" / "checkpoint_2")[-1])
  target = {"w": jax.ShapeDtypeStruct(SHAPE, np.float32)}
  with ckpt.MultiTierCheckpointer(str(tmp_path / "p"), **opts) as mt:
    got = mt.restore(target=target)
    assert mt.last_restore_tier == "persistent"
    assert mt.last_restore_step == 1
    assert np.array_equal(np.asarray(got["w"]), value)
