"""Every restore of a 2-process job ends alike when only one process reads
damaged data (tests/multiprocess/restore_agree_worker.py).

- An explicit ``restore(step)`` and a ``restore(path=...)``: every process
  raises CorruptCheckpointError naming process 1 and the damaged chunk
  (before, process 0 returned the step while process 1 raised, and process
  0 then waited in its next collective for a process that never came).
- A read-once resume past a damaged newest step: both processes fall back
  to step 1, also when process 1 reads each round's decision late (before,
  process 0 deleted the fallback attempt's keys, nested under the first
  attempt's, right after writing their decision: BarrierTimeoutError on
  both, about 1 run in 3, and every run with process 1 late).
"""

from __future__ import annotations

import pytest

from tests.multiprocess import launch as launch_lib
from tests.multiprocess import restore_agree_worker as w
from tests.multiprocess import worker


def run(scenario: str, config: dict, result):
  out = launch_lib.launch("tests.multiprocess.restore_agree_worker",
                          {"scenario": scenario, **config}, 2, 2)
  return [worker.decode(result, r) for r in out]


def test_an_explicit_step_or_path_fails_on_every_process(tmp_path):
  out = run("explicit", {"dir": str(tmp_path / "ck")}, w.Explicit)
  for call in ("step", "path"):
    errors = [getattr(r, call).error for r in out]
    for e in errors:
      assert e is not None and e.type == "CorruptCheckpointError", (call, out)
      assert "failed on process 1 of 2" in e.msg, (call, e)
      assert "checkpoint_2/w/1.0" in e.msg and "crc32c" in e.msg, (call, e)
      assert "leaf 'w'" in e.msg, (call, e)
    assert errors[0].msg == errors[1].msg, (call, errors)
  # The job goes on: the next restore (a collective) works on both.
  assert [r.after_exact for r in out] == [True, True], out


@pytest.mark.parametrize("slow", [0, 1.0])
def test_a_read_once_resume_falls_back_on_every_process(tmp_path, slow):
  out = run("fallback", {"dir": str(tmp_path / "ck"), "slow": slow},
            w.Fallback)
  for r in out:
    assert r.resume.ok, out
    assert r.step == 1 and r.exact, out

