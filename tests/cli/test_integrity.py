"""crc32c checksums taken at save; ckpt.integrity.verify and
restore(verify=True) catch flipped bytes, truncated, deleted and swapped
chunks, and edited checksums, naming the leaf.

zarr3 / ocdbt: every chunk carries zarr3's crc32c codec (every read checks
it); zarr v2: each process's ``.checksums/<process>.msgpack``; indexes
written before both carry the checksums in their entries.
"""

import dataclasses
import json
import os
import shutil

import jax
import msgpack
from tests import sealed
from ckpt.format import seal
import numpy as np
import pytest

import ckpt
import tensorstore as ts

from ckpt.restore import checksums
from ckpt.format import crc as crc_lib
from ckpt.format import index as index_lib
from ckpt.format import index_codec
from ckpt.store import ocdbt
from ckpt.store import storage as storage_lib
from ckpt.format import tree
from ckpt.format import tsspec
from tests.conftest import mesh, named, random_array, sharded


@pytest.fixture(scope="module", autouse=True)
def _arrays_only(arrays_only):
  """Small test arrays stay TensorStore arrays (tests/save/test_pack.py covers
  packed leaves)."""
  del arrays_only


@pytest.fixture(params=["zarr", "zarr3", "zarr3+crc32c"])
def saved(request, make_ckptr, ckpt_dir, rng):
  m = mesh()
  state = {"w": sharded(random_array(rng, (64, 128)), named(m, "data", "model")),
           "r": sharded(random_array(rng, (32, 16)), named(m)),
           "h": random_array(rng, (300,)), "step": 3}
  fmt, _, crc = request.param.partition("+")
  c = make_ckptr(async_save=False, format=fmt, chunk_bytes=4096,
                 chunk_checksums=bool(crc))
  c.save(1, state)
  return c, ckpt_dir / "checkpoint_1", state


def _chunks(step_dir, leaf):
  out = []
  for root, _, files in os.walk(step_dir / leaf):
    out += [os.path.join(root, f) for f in files
            if not f.startswith(".") and f != "zarr.json"]
  return sorted(out)


def _file_boxes(step_dir, idx):
  """{leaf path: [(start, stop, crc)]} from the per-process checksum files."""
  out = {}
  for p in range(idx.process_count):
    doc = sealed.unpackb(
        (step_dir / index_lib.process_file(index_lib.CHECKSUMS_DIR, p)
         ).read_bytes(), raw=False)
    assert doc["process"] == p
    for leaf, a, b, crc in doc["boxes"]:
      out.setdefault(idx.leaves[leaf].path, []).append((a, b, crc))
  return out


def test_checksums_cover_every_leaf(saved):
  _, step_dir, state = saved
  idx = index_lib.decode((step_dir / "index.msgpack").read_bytes())
  arrays = [e for e in idx.leaves if isinstance(e, index_lib.ArrayEntry)]
  assert arrays and all(not e.checksums for e in arrays)  # not in the index
  if arrays[0].codec.get("checksum") == "crc32c":
    assert not (step_dir / index_lib.CHECKSUMS_DIR).exists()
    for e in arrays:
      assert e.codec["checksum"] == "crc32c", e
      meta = json.loads((step_dir / e.relpath / "zarr.json").read_text())
      assert meta["codecs"][-1] == {"name": "crc32c"}, meta
    return
  boxes = _file_boxes(step_dir, idx)
  for e in arrays:
    assert "checksum" not in e.codec, e
    covered = sum(int(np.prod(np.subtract(b, a))) for a, b, _ in boxes[e.path])
    assert covered == int(np.prod(e.shape)), e.path
    whole = np.asarray(state[e.path[0]])
    for a, b, crc in boxes[e.path]:
      box = tuple(slice(x, y) for x, y in zip(a, b))
      assert crc_lib.checksum(whole[box]) == crc, (e.path, a, b)


def test_clean_checkpoint_verifies(saved, ckpt_dir):
  assert ckpt.integrity.verify(ckpt_dir) == []
  assert ckpt.integrity.verify(ckpt_dir / "checkpoint_1") == []


