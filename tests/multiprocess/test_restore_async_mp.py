"""restore_async is collective like restore: its result() ends alike on
every process (tests/multiprocess/restore_async_worker.py)."""

from __future__ import annotations

from tests.multiprocess import launch as launch_lib


def test_restore_async_in_a_two_process_job(tmp_path):
  out = launch_lib.launch("tests.multiprocess.restore_async_worker",
                          {"dir": str(tmp_path / "ck")}, 2, 2)
  for r in out:
    assert r["overlap_exact"] and r["refused_then_exact"], r
    assert "restore_async of step 1 is in flight" in r["refused"], r
    assert "cancelled: close() was called" in r["closed"], r
    assert r["failure_s"] < 60, r
  # Both raise the same error, naming process 1 and the chunk it read.
  assert out[0]["failure"] == out[1]["failure"], out
  assert out[1]["failure"].startswith(
      "CorruptCheckpointError: restore of step 2 failed on process 1 of 2: "
      "CorruptCheckpointError: leaf 'w'"), out
  assert "checkpoint_2/w/1.0" in out[1]["failure"]
  # A handle dropped without result() holds nothing: the next restore and
  # save work (before, both were refused until close()).
  for r in out:
    assert r["dropped"] == {"restore_exact": True, "save": None}, r
