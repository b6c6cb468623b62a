"""``ckpt import`` of real Orbax checkpoints (orbax-checkpoint writes them
here): every item of a step, sources by URL, saved shardings kept, host
memory within the budget, and a job of several processes importing
together. Bucket sources: tests/objectstore/test_orbax_import.py."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

import ckpt
from ckpt.save import pack
from ckpt.multihost import local_cluster
from tests.cli.test_cli import (assert_one_line_error, flat, in_process,
                                json_in_process, run_json, same)
from tests.conftest import mesh, named, sharded
from tests.multiprocess import worker

ocp = pytest.importorskip("orbax.checkpoint")

REPO = pathlib.Path(__file__).resolve().parents[2]
STEP = 7
SAVED = {  # leaf -> (shape, PartitionSpec on the (data=2, model=4) mesh)
    "params/w": ((64, 32), ("data", "model")),
    "params/b": ((256,), ("model",)),
    "params/emb": ((128, 16), (None, "model")),
    "layers/0/k": ((32, 32), (("data", "model"),)),
    "ema": ((48, 48), ()),
}
EXTRA = {"data_pos": 123, "files": ["a.tfrecord", "b.tfrecord"],
         "epoch": {"n": 2, "done": False}, "note": None}


def described(spec) -> str:
  return f"NamedSharding(mesh={{'data': 2, 'model': 4}}, spec={spec!r})"


def orbax_state(m):
  rng = np.random.default_rng(5)
  state: dict = {"opt": {"mu": rng.standard_normal((20, 20)).astype(np.float32),
                         "count": np.int32(3)},
                 "step": STEP, "lr": 0.5, "rng": jax.random.key(9),
                 "empty": {}}
  for path, (shape, spec) in SAVED.items():
    node = state
    *parents, last = path.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[last] = sharded(rng.standard_normal(shape).astype(np.float32),
                         named(m, *spec))
  state["layers"] = [state["layers"]["0"]]
  return state


def save_orbax(root, state, step=STEP, **items):
  options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"])
  with ocp.CheckpointManager(os.fspath(root), options=options) as mgr:
    mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), **items),
        metrics={"loss": 0.25, "eval": {"acc": 0.75}})
    mgr.wait_until_finished()
  return pathlib.Path(root) / str(step)


@pytest.fixture(scope="module", autouse=True)
def _arrays_only(arrays_only):
  """Small test arrays stay TensorStore arrays (tests/save/test_pack.py covers
  packed leaves)."""
  del arrays_only


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  """An Orbax step: Composite(state=StandardSave, extra=JsonSave) with
  metrics, and the state as Orbax restores it (numpy)."""
  m = mesh()
  state = orbax_state(m)
  src = save_orbax(tmp_path_factory.mktemp("orbax") / "run", state,
                   extra=ocp.args.JsonSave(EXTRA))
  with ocp.StandardCheckpointer() as c:
    restored = c.restore(src / "state")
  return src, restored


@pytest.fixture(scope="module")
def imported(source, tmp_path_factory):
  """The source imported by the command, as a user runs it."""
  src, _ = source
  dst = tmp_path_factory.mktemp("imported") / "ckpts"
  return dst, run_json("import", src, dst, "--step", STEP)


def as_numpy(x):
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype,
                                                        jax.dtypes.prng_key):
    return np.asarray(jax.random.key_data(x))
  return np.asarray(x) if isinstance(x, (jax.Array, np.ndarray)) else x


def test_every_item_of_a_composite_step(source, imported):
  _, restored = source
  dst, doc = imported
  got = ckpt.load(dst, STEP)
  assert got["extra"] == EXTRA  # the JSON item, as inline values
  assert doc["items"] == {"state": "pytree", "extra": "json",
                          "metrics": "metrics"}
  assert doc["skipped"] == []
  want = flat(restored)
  have = flat(got["state"])
  assert set(have) == set(want)
  for path, value in want.items():
    if isinstance(value, (jax.Array, np.ndarray)) and not isinstance(
        have[path], jax.Array):
      assert same(as_numpy(have[path]), as_numpy(value)), path
    else:
      assert have[path] == value and type(have[path]) is type(value), path
  assert got["state"]["empty"] == {}
  with ckpt.Checkpointer(dst) as ckptr:
    assert ckptr.metrics(STEP) == {"loss": 0.25, "eval/acc": 0.75}
    key = ckptr.restore(STEP)["state"]["rng"]
  assert jax.random.key_impl(key) == jax.random.key_impl(jax.random.key(0))


def test_saved_shardings_are_the_imported_leaves_saved_shardings(imported,
                                                                 capsys):
  dst, _ = imported
  leaves = {x["path"]: x for x in
            json_in_process(capsys, "inspect", dst)["leaves"]}
  for path, (_, spec) in SAVED.items():
    assert leaves[f"state/{path}"]["sharding"] == described(spec), path
  # Each chunk is one saved shard (one Orbax chunk): read whole, written
  # whole. (The command runs in its own process, where leaves of at most
  # ckpt.save.pack.MAX_LEAF_BYTES are packed: no chunks.)
  for path, chunks in (("state/params/w", [32, 8]),
                       ("state/layers/0/k", [4, 32])):
    x = leaves[path]
    assert x["kind"] == ("packed" if x["bytes"] <= pack.DEFAULT_MAX_LEAF_BYTES
                         else "array"), x
    assert x["kind"] == "packed" or x["chunks"] == chunks, x
  assert leaves["state/opt/mu"]["sharding"] == "replicated (host value)"
  # Restored onto the saved mesh with the saved specs: Orbax's values.
  m = mesh()
  with ckpt.Checkpointer(dst) as ckptr:
    target = ckpt.abstract_target(
        ckptr.metadata(STEP), m,
        [(f"state/{k}", P(*s)) for k, (_, s) in SAVED.items()])
    got = ckptr.restore(STEP, target=target)
  assert got["state"]["params"]["w"].sharding == named(m, "data", "model")


def test_file_url_of_an_existing_directory(source, tmp_path, capsys):
  src, restored = source
  doc = json_in_process(capsys, "import", f"file://{src}", tmp_path / "c",
                        "--step", 1)
  assert doc["items"]["state"] == "pytree"
  assert same(ckpt.load(tmp_path / "c")["state"]["params"]["w"],
              restored["params"]["w"])


def test_what_cannot_be_imported_is_refused_by_name(tmp_path, capsys):
  m = mesh()
  src = tmp_path / "orbax"
  options = ocp.CheckpointManagerOptions()
  with ocp.CheckpointManager(os.fspath(src), options=options) as mgr:
    mgr.save(3, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"w": sharded(np.ones((8, 8)),
                                                  named(m, "data"))}),
        key=ocp.args.JaxRandomKeySave(jax.random.key(1))),
        custom_metadata={"run": "lm"})
    mgr.wait_until_finished()
  dst = tmp_path / "c"
  rc, out, err = in_process(capsys, "import", src / "3", dst, "--step", 3)
  assert_one_line_error(rc, out, err, "custom_metadata", '{"run": "lm"}',
                        "--skip custom_metadata")
  rc, out, err = in_process(capsys, "import", src / "3", dst, "--step", 3,
                            "--skip", "custom_metadata")
  assert_one_line_error(rc, out, err, "item 'key'", "JaxRandomKey",
                        "--skip key")
  assert not dst.exists()  # nothing written before the refusal
  doc = json_in_process(capsys, "import", src / "3", dst, "--step", 3,
                        "--skip", "custom_metadata", "--skip", "key")
  assert doc["skipped"] == ["custom_metadata", "key"]
  assert doc["items"] == {"state": "pytree"}
  assert same(ckpt.load(dst)["state"]["w"], np.ones((8, 8), np.float32))


def test_a_leaf_cut_by_the_budget_is_decoded_once(tmp_path):
  """A box smaller than a source chunk cannot be read alone (TensorStore
  decodes the whole chunk): the chunk is read once for all its boxes."""
  from ckpt.save import leafsource  # pylint: disable=g-import-not-at-top
  data = np.arange(512 * 512, dtype=np.float32).reshape(512, 512)  # 1 MiB
  store = ts.open({"driver": "zarr", "kvstore": f"file://{tmp_path}/src/",
                   "metadata": {"chunks": [512, 512], "compressor": None,
                                "shape": [512, 512], "dtype": "<f4"}},
                  create=True).result()
  store.write(data).result()
  cache = leafsource.RegionCache()
  sharding = NamedSharding(AbstractMesh((2, 4), ("data", "model")),
                           P(None, "model"))
  state = {"whole": leafsource.LeafSource(store, describe="x", cache=cache),
           "sharded": leafsource.LeafSource(store, describe="y", cache=cache,
                                            sharding=sharding)}
  with ckpt.Checkpointer(tmp_path / "c", async_save=False,
                         concurrent_bytes=128 << 10) as ckptr:
    ckptr.save(1, state)
    assert ckptr.last_save_stats.peak_bytes_in_flight <= 128 << 10
    md = ckptr.metadata(1)
  got = ckpt.load(tmp_path / "c")
  assert same(got["whole"], data) and same(got["sharded"], data)
  # 8 boxes of 128 KiB each (4 shards of 256 KiB, each cut in 2): the one
  # chunk read once per leaf, not once per box (16 times).
  assert cache.decodes == 2
  assert str(md.shardings["sharded"]) == ("NamedSharding(mesh={'data': 2, "
                                     "'model': 4}, spec=(None, 'model'))")


MEMORY_CHILD = r"""
import json, os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
from ckpt.cli import main as cli
jax.devices()
def status(key):
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(key + ":"):
        return int(line.split()[1]) * 1024
