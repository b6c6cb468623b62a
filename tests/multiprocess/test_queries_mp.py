"""Read-only queries from any subset of processes (issue: a rank-0
``all_steps()`` used to hang the job until the barrier timeout)."""

from __future__ import annotations

from tests.multiprocess import launch as launch_lib


def test_rank_zero_queries_do_not_wait_for_the_others(tmp_path):
  out = launch_lib.launch("tests.multiprocess.queries_worker",
                          {"dir": str(tmp_path / "ck"), "timeout": 60}, 2, 2)
  a0, a1 = out[0]["answers"], out[1]["answers"]
  for s in ("1", "2", "3"):
    got = a0[s]
    assert got["all"] == list(range(1, int(s) + 1))
    assert got["latest"] == int(s) and got["best"] == int(s)
    assert got["metrics"] == {"loss": 10.0 - int(s)}
    assert got["meta"] == ["w"] and got["host_state"] == {"p": 0}
    assert got["should"] is True
  assert a1 == {"2": {"all": [1, 2], "host_state": {"p": 1}}}
  for r in out:  # no query waited for the other process's barrier
    assert r["slowest_query_s"] < 10, r
    assert r["exact"] and r["restored"] == 3, r
