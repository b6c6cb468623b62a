"""The save/restore comparison runs end to end on its smallest preset (not
a timed test).

``python -m scripts.bench --preset smoke --runs 1`` for ckpt and the limit
(../shared/limits/limits.py; Orbax too when it is installed: it is an
optional extra), as a subprocess, all in one worker process; the JSON report
must have every figure, every ratio to the limit, and every time, size and
file count must be positive. The other benchmarks' smoke
tests are in tests/test_benchmarks*_smoke.py.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMES = ("save_s", "async_s", "async_total_s", "restore_same_s",
         "restore_other_s")
MEMORY = ("save_rss_extra", "async_rss_extra", "restore_same_rss_extra",
          "restore_other_rss_extra")


def _has_orbax() -> bool:
  try:
    return importlib.util.find_spec("orbax.checkpoint") is not None
  except ModuleNotFoundError:
    return False


@pytest.mark.timeout(240)
def test_bench_smoke(tmp_path):
  systems = ["ckpt", "limit"] + (["orbax"] if _has_orbax() else [])
  out = tmp_path / "smoke.json"
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  proc = subprocess.run(
      [sys.executable, "-m", "scripts.bench", "--preset", "smoke",
       "--runs", "1", "--systems", ",".join(systems), "--out", str(out),
       "--dir", str(tmp_path / "ckpts"), "--drift-saves", "6"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  assert "sync save (s)" in proc.stdout  # the table was printed

  report = json.loads(out.read_text())
  assert report["preset"] == "smoke"
  assert report["runs"] == 1
  assert set(report["systems"]) == set(systems)
  assert report["state"]["bytes"] > 0 and report["state"]["array_leaves"] > 0
  assert any("page cache" in n for n in report["notes"])
  for name in systems:
    fig = report["systems"][name]
    limit = name == "limit"  # no async mode, the saved mesh only
    times = TIMES if not limit else ("save_s", "restore_same_s")
    for key in times + ("disk_bytes", "disk_files"):
      assert fig[key]["median"] > 0, (name, key, fig[key])
      assert fig[key]["min"] <= fig[key]["median"] <= fig[key]["max"]
      assert len(fig[key]["values"]) == 1
    for key in MEMORY if not limit else ("save_rss_extra",
                                         "restore_same_rss_extra"):
      assert fig[key]["median"] >= 0, (name, key, fig[key])
    assert fig["restore_same_shards_verified"]["median"] > 0
    if not limit:
      assert fig["restore_other_shards_verified"]["median"] > 0
  assert "async_s" not in report["systems"]["limit"]  # no async mode
  assert "restore_other_s" not in report["systems"]["limit"]
  # Every ckpt figure as a ratio to the limit (and to Orbax), issue 47.
  rat = report["ratios"]["ckpt"]
  for key in ("save_s", "restore_same_s"):
    assert rat[key]["limit"] == pytest.approx(
        report["systems"]["ckpt"][key]["median"] /
        report["systems"]["limit"][key]["median"])
    assert ("orbax" in rat[key]) == _has_orbax()
  assert "ratios of medians, to the limit and to Orbax" in proc.stdout
  assert "| ckpt / limit | ckpt / Orbax |" in proc.stdout  # the headline
  # One worker process for every system: the same process and rounds.
  assert len({tuple(w["process"]) for w in report["workers"].values()}) == 1
  # The ckpt figures land next to the ratios of the targets.
  names = {t["target"] for t in report["targets"]}
  assert "sync save within 1.2x of the limit" in names
  assert "restore (same mesh) within 1.25x of the limit" in names
  assert "RSS drift over the async saves < 5%" in names
  drift = report["systems"]["ckpt"]
  assert drift["drift_saves"]["median"] == 6
  assert drift["drift_rss_last"]["median"] > 0 and drift["drift_rss_5"][
      "median"] > 0
  assert "drift_ratio" not in report["systems"]["limit"]  # ckpt only


@pytest.mark.timeout(240)
def test_bench_smoke_in_a_job_of_two_processes(tmp_path):
  """``--processes 2``: ckpt and the limit in one jax.distributed job of two
  processes, runs rotated; each process writes the limit's files in its
  own folder, and every figure has its ratio to the limit."""
  out = tmp_path / "mp.json"
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  proc = subprocess.run(
      [sys.executable, "-m", "scripts.bench", "--preset", "smoke",
       "--runs", "2", "--processes", "2", "--systems", "ckpt,limit",
       "--drift-saves", "0", "--out", str(out),
       "--dir", str(tmp_path / "ckpts")],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  report = json.loads(out.read_text())
  assert report["topology"]["processes"] == 2
  for name in ("ckpt", "limit"):
    fig = report["systems"][name]
    assert len(fig["save_s"]["values"]) == 2, (name, fig)
    assert fig["restore_same_shards_verified"]["median"] > 0
  assert set(report["ratios"]["ckpt"]) >= {"save_s", "restore_same_s"}
