"""How many files a state of many small leaves becomes, per format.

Saves ``--leaves`` float32 leaves of 1 to 4 KiB each (host numpy arrays, so
their chunks are spread over the processes) as one step, with 1 and with 2
real ``jax.distributed`` processes (``ckpt.multihost.local_cluster``; this file is the
worker too), in zarr, zarr3 and ocdbt, and prints the files and bytes of the
step directory and the save time.

Usage (from the repository root):
  python -m scripts.file_counts [--leaves 10000] [--formats zarr,zarr3,ocdbt]
      [--process-counts 1,2] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import tempfile

import numpy as np

from ckpt.multihost import local_cluster
from scripts.benchlib import measure

ROOT = pathlib.Path(__file__).resolve().parent.parent


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
  with measure.measure(interval_s=0) as m:
    with ckpt.Checkpointer(config["dir"], format=config["format"],
                           async_save=False) as ckptr:
      ckptr.save(1, state)
  local_cluster.write_result({"process": jax.process_index(),
                              "save_s": m.wall_s})


def count(step_dir: str) -> tuple[int, int]:
  files = [os.path.join(d, f) for d, _, names in os.walk(step_dir)
           for f in names]
  return len(files), sum(os.path.getsize(f) for f in files)


def main(argv: list[str] | None = None) -> int:
  if local_cluster.ENV_CONFIG in os.environ:
    worker(json.loads(sys.argv[1]))
    return 0
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--leaves", type=int, default=10_000)
  parser.add_argument("--formats", default="zarr,zarr3,ocdbt")
  parser.add_argument("--process-counts", default="1,2")
  parser.add_argument("--dir", default=None)
  args = parser.parse_args(argv)
  root = pathlib.Path(tempfile.mkdtemp(prefix="ckpt-files-", dir=args.dir))
  print(f"{args.leaves:,} float32 leaves of 1-4 KiB, one step, in {root}")
  print(f"{'format':8} {'processes':>9} {'files':>7} {'MB':>7} {'save s':>7}")
  for fmt in args.formats.split(","):
    for n in (int(c) for c in args.process_counts.split(",")):
      where = root / f"{fmt}-{n}"
      shutil.rmtree(where, ignore_errors=True)
      results = local_cluster.check(local_cluster.run(
          "scripts.file_counts", {"dir": str(where), "format": fmt,
                                  "leaves": args.leaves},
          num_processes=n, devices_per_process=1, timeout_s=900,
          cwd=str(ROOT)))
      files, size = count(str(where / "checkpoint_1"))
      save_s = max(r["save_s"] for r in results)
      print(f"{fmt:8} {n:>9} {files:>7,} {size / 1e6:>7.1f} {save_s:>7.1f}",
            flush=True)
  shutil.rmtree(root, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
