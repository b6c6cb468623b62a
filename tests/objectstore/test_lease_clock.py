"""A lease's age is read on one clock, never by comparing two hosts' clocks.

The holder runs under libfaketime (its ``time.time()`` 2 minutes behind, or
a year ahead); the cleaner is this process with the real clock. On a disk
the age is the file system's (mtimes); on S3 (moto) the cleaner's own
monotonic time since it first saw the lease's generation
(ckpt/commit/lease.py). Before, a holder 2 minutes behind lost its live
attempt, and a dead one a year ahead was never removed (not by a save, not
by ``ckpt gc --yes`` on a bucket).

libfaketime: ``apt-get install faketime`` (.ci/run installs it); without it
these tests skip.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import ckpt
from ckpt.cli import main as cli
from ckpt.commit import attempt
from tests.objectstore import storeutil
from tests import faketime


# The holder: prepares an attempt at step 3 of argv[1] and prints its
# directory and its own time.time(). "live": renews the lease (what a save
# does) every 0.2 s until its stdin closes. "dead": rewrites the lease as
# written on another host (whose processes nobody here can see) and dies.
_HOLDER = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    from ckpt.commit import lease, protocol
    from ckpt.store import storage
    st = storage.Storage(sys.argv[1])
    token = "f00d" + sys.argv[3]
    rel = protocol.prepare(st, 3, token)
    def write(data):
      st.write_bytes(rel + "/attempt.json", data)
    if sys.argv[2] == "dead":
      doc = json.loads(lease.make(token))
      doc["host"] += "-elsewhere"
      write(json.dumps(doc).encode())
      print(rel, time.time(), flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()),
                     daemon=True).start()
    print(rel, time.time(), flush=True)
    n = 0
    while not done.wait(0.2):
      n += 1
      write(lease.make(token, n))
""")

OFFSETS = {"behind": ("-2m", -120.0), "ahead": ("+1y", 365 * 86400.0)}


def _holder(url: str, mode: str, offset: str, tag: str):
  env = dict(os.environ, PYTHONPATH=os.getcwd(), LD_PRELOAD=faketime.LIBS[0],
             FAKETIME=OFFSETS[offset][0], FAKETIME_DONT_FAKE_MONOTONIC="1")
  t0 = time.time()
  proc = subprocess.Popen([sys.executable, "-c", _HOLDER, url, mode, tag],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          env=env, text=True)
  line = proc.stdout.readline().split()
  assert len(line) == 2, (line, proc.wait(30))
  rel, their_time = line[0], float(line[1])
  skew = their_time - t0
  want = OFFSETS[offset][1]  # the holder's clock is off as asked
  assert abs(skew - want) < 60, (skew, want)
  return proc, rel


def _state(step: int) -> dict:
  return {"w": np.full(256, step, np.float32)}


def _exists(url: str, rel: str, is_disk: bool) -> bool:
  if is_disk:
    return os.path.isdir(os.path.join(url, rel))
  return storeutil.read_key(url, f"{rel}/{attempt.ATTEMPT_FILE}") is not None


@pytest.fixture(params=["disk", "s3"])
def root(request, tmp_path):
  if request.param == "disk":
    return str(tmp_path / "ckpts"), True
  return request.getfixturevalue("s3_bucket") + "/clock", False


@faketime.needs_faketime
def test_a_live_holder_behind_keeps_its_attempt(root):
  """The holder's clock is 2 minutes behind; it renews every 0.2 s; saves
  with lease_s=1.5 over 2 s never take its attempt."""
  url, is_disk = root
  proc, rel = _holder(url, "live", "behind", "01")
  try:
    with ckpt.Checkpointer(url, async_save=False, lease_s=1.5) as c:
      t0 = time.monotonic()
      for step in (1, 2, 3):
        if step > 1:
          time.sleep(0.8)
        assert c.save(step if step < 3 else 4, _state(step))
        assert _exists(url, rel, is_disk), (
            f"the live attempt {rel} was removed after "
            f"{time.monotonic() - t0:.1f} s")
  finally:
    proc.stdin.close()
    proc.wait(30)


@faketime.needs_faketime
@pytest.mark.parametrize("cleaner", ["save", "gc"])
def test_a_dead_holder_ahead_is_removed(root, cleaner):
  """The holder's clock is a year ahead and it died on "another host": its
  attempt goes once nothing renewed it for lease_s (by a save, or by ``ckpt
  gc --yes``, which watches a bucket's leases)."""
  url, is_disk = root
  if cleaner == "gc" and is_disk:
    pytest.skip("gc on a disk reads the file system's times (as before)")
  proc, rel = _holder(url, "dead", "ahead", "02")
  proc.wait(30)
  if cleaner == "gc":
    assert cli.main(["gc", url, "--tmp-min-age", "1", "--yes"]) == 0
  else:
    with ckpt.Checkpointer(url, async_save=False, lease_s=0.5) as c:
      assert c.save(1, _state(1))
      time.sleep(0.6)
      assert c.save(2, _state(2))
  assert not _exists(url, rel, is_disk), f"{rel} is still there"
