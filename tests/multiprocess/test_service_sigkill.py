"""Crash safety of the asynchronous checkpointing service under SIGKILL.

A 2-process ``jax.distributed`` job (``tests/multiprocess/service_worker.py``,
scenario "killloop") saves back to back and is SIGKILLed, restarted and
killed again; after every kill each committed step is complete and
bit-exact, and the restarted job resumes from the latest one. Here with the
save's writer thread; with the writer process (issue 50) the same loop is
tests/multiprocess/test_service_sigkill_process.py.

In its own file (it was the end of test_service.py), the writer process's
loop in another: with ``--dist loadfile`` a file runs on one worker, and
the two loops are among the suite's longest tests, so pytest-xdist's two
workers run them side by side.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import random
import re
import signal
import time

import pytest

import ckpt
from ckpt.commit import steps as steps_lib
from ckpt.multihost import local_cluster
from ckpt.store import storage as storage_lib
from tests.multiprocess import service_worker as worker
from tests.multiprocess import worker as worker_lib

REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
WORKER = "tests.multiprocess.service_worker"


def _decoded(scenario: str, results) -> list:
  """Each process's result, checked and decoded into the scenario's type."""
  return [worker_lib.decode(worker.RESULTS[scenario], r)
          for r in local_cluster.check(results)]


def _start(scenario: str, conf: dict) -> local_cluster.Cluster:
  return local_cluster.start(WORKER, dict(conf, scenario=scenario),
                             num_processes=2, devices_per_process=2,
                             cwd=REPO_ROOT)


def _outputs(results) -> str:
  return "\n".join(f"--- process {r.process_id} (exit {r.returncode}) ---\n"
                   f"{r.output[-3000:]}" for r in results)


KILL_SEED = 20240611
KILL_VICTIMS = ([0], [1], [0, 1])
KILL_DELAY_S = 1.5  # a kill comes within this of the job being ready
KILL_STRATA = 4  # kills per victim set, each in its own part of the delay
KILLS = len(KILL_VICTIMS) * KILL_STRATA
KEEP = 3
# The jobs' barrier_timeout_s. With writer="process" it is also how long
# process 0's writer waits for the other writers' records, and twice it how
# long another writer waits for process 0's commit: a kill that leaves a
# writer waiting for a step that can never commit (process 0's trainer
# died before handing that step over) costs the loop that long before the
# next job may start (_wait_writers_gone). 30 s is still several times
# what a live peer needs under heavy load (records 8 s apart at load 50).
BARRIER_TIMEOUT_S = {"thread": 60, "process": 30}


def _kill_point(launch: int, rng: random.Random
                ) -> tuple[list[int], float, bool]:
  """Who is killed at ``launch``, how long after the mark, and whether the
  mark is the job's first save (else: the job being ready).

  Stratified, not drawn: each victim set in turn, and the n-th kill of a
  set at a random moment of the n-th of KILL_STRATA equal parts of
  [0, KILL_DELAY_S), so 12 kills spread over who and when as evenly as 18
  random ones (which could leave a victim set with two, or a part of the
  delay with none). The first part counts from the job being ready (kills
  in its restore and its first save's start); the others from its first
  save's start, so that on a loaded machine, where the first save can
  start seconds after "ready", they still land among the saves."""
  victims = KILL_VICTIMS[launch % len(KILL_VICTIMS)]
  part = KILL_DELAY_S / KILL_STRATA
  stratum = launch // len(KILL_VICTIMS)
  return victims, part * (stratum + rng.random()), stratum > 0


def _events(events_dir: pathlib.Path,
            pid: int) -> list[tuple[float, int, str, int]]:
  path = events_dir / f"p{pid}.log"
  if not path.exists():
    return []
  out = []
  for line in path.read_text().splitlines():
    parts = line.split()
    if len(parts) == 4:  # a line cut by the kill is dropped
      out.append((float(parts[0]), int(parts[1]), parts[2], int(parts[3])))
  return out


def _phase_at(events, launch: int, t: float) -> tuple[str, int]:
  """What a process was doing at time t: from its last event before t."""
  last = None
  for e in events:
    if e[1] == launch and e[0] <= t:
      last = e
  if last is None or last[2] == "init":
    return "startup", -1
  return {"ready": "before first save", "save_start": "staging",
          "staged": "writing/commit", "bg_done": "between saves",
          "committed": "between saves"}.get(last[2], last[2]), last[3]


def _step_digest(step_dir: pathlib.Path) -> str:
  """A digest of every file of a step directory: its names and bytes."""
  h = hashlib.blake2b()
  for dirpath, dirnames, filenames in os.walk(step_dir):
    dirnames.sort()
    for name in sorted(filenames):
      path = os.path.join(dirpath, name)
      h.update(os.path.relpath(path, step_dir).encode() + b"\0")
      with open(path, "rb") as f:
        h.update(hashlib.blake2b(f.read()).digest())
  return h.hexdigest()


def _verify_root(root: pathlib.Path, prev_latest: int | None,
                 prev_count: int = 0,
                 verified: dict[int, str] | None = None) -> list[int]:
  """Every committed step is complete and bit-exact; returns the steps.

  Retention runs after each commit, so a job killed between a commit and
  its retention leaves one step more than KEEP; a restarted job killed in
  that window of ITS first commit adds one more to what it found (seen
  once in a full run: [82..86] after two such kills in a row).

  ``verified``: step -> the digest of its directory when it was loaded
  and found bit-exact. A step whose files are byte for byte the same
  (names and contents) loads the same, so it is not loaded again (with
  writer="process" the killed jobs' retention rarely runs, and every
  step saved stays until the last run: loading each after every kill
  grew as the square of the kills)."""
  names = os.listdir(root) if root.exists() else []
  step_dirs = sorted(int(m.group(1)) for n in names
                     if (m := re.fullmatch(r"checkpoint_(\d+)", n)))
  for s in step_dirs:
    assert (root / f"checkpoint_{s}" / "index.msgpack").exists(), (
        f"checkpoint_{s} is visible without index.msgpack: {names}")
  steps = steps_lib.committed_steps(storage_lib.Storage(str(root)))
  assert steps == step_dirs, (steps, names)
  assert len(steps) <= max(KEEP, prev_count) + 1, (prev_count, steps)
  if prev_latest is not None:
    assert steps and steps[-1] >= prev_latest, (prev_latest, steps)
  for s in steps:
    digest = _step_digest(root / f"checkpoint_{s}")
    if verified is not None and verified.get(s) == digest:
      continue
    got = ckpt.load(str(root), s)
    want = worker.kill_state(s)
    assert got["step"] == s
    for name in worker.KILL_SHAPES:
      assert worker.same_bits(got[name], want[name]), f"step {s} leaf {name}"
    if verified is not None:
      verified[s] = digest
  return steps


def _wait_ready(cluster, events_dir: pathlib.Path, launch: int) -> list[dict]:
  deadline = time.monotonic() + 90
  paths = [events_dir / f"ready_{launch}_{p}" for p in (0, 1)]
  while not all(p.exists() for p in paths):
    if (time.monotonic() > deadline or
        any(c is not None for c in cluster.poll())):
      pytest.fail(f"launch {launch} never got ready:\n" +
                  _outputs(cluster.wait(0, grace_s=0)))
    time.sleep(0.01)
  return [json.loads(p.read_text()) for p in paths]


def _wait_saving(cluster, events_dir: pathlib.Path, launch: int) -> None:
  """Until every process of ``launch`` has started its first save."""
  deadline = time.monotonic() + 90
  while not all(any(e[1] == launch and e[2] == "save_start"
                    for e in _events(events_dir, p)) for p in (0, 1)):
    if (time.monotonic() > deadline or
        any(c is not None for c in cluster.poll())):
      pytest.fail(f"launch {launch} never started a save:\n" +
                  _outputs(cluster.wait(0, grace_s=0)))
    time.sleep(0.01)


def _wait_writers_gone(trainers: list[int]) -> None:
  """writer="process": the writers of these (killed) trainers finish the
  save in flight, then exit; a restarted job that came up sooner could
  find a step committed after it looked (the dead job's, as designed). A
  writer waits for process 0's writer's commit at most twice the barrier
  timeout (BARRIER_TIMEOUT_S) when process 0's trainer died mid-hand-over."""
  import psutil  # pylint: disable=import-outside-toplevel
  mine = []
  for p in psutil.process_iter(["cmdline"]):
    cmd = p.info["cmdline"] or []
    if ("ckpt.save.writer_main" in cmd and len(cmd) > 4
        and cmd[-2].isdigit() and int(cmd[-2]) in trainers):
      mine.append(p)
  _, alive = psutil.wait_procs(mine, timeout=180)
  assert not alive, f"writers still running 180 s after their trainers died"


def _check_resume(launch: int, ready: list[dict], latest: int | None) -> None:
  for info in ready:
    assert info["latest"] == latest, (launch, info, latest)
    if latest is not None:
      assert info["resume_exact"] is True, (launch, info)


def _check_cleanup(cleanup_path: pathlib.Path, tmp_seen: list[str]) -> bool:
  """Abandoned dirs seen before a launch were gone after its first save.

  False if the launch was killed before its first save committed.
  """
  if not cleanup_path.exists():
    return False
  cleanup = json.loads(cleanup_path.read_text())
  assert set(tmp_seen) <= set(cleanup["before"]), (tmp_seen, cleanup)
  assert cleanup["after"] == [], cleanup  # process 0 removed abandoned dirs
  return cleanup["time"]


@pytest.mark.parametrize("writer", ["thread"])
def test_sigkill_during_saves_keeps_committed_checkpoints(tmp_path, writer):
  rng = random.Random(KILL_SEED)
  root, events = tmp_path / "ckpt", tmp_path / "events"
  events.mkdir()
  conf = {"dir": str(root), "events": str(events), "keep": KEEP,
          "max_step": 10**6, "writer": writer,
          "barrier_timeout_s": BARRIER_TIMEOUT_S[writer]}
  t_start = time.monotonic()
  latest, tmp_seen, rows = None, [], []
  launch, cleanups_checked = 0, 0
  crash_to_cleanup, last_kill = [], 0.0
  verified: dict[int, str] = {}  # step -> digest when found bit-exact
  while launch < KILLS:
    cluster = _start("killloop", dict(conf, launch=launch))
    try:
      ready = _wait_ready(cluster, events, launch)
      _check_resume(launch, ready, latest)
      victims, delay, after_first_save = _kill_point(launch, rng)
      if after_first_save:
        _wait_saving(cluster, events, launch)
      time.sleep(delay)
      t_kill = time.time()
      for v in victims:
        cluster.kill(v, signal.SIGKILL)
      # The job is restarted as a whole: a survivor runs on a little (it may
      # still commit, or wait at a barrier), then goes too.
      grace = rng.uniform(0.0, 0.3)
      time.sleep(grace)
    finally:
      results = cluster.wait(0, grace_s=0)
      t_gone = time.monotonic()
      if writer == "process":  # the dead job's saves end (committed or not)
        _wait_writers_gone(cluster.pids())
      t_gone = time.monotonic() - t_gone
    phases = [_phase_at(_events(events, p), launch, t_kill) for p in (0, 1)]
    cleaned = _check_cleanup(events / f"cleanup_{launch}.json", tmp_seen)
    cleanups_checked += bool(cleaned)
    if cleaned and tmp_seen:  # the previous kill left attempts: how soon gone
      crash_to_cleanup.append(cleaned - last_kill)
    last_kill = t_kill
    tmp_seen = sorted(n for n in os.listdir(root) if ".tmp-" in n) if (
        root.exists()) else []
    before = dict(verified)
    steps = _verify_root(root, latest, len(rows[-1]["steps"]) if rows else 0,
                         verified)
    loaded = sum(before.get(s) != verified[s] for s in steps)
    rows.append({"launch": launch, "victims": victims, "phases": phases,
                 "delay": delay, "grace": grace, "steps": steps,
                 "tmp": len(tmp_seen), "loaded": loaded,
                 "codes": [r.returncode for r in results],
                 "t": time.monotonic() - t_start, "gone": t_gone})
    latest = steps[-1] if steps else None
    launch += 1
  # A last run, not killed: resumes, saves a few steps and exits cleanly.
  final_steps = 3 if latest is None else latest + 4
  cluster = _start("killloop", dict(conf, launch=launch, max_step=final_steps))
  ready = _wait_ready(cluster, events, launch)
  _check_resume(launch, ready, latest)
  results = cluster.wait(120)
  out = _decoded("killloop", results)
  assert _check_cleanup(events / f"cleanup_{launch}.json", tmp_seen)
  steps = _verify_root(root, latest)
  assert steps == list(range(final_steps - KEEP, final_steps)), steps
  for r in out:
    assert r.all_steps == steps
    assert r.resume_exact in (True, None)
  assert not [n for n in os.listdir(root) if ".tmp-" in n]

  in_flight = ("staging", "writing/commit")
  mid_save = [row for row in rows
              if any(row["phases"][v][0] in in_flight for v in row["victims"])]
  # A save hit in flight whose step still committed: the kill came after the
  # commit (retention, last barrier) or the survivor finished the commit.
  still_committed = [row for row in mid_save
                     if max(s for ph, s in row["phases"]) in row["steps"]]
  print(f"\nkill test: {len(rows)} SIGKILLs in {time.monotonic() - t_start:.0f}s"
        f" (seed {KILL_SEED}); {len(mid_save)} landed while a killed process "
        f"had a save in flight ({len(mid_save) - len(still_committed)} of "
        f"those saves never committed, {len(still_committed)} did); "
        f"{sum(r['tmp'] > 0 for r in rows)} left "
        f"abandoned *.tmp-* directories; {cleanups_checked} restarted jobs "
        "were seen removing them at their first save")
  if crash_to_cleanup:
    print(f"  from a kill to the removal of its attempts by the restarted "
          f"job's first save (default lease, {len(crash_to_cleanup)} "
          f"restarts): median {sorted(crash_to_cleanup)[len(crash_to_cleanup) // 2]:.1f} s, "
          f"max {max(crash_to_cleanup):.1f} s")
  for row in rows:
    where = ", ".join(f"p{p}: {ph} {s}" if s >= 0 else f"p{p}: {ph}"
                      for p, (ph, s) in enumerate(row["phases"]))
    print(f"  kill {row['launch']:2d}: victims {row['victims']} at "
          f"+{row['delay']:.2f}s (+{row['grace']:.2f}s for the rest) "
          f"[{where}] -> committed {row['steps']} ({row['loaded']} loaded, "
          f"the rest unchanged), {row['tmp']} tmp dirs "
          f"(at {row['t']:.0f} s; writers gone in {row['gone']:.1f} s)")
  print(f"  final run: committed {steps}, every committed step verified "
        "bit-exact after every kill")
  assert len(rows) == KILLS
  assert len(mid_save) >= len(rows) // 2, "most kills should hit a save"
