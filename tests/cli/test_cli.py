"""The ``ckpt`` command, end to end.

Each subcommand runs at least once as its own process (``python -m ckpt``,
as a user runs it) on real checkpoints made here: single-process ones with
sharded, bfloat16, int4 and float8 leaves and inline values, one written by
a real 2-process ``jax.distributed`` job, and one written by Orbax. Variants
of a command that only change its arguments run in this process through
``cli.main`` (same code, no interpreter start-up).
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import pty
import shutil
import struct
import subprocess
import sys
import termios
import time

import ml_dtypes
import numpy as np
import pytest

import ckpt
from ckpt.cli import main as cli
from ckpt.cli.output import human_bytes
from ckpt.multihost import local_cluster
from ckpt.format import tree
from tests.cli import save_worker
from tests.conftest import named, sharded
from tests.multiprocess import worker

REPO = pathlib.Path(__file__).resolve().parents[2]
BF16 = np.dtype(ml_dtypes.bfloat16)
# safetensors dtype codes of what the test states hold (the file format's).
ST_CODES = {"float32": "F32", "float64": "F64", "bfloat16": "BF16",
            "int8": "I8", "int32": "I32", "float8_e4m3fn": "F8_E4M3"}
HOURS = 3600


# ---- helpers -----------------------------------------------------------------

def run_cli(*args, stderr=subprocess.PIPE, timeout=120):
  """``python -m ckpt ARGS`` in a fresh interpreter, as a user runs it."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.run([sys.executable, "-m", "ckpt", *map(str, args)],
                        stdout=subprocess.PIPE, stderr=stderr, text=True,
                        cwd=REPO, env=env, timeout=timeout)


def run_json(*args, rc=0):
  return run_json_many([args], rc=rc)[0]


