"""Benchmark: resident memory over many async saves with pinned staging.

Usage (from the repository root):
  python -m scripts.staging_pool [--gib 1] [--leaves 16] [--saves 100]
      [--dir /dev/shm] [--no-force] [--json F]

Issue 47, item 6: staging through pinned host memory made other JAX users'
resident memory grow at every save and never shrink (marin-community/marin
#6908). This saves the same random float32 state ``--saves`` times with an
async Checkpointer (``keep=2``), waits for each save, and reads the
process's RSS after each. Target: flat after the first save (growth < 1
MiB per save). ``--trim`` calls glibc's ``malloc_trim(0)`` after reading
the RSS of each save and reads it again: what the allocator holds free and
has not returned to the kernel is the difference (the next save's RSS then
starts from the trimmed heap).

On an accelerator ckpt stages every box with ``device_put`` into the
``pinned_host`` memory kind (ckpt/save/staging.py ``start_host_copy``). On
CPU devices it takes views and copies nothing, so by default this forces
the accelerator path there (``staging.cut_on_device`` answers True: every
box is sliced on the device and copied into ``pinned_host`` memory, which
CPU devices have) and counts the pinned copies; ``--no-force`` measures
the CPU path as it is. ``--dir`` defaults to /dev/shm when it exists, so
that 100 saves write no disk (RSS does not count the tmpfs pages).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import ckpt  # noqa: E402
from ckpt.save import staging  # noqa: E402
from scripts.benchlib import measure  # noqa: E402

MIB = 1 << 20


def state(gib: float, leaves: int) -> dict[str, jax.Array]:
  """``leaves`` random float32 (rows, 1024) leaves, ``gib`` GiB in all,
  sharded by rows over every device."""
  devs = np.array(jax.devices())
  sh = NamedSharding(Mesh(devs, ("x",)), P("x"))
  rows = int(gib * (1 << 30)) // leaves // 4096 // len(devs) * len(devs)
  return {f"w{i}": jax.device_put(np.random.default_rng(i).standard_normal(
      (rows, 1024), dtype=np.float32), sh) for i in range(leaves)}


def slope(ys: list[float]) -> float:
  """Least-squares growth per step of ``ys``."""
  xs = range(len(ys))
  mx, my = statistics.fmean(xs), statistics.fmean(ys)
  den = sum((x - mx) ** 2 for x in xs)
  return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=__doc__.split("\n\n", 1)[1])
  ap.add_argument("--gib", type=float, default=1.0)
  ap.add_argument("--leaves", type=int, default=16)
  ap.add_argument("--saves", type=int, default=100)
  ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm")
                  else None)
  ap.add_argument("--no-force", dest="force", action="store_false",
                  help="on CPU, do not force the accelerator staging path")
  ap.add_argument("--trim", action="store_true",
                  help="malloc_trim(0) after each save's RSS, and the RSS "
                  "again")
  ap.add_argument("--json", default=None)
  a = ap.parse_args(argv)
  platform = jax.devices()[0].platform
  forced = a.force and platform == "cpu"
  pinned = {"copies": 0}
  real_start = staging.start_host_copy
  if forced:
    staging.cut_on_device = lambda device: True

  def counted(piece):
    out = real_start(piece)
    if getattr(out.sharding, "memory_kind", None) == "pinned_host":
      pinned["copies"] += 1
    return out
  staging.start_host_copy = counted

  s = state(a.gib, a.leaves)
  nbytes = sum(x.nbytes for x in s.values())
  root = tempfile.mkdtemp(prefix="staging-pool-", dir=a.dir)
  rss, trimmed, copies = [], [], []
  try:
    with ckpt.Checkpointer(root, async_save=True, keep=2,
                           concurrent_bytes=nbytes + 64 * MIB) as c:
      for i in range(a.saves):
        before = pinned["copies"]
        c.save(i, s)
        c.wait_until_finished()
        rss.append(measure.rss())
        if a.trim:
          measure.malloc_trim()
        trimmed.append(measure.rss())
        copies.append(pinned["copies"] - before)
        if i < 3 or (i + 1) % 10 == 0:
          trim = (f" ({trimmed[-1] / MIB:8.1f} after malloc_trim)" if a.trim
                  else "")
          print(f"  save {i + 1:3d}: RSS {rss[-1] / MIB:8.1f} MiB{trim}, "
                f"{copies[-1]} pinned copies", flush=True)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  after_first = [r / MIB for r in rss[1:]]
  growth = slope(after_first)
  growth_trimmed = slope([r / MIB for r in trimmed[1:]])
  print(f"{a.saves} async saves of {nbytes / MIB:,.0f} MiB in {a.leaves} "
        f"leaves on {len(jax.devices())} {platform} devices, keep=2"
        + (", malloc_trim after each; " if a.trim else "; ")
        + ("accelerator staging path FORCED on CPU (boxes cut on the device "
           "and copied into pinned_host memory)" if forced else
           f"staging as on {platform}"))
  print(f"pinned copies per save: {statistics.median(copies):.0f}")
  print(f"RSS after save 1: {rss[0] / MIB:,.1f} MiB; after save 2: "
        f"{after_first[0]:,.1f}; after the last: {after_first[-1]:,.1f}; "
        f"min-max after save 2: {min(after_first):,.1f}-"
        f"{max(after_first):,.1f} MiB")
  print(f"growth after the first save: {growth:+.3f} MiB per save (least "
        f"squares over saves 2..{a.saves}); last - second: "
        f"{after_first[-1] - after_first[0]:+.1f} MiB" + (
            f"; after malloc_trim: {growth_trimmed:+.3f} MiB per save, last "
            f"{trimmed[-1] / MIB:,.1f} MiB" if a.trim else ""))
  print(f"target: growth < 1 MiB per save: "
        f"{'met' if abs(growth) < 1 else 'MISSED'}")
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"args": vars(a), "forced": forced, "platform": platform,
                 "rss": rss, "rss_after_malloc_trim": trimmed,
                 "pinned_copies": copies, "growth_mib_per_save": growth,
                 "growth_after_trim_mib_per_save": growth_trimmed},
                f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
