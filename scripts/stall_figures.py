"""The figures of issue 44 items 2 and 3 at the issue's own scale, against a
moto S3 server behind tests/objectstore/httpproxy.py (the tests use the
same parts scaled down to seconds):

- ``swallow``: a store that swallows uploads above 1 MiB and answers the
  rest; ``save_timeout_s=15``, ``lease_s=30`` (a renewal every 5 s), a
  64 MiB save in 16 MiB chunks: how long until the save fails;
- ``slow``: a healthy store capped at 1 MiB/s; the same bound, 32 MiB in
  16 MiB chunks (two requests of about 32 s each in flight), saved and
  restored with ``save_timeout_s=15`` and ``query_timeout_s=15``:
  outcome and duration of each;
- ``gaps``: 1 MiB/s, 24 MiB in 256 chunks of 96 KiB (TensorStore's queue
  of 32 uploads full all along), ``lease_s=30``: the largest gap between
  two versions of the lease seen directly on moto.

Usage::

  python -m scripts.stall_figures [swallow] [slow] [gaps]

Each prints one line. About 20 s, 70 s and 30 s (the swallowing store's
save is given at most ``LIMIT_S``: before issue 44 it never ended).
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
import urllib.parse

import numpy as np
import tensorstore as ts

import ckpt
from ckpt.store import urls
from tests.objectstore import servers
from tests.objectstore.httpproxy import HttpProxy

MIB = 1 << 20
LIMIT_S = 150.0  # how long the swallowing store's save is given


def _state(nbytes: int) -> dict:
  return {"w": np.random.default_rng(0).random(nbytes // 4, np.float32)}


def swallow(server, bucket: str) -> None:
  with HttpProxy(_target(server), swallow_above=MIB) as px:
    c = ckpt.Checkpointer(f"{bucket}/swallow", async_save=False,
                          save_timeout_s=15, lease_s=30, chunk_bytes=16 * MIB,
                          storage_options={"endpoint": px.endpoint})
    t0 = time.monotonic()
    out = []

    def save() -> None:
      try:
        c.save(1, _state(64 * MIB))
        out.append("committed (wrong)")
      except ckpt.CheckpointError as e:
        out.append(type(e).__name__)
    thread = threading.Thread(target=save, daemon=True)
    thread.start()
    thread.join(LIMIT_S)
    outcome = out[0] if out else "no end"
    renewals = sum(1 for r in px.requests if r[1] == "PUT"
                   and r[2].endswith("/attempt.json")) - 1
    print(f"swallow: {outcome} after {time.monotonic() - t0:.1f} s "
          f"(save_timeout_s=15, {px.swallowed} uploads swallowed, "
          f"{renewals} lease renewals answered)", flush=True)


def slow(server, bucket: str) -> None:
  state = _state(32 * MIB)
  with HttpProxy(_target(server), rate=MIB) as px:
    c = ckpt.Checkpointer(f"{bucket}/slow", async_save=False,
                          save_timeout_s=15, query_timeout_s=15, lease_s=30,
                          chunk_bytes=16 * MIB,
                          storage_options={"endpoint": px.endpoint})
    for what, call in (("save", lambda: c.save(1, state)),
                       ("restore", lambda: c.restore(1))):
      t0 = time.monotonic()
      try:
        got = call()
        outcome = "ok"
        if what == "restore" and not np.array_equal(got["w"], state["w"]):
          outcome = "WRONG DATA"
      except ckpt.CheckpointError as e:
        outcome = f"{type(e).__name__}: {str(e)[:120]}"
      print(f"slow {what}: {outcome} in {time.monotonic() - t0:.1f} s "
            "(32 MiB in 16 MiB chunks through 1 MiB/s, bound 15 s)",
            flush=True)
    c.close()


def gaps(server, bucket: str) -> None:
  url = f"{bucket}/gaps"
  changes: list[float] = []
  stop = threading.Event()

  def watch() -> None:
    spec, _ = urls.kvstore_for_url(url)
    kv = ts.KvStore.open(spec, context=ts.Context(
        {"s3_request_concurrency": {"limit": 4}})).result()
    last = None
    while not stop.wait(0.05):
      keys = [k.decode() for k in kv.list().result()]
      lease = [k for k in keys if k.endswith("/attempt.json")]
      if lease:
        r = kv.read(lease[0]).result()
        data = None if r.state == "missing" else bytes(r.value)
        if data is not None and data != last:
          changes.append(time.monotonic())
        last = data

  with HttpProxy(_target(server), rate=MIB) as px:
    c = ckpt.Checkpointer(url, lease_s=30, chunk_bytes=96 << 10,
                          storage_options={"endpoint": px.endpoint})
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    t0 = time.monotonic()
    c.save(1, _state(24 * MIB))
    c.wait_until_finished()
    took = time.monotonic() - t0
    stop.set()
    thread.join(10)
    c.close()
  found = [b - a for a, b in zip(changes, changes[1:])]
  print(f"gaps: 24 MiB in 256 chunks through 1 MiB/s took {took:.1f} s; "
        f"largest gap between lease versions {max(found, default=0):.1f} s "
        f"(lease_s=30, renewal every 5 s; {len(changes)} versions)",
        flush=True)


def _target(server) -> tuple[str, int]:
  t = urllib.parse.urlsplit(server.endpoint)
  return t.hostname, t.port


def main(argv: list[str]) -> None:
  parts = argv or ["swallow", "slow", "gaps"]
  server = servers.start_moto(tempfile.mkdtemp())
  try:
    os.environ.update(server.env)
    for part in parts:
      {"swallow": swallow, "slow": slow, "gaps": gaps}[part](
          server, servers.new_bucket(server))
  finally:
    server.stop()


if __name__ == "__main__":
  main(sys.argv[1:])
