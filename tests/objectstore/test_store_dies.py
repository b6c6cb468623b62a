"""A store that dies while a save runs: the save, and a new Checkpointer's
discovery, fail within their bounds (``save_timeout_s``,
``query_timeout_s``), naming the operation, the URL, the step and the
option; a multi-process job fails together; the failed attempt stays where
cleanup finds it.

Real parts: the session's moto server, and a TCP proxy on 127.0.0.1
(tests/objectstore/proxy.py) between it and ckpt, killed right after an
async ``save()`` returned, two ways: it refuses connections (a crashed
server: each request is retried with backoff, about 80 s, by TensorStore)
or it accepts them and never answers (a hung server: curl waits forever).

Measured before these bounds existed (the same scenario, run by hand):
refused, ``wait_until_finished()`` raised after 162 s and a new
Checkpointer's ``latest_step()`` after 81 s; black hole, neither had
answered after 400 s. Every test here waits in a daemon thread with a limit,
so on such code it fails at that limit instead of hanging.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import ckpt
from ckpt.multihost import local_cluster
from tests.multiprocess import worker
from tests.objectstore import deadstore_worker
from tests.objectstore import proxy as proxy_lib
from tests.objectstore import servers
from tests.objectstore import storeutil
from tests.objectstore.storeutil import in_thread

SMALL = {"w": np.arange(5000, dtype=np.float32), "n": 3}
# Several arrays of 1 MiB chunks: writes are in flight when the proxy dies.
BIG = {f"a{i}": np.full((512, 1024), i, np.float32) for i in range(8)}
SAVE_BOUND_S = 10.0
QUERY_BOUND_S = 8.0
# What may pass between a deadline and the error reaching the caller (the
# loop and worker threads of a 2-core machine under load).
SLACK_S = 4.0
BOUNDS = {"save_timeout_s": SAVE_BOUND_S, "query_timeout_s": QUERY_BOUND_S}
FLAVOURS = ["refuse", "black_hole"]


def settle_store(url: str, limit_s: float = 60.0) -> None:
  """Waits (bounded) until a fresh Checkpointer's listing of ``url``
  answers within 2 s: the store serves this process again."""
  end = time.monotonic() + limit_s
  while time.monotonic() < end:
    with ckpt.Checkpointer(url, query_timeout_s=2.0) as c:
      try:
        c.all_steps()
        return
      except ckpt.StoreTimeoutError:
        continue
  pytest.fail(f"{url} did not answer again within {limit_s} s")


def check_timeout(error, seconds: float, bound_s: float, head: str,
                  option: str):
  """``error`` is the StoreTimeoutError of a wait that ran to its bound:
  raised after about ``bound_s``, naming the operation and the URL
  (``head``), the bound and its option."""
  assert isinstance(error, ckpt.StoreTimeoutError), repr(error)
  assert isinstance(error, ckpt.CheckpointError)
  message = str(error)
  assert (f"{head} stalled: nothing it waited for from the store completed "
          "for ") in message, message
  assert f"more than the {bound_s:g} s allowed without progress" in message, (
      message)
  assert f"Checkpointer argument {option}={bound_s:g}" in message, message
  assert bound_s - 1.0 < seconds < bound_s + SLACK_S, (seconds, message)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_store_dies_after_save_returned(proxied, flavour):
  """The proxy dies right after an async save() returned: its
  wait_until_finished(), a synchronous save of another Checkpointer, and
  a new Checkpointer's latest_step() and restore() all fail within their
  bounds (at the same time: the test takes one bound)."""
  px, url = proxied
  ckptr = ckpt.Checkpointer(url, **BOUNDS)
  other = ckpt.Checkpointer(url, async_save=False, **BOUNDS)
  ckptr.save(1, SMALL)
  ckptr.wait_until_finished()
  ckptr.save(2, BIG)
  getattr(px, flavour)()
  waiting = in_thread(ckptr.wait_until_finished)
  saving = in_thread(other.save, 5, SMALL)
  asking = in_thread(lambda: ckpt.Checkpointer(url, **BOUNDS).latest_step())
  restoring = in_thread(lambda: ckpt.Checkpointer(url, **BOUNDS).restore())
  limit = SAVE_BOUND_S + SLACK_S + 5
  error, seconds = waiting(limit, "wait_until_finished()")
  print(f"{flavour}: wait_until_finished() raised after {seconds:.1f} s")
  check_timeout(error, seconds, SAVE_BOUND_S, f"writing step 2 to {url!r}",
                "save_timeout_s")
  # A save that starts on the dead store: its prepare (process 0's first
  # requests, on the caller's thread) is inside the bound too.
  error, seconds = saving(limit, "save(5)")
  print(f"{flavour}: save(5) raised after {seconds:.1f} s")
  check_timeout(error, seconds, SAVE_BOUND_S, f"writing step 5 to {url!r}",
                "save_timeout_s")
  error, seconds = asking(limit, "latest_step() of a new Checkpointer")
  print(f"{flavour}: latest_step() raised after {seconds:.1f} s")
  check_timeout(error, seconds, QUERY_BOUND_S,
                f"listing the steps of {url!r}", "query_timeout_s")
  error, seconds = restoring(limit, "restore() of a new Checkpointer")
  check_timeout(error, seconds, QUERY_BOUND_S,  # its choice of step
                f"listing the steps of {url!r}", "query_timeout_s")
  # The failure was reported once; close() returns.
  ckptr.close()
  other.close()
  # The store comes back: the requests abandoned at the bounds end now
  # instead of holding TensorStore's request slots (and the process's
  # connections) for their retries while the next tests run.
  px.resume()
  settle_store(url)


def test_a_request_that_failed_before_the_deadline_is_named(proxied):
  """The store refuses; each request gives up after its retries (about
  3 s here), and the removal of the failed attempt, refused too, after
  about as long again: both well before the save's bound (10 s), so the
  write's error is the one raised (with retries of 6 s, write plus removal
  came to 8-12 s, and the deadline's error replaced it). A
  refusing store answers (its answers are not a stall), so the save fails
  with the request's own error, naming the refusal, within the bound and
  its slack; the removal of the failed attempt, refused too, is logged and
  left to the next save's cleanup."""
  px, url = proxied
  slow = {"s3_request_retries": {"max_retries": 2, "initial_delay": "1s",
                                 "max_delay": "1s"}}
  settle_store(url)  # requests an earlier test abandoned have ended
  ckptr = ckpt.Checkpointer(url, storage_options=slow, **BOUNDS)
  ckptr.save(1, SMALL)
  ckptr.wait_until_finished()
  ckptr.save(2, BIG)
  px.refuse()
  waiting = in_thread(ckptr.wait_until_finished)
  error, seconds = waiting(SAVE_BOUND_S + SLACK_S + 5, "wait_until_finished()")
  print(f"wait_until_finished() raised after {seconds:.1f} s: {error}")
  assert isinstance(error, ckpt.CheckpointError), repr(error)
  assert "step 2" in str(error), error
  assert "All 2 retry attempts failed" in str(error), error
  assert seconds < SAVE_BOUND_S + SLACK_S, (seconds, error)
  ckptr.close()
  px.resume()
  settle_store(url)


