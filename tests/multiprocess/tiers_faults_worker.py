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

import dataclasses
import os
import time

import numpy as np

from tests.multiprocess import worker
from tests.multiprocess.worker import Outcome


@dataclasses.dataclass(frozen=True)
class Save:
  """A save and its wait: its Outcome and time.time() when it ended."""
  outcome: Outcome
  ended: float


@dataclasses.dataclass(frozen=True)
class Phase:
  """Process 0 after one phase of "keys"."""
  latest: int
  restored: list  # [step, bit-exact]
  tier: str
  keys: list[str]  # left in the coordination service


@dataclasses.dataclass(frozen=True)
class Result:
  """What a process saw; a scenario fills the fields it is about."""
  saves: dict[str, Save]  # by step
  local_steps: list[int] | None = None
  entries: list[str] | None = None
  restored: list | None = None  # [step, bit-exact]
  tier: str | None = None
  p1_done: bool | None = None
  phases: list[Phase] | None = None


def run(conf: dict) -> Result:
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  cfg = local_cluster.config_from_env()
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

  saves: dict[str, Save] = {}

  def save(step) -> Save:
    def call():
      ckptr.save(step, make(step), host_state={"pos": step * 10 + pid})
      ckptr.wait_until_finished()
    saves[str(step)] = Save(worker.timed(call), time.time())
    return saves[str(step)]

  out = {"saves": saves}
  if conf["scenario"] == "mkdir":
    save(1)
    mine = os.path.join(conf["local"], f"process_{pid}")
    multihost.barrier("mkdir-1", timeout_s=60)
    if pid == 1:  # a file where the process's local directory should be
      os.rename(mine, mine + ".aside")
      worker.touch(mine)
    multihost.barrier("mkdir-2", timeout_s=60)
    save(2)
    if pid == 1:
      os.remove(mine)
      os.rename(mine + ".aside", mine)
    multihost.barrier("mkdir-3", timeout_s=60)
    save(3)
    out["local_steps"] = ckptr.local.committed_steps()
    out["entries"] = sorted(os.listdir(mine))
    out["restored"] = exact(ckptr.restore(target=target))
    out["tier"] = ckptr.last_restore_tier
  elif conf["scenario"] == "stop":
    save(1)
    multihost.barrier("stop-1", timeout_s=60)
    if pid == 1:
      worker.touch(os.path.join(conf["flags"], "before_2"))
    save(2)
    if pid == 0:
      worker.touch(os.path.join(conf["flags"], "p0_done"))
      out["p1_done"] = worker.wait_for(
          os.path.join(conf["flags"], "p1_done"), 90)
    else:
      worker.touch(os.path.join(conf["flags"], "p1_done"))
    save(3)  # both start it within milliseconds
  elif conf["scenario"] == "keys":
    client = multihost.coordination_client()
    step = 0
    out["phases"] = []
    for k, n in enumerate(conf["phases"]):
      for _ in range(n):
        step += 1
        saved = save(step).outcome
        assert saved.ok, saved
      latest = ckptr.latest_step()
      restored = exact(ckptr.restore(target=target))
      step += 1
      saved = save(step).outcome
      assert saved.ok, saved
      multihost.barrier(f"keys-{k}", timeout_s=60)
      if pid == 0:
        keys = sorted(k for k, _ in client.key_value_dir_get_bytes("ckpt/"))
        out["phases"].append(Phase(latest, restored, ckptr.last_restore_tier,
                                   keys))
      multihost.barrier(f"keys-{k}-counted", timeout_s=60)
    saves.clear()  # dozens of them: the phases say what they did
  ckptr.close()
  return Result(**out)


if __name__ == "__main__":
  worker.main(run)
