"""The commit marker on buckets: killed saves stay invisible, retention
deletes through the store, and a save after a crash works.

Two 2-process jobs run at once (``kill_worker.py``), each killed with SIGKILL
in the middle of saving step 2 after step 1 was committed:
- into ``gs://`` (zarr3), one process dies while writing its boxes;
- into ``s3://`` (ocdbt), process 0 dies after writing the index, i.e.
  after everything but the commit marker.

The same kill points with ``writer="process"`` run in three more jobs at
the same time: the process that writes is the writer, so the kill hits the
writer at the same point of its data path (process 1's writer as it writes
its third box; process 0's writer after the index), and the trainers, alive,
hear of it: no commit, the save fails on both. The trainer-only kill at
the point after the index (process 0's trainer, killed by its writer) is
the one whose outcome differs: the save had been handed over whole, so the
writers commit the step (docs/writer-process.md, "What survives what").
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

import ckpt
from ckpt.commit import cleanup as cleanup_lib
from ckpt.multihost import local_cluster
from ckpt.store import names as names_lib
from tests.multiprocess import test_writer_mp as writer_mp
from tests.multiprocess import worker
from tests.objectstore import kill_worker
from tests.objectstore import servers
from tests.commit import test_durability as durability
from tests.objectstore import storeutil

REPO = pathlib.Path(__file__).resolve().parents[2]
KILLS = {  # name -> (store, format, kill point, writer)
    "gs-zarr3-mid-write": ("gs", "zarr3", "mid_write", "thread"),
    "s3-ocdbt-after-index": ("s3", "ocdbt", "after_index", "thread"),
    "gs-zarr3-mid-write-writer": ("gs", "zarr3", "mid_write", "process"),
    "s3-ocdbt-after-index-writer": ("s3", "ocdbt", "after_index", "process"),
    "s3-ocdbt-after-index-trainer": ("s3", "ocdbt", "trainer_after_index",
                                     "process"),
}
NOT_COMMITTED = [n for n, k in KILLS.items() if k[2] != "trainer_after_index"]


def assert_same(got, want: dict) -> None:
  assert set(got) == set(want), (sorted(got), sorted(want))
  for k, v in want.items():
    g = np.asarray(got[k])
    assert g.dtype == np.asarray(v).dtype and g.shape == np.shape(v), k
    assert g.tobytes() == np.asarray(v).tobytes(), f"{k} differs"


@pytest.fixture(scope="module")
def killed(s3_server, gcs_server, tmp_path_factory):
  """Runs both killed jobs at once; name -> (url, each process's result)."""
  del tmp_path_factory
  env = {**s3_server.env, **gcs_server.env}
  urls = {"s3": servers.new_bucket(s3_server),
          "gs": servers.new_bucket(gcs_server)}
  clusters = {}
  for name, (store, fmt, kill, writer) in KILLS.items():
    url = f"{urls[store]}/{name}"
    clusters[name] = (url, local_cluster.start(
        "tests.objectstore.kill_worker",
        {"url": url, "format": fmt, "kill": kill, "victim": 1,
         "writer": writer},
        num_processes=2, devices_per_process=4, extra_env=env,
        cwd=str(REPO)))
  out = {}
  for name, (url, cluster) in clusters.items():
    trainers = cluster.pids()
    results = cluster.wait(180, grace_s=3)
    # writer="process": what the writers do once their trainers are gone
    # ends before the store is looked at (bounded: the save's bound).
    writer_mp.wait_gone(writer_mp.writers_of(trainers), 180)
    out[name] = (url, results)
  return out


def logs_of(results) -> str:
  return "\n".join(f"--- {r.process_id} (exit {r.returncode})\n"
                   f"{r.output[-3000:]}" for r in results)


@pytest.mark.parametrize("name", NOT_COMMITTED)
def test_killed_save_is_not_visible(killed, store_env, name):
  del store_env
  url, results = killed[name]
  logs = logs_of(results)
  keys = storeutil.keys(url)
  step2 = [k for k in keys if k.startswith("checkpoint_2/")]
  assert "step 1 committed" in results[0].output, logs
  if KILLS[name][3] == "thread":
    assert all(r.result is None for r in results), logs  # nobody finished
    assert any("SIGKILL" in r.output and r.returncode == -9
               for r in results), logs
    # The killed save left data behind, all inside its own attempt, and no
    # commit marker.
    assert step2, keys
    assert all(k.startswith("checkpoint_2/attempt-") for k in step2), step2
    assert "checkpoint_2/commit_success" not in step2
    names = {k.split("/", 2)[2] for k in step2}
    if KILLS[name][2] == "after_index":
      # Everything but the marker: the index and the merged database too.
      assert "index.msgpack" in names and "manifest.ocdbt" in names, names
    else:
      assert "index.msgpack" not in names, names
  else:
    # The trainers live: the save failed on both, each naming the writer
    # that died, and (every process stopped writing) the attempt is gone.
    got = {f.process: f.error for f in (
        worker.decode(kill_worker.Failed, r)
        for r in local_cluster.check(results))}
    victim = 1 if KILLS[name][2] == "mid_write" else 0
    assert "SIGKILL" in results[victim].output, logs
    assert "killed by SIGKILL) while writing step 2" in got[victim], got
    if victim == 1:
      # Process 1's trainer recorded its writer's death: process 0's writer
      # stopped waiting at once (not after its bound), naming it.
      assert "process(es) [1]" in got[0] and "SIGKILL" in got[0], got
    else:  # process 1's writer saw at once that the lease's holder died
      assert "not committed by process 0's writer" in got[1], got
    assert step2 == [], keys
  with ckpt.Checkpointer(url, format=KILLS[name][1]) as ckptr:
    assert ckptr.all_steps() == [1]
    assert ckptr.latest_step() == 1
    with pytest.raises(ckpt.CheckpointNotFoundError):
      ckptr.restore(2)
    assert_same(ckptr.restore(), kill_worker.state_values(1))
  assert_same(ckpt.load(url), kill_worker.state_values(1))


def test_trainer_killed_after_the_index_the_writers_commit(killed, store_env):
  """writer="process": process 0's trainer SIGKILLed when its writer had
  written the index (the save handed over whole): the writers commit."""
  del store_env
  url, results = killed["s3-ocdbt-after-index-trainer"]
  logs = logs_of(results)
  assert results[0].returncode == -9, logs
  assert "SIGKILL of its trainer" in results[0].output, logs
  assert "step 1 committed" in results[0].output, logs
  keys = [k for k in storeutil.keys(url) if k.startswith("checkpoint_2/")]
  assert "checkpoint_2/commit_success" in keys, keys
  marker = json.loads(storeutil.read_key(url, "checkpoint_2/commit_success"))
  # One attempt, the committed one: nothing of another left behind.
  assert {k.split("/")[1] for k in keys if k.count("/") >= 2} == {
      marker["dir"]}, keys
  with ckpt.Checkpointer(url, format="ocdbt") as ckptr:
    assert ckptr.all_steps() == [1, 2]
    assert_same(ckptr.restore(2), kill_worker.state_values(2))
    assert_same(ckptr.restore(1), kill_worker.state_values(1))


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_new_save_of_the_killed_step(killed, store_env, writer):
  """The killed step is saved again, by another topology (one process);
  ``writer``: the killed job's."""
  del store_env
  url, _ = killed["s3-ocdbt-after-index" + (
      "-writer" if writer == "process" else "")]
  new = {"v": np.arange(4096, dtype=np.float32), "step": np.int64(22)}
  killed_attempts = {k.split("/")[1] for k in storeutil.keys(url)
                     if k.startswith("checkpoint_2/attempt-")}
  # (writer="process": its trainers removed it already)
  assert len(killed_attempts) == (writer == "thread"), killed_attempts
  # The default lease: the killed attempt goes at once because its holder
  # (process 0 of the killed job, on this host) is provably dead.
  with ckpt.Checkpointer(url, format="ocdbt", async_save=False) as ckptr:
    assert ckptr.save(2, new)
    assert ckptr.all_steps() == [1, 2]
    assert_same(ckptr.restore(2), new)
  keys = [k for k in storeutil.keys(url) if k.startswith("checkpoint_2/")]
  # The leftovers of the killed save (its whole attempt) are gone; the new
  # attempt is the one the marker names.
  assert not [k for k in keys if k.split("/")[1] in killed_attempts], keys
  marker = storeutil.read_key(url, "checkpoint_2/commit_success")
  assert json.loads(marker)["dir"] in {k.split("/")[1] for k in keys}
  assert_same(ckpt.load(url, step=1), kill_worker.state_values(1))


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_next_save_removes_the_abandoned_step(killed, store_env, writer):
  del store_env
  url, _ = killed["gs-zarr3-mid-write" + (
      "-writer" if writer == "process" else "")]
  with ckpt.Checkpointer(url, format="zarr3", async_save=False) as ckptr:
    reasons = {}
    found = cleanup_lib.abandoned(ckptr.storage, ckptr.lease_s, reasons)
    if writer == "process":  # its trainers removed it already
      assert found == [], reasons
    else:
      # Within its lease, but its holder (the killed process 0) is gone.
      [attempt] = found
      assert attempt.startswith("checkpoint_2/attempt-"), attempt
      assert "has exited" in reasons[attempt], reasons
  with ckpt.Checkpointer(url, format="zarr3", async_save=False) as ckptr:
    assert ckptr.save(3, kill_worker.state_values(3))
    assert ckptr.all_steps() == [1, 3]
    assert cleanup_lib.abandoned(ckptr.storage, lease_s=0.0) == []
  assert not [k for k in storeutil.keys(url) if k.startswith("checkpoint_2/")]
  assert_same(ckpt.load(url, step=3), kill_worker.state_values(3))


@pytest.mark.parametrize("store,fmt", [("s3", "ocdbt"), ("gs", "zarr3")])
def test_retention_deletes_from_the_bucket(store, fmt, s3_bucket, gs_bucket):
  url = (s3_bucket if store == "s3" else gs_bucket) + "/retention"
  states = {s: {"w": np.full((64, 64), s, np.float32),
                "b": np.arange(300, dtype=np.int32) * s} for s in range(1, 6)}
  with ckpt.Checkpointer(url, format=fmt, keep=2, keep_period=2,
                         async_save=True) as ckptr:
    for s, st in states.items():
      ckptr.save(s, st)
    ckptr.wait_until_finished()
    # keep=2 newest (4, 5) plus every step divisible by keep_period (2).
    assert ckptr.all_steps() == [2, 4, 5]
    for s in (2, 4, 5):
      assert_same(ckptr.restore(s), states[s])
  keys = storeutil.keys(url)
  heads = {k.partition("/")[0] for k in keys}
  # The steps, and their commit records (no deletion or save left pending).
  assert heads == {"checkpoint_2", "checkpoint_4", "checkpoint_5",
                   "commits"}, heads
  assert sorted(k for k in keys if k.startswith("commits/")) == [
      "commits/2", "commits/4", "commits/5", "commits/complete"]


def test_delete_removes_the_record_first(s3_bucket):
  """A step whose deletion is interrupted is no longer committed: its
  record and marker go before the data (here the deletion stopped right
  after them), and the deletion's pending record lets cleanup finish it."""
  url = s3_bucket + "/marker"
  with ckpt.Checkpointer(url, format="zarr3", async_save=False) as ckptr:
    ckptr.save(1, {"w": np.ones(1000, np.float32)})
    ckptr.save(2, {"w": np.zeros(1000, np.float32)})
  storeutil.write_key(url, "pending/1.delete", b'{"step": 1, "time": 0}')
  storeutil.delete_key(url, "commits/1")
  storeutil.delete_key(url, f"checkpoint_1/{names_lib.COMMIT_MARKER}")
  assert [k for k in storeutil.keys(url) if k.startswith("checkpoint_1/")]
  with ckpt.Checkpointer(url) as ckptr:
    assert ckptr.all_steps() == [2]
    # Named by its pending record: finishing it removes only what that
    # deletion deletes (see test_a_late_cleaner_spares_a_newer_commit).
    assert cleanup_lib.abandoned(ckptr.storage) == ["pending/1.delete"]
    with pytest.raises(ckpt.CheckpointNotFoundError):
      ckptr.restore(1)
  with ckpt.Checkpointer(url, async_save=False) as ckptr:
    ckptr.save(3, {"w": np.ones(10, np.float32)})  # its cleanup finishes it
    assert ckptr.all_steps() == [2, 3]
  keys = storeutil.keys(url)
  assert not [k for k in keys if k.startswith(("checkpoint_1/", "pending/"))]


def test_a_failed_save_removes_its_keys_from_the_bucket(s3_bucket):
  """A save that fails after some of its data reached the bucket removes
  its attempt at once; the same Checkpointer's next save works."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  url = s3_bucket + "/failed"
  mesh = Mesh(np.array(jax.devices()), ("x",))
  good = {"w": np.arange(64 * 1024, dtype=np.float32)}
  with ckpt.Checkpointer(url, format="zarr3", async_save=False) as ckptr:
    assert ckptr.save(1, good)
    doomed = jax.device_put(np.ones((64, 32), np.float32),
                            NamedSharding(mesh, P("x")))
    doomed.delete()  # staging it fails, after other leaves were written
    with pytest.raises(ckpt.CheckpointError, match="step 2"):
      ckptr.save(2, {"a": np.arange(300_000, dtype=np.float32), "z": doomed})
    assert not [k for k in storeutil.keys(url) if k.startswith("checkpoint_2/")]
    assert ckptr.save(2, good)
    assert ckptr.all_steps() == [1, 2]
    assert_same(ckptr.restore(2), good)


@pytest.mark.parametrize("after", ["record", "marker"])
def test_a_late_cleaner_spares_a_newer_commit_on_s3(s3_bucket, make_ckptr,
                                                    rng, after):
  """tests/commit/test_durability.py's race against moto: the cleaner's removals
  after its pause are conditional requests to a real S3 server."""
  url = f"{s3_bucket}/late-cleaner"
  durability.check_late_cleaner(
      make_ckptr, url, rng, lambda: durability.die_deleting(url, 5, after))
