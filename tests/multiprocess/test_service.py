"""Multi-process tests of the asynchronous checkpointing service.

Every test runs real ``jax.distributed`` jobs (2 processes x 2-4 CPU devices
on 127.0.0.1, see ``ckpt.multihost.local_cluster``) writing real TensorStore arrays to a
temporary disk. The processes run ``tests/multiprocess/service_worker.py``,
which checks what it can inside the job and returns a typed result (decoded
here: ``worker.RESULTS``); a launch costs a
few seconds of jax start-up, so each module-scoped fixture below is one
launch shared by the tests that assert on it (``shared_run``: one launch
for several scenarios, in turn). The SIGKILL loop is in
test_service_sigkill.py.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import time

import numpy as np
import pytest

import ckpt
from ckpt.commit import steps as steps_lib
from ckpt.multihost import local_cluster
from ckpt.store import storage as storage_lib
from ckpt.commit.retention import RetentionPolicy
from tests.multiprocess import service_worker as worker
from tests.multiprocess import worker as worker_lib

REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
WORKER = "tests.multiprocess.service_worker"


def _run(scenario: str, conf: dict, *, processes: int = 2, devices: int = 2,
         timeout_s: float = 120.0) -> list:
  results = local_cluster.run(WORKER, dict(conf, scenario=scenario),
                              num_processes=processes,
                              devices_per_process=devices,
                              timeout_s=timeout_s, cwd=REPO_ROOT)
  return _decoded(scenario, results)


def _decoded(scenario: str, results) -> list:
  """Each process's result, checked and decoded into the scenario's type."""
  return [worker_lib.decode(worker.RESULTS[scenario], r)
          for r in local_cluster.check(results)]


def _start(scenario: str, conf: dict, *, processes: int = 2,
           devices: int = 2) -> local_cluster.Cluster:
  return local_cluster.start(WORKER, dict(conf, scenario=scenario),
                             num_processes=processes,
                             devices_per_process=devices, cwd=REPO_ROOT)


def _outputs(results) -> str:
  return "\n".join(f"--- process {r.process_id} (exit {r.returncode}) ---\n"
                   f"{r.output[-3000:]}" for r in results)


# ---- 1 and 2: the async path and donation ----------------------------------

ASYNC_STEPS = [10, 20, 30, 40]
# Array bytes of the async scenario's params (w, b, r, i, h); none is inline.
ASYNC_ARRAY_BYTES = (512 * 1024 * 4 + 1024 * 4 + 256 * 256 * 4 + 128 * 512 * 4
                     + 256 * 512 * 2)


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
  root = tmp_path_factory.mktemp("async")
  return _run("async", {"dir": str(root)}, devices=4)


def test_async_save_returns_before_commit_and_serializes(async_run):
  for r in async_run:
    assert r.saved == [True] * len(ASYNC_STEPS)
    # save() came back while its step was still in flight (not committed) ...
    assert any(r.in_flight_at_return), r
    # ... and the next save() first waited for the previous one to commit.
    assert r.prev_committed_at_return == [True] * (len(ASYNC_STEPS) - 1)
    assert r.all_steps == ASYNC_STEPS
    assert r.sync_committed, "async_save=False returned before the commit"
    # A Checkpointer opened (and closed) on the directory while step 20 was
    # (most likely) in flight did not disturb the save (all steps committed).
    assert r.reader_saw in ([[10]], [[10, 20]]), r.reader_saw


def test_async_save_stats(async_run):
  for r in async_run:
    for row, step in zip(r.stats, ASYNC_STEPS):
      assert row.step == step and not row.skipped
      assert row.total_s > 0, row
      assert 0 < row.blocking_s <= row.total_s, row
  # Together the processes wrote every array byte exactly once.
  for k in range(len(ASYNC_STEPS)):
    assert sum(r.stats[k].bytes_written for r in async_run) == (
        ASYNC_ARRAY_BYTES)


def test_donated_state_saved_exactly_as_at_the_call(async_run):
  for r in async_run:
    # Three donating steps ran on the arrays passed to save() right after it
    # returned. On CPU devices save() keeps views of the buffers it has not
    # written yet, and XLA does not donate a buffer with outside references
    # (the step allocates its output instead), so whether each was donated
    # depends on how far the save got; either way what was saved is exact.
    assert len(r.donated) == len(ASYNC_STEPS)
    for step in ASYNC_STEPS:
      assert r.exact_sharded[str(step)], f"step {step} (sharded restore)"
      assert r.exact_full[str(step)], f"step {step} (host restore)"
      assert r.scalars[str(step)] == [step, f"s{step}"] * 2


# ---- 1: failures on the background thread ----------------------------------


BGFAIL_TIMEOUT_S = 5


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory) -> list[worker.Several]:
  """The scenarios on 2 x 2 devices that leave the job usable, then the
  barrier timeout (a process left behind at a barrier on purpose), in one
  job, each in its own directory: ``{scenario: result}`` per process."""
  root = tmp_path_factory.mktemp("shared")
  marks = root / "barrier" / "marks"
  marks.mkdir(parents=True)
  retention = [{k: v for k, v in c.items() if k != "history"}
               for c in RETENTION_CASES]
  parts = [
      ["bgfail", {"dir": str(root / "bgfail"),
                  "barrier_timeout_s": BGFAIL_TIMEOUT_S}],
      ["retention", {"dir": str(root / "retention"), "cases": retention}],
      ["restore_race", {
          "dir": str(root / "restore_race"), "variants": ["all"],
          "leaves": 16, "shape": [512, 2048], "second_shape": [1024, 1024],
          "budget": 64 << 10}],
      ["barrier_timeout", {"dir": str(root / "barrier"), "marks": str(marks),
                           "barrier_timeout_s": BARRIER_TIMEOUT_S}],
  ]
  for name, part in parts:
    if name != "barrier_timeout":
      os.makedirs(part["dir"])
  # The bound of the four launches it replaces, together.
  return _run("several", {"parts": parts}, timeout_s=3 * 120 + 90)


@pytest.fixture(scope="module")
def bgfail_run(shared_run):
  return [r.bgfail for r in shared_run]


def test_background_failure_reraised(bgfail_run):
  p0, p1 = bgfail_run
  for case, step in (("a", 2), ("b", 3), ("c", 5)):
    for r in bgfail_run:
      assert getattr(r, f"{case}_returned") is True, (
          "the failure came after staging")
    # Process 0 failed at the commit (rename onto a file) ...
    err = getattr(p0, case)
    assert err is not None, f"case {case}: no error on process 0"
    assert err.type == "CheckpointError", err
    assert f"step {step}" in err.msg and "NotADirectoryError" in err.msg
    # ... and process 1, waiting at the last barrier, was told by process 0
    # (not left to time out there).
    err = getattr(p1, case)
    assert err is not None, f"case {case}: no error on process 1"
    assert err.type == "CheckpointError", err
    assert f"step {step}" in err.msg, err
    assert "[0]" in err.msg and "NotADirectoryError" in err.msg, err
  for r in bgfail_run:
    assert r.a_again is None, "a failure is reported once"
    assert not r.b_step4_exists, "save(4) ran although save(3) had failed"
    assert r.c_closed and "closed" in r.c_closed.msg
    assert r.a_wait_s < BGFAIL_TIMEOUT_S - 1, r.a_wait_s  # no timeout


def test_after_background_failure_cleanup_and_save_again(bgfail_run):
  for r in bgfail_run:
    # Every process had stopped writing when the commit failed, so process 0
    # removed each failed attempt at once: nothing waits for a later job.
    assert r.tmp_before == [], r.tmp_before
    assert r.tmp_after == []
    assert r.all_steps == [1, 6]
    assert r.exact == {"1": True, "6": True}


# ---- 3: staging bounded by the budget --------------------------------------

BUDGET = 256 << 10
CHUNK = 64 << 10
# Resident memory a save may use beyond the budget (thread stacks, TensorStore
# and allocator overhead). Each process owns >= 16 MB in every case below.
RSS_SLACK = 6 << 20
BUDGET_CASES = {
    # Replicated jax array and host numpy array: cut into chunk-sized boxes.
    "chunked": {"shapes": {"rep": [[2048, 4096], "float32"],
                           "host": [[1024, 4096], "float32"]},
                "specs": {"rep": [], "host": None}},
    # Sharded over every device: each process owns two 8 MB shards.
    "sharded": {"shapes": {"w": [[2048, 4096], "float32"]},
                "specs": {"w": ["x", "y"]}},
}


@pytest.fixture(scope="module")
def budget_run(tmp_path_factory):
  root = tmp_path_factory.mktemp("budget")
  return _run("budget", {"dir": str(root), "budget": BUDGET,
                         "chunk_bytes": CHUNK, "cases": BUDGET_CASES})


def test_staging_within_budget(budget_run):
  for r in budget_run:
    c = r.cases["chunked"]
    assert c.exact
    assert c.bytes_written >= 16 << 20  # much more than the budget
    assert 0 < c.peak_bytes_in_flight <= BUDGET, c
    assert c.rss_delta <= BUDGET + RSS_SLACK, (
        f"resident memory grew by {c.rss_delta >> 20} MiB during a save "
        f"with a {BUDGET >> 10} KiB budget: {c}")


def test_staging_within_budget_when_shards_exceed_it(budget_run):
  for r in budget_run:
    c = r.cases["sharded"]
    assert c.exact
    assert c.bytes_written == 16 << 20
    assert c.boxes_written >= (16 << 20) // BUDGET  # shards were cut up
    assert 0 < c.peak_bytes_in_flight <= BUDGET, c
    assert c.rss_delta <= BUDGET + RSS_SLACK, (
        f"resident memory grew by {c.rss_delta >> 20} MiB during a save "
        f"with a {BUDGET >> 10} KiB budget: {c}")


# ---- 4: barrier timeout ----------------------------------------------------

BARRIER_TIMEOUT_S = 5


@pytest.fixture(scope="module")
def barrier_run(shared_run):
  """(each process's result, the longest a process spent in the
  scenario)."""
  out = [r.barrier_timeout for r in shared_run]
  return out, max(r.wall_s for r in out)


def test_barrier_timeout_names_barrier_step_and_late_process(barrier_run):
  (p0, p1), wall = barrier_run
  # Phase 0: process 1 never arrives at the save of step 7.
  saver, late = p0.phases["0"], p1.phases["0"]
  assert late.waited
  assert saver.barrier_error, saver.error
  assert (BARRIER_TIMEOUT_S - 0.5 <= saver.seconds
          <= BARRIER_TIMEOUT_S + 10), saver.seconds
  msg = saver.error.msg
  # The first barrier of a save is its start (the agreement round).
  assert re.search(r"barrier 'ckpt/\S+/save/7/\d+/start/in'", msg), msg
  assert "step 7" in msg, msg
  assert "did not arrive: [1]" in msg, msg
  assert wall < 60, wall
  assert p0.committed == [[], []]


def test_key_wait_timeout_raises_within_timeout(barrier_run):
  (p0, p1), _ = barrier_run
  # Phase 1: process 0 never arrives; process 1 waits for its token.
  saver, late = p1.phases["1"], p0.phases["1"]
  assert late.waited
  assert saver.barrier_error, saver.error
  assert (BARRIER_TIMEOUT_S - 0.5 <= saver.seconds
          <= BARRIER_TIMEOUT_S + 10), saver.seconds
  assert "did not arrive: [0]" in saver.error.msg, saver.error


def test_key_wait_timeout_names_step(barrier_run):
  (_, p1), _ = barrier_run
  assert "step 8" in p1.phases["1"].error.msg, p1.phases["1"].error


# ---- 5: retention in real jobs ---------------------------------------------

RETENTION_CASES = [
    {"name": "keep2", "kwargs": {"keep": 2}, "restart_after": 3,
     "saves": [[s, None] for s in range(1, 7)],
     "history": [[1], [1, 2], [2, 3], [3, 4], [4, 5], [5, 6]]},
    {"name": "period", "kwargs": {"keep": 1, "keep_period": 3},
     "saves": [[s, None] for s in range(1, 9)],
     "history": [[1], [2], [3], [3, 4], [3, 5], [3, 6], [3, 6, 7], [3, 6, 8]]},
    {"name": "best_min", "kwargs": {"keep": 2, "best_metric": "eval/loss"},
     "restart_after": 4,
     "saves": [[1, {"eval/loss": 5.0}], [2, {"eval/loss": 3.0}],
               [3, {"eval/loss": 4.0}], [4, {"eval/loss": 1.0, "acc": 0.5}],
               [5, {"eval/loss": 2.0}], [6, {"eval/loss": 6.0}]],
     "history": [[1], [1, 2], [2, 3], [2, 4], [4, 5], [4, 5, 6]]},
    {"name": "best_max", "kwargs": {"keep": 2, "best_metric": "acc",
                                    "best_mode": "max", "keep_period": 5},
     "saves": [[1, {"acc": 0.1}], [2, {"acc": 0.9}], [3, {"acc": 0.5}],
               [4, {"acc": 0.7}], [5, {"acc": 0.2}], [6, {"acc": 0.3}]],
     "history": [[1], [1, 2], [2, 3], [2, 4], [2, 4, 5], [2, 4, 5, 6]]},
    {"name": "missing_kept", "kwargs": {"keep": 1, "best_metric": "loss"},
     "saves": [[1, {"loss": 3}], [2, None], [3, {"loss": 1}],
               [4, {"other": 0}], [5, {"loss": 2}]],
     "history": [[1], [1, 2], [2, 3], [2, 3, 4], [2, 3, 4, 5]]},
    {"name": "missing_first",
     "kwargs": {"keep": 2, "best_metric": "loss",
                "keep_checkpoints_without_metrics": False},
     "saves": [[1, {"loss": 3}], [2, None], [3, {"loss": 1}], [4, None],
               [5, {"loss": 2}]],
     "history": [[1], [1, 2], [1, 3], [1, 3, 4], [3, 5]]},
]


@pytest.fixture(scope="module")
def retention_run(shared_run):
  return [r.retention for r in shared_run]


def _simulate(case) -> list[list[int]]:
  policy = RetentionPolicy(**case["kwargs"])
  steps, metrics, history = [], {}, []
  for step, m in case["saves"]:
    steps.append(step)
    metrics[step] = dict(m or {})
    doomed = policy.to_delete(steps, metrics, frozenset({step}))
    steps = [s for s in steps if s not in doomed]
    history.append(sorted(steps))
  return history


@pytest.mark.parametrize("case", RETENTION_CASES, ids=lambda c: c["name"])
def test_retention_in_real_jobs(retention_run, case):
  assert _simulate(case) == case["history"]  # the policy agrees on paper
  saved = {step: {k: float(v) for k, v in (m or {}).items()}
           for step, m in case["saves"]}
  for r in retention_run:
    got = r.cases[case["name"]]
    assert got.history == case["history"]
    final = case["history"][-1]
    assert got.on_disk == sorted(f"checkpoint_{s}" for s in final)
    want = {str(s): saved[s] for s in final}
    assert got.metrics == want
    assert got.metrics_fresh == want


# ---- 5: deletion never removes a checkpoint being restored -----------------


@pytest.fixture(scope="module")
def restore_race_run(shared_run):
  return [r.restore_race for r in shared_run]


def _check_restore_outcome(res):
  # Either step 1 was still there and came back exact, or it was gone before
  # the read began (CheckpointNotFoundError); never a half-deleted checkpoint.
  assert res.restore in ("ok", "not_found"), res
  if res.restore == "ok":
    assert res.exact, res
  assert res.all_steps[-1] == 2, res


def test_retention_never_deletes_a_step_being_restored(restore_race_run):
  # Every process restores step 1 while process 0's retention (keep=1,
  # after committing step 2) deletes it. Process 0 chose the step in the
  # restore's agreement round and protected it there: either retention had
  # deleted it before (every process gets CheckpointNotFoundError) or the
  # restore finds it whole on every process; never a mix.
  for r in restore_race_run:
    _check_restore_outcome(r.variants["all"])
  outcomes = {r.variants["all"].restore for r in restore_race_run}
  assert len(outcomes) == 1, restore_race_run


# ---- 6 and 7: re-saving a committed step; host_state -----------------------


@pytest.fixture(scope="module")
def resave_runs(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("resave"))
  first = _run("resave_host_state", {"dir": root, "phase": "first"})
  restart = _run("resave_host_state", {"dir": root, "phase": "restart"})
  other = _run("resave_host_state", {"dir": root, "phase": "other_count"},
               processes=1, devices=4)
  return first, restart, other


def _hs(pid: int, step: int):
  return worker.jsonable(worker.hs_value(pid, step))


def test_resave_committed_step_is_skipped(resave_runs):
  first, restart, _ = resave_runs
  for r in first:
    assert r.saved == [True, True, True]
    # Step 2 is below the newest committed step: refused (a rollback needs
    # delete(3) first); step 3, the newest, is skipped with a warning.
    assert r.resave[0].startswith(
        "CheckpointError: cannot save step 2: newer committed step(s) [3]"), r
    assert r.resave[1] is False
    assert r.resave_skipped_stat is True
    assert any("step 3 is already committed" in m for m in r.warnings), r
    assert r.exact == {"1": True, "2": True, "3": True}  # not overwritten
    assert r.hs_after == _hs(r.pid, 2)
  for r in restart:  # a restarted job saves its resume step again: no failure
    assert r.resume == 3 and r.resume_exact
    assert r.resaved is False
    assert any("step 3 is already committed" in m for m in r.warnings), r
    assert r.next is True
    assert r.all_steps == [1, 2, 3, 4]
    assert r.exact == {str(s): True for s in (1, 2, 3, 4)}


def test_restore_onto_other_processes_devices(resave_runs):
  _, restart, _ = resave_runs
  p0, p1 = restart
  assert p0.p1_mesh == worker.P1Mesh(local_shards=0, exact=True), p0
  assert p1.p1_mesh == worker.P1Mesh(local_shards=2, exact=True), p1


def test_host_state_per_process(resave_runs):
  first, restart, _ = resave_runs
  for r in first:
    pid = r.pid
    assert r.hs == {"1": _hs(pid, 1), "2": _hs(pid, 2), "3": None,
                    "latest": None}
  for r in restart:
    assert r.hs == {"2": _hs(r.pid, 2), "next": _hs(r.pid, 4)}


def test_host_state_on_other_process_count(resave_runs):
  _, _, (r,) = resave_runs
  err = r.error
  assert err is not None and err.type == "CheckpointError", r
  assert re.search(r"\b2 processes\b", err.msg), err
  assert re.search(r"\bhas 1\b", err.msg), err
  # The arrays themselves restore on the other process count.
  assert r.exact == {str(s): True for s in (1, 2, 3, 4)}


def test_per_process_files_and_index_limit(tmp_path):
  """host_state and box checksums are per-process files in the step
  (nothing per process in the index or through the coordinator); an index
  over the readers' limit fails the save everywhere, keeping step 1."""
  runs = _run("process_files", {"dir": str(tmp_path)})
  for r in runs:
    pid = r.pid
    for fmt in ("zarr", "zarr3"):
      res = r.formats[fmt]
      # Box checksums are per-process files in every format by default
      # (zarr3's crc32c chunk codec is opt-in: Checkpointer(chunk_checksums=True)).
      # Each process's table of its packed small leaves ("h") too.
      expected = [".checksums/0.msgpack", ".checksums/1.msgpack",
                  ".host_state/0.msgpack", ".host_state/1.msgpack",
                  ".packs/0.msgpack", ".packs/1.msgpack"]
      assert res.files == expected, res
      assert res.hs == {"pid": pid}, res
      assert res.exact is True and res.verify == [], res
      err = res.big
      assert err is not None and "MAX_INDEX_BYTES" in err.msg, res
      assert "step 2" in err.msg, err
      assert res.steps == [1] and res.left == ["checkpoint_1"], res
  # Process 0 raises its own error; the others are told it, word for word.
  for fmt in ("zarr", "zarr3"):
    big0, big1 = runs[0].formats[fmt].big, runs[1].formats[fmt].big
    assert big0.msg in big1.msg
    assert "process(es) [0]" in big1.msg


# ---- 8: preemption ---------------------------------------------------------


@pytest.mark.parametrize("victim", [1, 0])
def test_preemption_saves_agreed_step(tmp_path, victim):
  root, marks = tmp_path / "ckpt", tmp_path / "marks"
  marks.mkdir()
  cluster = _start("preempt", {"dir": str(root), "marks": str(marks),
                               "max_s": 60})
  cluster.wait_for_files([marks / f"looping_{p}" for p in (0, 1)], 60)
  t_signal = time.time()
  cluster.kill(victim, signal.SIGTERM)
  results = cluster.wait(60)
  assert [r.returncode for r in results] == [0, 0], _outputs(results)
  out = _decoded("preempt", results)
  steps = {r.step for r in out}
  assert len(steps) == 1 and None not in steps, out
  step = steps.pop()
  assert all(r.t_notice >= t_signal for r in out), "stopped before SIGTERM"
  assert steps_lib.committed_steps(storage_lib.Storage(str(root))) == [step]
  saved = ckpt.load(str(root), step)
  assert saved["step"] == step
  for name, base in worker.preempt_base().items():
    want = base + np.asarray(step, dtype=base.dtype)
    assert worker.same_bits(saved["params"][name], want), name
