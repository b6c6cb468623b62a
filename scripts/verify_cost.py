"""Benchmark: what verification costs a restore.

Usage (from the repository root):
  python -m scripts.verify_cost [--preset leaves64_f32_1g] [--rounds 5]
      [--cold] [--dir D]

The preset's random state (default: 1 GiB, 64 leaves of 1024x4096 float32
on a (data=2, model=4) mesh of 8 CPU devices, half sharded by rows over
``model``, half by columns) is saved once with ckpt, then restored onto the
same shardings with ``verify=True`` and ``verify=False`` alternately (the
order flips every round), ``--rounds`` times each, in one Checkpointer;
with ``--cold`` the page cache is dropped before every restore (needs
root). Prints the median and range of the wall and CPU seconds of each
(scripts/benchlib/measure.py), and their ratio.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from scripts.benchlib import measure  # noqa: E402
from scripts.benchlib import presets  # noqa: E402


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--preset", default="leaves64_f32_1g",
                  help="a name in configs/ or a path to a JSON preset")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--cold", action="store_true",
                  help="drop the page cache before every restore (root)")
  ap.add_argument("--dir", default=None)
  a = ap.parse_args(argv)
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  preset = presets.load_preset(a.preset)
  topo = presets.Topology(preset)
  state = presets.build_state(preset, topo)
  target = presets.abstract_state(preset, topo.save_mesh)
  root = tempfile.mkdtemp(dir=a.dir, prefix="verify-cost-")
  try:
    with ckpt.Checkpointer(root, async_save=False) as c:
      c.save(1, state)
    del state
    wall = {True: [], False: []}
    cpu = {True: [], False: []}
    with ckpt.Checkpointer(root) as c:
      for r in range(a.rounds):
        for verify in ((True, False) if r % 2 == 0 else (False, True)):
          if a.cold:
            if not measure.drop_page_cache():
              raise SystemExit("--cold needs root (/proc/sys/vm/drop_caches)")
          with measure.measure(interval_s=0) as m:
            out = c.restore(1, target=target, verify=verify)
            jax.block_until_ready(out)
          wall[verify].append(m.wall_s)
          cpu[verify].append(m.cpu_s)
          if r == 0:
            presets.verify(preset, out)
          del out
    med = statistics.median
    for v in (False, True):
      print(f"verify={v!s:5}: wall median {med(wall[v]):.3f} s "
            f"({min(wall[v]):.3f}-{max(wall[v]):.3f}), CPU median "
            f"{med(cpu[v]):.3f} s")
    print(f"ratio verified/unverified ({'cold' if a.cold else 'warm'}): wall "
          f"{med(wall[True]) / med(wall[False]):.3f}x, CPU "
          f"{med(cpu[True]) / max(med(cpu[False]), 1e-9):.3f}x")
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
