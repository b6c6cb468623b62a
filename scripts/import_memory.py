"""Peak host memory of ``ckpt import`` of an Orbax checkpoint.

    python scripts/import_memory.py [--mib 200] [--budget-mib 16] [--dir D]

Writes an Orbax step (``CheckpointManager``, ``Composite(state=StandardSave,
extra=JsonSave)``) of about ``--mib`` MiB of float32 on a (2, 4) mesh of 8
CPU devices: six leaves sharded four ways, one replicated jax.Array and one
host numpy array, all the same size; then imports it in a fresh interpreter
with ``concurrent_bytes = --budget-mib`` and prints the growth of its peak
resident memory (VmHWM after the import minus VmRSS just before it, from
/proc/self/status: every byte the import touched, whatever allocated it),
with the largest leaf and the budget for scale. ``--item state`` imports the
``state`` item directory instead of the step (what an importer that reads
one item needs); ``--api`` calls ``ckpt.cli.convert.import_checkpoint`` instead
of the command (whose process also returns large buffers to the OS: see
``ckpt/cli/transfer.py``), so older versions of ckpt can be measured the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

WRITE = r"""
import os, sys, json
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np, orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
root, mib = sys.argv[1], int(sys.argv[2])
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
n = int((mib * 2**20 / 8 / 4) ** 0.5) // 8 * 8  # 8 leaves of n*n float32
rng = np.random.default_rng(0)
specs = [P("data", "model"), P("model", "data"), P(None, "model"),
         P("model"), P(("data", "model")), P(None, ("model", "data")), P()]
state = {}
for i, spec in enumerate(specs):
  x = rng.standard_normal((n, n), np.float32)
  state[f"w{i}"] = jax.device_put(x, NamedSharding(mesh, spec))
state["host"] = rng.standard_normal((n, n), np.float32)
with ocp.CheckpointManager(root) as mgr:
  mgr.save(1, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      extra=ocp.args.JsonSave({"data_pos": 123})))
  mgr.wait_until_finished()
print(json.dumps({"leaf_bytes": n * n * 4, "state_bytes": 8 * n * n * 4}))
"""

IMPORT = r"""
import os, sys, json, time
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np, tensorstore
from ckpt.cli import convert
jax.devices()
def status(key):
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(key + ":"):
        return int(line.split()[1]) * 1024
src, dst, budget, api = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
before = status("VmRSS")
t = time.perf_counter()
if api == "api":  # the Python API (also in ckpt versions without the flag)
  convert.import_checkpoint(src, dst, 1, concurrent_bytes=budget)
else:  # what `ckpt import SRC DST --step 1 --concurrent-bytes B` runs
  from ckpt.cli import main as cli
  assert cli.main(["import", src, dst, "--step", "1", "--quiet",
                   "--concurrent-bytes", str(budget)]) == 0
print(json.dumps({"growth": status("VmHWM") - before,
                  "seconds": time.perf_counter() - t}))
"""


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--mib", type=int, default=200)
  ap.add_argument("--budget-mib", type=int, default=16)
  ap.add_argument("--dir", help="work directory (default: a fresh temporary)")
  ap.add_argument("--item", default="", help="import this item directory")
  ap.add_argument("--repeat", type=int, default=1)
  ap.add_argument("--api", action="store_true",
                  help="call ckpt.cli.convert.import_checkpoint, not the command")
  args = ap.parse_args()
  work = args.dir or tempfile.mkdtemp(prefix="import-memory-")
  src = os.path.join(work, "orbax")
  sizes_file = os.path.join(work, "sizes.json")
  if not os.path.exists(sizes_file):
    out = subprocess.run([sys.executable, "-c", WRITE, src, str(args.mib)],
                         check=True, capture_output=True, text=True).stdout
    with open(sizes_file, "w") as f:
      f.write(out.strip().splitlines()[-1])
  with open(sizes_file) as f:
    sizes = json.load(f)
  step = os.path.join(src, "1", args.item) if args.item else os.path.join(
      src, "1")
  env = {**os.environ, "PYTHONPATH": os.getcwd()}
  for r in range(args.repeat):
    dst = os.path.join(work, f"ckpt-{os.getpid()}-{r}")
    out = subprocess.run(
        [sys.executable, "-c", IMPORT, step, dst,
         str(args.budget_mib << 20), "api" if args.api else "cli"],
        check=True, capture_output=True,
        text=True, env=env).stdout
    got = json.loads(out.strip().splitlines()[-1])
    print(f"state {sizes['state_bytes'] / 2**20:.0f} MiB (largest leaf "
          f"{sizes['leaf_bytes'] / 2**20:.0f} MiB), budget "
          f"{args.budget_mib} MiB: peak RSS growth "
          f"{got['growth'] / 2**20:.0f} MiB, {got['seconds']:.1f} s")


if __name__ == "__main__":
  main()
