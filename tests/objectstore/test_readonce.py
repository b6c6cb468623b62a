"""Read once on moto's S3, across 4 real processes x 2 devices, and on the
GCS emulator across 2.

The same job as tests/multiprocess/test_readonce.py (save fully sharded,
restore onto leaves replicated over 4 and 2 processes and fully sharded),
into a bucket on moto. Bytes are counted twice, independently: by ckpt
(``last_restore_stats.bytes_read``, each process) and by the server: the
GET requests of chunk objects in moto's access log during each restore
(every chunk here is one 32 KiB object, so GETs x 32 KiB are the bytes
served). Read once, each stored chunk of the target's leaves is fetched
once over all processes; with ``read_once=False`` R times; automatic
(None) on an object store is on.

On both stores lazy leaves are then read later from the bucket with read
once on (each read a collective: the stored bytes once in all) and off
(read everywhere). On gs:// (2 processes, to keep the job short: the
emulator is slow) only one eager restore runs, with the automatic policy,
which must read once.
"""

from __future__ import annotations

import math

import numpy as np

from tests.multiprocess import readonce_worker as worker
from tests.multiprocess.test_readonce import (check_cases, check_counts,
                                              everywhere_bytes, launch,
                                              stored_bytes)


def test_read_once_on_s3(s3_server, s3_bucket):
  out = launch({"dir": f"{s3_bucket}/ck", "format": "zarr", "op": "both",
                "policies": [True, False, None],
                "moto_log": s3_server.log_path, "cases": ["lazy"]})
  check_counts(out, "True", stored_bytes(), balanced=True)
  check_counts(out, "False", everywhere_bytes(), balanced=True)
  check_counts(out, "None", stored_bytes(), balanced=True)  # auto: on
  chunk = worker.CHUNK_BYTES
  gets = {p: out[0].restores[p].moto_gets for p in ("True", "False", "None")}
  assert gets["True"] == stored_bytes() // chunk, gets
  assert gets["None"] == gets["True"], gets
  assert gets["False"] == everywhere_bytes() // chunk, gets
  # Lazy leaves read later from the bucket: read once (each read a
  # collective) the stored bytes once in all; read_once=False R times.
  check_cases(out, stored_bytes(), everywhere_bytes(), 4)


# 2 processes x 2 devices: mesh a=1, b=2, c=2, the processes along b; every
# leaf but shard/w (which uses b) is held whole by both.
REPLICAS_2 = {"rep4/w": 2, "rep4/all": 2, "rep4/i": 2, "rep2/w": 2,
              "shard/w": 1}


def test_read_once_on_gcs(gs_bucket):
  out = launch({"dir": f"{gs_bucket}/ck", "format": "zarr3", "op": "both",
                "policies": [None], "cases": ["lazy"]}, n=2)
  # Automatic on an object store: on. Read everywhere (read_once=False),
  # the processes would read 6 MiB in all (1.7x: shard/w is not replicated).
  check_counts(out, "None", stored_bytes(), balanced=True)
  assert [r.restores["None"].stats["read_once_leaves"] for r in out] == [4, 4]
  # Lazy leaves read later from the bucket: read once (each read a
  # collective), against read everywhere with read_once=False.
  everywhere = sum(math.prod(s) * np.dtype(d).itemsize * REPLICAS_2[n]
                   for n, (s, d, _) in worker.SHAPES.items())
  assert everywhere == 6 << 20
  check_cases(out, stored_bytes(), everywhere, 4)
