"""A store that does not answer fails in bounded time, naming what failed.

Real parts only: an endpoint on 127.0.0.1 where nothing listens, a moto
server stopped after a save, and moto behind a proxy that stops answering.
Most tests retry briefly through storage_options (their point is the
error); one keeps ckpt's defaults and checks their bounds: 120 s for a
save, 60 s for a query, both without progress (ckpt/store/deadline.py), and about 80 s per request
with the bounds off, against TensorStore's 15 minutes. The bounds with a
store that dies mid-save, both ways, are in test_store_dies.py.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import time

import numpy as np
import pytest
import tensorstore as ts

import ckpt
from ckpt.multihost import local_cluster
from ckpt.store import storage as storage_lib
from tests.objectstore import proxy as proxy_lib
from tests.objectstore import servers

STATE = {"w": np.arange(5000, dtype=np.float32), "n": 3}
# Three attempts, milliseconds apart: a dead store fails at once.
QUICK = {"max_retries": 2, "initial_delay": "10ms", "max_delay": "50ms"}
QUICK_BOUND_S = 30.0
# ckpt's defaults give up after about 80 s (1+2+4+8+16+16+16+16 s of backoff).
DEFAULT_BOUND_S = 150.0
# Operations named in the errors (ckpt/store/storage.py).
OPERATION = r"(listing|reading|writing|deleting|checking) [^']*"
_OFFLINE = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
            "GCE_METADATA_ROOT": "127.0.0.1:9",
            "GCE_METADATA_HOST": "127.0.0.1:9"}


@pytest.fixture
def dead_endpoint(restore_environ) -> str:
  """``http://127.0.0.1:<port>`` with nothing listening; s3 and gcs point
  there through the standard variables."""
  del restore_environ
  endpoint = f"http://127.0.0.1:{local_cluster.free_port()}"
  for var in ("AWS_ENDPOINT_URL_S3", "STORAGE_EMULATOR_HOST"):
    os.environ.pop(var, None)
  os.environ.update(_OFFLINE, AWS_ENDPOINT_URL=endpoint,
                    TENSORSTORE_GCS_HTTP_URL=endpoint)
  return endpoint


def quick(scheme: str) -> dict:
  return {f"{'gcs' if scheme == 'gs' else 's3'}_request_retries": QUICK}


def fails_within(bound_s: float, url: str, fn, *args, **kwargs):
  """Runs ``fn``; checks it raises CheckpointError naming ``url`` and an
  operation on it, within ``bound_s``; returns (error, seconds)."""
  t0 = time.monotonic()
  with pytest.raises(ckpt.CheckpointError) as info:
    fn(*args, **kwargs)
  elapsed = time.monotonic() - t0
  message = str(info.value)
  assert re.search(OPERATION + re.escape(repr(url)) + " failed", message), message
  assert elapsed < bound_s, f"{fn} took {elapsed:.1f}s: {message}"
  return info.value, elapsed


def test_default_retries_and_overrides():
  """ckpt's retry defaults are in every context; storage_options win member
  by member (inline or under "context")."""
  def retries(url, opts=None):
    ctx = storage_lib.Storage(url, opts).context()
    return {k: ctx[k].to_json(include_defaults=True)
            for k in ("s3_request_retries", "gcs_request_retries")}
  default = {"max_retries": 8, "initial_delay": "1s", "max_delay": "16s"}
  assert storage_lib.STORE_RETRIES == default
  assert retries("s3://bkt/a") == {"s3_request_retries": default,
                                   "gcs_request_retries": default}
  got = retries("s3://bkt/a", {"s3_request_retries": {"max_retries": 3}})
  assert got["s3_request_retries"] == {**default, "max_retries": 3}
  got = retries("gs://bkt/a", {"context": {"gcs_request_retries": {
      "initial_delay": "100ms", "max_delay": "2s"}}})
  assert got["gcs_request_retries"] == {"max_retries": 8,
                                        "initial_delay": "100ms",
                                        "max_delay": "2s"}


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_nothing_listening(dead_endpoint, scheme):
  del dead_endpoint
  url = f"{scheme}://bkt/run"
  opts = quick(scheme)
  ckptr = ckpt.Checkpointer(url, async_save=False, storage_options=opts)
  error, _ = fails_within(QUICK_BOUND_S, url, ckptr.latest_step)
  assert "listing the steps of" in str(error)
  assert isinstance(error.__cause__, Exception)  # TensorStore's, chained
  assert "retry attempts failed" in str(error.__cause__)
  assert f"storage_options={{'{list(opts)[0]}'" in str(error)
  fails_within(QUICK_BOUND_S, url, ckptr.all_steps)
  fails_within(QUICK_BOUND_S, url, ckptr.restore)
  fails_within(QUICK_BOUND_S, url, ckptr.save, 1, STATE)
  fails_within(QUICK_BOUND_S, url, ckpt.load, url, storage_options=opts)
  ckptr.close()


def test_server_stopped_after_a_save(server_logs, restore_environ):
  """moto answers, a save commits, then the server dies: every call fails
  quickly with the URL and the operation."""
  del restore_environ
  server = servers.start_moto(server_logs)
  try:
    os.environ.update(server.env)
    url = f"{servers.new_bucket(server)}/run"
    opts = quick("s3")
    ckptr = ckpt.Checkpointer(url, async_save=False, storage_options=opts)
    later = ckpt.Checkpointer(url, async_save=True, storage_options=opts)
    ckptr.save(1, STATE)
    assert ckptr.latest_step() == 1
  finally:
    server.stop()
  fails_within(QUICK_BOUND_S, url, ckptr.latest_step)
  fails_within(QUICK_BOUND_S, url, ckptr.all_steps)
  fails_within(QUICK_BOUND_S, url, ckptr.restore)
  fails_within(QUICK_BOUND_S, url, ckptr.restore, 1)
  fails_within(QUICK_BOUND_S, url, ckpt.load, url, storage_options=opts)
  fails_within(QUICK_BOUND_S, url, ckptr.save, 2, STATE)

  def save_async():
    later.save(3, STATE)
    later.wait_until_finished()
  fails_within(QUICK_BOUND_S, url, save_async)
  ckptr.close()
  later.close()


def test_defaults_give_up_in_bounded_time(dead_endpoint, s3_server):
  """No bounds given: ckpt's defaults, all at once (the test takes the
  longest, 120 s, not their sum).

  - A save whose store dies right after save() returned (moto behind a
    proxy that black-holes: no request of it would ever end) fails
    save_timeout_s=120 s after its last progress, and a new Checkpointer's latest_step() within
    query_timeout_s=60 s (ckpt/store/deadline.py).
  - Nothing listening: latest_step() on s3 fails at the query bound; with
    the bound off (query_timeout_s=None), TensorStore's retries as ckpt
    sets them end a listing on gcs, and a data write through the context
    every Checkpointer uses, in about 80 s, not 15 minutes.
  """
  del dead_endpoint
  s3 = ckpt.Checkpointer("s3://bkt/run", async_save=False)
  gs = ckpt.Checkpointer("gs://bkt/run", async_save=False,
                         query_timeout_s=None)
  moto = ("127.0.0.1", int(s3_server.endpoint.rsplit(":", 1)[1]))
  px = proxy_lib.Proxy(moto).start()
  # Through the proxy by storage_options: the environment names the dead
  # endpoint (the credentials and region in it suit moto as well).
  opts = {"endpoint": px.endpoint}
  url = f"{servers.new_bucket(s3_server)}/run"
  saver = ckpt.Checkpointer(url, storage_options=opts)
  saver.save(1, STATE)
  saver.wait_until_finished()

  def write_array():
    spec = {"driver": "zarr3", "kvstore": s3.storage.step_spec("checkpoint_1/w"),
            "metadata": {"shape": [4], "data_type": "float32"}}
    t0 = time.monotonic()
    try:
      store = ts.open(spec, create=True, context=s3.storage.context()).result()
      store.write(np.zeros(4, np.float32)).result()
    except ValueError as e:
      return e, time.monotonic() - t0
    return None, time.monotonic() - t0

  def timed(fn):
    """(its CheckpointError or None, seconds from its start, the time it
    ended)."""
    t0 = time.monotonic()
    try:
      fn()
      error = None
    except ckpt.CheckpointError as e:
      error = e
    end = time.monotonic()
    return error, end - t0, end

  try:
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
      called = time.monotonic()
      saver.save(2, {"big": np.ones((1024, 1024), np.float32), **STATE})
      returned = time.monotonic()
      px.black_hole()
      save = pool.submit(timed, saver.wait_until_finished)
      query = pool.submit(
          timed, lambda: ckpt.Checkpointer(
              url, storage_options=opts).latest_step())
      s3_listing = pool.submit(timed, s3.latest_step)
      gs_listing = pool.submit(fails_within, DEFAULT_BOUND_S, gs.storage.url,
                               gs.latest_step)
      write = pool.submit(write_array)

      error, _, end = save.result()
      print(f"save: failed {end - returned:.2f} s after save() returned, "
            f"{end - called:.2f} s after it was called: {error}")
      assert isinstance(error, ckpt.StoreTimeoutError), error
      stalled = re.match(  # as measured: the bound, or more if woken late
          re.escape(f"writing step 2 to {url!r} stalled: nothing it waited "
                    "for from the store completed for ") + r"(\d+\.\d) s",
          str(error))
      assert stalled and float(stalled.group(1)) >= 119.95, error
      assert "the 120 s allowed without progress" in str(error), error
      assert "save_timeout_s=120" in str(error)
      # The bound is on stalls: 120 s from the save's last progress, at
      # most when the store stopped (just after save() returned), at least
      # its first request (inside save()), plus what the error takes to
      # reach the caller (milliseconds).
      assert 119 < end - called and end - returned < 121, (
          end - called, end - returned)
      for name, f in (("latest_step() of a new Checkpointer", query),
                      ("latest_step() on s3, nothing listening", s3_listing)):
        error, elapsed, _ = f.result()
        print(f"{name}: failed after {elapsed:.1f} s: {error}")
        assert isinstance(error, ckpt.StoreTimeoutError), error
        assert str(error).startswith("listing the steps of 's3://"), error
        assert "stalled: nothing it waited for from the store completed " \
            "for 60" in str(error), error
        assert "query_timeout_s=60" in str(error), error
        assert 59.5 < elapsed < 61, elapsed
      error, elapsed = gs_listing.result()
      assert "All 8 retry attempts failed" in str(error), error
      assert elapsed > 60, f"gave up after {elapsed:.1f}s, before the retries"
      error, elapsed = write.result()
      assert error is not None and "All 8 retry attempts failed" in str(error)
      assert elapsed < DEFAULT_BOUND_S, f"data write took {elapsed:.1f}s"
  finally:
    px.close()
  s3.close()
  gs.close()
  saver.close()
