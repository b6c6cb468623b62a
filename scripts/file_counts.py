"""How many files a state of many small leaves becomes, per format.

Saves ``--leaves`` float32 leaves of 1 to 4 KiB each (host numpy arrays, so
their chunks are spread over the processes) as one step, with 1 and with 2
real ``jax.distributed`` processes (``ckpt.multihost.local_cluster``; this file is the
worker too), in zarr, zarr3 and ocdbt, and prints the files and bytes of the
step directory and the save time.

Usage: .venv/bin/python scripts/file_counts.py [--leaves 10000] [--dir DIR]
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

import numpy as np

from ckpt.multihost import local_cluster

SCRIPTS = pathlib.Path(__file__).resolve().parent


def small_leaves(n: int) -> dict:
  rng = np.random.default_rng(0)
  out: dict = {}
  for i in range(n):
    out.setdefault(f"layer_{i // 100}", {})[f"p{i % 100}"] = (
        rng.standard_normal(256 * (1 + i % 4), np.float32))
  return out


def worker(config: dict) -> None:
  local_cluster.init_from_env()
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  state = small_leaves(config["leaves"])
  t0 = time.perf_counter()
  with ckpt.Checkpointer(config["dir"], format=config["format"],
                         async_save=False) as ckptr:
    ckptr.save(1, state)
  local_cluster.write_result({"process": jax.process_index(),
                              "save_s": time.perf_counter() - t0})


def count(step_dir: str) -> tuple[int, int]:
  files = [os.path.join(d, f) for d, _, names in os.walk(step_dir)
           for f in names]
  return len(files), sum(os.path.getsize(f) for f in files)


def main() -> int:
  if local_cluster.ENV_CONFIG in os.environ:
    worker(json.loads(sys.argv[1]))
    return 0
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--leaves", type=int, default=10_000)
  parser.add_argument("--dir", default=None)
  args = parser.parse_args()
  root = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="ckpt-files-"))
  print(f"{args.leaves:,} float32 leaves of 1-4 KiB, one step, in {root}")
  print(f"{'format':8} {'processes':>9} {'files':>7} {'MB':>7} {'save s':>7}")
  for fmt in ("zarr", "zarr3", "ocdbt"):
    for n in (1, 2):
      where = root / f"{fmt}-{n}"
      shutil.rmtree(where, ignore_errors=True)
      results = local_cluster.check(local_cluster.run(
          "file_counts", {"dir": str(where), "format": fmt,
                          "leaves": args.leaves},
          num_processes=n, devices_per_process=1, timeout_s=900,
          cwd=str(SCRIPTS)))
      files, size = count(str(where / "checkpoint_1"))
      save_s = max(r["save_s"] for r in results)
      print(f"{fmt:8} {n:>9} {files:>7,} {size / 1e6:>7.1f} {save_s:>7.1f}",
            flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
