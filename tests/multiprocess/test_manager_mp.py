"""The manager calls that involve agreement, in real 2-process jobs.

One launch (``tests/multiprocess/manager_worker.py``, 2 processes x 2 CPU
devices) runs ``delete`` and friends, then a training loop that calls
``save`` every step with ``save_interval_steps`` until SIGTERM stops it at
jax's preemption sync point. Every process must take the same decisions,
and skipped saves must make no agreement round.
"""

from __future__ import annotations

import pathlib
import signal
import time

import pytest

from ckpt.commit import steps as steps_lib
from ckpt.multihost import local_cluster
from ckpt.store import storage as storage_lib
from tests.multiprocess import manager_worker
from tests.multiprocess import worker

REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
WORKER = "tests.multiprocess.manager_worker"
INTERVAL = 7


def _outputs(results) -> str:
  return "\n".join(f"--- process {r.process_id} (exit {r.returncode}) ---\n"
                   f"{r.output[-3000:]}" for r in results)


@pytest.fixture(scope="module", params=[1, 0], ids=["sigterm1", "sigterm0"])
def job(tmp_path_factory, request):
  root = tmp_path_factory.mktemp("manager")
  marks = root / "marks"
  marks.mkdir()
  conf = {"dir": str(root / "del"), "interval_dir": str(root / "interval"),
          "marks": str(marks), "interval": INTERVAL, "max_s": 90}
  cluster = local_cluster.start(WORKER, conf, num_processes=2,
                                devices_per_process=2, cwd=REPO_ROOT)
  cluster.wait_for_files([marks / f"looping_{p}" for p in (0, 1)], 120)
  time.sleep(0.2)  # a few steps past 20, so saves of multiples happened
  cluster.kill(request.param, signal.SIGTERM)  # either process hears it
  results = cluster.wait(90)
  assert [r.returncode for r in results] == [0, 0], _outputs(results)
  return [worker.decode(manager_worker.Result, r)
          for r in local_cluster.check(results)], root


def test_delete_is_agreed(job):
  out, _ = job
  d0, d1 = (r.delete for r in out)
  for d in (d0, d1):
    assert d.metrics == {"loss": 0.5, "eval/n": 3}
    assert d.after_delete == [1, 3]
    assert d.missing.type == "CheckpointNotFoundError", d
    assert "step 2" in d.missing.msg
    # The step of a save in flight (process 0 still committing it).
    assert d.inflight.type == "CheckpointError", d
    assert "step 4" in d.inflight.msg and "being saved" in d.inflight.msg
    assert d.in_progress is True
    assert d.timeout.type == "WaitTimeoutError", d
    assert d.still_tracked is True and d.done is True
    assert d.before_delete_4 == [1, 3, 4] and d.final == [1, 3]
    assert d.restored_ok is True
    assert "'x'" in d.restored_spec
  # The same decision, word for word, on both processes.
  assert d0.missing == d1.missing and d0.inflight == d1.inflight


def test_interval_and_preemption_are_agreed(job):
  out, root = job
  i0, i1 = (r.interval for r in out)
  assert i0 == i1, "the processes took different decisions"
  p = i0.preempted_at
  assert p is not None and p > 20, i0
  saved = [s for s, ok, _ in i0.log if ok]
  # The first step of a fresh run, every multiple, and the preemption step.
  want = sorted({1, p} | {s for s in range(1, p + 1) if s % INTERVAL == 0})
  assert saved == want
  assert i0.steps == want
  storage = storage_lib.Storage(str(root / "interval"))
  assert steps_lib.committed_steps(storage) == want
  for step, ok, rounds in i0.log:
    if step == 1:
      assert rounds == 2, (step, rounds)  # "holds a checkpoint?" + the save
    elif ok:
      assert rounds == 1, (step, rounds)  # the save round
    else:
      assert rounds == 0, (step, rounds)  # skipped: no round, no I/O
