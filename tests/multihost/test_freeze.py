"""A frozen process 0 ends the job in bounded time (ckpt/multihost/process.py).

2 real processes; process 0 stops itself (SIGSTOP) inside ``save(2)``, as a
debugger, a swapped-out host or a hang in native code would stop it, and
with it the coordination service it runs. Process 1 must raise
``BarrierTimeoutError`` naming process 0 within ``barrier_timeout_s`` +
``GRACE_S`` of the freeze; before, its key-value set (or its barrier) waited
until JAX's heartbeat aborted it (SIGABRT after about 100 s, no ckpt
error). JAX's heartbeat (100 s) cannot fire first: the bound here is 3 s.
"""

import os
import time

import pytest

from ckpt.multihost import local_cluster
from ckpt.multihost import process as multihost
from tests.multihost import freeze_worker
from tests.multiprocess import worker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BARRIER_S = 3.0
RESTORE_BARRIER_S = 15.0  # > ANSWER_S / 2: a question's wait could pass it
SLACK_S = 3.0  # the error reaching the worker's result, on a loaded machine


def stopped(pid: int) -> bool:
  with open(f"/proc/{pid}/stat") as f:
    return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize("first", ["frozen", "waiting"])
def test_a_frozen_process_0_fails_the_others_in_bounded_time(tmp_path, first):
  r = frozen_job(tmp_path, first, BARRIER_S)
  assert "step 2" in r.call.error.msg, r


def test_a_frozen_process_0_fails_a_restore_within_the_bound_and_grace(
    tmp_path):
  """Process 0 stops inside a resume while process 1 waits at the
  restore's next round, with ``barrier_timeout_s`` above ANSWER_S / 2:
  process 1 raises within the bound + GRACE_S (before, the question asked
  of the silent service at ANSWER_S-capped intervals waited its whole
  ANSWER_S past the bound: 30 s for a bound of 15)."""
  r = frozen_job(tmp_path, "restore", RESTORE_BARRIER_S)
  assert "step 1" in r.call.error.msg, r


def frozen_job(tmp_path, first: str, barrier_s: float) -> freeze_worker.Result:
  """Runs the worker; process 1's result, checked to have raised
  BarrierTimeoutError naming process 0 within ``barrier_s`` + GRACE_S
  (+ SLACK_S) of process 0's freeze."""
  sync = tmp_path / "sync"
  sync.mkdir()
  cluster = local_cluster.start(
      "tests.multihost.freeze_worker",
      {"dir": str(tmp_path / "ckpt"), "sync": str(sync), "first": first,
       "timeout": barrier_s},
      num_processes=2, devices_per_process=1, cwd=ROOT)
  try:
    if first == "waiting":
      cluster.wait_for_files([sync / "entering"], 120)
      time.sleep(0.5)  # process 1 is in the save round's barrier by now
      (sync / "go").touch()
    cluster.wait_for_files([sync / "freezing"], 120)
    end = time.monotonic() + 30
    while not stopped(cluster.pids()[0]):
      assert time.monotonic() < end, "process 0 did not stop"
      time.sleep(0.01)
    frozen_at = time.time()
    (sync / "stopped").touch()
    limit = barrier_s + multihost.GRACE_S + SLACK_S + 30
    end = time.monotonic() + limit
    while cluster.poll()[1] is None and time.monotonic() < end:
      time.sleep(0.05)
  finally:
    cluster.kill(0)
    results = cluster.wait(0, grace_s=5)
  one = results[1]
  assert one.result is not None, (
      f"process 1 did not answer within {limit:.0f} s of the freeze "
      f"(exit {one.returncode}):\n{one.output[-3000:]}")
  r = worker.decode(freeze_worker.Result, one.result)
  seconds = r.at - frozen_at
  error = r.call.error
  assert error is not None, r
  print(f"{first}: process 1 raised {error.type} {seconds:.1f} s after "
        f"process 0 stopped: {error.msg}")
  assert r.barrier_timeout, r
  assert "process 0" in error.msg and "did not answer" in error.msg, r
  assert "processes that did not answer: [0]" in error.msg or (
      "did not arrive: [0]" in error.msg), r
  assert seconds < barrier_s + multihost.GRACE_S + SLACK_S, (seconds, r)
  return r
