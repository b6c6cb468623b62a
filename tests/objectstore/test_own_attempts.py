"""A Checkpointer removes its own failed attempts at its next save, whatever
the lease rule says (ckpt/face/saver.py), on moto behind
tests/objectstore/httpproxy.py.

The store goes away (``down()``: connections reset, new ones refused) while
a save uploads: the save fails, and so does the removal of its attempt (the
store is still down). The store comes back, and the same Checkpointer saves
again: nothing of the failed attempt is left in the bucket, though its
lease (``lease_s`` 600 s) is far from expired and its holder, this process,
is alive. Before, the next save left it (a lease first seen then is not
old), and only another process's cleanup (whose holder check finds this
one dead) or one ``lease_s`` later removed it.
"""

from __future__ import annotations

import time
import urllib.parse

import numpy as np
import pytest

import ckpt
from tests.objectstore import storeutil
from tests.objectstore.httpproxy import HttpProxy

# Requests fail fast while the store is down (the save fails by its errors,
# not by its deadline, which would leave writes in flight).
FAST_RETRIES = {"max_retries": 2, "initial_delay": "0.1s", "max_delay": "0.2s"}


def _state(step: int, nbytes: int) -> dict:
  return {"w": np.random.default_rng(step).random(nbytes // 4, np.float32),
          "n": np.int64(step)}


def _wait_for(predicate, what: str, timeout_s: float = 30.0) -> None:
  deadline = time.monotonic() + timeout_s
  while not predicate():
    assert time.monotonic() < deadline, what
    time.sleep(0.05)


def _outage(s3_server, url: str, options: dict, **kwargs):
  """A Checkpointer through a 256 KiB/s proxy: step 1 saved, then the
  store goes away while step 2 uploads (2 MiB, 8 s), and comes back once
  that save failed. Returns (proxy, checkpointer, the failure, the keys
  of step 2 then)."""
  t = urllib.parse.urlsplit(s3_server.endpoint)
  px = HttpProxy((t.hostname, t.port), rate=256 << 10).start()
  c = ckpt.Checkpointer(url, lease_s=600.0, chunk_bytes=256 << 10,
                        storage_options={"endpoint": px.endpoint, **options},
                        **kwargs)
  c.save(1, _state(1, 64 << 10))
  c.wait_until_finished()
  c.save(2, _state(2, 2 << 20))
  _wait_for(lambda: any(r[1] == "PUT" and r[3] >= 256 << 10
                        for r in px.requests), "no upload started")
  px.down()
  with pytest.raises(ckpt.CheckpointError) as failure:
    c.wait_until_finished()
  left = [k for k in storeutil.keys(url) if k.startswith("checkpoint_2/")]
  px.up()
  return px, c, failure.value, left


def _nothing_left_of_step_2(url: str, c: ckpt.Checkpointer, left: list):
  keys = storeutil.keys(url)
  print(f"\nafter the outage: {len(left)} keys of the failed attempt; "
        f"after the next save: {keys}")
  assert not [k for k in keys if k.startswith(("checkpoint_2/",
                                               "pending/2"))], keys
  assert c.all_steps() == [1, 3]
  assert int(c.restore(3)["n"]) == 3


def test_a_failed_attempt_goes_at_the_next_save_of_its_checkpointer(
    s3_server, s3_bucket):
  """The save fails by its requests' errors (few retries): the attempt
  it could not remove goes at the next save (2 MiB, 8 s through the
  proxy), and so do the chunks of the failed save that TensorStore still
  sent once the store was back (seen: one, after the removal at the start
  of the next save, so the next save removes the attempt again as it
  ends)."""
  url = f"{s3_bucket}/own"
  px, c, error, left = _outage(s3_server, url,
                               {"s3_request_retries": FAST_RETRIES})
  try:
    assert not isinstance(error, ckpt.StoreTimeoutError), error
    assert left  # the failed attempt, which could not be removed then
    c.save(3, _state(3, 2 << 20))
    c.wait_until_finished()
    _nothing_left_of_step_2(url, c, left)
  finally:
    c.close()
    px.close()


def test_an_attempt_failed_at_its_deadline_goes_once_its_writes_ended(
    s3_server, s3_bucket):
  """The save fails at its deadline (3 s), leaving its writes in flight
  inside TensorStore, which retries them (1, 2, 4, 8 s apart) until the
  store is back. The next save (4 MiB, about 16 s through the proxy)
  removes the attempt as it starts and again as it ends: no late write
  is left after it."""
  url = f"{s3_bucket}/own-deadline"
  px, c, error, left = _outage(s3_server, url, {}, save_timeout_s=3.0)
  try:
    assert isinstance(error, ckpt.StoreTimeoutError), error
    c.save(3, _state(3, 4 << 20))
    c.wait_until_finished()
    _nothing_left_of_step_2(url, c, left)
  finally:
    c.close()
    px.close()