def test_next_save_after_the_store_came_back(proxied):
  """The store comes back after a save failed at its deadline: a NEW
  Checkpointer's next save succeeds, the failed attempt is recorded where
  cleanup finds it (its pending/ record is there), and that save's cleanup
  removes its keys. The failed attempt's holder is this (live) process, so
  its lease has to expire first: the new Checkpointer's lease_s is 2 s
  (a restarted job removes it at once: its holder is dead, see
  tests/objectstore/test_commit.py). Writes abandoned at the deadline may
  still land once the store is back: the test lets them settle first (a
  write landing after the cleanup would leave keys no record names: a
  known limit, docs/object-stores.md)."""
  px, url = proxied
  settle_store(url)  # requests an earlier test abandoned have ended
  # Bounded retries: the requests this save abandons at its deadline end
  # (land or fail) within a few seconds of the store's return, so the wait
  # below sees them settle. With TensorStore's default retries (up to 32,
  # backing off to 32 s), .zarray PUTs were seen landing after that wait,
  # and that run's cleanup left the whole failed attempt (a late write of
  # its lease would make it look alive: a leak a later save removes, not a
  # loss; inferred, not traced).
  quick = {"s3_request_retries": {"max_retries": 3, "initial_delay": "0.2s",
                                  "max_delay": "0.5s"}}
  ckptr = ckpt.Checkpointer(url, save_timeout_s=5.0, query_timeout_s=5.0,
                            storage_options=quick)
  ckptr.save(1, SMALL)
  ckptr.wait_until_finished()
  ckptr.save(2, BIG)
  px.black_hole()
  with pytest.raises(ckpt.StoreTimeoutError):
    ckptr.wait_until_finished()
  ckptr.close()
  px.resume()
  failed = [k for k in storeutil.keys(url)
            if k.startswith(("checkpoint_2/", "pending/2."))]
  print("keys of the failed step 2 when the store came back:", failed)
  if failed and not any(k.startswith("pending/2.") for k in failed):
    pytest.fail(f"the failed attempt's keys {failed} have no pending/ "
                "record: no cleanup would ever find them")
  # Requests abandoned at the deadline go on inside TensorStore and may land
  # now that the store answers (seen: a .zarray PUT after the cleanup): let
  # them settle first (bounded), else their keys would outlive the cleanup.
  settled, last, deadline = time.monotonic(), None, time.monotonic() + 30
  while time.monotonic() < deadline and time.monotonic() - settled < 3.0:
    now = sorted(k for k in storeutil.keys(url) if k.startswith("checkpoint_2/"))
    if now != last:
      settled, last = time.monotonic(), now
    time.sleep(0.1)
  # Lease ages are the cleaner's own clock (docs/object-stores.md): the
  # first save sees the failed attempt's lease, and the next one, lease_s
  # later with the lease unchanged, removes it.
  fresh = ckpt.Checkpointer(url, lease_s=2.0)
  fresh.save(3, SMALL)
  fresh.wait_until_finished()
  time.sleep(2.5)  # the failed save renews its lease no more
  fresh.save(4, SMALL)
  fresh.wait_until_finished()
  if fresh.all_steps() != [1, 3, 4]:
    pytest.fail(f"steps after the store came back: {fresh.all_steps()}")
  left = [k for k in storeutil.keys(url)
          if k.startswith(("checkpoint_2/", "pending/2."))]
  print("keys of the failed step 2 after the next save:", left)
  fresh.close()
  assert left == [], f"the next save left the failed attempt's keys {left}"


