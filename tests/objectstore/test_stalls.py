"""Deadlines bound stalls, not size (ckpt/store/deadline.py).

A save or a restore through a store that is slow but answers (the proxy of
tests/objectstore/proxy.py throttled to a steady rate) goes on for several
times its bound and completes: the bound is the time without progress, and
every request that completes is progress. A store that stops answering
(the proxy black-holes) fails the same operations one bound after their
last progress, the message saying what stalled and for how long; a
restore's reads too (before, they waited as long as curl, forever against
a black hole).

The numbers: requests of ``CHUNK`` bytes, at most 32 at once (TensorStore's
default), through ``RATE`` bytes/s: a round of concurrent requests takes
32 * CHUNK / RATE = 0.7 s, well inside the bound of 2 s; the whole state
takes about 3 s to go through, the bound 2 s.
"""

from __future__ import annotations

import time

import numpy as np

import ckpt
from tests.objectstore.storeutil import in_thread

BOUND_S = 2.0
RATE = 1.5e6  # bytes/s, both directions together
CHUNK = 32 * 1024
STATE = {f"a{i}": np.random.default_rng(i).random(128 * 1024, np.float32)
         for i in range(8)}  # 4 MiB: incompressible
NBYTES = sum(a.nbytes for a in STATE.values())
SLACK_S = 4.0  # between a stall reaching its bound and the caller's error
OPTS = {"save_timeout_s": BOUND_S, "query_timeout_s": BOUND_S,
        "chunk_bytes": CHUNK}


def check_stalled(error, seconds: float, head: str, option: str) -> None:
  assert isinstance(error, ckpt.StoreTimeoutError), repr(error)
  message = str(error)
  assert message.startswith(f"{head} stalled: nothing it waited for from the "
                            "store completed for "), message
  stalled = float(message.split("completed for ")[1].split(" s")[0])
  assert BOUND_S <= stalled < BOUND_S + SLACK_S, message
  assert (f"more than the {BOUND_S:g} s allowed without progress"
          in message), message
  assert f"Checkpointer argument {option}={BOUND_S:g}" in message, message
  assert BOUND_S - 0.5 < seconds < BOUND_S + SLACK_S, (seconds, message)


def test_a_slow_store_commits_a_save_longer_than_its_bound(proxied):
  """Throttled: the save and the restore each take longer than the bound
  (checked), and both complete; the restored data is the saved data."""
  px, url = proxied
  ckptr = ckpt.Checkpointer(url, async_save=False, **OPTS)
  ckptr.save(1, {"n": 1})  # the bucket's first keys, at full speed
  px.throttle(RATE)
  t0 = time.monotonic()
  saving = in_thread(ckptr.save, 2, STATE)
  error, save_s = saving(60, "save(2) through the throttled store")
  assert error is None, error
  print(f"save: {NBYTES / 2**20:.1f} MiB in {save_s:.1f} s at "
        f"{RATE / 1e6:g} MB/s, bound {BOUND_S:g} s")
  assert save_s > 1.2 * BOUND_S, save_s  # else it proves nothing
  assert ckptr.latest_step() == 2
  out = {}
  restoring = in_thread(lambda: out.update(ckptr.restore(2)))
  error, restore_s = restoring(60, "restore(2) through the throttled store")
  assert error is None, error
  print(f"restore: {restore_s:.1f} s")
  assert restore_s > 1.2 * BOUND_S, restore_s
  for k, v in STATE.items():
    np.testing.assert_array_equal(out[k], v)
  print(f"both took {time.monotonic() - t0:.1f} s")
  ckptr.close()


def test_a_stopped_store_fails_a_save_and_a_restore_at_the_bound(proxied):
  """Black hole mid-save and before a restore's reads: both fail one bound
  after their last progress, naming what stalled and for how long."""
  px, url = proxied
  ckptr = ckpt.Checkpointer(url, **OPTS)
  ckptr.save(1, STATE)
  ckptr.wait_until_finished()
  reader = ckpt.Checkpointer(url, **OPTS)
  # The reader chose its step and opened its arrays; its reads are all
  # that is left when the store stops (restore(lazy=True) reads nothing).
  lazy = reader.restore(1, lazy=True)
  px.throttle(RATE)
  ckptr.save(2, STATE)  # returns once staged; writes in flight
  px.black_hole()
  waiting = in_thread(ckptr.wait_until_finished)
  reading = in_thread(lambda: [leaf.read() for leaf in lazy.values()
                               if hasattr(leaf, "read")])
  error, seconds = waiting(BOUND_S + SLACK_S + 10, "wait_until_finished()")
  print(f"save: raised after {seconds:.1f} s: {error}")
  check_stalled(error, seconds, f"writing step 2 to {url!r}", "save_timeout_s")
  error, seconds = reading(BOUND_S + SLACK_S + 10, "lazy reads")
  print(f"reads: raised after {seconds:.1f} s: {error}")
  check_stalled(error, seconds, f"reading step 1 from {url!r}",
                "query_timeout_s")
  ckptr.close()
  reader.close()
