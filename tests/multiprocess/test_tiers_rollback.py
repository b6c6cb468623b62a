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

REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
WORKER = "tests.multiprocess.tiers_rollback_worker"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
  root = tmp_path_factory.mktemp("rollback")
  conf = {"persistent": str(root / "persistent"), "local": str(root / "local"),
          "ck": str(root / "ck")}
  runs = {}
  for phase in ("first", "restart"):
    runs[phase] = local_cluster.check(local_cluster.run(
        WORKER, dict(conf, phase=phase), num_processes=2,
        devices_per_process=2, timeout_s=180, cwd=REPO_ROOT))
  return runs


def test_a_save_below_the_newest_step_is_refused_until_deleted(jobs):
  """Item 4, MultiTierCheckpointer: before, save(11) after restoring 10
  returned True, retention deleted it at once (it kept [20, 21, 22]),
  latest_step() said 22 and a restart resumed the abandoned step 22."""
  for r in jobs["first"]:
    assert r["before"] == {"local": [20, 21, 22],
                           "persistent": [5, 10, 15, 20]}, r
    # Refused on every process, naming the newer steps of both tiers and
    # the remedy; nothing was written in either tier.
    assert r["save_11"].startswith(
        "CheckpointError: cannot save step 11: newer committed step(s) "
        "[15, 20, 21, 22] exist (in the persistent tier "), r["save_11"]
    assert re.search(r"in the persistent tier '[^']*/persistent': \[15, 20\]"
                     r"; in the local tier '[^']*/local': \[20, 21, 22\]\)",
                     r["save_11"]), r["save_11"]
    assert "call delete(s) for each of [15, 20, 21, 22]" in r["save_11"]
    assert r["save_15"].startswith(
        "CheckpointError: cannot save step 15: newer committed step(s) "
        "[20, 21, 22]"), r["save_15"]
    assert r["unchanged"] == {"local": True, "persistent": True}, r
    assert r["restore_10"] == {
        "step": 10, "exact": True, "tier": "persistent",
        "last_restore_step": 10, "reason": r["restore_10"]["reason"]}, r
    # A delete that fails anywhere changes no tier, on every process.
    if r["pid"] == 1:
      assert r["delete_fails_on_1"] == (
          "OSError: injected: cannot rename step_22"), r["delete_fails_on_1"]
    else:
      assert r["delete_fails_on_1"].startswith(
          "CheckpointError: delete(22) failed on process(es) [1]; no tier was "
          "changed: process 1: OSError: injected"), r["delete_fails_on_1"]
    assert re.match(r"CheckpointError: deleting step 20: cannot delete step "
                    r"20 in '[^']*': it is being read", r["delete_being_read"]
                    ), r["delete_being_read"]
    assert r["after_failed_deletes"] == {"local": [20, 21, 22],
                                         "persistent": [5, 10, 15, 20]}, r
    # delete() removes a step from both tiers; a second time, not found.
    assert r["delete"] == {"15": None, "20": None, "21": None, "22": None}, r
    assert r["delete_again"].startswith(
        "CheckpointNotFoundError: cannot delete step 20: neither tier holds "
        "it"), r["delete_again"]
    assert r["after_delete"] == {"local": [], "persistent": [5, 10],
                                 "latest": 10, "all_steps": [5, 10]}, r
    # The new timeline: saved, kept by retention, restored.
    assert r["save_new"] == [True, True], r
    after = r["after"]
    assert after["local"] == [11, 12], r
    assert all(re.fullmatch(r"step_\d+", e) for e in after["local_entries"])
    assert after["persistent"] == [5, 10] and after["latest"] == 12, r
    assert (after["restore"]["step"], after["restore"]["exact"],
            after["restore"]["tier"]) == (12, True, "local"), r
  for p, r in enumerate(jobs["restart"]):  # a restart resumes step 12
    assert r["latest"] == 12, r
    assert r["restore"]["step"] == 12 and r["restore"]["exact"], r
    assert r["restore"]["tier"] == "local", r
    assert r["restore"]["last_restore_step"] == 12, r
    assert r["host_state"] == {"pos": 1200 + p}, r