def test_a_job_fails_together_when_one_process_loses_the_store(
    s3_server, restore_environ, tmp_path):
  """2 processes; process 1 reaches the store through the proxy, which
  black-holes before step 2: process 1 gives up at its deadline and says
  so at the "written" barrier, where process 0 (whose store answers) hears
  it: both fail within the bound, and the attempt (into which process 1
  may still have writes in flight) is left for cleanup, not removed."""
  del restore_environ
  os.environ.update(s3_server.env)
  url = f"{servers.new_bucket(s3_server)}/run"
  target = ("127.0.0.1", int(s3_server.endpoint.rsplit(":", 1)[1]))
  sync = tmp_path / "sync"
  sync.mkdir()
  with proxy_lib.Proxy(target) as px:
    cluster = local_cluster.start(
        "tests.objectstore.deadstore_worker",
        {"url": url, "proxy": px.endpoint, "bound": SAVE_BOUND_S,
         "sync": os.fspath(sync)},
        num_processes=2, devices_per_process=2, cwd=servers.REPO)
    # Ends the processes itself if they do not get there.
    cluster.wait_for_files([sync / "saved_0", sync / "saved_1"], 120)
    before = px.accepted
    px.black_hole()
    (sync / "go").touch()
    results = local_cluster.check(cluster.wait(SAVE_BOUND_S + SLACK_S + 60))
  assert before > 0  # process 1's requests did go through the proxy
  by_process = {r.process: r.save for r in (
      worker.decode(deadstore_worker.Result, r) for r in results)}
  print(by_process)
  one, zero = by_process[1].error, by_process[0].error
  assert one is not None and one.type == "StoreTimeoutError", one
  assert one.msg.startswith(f"writing step 2 to {url!r} stalled: "), one
  assert f"the {SAVE_BOUND_S:g} s allowed without progress" in one.msg
  assert zero is not None and zero.type == "CheckpointError", zero
  assert ("failed on process(es) [1] before 'all processes wrote"
          in zero.msg), zero
  assert (f"process 1: StoreTimeoutError: writing step 2 to {url!r} "
          "stalled: ") in zero.msg, zero
  assert "save_timeout_s=" in zero.msg
  for save in by_process.values():
    assert save.seconds < SAVE_BOUND_S + SLACK_S, save
  keys = storeutil.keys(url)
  assert "commits/2" not in keys
  assert [k for k in keys if k.startswith("pending/2.")], keys


def test_bounds_are_checked():
  for name in ("save_timeout_s", "query_timeout_s"):
    for bad in (0, -5, float("inf"), float("nan"), True, "60"):
      with pytest.raises(ValueError, match=f"{name} must be a positive"):
        ckpt.Checkpointer("memory://bounds", **{name: bad})
  c = ckpt.Checkpointer("memory://bounds", save_timeout_s=None,
                        query_timeout_s=2)
  assert (c.save_timeout_s, c.query_timeout_s) == (None, 2.0)
  c.close()
  c = ckpt.Checkpointer("memory://bounds")
  assert (c.save_timeout_s, c.query_timeout_s) == (120.0, 60.0)
  c.close()
