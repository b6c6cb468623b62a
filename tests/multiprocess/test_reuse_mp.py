"""reuse_unchanged=True with 2 real processes (tests/multiprocess/reuse_worker.py):
reuse across retention, and SIGKILLs at random moments of saves that link."""

from __future__ import annotations

import os
import pathlib
import random
import re
import signal
import time

import pytest

import ckpt
from ckpt.cli import integrity
from ckpt.commit import steps as steps_lib
from ckpt.multihost import local_cluster
from ckpt.store import storage as storage_lib
from tests.multiprocess import reuse_worker as worker
from tests.multiprocess.launch import REPO, launch

WORKER = "tests.multiprocess.reuse_worker"
KILLS = 3
KILL_SEED = 20261127


def _check_root(root: pathlib.Path) -> list[int]:
  """Every committed step restores bit-exact and verifies; returns them."""
  names = os.listdir(root) if root.exists() else []
  visible = sorted(int(m.group(1)) for n in names
                   if (m := re.fullmatch(r"checkpoint_(\d+)", n)))
  steps = steps_lib.committed_steps(storage_lib.Storage(str(root)))
  assert steps == visible, (steps, names)
  for s in steps:
    got, want = ckpt.load(str(root), s), worker.state(s)
    for k in worker.LEAVES:
      assert got[k].tobytes() == want[k].tobytes(), f"step {s} leaf {k}"
    assert integrity.verify(str(root), step=s) == [], s
  return steps


def test_reuse_across_retention(tmp_path):
  root = tmp_path / "root"
  out = launch(WORKER, {"scenario": "retention", "dir": str(root)},
               num_processes=2, devices_per_process=2, result=worker.Result)
  worker.check_retention(out)  # steps 2 and 3 linked the frozen chunks
  # Steps 0 and 1, which wrote those files, are gone: steps 2 and 3 hold
  # one copy each (step 0's and step 1's), whole.
  two, three = root / "checkpoint_2", root / "checkpoint_3"
  linked = [p for p in (three / "frozen").iterdir() if p.name[0].isdigit()]
  assert len(linked) == 16
  for p in linked:
    assert p.stat().st_ino != (two / "frozen" / p.name).stat().st_ino
  assert _check_root(root) == [2, 3]
  moved = tmp_path / "moved"
  os.rename(root, moved)
  assert _check_root(moved) == [2, 3]


def test_a_restarted_job_reuses_its_steps(tmp_path):
  """Issue 45, item 5, with 2 real processes on a disk: each process
  starts from its own .reuse records of the newest two steps."""
  worker.check_resumed(str(tmp_path / "root"), launch)
  assert _check_root(tmp_path / "root") == [2, 3]


def _wait_saved(cluster, events: pathlib.Path, launch_no: int) -> None:
  """Until the launch's first save is committed: its next ones link."""
  deadline = time.monotonic() + 90
  paths = [events / f"saved_{launch_no}"]
  while not all(p.exists() for p in paths):
    if time.monotonic() > deadline or any(
        c is not None for c in cluster.poll()):
      res = cluster.wait(0, grace_s=0)
      pytest.fail(f"launch {launch_no} never saved: " + "\n".join(
          r.output[-2000:] for r in res))
    time.sleep(0.01)


def test_sigkill_during_saves_with_reuse_keeps_every_step_whole(tmp_path):
  """Kills (process 0, 1 or both) at random moments of back-to-back saves
  that link their frozen chunks; after each, every committed step restores
  bit-exact and verifies; a last run resumes, links again and ends clean."""
  rng = random.Random(KILL_SEED)
  root, events = tmp_path / "root", tmp_path / "events"
  events.mkdir()
  conf = {"scenario": "killloop", "dir": str(root), "events": str(events),
          "max_step": 10**6}
  latest = None
  for launch_no in range(KILLS):
    cluster = local_cluster.start(WORKER, dict(conf, launch=launch_no),
                                  num_processes=2, devices_per_process=2,
                                  cwd=str(REPO))
    try:
      _wait_saved(cluster, events, launch_no)
      time.sleep(rng.uniform(0.0, 0.6))  # in a save that links, or after
      for v in rng.choice([[0], [1], [0, 1]]):
        cluster.kill(v, signal.SIGKILL)
      time.sleep(rng.uniform(0.0, 0.2))
    finally:
      cluster.wait(0, grace_s=0)
    steps = _check_root(root)
    if latest is not None:
      assert steps and steps[-1] >= latest, (latest, steps)
    latest = steps[-1] if steps else None
    print(f"kill {launch_no}: committed steps {steps}")
  final = 3 if latest is None else latest + 3
  known = min(2, len(_check_root(root)))
  out = launch(WORKER, dict(conf, launch=KILLS, max_step=final),
               num_processes=2, devices_per_process=2, result=worker.Result)
  steps = _check_root(root)
  assert steps == list(range(final - 3, final)), steps
  # The resumed job starts from the records of the newest two steps: it
  # links every frozen chunk from its first save on (from its third when
  # it found fewer than two steps: the first copies are written).
  for i, _ in enumerate(out[0].stats):
    reused = sum(r.stats[i].reused for r in out)
    want = worker.frozen_bytes() if i + known >= 2 else 0
    assert reused == want, (i, known, out)
  assert not [n for n in os.listdir(root) if ".tmp-" in n]