def _flip(path, offset=-5):
  b = bytearray(open(path, "rb").read())
  b[offset] ^= 0x10
  open(path, "wb").write(bytes(b))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "swap"])
def test_damaged_chunk_is_reported_with_its_leaf(saved, ckpt_dir, damage):
  c, step_dir, state = saved
  codec_checked = c.restore(lazy=True)["w"].entry.codec.get("checksum")
  if codec_checked and damage == "swap":
    pytest.skip("known limit of the crc32c codec: it covers a chunk's bytes, "
                "not its place, so two swapped (whole, same-shape) chunks "
                "each verify")
  files = _chunks(step_dir, "w")
  assert len(files) >= 2
  if damage == "flip":
    _flip(files[1])
  elif damage == "truncate":
    with open(files[1], "r+b") as f:
      f.truncate(os.path.getsize(files[1]) // 2)
  elif damage == "delete":
    os.remove(files[1])
  else:  # two chunks trade places: each is a valid chunk, in the wrong spot
    a, b = open(files[0], "rb").read(), open(files[1], "rb").read()
    open(files[0], "wb").write(b)
    open(files[1], "wb").write(a)
  problems = ckpt.integrity.verify(ckpt_dir)
  assert [p.path for p in problems] == ["w"], problems
  assert "'w'" in problems[0].message
  target = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      if isinstance(x, jax.Array) else x, state)
  with pytest.raises(ckpt.CorruptCheckpointError, match="'w'"):
    c.restore(target=target, verify=True)
  if codec_checked:  # zarr3: every read is checked, verify or not
    with pytest.raises(ckpt.CorruptCheckpointError, match="'w'"):
      c.restore(target=target)
  # Leaves that are intact still restore and verify on their own.
  out = c.restore(target={"r": target["r"], "h": state["h"]}, verify=True)
  assert np.array_equal(np.asarray(out["r"]), np.asarray(state["r"]))


def test_edited_checksum_file_is_caught(saved, ckpt_dir):
  c, step_dir, state = saved
  if c.restore(lazy=True)["h"].entry.codec.get("checksum"):
    pytest.skip("zarr3: no checksum file (the chunks carry theirs)")
  idx = index_lib.decode((step_dir / "index.msgpack").read_bytes())
  h = next(i for i, e in enumerate(idx.leaves) if e.path == ("h",))
  path = step_dir / index_lib.process_file(index_lib.CHECKSUMS_DIR, 0)
  doc = sealed.unpackb(path.read_bytes(), raw=False)
  next(r for r in doc["boxes"] if r[0] == h)[3] ^= 1
  path.write_bytes(sealed.packb(doc, use_bin_type=True))
  problems = ckpt.integrity.verify(ckpt_dir)
  assert [p.path for p in problems] == ["h"]
  with pytest.raises(ckpt.CorruptCheckpointError, match="'h'.*crc32c"):
    c.restore(target={"h": state["h"]}, verify=True)
  # without verify the (intact) data restores: the check is what failed
  assert np.array_equal(c.restore(target={"h": state["h"]}, verify=False)["h"],
                        state["h"])


def test_restore_verify_reads_only_overlapping_boxes(saved, ckpt_dir):
  """A flipped byte in a box this process does not read goes unnoticed by
  restore(verify=True) of another leaf, and is caught by full verify."""
  c, step_dir, state = saved
  _flip(_chunks(step_dir, "w")[0])
  out = c.restore(target={"h": state["h"]}, verify=True)
  assert np.array_equal(out["h"], state["h"])
  assert [p.path for p in ckpt.integrity.verify(ckpt_dir)] == ["w"]


# ---- zarr v2: the per-process checksum files ---------------------------------

def _zarr_saved(make_ckptr, rng, ckpt_dir):
  m = mesh()
  state = {"w": sharded(random_array(rng, (64, 128)), named(m, "data", "model")),
           "h": random_array(rng, (300,))}
  c = make_ckptr(async_save=False, format="zarr", chunk_bytes=4096)
  c.save(1, state)
  return c, ckpt_dir / "checkpoint_1", state