def run_json_many(commands, rc=0):
  """Several ``python -m ckpt ... --json`` at once; their parsed outputs."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  procs = [subprocess.Popen(
      [sys.executable, "-m", "ckpt", *map(str, args), "--json"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
      env=env) for args in commands]
  docs = []
  for args, p in zip(commands, procs):
    out, err = p.communicate(timeout=120)
    assert p.returncode == rc, (args, err)
    assert err == "", err  # no bar (not a terminal), no warnings
    docs.append(json.loads(out))
  return docs


def json_in_process(capsys, *args, rc=0):
  got, out, err = in_process(capsys, *args, "--json")
  assert got == rc, err
  return json.loads(out)


def assert_one_line_error(rc: int, out: str, err: str, *fragments: str):
  assert rc == 1, (rc, out, err)
  assert out == ""
  lines = err.splitlines()
  assert len(lines) == 1 and lines[0].startswith("ckpt: error: "), err
  assert "Traceback" not in err
  for f in fragments:
    assert f in err, (f, err)


def in_process(capsys, *args) -> tuple[int, str, str]:
  rc = cli.main([str(a) for a in args])
  out, err = capsys.readouterr()
  return rc, out, err


def flat(x) -> dict[str, object]:
  return {tree.path_str(p): v for p, v in tree.flatten(x)}


def same(got, want) -> bool:
  got, want = np.asarray(got), np.asarray(want)
  return (got.dtype == want.dtype and got.shape == want.shape and
          got.tobytes() == want.tobytes())


def chunk_files(leaf_dir: pathlib.Path) -> list[pathlib.Path]:
  return sorted(p for p in leaf_dir.iterdir()
                if p.is_file() and not p.name.startswith("."))


def make_state(m, step: int):
  rng = np.random.default_rng(0)
  w = rng.standard_normal((64, 32), np.float32)
  return {
      "params": {
          "w": sharded(w, named(m, "data", "model")),
          "b": rng.standard_normal(300).astype(BF16),
          "q": rng.integers(-8, 8, 600).astype(ml_dtypes.int4),
          "f8": rng.standard_normal(400).astype(ml_dtypes.float8_e4m3fn),
      },
      "opt": {"count": np.int32(step),
              "mu": [rng.standard_normal((20, 20)).astype(np.float32),
                     np.ones(3)]},
      "step": step, "name": "run", "lr": np.float32(1e-3), "flag": True,
      "blob": b"\x00\x01",
  }


@pytest.fixture(scope="module", autouse=True)
def _arrays_only(arrays_only):
  """Small test arrays stay TensorStore arrays (tests/save/test_pack.py covers
  packed leaves)."""
  del arrays_only


@pytest.fixture(scope="module")
def root(tmp_path_factory, mesh8):
  """Steps 1-4 (metrics loss and acc), an old abandoned save (2 h) and a
  fresh uncommitted one (maybe in progress)."""
  d = tmp_path_factory.mktemp("cli") / "ckpts"
  with ckpt.Checkpointer(d, async_save=False) as ckptr:
    for s in range(1, 5):
      ckptr.save(s, make_state(mesh8, s),
                 metrics={"loss": 1.0 / s, "acc": [0.5, 0.9, 0.7, 0.6][s - 1]})
  for name, age in (("checkpoint_9.tmp-old1", 2 * HOURS),
                    ("checkpoint_10.tmp-new1", 0)):
    (d / name).mkdir()
    (d / name / "part").write_bytes(b"x" * 100)
    t = time.time() - age
    os.utime(d / name / "part", (t, t))
  return d


@pytest.fixture(scope="module")
def mesh8():
  from tests.conftest import mesh  # pylint: disable=g-import-not-at-top
  return mesh()


# ---- ls ----------------------------------------------------------------------

def test_ls_json(root):
  doc = run_json("ls", root)
  rows = {r["name"]: r for r in doc["steps"]}
  assert [r["step"] for r in doc["steps"]] == [1, 2, 3, 4, 9, 10]
  for s in range(1, 5):
    r = rows[f"checkpoint_{s}"]
    assert r["status"] == "committed"
    assert r["metrics"] == {"loss": 1.0 / s,
                            "acc": [0.5, 0.9, 0.7, 0.6][s - 1]}
    assert r["files"] > 5 and r["bytes"] > r["data_bytes"] > 10_000
    assert r["format"] == "zarr" and r["process_count"] == 1
    assert abs(r["time"] - time.time()) < 600 and r["time_iso"]
  old, new = rows["checkpoint_9.tmp-old1"], rows["checkpoint_10.tmp-new1"]
  assert old["status"] == new["status"] == "uncommitted"
  assert old["bytes"] == 100 and old["files"] == 1
  assert old["age_s"] > 1.9 * HOURS and new["age_s"] < 600


def test_ls_text(root, capsys):
  rc, out, _ = in_process(capsys, "ls", root)
  assert rc == 0
  lines = out.splitlines()
  assert lines[0].split() == ["STEP", "STATUS", "SIZE", "FILES", "TIME",
                              "METRICS"]
  assert "acc=0.9 loss=0.5" in lines[2]
  assert "uncommitted" in out and "checkpoint_9.tmp-old1" in out
  assert lines[-1].startswith("4 committed (latest 4), 2 not committed")
  assert "KiB" in out


# ---- inspect -----------------------------------------------------------------

def test_inspect_json(root):
  doc = run_json("inspect", root, "--step", 2)
  assert doc["step"] == 2 and doc["path"].endswith("checkpoint_2")
  assert doc["format"] == "zarr" and doc["metrics"]["acc"] == 0.9
  leaves = {x["path"]: x for x in doc["leaves"]}
  assert set(leaves) == {"params/w", "params/b", "params/q", "params/f8",
                         "opt/count", "opt/mu/0", "opt/mu/1", "step", "name",
                         "lr", "flag", "blob"}
  w = leaves["params/w"]
  assert (w["kind"], w["shape"], w["dtype"], w["bytes"]) == (
      "array", [64, 32], "float32", 64 * 32 * 4)
  assert w["sharding"] == ("NamedSharding(mesh={'data': 2, 'model': 4}, "
                           "spec=('data', 'model'))")
  assert w["codec"]["compression"] is None
  assert w["chunk_count"] == np.prod(np.ceil(np.divide(w["shape"],
                                                       w["chunks"])))
  # Box checksums are no longer in the index (zarr v2: per-process files
  # .checksums/<process>.msgpack; zarr3/ocdbt: the crc32c codec).
  assert w["checksums"] == 0
  assert leaves["params/b"]["dtype"] == "bfloat16"
  assert leaves["params/b"]["sharding"] == "replicated (host value)"
  assert leaves["params/q"]["dtype"] == "int4"
  assert leaves["step"] == {**leaves["step"], "kind": "value", "type": "int",
                            "value": 2}
  assert leaves["name"]["value"] == "run"
  assert leaves["opt/count"]["type"] == "int32"
  assert leaves["opt/count"]["shape"] == [] and leaves["opt/count"]["value"] == 2


def test_inspect_text_of_a_step_directory(root, capsys):
  rc, out, _ = in_process(capsys, "inspect", root / "checkpoint_3")
  assert rc == 0
  assert out.startswith(f"checkpoint {root}/checkpoint_3 (step 3)")
  assert "metrics   acc=0.7 loss=0.333333" in out
  row = next(line for line in out.splitlines() if line.startswith("params/w"))
  assert row.split()[:4] == ["params/w", "(64,", "32)", "float32"]
  assert "8.0 KiB" in row and "raw" in row and "NamedSharding(" in row
  assert any(line.startswith("name ") and line.endswith("= 'run'")
             for line in out.splitlines())


# ---- verify ------------------------------------------------------------------

@pytest.fixture
def step3(root, tmp_path):
  """A private copy of step 3 to damage."""
  return pathlib.Path(shutil.copytree(root / "checkpoint_3",
                                      tmp_path / "checkpoint_3"))


def test_verify_clean_then_flipped_byte(step3, capsys):
  doc = json_in_process(capsys, "verify", step3)
  assert doc["ok"] and doc["step"] == 3 and doc["problems"] == []
  assert doc["arrays"] == 5 and doc["bytes"] > 10_000
  chunk = chunk_files(step3 / "params" / "w")[0]
  data = bytearray(chunk.read_bytes())
  data[len(data) // 2] ^= 0x10
  chunk.write_bytes(bytes(data))
  doc = run_json("verify", step3, rc=1)
  assert not doc["ok"]
  assert [p["path"] for p in doc["problems"]] == ["params/w"]
  assert "crc32c" in doc["problems"][0]["message"]


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_verify_reports_a_damaged_chunk_by_path(step3, damage, capsys):
  chunk = chunk_files(step3 / "params" / "b")[0]
  if damage == "truncate":
    chunk.write_bytes(chunk.read_bytes()[:10])
  else:
    chunk.unlink()
  rc, out, _ = in_process(capsys, "verify", step3)
  assert rc == 1
  assert out.splitlines()[0].startswith("CORRUPT params/b: ")
  assert "1 of 5 arrays corrupt" in out


def test_verify_all_steps(root, capsys):
  rc, out, _ = in_process(capsys, "verify", root, "--all", "--json")
  doc = json.loads(out)
  assert rc == 0 and doc["ok"]
  assert [c["step"] for c in doc["checkpoints"]] == [1, 2, 3, 4]


# ---- gc ----------------------------------------------------------------------

def test_gc_dry_run_then_yes(root, tmp_path, capsys):
  d = pathlib.Path(shutil.copytree(root, tmp_path / "ckpts"))
  before = sorted(os.listdir(d))
  doc = json_in_process(capsys, "gc", d, "--keep", 2)
  assert doc["dry_run"] and doc["deleted"] == []
  assert [i["name"] for i in doc["delete"]] == [
      "checkpoint_1", "checkpoint_2", "checkpoint_9.tmp-old1"]
  assert [i["name"] for i in doc["skipped"]] == ["checkpoint_10.tmp-new1"]
  assert doc["kept"] == [3, 4]
  assert sorted(os.listdir(d)) == before  # a dry run deletes nothing
  doc = run_json("gc", d, "--keep", 2, "--yes")
  assert not doc["dry_run"]
  assert doc["deleted"] == ["checkpoint_1", "checkpoint_2",
                            "checkpoint_9.tmp-old1"]
  assert sorted(os.listdir(d)) == ["checkpoint_10.tmp-new1", "checkpoint_3",
                                   "checkpoint_4"]
  assert ckpt.load(d, 3)["step"] == 3


def test_gc_best_metric_and_period(root, tmp_path, capsys):
  d = pathlib.Path(shutil.copytree(root, tmp_path / "ckpts"))
  # acc: 0.5 0.9 0.7 0.6 -> the best is step 2; the newest (4) always stays;
  # --keep-period 3 keeps step 3.
  rc, out, _ = in_process(capsys, "gc", d, "--keep", 1, "--best-metric",
                          "acc", "--best-mode", "max", "--keep-period", 3,
                          "--tmp-min-age", 0)
  assert rc == 0
  lines = out.splitlines()
  size1 = human_bytes(run_size(d / "checkpoint_1"))
  assert lines[:4] == [
      f"would delete checkpoint_1 (step 1, {size1})",
      "would delete checkpoint_9.tmp-old1 (abandoned save, 100 B)",
      "would delete checkpoint_10.tmp-new1 (abandoned save, 100 B)",
      "kept steps: 2, 3, 4"]
  assert lines[4].startswith("dry run: nothing deleted (")
  assert lines[4].endswith("pass --yes to delete") and len(lines) == 5
  rc, out, _ = in_process(capsys, "gc", d, "--keep", 1, "--best-metric",
                          "acc", "--best-mode", "max", "--yes", "--json")
  assert json.loads(out)["deleted"] == ["checkpoint_1", "checkpoint_3",
                                        "checkpoint_9.tmp-old1"]
  assert sorted(os.listdir(d)) == ["checkpoint_10.tmp-new1", "checkpoint_2",
                                   "checkpoint_4"]


def test_ls_and_gc_of_a_step_without_its_index(root, tmp_path, capsys):
  """A step directory that lost its index is "incomplete": listed, not
  committed, kept by gc unless --incomplete asks for it."""
  d = pathlib.Path(shutil.copytree(root, tmp_path / "ckpts"))
  os.unlink(d / "checkpoint_3" / "index.msgpack")
  rows = {r["name"]: r for r in json_in_process(capsys, "ls", d)["steps"]}
  assert rows["checkpoint_3"]["status"] == "incomplete"
  assert "no index.msgpack" in rows["checkpoint_3"]["problem"]
  rc, out, _ = in_process(capsys, "ls", d)
  assert rc == 0 and "checkpoint_3: has a commit marker but no index.msgpack" in out
  doc = json_in_process(capsys, "gc", d, "--keep", 1, "--tmp-min-age", 0,
                        "--yes")
  assert doc["deleted"] == ["checkpoint_1", "checkpoint_2",
                            "checkpoint_9.tmp-old1", "checkpoint_10.tmp-new1"]
  assert [(i["name"], i["kind"]) for i in doc["skipped"]] == [
      ("checkpoint_3", "incomplete")]
  assert (d / "checkpoint_3" / "commit_success").exists()
  rc, out, _ = in_process(capsys, "gc", d, "--incomplete")
  assert rc == 0
  assert "would delete checkpoint_3 (incomplete: has a commit marker but no " \
         "index.msgpack" in out
  doc = json_in_process(capsys, "gc", d, "--incomplete", "--yes")
  assert doc["deleted"] == ["checkpoint_3"]
  assert sorted(os.listdir(d)) == ["checkpoint_4"]


def run_size(path: pathlib.Path) -> int:
  return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---- export / import ---------------------------------------------------------

def test_export_import_safetensors_round_trip(root, tmp_path, capsys):
  from safetensors import deserialize  # the reference parser
  out = tmp_path / "step4.safetensors"
  doc = json_in_process(capsys, "export", root, out)  # format from the extension
  assert doc["format"] == "safetensors" and doc["step"] == 4
  assert doc["widened"] == {"params/q": "int4->int8"}
  assert doc["values"] == ["blob", "flag", "name", "step"]
  want = flat(ckpt.load(root))
  got = {k: v for k, v in deserialize(out.read_bytes())}
  assert set(got) == {k for k, v in want.items()
                      if isinstance(v, (np.ndarray, np.generic))}
  for k, v in got.items():
    w = np.asarray(want[k])
    if k == "params/q":
      w = w.astype(np.int8)
    assert v["dtype"] == ST_CODES[w.dtype.name], k
    assert v["shape"] == list(w.shape) and bytes(v["data"]) == w.tobytes(), k

  doc = run_json("import", out, tmp_path / "imported", "--step", 40)
  assert doc["kind"] == "safetensors" and doc["leaves"] == len(want)
  back = flat(ckpt.load(tmp_path / "imported", 40))
  assert set(back) == set(want)
  for k, w in want.items():
    if isinstance(w, (np.ndarray, np.generic)):
      if k == "params/q":
        w = np.asarray(w).astype(np.int8)
      assert same(back[k], w), k  # numpy scalars come back as 0-d arrays
    else:
      assert type(back[k]) is type(w) and back[k] == w, k


def test_export_npz_widens_what_numpy_lacks(root, tmp_path, capsys):
  out = tmp_path / "x.npz"
  rc, text, _ = in_process(capsys, "export", root, "--step", 1, "--to", "npz",
                           out)
  assert rc == 0 and "widened" in text
  want = flat(ckpt.load(root, 1))
  with np.load(out, allow_pickle=False) as z:
    assert set(z.files) == set(want)
    assert z["params/b"].dtype == np.float32
    np.testing.assert_array_equal(z["params/b"],
                                  want["params/b"].astype(np.float32))
    assert z["params/f8"].dtype == np.float32
    assert same(z["params/q"], want["params/q"].astype(np.int8))
    assert same(z["params/w"], want["params/w"])
    assert z["name"][()] == "run" and z["step"][()] == 1
    assert z["blob"][()] == b"\x00\x01" and z["flag"][()]


def test_import_safetensors_written_by_the_library(tmp_path, capsys):
  from safetensors.numpy import save_file
  rng = np.random.default_rng(1)
  tensors = {"model/layers/0/w": rng.standard_normal((8, 4), np.float32),
             "model/layers/1/w": rng.standard_normal((8, 4), np.float32),
             "model/embed": rng.standard_normal((30, 20)).astype(BF16),
             "head.bias": np.arange(5, dtype=np.int64)}
  save_file(tensors, tmp_path / "model.safetensors")
  rc, _, err = in_process(capsys, "import", tmp_path / "model.safetensors",
                          tmp_path / "c", "--step", 0)
  assert rc == 0, err
  got = ckpt.load(tmp_path / "c", 0)
  assert set(got) == {"model", "head.bias"}
  assert set(got["model"]["layers"]) == {"0", "1"}
  for k, v in tensors.items():
    node = got
    for part in k.split("/"):
      node = node[part]
    assert same(node, v), k
  # --sep . splits HF-style names instead.
  rc, _, err = in_process(capsys, "import", tmp_path / "model.safetensors",
                          tmp_path / "c", "--step", 1, "--sep", ".")
  assert rc == 0, err
  assert same(ckpt.load(tmp_path / "c", 1)["head"]["bias"],
              tensors["head.bias"])


def test_orbax_import_then_export_round_trip(tmp_path, mesh8, capsys):
  ocp = pytest.importorskip("orbax.checkpoint")
  from safetensors.numpy import load_file
  from safetensors import safe_open
  rng = np.random.default_rng(2)
  w = rng.standard_normal((32, 16), np.float32)
  arrays = {"params/w": w,
            "params/b": rng.standard_normal(64).astype(BF16),
            "opt/mu": rng.standard_normal((10, 3)),
            "layers/0": np.arange(12, dtype=np.int32)}
  state = {"params": {"w": sharded(w, named(mesh8, "data", "model")),
                      "b": sharded(arrays["params/b"], named(mesh8, "model"))},
           "opt": {"mu": arrays["opt/mu"], "count": 12},
           "layers": [arrays["layers/0"]], "name": "orbax-run"}
  src = tmp_path / "orbax" / "state"
  with ocp.PyTreeCheckpointer() as c:
    c.save(src, state)

  doc = run_json("import", src, tmp_path / "c", "--step", 12)
  assert doc["kind"] == "orbax" and doc["leaves"] == 6
  out = tmp_path / "state.safetensors"
  json_in_process(capsys, "export", tmp_path / "c", "--to", "safetensors",
                  out)
  got = load_file(out)
  assert set(got) == set(arrays)
  for k, v in arrays.items():
    assert same(got[k], v), k
  with safe_open(out, "np") as f:
    values = json.loads(f.metadata()["ckpt.values"])
  assert values == {"opt/count": {"py": "int", "v": 12},
                    "name": {"py": "str", "v": "orbax-run"}}


def test_import_finds_the_item_of_an_orbax_step_directory(tmp_path, capsys):
  ocp = pytest.importorskip("orbax.checkpoint")
  with ocp.CheckpointManager(tmp_path / "mgr") as mgr:
    mgr.save(5, args=ocp.args.StandardSave({"x": np.arange(100.0)}))
    mgr.wait_until_finished()
  rc, _, err = in_process(capsys, "import", tmp_path / "mgr", tmp_path / "c",
                          "--step", 5)
  assert_one_line_error(rc, "", err, "CheckpointManager", "mgr/5")
  rc, _, err = in_process(capsys, "import", tmp_path / "mgr" / "5",
                          tmp_path / "c", "--step", 5)
  assert rc == 0, err
  assert same(ckpt.load(tmp_path / "c")["x"], np.arange(100.0))


def test_import_orbax_needs_no_orbax(tmp_path, capsys, monkeypatch):
  ocp = pytest.importorskip("orbax.checkpoint")
  with ocp.PyTreeCheckpointer() as c:
    c.save(tmp_path / "o", {"x": np.arange(10.0), "n": 3})
  (tmp_path / "bad").mkdir()
  (tmp_path / "bad" / "_METADATA").write_text("{}")
  monkeypatch.setitem(sys.modules, "orbax", None)  # not installed
  monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)
  rc, _, err = in_process(capsys, "import", tmp_path / "o", tmp_path / "c",
                          "--step", 1)
  assert rc == 0, err
  assert ckpt.load(tmp_path / "c")["n"] == 3
  rc, out, err = in_process(capsys, "import", tmp_path / "bad",
                            tmp_path / "c", "--step", 2)
  assert_one_line_error(rc, out, err, "_METADATA has no tree_metadata",
                        "not an Orbax PyTree checkpoint")


# ---- a checkpoint written by a real 2-process job ------------------------------

@pytest.fixture(scope="module")
def cluster_root(tmp_path_factory):
  d = tmp_path_factory.mktemp("cluster") / "ckpts"
  results = local_cluster.run("tests.cli.save_worker",
                              {"dir": str(d), "step": 7}, num_processes=2,
                              devices_per_process=2, timeout_s=120,
                              cwd=str(REPO))
  assert [worker.decode(save_worker.Saved, r)
          for r in local_cluster.check(results)] == [
              save_worker.Saved(0), save_worker.Saved(1)]
  return d


def test_multiprocess_checkpoint(cluster_root, tmp_path, capsys):
  rows = json_in_process(capsys, "ls", cluster_root)["steps"]
  assert [(r["step"], r["status"], r["process_count"]) for r in rows] == [
      (7, "committed", 2)]
  out = tmp_path / "mp.safetensors"
  inspected, verified, exported = run_json_many([
      ("inspect", cluster_root), ("verify", cluster_root),
      ("export", cluster_root, out, "--step", 7)])

  leaves = {x["path"]: x for x in inspected["leaves"]}
  assert inspected["process_count"] == 2
  assert inspected["metrics"] == {"loss": 0.25}
  for path, (shape, dtype, spec) in save_worker.ARRAYS.items():
    x = leaves[path]
    assert x["shape"] == list(shape) and x["dtype"] == np.dtype(dtype).name
    assert x["sharding"] == ("NamedSharding(mesh={'data': 2, 'model': 2}, "
                             f"spec={spec!r})"), path
  assert leaves["name"]["value"] == "two-process"

  assert verified["ok"] and verified["arrays"] == len(save_worker.ARRAYS)

  from safetensors.numpy import load_file
  assert exported["tensors"] == len(save_worker.ARRAYS)
  got = load_file(out)
  assert set(got) == set(save_worker.ARRAYS)
  for path in save_worker.ARRAYS:
    assert same(got[path], save_worker.value(path)), path


# ---- errors ------------------------------------------------------------------

def test_corrupt_index_is_one_line(step3):
  index = step3 / "index.msgpack"
  index.write_bytes(index.read_bytes()[:50])
  p = run_cli("inspect", step3)
  assert_one_line_error(p.returncode, p.stdout, p.stderr, "index.msgpack",
                        "truncated or corrupt")


@pytest.mark.parametrize("args,fragments", [
    (["ls", "{tmp}/nope"], ["does not exist"]),
    (["verify", "{tmp}/nope"], ["does not exist"]),
    (["inspect", "{root}", "--step", "8"], ["step 8 is not a committed"]),
    (["export", "{root}", "{tmp}/x.bin"],
     ["--to safetensors, --to npz or --to orbax"]),
    (["import", "{root}", "{tmp}/c", "--step", "1"],
     ["neither an Orbax PyTree checkpoint"]),
    (["import", "{tmp}/nothing", "{tmp}/c", "--step", "1"], ["does not exist"]),
    (["import", "{tmp}/bad.safetensors", "{tmp}/c", "--step", "1"],
     ["not a safetensors file"]),
    (["gc", "{root}", "--best-metric", "loss"], ["needs --keep"]),
    (["verify", "{root}", "--all", "--step", "1"], ["not both"]),
    (["ls", "{root}/checkpoint_1"], ["is one checkpoint", "ckpt inspect"]),
    (["ls", "{tmp}/bad.safetensors"], ["not a directory"]),
])
def test_usage_and_input_errors_are_one_line(root, tmp_path, capsys, args,
                                             fragments):
  (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 64)
  args = [a.format(root=root, tmp=tmp_path) for a in args]
  rc, out, err = in_process(capsys, *args)
  assert_one_line_error(rc, out, err, *fragments)


def test_import_refuses_an_existing_step(root, tmp_path, capsys):
  out = tmp_path / "s.safetensors"
  assert in_process(capsys, "export", root, out)[0] == 0
  rc, out_text, err = in_process(capsys, "import", out, root, "--step", 4)
  assert_one_line_error(rc, out_text, err, "step 4 already exists")


def test_bad_usage_exits_2(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["gc"])
  assert e.value.code == 2


# ---- progress, entry points --------------------------------------------------

def test_progress_bar_only_on_a_terminal(root, tmp_path):
  master, slave = pty.openpty()
  # A terminal 100 columns wide (a bare pty has none, and tqdm draws nothing
  # in zero columns).
  fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.Popen(
      [sys.executable, "-m", "ckpt", "export", str(root),
       str(tmp_path / "a.npz")], stdout=subprocess.DEVNULL, stderr=slave,
      cwd=REPO, env={**env, "JAX_PLATFORMS": "cpu"})
  os.close(slave)
  err = b""
  while True:  # read as it runs, so the terminal's buffer never fills
    try:
      data = os.read(master, 1 << 16)
    except OSError:  # EIO: the child closed the terminal
      break
    if not data:
      break
    err += data
  os.close(master)
  assert proc.wait(timeout=120) == 0, err
  assert b"export" in err and b"%" in err, err  # tqdm drew a bar


def test_console_script_entry_point():
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  scripts = {e.name: e.value for e in
             metadata.entry_points(group="console_scripts")}
  if "ckpt" not in scripts:
    pytest.skip("ckpt is not pip-installed here (pip install -e .)")
  assert scripts["ckpt"] == "ckpt.cli.main:main"


def test_main_leaves_the_programs_logging_as_it_was(tmp_path, capsys):
  """cli.main() inside a program (a notebook, a test) quiets absl while it
  runs and then puts back both absl's verbosity and the "absl" logger's own
  level: it left the logger at WARNING, so a program's INFO lines (its own,
  and ckpt's one line per save) vanished after the first command."""
  import logging as std_logging  # pylint: disable=g-import-not-at-top
  from absl import logging  # pylint: disable=g-import-not-at-top
  absl_logger = std_logging.getLogger("absl")
  before = (logging.get_verbosity(), absl_logger.level)
  with ckpt.Checkpointer(tmp_path / "run", async_save=False) as c:
    c.save(1, {"w": np.arange(4.0)})
  assert cli.main(["ls", str(tmp_path / "run")]) == 0
  capsys.readouterr()
  assert (logging.get_verbosity(), absl_logger.level) == before
