"""Every benchmark in scripts/ runs end to end on a tiny preset (not timed).

Each runs as its docs say, ``python -m scripts.<name> ...`` from the
repository root, in a subprocess with its own CPU devices; the test checks
the figures it prints or writes are there and sane, never their values.
The save/restore comparison (scripts/bench.py) is tests/test_bench_smoke.py,
the scale harness's jobs and merge parts tests/test_scale_smoke.py, the
charts tests/test_docs.py.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from scripts.benchlib import systems as systems_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
ORBAX = ["orbax"] if systems_lib.orbax_installed() else []


def _run(module: str, *args: str, timeout: float = 200) -> str:
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  # Never the whole machine's page cache: other tests run beside this one
  # (scripts/benchlib/measure.py drop_page_cache).
  env["CKPT_KEEP_PAGE_CACHE"] = "1"
  proc = subprocess.run([sys.executable, "-m", f"scripts.{module}", *args],
                        cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  return proc.stdout


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
def test_bench_read_once(tmp_path):
  out = tmp_path / "ro.json"
  stdout = _run("bench_read_once", "--read-once-scale", "1",
                "--read-once-states", "aligned", "--stores", "disk",
                "--process-counts", "2", "--out", str(out))
  assert "| state | store | processes | read once |" in stdout
  rows = json.loads(out.read_text())["rows"]
  assert [(r["store"], r["processes"], r["read_once"]) for r in rows] == [
      ("disk", 2, True), ("disk", 2, False)]
  for r in rows:
    assert r["bit_exact"] and r["time_s"] > 0 and r["stored"] > 0, r


@pytest.mark.timeout(200)
def test_first_restore():
  stdout = _run("first_restore", "--preset", "smoke", "--repeat", "2")
  for name in ("restore same (first)", "restore same (second)",
               "restore other"):
    assert f"{name}: wall" in stdout, stdout
  assert "minor faults" in stdout


@pytest.mark.timeout(240)
def test_first_restore_rotation(tmp_path):
  out = tmp_path / "rotation.json"
  names = ORBAX + ["ckpt", "raw"]
  stdout = _run("first_restore_rotation", "--preset", "smoke", "--rounds",
                "2", "--systems", ",".join(names), "--out", str(out))
  assert "restore, other mesh: wall (s)" in stdout
  report = json.loads(out.read_text())
  rounds = report["rounds"]
  assert len(rounds) == 2 * len(names)
  # Rotation: round 0 starts with the first system, round 1 with the second.
  firsts = [r["system"] for r in rounds if r["position"] == 0]
  assert firsts == names[:2]
  for r in rounds:
    assert r["save_s"] > 0 and r["restore_same_s"] > 0, r
    assert ("restore_other_s" in r) == (r["system"] == "ckpt"), r
    assert r["restore_same_minflt"] >= 0 and r["restore_same_sys_s"] >= 0, r
  assert "restore, same: minor faults" in stdout
  assert set(report["systems"]) == set(names)


@pytest.mark.timeout(300)
def test_first_restore_rotation_in_fresh_processes(tmp_path):
  out = tmp_path / "fresh.json"
  stdout = _run("first_restore_rotation", "--preset", "smoke", "--rounds",
                "2", "--systems", "ckpt,raw", "--fresh", "--out", str(out),
                timeout=280)
  assert "fresh round 2:" in stdout, stdout
  report = json.loads(out.read_text())
  assert report["fresh"] is True
  rounds = report["rounds"]
  assert [r["system"] for r in rounds] == ["ckpt", "raw", "raw", "ckpt"]
  for r in rounds:
    assert r["restore_same_s"] > 0 and r["restore_same_minflt"] >= 0, r


@pytest.mark.timeout(200)
def test_verify_cost():
  stdout = _run("verify_cost", "--preset", "smoke", "--rounds", "1")
  assert "verify=True : wall median" in stdout
  assert "ratio verified/unverified (warm)" in stdout


@pytest.mark.timeout(240)
def test_bench_tiers():
  stdout = _run("bench_tiers", "--mib", "1", "--processes", "2",
                "--devices", "1")
  for key in ("local_save_2", "both_save", "persistent_save_3000",
              "restore_local", "restore_local_partner", "restore_persistent"):
    assert key in stdout, stdout
  res = json.loads(stdout.strip().splitlines()[-1])
  assert len(res) == 2 and res[0]["restore_local_partner"][1] == "local"


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
@pytest.mark.parametrize("part", ["plan", "requests"])
def test_scale_parts(part, tmp_path):
  """The scale harness's parts not in tests/test_scale_smoke.py."""
  out = tmp_path / f"{part}.json"
  _run("scale", "--config", str(ROOT / "configs" / "scale_smoke.json"),
       "--part", part, "--out", str(out))
  rows = json.loads(out.read_text())["parts"][part]
  if part == "plan":
    (row,) = rows
    assert row["devices"] == 1024 and row["leaves"] == 1000
    assert row["plan_cpu_s"] > 0 and row["writes_this_host"] > 0
    assert row["peak_rss_growth_mib"] >= 0 and row["index_bytes"] > 0
  else:
    assert {r["op"] for r in rows} == {"save", "restore"}
    assert all(r["total"] > 0 for r in rows), rows


