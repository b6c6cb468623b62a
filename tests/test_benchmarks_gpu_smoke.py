"""The GPU benchmarks of scripts/ (written for an accelerator) run end to
end on this machine's CPU devices (not timed). The rest:
tests/test_benchmarks_smoke.py.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.benchrun import run as _run


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
