"""One process of a multi-tier job whose processes run on "hosts" of their
own (a UTS namespace each, set up by tests/multiprocess/test_tiers_hosts.py;
``<local>`` is a bind mount of that host's directory).

``config["scenario"]``: "save" saves steps 1..``steps`` (local every step,
persistent every 4th); "restore" restores onto the saved shardings, says
from which tier and step and whether it is bit-exact, then optionally saves
the next step to the local tier. Its result: a ``Result``.
"""

from __future__ import annotations

import dataclasses
import logging as std_logging
import os
import socket
from typing import Any

import numpy as np

from tests.multiprocess import worker

SHAPES = {"w": ((64, 32), "float32"), "v": ((32,), "int32"),
          "r": ((8, 8), "float32")}
SPECS = {"w": ("x", "y"), "v": ("x",), "r": ()}


def state_np(step: int) -> dict:
  out = {}
  for name, (shape, dtype) in SHAPES.items():
    rng = np.random.default_rng([23, sum(map(ord, name))])
    base = rng.standard_normal(shape).astype(dtype) if dtype == "float32" else (
        rng.integers(-2**20, 2**20, size=shape).astype(dtype))
    out[name] = base + np.asarray(step, dtype)
  return out


@dataclasses.dataclass(frozen=True)
class Restored:
  """The "restore" scenario's restore."""
  step: int
  exact: bool          # bit-exact on this process's shards and shardings
  tier: str            # last_restore_tier
  reason: str          # last_restore_reason
  host_state: Any
  from_partner: bool | None


@dataclasses.dataclass(frozen=True)
class Result:
  host: str                   # socket.gethostname()
  entries: list[str] | None   # what this process's local directory held
  dst: list[int]              # the local tier's partner map
  hosts: list[str] | None     # ... and the host of each process
  local_steps: list[int]      # the local tier's steps at the end
  restored: Restored | None   # None in the "save" scenario


def run(conf: dict) -> Result:
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.INFO)
  std_logging.getLogger("absl").setLevel(std_logging.INFO)
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  pid = jax.process_index()
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
  shard = {n: NamedSharding(mesh, P(*SPECS[n])) for n in SHAPES}

  def make(step):
    s = state_np(step)
    return {"params": {n: jax.make_array_from_callback(
        s[n].shape, shard[n], lambda idx, a=s[n]: a[idx]) for n in s},
            "step": np.int64(step)}

  mine = os.path.join(conf["local"], f"process_{pid}")
  host = socket.gethostname()   # what this process held at start
  entries = sorted(os.listdir(mine)) if os.path.isdir(mine) else None
  restored = None
  ckptr = ckpt.MultiTierCheckpointer(
      conf["persistent"], local=conf["local"], local_interval=1, local_keep=2,
      persistent_interval=4, persistent_keep=3, barrier_timeout_s=60)
  if conf["scenario"] == "save":
    for step in range(1, conf["steps"] + 1):
      ckptr.save(step, make(step), host_state={"pos": step * 100 + pid})
    ckptr.wait_until_finished()
  else:
    target = {"params": {n: jax.ShapeDtypeStruct(
        SHAPES[n][0], SHAPES[n][1], sharding=shard[n]) for n in SHAPES},
              "step": np.int64(0)}
    got = ckptr.restore(target=target)
    step = int(got["step"])
    want = state_np(step)
    exact = all(np.array_equal(np.asarray(s.data), want[n][s.index])
                for n in SHAPES for s in got["params"][n].addressable_shards)
    exact &= all(got["params"][n].sharding == shard[n] for n in SHAPES)
    restored = Restored(
        step, bool(exact), ckptr.last_restore_tier,
        ckptr.last_restore_reason, ckptr.host_state(),
        ckptr.local.last_restore_stats.get("from_partner"))
    if conf.get("save_after"):
      ckptr.save(step + 1, make(step + 1),
                 host_state={"pos": (step + 1) * 100 + pid})
      ckptr.wait_until_finished()
  lay = ckptr.local.layout
  out = Result(host, entries, list(lay.dst), getattr(lay, "hosts", None),
               ckptr.local.committed_steps(), restored)
  ckptr.close()
  return out


if __name__ == "__main__":
  worker.main(run)
