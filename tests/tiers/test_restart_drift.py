"""Issue 45 items 1 and 3: a multi-tier LoRA job killed and restarted with
other target shardings than the local tier saved (a real 2-process job, 2
CPU devices each, a Flax NNX model with a frozen base and an adapter, the
persistent tier on S3 served by moto; tests/multiprocess/tiers_restart_worker.py).
Every save and restore runs inside ``with jax.set_mesh(mesh):`` (item 2:
the local tier's save raised there).

Before, the restart skipped local steps 25 and 30 (their shardings differ
from the target's), restored persistent step 20, and its first save was
refused: "cannot save step 25: newer committed step(s) [30] exist (in the
local tier ...)", on every restart; ``latest_step()`` said 30 while
``restore()`` returned 20; the reason was logged at INFO only, ~3 KB, once
per step per process. Now the resume sets the local steps it passed over
aside (one timeline: the restored one), says so once as a WARNING naming
the leaf, both shard shapes and what to do, and the next save proceeds.

The jobs, each killed with SIGKILL once it is done:

1. first: local steps 5..30 (kept: 25, 30), persistent 20, the adapter
   sharded as a jitted train step's output (``lora_a`` on ``data``, across
   the processes; ``lora_b`` on ``model``, within each);
2. drift: the adapter replicated in the target (``nnx.eval_shape``; half
   of ``lora_a`` is on the other process): resumes 20 from S3, saves 25
   and 30 on the restored shardings;
3. lost: process 1's local directory is gone, the first job's shardings
   again: resumes 20, saves 25;
4. resume: what a restart resumes (step 25 of job 3, ``lora_b`` resharded
   from each process's own shards onto a replicated target).
"""

from __future__ import annotations

import shutil
import signal

import pytest

from ckpt.multihost import local_cluster
from tests.multiprocess import launch
from tests.multiprocess import tiers_restart_worker as rw
from tests.multiprocess import worker
from tests.objectstore import servers
from tests.objectstore.conftest import s3_server, server_logs  # pylint: disable=unused-import

WORKER = "tests.multiprocess.tiers_restart_worker"
N = 2


def _job(conf: dict, phase: str, env: dict) -> list[rw.Phase]:
  """One job of ``phase``; killed (SIGKILL) once every process is done,
  as a preempted job is (the "resume" job ends by itself)."""
  cluster = local_cluster.start(
      WORKER, dict(conf, phase=phase), num_processes=N,
      devices_per_process=2, extra_env=env, cwd=str(launch.REPO))
  if phase != "resume":
    try:
      cluster.wait_for_files(
          [f"{conf['marks']}/done_{phase}_{p}" for p in range(N)], 150)
    finally:
      for p in range(N):
        cluster.kill(p, signal.SIGKILL)
    results = cluster.wait(30, grace_s=0)
  else:
    results = cluster.wait(launch.TIMEOUT_S)
    local_cluster.check(results)
  bad = [r for r in results if r.result is None]
  assert not bad, "\n".join(r.output[-4000:] for r in results)
  return [worker.decode(rw.Phase, r.result) for r in results]


@pytest.fixture(scope="module")
def jobs(s3_server, tmp_path_factory):  # pylint: disable=redefined-outer-name
  root = tmp_path_factory.mktemp("restart")
  bucket = servers.new_bucket(s3_server)
  conf = {"persistent": f"{bucket}/lora", "local": str(root / "local"),
          "marks": str(root)}
  out = {}
  for phase in ("first", "drift", "lost", "resume"):
    if phase == "lost":  # a host replaced: its local directory is gone
      shutil.rmtree(root / "local" / "process_1")
    out[phase] = _job(conf, phase, s3_server.env)
  return out


def test_the_first_job_holds_local_25_30_and_persistent_20(jobs):
  for r in jobs["first"]:
    assert all(o.ok for o in r.saves.values()), r.saves
    assert r.local_end == [25, 30] and r.latest_end == 30, r


def test_a_restart_with_drifted_shardings_resumes_and_saves(jobs):
  """Item 1: the resume returns persistent step 20 (the local steps are
  sharded otherwise), latest_step() agrees with it afterwards, and the
  saves of 25 and 30 proceed (before: refused, on every restart)."""
  for r in jobs["drift"]:
    assert r.local_before == [25, 30], r
    # Without a target latest_step() counts the local steps whatever
    # shardings a restore will ask for; with the target it is the step
    # restore returns.
    assert r.latest_before == 30 and r.latest_target_before == 20, r
    assert r.restore == rw.Restored(20, "persistent", 0, True), r.restore
    assert r.latest_after == 20, r
    assert r.all_steps_after == [20], r
    assert {s: (o.error, o.value) for s, o in r.saves.items()} == {
        "25": (None, True), "30": (None, True)}, r.saves
    assert r.latest_end == 30 and r.local_end == [25, 30], r


def test_the_skipped_local_tier_is_one_warning_that_says_what_to_do(jobs):
  """Item 3: one WARNING per restore (process 0), naming the leaf, both
  shard shapes and the remedy; the per-step reasons are no longer INFO
  lines (before: one ~3 KB INFO line per step and process, no WARNING)."""
  p0, p1 = jobs["drift"]
  (w,) = [m for m in p0.warnings if "not used" in m]
  assert w.startswith("ckpt: resumed step 20 from the persistent tier s3://")
  assert "the local tier's newer step(s) [25, 30] were not used" in w, w
  assert "leaf model/lora/lora_a/value is sharded differently" in w, w
  assert "saved in shards of [8, 4], the target's are [16, 4]" in w, w
  assert "out_shardings" in w and "docs/multi-tier.md" in w, w
  assert "set aside: the next local save removes them" in w, w
  assert len(w) < 1500, len(w)
  assert not [m for m in p1.warnings if "not used" in m], p1.warnings
  for r in (p0, p1):  # the reason, once per restore at most
    assert r.reason_lines <= 1, r.reason_lines


def test_a_restart_after_a_lost_local_directory_resumes_and_saves(jobs):
  """Item 1, a host lost: process 1's local directory is gone and the
  shardings drift back; the resume returns 20 again, the save of 25
  proceeds (before: refused by the local tier's 30, which process 0's own
  part and its replica of process 1's made rebuildable)."""
  p0, p1 = jobs["lost"]
  assert p0.local_before == [25, 30] and p1.local_before == [], (p0, p1)
  for r in (p0, p1):
    assert r.restore == rw.Restored(20, "persistent", 0, True), r.restore
    assert r.latest_after == 20 and r.all_steps_after == [20], r
    assert r.saves["25"].ok and r.saves["25"].value is True, r.saves
    assert r.latest_end == 25 and r.local_end == [25], r
  assert [m for m in p0.warnings if "not used" in m], p0.warnings


def test_the_next_restart_resumes_the_new_timeline(jobs):
  """One timeline: the step the last job saved (25, written by job 3),
  from the local tier, bit-exact; nothing of the abandoned steps is left.
  Its target replicates lora_b, saved split on "model": each process
  holds every byte of it, so the local tier reshards it from its own
  shards (before: it resumed persistent step 20, losing 5 steps)."""
  for r in jobs["resume"]:
    assert r.local_before == [25], r
    assert r.latest_before == 25, r
    assert r.restore == rw.Restored(25, "local", 2, True), r.restore
    assert not r.warnings, r.warnings