def test_missing_checksum_file_makes_leaves_unverifiable(make_ckptr, rng,
                                                         ckpt_dir):
  c, step_dir, state = _zarr_saved(make_ckptr, rng, ckpt_dir)
  os.remove(step_dir / index_lib.process_file(index_lib.CHECKSUMS_DIR, 0))
  problems = ckpt.integrity.verify(ckpt_dir)
  assert [p.path for p in problems] == ["h", "w"], problems
  for p in problems:
    assert "cannot be verified" in p.message, p
    assert ".checksums/0.msgpack" in p.message and "missing" in p.message, p
  with pytest.raises(ckpt.CorruptCheckpointError,
                     match="'h' cannot be verified.*missing"):
    c.restore(target={"h": state["h"]}, verify=True)
  # Unverifiable is not unreadable: without verify it restores.
  assert np.array_equal(
      c.restore(target={"h": state["h"]}, verify=False)["h"], state["h"])


@pytest.mark.parametrize("content,fragment", [
    (seal.seal(b"\xc1garbage"), "not a valid msgpack"),
    (b"\xc1garbage", "expected a crc32c trailer"),
    (sealed.packb({"process": 0, "boxes": []})[:-1] + b"\0", "crc32c"),
    (sealed.packb({"process": 1, "boxes": []}), "'process': 0"),
    (sealed.packb({"process": 0, "boxes": [[9, [0], [1], 0]]}),
     "array leaf number"),
    (sealed.packb({"process": 0, "boxes": [[1, [0], [301], 0]]}),
     "not inside the leaf's shape"),
    (sealed.packb({"process": 0, "boxes": [[1, [0], [1], -1]]}),
     "array leaf number, start, stop, crc32c"),
])
def test_hostile_checksum_file_is_refused(make_ckptr, rng, ckpt_dir, content,
                                          fragment):
  c, step_dir, state = _zarr_saved(make_ckptr, rng, ckpt_dir)
  idx = index_lib.decode((step_dir / "index.msgpack").read_bytes())
  assert [e.path for e in idx.leaves] == [("h",), ("w",)]
  (step_dir / index_lib.process_file(index_lib.CHECKSUMS_DIR, 0)
   ).write_bytes(content)
  problems = ckpt.integrity.verify(ckpt_dir)
  assert [p.path for p in problems] == ["h", "w"], problems
  assert fragment in problems[0].message, problems[0]
  assert "cannot be verified" in problems[0].message


def test_checksum_file_names_come_from_the_process_count(make_ckptr, rng,
                                                         ckpt_dir):
  """A process count the index claims beyond the limit is refused; names
  are never read from the files."""
  c, step_dir, state = _zarr_saved(make_ckptr, rng, ckpt_dir)
  doc = sealed.unpackb((step_dir / "index.msgpack").read_bytes(), raw=False)
  doc["process_count"] = 2
  (step_dir / "index.msgpack").write_bytes(sealed.packb(doc,
                                                         use_bin_type=True))
  problems = ckpt.integrity.verify(ckpt_dir)
  assert problems and all(".checksums/1.msgpack" in p.message
                          for p in problems), problems
  with pytest.raises(ckpt.CheckpointError):
    index_lib.process_file(index_lib.CHECKSUMS_DIR, -1)
  with pytest.raises(ckpt.CheckpointError):
    index_lib.process_file(index_lib.CHECKSUMS_DIR, index_lib.MAX_PROCESSES)
  with pytest.raises(ValueError):
    index_lib.process_file("../x", 0)


# ---- zarr3 and ocdbt: the crc32c codec ---------------------------------------

def _ocdbt_chunk_files(step_dir, leaf_relpath):
  """[(data file, offset, length)] of each stored chunk of a leaf inside
  the OCDBT data files of the step."""
  storage = storage_lib.Storage(str(step_dir.parent))
  kv = ts.KvStore.open(ocdbt.database(storage.step_spec(step_dir.name)),
                       context=storage.context()).result()
  out = []
  for key in kv.list().result():
    if not key.startswith(f"{leaf_relpath}/c/".encode()):
      continue
    value = kv.read(key).result().value
    for root, _, files in os.walk(step_dir):
      for f in files:
        if "/d" not in root[len(str(step_dir)):]:
          continue
        path = os.path.join(root, f)
        i = open(path, "rb").read().find(value)
        if i >= 0:
          out.append((path, i, len(value)))
  return out


