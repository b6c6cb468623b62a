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
