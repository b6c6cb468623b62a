"""CPU and wall seconds of repeated same-mesh restores of a bench preset in
one process (8 CPU devices): what a restore costs per leaf, without the
other systems of scripts/bench.py. Saves the preset's state once, then
restores it ``--restores`` times onto its own shardings.

  python scripts/restore_cpu.py --preset small_leaves_10k
  python scripts/restore_cpu.py --preset small_leaves_10k --wait 5  # then:
  py-spy record --pid <printed pid> --threads --format raw -o prof.txt
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
SCRIPTS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
sys.path.insert(0, str(SCRIPTS.parent))

import bench  # noqa: E402  pylint: disable=g-import-not-at-top
import jax  # noqa: E402  pylint: disable=g-import-not-at-top

import ckpt  # noqa: E402  pylint: disable=g-import-not-at-top


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="small_leaves_10k")
  parser.add_argument("--restores", type=int, default=3)
  parser.add_argument("--wait", type=float, default=0.0,
                      help="seconds to wait before the restores (to attach "
                      "a profiler to the printed pid)")
  args = parser.parse_args(argv)
  preset = json.loads((SCRIPTS.parent / "configs" /
                       f"{args.preset}.json").read_text())
  state = bench.build_state(preset, bench.Topology(preset))
  target = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      if isinstance(x, jax.Array) else x, state)
  root = tempfile.mkdtemp(prefix="ckpt-restore-cpu-")
  try:
    with ckpt.Checkpointer(root, async_save=False) as c:
      c.save(1, state)
      print(f"pid {os.getpid()}", flush=True)
      time.sleep(args.wait)
      for i in range(args.restores):
        t, cpu = time.perf_counter(), time.process_time()
        got = c.restore(1, target=target)
        jax.block_until_ready(jax.tree_util.tree_leaves(got))
        print(json.dumps({
            "restore": i, "wall_s": round(time.perf_counter() - t, 3),
            "cpu_s": round(time.process_time() - cpu, 3)}), flush=True)
        del got
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
