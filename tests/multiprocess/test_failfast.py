"""A save that fails on one process fails on all of them promptly."""

import os

import pytest

import ckpt
from ckpt.multihost import local_cluster
from tests.multiprocess import failfast_worker
from tests.multiprocess import worker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 60


@pytest.mark.parametrize("async_save,processes", [
    (False, 2), (True, 2),
    # Processes 2 and 3 hear of process 1's failure from process 0, which
    # alone reads the failures at "written" and relays them at "done".
    (True, 4)])
def test_write_failure_on_one_process_fails_every_process_fast(
    tmp_path, async_save, processes):
  results = [worker.decode(failfast_worker.Result, r)
             for r in local_cluster.check(local_cluster.run(
                 "tests.multiprocess.failfast_worker",
                 {"dir": str(tmp_path), "async": async_save,
                  "timeout": TIMEOUT_S},
                 num_processes=processes,
                 devices_per_process=4 // processes, timeout_s=120,
                 cwd=ROOT))]
  p0, p1 = results[:2]
  for r in results[2:]:  # the same message as process 0's
    assert r.save.error.msg == p0.save.error.msg, (r, p0)
  for r in results:
    assert r.save.error is not None, r
    assert issubclass(getattr(ckpt, r.save.error.type), ckpt.CheckpointError), r
    assert "step 2" in r.save.error.msg, r.save.error.msg
    assert "leaf 'w'" in r.save.error.msg, r.save.error.msg
    # learned at the barrier, not by timeout
    assert r.save.seconds < TIMEOUT_S / 4, r
    assert r.steps == [1], r
    assert r.step1_exact, r
  assert "process(es) [1]" in p0.save.error.msg, p0.save.error.msg
  assert "deleted" in p1.save.error.msg, p1.save.error.msg
