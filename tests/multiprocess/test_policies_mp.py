"""save_interval_secs and skip_while_saving in real 2-process jobs: every
process saves exactly the same steps, decided by process 0.

Process 1 runs under libfaketime with its clock 10 times faster than
process 0's (``FAKETIME="+0 x10"``): deciding on its own clock it would
save by time at nearly every step; it follows process 0's decisions
instead. libfaketime: ``apt-get install faketime`` (.ci/run installs it);
without it the interval test runs with both clocks real (it still checks
that both processes agree) and says so.
"""

from __future__ import annotations

import pytest

from ckpt.multihost import local_cluster
from tests.multiprocess import launch
from tests.multiprocess import policies_worker
from tests.multiprocess import worker
from tests import faketime

WORKER = "tests.multiprocess.policies_worker"
EVERY, SECS, STEPS = 25, 0.6, 60


def _fast_clock(pid: int) -> list[str]:
  """Process 1's clock runs 10x (its monotonic clock stays real)."""
  if pid != 1:
    return []
  return ["env", f"LD_PRELOAD={faketime.LIBS[0]}", "FAKETIME=+0 x10",
          "FAKETIME_DONT_FAKE_MONOTONIC=1"]


def _run(conf: dict, prefix=None) -> list:
  results = local_cluster.run(WORKER, conf, num_processes=2,
                              devices_per_process=2, cwd=str(launch.REPO),
                              timeout_s=launch.TIMEOUT_S, prefix=prefix)
  out = local_cluster.check(results)
  return out


def _alone(clock: list[float]) -> list[int]:
  """The steps a process would save deciding on its own ``clock``."""
  saved, last = [], clock[0]
  for step, now in enumerate(clock):
    if step % EVERY == 0 or now - last >= SECS:
      saved.append(step)
      last = now
  return saved


@faketime.needs_faketime
def test_interval_is_decided_by_process_0(tmp_path):
  conf = {"scenario": "interval", "dir": str(tmp_path / "ck"), "every": EVERY,
          "secs": SECS, "steps": STEPS, "step_s": 0.05}
  p0, p1 = (worker.decode(policies_worker.Interval, r)
            for r in _run(conf, _fast_clock))
  # The clocks differ: process 1's ran about 10x as fast.
  span0 = p0.clock[-1] - p0.clock[0]
  span1 = p1.clock[-1] - p1.clock[0]
  assert span1 > 5 * span0, (span0, span1)
  # The same decisions on both processes, at every step.
  assert p0.asked == p1.asked
  assert p0.saved == p1.saved
  saved = [s for s, ok in enumerate(p0.saved) if ok]
  by_time = [s for s in saved if s % EVERY]
  assert [s for s in saved if s % EVERY == 0] == [0, 25, 50]
  assert len(by_time) >= 2, saved  # the interval did save steps
  # Process 1 alone would have saved other steps (many more).
  assert _alone(p1.clock) != saved
  assert len(_alone(p1.clock)) > len(saved)
  # Temporary steps went as the next ones landed: the multiples stay, and
  # the newest if it was saved by time.
  last = saved[-1]
  want = [0, 25, 50] + ([last] if last % EVERY else [])
  assert p0.committed == p1.committed == want
  assert p0.temporary == ([last] if last % EVERY else [])
  # The root metadata, written once by process 0, read by each process.
  assert p0.root == p1.root == {"run": "mp"}


@pytest.mark.parametrize("holder", [0, 1])
def test_skip_while_saving_is_agreed(tmp_path, holder):
  """Step 0's save is held by one process (process 0, or process 1 while
  process 0 waits for it at the "written" barrier): both processes skip
  steps 1 and 2 at once, then save step 3."""
  conf = {"scenario": "skip", "dir": str(tmp_path / "ck"), "holder": holder}
  p0, p1 = (worker.decode(policies_worker.Skip, r) for r in _run(conf))
  for p in (p0, p1):
    assert p.during == [False, False, False, False]
    assert p.after == [True, True]
    assert p.committed == [0, 3]


def test_a_failing_clock_on_process_0_fails_the_decision_everywhere(tmp_path):
  """Process 0's clock raises inside the decision round: save(1) raises the
  same CheckpointError on both processes at once (no process waits for a
  barrier timeout); the next calls work on both."""
  conf = {"scenario": "clockfail", "dir": str(tmp_path / "ck")}
  p0, p1 = (worker.decode(policies_worker.ClockFails, r) for r in _run(conf))
  assert p0.save.error == p1.save.error
  assert p0.save.error.type == "CheckpointError"
  assert "the clock broke" in p0.save.error.msg
  assert p0.save.seconds < 30 and p1.save.seconds < 30
  for p in (p0, p1):
    assert p.should.ok and p.should.value is False
    assert p.after.ok and p.after.value is True
    assert p.committed == [3]


def test_processes_whose_rules_differ_follow_process_0(tmp_path, capsys):
  """should_save_fn says yes on process 1 and no on process 0: with
  save_interval_secs every save() makes the one round and both take
  process 0's answer (nothing saved, nobody waits for a barrier)."""
  conf = {"scenario": "differ", "dir": str(tmp_path / "ck")}
  p0, p1 = (worker.decode(policies_worker.Differ, r) for r in _run(conf))
  assert p0.saved == p1.saved == [False] * 20
  assert p0.committed == p1.committed == []
  with capsys.disabled():  # what one skipped save() costs (a read round)
    print(f"\na save() skipped by process 0's decision: {p0.round_s * 1e3:.1f}"
          f" / {p1.round_s * 1e3:.1f} ms (processes 0 / 1)")
