"""The multi-tier benchmark and the scale harness's plan and requests parts
run end to end on tiny settings (not timed). The rest:
tests/test_benchmarks_smoke.py.
"""

from __future__ import annotations

import json

import pytest

from tests.benchrun import ROOT, run as _run


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
