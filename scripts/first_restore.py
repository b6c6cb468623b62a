"""Benchmark: a restore's first run in a process against the next ones.

Usage (from the repository root; A/B: run it alternately with PYTHONPATH
at each tree, best of 3):
  python -m scripts.first_restore [--preset large_f32_1g] [--repeat 2]
      [--wait S] [--dir D]

In this one process (8 CPU devices unless XLA_FLAGS / JAX_PLATFORMS say
otherwise) it builds the preset's random state (scripts/benchlib/presets.py),
saves it with ckpt (sync), then restores it onto the save mesh ``--repeat``
times (the first apart; ``--preset small_leaves_10k --repeat 3`` is an A/B of
a restore's per-leaf work) and once onto the other mesh. Each restore:
wall, user and system CPU seconds and minor page faults of this process
(scripts/benchlib/measure.py). System time is where fresh host memory shows:
a restore's buffers are faulted in (and zeroed by the kernel) on first
touch. ``--wait S`` waits S seconds after the save, printing this process's
pid, to attach a profiler (py-spy record --pid).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from scripts.benchlib import measure  # noqa: E402
from scripts.benchlib import presets  # noqa: E402
from scripts.benchlib import systems  # noqa: E402


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="large_f32_1g")
  parser.add_argument("--dir", default=None)
  parser.add_argument("--repeat", type=int, default=2,
                      help="restores onto the save mesh (the first apart)")
  parser.add_argument("--wait", type=float, default=0.0,
                      help="seconds to wait after the save (pid printed)")
  args = parser.parse_args(argv)
  import jax  # pylint: disable=g-import-not-at-top
  preset = presets.load_preset(args.preset)
  topo = presets.Topology(preset)
  state = presets.build_state(preset, topo)
  targets = {"same": presets.abstract_state(preset, topo.save_mesh),
             "other": presets.abstract_state(preset, topo.other_mesh)}
  system = systems.make_system("ckpt", preset)
  root = tempfile.mkdtemp(prefix="first-restore-", dir=args.dir)
  path = os.path.join(root, "ck")
  try:
    with measure.measure(interval_s=0) as m:
      system.save(path, state)
    print(f"save: wall {m.wall_s:.2f} s, CPU {m.cpu_s:.2f} s", flush=True)
    print(f"pid {os.getpid()}", flush=True)
    time.sleep(args.wait)
    runs = [("restore same (first)", "same")] + [
        (f"restore same ({'second' if i == 2 else i})", "same")
        for i in range(2, args.repeat + 1)]
    for name, mesh in runs + [("restore other", "other")]:
      with measure.measure(interval_s=0) as m:
        out = system.restore(path, targets[mesh])
        jax.block_until_ready(out)
      print(f"{name}: wall {m.wall_s:.2f} s, user {m.user_s:.2f} s, sys "
            f"{m.sys_s:.2f} s, minor faults {m.minor_faults}", flush=True)
      del out
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
