"""A deadline counts the operation's own data, not the process's requests
(ckpt/store/deadline.py), through tests/objectstore/httpproxy.py in front
of moto.

- A store that swallows large uploads and answers small requests: the
  save's lease renewals (one a second here) are answered, its chunks never
  are. The save fails one bound after its last byte went out (before, each
  renewal counted as progress: with save_timeout_s=15 no end after 150 s).
- A store capped at ``RATE``, slower than one request per bound: each
  chunk takes longer than the bound to go up or come down, and no lease
  renewal happens during the save (``lease_s`` 600 s). The save and the
  restore still complete: the bytes of their requests in flight are
  progress (before, both failed at the bound, no request having completed).

The scale: the issue's 16 MiB requests at 1 MiB/s against a 15 s bound,
made 768 KiB at 256 KiB/s against 2 s (one chunk alone takes 3 s, the two
together 6 s).
"""

from __future__ import annotations

import time
import urllib.parse

import numpy as np

import ckpt
from tests.objectstore.httpproxy import HttpProxy
from tests.objectstore.storeutil import in_thread

BOUND_S = 2.0
SLACK_S = 4.0  # between a stall reaching its bound and the caller's error


def _target(s3_server) -> tuple[str, int]:
  t = urllib.parse.urlsplit(s3_server.endpoint)
  return t.hostname, t.port


def _state(nbytes: int, seed: int) -> dict:
  # incompressible, so every byte crosses the proxy
  return {"w": np.random.default_rng(seed).random(nbytes // 4, np.float32)}


def test_a_store_that_swallows_uploads_fails_the_save_at_the_bound(
    s3_server, s3_bucket):
  """Chunks of 64 KiB swallowed, everything under 32 KiB answered (the
  lease, renewed every second, the pending record, the array metadata):
  the save fails about one bound after its uploads went out, naming the
  stall, while the renewals went on answered."""
  with HttpProxy(_target(s3_server), swallow_above=32 << 10) as px:
    c = ckpt.Checkpointer(f"{s3_bucket}/swallow", async_save=False,
                          save_timeout_s=BOUND_S, lease_s=6.0,
                          chunk_bytes=64 << 10,
                          storage_options={"endpoint": px.endpoint})
    t0 = time.monotonic()
    saving = in_thread(c.save, 1, _state(1 << 20, 1))
    error, seconds = saving(BOUND_S + 30, "save(1) through the swallowing "
                            "store")
    renewals = [t - t0 for t, method, path, _, _ in px.requests
                if method == "PUT" and path.endswith("/attempt.json")][1:]
    print(f"\nswallowing store: the save raised after {seconds:.1f} s "
          f"({px.swallowed} uploads swallowed, {px.forwarded} requests "
          f"answered, lease renewals at {[round(t, 1) for t in renewals]} "
          f"s): {error}")
    assert px.swallowed >= 1
    assert renewals, px.requests  # answered, and no progress of the save
    assert isinstance(error, ckpt.StoreTimeoutError), repr(error)
    assert str(error).startswith(f"writing step 1 to '{s3_bucket}/swallow' "
                                 "stalled"), error
    assert "save_timeout_s=2" in str(error), error
    assert seconds < BOUND_S + SLACK_S, seconds
    c.close()


def test_a_slow_steady_store_completes_a_save_and_a_restore(
    s3_server, s3_bucket):
  """256 KiB/s, chunks of 768 KiB (3 s each alone), bound 2 s, no lease
  renewal during the save: both complete, each longer than twice the
  bound, and the restored data is the saved data."""
  state = _state(3 << 19, 2)  # 1.5 MiB: two chunks
  with HttpProxy(_target(s3_server), rate=256 << 10) as px:
    c = ckpt.Checkpointer(f"{s3_bucket}/slow", async_save=False,
                          save_timeout_s=BOUND_S, query_timeout_s=BOUND_S,
                          lease_s=600.0, chunk_bytes=3 << 18,
                          storage_options={"endpoint": px.endpoint})
    saving = in_thread(c.save, 1, state)
    error, save_s = saving(60, "save(1) through the slow store")
    print(f"\nslow store: save {'ok' if error is None else error} in "
          f"{save_s:.1f} s")
    assert error is None, error
    assert save_s > 2 * BOUND_S, save_s  # else it proves nothing
    out = {}
    restoring = in_thread(lambda: out.update(c.restore(1)))
    error, restore_s = restoring(60, "restore(1) through the slow store")
    print(f"slow store: restore {'ok' if error is None else error} in "
          f"{restore_s:.1f} s")
    assert error is None, error
    assert restore_s > 2 * BOUND_S, restore_s
    np.testing.assert_array_equal(out["w"], state["w"])
    c.close()