def test_a_checkpointer_save_below_the_newest_step_is_refused(jobs):
  """Item 4, Checkpointer: before, save(11) after steps up to 20 wrote
  step 11 and returned True, and latest_step() stayed 20."""
  for r in jobs["first"]:
    assert r["ck_before"] == [5, 10, 15, 18, 19, 20], r
    assert r["ck_restore_10"] == [10, True], r
    assert r["ck_save_11"].startswith(
        "CheckpointError: cannot save step 11: newer committed step(s) "
        "[15, 18, 19, 20] exist (in "), r["ck_save_11"]
    assert "call delete(s) for each of [15, 18, 19, 20]" in r["ck_save_11"]
    assert r["ck_unchanged"] is True, r
    assert r["ck_delete"] == {"15": None, "18": None, "19": None,
                              "20": None}, r
    assert r["ck_save_new"] == [True, True], r
    assert r["ck_after"] == {"steps": [5, 10, 11, 12], "latest": 12}, r
  for r in jobs["restart"]:
    assert r["ck_latest"] == 12 and r["ck_restore"] == [12, True], r


def test_restore_options_choose_among_persistent_steps(jobs):
  """Item 5: with the local tier ahead (22) of the persistent tier (20),
  restore(lazy=True) and restore(transforms=...) raised
  CheckpointNotFoundError: step 22, and so did restore(verify=True)."""
  for r in jobs["first"]:
    for name in ("lazy", "transforms"):
      got = r[name]
      assert isinstance(got, dict), (name, got)
      assert (got["step"], got["exact"], got["tier"],
              got["last_restore_step"]) == (20, True, "persistent", 20), got
      assert "the local tier's newer step 22 is not used" in got["reason"]
    # A step only the local tier holds, with an option it does not take.
    assert r["lazy_local_only_step"].startswith(
        "CheckpointNotFoundError: step 21 is in the local tier only, which "
        "does not take the restore options lazy=True; the persistent tier "
        ), r["lazy_local_only_step"]
    assert "holds steps [5, 10, 15, 20]" in r["lazy_local_only_step"]
    # verify=True: the local tier checks every shard's crc32c anyway.
    v = r["verify"]
    assert isinstance(v, dict), v
    assert (v["step"], v["exact"], v["tier"], v["last_restore_step"]) == (
        22, True, "local", 22), v


def test_latest_step_of_a_target_is_the_step_restore_returns(jobs):
  """Item 6: latest_step() said 22 while restore(target) of a target whose
  shardings the local tier cannot serve returned step 20, and no attribute
  named the restored step."""
  for r in jobs["first"]:
    assert r["latest"] == 22 and r["latest_fit"] == 22, r
    assert r["latest_other"] == 20, r
    got = r["restore_other"]
    assert isinstance(got, dict), got
    assert (got["step"], got["exact"], got["tier"],
            got["last_restore_step"]) == (20, True, "persistent", 20), got
    assert "sharded differently from the save" in got["reason"], got


def test_all_steps_lists_both_tiers_alike_on_every_process(jobs):
  """Issue 36 item 6: MultiTierCheckpointer had no all_steps(). It lists
  the persistent tier's steps and the local steps the job can rebuild,
  the same on both processes, its last the step latest_step() gives."""
  first = jobs["first"]
  for r in first:
    assert r["all_steps"] == [5, 10, 15, 20, 21, 22], r   # local ahead
    assert r["all_steps"][-1] == r["latest"], r
    assert r["after_delete"]["all_steps"] == [5, 10], r
    assert r["after"]["all_steps"] == [5, 10, 11, 12], r  # local 11, 12
    assert r["after"]["all_steps"][-1] == r["after"]["latest"], r
  assert first[0]["all_steps"] == first[1]["all_steps"]
  assert first[0]["after"]["all_steps"] == first[1]["after"]["all_steps"]
