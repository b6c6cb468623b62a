"""Raw zarr chunks read straight from their files into the restored
array's memory, each chunk's crc32c taken as it arrives
(ckpt/restore/rawread.py), with every verification guarantee kept."""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from ckpt.format import index as index_lib
from ckpt.restore import rawread
from ckpt.restore import verified
from ckpt.shards.plan import Box

SHAPE = (256, 512)  # float32: 512 KiB, stored (not packed)


def _mesh(rows: int, cols: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:rows * cols]).reshape(rows, cols),
              ("a", "b"))


@pytest.fixture
def value():
  return np.random.default_rng(1).standard_normal(SHAPE, dtype=np.float32)


def _save(path, value, mesh, spec):
  x = jax.device_put(value, NamedSharding(mesh, spec))
  with ckpt.Checkpointer(path, async_save=False) as c:
    c.save(1, {"w": x})
  index = index_lib.decode((path / "checkpoint_1" / "index.msgpack"
                            ).read_bytes(), "index")
  [entry] = index.leaves
  return path / "checkpoint_1" / entry.relpath.strip("/"), tuple(entry.chunks)


def _target(mesh, spec):
  return {"w": jax.ShapeDtypeStruct(SHAPE, np.float32,
                                    sharding=NamedSharding(mesh, spec))}


@pytest.mark.parametrize("saved,restored,spec", [
    ((2, 4), (2, 4), P("a", "b")),         # the same mesh: a box is a chunk
    ((1, 8), (1, 4), P(None, "b")),        # chunks side by side: strided
    ((8, 1), (4, 1), P("a", None)),        # chunks one above the other
])
def test_verified_restore_sums_each_chunk_as_it_reads_it(
    tmp_path, value, monkeypatch, saved, restored, spec):
  """A verified restore whose boxes are whole raw chunks returns the exact
  data and checks every chunk against its record from the crc32c taken
  while reading it: no second pass over the restored memory (before, each
  chunk was summed again after the read, checksum_view)."""
  _save(tmp_path, value, _mesh(*saved), spec)
  passes = []
  real = verified.checksum_view
  monkeypatch.setattr(verified, "checksum_view",
                      lambda v: passes.append(v.nbytes) or real(v))
  with ckpt.Checkpointer(tmp_path) as c:
    got = c.restore(1, target=_target(_mesh(*restored), spec))["w"]
  np.testing.assert_array_equal(np.asarray(got), value)
  assert passes == []


def test_flipped_byte_in_a_strided_chunk_names_that_chunk(tmp_path, value):
  """Chunks placed side by side in one restored box (read row by row into
  their columns): a flipped byte in one still fails the restore, naming
  the leaf and that chunk's file; verify=False returns exactly the stored
  bytes, each chunk in its place."""
  where, chunks = _save(tmp_path, value, _mesh(1, 8), P(None, "b"))
  assert chunks == (256, 64)
  victim = where / "0.5"
  data = bytearray(victim.read_bytes())
  data[1000] ^= 0x10
  victim.write_bytes(bytes(data))
  damaged = value.copy()
  damaged[:, 320:384] = np.frombuffer(bytes(data), np.float32).reshape(256, 64)
  target = _target(_mesh(1, 4), P(None, "b"))
  with ckpt.Checkpointer(tmp_path) as c:
    with pytest.raises(ckpt.CorruptCheckpointError,
                       match=r"leaf 'w': box \[0, 320\]\.\.\[256, 384\] "
                       r"\(stored in .*checkpoint_1.*/0\.5\) has crc32c"):
      c.restore(1, target=target)
    got = c.restore(1, target=target, verify=False)["w"]
  np.testing.assert_array_equal(np.asarray(got), damaged)


@pytest.mark.parametrize("change", ["truncated", "longer", "missing"])
def test_chunk_file_not_one_chunk_fails_naming_the_leaf(tmp_path, value,
                                                         change):
  """A chunk file missing, or not exactly one chunk's bytes, is not read
  raw: the read goes through TensorStore, which refuses it naming the
  leaf, verified or not."""
  where, _ = _save(tmp_path, value, _mesh(2, 4), P("a", "b"))
  victim = where / "1.2"
  data = victim.read_bytes()
  if change == "missing":
    victim.unlink()
  else:
    victim.write_bytes(data[:-4] if change == "truncated" else data + b"\0")
  target = _target(_mesh(2, 4), P("a", "b"))
  with ckpt.Checkpointer(tmp_path) as c:
    for verify in (True, False):
      with pytest.raises(ckpt.CorruptCheckpointError, match=r"leaf 'w'"):
        c.restore(1, target=target, verify=verify)


