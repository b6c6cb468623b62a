"""A crashed save's attempt goes at the next save; a live one never does.

Real processes hold the attempts: a child prepares an attempt (what a save
does first, ckpt/commit/protocol.py) and is then SIGKILLed, left a zombie, or kept
alive. The parent's Checkpointer cleans up at every save (ckpt/commit/lease.py says
what proves a holder dead).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from ckpt.commit import cleanup as cleanup_lib
from ckpt.commit import lease as lease_lib
from ckpt.commit.marker import MarkerCommit
from ckpt.commit.rename import RenameCommit
from ckpt.store import storage as storage_lib
from ckpt.commit import attempt
from tests.conftest import random_array

# The child: prepares an attempt at step 3 in argv[1], writes a data file
# into it, says "ready", then dies (SIGKILL) or waits on stdin.
_CHILD = textwrap.dedent("""
    import os, signal, sys
    from ckpt.commit import protocol as commit
    from ckpt.store import storage
    st = storage.Storage(sys.argv[1])
    rel = commit.prepare(st, 3, "c0ffee" + sys.argv[2])
    with open(os.path.join(sys.argv[1], rel, "data"), "wb") as f:
      f.write(os.urandom(1 << 16))
    print(rel, flush=True)
    if sys.argv[3] == "die":
      os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.read()
""")


def _child(root, tag: str, mode: str) -> tuple[subprocess.Popen, str]:
  proc = subprocess.Popen(
      [sys.executable, "-c", _CHILD, str(root), tag, mode],
      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
      env=dict(os.environ, PYTHONPATH=os.getcwd()))
  rel = proc.stdout.readline().strip()
  assert rel.startswith("checkpoint_3.tmp-"), rel
  return proc, rel


def _state(rng):
  return {"w": random_array(rng, (64, 64))}


def _wait_state(pid: int, letter: str, timeout_s: float = 10.0) -> None:
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    with open(f"/proc/{pid}/stat") as f:
      if f.read().rsplit(")", 1)[1].split()[0] == letter:
        return
    time.sleep(0.01)
  pytest.fail(f"process {pid} never reached state {letter}")


def test_every_save_removes_attempts_of_dead_holders(make_ckptr, ckpt_dir, rng):
  """A process killed mid-save leaves its attempt; the next save of the
  restarted writer removes it at once, whatever the (default) lease says,
  and not only at a Checkpointer's first save."""
  ckptr = make_ckptr(async_save=False)
  assert ckptr.lease_s == lease_lib.DEFAULT_LEASE_S <= 60
  assert ckptr.save(1, _state(rng))
  proc, rel = _child(ckpt_dir, "01", "die")
  assert proc.wait(30) == -signal.SIGKILL  # reaped: the pid is free
  t_dead = time.monotonic()
  assert (ckpt_dir / rel / "data").exists()
  reasons = {}
  assert cleanup_lib.abandoned(ckptr.storage, ckptr.lease_s, reasons) == [rel]
  assert "has exited" in reasons[rel], reasons
  assert ckptr.save(2, _state(rng))  # the same Checkpointer's second save
  cleaned_s = time.monotonic() - t_dead
  assert not (ckpt_dir / rel).exists()
  assert sorted(p.name for p in ckpt_dir.iterdir()) == [
      "checkpoint_1", "checkpoint_2"]
  print(f"\nattempt of a SIGKILLed holder removed {cleaned_s:.2f} s after "
        "its death, by the next save")


def test_a_zombie_holder_is_dead(make_ckptr, ckpt_dir, rng):
  """Killed but not reaped by its parent yet: the pid still exists."""
  proc, rel = _child(ckpt_dir, "02", "die")
  try:
    _wait_state(proc.pid, "Z")
    assert make_ckptr(async_save=False).save(1, _state(rng))
    assert not (ckpt_dir / rel).exists()
  finally:
    proc.wait(30)


def test_a_live_holders_attempt_stays(make_ckptr, ckpt_dir, rng):
  """Another job saving into the same root (alive, lease fresh) keeps its
  attempt through our saves; its lease, once expired, is the only rule."""
  proc, rel = _child(ckpt_dir, "03", "live")
  try:
    ckptr = make_ckptr(async_save=False)
    assert ckptr.save(1, _state(rng))
    assert ckptr.save(2, _state(rng))
    assert (ckpt_dir / rel / "data").exists(), "a live save was removed"
    assert cleanup_lib.abandoned(ckptr.storage) == []
    # The lease is older than a writer's lease_s: removed (the age rule).
    time.sleep(0.05)
    assert make_ckptr(async_save=False, lease_s=0.01).save(4, _state(rng))
    assert not (ckpt_dir / rel).exists()
  finally:
    proc.stdin.close()
    proc.wait(30)


