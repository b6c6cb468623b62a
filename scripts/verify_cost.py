"""What verification costs a restore: 1 GiB (64 leaves of 1024x4096
random float32 on a (data=2, model=4) mesh of 8 CPU devices, odd leaves
sharded by rows over ``model``, even ones by columns), saved once, then
restored onto the same shardings with ``verify=True`` and ``verify=False``
alternately, ``--rounds`` times each; with ``--cold`` the page cache is
dropped before every restore (needs root). Prints the median and range of
wall and CPU seconds of each, and their ratio.

  python scripts/verify_cost.py [--rounds 5] [--cold] [--gib 1] [--dir D]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import ckpt  # noqa: E402


def drop_caches() -> None:
  subprocess.run(["sync"], check=True)
  with open("/proc/sys/vm/drop_caches", "w") as f:
    f.write("3\n")


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--cold", action="store_true")
  ap.add_argument("--gib", type=float, default=1.0)
  ap.add_argument("--dir", default=None)
  a = ap.parse_args()
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
  leaves = max(1, int(64 * a.gib))
  rng = np.random.default_rng(0)
  state = {}
  for i in range(leaves):
    spec = P("model", None) if i % 2 else P(None, "model")
    state[f"l{i:03d}"] = jax.device_put(
        rng.standard_normal((1024, 4096), dtype=np.float32),
        NamedSharding(mesh, spec))
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
            for k, v in state.items()}
  root = tempfile.mkdtemp(dir=a.dir, prefix="verify-cost-")
  try:
    with ckpt.Checkpointer(root, async_save=False) as c:
      c.save(1, state)
    del state
    times = {True: [], False: []}
    cpus = {True: [], False: []}
    with ckpt.Checkpointer(root) as c:
      for r in range(a.rounds):
        for verify in ((True, False) if r % 2 == 0 else (False, True)):
          if a.cold:
            drop_caches()
          t0, c0 = time.perf_counter(), time.process_time()
          out = c.restore(1, target=target, verify=verify)
          jax.block_until_ready(out)
          times[verify].append(time.perf_counter() - t0)
          cpus[verify].append(time.process_time() - c0)
          del out
    for v in (False, True):
      print(f"verify={v!s:5}: wall median {statistics.median(times[v]):.3f} s "
            f"({min(times[v]):.3f}-{max(times[v]):.3f}), CPU median "
            f"{statistics.median(cpus[v]):.3f} s")
    print(f"ratio verified/unverified ({'cold' if a.cold else 'warm'}): wall "
          f"{statistics.median(times[True]) / statistics.median(times[False]):.3f}x, "
          f"CPU {statistics.median(cpus[True]) / statistics.median(cpus[False]):.3f}x")
  finally:
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  main()
