"""Benchmark: device-to-host staging, on whatever devices jax has.

Usage (from the repository root):
  python -m scripts.bench_staging [--leaves 8] [--mib 128] [--runs 3] [--out F]

Figures (seconds, medians of --runs, fresh device arrays every run):
  serial      np.asarray of one box after another (what staging did before)
  overlapped  copy_to_host_async() on every box first, then np.asarray each
              (what ckpt's staging does now, within the byte budget)
  pinned      device_put of every box to the "pinned_host" memory kind,
              then np.asarray each (where the backend has that kind)
  ckpt        Checkpointer.save(async_save=True): time the caller is
              blocked, and until the save is finished; and a sync save

On CPU devices the first three are views (near zero) and "ckpt blocked" is
the planning and the views. Accelerator figures come only from a machine
that has one. Random data (constant arrays flatter a disk).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import ckpt
from scripts.benchlib import measure


def fresh_state(n: int, mib: int, key) -> dict[str, jax.Array]:
  """``n`` random float32 leaves of ``mib`` MiB, spread over the local
  devices round-robin (one leaf per device at a time)."""
  devs = jax.local_devices()
  rows = mib * (1 << 20) // 4 // 1024
  out = {}
  for i in range(n):
    key, sub = jax.random.split(key)
    x = jax.random.normal(sub, (rows, 1024), jnp.float32)
    out[f"w{i}"] = jax.device_put(x, devs[i % len(devs)])
  jax.block_until_ready(out)
  return out


def timed(fn) -> float:
  with measure.measure(interval_s=0) as m:
    fn()
  return m.wall_s


def serial(state):
  for x in state.values():
    np.asarray(x)


def overlapped(state):
  for x in state.values():
    x.copy_to_host_async()
  for x in state.values():
    np.asarray(x)


def pinned(state):
  moved = [jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
           for x in state.values()]
  for y in moved:
    np.asarray(y)


def has_pinned() -> bool:
  try:
    kinds = jax.local_devices()[0].addressable_memories()
    return any(m.kind == "pinned_host" for m in kinds)
  except Exception:  # pylint: disable=broad-except
    return False


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--leaves", type=int, default=8)
  p.add_argument("--mib", type=int, default=128)
  p.add_argument("--runs", type=int, default=3)
  p.add_argument("--dir", default=None)
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  key = jax.random.key(0)
  figures: dict[str, list[float]] = {}
  ops = {"serial": serial, "overlapped": overlapped}
  if has_pinned():
    ops["pinned"] = pinned
  root = tempfile.mkdtemp(prefix="bench_staging_", dir=args.dir)
  for run in range(args.runs + 1):  # run 0 warms up
    for name, fn in ops.items():
      state = fresh_state(args.leaves, args.mib, key)
      t = timed(lambda: fn(state))
      if run:
        figures.setdefault(name, []).append(t)
      del state
    for mode in ("async", "sync"):
      state = fresh_state(args.leaves, args.mib, key)
      with ckpt.Checkpointer(os.path.join(root, f"{mode}{run}"),
                             async_save=mode == "async",
                             concurrent_bytes=(args.leaves * args.mib + 64) << 20
                             ) as c:
        with measure.measure(interval_s=0) as m:
          c.save(1, state)
          blocked = m.lap()
          c.wait_until_finished()
        total = m.wall_s
      if run:
        figures.setdefault(f"ckpt {mode} save: blocked", []).append(blocked)
        figures.setdefault(f"ckpt {mode} save: total", []).append(total)
      del state
  nbytes = args.leaves * args.mib << 20
  devs = jax.local_devices()
  print(f"{args.leaves} x {args.mib} MiB float32 on {len(devs)} "
        f"{devs[0].platform} device(s) ({devs[0].device_kind}); jax "
        f"{jax.__version__}; medians of {args.runs}")
  report = {}
  for name, vals in figures.items():
    med = statistics.median(vals)
    gbps = nbytes / med / 1e9 if med else None
    report[name] = {"median_s": med, "runs": vals, "GB/s": gbps}
    print(f"{name:28s} {med:8.3f} s  ({min(vals):.3f}-{max(vals):.3f})  "
          f"{gbps or float('inf'):7.1f} GB/s")
  shutil.rmtree(root, ignore_errors=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
