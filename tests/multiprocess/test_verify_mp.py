"""A resume whose newest step fails verification on one process only: every
process falls back to the same older step (tests/multiprocess/verify_worker.py)."""

from __future__ import annotations

from tests.multiprocess import launch as launch_lib
from tests.multiprocess import verify_worker


def test_resume_falls_back_on_every_process(tmp_path):
  out = launch_lib.launch("tests.multiprocess.verify_worker",
                          {"dir": str(tmp_path / "ck")}, 2, 2,
                          result=verify_worker.Result)
  assert out[0].rows == [0] and out[1].rows == [128]
  for r in out:
    assert r.step == 1 and r.exact, out
    assert r.steps == [2, 3], r
  # Only process 1 reads the damaged chunk; an explicit restore(2) raises
  # on both (tests/multiprocess/test_restore_agree.py), naming it.
  errors = [r.explicit.error for r in out]
  assert all(e is not None and e.type == "CorruptCheckpointError"
             for e in errors), out
  assert errors[0].msg == errors[1].msg, out
  assert "leaf 'w'" in errors[1].msg and "checkpoint_2/w/1.0" in errors[
      1].msg and "crc32c" in errors[1].msg
  assert "failed on process 1 of 2" in errors[1].msg
