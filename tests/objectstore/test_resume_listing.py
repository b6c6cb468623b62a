"""A restarted job's first calls list the root once (issue: latest_step()
then restore() listed it twice), and finding the latest of 1,000 committed
steps on a bucket is one listing of the flat records, well under a second.
Counted at the store: moto's access log (S3) and every listing ckpt makes
(both servers)."""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import pytest

import ckpt
from ckpt.commit import records
from ckpt.store import storage as storage_lib
from tests.objectstore.test_requests import count_requests

KW = dict(async_save=False)


@pytest.mark.parametrize("store", ["s3", "gs"])
@pytest.mark.parametrize("how", ["restore", "restore_async"])
def test_latest_step_then_restore_lists_once(store, how, s3_bucket,
                                             gs_bucket, listed):
  url = f"{s3_bucket if store == 's3' else gs_bucket}/resume"
  with ckpt.Checkpointer(url, **KW) as c:
    for s in (1, 2, 3):
      c.save(s, {"w": np.full(1000, s, np.float32)})
  with ckpt.Checkpointer(url, **KW) as restarted:
    listed.clear()
    latest = restarted.latest_step()
    got = (restarted.restore() if how == "restore" else
           restarted.restore_async().result())
    assert latest == 3 and restarted.last_restore_step == 3
    assert np.array_equal(got["w"], np.full(1000, 3, np.float32))
    assert listed == [records.RECORDS], listed
    # Later, or after a save, it lists again (nothing stale is trusted).
    restarted.save(4, {"w": np.full(1000, 4, np.float32)})
    listed.clear()
    assert restarted.restore()["w"][0] == 4
    assert restarted.last_restore_step == 4


def test_latest_of_a_thousand_steps_is_one_list_request(s3_server, s3_bucket):
  url = f"{s3_bucket}/thousand"
  with ckpt.Checkpointer(url, **KW) as c:
    c.save(1, {"w": np.zeros(10, np.float32)})
  storage = storage_lib.Storage(url)
  first = records.read_record(storage, 1)
  # 999 more records of committed steps (their data is step 1's: only the
  # listing is timed here).
  def put(s):
    storage.write_bytes(records.record_key(s), records.record(
        s, first["attempt"], first["dir"].replace("checkpoint_1",
                                                  f"checkpoint_{s}"),
        first["time"], first["metrics"]))
  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    list(pool.map(put, range(2, 1001)))
  with ckpt.Checkpointer(url, **KW) as restarted:
    t = time.perf_counter()
    assert restarted.latest_step() == 1000
    took = time.perf_counter() - t
  with ckpt.Checkpointer(url, **KW) as restarted:
    got = count_requests(s3_server, url, restarted.latest_step)
  # One listing of the flat records: two pages of at most 1,000 keys (the
  # 1,000 records and commits/complete), never a key per chunk or step
  # directory. The time is reported, not asserted (a shared machine).
  assert got["LIST"] <= 2 and got["GET"] <= 1, got
  print(f"latest of 1,000 steps: {took:.3f} s, requests {dict(got)}")