def _rewrite_lease(ckpt_dir, rel: str, **changes) -> None:
  path = ckpt_dir / rel / attempt.ATTEMPT_FILE
  lease = json.loads(path.read_bytes())
  lease.update(changes)
  storage_lib.write_file(os.fspath(path), json.dumps(lease).encode())


@pytest.mark.parametrize("what", ["pid reused", "other host", "old ckpt"])
def test_what_proves_a_holder_dead(make_ckptr, ckpt_dir, rng, what):
  """The holder's pid is alive in every case: a pid whose process started
  at another time is a reused pid (dead holder); a lease written on another
  host, or by a ckpt that did not record the holder, proves nothing and
  waits for its age."""
  proc, rel = _child(ckpt_dir, "04", "live")
  try:
    lease = json.loads((ckpt_dir / rel / attempt.ATTEMPT_FILE).read_bytes())
    assert lease["pid"] == proc.pid and lease["host"] and lease["pid_start"]
    if what == "pid reused":
      _rewrite_lease(ckpt_dir, rel, pid_start=lease["pid_start"] - 1)
    elif what == "other host":
      _rewrite_lease(ckpt_dir, rel, host=lease["host"] + "-elsewhere")
    else:  # ckpt <= 0.1 wrote token, time, host and pid only
      _rewrite_lease(ckpt_dir, rel, boot=None, pidns=None, pid_start=None)
    ckptr = make_ckptr(async_save=False)
    assert ckptr.save(1, _state(rng))
    if what == "pid reused":
      assert not (ckpt_dir / rel).exists()
      return
    assert (ckpt_dir / rel / "data").exists()
    # Aged on the file system's clock (what cleanup reads: lease.py).
    old = os.stat(ckpt_dir).st_mtime - ckptr.lease_s - 1
    os.utime(ckpt_dir / rel / attempt.ATTEMPT_FILE, (old, old))
    assert ckptr.save(2, _state(rng))
    assert not (ckpt_dir / rel).exists()
  finally:
    proc.stdin.close()
    proc.wait(30)


def test_renewals_are_spaced_for_object_stores():
  disk, bucket = RenameCommit.least_renewal_s, MarkerCommit.least_renewal_s
  assert lease_lib.renew_interval(30.0, disk) == 5.0
  assert lease_lib.renew_interval(1e-3, disk) == 0.05
  assert lease_lib.renew_interval(1e-3, bucket) == 1.0


def test_a_lease_names_its_holder():
  lease = json.loads(lease_lib.make("abc"))
  assert lease["token"] == "abc" and lease["pid"] == os.getpid()
  assert lease["processes"] == 1 and lease["coordinator"] is None
  assert lease_lib.dead_reason(lease) is None  # this very process
  assert np.isfinite(lease["time"])


def test_an_attempt_that_never_got_its_lease(make_ckptr, ckpt_dir, rng):
  """A save killed between creating its directory and writing its lease
  leaves an empty directory (maybe a lease being written): gone at the next
  save once it is 2 s old; one that holds data waits for the lease age."""
  ckpt_dir.mkdir()
  empty = ckpt_dir / "checkpoint_3.tmp-0badc0de"
  empty.mkdir()
  (empty / f"{attempt.ATTEMPT_FILE}.partial-1234").write_bytes(b"{")
  data = ckpt_dir / "checkpoint_4.tmp-0badf00d"
  data.mkdir()
  (data / "w").write_bytes(b"x")
  ckptr = make_ckptr(async_save=False)
  assert ckptr.save(1, _state(rng))
  assert empty.exists() and data.exists()  # younger than 2 s
  old = time.time() - cleanup_lib.UNFINISHED_PREPARE_S - 1
  for d in (empty, data):
    os.utime(d, (old, old))
  assert ckptr.save(2, _state(rng))
  assert not empty.exists()
  assert data.exists()  # not empty: the age rule (lease_s) applies
