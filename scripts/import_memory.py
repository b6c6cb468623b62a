"""Benchmark: peak host memory of ``ckpt import`` of an Orbax checkpoint.

Usage (from the repository root):
  python -m scripts.import_memory [--mib 200] [--budget-mib 16] [--repeat 1]
      [--item state] [--api] [--dir D]

Writes an Orbax step (``CheckpointManager``, ``Composite(state=StandardSave,
extra=JsonSave)``) of about ``--mib`` MiB of random float32 on a (2, 4) mesh
of 8 CPU devices: six leaves sharded four ways, one replicated jax.Array and
one host numpy array, all the same size (``write_orbax``, in a fresh
process); then imports it in another fresh process with ``concurrent_bytes
= --budget-mib`` (``import_once``) and prints the growth of its peak
resident memory (scripts/benchlib/measure.py: the kernel's high-water mark
during the import minus the RSS just before it: every byte the import
touched, whatever allocated it), with the largest leaf and the budget for
scale. ``--item state`` imports the ``state`` item directory instead of the
step (what an importer that reads one item needs); ``--api`` calls
``ckpt.cli.convert.import_checkpoint`` instead of the command (whose process
also returns large buffers to the OS: see ``ckpt/cli/transfer.py``), so
older versions of ckpt (first on PYTHONPATH) can be measured the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from scripts.benchlib import measure
from scripts.benchlib import presets


def write_orbax(root: str, mib: int) -> dict[str, int]:
  """In a fresh process: the Orbax step (see the docstring); its sizes."""
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  n = max(8, int((mib * 2**20 / 8 / 4) ** 0.5) // 8 * 8)  # 8 leaves of n*n
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
  return {"leaf_bytes": n * n * 4, "state_bytes": 8 * n * n * 4}


def import_once(src: str, dst: str, budget: int, api: bool) -> dict[str, float]:
  """In a fresh process: one import; its peak RSS growth and seconds."""
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax  # pylint: disable=g-import-not-at-top
  from ckpt.cli import convert  # pylint: disable=g-import-not-at-top
  jax.devices()
  with measure.measure(interval_s=0) as m:
    if api:  # the Python API (also in ckpt versions without the flag)
      convert.import_checkpoint(src, dst, 1, concurrent_bytes=budget)
    else:  # what `ckpt import SRC DST --step 1 --concurrent-bytes B` runs
      from ckpt.cli import main as cli  # pylint: disable=g-import-not-at-top
      code = cli.main(["import", src, dst, "--step", "1", "--quiet",
                       "--concurrent-bytes", str(budget)])
      if code != 0:
        raise RuntimeError(f"ckpt import exited with {code}")
  return {"growth": m.extra_rss, "seconds": m.wall_s}


def _child(work: str, *args: str) -> dict:
  """Runs this module with ``args`` in a fresh process; its JSON answer.
  A tree on PYTHONPATH comes first (ckpt from there), this one after it."""
  path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(path + [str(presets.ROOT)]))
  out = subprocess.run([sys.executable, "-m", "scripts.import_memory", *args],
                       check=True, capture_output=True, text=True, env=env,
                       cwd=work).stdout
  return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--mib", type=int, default=200)
  ap.add_argument("--budget-mib", type=int, default=16)
  ap.add_argument("--dir", help="work directory (default: a fresh temporary)")
  ap.add_argument("--item", default="", help="import this item directory")
  ap.add_argument("--repeat", type=int, default=1)
  ap.add_argument("--api", action="store_true",
                  help="call ckpt.cli.convert.import_checkpoint, not the command")
  ap.add_argument("--write-orbax", nargs=2, metavar=("ROOT", "MIB"),
                  help=argparse.SUPPRESS)
  ap.add_argument("--import-once", nargs=4,
                  metavar=("SRC", "DST", "BUDGET", "api|cli"),
                  help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.write_orbax:
    print(json.dumps(write_orbax(args.write_orbax[0],
                                 int(args.write_orbax[1]))))
    return 0
  if args.import_once:
    src, dst, budget, how = args.import_once
    print(json.dumps(import_once(src, dst, int(budget), how == "api")))
    return 0
  work = args.dir or tempfile.mkdtemp(prefix="import-memory-")
  src = os.path.join(work, "orbax")
  sizes_file = os.path.join(work, "sizes.json")
  if not os.path.exists(sizes_file):  # kept: later runs import the same step
    sizes = _child(work, "--write-orbax", src, str(args.mib))
    with open(sizes_file, "w") as f:
      json.dump(sizes, f)
  with open(sizes_file) as f:
    sizes = json.load(f)
  step = os.path.join(src, "1", args.item) if args.item else os.path.join(
      src, "1")
  for r in range(args.repeat):
    dst = os.path.join(work, f"ckpt-{os.getpid()}-{r}")
    got = _child(work, "--import-once", step, dst, str(args.budget_mib << 20),
                 "api" if args.api else "cli")
    print(f"state {sizes['state_bytes'] / 2**20:.0f} MiB (largest leaf "
          f"{sizes['leaf_bytes'] / 2**20:.0f} MiB), budget "
          f"{args.budget_mib} MiB: peak RSS growth "
          f"{got['growth'] / 2**20:.0f} MiB, {got['seconds']:.1f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
