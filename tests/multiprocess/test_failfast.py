"""A save that fails on one process fails on all of them promptly."""

import os

import pytest

from ckpt.multihost import local_cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 60


@pytest.mark.parametrize("async_save", [False, True])
def test_write_failure_on_one_process_fails_every_process_fast(tmp_path,
                                                               async_save):
  results = local_cluster.check(local_cluster.run(
      "tests.multiprocess.failfast_worker",
      {"dir": str(tmp_path), "async": async_save, "timeout": TIMEOUT_S},
      num_processes=2, devices_per_process=2, timeout_s=120, cwd=ROOT))
  p0, p1 = results
  for r in results:
    assert r["msg"] is not None, r
    assert "step 2" in r["msg"], r["msg"]
    assert "leaf 'w'" in r["msg"], r["msg"]
    assert r["elapsed"] < TIMEOUT_S / 4, r  # learned at the barrier, not by timeout
    assert r["steps"] == [1], r
    assert r["step1_exact"], r
  assert "process(es) [1]" in p0["msg"], p0["msg"]
  assert "deleted" in p1["msg"], p1["msg"]