@pytest.mark.parametrize("fmt", ["zarr3", "ocdbt"])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_flipped_byte_in_a_checksummed_chunk(make_ckptr, rng, ckpt_dir, fmt,
                                             compression):
  m = mesh()
  state = {"w": sharded(random_array(rng, (64, 128)), named(m, "data", "model")),
           "h": random_array(rng, (300,))}
  c = make_ckptr(async_save=False, format=fmt, chunk_bytes=4096,
                 compression=compression, chunk_checksums=True)
  c.save(1, state)
  step_dir = ckpt_dir / "checkpoint_1"
  if fmt == "zarr3":
    path = _chunks(step_dir, "w")[1]
    offset = os.path.getsize(path) // 2  # inside the (compressed) data
  else:
    chunks = _ocdbt_chunk_files(step_dir, "w")
    assert len(chunks) >= 2, chunks
    path, start, length = chunks[1]
    offset = start + length // 2
  assert ckpt.integrity.verify(ckpt_dir) == []
  _flip(path, offset)
  with pytest.raises(ckpt.CorruptCheckpointError, match="leaf 'w'") as e:
    c.restore()
  assert any(s in str(e.value) for s in ("Digest mismatch", "corrupt",
                                         "Corrupt")), e.value
  problems = ckpt.integrity.verify(ckpt_dir)
  assert [p.path for p in problems] == ["w"], problems
  assert "leaf 'w'" in problems[0].message
  with pytest.raises(ckpt.CorruptCheckpointError, match="leaf 'w'"):
    c.restore(verify=True)
  # The other leaf is intact and reads on its own.
  assert np.array_equal(c.restore(target={"h": state["h"]})["h"], state["h"])


def test_verify_by_reading_splits_large_leaves():
  box = checksums.Box((0, 0), (100, 64))
  parts = checksums.read_boxes(box, (10, 16), 4, 10 * 64 * 4 * 3)
  assert [p.start[0] for p in parts] == [0, 30, 60, 90]
  assert all(p.stop[1] == 64 for p in parts)
  # A chunk row larger than the limit: split along the next dimension.
  parts = checksums.read_boxes(box, (10, 16), 4, 10 * 16 * 4)
  assert len(parts) == 40 and sum(p.size for p in parts) == box.size
  parts = checksums.read_boxes(box, (100, 64), 4, 1)  # one chunk: whole
  assert parts == [box]


# ---- indexes written before the checksum codec and the per-process files -----

def _to_old_layout(step_dir, per_box_sums, host_states):
  """Rewrites a step as an older ckpt wrote it: checksums in the entries,
  every process's host_state in the index, no per-process files."""
  doc = sealed.unpackb((step_dir / "index.msgpack").read_bytes(), raw=False)
  doc["version"] = 1  # one map per leaf, every relpath spelled out
  doc["leaves"] = index_codec.rows(doc["leaves"])
  doc["structure"] = tree.named(  # leaves by path, not number
      doc["structure"], [tree.path_str(tuple(e["path"])) for e in doc["leaves"]])
  for i, e in enumerate(doc["leaves"]):
    if e["kind"] == "array":
      e.setdefault("relpath", tree.storage_relpath(tuple(e["path"])))
      e["codec"].pop("checksum", None)
      e["checksums"] = [list(map(list, (a, b))) + [crc]
                        for a, b, crc in per_box_sums[i]]
  doc["host_state"] = [sealed.packb(h) for h in host_states]
  (step_dir / "index.msgpack").write_bytes(sealed.packb(doc,
                                                         use_bin_type=True))
  for d in (index_lib.CHECKSUMS_DIR, index_lib.HOST_STATE_DIR):
    shutil.rmtree(step_dir / d, ignore_errors=True)


def _boxes_of(state, idx):
  out = {}
  for i, e in enumerate(idx.leaves):
    if isinstance(e, index_lib.ArrayEntry):
      whole = np.asarray(state[e.path[0]])
      # one box per row block of 16
      out[i] = [((a,) + (0,) * (whole.ndim - 1),
                 (min(a + 16, whole.shape[0]),) + whole.shape[1:],
                 crc_lib.checksum(whole[a:a + 16]))
                for a in range(0, whole.shape[0], 16)]
  return out


