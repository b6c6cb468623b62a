"""Benchmark: the multi-tier checkpointer (docs/multi-tier.md; the table is
on docs/benchmarks.md).

Usage (from the repository root):
  python -m scripts.bench_tiers [--mib 256] [--processes 4] [--devices 2]

Starts N real jax.distributed processes (ckpt.multihost.local_cluster, gloo CPU
collectives), builds random float32 state (np.random, sharded over all
devices), and measures, per process (the table shows the slowest):
the caller's blocking time and the total time of a local-tier save and of a
persistent-tier save, and the time to restore from each tier (local with
every own part present; local with one process's directory wiped, so its
shards come from its partner; persistent).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from scripts.benchlib import measure
from scripts.benchlib import presets


def timed(start, wait=None) -> list[float]:
  """[seconds the caller was blocked in ``start()``, seconds until ``wait()``
  returned]; with no ``wait``, [seconds of ``start()``, its result]."""
  with measure.measure(interval_s=0) as m:
    value = start()
    blocked = m.lap()
    if wait is not None:
      wait()
  return [blocked, m.wall_s] if wait is not None else [m.wall_s, value]


def worker(conf: dict) -> None:
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  local_cluster.init_from_env()
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.multihost import process as multihost  # pylint: disable=g-import-not-at-top
  pid = jax.process_index()
  mesh = Mesh(np.array(jax.devices()), ("x",))
  sh = NamedSharding(mesh, P("x"))
  n_leaves = 8
  rows = conf["mib"] * 2**20 // 4 // 1024 // n_leaves
  rows -= rows % len(jax.devices())

  def leaf(k):
    def cb(idx):
      r = np.random.default_rng([k, idx[0].start or 0])
      return r.standard_normal((idx[0].stop - (idx[0].start or 0), 1024),
                               dtype=np.float32)
    return jax.make_array_from_callback((rows, 1024), sh, cb)

  state = {f"l{k}": leaf(k) for k in range(n_leaves)}
  jax.block_until_ready(state)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                       sharding=x.sharding),
                        state)
  out = {}
  with ckpt.MultiTierCheckpointer(
      conf["persistent"], local=conf["local"], local_interval=1, local_keep=2,
      persistent_interval=1000, persistent_keep=2) as c:
    for step in (1, 2, 3):  # local only; the first one compiles the permute
      out[f"local_save_{step}"] = timed(
          lambda s=step: c.save(s, state, host_state={"pos": s}),
          c.wait_until_finished)
    multihost.barrier("bench-p")
    out["both_save"] = timed(  # both tiers
        lambda: c.save(1000, state, host_state={"pos": 1000}),
        c.wait_until_finished)
    for step in (2000, 3000):
      out[f"persistent_save_{step}"] = timed(
          lambda s=step: c.persistent.save(s, state, host_state={"pos": s}),
          c.persistent.wait_until_finished)
    for step in (3001,):
      c.save(step, state, host_state={"pos": step})
    c.wait_until_finished()
    multihost.barrier("bench-r")
    for name, wipe in (("local", False), ("local_partner", True)):
      if wipe and pid == 1:
        shutil.rmtree(os.path.join(conf["local"], "process_1"))
      multihost.barrier(f"bench-{name}")
      seconds, _ = timed(lambda: jax.block_until_ready(
          c.restore(target=target)))
      out[f"restore_{name}"] = [seconds, c.last_restore_tier]
    seconds, _ = timed(lambda: jax.block_until_ready(
        c.persistent.restore(3000, target=target)))
    out["restore_persistent"] = [seconds, "persistent"]
  local_cluster.write_result(out)


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--mib", type=int, default=256)
  ap.add_argument("--processes", type=int, default=4)
  ap.add_argument("--devices", type=int, default=2)
  ap.add_argument("--dir", default=None)
  a = ap.parse_args(argv)
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  root = a.dir or tempfile.mkdtemp(prefix="bench-tiers-")
  local = "/dev/shm" if os.path.isdir("/dev/shm") else root
  local = tempfile.mkdtemp(prefix="bench-tiers-local-", dir=local)
  conf = {"mib": a.mib, "persistent": os.path.join(root, "persistent"),
          "local": local}
  try:
    res = local_cluster.check(local_cluster.run(
        "scripts.bench_tiers", conf, num_processes=a.processes,
        devices_per_process=a.devices, timeout_s=600, cwd=str(presets.ROOT)))
  finally:
    shutil.rmtree(local, ignore_errors=True)
    if a.dir is None:
      shutil.rmtree(root, ignore_errors=True)
  print(f"{a.processes} processes x {a.devices} CPU devices, {a.mib} MiB of "
        f"random float32 ({a.mib // a.processes} MiB per process); local tier "
        f"in {os.path.dirname(local)}, persistent tier in {root}; slowest "
        "process:")
  for key in res[0]:
    vals = [r[key] for r in res]
    if isinstance(vals[0][1], str):
      print(f"  {key:24s} {max(v[0] for v in vals):7.3f} s  ({vals[0][1]})")
    else:
      print(f"  {key:24s} blocking {max(v[0] for v in vals):7.3f} s   total "
            f"{max(v[1] for v in vals):7.3f} s")
  print(json.dumps(res))


if __name__ == "__main__":
  if "CKPT_CLUSTER" in os.environ:
    worker(json.loads(sys.argv[1]))
  else:
    main()
