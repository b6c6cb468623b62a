"""Read-only queries from any subset of processes (issue: a rank-0
``all_steps()`` used to hang the job until the barrier timeout)."""

from __future__ import annotations

from tests.multiprocess import launch as launch_lib
from tests.multiprocess import queries_worker


def test_rank_zero_queries_do_not_wait_for_the_others(tmp_path):
  out = launch_lib.launch("tests.multiprocess.queries_worker",
                          {"dir": str(tmp_path / "ck"), "timeout": 60}, 2, 2,
                          result=queries_worker.Result)
  assert out[0].rank1 == {} and out[1].rank0 == {}, out
  a0, a1 = out[0].rank0, out[1].rank1
  assert sorted(a0) == ["1", "2", "3"], a0
  for s in ("1", "2", "3"):
    got = a0[s]
    assert got.all == list(range(1, int(s) + 1))
    assert got.latest == int(s) and got.best == int(s)
    assert got.metrics == {"loss": 10.0 - int(s)}
    assert got.meta == ["w"] and got.host_state == {"p": 0}
    assert got.should is True
  assert a1 == {"2": queries_worker.Rank1([1, 2], {"p": 1})}
  for r in out:  # no query waited for the other process's barrier
    assert r.slowest_query_s < 10, r
    assert r.exact and r.restored == 3, r