@pytest.mark.timeout(200)
def test_file_counts(tmp_path):
  stdout = _run("file_counts", "--leaves", "20", "--formats", "zarr",
                "--process-counts", "1,2", "--dir", str(tmp_path))
  lines = [l.split() for l in stdout.splitlines() if l.startswith("zarr ")]
  assert [l[1] for l in lines] == ["1", "2"], stdout
  # Small leaves are packed: a few files, more with more processes.
  assert all(int(l[2].replace(",", "")) > 0 for l in lines), stdout
  assert not any(tmp_path.iterdir())  # it cleaned up


@pytest.mark.timeout(240)
@pytest.mark.skipif(not ORBAX, reason="needs orbax-checkpoint")
def test_import_memory(tmp_path):
  stdout = _run("import_memory", "--mib", "1", "--budget-mib", "1",
                "--dir", str(tmp_path))
  assert re.search(r"peak RSS growth \d+ MiB, [0-9.]+ s", stdout), stdout


@pytest.mark.timeout(240)
def test_restart(tmp_path):
  out = tmp_path / "restart.json"
  text = _run("restart", "--processes", "1", "--runs", "1", "--mib", "4",
              "--width", "128", "--out", str(out))
  assert "| 1 | overlap |" in text and "| 1 | sequential |" in text, text
  rows = json.loads(out.read_text())["rows"]
  assert {r["variant"] for r in rows} == {"sequential", "overlap"}
  for r in rows:
    assert r["first_step_s"] > r["both_s"] > 0 and r["bytes"] > 0, r


@pytest.mark.timeout(200)
def test_reuse_cost():
  stdout = _run("reuse_cost", "--frozen-mib", "4", "--train-mib", "1",
                "--dense-mib", "4", "--rounds", "1")
  assert "target: reuse hands 1.00 MiB to the disk" in stdout
  assert "dense overhead of reuse, cpu_s:" in stdout


@pytest.mark.timeout(240)
def test_untrusted(tmp_path):
  """The hostile files of docs/untrusted.md, tiny: each is refused (never
  read as data), each line has its seconds and peak RSS growth."""
  stdout = _run("untrusted", "--preset", "smoke", "--dir", str(tmp_path),
                "--items", "90")
  lines = stdout.strip().splitlines()
  assert [l.split(":")[0] for l in lines] == [
      "nils", "dups", "huge", "bomb", "90 x1048512"], stdout
  for line in lines:
    assert re.search(r" [0-9.]+ s, cpu [0-9.]+ s, peak RSS \+\d+ MiB; ",
                     line), line
  for line in lines[:4]:
    assert "; CorruptCheckpointError: " in line, line
  assert "duplicate leaf paths" in lines[1], lines[1]
  assert "leaf 'w'" in lines[3], lines[3]  # the bomb: refused at open
  assert "more lists than a real index" in lines[4], lines[4]


@pytest.mark.timeout(240)
def test_gpu_bench_on_cpu(tmp_path):
  """scripts/gpu_bench.py (issue 37.6, written for a GPU) on this CPU: every
  system saves, restores and gives back equal arrays, and the table has a
  row per system."""
  stdout = _run("gpu_bench", "--gib", "0.004", "--leaves", "2", "--rounds",
                "2", "--systems", "ckpt,ckpt1g,ckptpage,raw", "--dir", str(tmp_path))
  rows = [json.loads(line) for line in stdout.splitlines()
          if line.startswith("{")]
  checks = [r for r in rows if r.get("what") == "check"]
  assert len(checks) == 8 and all(r["equal"] for r in checks), checks
  assert not [r for r in rows if r.get("what") == "error"], rows
  for name in ("ckpt", "ckpt1g", "ckptpage", "raw"):
    assert re.search(rf"^\| {name} \| [0-9.]+ \|", stdout, re.M), stdout
  assert "unverified" in stdout
  assert not any(tmp_path.iterdir())  # it cleaned up


@pytest.mark.timeout(120)
def test_gpu_d2h_on_cpu():
  """scripts/gpu_d2h.py: each way to the host, three times, equal bytes."""
  stdout = _run("gpu_d2h", "--gib", "0.004", "--leaves", "2")
  rows = [json.loads(line) for line in stdout.splitlines()
          if line.startswith("{")]
  ways = {r["way"] for r in rows if r.get("equal")}
  assert ways == {"device_get", "async_then_asarray", "pinned_host"}, rows
  assert len(rows) == 9 and all(r["equal"] and r["wall_s"] > 0 for r in rows)


@pytest.mark.timeout(240)
def test_bench_safetensors(tmp_path):
  out = tmp_path / "st.json"
  stdout = _run("bench_safetensors", "--hidden", "128", "--layers", "2",
                "--vocab", "256", "--layouts", "1x8,2x2", "--fsdp-on",
                "out,in", "--out", str(out), "--dir", str(tmp_path))
  assert "load_file + device_put" in stdout and "ckpt export" in stdout
  rep = json.loads(out.read_text())
  rows = {(r["layout"], r["fsdp_on"], r["system"]): r for r in rep["rows"]}
  assert len(rows) == 8
  total = rep["model_bytes"]
  one = rows[("1x8", "out", "load_safetensors")]
  assert one["asked"] == [total] and one["wall_s"] > 0
  two = rows[("2x2", "out", "load_safetensors")]
  # fsdp across the 2 processes splits the files' rows: each asks and
  # fetches about half (the norms, replicated, are read by both).
  assert all(a < 0.6 * total for a in two["fetched"]), two
  assert all(0 < p <= (256 << 20) for p in two["peak"]), two
  assert [r["system"] for r in rep["export"]] == ["ckpt export",
                                                  "ckpt.load + save_file"]
  assert rep["export"][0]["written"] == total
