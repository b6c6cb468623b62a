"""One process of a multi-tier job for tests/multiprocess/test_tiers_faults.py.

``config["scenario"]``:

- "mkdir": process 1 cannot create its local step directory at step 2 (a
  file stands where ``process_1/`` was); every process reports the error
  of save 2 and how long it took, then saves step 3 with the directory
  back and restores it.
- "stop": saves step 1, then step 2 while the test SIGSTOPs process 1
  (once its step-2 directory appears); each process reports the error of
  save 2, and when it came (``time.time()``), then saves step 3. Process 1
  writes ``<flags>/before_2`` just before save 2; process 0 writes
  ``<flags>/p0_done`` once its save 2 ended and waits until process 1
  wrote ``<flags>/p1_done`` (the coordination service lives in process 0).
- "keys": local saves (every 5th also persistent), ``latest_step`` and
  restores in two phases of different lengths; process 0 reports the keys
  left in the coordination service after each phase.

Every wait here is bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import numpy as np


def _wait_for(path: str, timeout_s: float) -> bool:
  deadline = time.monotonic() + timeout_s
  while not os.path.exists(path):
    if time.monotonic() > deadline:
      return False
    time.sleep(0.01)
  return True


def _touch(path: str) -> None:
  with open(path, "w") as f:
    f.write(str(time.time()))


def main() -> None:
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  cfg = local_cluster.init_from_env()
  conf = json.loads(sys.argv[1])
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.multihost import process as multihost  # pylint: disable=g-import-not-at-top
  pid = cfg["process_id"]
  rows = conf.get("rows", 256)
  mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("x", "y"))
  shard = {"w": NamedSharding(mesh, P("x", "y")),
           "b": NamedSharding(mesh, P("x"))}
  base = np.random.default_rng(3).standard_normal((rows, 512), np.float32)

  def want(step):
    return {"w": base + step, "b": np.arange(64, dtype=np.int32) * step}

  def make(step):
    s = want(step)
    return {"params": {n: jax.make_array_from_callback(
        s[n].shape, shard[n], lambda idx, a=s[n]: a[idx]) for n in s},
            "step": np.int64(step)}

  target = {"params": {n: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                               sharding=shard[n])
                       for n, v in want(0).items()}, "step": np.int64(0)}

  def exact(got) -> list:
    step = int(got["step"])
    w = want(step)
    return [step, all(np.array_equal(np.asarray(s.data), w[n][s.index])
                      for n in w for s in got["params"][n].addressable_shards)]

  ckptr = ckpt.MultiTierCheckpointer(
      conf["persistent"], local=conf["local"], local_interval=1, local_keep=2,
      persistent_interval=conf.get("persistent_interval"),
      barrier_timeout_s=conf["timeout_s"])

  def save(step) -> tuple[str | None, float, float]:
    """(error, seconds, time.time() at the end) of a save and its wait."""
    t0 = time.perf_counter()
    try:
      ckptr.save(step, make(step), host_state={"pos": step * 10 + pid})
      ckptr.wait_until_finished()
      err = None
    except Exception as e:  # pylint: disable=broad-except
      err = f"{type(e).__name__}: {e}"
    return err, time.perf_counter() - t0, time.time()

  out = {}
  if conf["scenario"] == "mkdir":
    out["1"] = save(1)
    mine = os.path.join(conf["local"], f"process_{pid}")
    multihost.barrier("mkdir-1", timeout_s=60)
    if pid == 1:  # a file where the process's local directory should be
      os.rename(mine, mine + ".aside")
      _touch(mine)
    multihost.barrier("mkdir-2", timeout_s=60)
    out["2"] = save(2)
    if pid == 1:
      os.remove(mine)
      os.rename(mine + ".aside", mine)
    multihost.barrier("mkdir-3", timeout_s=60)
    out["3"] = save(3)
    out["local_steps"] = ckptr.local.committed_steps()
    out["entries"] = sorted(os.listdir(mine))
    out["restored"] = exact(ckptr.restore(target=target))
    out["tier"] = ckptr.last_restore_tier
  elif conf["scenario"] == "stop":
    out["1"] = save(1)
    multihost.barrier("stop-1", timeout_s=60)
    if pid == 1:
      _touch(os.path.join(conf["flags"], "before_2"))
    out["2"] = save(2)
    if pid == 0:
      _touch(os.path.join(conf["flags"], "p0_done"))
      out["p1_done"] = _wait_for(os.path.join(conf["flags"], "p1_done"), 90)
    else:
      _touch(os.path.join(conf["flags"], "p1_done"))
    out["3"] = save(3)  # both start it within milliseconds
  elif conf["scenario"] == "keys":
    client = multihost.coordination_client()
    step = 0
    for k, n in enumerate(conf["phases"]):
      for _ in range(n):
        step += 1
        err = save(step)[0]
        assert err is None, err
      latest = ckptr.latest_step()
      restored = exact(ckptr.restore(target=target))
      step += 1
      assert save(step)[0] is None
      multihost.barrier(f"keys-{k}", timeout_s=60)
      if pid == 0:
        keys = sorted(k for k, _ in client.key_value_dir_get_bytes("ckpt/"))
        out[str(k)] = {"latest": latest, "restored": restored,
                       "tier": ckptr.last_restore_tier, "keys": keys}
      multihost.barrier(f"keys-{k}-counted", timeout_s=60)
  ckptr.close()
  local_cluster.write_result(out)


if __name__ == "__main__":
  main()
