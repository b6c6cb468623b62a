"""One process of tests/multiprocess/test_readonce_overlap.py.

SPMD, 2 processes x 2 devices: the mesh ("r", "c") has shape (2, 2), "r"
across the processes. Six float32 leaves of 256 KiB, saved fully sharded,
are restored read once replicated over "r" (R = 2) with a
``concurrent_bytes`` (BUDGET) that cuts the exchange into one leaf per
batch (each costs 512 KiB per process: the part read + the gathered box).

The worker wraps ckpt's read of a batch (``restore.read_parts``) and the
exchange program (``readsplit.exchange_program``) to see when each runs:
before exchange k (but the last) starts, it waits up to WAIT_S for the read
of batch k+1 to have started, and records whether it had (the overlap).

- ``op: "restore"``: one restore; reports per process whether each exchange
  overlapped the next batch's read, the stats, and the leaves' mismatches
  (bit-exact, target sharding).
- ``op: "fail"``: process ``fail_on``'s read of batch ``fail_batch`` raises
  at once (while batch ``fail_batch - 1`` is exchanged, where reads
  overlap); every process reports the error its restore raised and how
  long it took, then restores again (must be exact).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from tests.multiprocess import worker
from tests.multiprocess.worker import Outcome

N_LEAVES = 6
SHAPE = (256, 256)
BUDGET = 1 << 20
WAIT_S = 20.0


def truth(i: int):
  import numpy as np
  return (np.arange(SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE)
          * (i + 1) + i / 7)


@dataclasses.dataclass(frozen=True)
class Result:
  process: int
  restore: Outcome           # the read-once restore
  bad: list[str] | None      # its mismatches, if it returned
  overlapped: list[bool]     # per exchange but the last: the next read ran
  stats: dict[str, Any]      # last_restore_stats, as a dict
  again_bad: list[str] | None = None   # op "fail": the restore after


def run(conf: dict) -> Result:
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import ckpt
  from ckpt.restore import readsplit
  from ckpt.restore import read as restore_lib

  me = jax.process_index()
  mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("r", "c"))
  full = NamedSharding(mesh, P(("r", "c")))
  state = {f"l{i}": jax.make_array_from_callback(
      SHAPE, full, lambda idx, i=i: truth(i)[idx]) for i in range(N_LEAVES)}
  tgt_sharding = NamedSharding(mesh, P(None, "c"))
  target = {k: jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=tgt_sharding)
            for k in state}

  lock = threading.Lock()
  reads_started: list[threading.Event] = []
  exchanges = [0]
  overlapped: list[bool] = []
  fail = [conf["fail_batch"] if conf.get("fail_on") == me else None]
  real_read, real_exchange = restore_lib.read_parts, readsplit.exchange_program

  def read_parts(batch, budget):
    with lock:
      k = len(reads_started)
      reads_started.append(threading.Event())
      reads_started[k].set()
    if k == fail[0]:
      async def boom():
        raise ValueError(f"injected read failure on process {me}, batch {k}")
      return boom()
    return real_read(batch, budget)

  def exchange_program(parts, shardings):
    k = exchanges[0]
    exchanges[0] += 1
    if k + 1 < n_batches[0]:
      t_end = time.monotonic() + WAIT_S
      while time.monotonic() < t_end:
        with lock:
          started = len(reads_started) > k + 1
        if started:
          break
        time.sleep(0.005)
      overlapped.append(started)
    return real_exchange(parts, shardings)

  n_batches = [N_LEAVES]
  restore_lib.read_parts = read_parts
  readsplit.exchange_program = exchange_program

  def check(got) -> list[str]:
    bad = []
    for k, a in got.items():
      i = int(k[1:])
      if a.sharding != tgt_sharding:
        bad.append(f"{k}: sharding {a.sharding}")
      for sh in a.addressable_shards:
        if not np.array_equal(np.asarray(sh.data), truth(i)[sh.index]):
          bad.append(f"{k}: shard {sh.index} differs")
    return bad

  out: dict[str, Any] = {"process": me}
  with ckpt.Checkpointer(conf["dir"], format="zarr3", async_save=False,
                         chunk_bytes=32 << 10, concurrent_bytes=BUDGET,
                         barrier_timeout_s=60) as ck:
    ck.save(1, state)
    got = worker.timed(ck.restore, 1, target=target, read_once=True)
    out["restore"] = dataclasses.replace(got, value=None)
    out["bad"] = check(got.value) if got.ok else None
    out["overlapped"] = list(overlapped)
    out["stats"] = dataclasses.asdict(ck.last_restore_stats)
    if conf["op"] == "fail":
      fail[0] = None
      reads_started.clear()
      exchanges[0] = 0
      overlapped.clear()
      out["again_bad"] = check(ck.restore(1, target=target, read_once=True))
  return Result(**out)


if __name__ == "__main__":
  worker.main(run)