@pytest.mark.parametrize("fmt", ["zarr", "zarr3"])
def test_old_index_with_checksums_and_host_state_still_works(
    make_ckptr, rng, ckpt_dir, fmt):
  state = {"w": random_array(rng, (64, 128)), "h": random_array(rng, (300,)),
           "n": 7}
  c = make_ckptr(async_save=False, format=fmt, chunk_bytes=4096)
  if fmt == "zarr3":  # arrays as an older ckpt wrote them: no crc32c codec
    saver = c._saver  # pylint: disable=protected-access
    saver.settings = dataclasses.replace(saver.settings, options=(
        dataclasses.replace(saver.settings.options,
                            codec=tsspec.Codec(checksum="none"))))
  c.save(1, state, host_state={"rng": 11})
  step_dir = ckpt_dir / "checkpoint_1"
  idx = index_lib.decode((step_dir / "index.msgpack").read_bytes())
  _to_old_layout(step_dir, _boxes_of(state, idx), [{"rng": 11}])
  old = index_lib.decode((step_dir / "index.msgpack").read_bytes())
  assert old.host_state is not None and all(
      e.checksums for e in old.leaves if isinstance(e, index_lib.ArrayEntry))
  assert "checksum" not in old.leaves[0].codec
  c.reload()
  assert c.host_state(1) == {"rng": 11}
  assert ckpt.integrity.verify(ckpt_dir) == []
  out = c.restore(verify=True)
  assert np.array_equal(out["w"], state["w"]) and out["n"] == 7
  # The checksums in the entries are what is checked.
  _flip(_chunks(step_dir, "w")[1])
  assert [p.path for p in ckpt.integrity.verify(ckpt_dir)] == ["w"]
  with pytest.raises(ckpt.CorruptCheckpointError, match="'w'.*crc32c"):
    c.restore(verify=True)


def test_checksum_records_of_every_process_are_held_compactly(tmp_path):
  """restore(verify=True) on format "zarr": every process reads every
  saving process's checksum file, so what a record costs once read is what
  a 1,000-host job multiplies. 64,000 records (2 processes x 1,000 leaves x
  32 row boxes): the records come back exact, and they are held in under
  80 bytes each (Python tuples took about 305)."""
  import asyncio  # pylint: disable=g-import-not-at-top
  import tracemalloc  # pylint: disable=g-import-not-at-top
  leaves = tuple(index_lib.ArrayEntry(
      path=(f"l{i}",), relpath=f"l{i}", shape=(4096, 4096), dtype="float32",
      chunks=(64, 4096), codec={}, source_dtype="float32")
      for i in range(1000))
  idx = index_lib.Index(step=1, time=0.0, storage_format="zarr",
                        process_count=2, structure={}, leaves=leaves)
  def records(p):
    return [[i, [r * 64, 0], [r * 64 + 64, 4096], (i * 64 + r) * 7919 % 2**32]
            for i in range(1000) for r in range(p * 32, p * 32 + 32)]
  for p in range(2):
    path = tmp_path / index_lib.process_file(index_lib.CHECKSUMS_DIR, p)
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(sealed.packb({"process": p, "boxes": records(p)}))
  table = checksums.ProcessChecksums(storage_lib.Storage(str(tmp_path)), "",
                                     idx)

  class Leaf:  # what ProcessChecksums.boxes reads of a lazy leaf
    def __init__(self, e):
      self.entry, self.path = e, e.relpath

  tracemalloc.start()
  try:
    before = tracemalloc.get_traced_memory()[0]
    first = asyncio.run(table.boxes(Leaf(leaves[0])))
    held = tracemalloc.get_traced_memory()[0] - before
  finally:
    tracemalloc.stop()
  want = sorted((tuple(a), tuple(b), c) for p in range(2)
                for i, a, b, c in records(p) if i == 0)
  assert sorted(first) == want
  last = sorted(asyncio.run(table.boxes(Leaf(leaves[999]))))
  assert len(last) == 64 and last[0][0] == (0, 0) and last[-1][1] == (
      4096, 4096)
  assert held / 64000 < 80, held / 64000
