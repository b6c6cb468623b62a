"""crc32c checksums recorded at save; ckpt.integrity.verify and
restore(verify=True) catch flipped bytes, truncated, deleted and swapped
chunks, and an edited index, naming the leaf."""

import os

import jax
import msgpack
import numpy as np
import pytest

import ckpt
from ckpt import checksums
from ckpt import index as index_lib
from tests.conftest import mesh, named, random_array, sharded


@pytest.fixture(params=["zarr", "zarr3"])
def saved(request, make_ckptr, ckpt_dir, rng):
  m = mesh()
  state = {"w": sharded(random_array(rng, (64, 128)), named(m, "data", "model")),
           "r": sharded(random_array(rng, (32, 16)), named(m)),
           "h": random_array(rng, (300,)), "step": 3}
  c = make_ckptr(async_save=False, format=request.param, chunk_bytes=4096)
  c.save(1, state)
  return c, ckpt_dir / "checkpoint_1", state


def _chunks(step_dir, leaf):
  out = []
  for root, _, files in os.walk(step_dir / leaf):
    out += [os.path.join(root, f) for f in files
            if not f.startswith(".") and f != "zarr.json"]
  return sorted(out)


def test_index_records_checksums_covering_every_leaf(saved):
  _, step_dir, state = saved
  idx = index_lib.decode((step_dir / "index.msgpack").read_bytes())
  for e in idx.leaves:
    if isinstance(e, index_lib.ArrayEntry):
      covered = sum(int(np.prod(np.subtract(b, a))) for a, b, _ in e.checksums)
      assert covered == int(np.prod(e.shape)), e.path
      whole = np.asarray(state[e.path[0]])
      for a, b, crc in e.checksums:
        box = tuple(slice(x, y) for x, y in zip(a, b))
        assert checksums.checksum(whole[box]) == crc, (e.path, a, b)


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
  # Leaves that are intact still restore and verify on their own.
  out = c.restore(target={"r": target["r"], "h": state["h"]}, verify=True)
  assert np.array_equal(np.asarray(out["r"]), np.asarray(state["r"]))


def test_edited_checksum_in_index_is_caught(saved, ckpt_dir):
  c, step_dir, state = saved
  doc = msgpack.unpackb((step_dir / "index.msgpack").read_bytes(), raw=False,
                        strict_map_key=False)
  leaf = next(e for e in doc["leaves"] if e["path"] == ["h"])
  leaf["checksums"][0][2] ^= 1
  (step_dir / "index.msgpack").write_bytes(msgpack.packb(doc, use_bin_type=True))
  problems = ckpt.integrity.verify(ckpt_dir)
  assert [p.path for p in problems] == ["h"]
  with pytest.raises(ckpt.CorruptCheckpointError, match="'h'.*crc32c"):
    c.restore(target={"h": state["h"]}, verify=True)
  # without verify the (intact) data restores: the check is what failed
  assert np.array_equal(c.restore(target={"h": state["h"]})["h"], state["h"])


def test_restore_verify_reads_only_overlapping_boxes(saved, ckpt_dir):
  """A flipped byte in a box this process does not read goes unnoticed by
  restore(verify=True) of another leaf, and is caught by full verify."""
  c, step_dir, state = saved
  _flip(_chunks(step_dir, "w")[0])
  out = c.restore(target={"h": state["h"]}, verify=True)
  assert np.array_equal(out["h"], state["h"])
  assert [p.path for p in ckpt.integrity.verify(ckpt_dir)] == ["w"]
