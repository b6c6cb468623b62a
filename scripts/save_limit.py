"""ckpt's synchronous save against the limit's, in one process (issue 47).

Usage (from the repository root):
  python -m scripts.save_limit [--preset large_f32_1g] [--rounds 5]
      [--systems ckpt,limit] [--dir /tmp/ckpt-save-limit] [--stages]

The preset's state (8 CPU devices) is saved ``--rounds`` times by each of
ckpt (``Checkpointer(async_save=False)``, a new Checkpointer per save, as
scripts/bench.py does) and the limit (``../shared/limits/limits.py``
``dense_save``, loaded by path), alternating who goes first, each into a
fresh directory. ``ckpt-ts`` is ckpt with its raw chunk writes off
(``ckpt.save.rawwrite.RAW_WRITES = False``: every chunk through TensorStore,
as before them), for an A/B in the same process. Per save it prints wall and CPU seconds (every thread,
getrusage), minor page faults and voluntary context switches; then the
medians of the first save and of the later ones as ratios to the limit's.
With ``--stages`` it adds ckpt's ``last_save_stats`` per save.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def _usage():
  return resource.getrusage(resource.RUSAGE_SELF)


def timed(fn):
  import gc  # pylint: disable=g-import-not-at-top
  gc.collect()
  u0, t0 = _usage(), time.perf_counter()
  fn()
  wall = time.perf_counter() - t0
  u1 = _usage()
  return {"wall": wall,
          "cpu": u1.ru_utime - u0.ru_utime + u1.ru_stime - u0.ru_stime,
          "sys": u1.ru_stime - u0.ru_stime,
          "minflt": u1.ru_minflt - u0.ru_minflt,
          "nvcsw": u1.ru_nvcsw - u0.ru_nvcsw}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="large_f32_1g")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--dir", default="/tmp/ckpt-save-limit")
  ap.add_argument("--systems", default="ckpt,limit")
  ap.add_argument("--stages", action="store_true")
  args = ap.parse_args(argv)

  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.save import rawwrite  # pylint: disable=g-import-not-at-top
  from scripts.benchlib import presets  # pylint: disable=g-import-not-at-top
  from scripts.benchlib import systems  # pylint: disable=g-import-not-at-top

  preset = presets.load_preset(args.preset)
  state = presets.build_state(preset, presets.Topology(preset))
  arrays = [x for _, x in presets.flat_items(state) if isinstance(x, jax.Array)]
  limits = systems.load_limits()
  options = dict(preset.get("ckpt", {}))
  shutil.rmtree(args.dir, ignore_errors=True)
  os.makedirs(args.dir)
  with open("/proc/loadavg") as f:
    print(f"load before: {f.read().strip()}  (cores: {os.cpu_count()})")

  stats = []

  def ckpt_save(path, raw=True):
    rawwrite.RAW_WRITES = raw
    try:
      with ckpt.Checkpointer(path, async_save=False, **options) as c:
        c.save(1, state)
        stats.append(c.last_save_stats)
    finally:
      rawwrite.RAW_WRITES = True

  savers = {"ckpt": ckpt_save,
             "ckpt-ts": lambda path: ckpt_save(path, raw=False),
             "limit": lambda path: limits.dense_save(path, arrays)}
  names = args.systems.split(",")
  unknown = [n for n in names if n not in savers]
  if unknown or "limit" not in names:
    ap.error(f"--systems: from {sorted(savers)}, the limit among them; "
             f"got {args.systems!r}")
  runs = {n: [] for n in names}
  for r in range(args.rounds):
    k = r % len(names)  # who goes first rotates
    for name in names[k:] + names[:k]:
      path = os.path.join(args.dir, f"{name}-{r}")
      runs[name].append(timed(lambda: savers[name](path)))
      if args.stages and name != "limit":
        s = stats[-1]
        print(f"   {name} stats: total {s.total_s:.3f} plan {s.plan_s:.3f} "
              f"coord {s.coordination_s:.3f} boxes {s.boxes_written}")
      shutil.rmtree(path, ignore_errors=True)
    line = "  ".join(
        f"{n} {runs[n][-1]['wall']:.3f}s wall {runs[n][-1]['cpu']:.3f}s cpu "
        f"({runs[n][-1]['sys']:.3f} sys) {runs[n][-1]['minflt']} flt "
        f"{runs[n][-1]['nvcsw']} csw" for n in names)
    print(f"round {r}: {line}", flush=True)
  with open("/proc/loadavg") as f:
    print(f"load after: {f.read().strip()}")

  def med(name, key, first):
    xs = [x[key] for x in (runs[name][:1] if first else runs[name][1:])]
    return statistics.median(xs) if xs else float("nan")

  for first in (True, False):
    which = "first save " if first else "later saves"
    lw, lc = med("limit", "wall", first), med("limit", "cpu", first)
    for n in names:
      if n == "limit":
        continue
      w, c = med(n, "wall", first), med(n, "cpu", first)
      print(f"{which}: {n} {w:.3f}s / limit {lw:.3f}s = {w / lw:.2f}x wall;"
            f" cpu {c:.3f}s / {lc:.3f}s = {c / lc:.2f}x")
  shutil.rmtree(args.dir, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
