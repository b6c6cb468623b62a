"""Sharded save and restore across real ``jax.distributed`` processes, into
buckets on real servers (moto's S3, the GCS emulator) and OCDBT on disk.

The jobs run ``tests.multiprocess.sharded_worker`` (the training-state-like
tree of the disk tests, checked bit for bit) with checkpoint URLs instead of
paths; the workers reach the servers only through the standard environment
variables (AWS_ENDPOINT_URL, AWS_REGION, AWS credentials,
TENSORSTORE_GCS_HTTP_URL). Launches are chained as in the disk tests:

1. 2 processes x 4 devices save step 1 into every store x format below;
2. 4 x 2 restore step 1 onto other shardings, check every shard, and save
   what they restored as step 2 (four processes, four OCDBT databases to
   merge);
3. this test process (one process, 8 devices) restores step 2 onto a third
   mesh and with ``ckpt.load``, and checks it the same way.

The GCS emulator runs with the two pieces of the GCS API it lacks added (see
``tests/objectstore/gcs_emulator.py``); without them every listing and
multi-process restore fails there, in any format.
"""

from __future__ import annotations

import os
import pathlib
import re

import pytest

from ckpt.multihost import local_cluster
from tests.multiprocess import sharded_worker as worker
from tests.multiprocess import worker as worker_lib
from tests.multiprocess.test_sharded import all_leaf_paths, assert_balanced
from tests.objectstore import servers
from tests.objectstore import storeutil

REPO = pathlib.Path(__file__).resolve().parents[2]
WORKER = "tests.multiprocess.sharded_worker"
LAUNCH_TIMEOUT_S = 240
# name -> (store, Checkpointer options).
CKPTS = {
    "s3-zarr": ("s3", {"format": "zarr"}),
    "s3-zarr3": ("s3", {"format": "zarr3", "async_save": True}),
    "s3-ocdbt": ("s3", {"format": "ocdbt", "async_save": True}),
    "gs-zarr3": ("gs", {"format": "zarr3", "compression": "zstd"}),
    "gs-ocdbt": ("gs", {"format": "ocdbt"}),
    "disk-ocdbt": ("disk", {"format": "ocdbt", "compression": "zstd"}),
}
OCDBT_KEYS_PER_STEP_MAX = 48


@pytest.fixture(scope="module")
def env(s3_server, gcs_server):
  """The servers' standard variables, in this process for the module."""
  saved = dict(os.environ)
  env = {**s3_server.env, **gcs_server.env}
  os.environ.update(env)
  yield env
  os.environ.clear()
  os.environ.update(saved)


@pytest.fixture(scope="module")
def ckpts(env, s3_server, gcs_server, tmp_path_factory) -> dict[str, dict]:
  del env
  buckets = {"s3": servers.new_bucket(s3_server),
             "gs": servers.new_bucket(gcs_server)}
  disk = tmp_path_factory.mktemp("mp-ocdbt")
  out = {}
  for name, (store, opts) in CKPTS.items():
    where = str(disk / name) if store == "disk" else f"{buckets[store]}/run/{name}"
    out[name] = {**opts, "dir": where}
  return out


def launch(config: dict, env: dict, num_processes: int, devices: int):
  results = local_cluster.run(
      WORKER, config, num_processes=num_processes, devices_per_process=devices,
      timeout_s=LAUNCH_TIMEOUT_S, extra_env=env, cwd=str(REPO))
  out = local_cluster.check(results)
  assert [r["process"] for r in out] == list(range(num_processes))
  result = worker.Saved if config["op"] == "save" else worker.Restored
  return [worker_lib.decode(result, r) for r in out]


@pytest.fixture(scope="module")
def saved_2x4(ckpts, env):
  return launch({"op": "save", "ckpts": ckpts, "step": 1}, env, 2, 4)


@pytest.fixture(scope="module")
def restored_4x2(ckpts, env, saved_2x4):
  del saved_2x4
  return launch({"op": "restore", "ckpts": ckpts, "steps": [1],
                 "resave": 2}, env, 4, 2)


