"""writer="process" with real jax.distributed jobs of 2 and 4 processes
(issue 50, items 1-3): each host's writer writes its part from shared
memory and the writers commit through the storage, so a step whose save()
returned commits even when the trainers are SIGKILLed; a killed writer, or
a killed host, commits nothing and the next job's save commits.

The kill tests hold every writer (SIGSTOP, by its own trainer once save()
returned) until the kills are done, so that "nothing committed at the
kill" is checked, not hoped for; then the writers go on (SIGCONT).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import time

import numpy as np
import psutil
import pytest

import ckpt
from ckpt.multihost import local_cluster
from tests.multiprocess import launch
from tests.multiprocess import worker as worker_lib
from tests.multiprocess import writer_worker
from tests.multiprocess.writer_worker import After, Roundtrip

WORKER = "tests.multiprocess.writer_worker"
REPO = str(pathlib.Path(__file__).resolve().parents[2])


def committed(root) -> list[int]:
  return sorted(int(n.split("_")[1]) for n in os.listdir(root)
                if n.startswith("checkpoint_") and "." not in n)


def bit_exact(root, step: int, mib: int) -> bool:
  got = ckpt.load(str(root), step)
  return all(np.asarray(got[name]).tobytes() ==
             writer_worker.truth(name, m).tobytes()
             for name, m in writer_worker.names(mib).items())


@pytest.mark.parametrize("processes", [2, 4])
def test_writer_process_jobs_save_and_restore(tmp_path, processes):
  out = launch.launch(WORKER, {"scenario": "roundtrip",
                               "dir": str(tmp_path / "c"), "mib": 2},
                      processes, 2, result=Roundtrip)
  for r in out:
    assert r.steps == [1, 2] and r.exact and r.writers == 1, r
    assert r.segments == [] and r.remeshed, r
  assert bit_exact(tmp_path / "c", 2, 2)


@pytest.mark.parametrize("fmt,groups", [("ocdbt", 1), ("ocdbt", 2),
                                        ("zarr3", 0)])
def test_writer_process_jobs_write_ocdbt_and_packs(tmp_path, fmt, groups):
  """2 processes, small leaves packed by every process and, with "ocdbt",
  each writer writing its own database (of each merge group), merged by
  process 0's writer: bit-exact onto the same shardings and onto another
  mesh."""
  out = launch.launch(WORKER, {"scenario": "roundtrip", "format": fmt,
                               "small": True, "dir": str(tmp_path / "c"),
                               "mib": 2,
                               "keys_per_merge": 8 if groups == 2 else 0},
                      2, 2, result=Roundtrip)
  for r in out:
    assert r.steps == [1, 2] and r.exact and r.remeshed, r
    assert r.segments == [], r
  step = tmp_path / "c" / "checkpoint_2"
  assert sorted(n for n in os.listdir(step / ".packs")
                if n.endswith(".msgpack")) == ["0.msgpack", "1.msgpack"]
  names = os.listdir(step)
  if groups == 1:
    assert {"manifest.ocdbt", "ocdbt.process_0", "ocdbt.process_1"} <= set(
        names), names
  for g in range(groups if groups > 1 else 0):
    assert "manifest.ocdbt" in os.listdir(step / f"ocdbt.group_{g}"), names
  assert bit_exact(tmp_path / "c", 2, 2)
  got = ckpt.load(str(tmp_path / "c"), 2)
  for i in range(6):
    assert np.asarray(got[f"s{i}"]).tobytes() == (
        writer_worker.small_truth(i).tobytes())


def test_writer_process_jobs_link_unchanged_chunks(tmp_path):
  """reuse_unchanged=True on 2 processes: each writer links its share of
  the frozen leaf from the step before the newest (none at steps 0 and 1:
  the second copy), and a new job's writers from the steps' records of
  their own process."""
  out = launch.launch(WORKER, {"scenario": "reuse", "dir": str(tmp_path / "c")},
                      2, 2, result=writer_worker.Reused)
  share = (1 << 20) // 2  # this process's half of the 1 MiB frozen leaf
  for r in out:
    assert r.exact, r
    assert r.reused == [0, 0, share, share], r


def held(tmp_path, processes: int, mib: int, step: int = 5,
         bound_s: float = 60, fmt: str = "zarr", **extra):
  """A job whose every trainer returned from save() and stopped its writer;
  (cluster, the per-process info). ``extra``: more of the hold scenario's
  config (``before``, ``lease_s``, ``keep``)."""
  events = tmp_path / "events"
  events.mkdir(exist_ok=True)
  cluster = local_cluster.start(
      WORKER, {"scenario": "hold", "dir": str(tmp_path / "c"), "mib": mib,
               "step": step, "events": str(events), "bound_s": bound_s,
               "format": fmt, **extra},
      num_processes=processes, devices_per_process=2, cwd=REPO)
  paths = [events / f"p{p}.json" for p in range(processes)]
  cluster.wait_for_files(paths, 240)
  return cluster, [json.loads(p.read_text()) for p in paths]


def resume(pids: list[int]) -> None:
  for pid in pids:
    os.kill(pid, signal.SIGCONT)


def wait_gone(pids: list[int], timeout_s: float) -> None:
  for pid in pids:
    try:
      psutil.Process(pid).wait(timeout_s)
    except psutil.NoSuchProcess:
      pass


def no_segments(info: list[dict]) -> bool:
  return not [n for n in os.listdir("/dev/shm")
              for i in info if n.startswith(f"ckpt-{i['trainer']}-")]


@pytest.mark.parametrize("processes,fmt", [(2, "zarr"), (4, "zarr"),
                                           (2, "ocdbt")])
def test_every_trainer_killed_after_save_returned_the_step_commits(
    tmp_path, processes, fmt):
  """... and retention (keep=1) waits for the next job's first save: no
  trainer is left to apply it (docs/writer-process.md)."""
  cluster, info = held(tmp_path, processes, mib=16, fmt=fmt, before=4,
                       keep=1)
  writers = [w for i in info for w in i["writers"]]
  assert len(writers) == processes
  for p in range(processes):
    cluster.kill(p, signal.SIGKILL)
  cluster.wait(30, grace_s=0)
  assert committed(tmp_path / "c") == [4]  # the writers were stopped
  t0 = time.monotonic()
  resume(writers)
  wait_gone(writers, 120)
  print(f"\n{processes} trainers killed: committed "
        f"{time.monotonic() - t0:.2f} s after the writers went on")
  assert committed(tmp_path / "c") == [4, 5]  # keep=1: not applied yet
  assert bit_exact(tmp_path / "c", 5, 16)
  assert no_segments(info)
  # A restarted job finds the step the dead job committed; its first
  # save's retention drops the older ones.
  out = launch.launch(WORKER, {"scenario": "after", "dir": str(tmp_path / "c"),
                               "step": 6, "keep": 1, "format": fmt},
                      processes, 2, result=After)
  assert all(r.latest == 5 and r.steps == [6] for r in out), out
  assert committed(tmp_path / "c") == [6]


def test_one_trainer_killed_the_step_commits(tmp_path):
  cluster, info = held(tmp_path, 2, mib=8)
  writers = [w for i in info for w in i["writers"]]
  cluster.kill(1, signal.SIGKILL)
  resume(writers)
  wait_gone(info[1]["writers"], 120)  # process 1's writer: its trainer died
  deadline = time.monotonic() + 60
  while committed(tmp_path / "c") != [5]:
    assert time.monotonic() < deadline, os.listdir(tmp_path / "c")
    time.sleep(0.1)
  cluster.kill(0, signal.SIGKILL)
  cluster.wait(30, grace_s=0)
  wait_gone(writers, 60)
  assert bit_exact(tmp_path / "c", 5, 8)
  assert no_segments(info)


@pytest.mark.parametrize("also_trainer", [False, True])
def test_a_killed_writer_or_host_commits_nothing(tmp_path, also_trainer):
  """The writer of process 1 (and, ``also_trainer``, its trainer: the
  host) SIGKILLed: process 0's writer waits for its record at most the
  bound (10 s here), commits nothing, and (its trainer killed next, as a
  restarted job's would be) exits; a new job's save commits."""
  cluster, info = held(tmp_path, 2, mib=8, bound_s=10)
  os.kill(info[1]["writers"][0], signal.SIGKILL)
  if also_trainer:
    cluster.kill(1, signal.SIGKILL)
  t0 = time.monotonic()
  resume(info[0]["writers"])
  cluster.kill(0, signal.SIGKILL)
  cluster.kill(1, signal.SIGKILL)
  cluster.wait(30, grace_s=0)
  wait_gone(info[0]["writers"], 120)
  print(f"\nprocess 0's writer gave up {time.monotonic() - t0:.1f} s after "
        "it went on")
  assert committed(tmp_path / "c") == []
  out = launch.launch(WORKER, {"scenario": "after", "dir": str(tmp_path / "c"),
                               "step": 6}, 2, 2, result=After)
  assert all(r.steps == [6] for r in out), out
  assert no_segments(info)


def attempts(root, step: int) -> list[str]:
  return sorted(n for n in os.listdir(root)
                if n.startswith(f"checkpoint_{step}.tmp-"))


def segments_of(info: list[dict]) -> list[str]:
  return sorted(n for n in os.listdir("/dev/shm") for i in info
                if n.startswith(f"ckpt-{i['trainer']}-"))


def same_state(root, step: int, mib: int) -> bool:
  got = ckpt.load(str(root), step)
  return all(np.asarray(got[name]).tobytes() ==
             writer_worker.truth(name, m).tobytes()
             for name, m in writer_worker.names(mib).items())


@pytest.mark.parametrize("writer,same_step", [("process", False),
                                              ("thread", True)])
def test_a_job_restarted_at_once_races_the_dead_jobs_writers(
    tmp_path, writer, same_step):
  """Every trainer SIGKILLed once save(5) returned, their writers still
  holding it (stopped), and a new job started at once (its ``writer``):
  it resumes from step 4 (nothing of 5 is seen), its cleanup spares the
  attempt of 5 (its holder, process 0's old writer, lives), its writer
  spares the old writers' shared memory, and it saves 6 (or 5 again:
  ``same_step``). Then the old writers go on: 5 commits beside 6, bit for
  bit; or, 5 committed by the new job meanwhile, the old writer commits
  nothing over it. Leases of 600 s: only a holder provably dead lets the
  new job remove an attempt."""
  root = tmp_path / "c"
  cluster, info = held(tmp_path, 2, mib=8, step=5, before=4, lease_s=600)
  for p in range(2):
    cluster.kill(p, signal.SIGKILL)
  cluster.wait(30, grace_s=0)
  old_attempt, old_segments = attempts(root, 5), segments_of(info)
  assert len(old_attempt) == 1 and old_segments, (os.listdir(root),
                                                  old_segments)
  new_step = 5 if same_step else 6
  out = launch.launch(WORKER, {
      "scenario": "restart", "dir": str(root), "writer": writer,
      "step": new_step, "mib": 1, "old_mib": 8, "lease_s": 600},
                      2, 2, result=writer_worker.Restart)
  for r in out:
    assert r.latest == 4 and r.exact, r
    assert r.steps == [4, new_step], r
  assert old_attempt[0] in os.listdir(root)  # its holder lives: spared
  assert segments_of(info) == old_segments  # the old writers' memory too
  writers = [w for i in info for w in i["writers"]]
  resume(writers)
  wait_gone(writers, 120)
  if same_step:  # the new job's step 5 stands; the old attempt never commits
    assert committed(root) == [4, 5]
    assert same_state(root, 5, 1)
  else:
    assert committed(root) == [4, 5, 6]
    assert same_state(root, 5, 8) and same_state(root, 6, 1)
  assert same_state(root, 4, 8)
  assert segments_of(info) == []


def writers_of(trainers: list[int]) -> list[int]:
  """The writer processes (still running) started by these trainers."""
  out = []
  for p in psutil.process_iter(["cmdline"]):
    cmd = p.info["cmdline"] or []
    if (any("writer_main" in c or "writer_faults" in c for c in cmd)
        and len(cmd) > 4 and cmd[-2].isdigit() and int(cmd[-2]) in trainers):
      out.append(p.pid)
  return out


@pytest.mark.parametrize("kill", ["mid hand-over", "before rename",
                                  "before record", "after record"])
def test_crash_points_of_the_writers_path(tmp_path, kill):
  """The crash points a save crosses in the writer's own path, in a job of
  2: a trainer killed as it hands its boxes over (its writer abandons the
  save; nothing commits and the attempt goes), process 0's writer killed
  in its commit before the rename (nothing commits; the save fails on
  every process, process 1's writer seeing at once that the lease's holder
  died, and the next save of the step commits), process 1's writer killed
  as it is about to write its record (nothing commits; every save fails
  at once, none waiting out the bound: its trainer records the death for
  it, and process 0's writer removes the attempt), process 1's writer
  killed once its record is written (its part is durable: the step
  commits and restores bit for bit, and every trainer's save succeeds,
  process 1's with a warning naming its writer's death; the next save
  starts a new writer there).
  """
  root = tmp_path / "c"
  cluster = local_cluster.start(
      WORKER, {"scenario": "crash", "dir": str(root), "mib": 8, "kill": kill,
               "before": 4, "step": 5, "again": 5 if kill == "before rename"
               else 6, "bound_s": 30},
      num_processes=2, devices_per_process=2, cwd=REPO)
  trainers = cluster.pids()
  if kill == "mid hand-over":
    deadline = time.monotonic() + 120
    while cluster.poll()[1] is None:  # process 1 kills itself
      assert time.monotonic() < deadline
      time.sleep(0.1)
    cluster.kill(0, signal.SIGKILL)  # the job goes, as a scheduler ends it
  results = cluster.wait(180, grace_s=0)
  wait_gone(writers_of(trainers), 120)
  assert not [n for n in os.listdir("/dev/shm")
              for t in trainers if n.startswith(f"ckpt-{t}-")]
  if kill == "mid hand-over":  # (its attempt goes at the next save)
    assert results[1].returncode == -signal.SIGKILL
    assert committed(root) == [4]
    return
  out = local_cluster.check(results)
  got = [worker_lib.decode(writer_worker.Crash, r) for r in out]
  if kill == "after record":  # committed: no save failed
    assert all(r.error is None and r.steps == [4, 5, 6] for r in got), got
    assert [w for w in got[0].warnings if "writer process" in w] == [], got
    assert any("step 5 is committed" in w and "writer process" in w
               and "died" in w for w in got[1].warnings), got[1]
    assert len(got[1].writers[1]) == 1, got[1]  # a new one, the old gone
    assert got[1].writers[1] != got[1].writers[0], got[1]
    assert bit_exact(root, 5, 8)
    return
  for r in got:  # every process raised (none waited out a bound), naming it
    assert r.error is not None and "writer" in r.error, r
    assert "BarrierTimeoutError" not in r.error, r
  if kill == "before rename":
    assert all(r.steps == [4, 5] for r in got), got
    assert committed(root) == [4, 5] and attempts(root, 5) == []
    assert bit_exact(root, 5, 8)
  else:  # before record: step 5 never committed, its attempt removed
    assert all(r.steps == [4, 6] for r in got), got
    assert committed(root) == [4, 6] and attempts(root, 5) == []
    assert bit_exact(root, 6, 8)
