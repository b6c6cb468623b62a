"""restore_async is collective like restore: its result() ends alike on
every process (tests/multiprocess/restore_async_worker.py)."""

from __future__ import annotations

from tests.multiprocess import launch as launch_lib
from tests.multiprocess import restore_async_worker
from tests.multiprocess.worker import Outcome


def said(o: Outcome) -> str:
  """What a call that raised raised, as "<type>: <message>"."""
  assert o.error is not None, o
  return f"{o.error.type}: {o.error.msg}"


def test_restore_async_in_a_two_process_job(tmp_path):
  out = launch_lib.launch("tests.multiprocess.restore_async_worker",
                          {"dir": str(tmp_path / "ck")}, 2, 2,
                          result=restore_async_worker.Result)
  for r in out:
    assert r.overlap_exact and r.refused_then_exact, r
    assert "restore_async of step 1 is in flight" in said(r.refused), r
    assert "cancelled: close() was called" in said(r.closed), r
    assert r.failure.seconds < 60, r
  # Both raise the same error, naming process 1 and the chunk it read.
  assert said(out[0].failure) == said(out[1].failure), out
  assert said(out[1].failure).startswith(
      "CorruptCheckpointError: restore of step 2 failed on process 1 of 2: "
      "CorruptCheckpointError: leaf 'w'"), out
  assert "checkpoint_2/w/1.0" in said(out[1].failure)
  # A handle dropped without result() holds nothing: the next restore and
  # save work (before, both were refused until close()).
  for r in out:
    assert r.dropped.restore_exact and r.dropped.save.ok, r