before = status("VmRSS")
rc = cli.main(sys.argv[1:])
print(json.dumps({"rc": rc, "growth": status("VmHWM") - before}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                    reason="reads VmHWM from /proc")
def test_host_memory_stays_within_the_budget(tmp_path):
  """95 MiB of Orbax state (8 leaves of 12 MiB: six sharded, one
  replicated, one host array) imported with an 8 MiB budget: peak RSS
  grows by about 31 MiB (the budget, plus the one decoded chunk of a
  replicated leaf and its read buffer); reading the whole state first, as
  ckpt did before, grew it by about twice the state."""
  m = mesh()
  n = 1792  # 12.25 MiB of float32
  rng = np.random.default_rng(0)
  specs = [("data", "model"), ("model", "data"), (None, "model"), ("model",),
           (("data", "model"),), (None, ("model", "data")), ()]
  host = rng.standard_normal((n, n), np.float32)
  state = {f"w{i}": sharded(rng.standard_normal((n, n), np.float32),
                            named(m, *s)) for i, s in enumerate(specs)}
  state["host"] = host
  leaf, budget = n * n * 4, 8 << 20
  src = save_orbax(tmp_path / "orbax", state, step=1)
  del state
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  p = subprocess.run(
      [sys.executable, "-c", MEMORY_CHILD, "import", os.fspath(src),
       os.fspath(tmp_path / "c"), "--step", "1", "--quiet",
       "--concurrent-bytes", str(budget)],
      capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
  assert p.returncode == 0, p.stderr
  got = json.loads(p.stdout.strip().splitlines()[-1])
  assert got["rc"] == 0, p.stderr
  print(f"peak RSS growth {got['growth'] / 2**20:.1f} MiB")
  assert got["growth"] < budget + 2 * leaf + (8 << 20), got
  assert same(ckpt.load(tmp_path / "c")["state"]["host"], host)


def _imported(src, dst, scenario: str) -> list:
  """Each process's ``import_worker.Imported`` of a 2-process import."""
  from tests.cli import import_worker  # pylint: disable=g-import-not-at-top
  return [worker.decode(import_worker.Imported, r)
          for r in local_cluster.check(local_cluster.run(
              "tests.cli.import_worker",
              {"src": os.fspath(src), "dst": os.fspath(dst), "step": STEP,
               "scenario": scenario, "timeout": 60},
              num_processes=2, devices_per_process=2, timeout_s=120,
              cwd=str(REPO)))]


def test_a_job_of_two_processes_imports_together(source, tmp_path):
  """Each process reads and writes its share of every leaf."""
  src, restored = source
  results = _imported(src, tmp_path / "c", "ok")
  assert all(r.imported.ok for r in results), results
  with ckpt.Checkpointer(tmp_path / "c") as ckptr:
    saved = ckptr.metadata(STEP).shardings
  for path, (_, spec) in SAVED.items():
    assert str(saved[f"state/{path}"]) == described(spec), path
  written = [r.imported.value.get("bytes_written") for r in results]
  arrays = sum(np.prod(s) * 4 for s, _ in SAVED.values()) + 20 * 20 * 4
  assert sum(written) == arrays, written
  assert min(written) > arrays // 4, written
  got = ckpt.load(tmp_path / "c")
  assert got["extra"] == EXTRA
  for path, value in flat(restored).items():
    if isinstance(value, (jax.Array, np.ndarray)):
      assert same(as_numpy(flat(got["state"])[path]), as_numpy(value)), path


def test_a_source_one_process_cannot_read_fails_every_process(source,
                                                              tmp_path):
  src, _ = source
  results = _imported(src, tmp_path / "c", "one_bad")
  for r in results:
    error = r.imported.error
    assert error is not None and r.imported.seconds < 15, r
    assert "does not exist" in error.msg, r
  assert "process(es) [1]" in results[0].imported.error.msg, results[0]
  assert not (tmp_path / "c").exists() or not os.listdir(tmp_path / "c")


def test_a_checkpoint_saved_by_a_two_process_orbax_job(tmp_path, capsys):
  from tests.cli import import_worker  # pylint: disable=g-import-not-at-top
  assert [worker.decode(import_worker.Saved, r)
          for r in local_cluster.check(local_cluster.run(
              "tests.cli.import_worker",
              {"dst": os.fspath(tmp_path / "orbax"), "step": 4,
               "scenario": "orbax_save"},
              num_processes=2, devices_per_process=2, timeout_s=120,
              cwd=str(REPO)))] == [import_worker.Saved(0),
                                   import_worker.Saved(1)]
  assert (tmp_path / "orbax" / "4" / "state" / "ocdbt.process_1").is_dir()
  doc = json_in_process(capsys, "import", tmp_path / "orbax" / "4",
                        tmp_path / "c", "--step", 4)
  got = ckpt.load(tmp_path / "c")
  assert got["extra"] == {"data_pos": 7} and got["state"]["step"] == 4
  assert doc["items"] == {"extra": "json", "state": "pytree"}
  for k in ("w", "r"):
    assert same(got["state"][k], import_worker.orbax_value(k)), k
  with ckpt.Checkpointer(tmp_path / "c") as ckptr:
    assert str(ckptr.metadata(4).shardings["state/w"]) == (
        "NamedSharding(mesh={'data': 2, 'model': 2}, spec=('data', 'model'))")