def test_only_whole_chunks_inside_the_array_are_read_raw():
  """``parts``: the chunks that make up a box exactly, or None for a box
  that cuts a chunk or holds an edge chunk (stored padded in zarr v2)."""
  files = rawread.ChunkFiles("/nowhere", (100, 64), (32, 64), np.float32)
  assert files.parts(Box((32, 0), (96, 64))) == [
      Box((32, 0), (64, 64)), Box((64, 0), (96, 64))]
  assert files.parts(Box((0, 0), (16, 64))) is None    # half a chunk
  assert files.parts(Box((64, 0), (100, 64))) is None  # an edge chunk
  assert files.parts(Box((16, 0), (48, 64))) is None   # off the grid


def test_only_raw_local_zarr_is_read_raw(tmp_path, value):
  """Compressed chunks, zarr3 and ocdbt, and object stores go through
  TensorStore."""
  x = jax.device_put(value, NamedSharding(_mesh(2, 4), P("a", "b")))
  for fmt, compression in (("zarr", None), ("zarr", "zstd"),
                           ("zarr3", None), ("ocdbt", None)):
    path = tmp_path / f"{fmt}-{compression}"
    with ckpt.Checkpointer(path, format=fmt, compression=compression,
                           async_save=False) as c:
      c.save(1, {"w": x})
    index = index_lib.decode((path / "checkpoint_1" / "index.msgpack"
                              ).read_bytes(), "index")
    [entry] = index.leaves
    kvstore = {"driver": "file", "path": str(path / "checkpoint_1") + "/"}
    got = rawread.ChunkFiles.of(fmt, kvstore, entry)
    assert (got is not None) == (fmt == "zarr" and compression is None)
    if got is not None:
      assert rawread.ChunkFiles.of(
          fmt, {"driver": "s3", "bucket": "b", "path": "p/"}, entry) is None


def test_long_strided_runs_are_read_in_place(tmp_path, monkeypatch):
  """Chunks side by side whose rows are long (>= LONG_RUN_BYTES) are read
  row by row straight into place; a flipped byte still names its chunk."""
  shape = (4, 131072)  # chunks of (4, 16384) float32: rows of 64 KiB
  value = np.random.default_rng(2).standard_normal(shape, dtype=np.float32)
  x = jax.device_put(value, NamedSharding(_mesh(1, 8), P(None, "b")))
  with ckpt.Checkpointer(tmp_path, async_save=False) as c:
    c.save(1, {"w": x})
  scratch = []
  real = rawread._read_through_scratch
  monkeypatch.setattr(rawread, "_read_through_scratch",
                      lambda *a: scratch.append(1) or real(*a))
  target = {"w": jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(
      _mesh(1, 4), P(None, "b")))}
  with ckpt.Checkpointer(tmp_path) as c:
    got = c.restore(1, target=target)["w"]
  np.testing.assert_array_equal(np.asarray(got), value)
  assert scratch == []
  [victim] = [p for p in (tmp_path / "checkpoint_1").rglob("0.3")]
  data = bytearray(victim.read_bytes())
  data[-5] ^= 0x01
  victim.write_bytes(bytes(data))
  with ckpt.Checkpointer(tmp_path) as c:
    with pytest.raises(ckpt.CorruptCheckpointError,
                       match=r"leaf 'w': box \[0, 49152\]\.\.\[4, 65536\] "
                       r"\(stored in .*/0\.3\)"):
      c.restore(1, target=target)


def test_plan_finds_the_records_that_tile_a_box_by_look_up():
  """A box made of whole recorded chunks is planned by one look-up a
  chunk (a scan of every record of the leaf per box cost ~0.1 ms, 50 ms of
  a verified restore of 256 boxes); a missing record still refuses it."""
  records = [((r, c), (r + 2, c + 2), r * 8 + c)
             for r in range(0, 8, 2) for c in range(0, 8, 2)]
  sums = verified.BoxSums.of(records, 2, "where", str, (2, 2))
  box = Box((2, 0), (6, 8))
  at, rows = verified.plan(sums, box, "w")
  assert at == box
  assert {sums.box(i) for i in rows.tolist()} == {
      Box((r, c), (r + 2, c + 2)) for r in (2, 4) for c in (0, 2, 4, 6)}
  assert sums.tiling(Box((1, 0), (3, 2))) is None  # off the grid
  holed = verified.BoxSums.of(records[:-1], 2, "where", str, (2, 2))
  assert holed.tiling(Box((6, 0), (8, 8))) is None
  with pytest.raises(ckpt.CorruptCheckpointError, match="cover 12 of the 16"):
    verified.plan(holed, Box((6, 0), (8, 8)), "w")
