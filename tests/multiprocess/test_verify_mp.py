"""A resume whose newest step fails verification on one process only: every
process falls back to the same older step (tests/multiprocess/verify_worker.py)."""

from __future__ import annotations

from tests.multiprocess import launch as launch_lib


def test_resume_falls_back_on_every_process(tmp_path):
  out = launch_lib.launch("tests.multiprocess.verify_worker",
                          {"dir": str(tmp_path / "ck")}, 2, 2)
  assert out[0]["rows"] == [0] and out[1]["rows"] == [128]
  for r in out:
    assert r["step"] == 1 and r["exact"], out
    assert r["steps"] == [2, 3], r
  # Only process 1 reads the damaged chunk; an explicit restore(2) raises
  # on both (tests/multiprocess/test_restore_agree.py), naming it.
  assert out[0]["explicit"] == out[1]["explicit"], out
  assert "leaf 'w'" in out[1]["explicit"] and "checkpoint_2/w/1.0" in out[1][
      "explicit"] and "crc32c" in out[1]["explicit"]
  assert "failed on process 1 of 2" in out[1]["explicit"]
