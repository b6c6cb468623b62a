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
         bound_s: float = 60, fmt: str = "zarr"):
  """A job whose every trainer returned from save() and stopped its writer;
  (cluster, the per-process info)."""
  events = tmp_path / "events"
  events.mkdir(exist_ok=True)
  cluster = local_cluster.start(
      WORKER, {"scenario": "hold", "dir": str(tmp_path / "c"), "mib": mib,
               "step": step, "events": str(events), "bound_s": bound_s,
               "format": fmt},
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
  cluster, info = held(tmp_path, processes, mib=16, fmt=fmt)
  writers = [w for i in info for w in i["writers"]]
  assert len(writers) == processes
  for p in range(processes):
    cluster.kill(p, signal.SIGKILL)
  cluster.wait(30, grace_s=0)
  assert committed(tmp_path / "c") == []  # the writers were stopped
  t0 = time.monotonic()
  resume(writers)
  wait_gone(writers, 120)
  print(f"\n{processes} trainers killed: committed "
        f"{time.monotonic() - t0:.2f} s after the writers went on")
  assert committed(tmp_path / "c") == [5]
  assert bit_exact(tmp_path / "c", 5, 16)
  assert no_segments(info)
  # A restarted job finds the step the dead job committed.
  out = launch.launch(WORKER, {"scenario": "after", "dir": str(tmp_path / "c"),
                               "step": 6, "format": fmt}, processes, 2,
                      result=After)
  assert all(r.steps == [5, 6] for r in out), out


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
