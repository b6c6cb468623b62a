"""The calls of a save into the coordination service process 0 runs (each
is one more for it: docs/at-scale.md#process-0-per-process): in a later
save's round a process whose post is the one process 0 accepted in the last
save only arrives at the round's barrier, and the outcome is one key read
with one blocking get (no barrier "done"); what a process posts
differently is still heard by every process."""

import os

from ckpt.multihost import local_cluster
from tests.multiprocess import round_worker
from tests.multiprocess import worker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 60


def test_unchanged_post_costs_no_set_and_a_changed_one_is_heard(tmp_path):
  results = [worker.decode(round_worker.Result, r)
             for r in local_cluster.check(local_cluster.run(
                 "tests.multiprocess.round_worker",
                 {"dir": str(tmp_path), "timeout": TIMEOUT_S},
                 num_processes=2, devices_per_process=2, timeout_s=120,
                 cwd=ROOT))]
  for pid, r in enumerate(results):
    # The later saves post nothing; after a refused round every process
    # posts in full again.
    assert r.posted == [1, 0, 1, 0], (pid, r.posted)
    # The changed host value reached process 0, which refused the save
    # on both processes alike, before anything was written.
    assert r.mismatch.error is not None, r
    assert r.mismatch.error.type == "InvalidStateError", r.mismatch
    assert "leaf 'lr' differs between process 0 and process(es) [1]" in (
        r.mismatch.error.msg), r.mismatch.error.msg
    assert r.mismatch.seconds < TIMEOUT_S / 4, r.mismatch
    assert r.steps == [1, 2, 4, 5], r.steps
    assert r.exact, r
  assert results[0].mismatch.error.msg == results[1].mismatch.error.msg
  # Process 1's calls per save: 3 key-value calls in full (the post, the
  # decision, the outcome), 2 without the post, and 2 barriers ("start/in",
  # "written"); process 0's also include retention's own.
  assert results[1].kv_calls == [3, 2, 3, 2], results[1].kv_calls
  assert results[1].barriers == [2, 2, 2, 2], results[1].barriers
  assert results[0].barriers == [2, 2, 2, 2], results[0].barriers
