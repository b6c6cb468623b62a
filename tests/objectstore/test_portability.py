"""A checkpoint copied between stores, or moved, restores bit for bit.

The copies are made key by key with no knowledge of ckpt (as ``gsutil cp
-r`` or ``aws s3 cp --recursive`` would); the index holds only relative
paths and the driver comes from the URL a checkpoint is opened with.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from tests.objectstore import storeutil


def make_state(seed: int) -> dict:
  rng = np.random.default_rng(seed)
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
  w = rng.standard_normal((256, 128), np.float32)
  return {
      "w": jax.device_put(w, NamedSharding(mesh, P("a", "b"))),
      "e": rng.integers(0, 1 << 30, (1000, 8), dtype=np.int32),
      "tiny": np.float32(3.5), "name": "portable",
  }


def target_on_other_mesh() -> dict:
  mesh = Mesh(np.array(jax.devices()).reshape(8), ("x",))
  return {"w": jax.ShapeDtypeStruct((256, 128), np.float32,
                                    sharding=NamedSharding(mesh, P(None, "x"))),
          "e": jax.ShapeDtypeStruct((1000, 8), np.int32,
                                    sharding=NamedSharding(mesh, P("x"))),
          "tiny": np.float32(0), "name": ""}


def assert_restores(url: str, state: dict, step: int) -> None:
  want = {k: np.asarray(v) for k, v in state.items() if k in ("w", "e")}
  with ckpt.Checkpointer(url) as ckptr:
    assert ckptr.all_steps() == [step]
    got = ckptr.restore(step, target=target_on_other_mesh())
  for k, v in want.items():
    assert isinstance(got[k], jax.Array)
    assert np.asarray(got[k]).tobytes() == v.tobytes(), f"{url}: {k} differs"
  assert got["tiny"] == state["tiny"] and got["name"] == state["name"]
  loaded = ckpt.load(url, step=step)
  for k, v in want.items():
    assert loaded[k].tobytes() == v.tobytes(), f"{url} (load): {k} differs"


@pytest.mark.parametrize("fmt", ["ocdbt", "zarr3"])
def test_bucket_to_disk_to_bucket(fmt, s3_bucket, gs_bucket, tmp_path):
  state = make_state(1)
  src = f"{s3_bucket}/run"
  with ckpt.Checkpointer(src, format=fmt) as ckptr:
    ckptr.save(7, state)
  # Bucket -> disk; then the bucket copy goes away: the disk copy must not
  # read from anywhere else.
  disk = str(tmp_path / "from-s3")
  assert storeutil.copy_tree(src, disk) > 0
  for k in storeutil.keys(src):
    storeutil.delete_key(src, k)
  assert storeutil.keys(src) == []
  assert_restores(disk, state, 7)
  assert_restores(f"file://{disk}", state, 7)
  # Disk -> another store's bucket.
  dst = f"{gs_bucket}/copied/run"
  storeutil.copy_tree(disk, dst)
  assert_restores(dst, state, 7)


def test_disk_to_bucket_and_moved_directory(s3_bucket, tmp_path):
  state = make_state(2)
  first = tmp_path / "first"
  with ckpt.Checkpointer(str(first), format="ocdbt", async_save=False) as ckptr:
    ckptr.save(3, state)
  # A checkpoint saved on a disk carries its commit marker, so it is
  # committed once copied to a bucket.
  storeutil.copy_tree(str(first), f"{s3_bucket}/from-disk")
  assert_restores(f"{s3_bucket}/from-disk", state, 3)
  # Moved on the disk: the merged OCDBT database refers to its files by
  # paths relative to the step directory.
  moved = tmp_path / "elsewhere" / "moved"
  moved.parent.mkdir()
  os.rename(first, moved)
  assert_restores(str(moved), state, 3)
  # One step directory on its own.
  assert ckpt.load(str(moved / "checkpoint_3"))["w"].tobytes() == (
      np.asarray(state["w"]).tobytes())


def test_bucket_copy_without_its_marker_is_not_committed(s3_bucket, gs_bucket):
  """A partial copy (everything but the commit record and the marker) is
  not a checkpoint: in a root with records (``commits/complete``) the
  record is what makes a step committed, the marker alone does not."""
  state = make_state(3)
  src = f"{gs_bucket}/run"
  with ckpt.Checkpointer(src, format="zarr") as ckptr:
    ckptr.save(1, state)
  dst = f"{s3_bucket}/partial"
  storeutil.copy_tree(src, dst)
  storeutil.delete_key(dst, "commits/1")
  with ckpt.Checkpointer(dst) as ckptr:
    assert ckptr.all_steps() == []
  storeutil.delete_key(dst, "checkpoint_1/commit_success")
  with ckpt.Checkpointer(dst) as ckptr:
    assert ckptr.all_steps() == []
  # Read explicitly as one step directory, it is still readable.
  loaded = ckpt.load(f"{dst}/checkpoint_1")
  assert loaded["e"].tobytes() == state["e"].tobytes()