@pytest.fixture(scope="module")
def restored_here(ckpts, restored_4x2) -> dict[str, dict]:
  """Step 2 (written by four processes) read back by this one process."""
  del restored_4x2
  import ckpt  # pylint: disable=g-import-not-at-top
  mesh = worker._mesh("1x8")  # pylint: disable=protected-access
  target = worker.make_target("1x8", mesh)
  want = worker.to_plain(worker.build(
      lambda p: worker.VALUES[p] if p in worker.VALUES else worker.global_value(p)))
  out = {}
  for name, options in ckpts.items():
    with ckpt.Checkpointer(options["dir"], format=options["format"]) as ckptr:
      bad, checked = worker.check_restored(ckptr.restore(2, target=target),
                                           target)
      worker.compare_plain(ckpt.load(options["dir"], step=2), want,
                           "ckpt.load", bad)
      out[name] = {"steps": ckptr.all_steps(), "mismatches": bad,
                   "checked": checked}
  return out


@pytest.mark.parametrize("name", CKPTS)
def test_save_2x4_each_process_writes_its_share(saved_2x4, name):
  for r in saved_2x4:
    assert r.ckpts[name].steps == [1], r.ckpts[name]
  assert_balanced([r.ckpts[name].bytes_written for r in saved_2x4],
                  f"save 2x4 into {name}")


@pytest.mark.parametrize("name", CKPTS)
def test_restore_4x2_bit_exact_and_resave(restored_4x2, name):
  for r in restored_4x2:
    res = r.ckpts[name]
    assert res.mismatches == [], (
        f"process {r.process}:\n" + "\n".join(res.mismatches))
    assert set(res.checked["1"]) == all_leaf_paths()
    assert res.resave.saved is True
    assert res.resave.steps == [1, 2]
  assert_balanced([r.ckpts[name].resave.bytes_written for r in restored_4x2],
                  f"re-save 4x2 into {name}")


@pytest.mark.parametrize("name", CKPTS)
def test_restore_here_bit_exact_and_load(restored_here, name):
  res = restored_here[name]
  assert res["steps"] == [1, 2]
  assert res["mismatches"] == [], "\n".join(res["mismatches"])
  assert set(res["checked"]) == all_leaf_paths()


def _keys(ckpts, name) -> list[str]:
  return storeutil.keys(ckpts[name]["dir"])


@pytest.mark.parametrize("name", CKPTS)
def test_what_the_store_holds(restored_here, ckpts, name):
  del restored_here
  keys = _keys(ckpts, name)
  heads = {k.partition("/")[0] for k in keys}
  if name.startswith("disk"):
    assert heads == {"checkpoint_1", "checkpoint_2"}, sorted(heads)
  else:
    # A bucket also holds one commit record per step (ckpt/commit/protocol.py), and
    # nothing is left pending.
    assert heads == {"checkpoint_1", "checkpoint_2", "commits"}, sorted(heads)
    assert sorted(k for k in keys if k.startswith("commits/")) == [
        "commits/1", "commits/2", "commits/complete"]
  for step, writers in (("checkpoint_1", 2), ("checkpoint_2", 4)):
    mine = [k[len(step) + 1:] for k in keys if k.startswith(step + "/")]
    assert "commit_success" in mine
    if not name.startswith("disk"):
      # On a bucket: the marker, and the one attempt it names, holding
      # everything else (a disk commits by renaming the attempt instead).
      attempts = {m.split("/")[0] for m in mine if m != "commit_success"}
      assert len(attempts) == 1, attempts
      assert attempts.pop().startswith("attempt-")
      mine = [m.split("/", 1)[1] for m in mine if m != "commit_success"]
    assert "index.msgpack" in mine and "attempt.json" in mine
    if CKPTS[name][1]["format"] == "ocdbt":
      # One database per writing process, merged into one at the step root;
      # the arrays' own keys live inside them, not as objects.
      procs = {m.split("/")[0] for m in mine if m.startswith("ocdbt.process_")}
      assert procs == {f"ocdbt.process_{p}" for p in range(writers)}, procs
      assert "manifest.ocdbt" in mine
      assert not [m for m in mine if m.endswith("zarr.json")]
      assert len(mine) <= OCDBT_KEYS_PER_STEP_MAX, (len(mine), mine)
    else:
      meta = ".zarray" if CKPTS[name][1]["format"] == "zarr" else "zarr.json"
      for leaf in ("params/embed/table", "ema/table", "data/tokens"):
        assert f"{leaf}/{meta}" in mine, f"{step}/{leaf}/{meta} missing"
      assert not [m for m in mine if re.match(r"ocdbt\.process_", m)]
