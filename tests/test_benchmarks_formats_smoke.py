"""The benchmarks of other files run end to end on tiny settings (not
timed): hostile files (docs/untrusted.md), an Orbax checkpoint's import and
Hugging Face safetensors in and out. The rest: tests/test_benchmarks_smoke.py.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.benchrun import ORBAX, run as _run


@pytest.mark.timeout(240)
@pytest.mark.skipif(not ORBAX, reason="needs orbax-checkpoint")
def test_import_memory(tmp_path):
  stdout = _run("import_memory", "--mib", "1", "--budget-mib", "1",
                "--dir", str(tmp_path))
  assert re.search(r"peak RSS growth \d+ MiB, [0-9.]+ s", stdout), stdout


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
