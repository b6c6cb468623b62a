"""Test helpers that look at a store directly, as a user's tools would.

``in_thread`` runs a call that may never answer with a limit on the wait;
``keys`` lists what is under a URL; ``copy_tree`` copies every object from
one URL to another (like ``gsutil cp -r`` / ``aws s3 cp --recursive``), key
by key through TensorStore, with no knowledge of ckpt's layout.
"""

from __future__ import annotations

import threading
import time

import pytest
import tensorstore as ts

from ckpt.store import urls


def kvstore(url: str) -> ts.KvStore:
  spec, _ = urls.kvstore_for_url(url)
  return ts.KvStore.open(spec).result()


def keys(url: str) -> list[str]:
  """Every key under ``url`` (relative to it), sorted."""
  return sorted(k.decode() for k in kvstore(url).list().result())


def copy_tree(src: str, dst: str) -> int:
  """Copies every object under ``src`` to the same key under ``dst``."""
  source, target = kvstore(src), kvstore(dst)
  names = [k.decode() for k in source.list().result()]
  reads = [(k, source.read(k)) for k in names]
  writes = [target.write(k, r.result().value) for k, r in reads]
  for w in writes:
    w.result()
  return len(names)


def write_key(url: str, key: str, data: bytes) -> None:
  kvstore(url).write(key, data).result()


def delete_key(url: str, key: str) -> None:
  kvstore(url).write(key, None).result()


def read_key(url: str, key: str) -> bytes | None:
  r = kvstore(url).read(key).result()
  return None if r.state == "missing" else bytes(r.value)


def in_thread(fn, *args):
  """Runs ``fn(*args)`` on a daemon thread: ``finish(limit_s)`` gives
  (exception or None, seconds) or fails the test after ``limit_s``, so
  code that never answers fails here instead of hanging the suite."""
  out = {}
  t0 = time.monotonic()

  def run():
    try:
      fn(*args)
      out["error"] = None
    except BaseException as e:  # pylint: disable=broad-except
      out["error"] = e
    out["seconds"] = time.monotonic() - t0

  thread = threading.Thread(target=run, daemon=True)
  thread.start()

  def finish(limit_s: float, what: str):
    thread.join(max(0.0, limit_s - (time.monotonic() - t0)))
    if thread.is_alive():
      pytest.fail(f"{what} had not answered after {limit_s:.0f} s")
    return out["error"], out["seconds"]
  return finish
