"""Read once overlaps the next batch's reads with the current exchange
(ckpt/restore/readonce.py ``finish``), across real processes (2 x 2 devices,
tests/multiprocess/overlap_worker.py): six leaves, one per exchange batch
under a small ``concurrent_bytes``.

- Every exchange but the last starts with the next batch's read already
  under way (the worker waits, bounded, for it to start before it lets the
  exchange run, and records whether it had; before, a batch was read only
  after the previous exchange, so this waited the whole bound and said
  no), the result is bit-exact in the target's sharding, and each batch
  costs at most half the budget (two at a time within it).
- A read that fails on one process while the previous batch is exchanged
  makes every process raise, naming that process's error, within the
  round's timeout (no hang: the same rounds and exchanges run everywhere);
  the next restore works.
"""

from __future__ import annotations

import pathlib

from ckpt.multihost import local_cluster
from tests.multiprocess import overlap_worker as worker
from tests.multiprocess import worker as worker_lib

REPO = pathlib.Path(__file__).resolve().parents[2]
WORKER = "tests.multiprocess.overlap_worker"


def launch(config: dict) -> list[worker.Result]:
  return [worker_lib.decode(worker.Result, r)
          for r in local_cluster.check(local_cluster.run(
              WORKER, config, num_processes=2, devices_per_process=2,
              timeout_s=150, cwd=str(REPO)))]


def test_next_batch_is_read_while_the_current_one_is_exchanged(tmp_path):
  out = launch({"dir": str(tmp_path / "ck"), "op": "restore"})
  for r in out:
    assert r.restore.error is None, r.restore.error
    assert r.bad == [], r.bad
    s = r.stats
    # Every exchange but the last overlapped the next batch's read.
    assert r.overlapped == [True] * (worker.N_LEAVES - 1), r.overlapped
    assert s["batches"] == worker.N_LEAVES, s
    assert s["overlapped_batches"] == worker.N_LEAVES - 1, s
    assert s["read_once_leaves"] == worker.N_LEAVES, s
    # One batch (its parts + gathered boxes) within half the budget, so the
    # batch exchanged and the one read hold at most the budget together.
    assert 0 < s["peak_batch_bytes"] <= worker.BUDGET // 2, s
    assert s["peak_read_bytes"] <= worker.BUDGET // 2, s


def test_a_read_failing_on_one_process_during_an_exchange_fails_all(
    tmp_path):
  out = launch({"dir": str(tmp_path / "ck"), "op": "fail", "fail_on": 1,
                "fail_batch": 2})
  want = "injected read failure on process 1, batch 2"
  for r in out:
    error = r.restore.error
    assert error is not None and want in error.msg, error
    # the round, not the 60 s timeout
    assert r.restore.seconds < 30, r.restore.seconds
    # The exchanges before the failed batch ran, overlapping the reads.
    assert r.overlapped[:2] == [True, True], r.overlapped
    assert r.again_bad == [], r.again_bad
  error = out[0].restore.error
  assert error.type == "CheckpointError", error
  assert "failed on process 1 of 2" in error.msg, error
