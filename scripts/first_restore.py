"""The first restore after a save in one process, against the next ones.

Usage (A/B: run it alternately with PYTHONPATH at each tree, best of 3):
  PYTHONPATH=. python scripts/first_restore.py [--preset large_f32_1g]
(8 CPU devices unless XLA_FLAGS / JAX_PLATFORMS say otherwise)

Builds the preset's random state (scripts/bench.py), saves it (sync), then
restores it onto the save mesh twice (``--repeat N``: N times; an A/B of a
restore's per-leaf work, e.g. ``--preset small_leaves_10k --repeat 3``)
and onto the other mesh, timing each:
wall, user and system CPU seconds and minor page faults of this process
(getrusage). System time is where fresh host memory shows: a restore's
buffers are faulted in (and zeroed by the kernel) on first touch
(ckpt/restore/hostmem.py). ``--wait S`` waits S seconds after the save,
printing this process's pid, to attach a profiler (py-spy record --pid).
"""

from __future__ import annotations

import argparse
import os
import resource

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="large_f32_1g")
  parser.add_argument("--dir", default=None)
  parser.add_argument("--repeat", type=int, default=2,
                      help="restores onto the save mesh (the first apart)")
  parser.add_argument("--wait", type=float, default=0.0,
                      help="seconds to wait after the save (pid printed)")
  args = parser.parse_args()
  import jax  # pylint: disable=g-import-not-at-top
  preset = bench.load_preset(args.preset)
  topo = bench.Topology(preset)
  state = bench.build_state(preset, topo)
  targets = {"same": bench.abstract_state(preset, topo, topo.save_mesh),
             "other": bench.abstract_state(preset, topo, topo.other_mesh)}
  system = bench.make_system("ckpt", preset)
  root = tempfile.mkdtemp(prefix="first-restore-", dir=args.dir)
  try:
    t0 = time.perf_counter()
    system.save(os.path.join(root, "ck"), state)
    print(f"save: wall {time.perf_counter() - t0:.2f} s", flush=True)
    print(f"pid {os.getpid()}", flush=True)
    time.sleep(args.wait)
    runs = [("restore same (first)", "same")] + [
        (f"restore same ({'second' if i == 2 else i})", "same")
        for i in range(2, args.repeat + 1)]
    for name, mesh in runs + [("restore other", "other")]:
      r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
      out = system.restore(os.path.join(root, "ck"), targets[mesh])
      jax.block_until_ready(out)
      wall = time.perf_counter() - t0
      r1 = resource.getrusage(resource.RUSAGE_SELF)
      print(f"{name}: wall {wall:.2f} s, user {r1.ru_utime - r0.ru_utime:.2f}"
            f" s, sys {r1.ru_stime - r0.ru_stime:.2f} s, minor faults "
            f"{r1.ru_minflt - r0.ru_minflt}", flush=True)
      del out
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
