"""``ckpt import`` of an Orbax checkpoint in a bucket (the GCS emulator and
moto's S3 server).

Orbax here cannot write to these buckets itself (its paths go through
etils/fsspec, which needs gcsfs or s3fs), so the step is written to a disk
by Orbax and copied key by key, as ``gsutil cp -r`` would; the layout is
the one Orbax writes to a bucket (OCDBT, relative references only).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import ckpt
from tests.cli.test_cli import assert_one_line_error, run_cli, same
from tests.conftest import mesh, named, sharded
from tests.objectstore import storeutil

ocp = pytest.importorskip("orbax.checkpoint")


def orbax_step(root) -> tuple[str, dict]:
  m = mesh()
  rng = np.random.default_rng(3)
  w = rng.standard_normal((64, 32)).astype(np.float32)
  host = rng.standard_normal((300,)).astype(np.float32)
  with ocp.CheckpointManager(os.fspath(root)) as mgr:
    mgr.save(3, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"w": sharded(w, named(m, "data", "model")),
                                     "host": host, "step": 3}),
        extra=ocp.args.JsonSave({"data_pos": 123})))
    mgr.wait_until_finished()
  return os.path.join(root, "3"), {"w": w, "host": host}


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_import_from_a_bucket(scheme, request, tmp_path):
  bucket = request.getfixturevalue(f"{scheme}_bucket")
  local, want = orbax_step(tmp_path / "orbax")
  src = f"{bucket}/orbax/3"
  assert storeutil.copy_tree(f"file://{local}", src) > 5
  p = run_cli("import", src, tmp_path / "c", "--step", 3, "--json")
  assert p.returncode == 0, p.stderr
  doc = json.loads(p.stdout)
  assert doc["items"] == {"extra": "json", "state": "pytree"}
  got = ckpt.load(tmp_path / "c")
  assert got["extra"] == {"data_pos": 123} and got["state"]["step"] == 3
  for k, v in want.items():
    assert same(got["state"][k], v), k
  with ckpt.Checkpointer(tmp_path / "c") as ckptr:
    assert str(ckptr.metadata(3).shardings["state/w"]) == (
        "NamedSharding(mesh={'data': 2, 'model': 4}, spec=('data', 'model'))")


def test_a_bucket_path_without_an_orbax_checkpoint(gs_bucket, tmp_path):
  p = run_cli("import", f"{gs_bucket}/nothing/3", tmp_path / "c", "--step",
              3)
  assert_one_line_error(p.returncode, p.stdout, p.stderr,
                        "is not an Orbax checkpoint", "_CHECKPOINT_METADATA")


def zarr_item(root) -> str:
  """An Orbax PyTree item with its arrays in zarr directories (a.w/, b/)."""
  path = os.path.join(root, "item")
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)) as c:
    c.save(path, args=ocp.args.PyTreeSave(
        {"a": {"w": np.arange(1000, dtype=np.float32)},
         "b": np.ones(4, np.int32)}))
  return path


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_key_path_out_of_the_item_is_refused_on_buckets(scheme, request,
                                                          tmp_path):
  """Keys [".", "/../victim"] name Orbax array ``../../victim``; on s3://
  the HTTP layer resolved ``<item>/../../victim/`` to another prefix of
  the bucket, whose array the import read. Refused before any array is
  opened."""
  bucket = request.getfixturevalue(f"{scheme}_bucket")
  local = zarr_item(tmp_path)
  for f in os.listdir(os.path.join(local, "b")):
    with open(os.path.join(local, "b", f), "rb") as src:
      storeutil.write_key(bucket, f"victim/{f}", src.read())
  meta = os.path.join(local, "_METADATA")
  with open(meta) as f:
    doc = json.load(f)
  entry = doc["tree_metadata"]["('b',)"]
  entry["key_metadata"] = [{"key": ".", "key_type": 2},
                           {"key": "/../victim", "key_type": 2}]
  with open(meta, "w") as f:
    json.dump(doc, f)
  assert storeutil.copy_tree(f"file://{local}", f"{bucket}/orbax/item") > 4
  p = run_cli("import", f"{bucket}/orbax/item", tmp_path / "c", "--step", 1)
  assert_one_line_error(p.returncode, p.stdout, p.stderr, "_METADATA",
                        "key '.' is not a plain name")
  assert not (tmp_path / "c").exists()


def test_claims_are_checked_against_bytes_stored_in_a_bucket(
    s3_bucket, tmp_path, monkeypatch, capsys):
  """On a bucket the bytes stored come from one-byte ranged reads (its
  listing has no sizes): an honest item passes with no allowance; a
  ``.zarray`` claiming 4 TiB with no chunk is refused before writing."""
  from ckpt.cli import orbax_bounds  # pylint: disable=g-import-not-at-top
  from tests.cli.test_cli import in_process  # pylint: disable=g-import-not-at-top
  local = zarr_item(tmp_path)
  assert storeutil.copy_tree(f"file://{local}", f"{s3_bucket}/ok") > 4
  monkeypatch.setattr(orbax_bounds, "SPARSE_ALLOWANCE", 0)
  rc, _, err = in_process(capsys, "import", f"{s3_bucket}/ok", tmp_path / "c",
                          "--step", 1)
  assert rc == 0, err
  monkeypatch.undo()
  zarray = os.path.join(local, "b", ".zarray")
  with open(zarray) as f:
    z = json.load(f)
  z.update(shape=[2**40], chunks=[2**20])
  with open(zarray, "w") as f:
    json.dump(z, f)
  os.remove(os.path.join(local, "b", "0"))
  with open(os.path.join(local, "_METADATA")) as f:
    doc = json.load(f)
  doc["store_array_data_equal_to_fill_value"] = False
  with open(os.path.join(local, "_METADATA"), "w") as f:
    json.dump(doc, f)
  storeutil.copy_tree(f"file://{local}", f"{s3_bucket}/bad")
  rc, out, err = in_process(capsys, "import", f"{s3_bucket}/bad",
                            tmp_path / "d", "--step", 1)
  assert_one_line_error(rc, out, err, "claim 4398046", "less than",
                        "b/.zarray", "--allow-sparse")
  assert not (tmp_path / "d").exists()
