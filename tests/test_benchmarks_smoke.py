"""Every benchmark in scripts/ runs end to end on a tiny preset (not timed):
here those of the save (its training slowdown, small leaves, staging, the
index, reuse, verification, file counts); the others by concern in
tests/test_benchmarks_restore_smoke.py (restores and restarts),
tests/test_benchmarks_hosts_smoke.py (multi-tier and the scale harness),
tests/test_benchmarks_formats_smoke.py (hostile files, Orbax import,
safetensors) and tests/test_benchmarks_gpu_smoke.py (the GPU scripts on
CPU): a file each, so that pytest-xdist's two workers share them.

Each runs as its docs say, ``python -m scripts.<name> ...`` from the
repository root, in a subprocess with its own CPU devices
(tests/benchrun.py); the test checks the figures it prints or writes are
there and sane, never their values.
The save/restore comparison (scripts/bench.py) is tests/test_bench_smoke.py,
the scale harness's jobs and merge parts tests/test_scale_smoke.py, the
charts tests/test_docs.py.
"""

from __future__ import annotations

import json

import pytest

from tests.benchrun import run as _run


@pytest.mark.timeout(240)
def test_bench_train(tmp_path):
  out = tmp_path / "train.json"
  stdout = _run("bench_train", "--preset", "smoke", "--runs", "1",
                "--systems", "ckpt", "--steps", "4", "--width", "64",
                "--out", str(out), "--dir", str(tmp_path / "ckpts"))
  assert "train slowdown during save (x)" in stdout
  fig = json.loads(out.read_text())["systems"]["ckpt"]
  for key in ("train_step_idle_s", "train_step_idle_p90_s",
              "train_step_during_p90_s", "train_slowdown",
              "train_save_total_s"):
    assert fig[key]["median"] > 0, (key, fig[key])
  assert (fig["train_save_total_s"]["median"] >=
          fig["train_save_blocked_s"]["median"])
  assert fig["train_steps_during"]["median"] >= 1
  assert fig["train_cpu_step_idle_s"]["median"] > 0
  assert fig["train_save_cpu_s"]["median"] >= 0
  assert "train: the save's CPU (s)" in stdout
  # CPU by thread group during the save: at least the steps' own threads.
  assert any(k.startswith("train_cpu_") and k.endswith("_s")
             and k not in ("train_cpu_step_idle_s", "train_cpu_step_during_s")
             for k in fig), sorted(fig)


@pytest.mark.timeout(240)
def test_bench_small_leaves(tmp_path):
  out = tmp_path / "small.json"
  stdout = _run("bench_small_leaves", "--preset", "smoke", "--runs", "1",
                "--async-leaves", "20", "--out", str(out),
                "--dir", str(tmp_path / "ckpts"))
  assert "CPU us/leaf" in stdout and "caller thread CPU" in stdout
  report = json.loads(out.read_text())
  assert set(report["sync"]) == {"plain", "rawpack", "ckpt"}
  for fig in report["sync"].values():
    assert fig["cpu_s"] > 0 and fig["wall_s"] > 0 and fig["cpu_us_per_leaf"] > 0
  asy = report["async"]
  assert 0 < asy["blocked_s"] <= asy["total_s"]
  assert 0 < asy["caller_cpu_s"] and asy["state_bytes"] == 20 * 4096
  assert asy["blocked_cpu_s"] >= asy["caller_cpu_s"] > 0  # every thread


@pytest.mark.timeout(240)
def test_bench_small_leaves_against_the_limit(tmp_path):
  from scripts import bench_small_leaves  # pylint: disable=g-import-not-at-top
  if bench_small_leaves.limits_path() is None:
    pytest.skip("no ../shared/limits/limits.py next to the repository")
  out = tmp_path / "limits.json"
  stdout = _run("bench_small_leaves", "--limits", "--limits-leaves", "40",
                "--runs", "1", "--async-leaves", "20", "--out", str(out),
                "--dir", str(tmp_path / "ckpts"))
  figs = json.loads(out.read_text())["figures"]
  for name in ("process_first_save", "first_save", "later_save", "restore"):
    assert figs[name]["wall_ratio"] > 0 and figs[name]["cpu_ratio"] > 0
    assert name in stdout
  assert figs["async"]["blocked_s"] and "0.05 s target" in stdout


@pytest.mark.timeout(200)
def test_verify_cost():
  stdout = _run("verify_cost", "--preset", "smoke", "--rounds", "1")
  assert "verify=True : wall median" in stdout
  assert "ratio verified/unverified (warm)" in stdout


@pytest.mark.timeout(200)
def test_bench_staging(tmp_path):
  out = tmp_path / "staging.json"
  _run("bench_staging", "--leaves", "2", "--mib", "1", "--runs", "1",
       "--out", str(out))
  report = json.loads(out.read_text())
  for name in ("serial", "overlapped", "ckpt async save: blocked",
               "ckpt async save: total", "ckpt sync save: total"):
    assert report[name]["median_s"] >= 0, (name, report)


@pytest.mark.timeout(200)
def test_staging_pool(tmp_path):
  """Issue 47 item 6's RSS over async saves, the accelerator staging path
  forced on CPU: every box goes through a pinned_host copy."""
  out = tmp_path / "pool.json"
  stdout = _run("staging_pool", "--gib", "0.03", "--leaves", "2", "--saves",
                "3", "--dir", str(tmp_path), "--trim", "--json", str(out))
  assert "accelerator staging path FORCED on CPU" in stdout
  assert "target: growth < 1 MiB per save:" in stdout
  report = json.loads(out.read_text())
  assert report["forced"] and len(report["rss"]) == 3
  assert report["pinned_copies"] == [16] * 3  # 2 leaves x 8 devices
  assert len(report["rss_after_malloc_trim"]) == 3


@pytest.mark.timeout(120)
def test_bench_index():
  """500 leaves: the round trip check passes (decode(encode(index)) equals
  the index) and every figure is reported."""
  stdout = _run("bench_index", "--leaves", "500", "--repeat", "1")
  out = json.loads(stdout.strip().splitlines()[-1])
  assert out["leaves"] == 500 and out["bytes"] > 500
  assert out["encode_cpu_s"] >= 0 and out["decode_cpu_s"] >= 0


@pytest.mark.timeout(200)
def test_file_counts(tmp_path):
  # 2 processes only: a job of 1 runs the same code (a job's start is most
  # of this test's time).
  stdout = _run("file_counts", "--leaves", "20", "--formats", "zarr",
                "--process-counts", "2", "--dir", str(tmp_path))
  lines = [l.split() for l in stdout.splitlines() if l.startswith("zarr ")]
  assert [l[1] for l in lines] == ["2"], stdout
  # Small leaves are packed: a few files.
  assert all(int(l[2].replace(",", "")) > 0 for l in lines), stdout
  assert not any(tmp_path.iterdir())  # it cleaned up


@pytest.mark.timeout(200)
def test_reuse_cost():
  stdout = _run("reuse_cost", "--frozen-mib", "4", "--train-mib", "1",
                "--dense-mib", "4", "--rounds", "1")
  assert "target: reuse hands 1.00 MiB to the disk" in stdout
  assert "dense overhead of reuse, cpu_s:" in stdout
