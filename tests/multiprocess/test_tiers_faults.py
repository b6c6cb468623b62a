"""The local tier's save under faults, in real 2-process jobs (issue 23,
items 1 and 10): a process that cannot create its step directory, a peer
stopped in the middle of a save, and the coordination keys left behind.
"""

from __future__ import annotations

import os
import pathlib
import signal
import time

import pytest

from ckpt.multihost import local_cluster
from tests.multiprocess import worker
from tests.multiprocess.tiers_faults_worker import Result

REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
WORKER = "tests.multiprocess.tiers_faults_worker"
TIMEOUT_S = 8     # barrier_timeout_s of these jobs
MARGIN_S = 7      # what a loaded 2-core machine may add to it


def _conf(tmp_path, scenario: str, **extra) -> dict:
  return {"persistent": str(tmp_path / "persistent"),
          "local": str(tmp_path / "local"), "flags": str(tmp_path),
          "scenario": scenario, "timeout_s": TIMEOUT_S, **extra}


def _results(results) -> list[Result]:
  return [worker.decode(Result, r) for r in local_cluster.check(results)]


def _listdir(path) -> list[str]:
  try:
    return os.listdir(path)
  except FileNotFoundError:
    return []


def test_a_process_that_cannot_create_its_step_directory_fails_all(tmp_path):
  """Process 1's local directory is a file at step 2: every process raises
  a CheckpointError naming process 1, at the start round (not by a
  timeout, and not inside the partner exchange, which process 1 would
  never join: on the old code process 0 hung there); step 3 saves and
  restores once the directory is back."""
  results = _results(local_cluster.run(
      WORKER, _conf(tmp_path, "mkdir"), num_processes=2,
      devices_per_process=2, timeout_s=120, cwd=REPO_ROOT))
  for r in results:
    assert r.saves["1"].outcome.ok, r
    failed = r.saves["2"].outcome
    err = failed.error
    assert err and err.type == "CheckpointError", r
    # Refused in the first round that reaches the broken directory: the
    # multi-tier save's timeline round (listing process_1/), else the local
    # tier's start round (creating the step directory).
    assert "process 1" in err.msg, err
    assert "NotADirectoryError" in err.msg, err
    assert failed.seconds < TIMEOUT_S, r  # learned in the round
    assert r.saves["3"].outcome.ok, r
    assert r.local_steps == [1, 3], r
    assert r.entries == ["step_1", "step_3"], r  # nothing left of step 2
    assert r.restored == [3, True] and r.tier == "local", r
  assert "failed on process(es) [1]" in results[0].saves["2"].outcome.error.msg


@pytest.mark.parametrize("delay_s", [0.0, 0.1])
def test_a_stopped_peer_holds_no_one_past_the_timeout(tmp_path, delay_s):
  """Process 1 is SIGSTOPped (alive, but it never joins) once its step-2
  directory appears, or ``delay_s`` later, when it may be past the start
  round, in the partner exchange or at the commit barrier. Process 0 must
  raise a timeout within barrier_timeout_s + margin wherever that was (the
  old code: inside the ppermute, until the test gave up), and process 1,
  once resumed, must end with an error within the same bound; then step 3
  saves, or is refused everywhere if process 0 abandoned the exchange."""
  # 32 MiB per process: a save takes far longer than delay_s (the stop
  # lands before process 1 reaches the commit barrier).
  conf = _conf(tmp_path, "stop", rows=32768)
  cluster = local_cluster.start(WORKER, conf, num_processes=2,
                                devices_per_process=2, cwd=REPO_ROOT)
  mine = tmp_path / "local" / "process_1"
  try:
    cluster.wait_for_files([tmp_path / "before_2"], 120)
    deadline = time.monotonic() + 30
    while not any(n.startswith("step_2.tmp-") for n in _listdir(mine)):
      assert time.monotonic() < deadline, "process 1 never started save 2"
      assert all(c is None for c in cluster.poll()), cluster.poll()
      time.sleep(0.0005)
    time.sleep(delay_s)
    cluster.kill(1, signal.SIGSTOP)
    cluster.wait_for_files([tmp_path / "p0_done"], TIMEOUT_S + 60)
    resumed = time.time()
    cluster.kill(1, signal.SIGCONT)
    results = _results(cluster.wait(120))
  except BaseException:
    cluster.kill(1, signal.SIGCONT)
    cluster.wait(0, grace_s=0)
    raise
  p0, p1 = results
  assert p0.saves["1"].outcome.ok and p1.saves["1"].outcome.ok, results
  waited = p0.saves["2"].outcome
  assert waited.error and waited.error.type == "BarrierTimeoutError", p0
  assert waited.seconds < TIMEOUT_S + MARGIN_S, p0
  print(f"stopped {delay_s} s in: process 0 waited {waited.seconds:.1f} s: "
        f"{waited.error}")
  stopped = p1.saves["2"]
  assert stopped.outcome.error and stopped.outcome.error.type.endswith(
      "Error"), p1
  assert stopped.ended - resumed < TIMEOUT_S + MARGIN_S, (
      stopped.ended - resumed, p1)
  assert p0.p1_done, p0
  # Step 3: a process that abandoned the exchange (its device collectives
  # may be out of step) refuses every later local save, on all processes
  # at once; after a timeout at a barrier, the next save works. (Process
  # 1, stopped in the exchange, may find its own deadline passed when it
  # resumes: then it abandons it too.)
  abandoned = "partner exchange" in waited.error.msg
  if abandoned or not (p0.saves["3"].outcome.ok and p1.saves["3"].outcome.ok):
    for r in results:
      refused = r.saves["3"].outcome
      assert refused.error and (
          "abandoned the partner exchange" in refused.error.msg), r
      assert refused.seconds < TIMEOUT_S, r
    if abandoned:
      assert "process 0 abandoned" in p0.saves["3"].outcome.error.msg, p0


def test_local_saves_and_restores_leave_no_growing_keys(tmp_path):
  """Two phases, 5 and 15 saves (every 5th also to the persistent tier),
  each followed by latest_step, a restore and one more save: the keys left
  in the coordination service are as many after the second phase as after
  the first (the old code left n + 1 = 3 more per local save)."""
  results = _results(local_cluster.run(
      WORKER, _conf(tmp_path, "keys", phases=[5, 15], persistent_interval=5,
                    timeout_s=60),
      num_processes=2, devices_per_process=2, timeout_s=180, cwd=REPO_ROOT))
  first, second = results[0].phases
  for phase, latest in ((first, 5), (second, 21)):
    assert phase.latest == latest, phase
    assert phase.restored == [latest, True], phase
    assert phase.tier == "local", phase
  assert len(second.keys) == len(first.keys), (first.keys, second.keys)
  assert len(first.keys) <= 12, first.keys
