"""The restore benchmarks of scripts/ run end to end on a tiny preset (not
timed): read-once, the first restore (in one process, rotated, in fresh
processes) and the restart to the first training step. The rest:
tests/test_benchmarks_smoke.py.
"""

from __future__ import annotations

import json

import pytest

from tests.benchrun import ORBAX, run as _run


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
