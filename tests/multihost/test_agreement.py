"""Processes that cannot disagree, whatever one of them does (real jobs).

One job of 2 real ``jax.distributed`` processes x 2 CPU devices
(``ckpt.multihost.local_cluster``) runs every scenario in turn; in each, one
process behaves differently: its save fails before writing, it lags behind
while another job commits, or it holds other host values. Every process
must take the same decision, and the job must go on checkpointing
afterwards (also into the next scenario).
"""

from __future__ import annotations

import pathlib

import pytest

from ckpt.multihost import local_cluster
from ckpt.format import entries
from tests.multihost import agreement_worker as aw
from tests.multiprocess import worker

REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
WORKER = "tests.multihost.agreement_worker"
# Long enough that a save waiting at a barrier the other process already
# left (keys that drifted apart) shows as a failure of the timing checks.
TIMEOUT_S = 30


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[list[aw.All], pathlib.Path]:
  """(each process's results, the job's root directory)."""
  root = tmp_path_factory.mktemp("agreement")
  results = local_cluster.run(
      WORKER, {"root": str(root), "timeout_s": TIMEOUT_S,
               "keys_per_merge": 8},
      num_processes=2, devices_per_process=2, timeout_s=240, cwd=REPO_ROOT)
  return [worker.decode(aw.All, r) for r in local_cluster.check(results)], root


@pytest.fixture(scope="module")
def one_fails(job):
  return [r.one_fails for r in job[0]]


def test_a_failure_on_one_process_fails_the_save_on_all(one_fails):
  for r in one_fails:
    err = r.s2.error
    assert err is not None, r
    assert err.type == "CheckpointError", err
    assert "process 1" in err.msg and "data pipeline" in err.msg, err
    assert "step 2" in err.msg, err
    # Told at the start, not at a barrier timeout.
    assert r.s2.seconds < 10, r.s2
  p0, p1 = one_fails
  assert p0.s2.error.msg == p1.s2.error.msg, "the same error everywhere"


def test_keys_do_not_drift_after_a_failed_save(one_fails):
  for r in one_fails:
    for step, saved in (("s1", r.s1), ("s3", r.s3), ("s6", r.s6)):
      assert saved.ok and saved.value is True, (step, saved)
      # Not the timeout of a barrier whose keys drifted apart.
      assert saved.seconds < 10, (step, saved)
  assert one_fails[0].steps == [1, 3, 6]
  assert one_fails[1].steps == [1, 3, 6]


def test_host_state_or_plan_failing_on_one_process(one_fails):
  for r in one_fails:
    for saved, what in ((r.s4, "host_state"), (r.s5, "'extra'")):
      err = saved.error
      assert err is not None and err.type == "InvalidStateError", err
      assert "process 1" in err.msg and what in err.msg, err
  for r in one_fails:
    assert r.s6_again.ok and r.s6_again.value is False, r.s6_again
    assert r.tmp_left == [], "a refused save left a work directory"


@pytest.fixture(scope="module")
def restore_race(job):
  return [r.restore_race for r in job[0]]


def test_restore_uses_one_step_for_every_process(restore_race):
  # Process 1 arrived after step 2 was committed; process 0 before. Both
  # restore the step process 0 chose once every process had arrived.
  steps = {r.restored_step for r in restore_race}
  assert steps == {2}, restore_race
  for r in restore_race:
    assert set(r.w_matches_step) == {2}, r  # no shard of another step
    assert r.latest == 2


def test_processes_asking_for_different_steps_all_raise(restore_race):
  for r in restore_race:
    err = r.differ
    assert err is not None and err.type == "CheckpointError", r
    assert "restore(step=1" in err.msg and "restore(step=2" in err.msg
    assert r.after == 1  # and the next restore works


@pytest.fixture(scope="module")
def host_mismatch(job):
  return [r.host_mismatch for r in job[0]]


def test_host_leaves_that_differ_are_refused(host_mismatch):
  for r in host_mismatch:
    assert r.equal.ok and r.equal.value is True, r.equal
    for saved, leaf in ((r.array, "loader/rng"), (r.scalar, "data_pos")):
      err = saved.error
      assert err is not None and err.type == "InvalidStateError", err
      assert repr(leaf) in err.msg and "[1]" in err.msg, err
      assert "host_state" in err.msg, err  # says what to use instead
    assert r.host_state.ok, r.host_state
    assert r.steps == [1, 4]
    assert r.tmp_left == []
  assert [r.hs for r in host_mismatch] == [{"rng": 0}, {"rng": 1}]


def test_processes_that_planned_differently_never_commit(job):
  """One host's plan leaves a box unwritten (step 2) or writes one box
  twice and another never (step 3): process 0 finds the tiling wrong before
  the commit (ckpt/shards/tiling.py), the save fails on both processes, nothing is
  committed, and the next honest save works."""
  for r in (r.planned_differently for r in job[0]):
    assert r.s1.ok and r.s4.ok, r
    for step, saved in ((2, r.s2), (3, r.s3)):
      err = saved.error
      assert err is not None and err.type == "CheckpointError", err
      assert f"step {step}" in err.msg, err
      assert "exactly once" in err.msg, err
    assert r.steps == [1, 4]
    assert r.tmp_left == []


