"""What a read-once restore fetches from a bucket, counted at the store.

A counting proxy (tests/objectstore/proxy.py, ``HttpCounter``) sits
between the processes and the server (moto's S3, the GCS emulator) and
sums the bodies of every response to a GET, per object, parsed from the
HTTP streams: nothing ckpt or TensorStore counts. The worker
(tests/multiprocess/fetch_worker.py) saves five leaves whose shapes do not
divide evenly by the replica count or by their chunks, then restores them
read once onto R = 2 or 4 replica processes (one job per store and R).

Wanted (issue 24): the chunk objects fetched during the restore, over all
processes, at most 1.05x the stored bytes of those chunks, and everything
fetched at most that plus each process's reads of the small objects (index,
array metadata, commit records). Before, the read split cut boxes into R
parts inside chunks (each reader fetched whole chunks it needed a part of),
and leaves with no dimension divisible by R were not read once at all.
``last_restore_stats.fetched_bytes`` (TensorStore's kvstore byte counters,
per process) must agree with the proxy, and ``fetched_bytes_all`` is their
sum.
"""

from __future__ import annotations

import collections
import pathlib

import pytest

from ckpt.multihost import local_cluster
from tests.objectstore import proxy as proxy_lib
from tests.objectstore import storeutil
from tests.multiprocess import fetch_worker
from tests.multiprocess import worker

REPO = pathlib.Path(__file__).resolve().parents[2]
BOUND = 1.05
BALANCE = 1.5


def run_job(server, bucket: str, n: int) -> dict:
  """The job through a counting proxy; what it fetched during the restore
  (per object key under the root) and the workers' results."""
  host, port = server.endpoint.rsplit("//", 1)[1].split(":")
  counter = proxy_lib.HttpCounter()
  with proxy_lib.Proxy((host, int(port)), counter) as px:
    env = dict(server.env)
    env["AWS_ENDPOINT_URL" if server.scheme == "s3" else
        "TENSORSTORE_GCS_HTTP_URL"] = px.endpoint
    out = [worker.decode(fetch_worker.Result, r)
           for r in local_cluster.check(local_cluster.run(
               "tests.multiprocess.fetch_worker",
               {"dir": f"{bucket}/ck", "format": "zarr3", "policies": [True],
                "count_url": px.endpoint},
               num_processes=n, devices_per_process=2, timeout_s=240,
               extra_env=env, cwd=str(REPO)))]
  assert not counter.errors, counter.errors
  requests, bodies = counter.between("saved", "0-True")
  name = bucket.split("://", 1)[1]
  fetched = collections.Counter()
  gets = collections.Counter()
  for (method, path), nbytes in bodies.items():
    assert method == "GET", (method, path)
    fetched[_key(path, name)] += nbytes
  for (method, path), k in requests.items():
    if method == "GET":
      gets[_key(path, name)] += k
  return {"out": out, "fetched": fetched, "gets": gets}


def _key(path: str, bucket: str) -> str:
  """The object key (under the job's root "ck/") of a request path: S3
  path style ``/<bucket>/<key>``, GCS ``.../b/<bucket>/o/<key>``."""
  for head in (f"/b/{bucket}/o/", f"/{bucket}/"):
    if head in path:
      key = path.split(head, 1)[1]
      return key[len("ck/"):] if key.startswith("ck/") else key
  return path


def stored(bucket: str) -> dict[str, int]:
  """key -> bytes, read directly from the server (not through the proxy)."""
  store = storeutil.kvstore(f"{bucket}/ck")
  keys = [k.decode() for k in store.list().result()]
  return {k: len(store.read(k).result().value) for k in keys}


def leaf_of(key: str) -> str | None:
  """The leaf whose chunk ``key`` is (zarr3: ``.../<leaf>/c/<i>/<j>``)."""
  parts = key.split("/")
  if "c" in parts:
    i = parts.index("c")
    if i > 0 and parts[i - 1] in fetch_worker.LEAVES:
      return parts[i - 1]
  return None


def check(job: dict, objects: dict[str, int], n: int) -> None:
  out, fetched = job["out"], job["fetched"]
  for r in out:
    assert r.restores["0-True"].bad == [], r.restores["0-True"].bad
  chunks = {k: v for k, v in objects.items() if leaf_of(k)}
  small = sum(v for k, v in objects.items() if not leaf_of(k))
  stored_bytes = sum(chunks.values())
  got_chunks = sum(v for k, v in fetched.items() if k in chunks)
  per_leaf = {}
  for leaf in fetch_worker.LEAVES:
    mine = [k for k in chunks if leaf_of(k) == leaf]
    per_leaf[leaf] = (
        round(sum(fetched[k] for k in mine) / sum(chunks[k] for k in mine),
              3), max(job["gets"][k] for k in mine))
  # Every chunk object fetched (the data is exact), and all of them
  # together at most BOUND times what is stored: per leaf (fetched/stored,
  # the most GETs of one chunk) in the message.
  assert got_chunks >= stored_bytes, (got_chunks, stored_bytes)
  assert got_chunks <= BOUND * stored_bytes, (
      f"{n} processes fetched {got_chunks} bytes of chunks, stored "
      f"{stored_bytes} ({got_chunks / stored_bytes:.2f}x); per leaf "
      f"(fetched/stored, most GETs of one chunk): {per_leaf}")
  total = sum(fetched.values())
  assert total <= BOUND * stored_bytes + n * small, (total, stored_bytes, small)
  # ckpt's own figure (TensorStore's kvstore counters, per process) is what
  # the store served, and the total is the sum over the processes.
  stats = [r.restores["0-True"].stats for r in out]
  mine = [s["fetched_bytes"] for s in stats]
  assert abs(sum(mine) - total) <= 0.01 * total, (mine, total)
  assert [s["fetched_bytes_all"] for s in stats] == [sum(mine)] * n, stats
  assert max(mine) <= BALANCE * sum(mine) / n, mine


@pytest.mark.parametrize("n", [2, 4])
def test_read_once_fetches_each_chunk_once_from_s3(s3_server, s3_bucket, n):
  job = run_job(s3_server, s3_bucket, n)
  check(job, stored(s3_bucket), n)


@pytest.mark.parametrize("n", [2, 4])
def test_read_once_fetches_each_chunk_once_from_gcs(gcs_server, gs_bucket, n):
  job = run_job(gcs_server, gs_bucket, n)
  check(job, stored(gs_bucket), n)
