"""Rollback, delete, restore options and the restored step of multi-tier
checkpoints (issue 23 items 4, 5, 6) in real 2-process jobs (2 CPU
devices each).

One job saves steps 1..22 (local tier every step, keeping 3; persistent
every 5th, keeping 4): the local tier holds 20..22, the persistent 5..20.
While the local tier is ahead it checks restore options and
``latest_step(target=)``; then it rolls back to step 10: restore 10, save
11 (refused on every process, nothing written), delete the newer steps,
save 11 and 12. Then the same rollback with a plain ``Checkpointer``. A
second job (a restart) resumes from both directories.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from ckpt.multihost import local_cluster
from tests.multiprocess import worker
from tests.multiprocess.tiers_rollback_worker import First, Restart, Restored

REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
WORKER = "tests.multiprocess.tiers_rollback_worker"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
  root = tmp_path_factory.mktemp("rollback")
  conf = {"persistent": str(root / "persistent"), "local": str(root / "local"),
          "ck": str(root / "ck")}
  runs = {}
  for phase, result in (("first", First), ("restart", Restart)):
    runs[phase] = [worker.decode(result, r) for r in local_cluster.check(
        local_cluster.run(WORKER, dict(conf, phase=phase), num_processes=2,
                          devices_per_process=2, timeout_s=180,
                          cwd=REPO_ROOT))]
  return runs


def said(o: worker.Outcome) -> str:
  """What a call that raised raised, as "<type>: <message>"."""
  assert o.error is not None, o
  return f"{o.error.type}: {o.error.msg}"


def value(o: worker.Outcome):
  """What a call that returned returned."""
  assert o.ok, o
  return o.value


def returned_none(outcomes: dict) -> dict:
  return {k: (o.error, o.value) for k, o in outcomes.items()}


def test_a_save_below_the_newest_step_is_refused_until_deleted(jobs):
  """Item 4, MultiTierCheckpointer: before, save(11) after restoring 10
  returned True, retention deleted it at once (it kept [20, 21, 22]),
  latest_step() said 22 and a restart resumed the abandoned step 22."""
  for r in jobs["first"]:
    assert (r.before.local, r.before.persistent) == (
        [20, 21, 22], [5, 10, 15, 20]), r
    # Refused on every process, naming the newer steps of both tiers and
    # the remedy; nothing was written in either tier.
    assert said(r.save_11).startswith(
        "CheckpointError: cannot save step 11: newer committed step(s) "
        "[15, 20, 21, 22] exist (in the persistent tier "), r.save_11
    assert re.search(r"in the persistent tier '[^']*/persistent': \[15, 20\]"
                     r"; in the local tier '[^']*/local': \[20, 21, 22\]\)",
                     said(r.save_11)), r.save_11
    assert "call delete(s) for each of [15, 20, 21, 22]" in said(r.save_11)
    assert said(r.save_15).startswith(
        "CheckpointError: cannot save step 15: newer committed step(s) "
        "[20, 21, 22]"), r.save_15
    assert (r.unchanged.local, r.unchanged.persistent) == (True, True), r
    assert r.restore_10 == Restored(
        None, 10, True, "persistent", 10, r.restore_10.reason), r
    # A delete that fails anywhere changes no tier, on every process.
    if r.pid == 1:
      assert said(r.delete_fails_on_1) == (
          "OSError: injected: cannot rename step_22"), r.delete_fails_on_1
    else:
      assert said(r.delete_fails_on_1).startswith(
          "CheckpointError: delete(22) failed on process(es) [1]; no tier was "
          "changed: process 1: OSError: injected"), r.delete_fails_on_1
    assert re.match(r"CheckpointError: deleting step 20: cannot delete step "
                    r"20 in '[^']*': it is being read",
                    said(r.delete_being_read)), r.delete_being_read
    assert (r.after_failed_deletes.local,
            value(r.after_failed_deletes.persistent)) == (
                [20, 21, 22], [5, 10, 15, 20]), r
    # delete() removes a step from both tiers; a second time, not found.
    assert returned_none(r.delete) == {
        s: (None, None) for s in ("15", "20", "21", "22")}, r
    assert said(r.delete_again).startswith(
        "CheckpointNotFoundError: cannot delete step 20: neither tier holds "
        "it"), r.delete_again
    d = r.after_delete
    assert (d.local, value(d.persistent), value(d.latest),
            value(d.all_steps)) == ([], [5, 10], 10, [5, 10]), r
    # The new timeline: saved, kept by retention, restored.
    assert [value(o) for o in r.save_new] == [True, True], r
    after = r.after
    assert after.local == [11, 12], r
    assert all(re.fullmatch(r"step_\d+", e) for e in after.local_entries)
    assert value(after.persistent) == [5, 10] and value(after.latest) == 12, r
    assert (after.restore.step, after.restore.exact,
            after.restore.tier) == (12, True, "local"), r
  for p, r in enumerate(jobs["restart"]):  # a restart resumes step 12
    assert value(r.latest) == 12, r
    assert r.restore.step == 12 and r.restore.exact, r
    assert r.restore.tier == "local", r
    assert r.restore.last_restore_step == 12, r
    assert value(r.host_state) == {"pos": 1200 + p}, r


def test_a_checkpointer_save_below_the_newest_step_is_refused(jobs):
  """Item 4, Checkpointer: before, save(11) after steps up to 20 wrote
  step 11 and returned True, and latest_step() stayed 20."""
  for r in jobs["first"]:
    assert r.ck_before == [5, 10, 15, 18, 19, 20], r
    assert value(r.ck_restore_10) == [10, True], r
    assert said(r.ck_save_11).startswith(
        "CheckpointError: cannot save step 11: newer committed step(s) "
        "[15, 18, 19, 20] exist (in "), r.ck_save_11
    assert "call delete(s) for each of [15, 18, 19, 20]" in said(r.ck_save_11)
    assert r.ck_unchanged is True, r
    assert returned_none(r.ck_delete) == {
        s: (None, None) for s in ("15", "18", "19", "20")}, r
    assert [value(o) for o in r.ck_save_new] == [True, True], r
    assert (value(r.ck_after.steps), value(r.ck_after.latest)) == (
        [5, 10, 11, 12], 12), r
  for r in jobs["restart"]:
    assert value(r.ck_latest) == 12 and value(r.ck_restore) == [12, True], r


def test_restore_options_choose_among_persistent_steps(jobs):
  """Item 5: with the local tier ahead (22) of the persistent tier (20),
  restore(lazy=True) and restore(transforms=...) raised
  CheckpointNotFoundError: step 22, and so did restore(verify=True)."""
  for r in jobs["first"]:
    for name in ("lazy", "transforms"):
      got = getattr(r, name)
      assert got.error is None, (name, got)
      assert (got.step, got.exact, got.tier,
              got.last_restore_step) == (20, True, "persistent", 20), got
      assert "the local tier's newer step 22 is not used" in got.reason
    # A step only the local tier holds, with an option it does not take.
    only = r.lazy_local_only_step.error
    assert only is not None, r.lazy_local_only_step
    assert f"{only.type}: {only.msg}".startswith(
        "CheckpointNotFoundError: step 21 is in the local tier only, which "
        "does not take the restore options lazy=True; the persistent tier "
        ), only
    assert "holds steps [5, 10, 15, 20]" in only.msg
    # verify=True: the local tier checks every shard's crc32c anyway.
    v = r.verify
    assert v.error is None, v
    assert (v.step, v.exact, v.tier, v.last_restore_step) == (
        22, True, "local", 22), v


def test_latest_step_of_a_target_is_the_step_restore_returns(jobs):
  """Item 6: latest_step() said 22 while restore(target) of a target whose
  shardings the local tier cannot serve returned step 20, and no attribute
  named the restored step."""
  for r in jobs["first"]:
    assert value(r.latest) == 22 and value(r.latest_fit) == 22, r
    assert value(r.latest_other) == 20, r
    got = r.restore_other
    assert got.error is None, got
    assert (got.step, got.exact, got.tier,
            got.last_restore_step) == (20, True, "persistent", 20), got
    assert "sharded differently from the save" in got.reason, got


def test_all_steps_lists_both_tiers_alike_on_every_process(jobs):
  """Issue 36 item 6: MultiTierCheckpointer had no all_steps(). It lists
  the persistent tier's steps and the local steps the job can rebuild,
  the same on both processes, its last the step latest_step() gives."""
  first = jobs["first"]
  for r in first:
    assert value(r.all_steps) == [5, 10, 15, 20, 21, 22], r   # local ahead
    assert value(r.all_steps)[-1] == value(r.latest), r
    assert value(r.after_delete.all_steps) == [5, 10], r
    assert value(r.after.all_steps) == [5, 10, 11, 12], r  # local 11, 12
    assert value(r.after.all_steps)[-1] == value(r.after.latest), r
  assert value(first[0].all_steps) == value(first[1].all_steps)
  assert (value(first[0].after.all_steps) ==
          value(first[1].after.all_steps))
