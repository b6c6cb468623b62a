"""Multi-tier checkpoints (ckpt/tiers/multitier.py, ckpt/tiers/local_tier.py) in real 4-process jobs.

One job (4 processes x 2 CPU devices) saves every step to the local tier
and every 5th to the persistent tier and is SIGKILLed (every process) while
a local save is in flight. Restarts then restore: the newest complete local
step, bit-exact; the same after one process's local directory is wiped (its
shards come from its partner); after that process's partner is wiped too,
the newest persistent step, with the log line; and on 2 processes x 4
devices, the persistent tier.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import time

import pytest

from ckpt.multihost import local_cluster
from tests.multiprocess import tiers_worker
from tests.multiprocess import worker

REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
WORKER = "tests.multiprocess.tiers_worker"
N = 4


def _steps(path) -> list[int]:
  try:
    names = os.listdir(path)
  except FileNotFoundError:
    return []
  return sorted(int(m.group(1)) for m in
                map(re.compile(r"^step_(\d+)$").match, names) if m)


def _persistent(path) -> list[int]:
  return sorted(int(m.group(1)) for m in
                map(re.compile(r"^checkpoint_(\d+)$").match, os.listdir(path))
                if m)


def _listdir(path) -> list[str]:
  try:
    return os.listdir(path)
  except FileNotFoundError:
    return []


def _newest_complete(held: dict[int, list[int]]) -> int | None:
  dst = {p: (p + 1) % N for p in range(N)}
  cands = set().union(*held.values())
  ok = [s for s in cands
        if all(s in held[p] or s in held[dst[p]] for p in range(N))]
  return max(ok) if ok else None


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
  root = tmp_path_factory.mktemp("tiers")
  conf = {"persistent": str(root / "persistent"), "local": str(root / "local"),
          "flags": str(root), "mesh": [4, 2], "steps": 200,
          "scenario": "train"}
  cluster = local_cluster.start(WORKER, conf, num_processes=N,
                                devices_per_process=2, cwd=REPO_ROOT)
  try:
    cluster.wait_for_files([root / f"saved_{p}_12" for p in range(N)], 150)
    # The persistent tier's step 10 is saved in the background: under load
    # it may commit after local step 12 (the test restores from both).
    deadline = time.monotonic() + 150
    while not (_persistent(root / "persistent") or [0])[-1] >= 10:
      assert time.monotonic() < deadline, "persistent step 10 never committed"
      time.sleep(0.05)
  except BaseException:
    for p in range(N):
      cluster.kill(p, signal.SIGKILL)
    raise
  # Every process, while a local save is in flight: a process seen with a
  # .tmp- directory is stopped first (SIGSTOP), and killed if the directory
  # is still there (not renamed meanwhile); then all of them (bounded).
  deadline = time.monotonic() + 60
  while time.monotonic() < deadline:
    busy = [p for p in range(N) if any(".tmp-" in n for n in _listdir(
        root / "local" / f"process_{p}"))]
    if busy:
      cluster.kill(busy[0], signal.SIGSTOP)
      if any(".tmp-" in n for n in _listdir(
          root / "local" / f"process_{busy[0]}")):
        break
      cluster.kill(busy[0], signal.SIGCONT)
    time.sleep(0.001)
  for p in range(N):
    cluster.kill(p, signal.SIGKILL)
  cluster.wait(30, grace_s=0)
  leftovers = [n for p in range(N) for n in os.listdir(root / "local" /
                                                        f"process_{p}")
               if ".tmp-" in n]
  return root, conf, leftovers


def _restore(conf, phases, processes=N, devices=2, mesh=(4, 2), **extra):
  results = local_cluster.run(
      WORKER, dict(conf, scenario="restore", phases=phases, mesh=list(mesh),
                   **extra),
      num_processes=processes, devices_per_process=devices, timeout_s=180,
      cwd=REPO_ROOT)
  return [worker.decode(tiers_worker.Phases, r)
          for r in local_cluster.check(results)], results


def test_restore_after_sigkill_wipes_and_topology(killed):
  root, conf, leftovers = killed
  assert leftovers, "the kill did not catch a local save in flight"
  local = root / "local"
  held = {p: _steps(local / f"process_{p}") for p in range(N)}
  persistent = _persistent(root / "persistent")
  assert persistent and persistent[-1] >= 10, persistent
  want_a = _newest_complete(held)
  assert want_a is not None and want_a >= persistent[-1], (held, persistent)
  # Phase B: process 1 is a replaced host (its local directory is empty).
  held_b = {**held, 1: []}
  want_b = _newest_complete(held_b)
  got, results = _restore(conf, [{}, {"wipe": [1]}, {"wipe": [2]}],
                          save_after=True)
  for p, r in enumerate(got):
    a, b, c = r.restores
    after = r.after
    assert (a.tier, a.step, a.exact) == ("local", want_a, True), r
    assert a.host_state == {"pos": want_a * 100 + p}
    assert (b.tier, b.step, b.exact) == ("local", want_b, True), r
    assert b.from_partner == (p == 1)
    assert b.host_state == {"pos": want_b * 100 + p}
    # Process 1 and its partner (process 2) both lost their local tier.
    assert (c.tier, c.step, c.exact) == (
        "persistent", persistent[-1], True), r
    assert c.host_state == {"pos": persistent[-1] * 100 + p}
    # The next save works, and leaves nothing over (crash leftovers gone).
    assert f"step_{after.saved}" in after.entries, after
    assert all(re.fullmatch(r"step_\d+", e) for e in after.entries), after
  assert "from the persistent tier" in results[0].output
  assert "the local tier holds no step every process can rebuild" in (
      results[0].output)


def test_restore_on_another_topology_uses_persistent(killed):
  root, conf, _ = killed
  persistent = _persistent(root / "persistent")
  got, results = _restore(conf, [{}], processes=2, devices=4, mesh=(2, 4))
  for r in got:
    first = r.restores[0]
    assert (first.tier, first.step, first.exact) == (
        "persistent", persistent[-1], True), r
  assert "saved by 4 processes x 2 devices" in results[0].output


def test_a_local_save_failing_on_one_process_fails_on_all(tmp_path):
  """Process 1's host_state is over the local tier's limit at step 2: every
  process raises before the partner exchange (a collective one process
  never joined would hang), nothing is committed, step 3 saves."""
  conf = {"persistent": str(tmp_path / "persistent"),
          "local": str(tmp_path / "local"), "flags": str(tmp_path),
          "mesh": [2, 2], "scenario": "one_fails",
          "persistent_interval": 100}
  results = [worker.decode(tiers_worker.OneFails, r)
             for r in local_cluster.check(local_cluster.run(
                 WORKER, conf, num_processes=2, devices_per_process=2,
                 timeout_s=180, cwd=REPO_ROOT))]
  for r in results:
    assert r.saves["1"].ok and r.saves["3"].ok, r
    assert r.local_steps == [1, 3], r
  p0, p1 = (r.saves["2"].error for r in results)
  assert p0 and "process(es) [1]" in p0.msg and "bytes" in p0.msg, p0
  assert p1 and f"{p1.type}: {p1.msg}".startswith(
      "CheckpointError: host_state"), p1


# ---- integrity, run identity and manifests (issue 23 items 2, 3, 8) --------

_PHASES = [
    [(0, 5, "own.bin", "flip")],                                   # 0
    [(0, 5, "own.bin", "flip"), (1, 5, "partner.bin", "flip")],    # 1
    [(1, 5, "own.bin", "truncate")],                               # 2
    [(0, 5, "own.bin", "empty"), (1, 5, "partner.bin", "truncate")],  # 3
    [(0, 5, "manifest.json", "{}"), (1, 5, "manifest.json", "huge")],  # 4
    [(0, 5, "manifest.json", "not json {"),
     (1, 5, "manifest.json", '{"format": "ckpt-local-tier"}')],    # 5
    [(0, 5, "host.msgpack", "flip")],                              # 6
]


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
  """One 2-process x 2-device job: local steps 4, 5 and persistent step 5,
  restored after each phase's damage (process 1 keeps process 0's replica
  and the other way round), then by a run of another persistent root."""
  root = tmp_path_factory.mktemp("damaged")
  conf = {"persistent": str(root / "persistent"), "local": str(root / "local"),
          "flags": str(root), "mesh": [2, 2], "scenario": "integrity",
          "phases": _PHASES, "dump_after_s": 120}
  return [worker.decode(tiers_worker.Integrity, r)
          for r in local_cluster.check(local_cluster.run(
              WORKER, conf, num_processes=2, devices_per_process=2,
              timeout_s=240, cwd=REPO_ROOT))]


def test_a_damaged_local_shard_falls_back_to_the_replica_then_persistent(
    damaged):
  for p, r in enumerate(damaged):
    flip, both, trunc, gone = r.phases[:4]
    # A flipped bit in process 0's own part: its partner's replica.
    assert (flip.tier, flip.step, flip.exact) == ("local", 5, True), flip
    assert flip.from_partner == (p == 0), flip
    assert flip.host_state == {"pos": 500 + p}, flip
    assert "process 0" in flip.reason and "own.bin" in flip.reason, flip
    assert "crc32c" in flip.reason, flip
    # ... and in that replica too: the persistent tier, on every process.
    assert (both.tier, both.step, both.exact) == ("persistent", 5, True), both
    assert "own.bin" in both.reason and "partner.bin" in both.reason
    # A truncated own part: the replica, with a reason naming sizes.
    assert (trunc.tier, trunc.step, trunc.exact) == ("local", 5, True), trunc
    assert trunc.from_partner == (p == 1), trunc
    assert "own.bin" in trunc.reason and "bytes" in trunc.reason, trunc
    # Empty own part and truncated replica: the persistent tier.
    assert (gone.tier, gone.step, gone.exact) == ("persistent", 5, True), gone
    assert "Error" not in gone.reason, gone  # no bare ValueError/TypeError
  assert damaged[0].phases[1].reason == damaged[1].phases[1].reason


def test_a_bad_manifest_is_skipped_with_a_reason(damaged):
  for r in damaged:
    empty_huge, garbage, host = r.phases[4:7]
    for d in (empty_huge, garbage):
      assert (d.tier, d.step, d.exact) == ("persistent", 5, True), d
      assert "manifest.json" in d.reason, d
    assert "bytes" in empty_huge.reason, empty_huge   # the size bound
    assert "JSON" in garbage.reason, garbage
    assert "process_count" not in garbage.reason or (
        "missing" in garbage.reason), garbage
    # A damaged host.msgpack: that process's part comes from its partner.
    assert (host.tier, host.step, host.exact) == ("local", 5, True), host
    assert "host.msgpack" in host.reason, host


def test_local_steps_of_another_persistent_root_are_not_restored(damaged):
  for r in damaged:
    other = r.other
    assert other.latest is None, other
    assert other.tier != "local", other
    assert other.step is None or other.tier == "persistent", other
    # The next save removes them (retention would otherwise keep 4, 5).
    assert other.entries == ["step_1"], other
    assert other.restored_after_save == [1, True], other
  # Nothing to restore anywhere: every process raises the same error.
  errors = [r.other.error for r in damaged]
  assert errors[0] == errors[1], errors