def test_large_ocdbt_steps_are_merged_in_groups_by_every_process(job):
  """A step with more keys than one merge should take is split into merge
  groups, each merged by another process at once (ckpt/store/ocdbt.py); the
  arrays restore bit-exact on the job and in one process with no job."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.format import index as index_lib  # pylint: disable=g-import-not-at-top
  for r in (r.ocdbt_groups for r in job[0]):
    assert r.save.ok, r
    assert r.exact and r.exact_host, r
  root = job[1] / "ocdbt"
  step = root / "checkpoint_1"
  idx = index_lib.decode((step / "index.msgpack").read_bytes())
  groups = {e.ocdbt_group for e in idx.leaves
            if isinstance(e, entries.ArrayEntry)}
  assert groups == {0, 1}, groups
  names = sorted(p.name for p in step.iterdir())
  assert "ocdbt.group_0" in names and "ocdbt.group_1" in names, names
  assert "manifest.ocdbt" not in names  # no database at the step's root
  for g in (0, 1):  # each group merged: its own manifest beside the writers'
    assert (step / f"ocdbt.group_{g}" / "manifest.ocdbt").exists()
  loaded = ckpt.load(root)  # one process, no jax.distributed job
  rng = np.random.default_rng(7)
  want = {f"w{i}": rng.standard_normal((32, 16)).astype(np.float32)
          for i in range(6)}
  want["r"] = rng.standard_normal((40,)).astype(np.float32)
  for k, v in want.items():
    assert np.array_equal(loaded[k], v), k


# ---- one process fails at the start of each collective call ----------------

@pytest.fixture(scope="module")
def each_call(job):
  return [r.each_call for r in job[0]]


CALLS = ["save", "restore", "restore_path", "metadata", "delete",
         "bad_path", "bad_arg", "latest_step"]


QUERIES = {"latest_step": 0, "metadata": 1}  # query: the process it fails on


@pytest.mark.parametrize("call", CALLS)
def test_a_call_failing_on_one_process_fails_on_all_at_once(each_call, call):
  """Process 1 fails at the start of a collective call: every process
  raises within seconds, not at a barrier timeout, and the others name the
  failing process. A read-only query is not collective: it fails on the
  failing process alone, and the others answer at once."""
  failing = QUERIES.get(call, 1)
  for r in each_call:
    first = r.calls[call].first
    err = first.error
    assert first.seconds < 10, (call, r.pid, first)
    if call in QUERIES:
      if r.pid == failing:
        assert err.msg == f"injected failure at the start of {call}", err
      else:
        assert err is None and first.value == 1, (call, r.pid, first)
      continue
    assert err is not None, (call, r.pid, first)
    if r.pid != failing:
      assert f"process {failing}" in err.msg, (call, err)
      assert "injected failure" in err.msg or call in ("bad_path",
                                                      "bad_arg"), err


@pytest.mark.parametrize("call", CALLS)
def test_the_next_call_works_on_every_process(each_call, call):
  want = {"save": True, "restore": 3, "restore_path": 1, "metadata": 1,
          "delete": None, "bad_path": 1, "bad_arg": 1, "latest_step": 1}
  for r in each_call:
    assert r.setup.ok, r.setup
    again = r.calls[call].again
    assert again.ok, (call, r.pid, again)
    assert again.seconds < 10, (call, r.pid, again)
    assert again.value == want[call], (call, r.pid, again)
  assert [r.steps for r in each_call] == [[1], [1]]


def test_multi_tier_calls_failing_on_one_process(each_call):
  """The local save: all raise at once, the next save works. The restore:
  process 1's local check fails; every process takes the same decision,
  and the next restore comes from the local tier, bit-exact."""
  for r in each_call:
    assert r.mt_setup.ok, r.mt_setup
    failed, next_save = r.mt_save.first, r.mt_save.again
    assert not failed.ok and failed.seconds < 10, (r.pid, failed)
    assert "process(es) [1]" in failed.error.msg or r.pid == 1, failed
    assert (next_save.ok and next_save.value is True and
            next_save.seconds < 10), r.mt_save
  # The same decision on both processes, whichever it was.
  first = [r.mt_restore[0] for r in each_call]
  assert ({(f.outcome.value, f.tier) for f in first} ==
          {(first[0].outcome.value, first[0].tier)}), first
  for r in each_call:
    injected, again = r.mt_restore
    step = injected.outcome.value
    assert injected.outcome.ok and injected.outcome.seconds < 10, (r.pid,
                                                                   injected)
    if injected.tier == "persistent":  # process 1's local tier could not answer
      assert "injected failure" in injected.reason and step == 1, injected
    else:  # process 1's part from its partner's replica
      assert step == 3, (r.pid, injected)
    assert (again.outcome.ok and again.outcome.value == 3 and
            again.tier == "local"), again
    assert again.first_w == injected.first_w or injected.first_w is None
    # step 3's w is arange + 3: each shard's first element says which rows
    assert all((v - 3) % 32 == 0 for v in again.first_w), again.first_w
