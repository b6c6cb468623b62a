"""Benchmark: the per-leaf cost of saving many small leaves (issue 37 item 2).

Usage (from the repository root):
  python -m scripts.bench_small_leaves [--preset small_leaves_10k]
      [--async-leaves 5000] [--runs 5] [--dir /tmp/ckpt-small] [--out F]
  python -m scripts.bench_small_leaves --limits [--runs 3] [--dir D]

``--limits`` (issue 47 item 2) measures against the limit, the plainest code
for the same bytes: ``../shared/limits/limits.py``'s ``small`` case, loaded
by path (never copied), on its own state (10,000 leaves of 3-4 KB on its
(2, 4) mesh of 8 CPU devices), in the same process and round as ckpt,
alternating who goes first each round. It prints, each as a ratio to the
limit (wall, and CPU of the whole process), medians and spread over the
rounds: the process's very first save (once, before the rounds), the first
save of a fresh Checkpointer, a later save, the restore right after it
(``target=`` the state), against ``small_save`` / ``small_restore``; then
``save()``'s blocking time of an async later save of ``--async-leaves``
replicated leaves of 4 KiB against its 0.05 s target, with the full Python
GC passes that ran while the caller was blocked. Each timed call starts
after a ``gc.collect()`` (``--no-collect``: without), so that none pays
for the garbage of the call before it.

In one process on the preset's mesh (8 CPU devices), runs alternate:
- ``plain``: the limit. Every distinct shard's bytes (``distinct_shards``
  of scripts/benchlib/systems.py) concatenated (``np.concatenate``) into
  one file: ``tofile``, ``fsync``, directory ``fsync``;
- ``rawpack``: the benchmark's baseline (systems.RawPackSystem: the same
  bytes plus the table a reader needs, one write);
- ``ckpt``: ``Checkpointer(async_save=False)``, a later save of the same
  tree (the plan cached), into one root (keep=2).
Each is measured in wall seconds and CPU seconds of the whole process
(``getrusage``: every thread); the figures are medians over the runs, and
CPU per leaf. Then the async case: ``--async-leaves`` replicated leaves of
4 KiB saved with ``async_save=True`` (a later save): the time ``save()``
blocks the caller, the CPU time of the caller's thread in it
(``time.thread_time``) and of the whole process while it blocks (every
thread: the background thread stages while the caller waits; on a loaded
machine the figure to compare, where wall time is inflated), and the extra
peak RSS until the save is finished, against the state's bytes.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import statistics
import sys
import time

from scripts.benchlib import measure
from scripts.benchlib import presets
from scripts.benchlib import report
from scripts.benchlib import workers


def _plain(path: str, state) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from scripts.benchlib import systems  # pylint: disable=g-import-not-at-top
  os.makedirs(path)
  pieces = [d.reshape(-1).view(np.uint8)
            for _, x in presets.flat_items(state) if isinstance(x, jax.Array)
            for d, _ in systems.distinct_shards(x)]
  data = np.concatenate(pieces)
  with open(os.path.join(path, "all.bin"), "wb") as f:
    data.tofile(f)
    f.flush()
    os.fsync(f.fileno())
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def sync_figures(preset: dict, root: str, runs: int) -> dict[str, dict]:
  """plain, rawpack and ckpt's sync save, alternating, ``runs`` times."""
  import ckpt  # pylint: disable=g-import-not-at-top
  from scripts.benchlib import systems  # pylint: disable=g-import-not-at-top
  state = presets.build_state(preset, presets.Topology(preset))
  rawpack = systems.RawPackSystem({})
  ckptr = ckpt.Checkpointer(os.path.join(root, "ckpt"), async_save=False,
                            keep=2, **preset.get("ckpt", {}))
  ckptr.save(0, state)  # the first save plans; the later ones replay it
  _plain(os.path.join(root, "plain-warm"), state)  # distinct_shards' cache
  raw: dict[str, dict[str, list]] = {}
  for r in range(runs):
    fns = {"plain": lambda p: _plain(p, state),
           "rawpack": lambda p: rawpack.save(p, state),
           "ckpt": lambda p: ckptr.save(r + 1, state)}
    for name in list(fns)[r % 3:] + list(fns)[:r % 3]:
      with measure.measure(interval_s=0) as m:
        fns[name](os.path.join(root, f"{name}-{r}"))
      report.record(raw, name, {"wall_s": m.wall_s, "cpu_s": m.cpu_s})
      if name != "ckpt":
        shutil.rmtree(os.path.join(root, f"{name}-{r}"))
  ckptr.close()
  leaves = len(presets.leaf_specs(preset))
  out = {}
  for name, figs in raw.items():
    out[name] = {k: statistics.median(v) for k, v in figs.items()}
    out[name]["cpu_us_per_leaf"] = out[name]["cpu_s"] / leaves * 1e6
  return out


def async_figures(preset: dict, leaves: int, root: str, runs: int) -> dict:
  """``leaves`` replicated 4 KiB leaves, async saves: blocking, the caller
  thread's CPU, extra peak RSS until finished."""
  import ckpt  # pylint: disable=g-import-not-at-top
  preset = dict(preset, leaves=[{"path": "replicated/{i}", "count": leaves,
                                 "shape": [32, 32], "dtype": "float32",
                                 "spec": []}])
  state = presets.build_state(preset, presets.Topology(preset))
  ckptr = ckpt.Checkpointer(os.path.join(root, "async"), async_save=True,
                            keep=2, **preset.get("ckpt", {}))
  ckptr.save(0, state)
  ckptr.wait_until_finished()
  raw: dict[str, list] = {}
  for r in range(runs):
    with measure.measure() as m:
      t0, p0 = time.thread_time(), time.process_time()
      ckptr.save(r + 1, state)
      caller_cpu = time.thread_time() - t0
      blocked_cpu = time.process_time() - p0
      blocked = m.lap()
      ckptr.wait_until_finished()
    report.record(raw, "async", {"blocked_s": blocked,
                                 "caller_cpu_s": caller_cpu,
                                 "blocked_cpu_s": blocked_cpu,
                                 "total_s": m.wall_s, "cpu_s": m.cpu_s,
                                 "extra_rss": m.extra_rss})
  ckptr.close()
  out = {k: statistics.median(v) for k, v in raw["async"].items()}
  out["state_bytes"] = presets.state_nbytes(preset)
  out["leaves"] = leaves
  return out


def limits_path() -> pathlib.Path | None:
  """``../shared/limits/limits.py`` next to the repository (or, from a
  worktree under /work/wt, /work/shared's), None where there is none."""
  for path in (presets.ROOT / ".." / "shared" / "limits" / "limits.py",
               pathlib.Path("/work/shared/limits/limits.py")):
    if path.exists():
      return path
  return None


def _limits_module():
  """``../shared/limits/limits.py``, loaded by path as its docstring says."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  path = limits_path()
  if path is None:
    raise SystemExit("bench_small_leaves --limits: no ../shared/limits/"
                     "limits.py next to the repository")
  spec = importlib.util.spec_from_file_location("limits", path)
  limits = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(limits)
  return limits


# --limits: a full collection before each timed call (``--no-collect``:
# none), so that no call pays for the garbage of the one before it: ckpt
# pauses the cyclic GC while it saves and restores (ckpt/store/gcpause.py),
# which leaves the collection its objects call for to whatever runs next.
COLLECT = True


def _timed(fn, collect: bool = True) -> tuple[float, float]:
  """(wall, CPU of the whole process) of ``fn()``."""
  if collect and COLLECT:
    import gc  # pylint: disable=g-import-not-at-top
    gc.collect()
  w, c = time.perf_counter(), time.process_time()
  fn()
  return time.perf_counter() - w, time.process_time() - c


def limit_rounds(limits, root: str, runs: int, leaves: int) -> dict:
  """The limit's small_save / small_restore and ckpt's saves and restore of
  the limit's own state, alternating who goes first each round."""
  import ckpt  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  state = limits.small_state(limits.mesh(), leaves)
  raw: dict[str, list] = {}

  def note(name, wall_cpu):
    raw.setdefault(name, []).append(wall_cpu)

  c = ckpt.Checkpointer(os.path.join(root, "process-first"), async_save=False)
  note("process_first_save", _timed(lambda: c.save(0, state)))
  c.close()
  shutil.rmtree(os.path.join(root, "process-first"))

  def limit(r):
    path = os.path.join(root, f"limit-{r}")
    note("limit_save", _timed(lambda: limits.small_save(path, state)))
    note("limit_restore", _timed(lambda: limits.small_restore(path, state)))
    shutil.rmtree(path)

  def ours(r):
    path = os.path.join(root, f"ckpt-{r}")
    ckptr = ckpt.Checkpointer(path, async_save=False, keep=2)
    note("first_save", _timed(lambda: ckptr.save(0, state)))
    note("later_save", _timed(lambda: ckptr.save(1, state)))
    got = []
    note("restore", _timed(lambda: got.append(jax.block_until_ready(
        ckptr.restore(1, target=state)))))
    if r == 0:
      import numpy as np  # pylint: disable=g-import-not-at-top
      assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                 zip(jax.tree.leaves(got[0]), jax.tree.leaves(state)))
    del got
    ckptr.close()
    shutil.rmtree(path)

  for r in range(runs):
    for fn in ((limit, ours) if r % 2 == 0 else (ours, limit)):
      fn(r)
  return raw


def limit_async(root: str, runs: int, leaves: int) -> dict:
  """``save()``'s blocking time of a later async save of ``leaves``
  replicated 4 KiB leaves (on the limit's mesh), and the full GC passes
  (generation 2) that ran while the caller was blocked."""
  import gc  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  limits = _limits_module()
  rep = NamedSharding(limits.mesh(), PartitionSpec())
  rng = np.random.default_rng(1)
  state = {"replicated": {str(i): jax.device_put(
      rng.standard_normal((32, 32), dtype=np.float32), rep)
                          for i in range(leaves)}}
  full = []
  def on_gc(phase, info):
    if phase == "start" and info["generation"] == 2:
      full.append(1)
  ckptr = ckpt.Checkpointer(os.path.join(root, "async"), async_save=True,
                            keep=2)
  ckptr.save(0, state)
  ckptr.wait_until_finished()
  out = {"blocked_s": [], "blocked_cpu_s": [], "full_gcs": []}
  gc.callbacks.append(on_gc)
  try:
    for r in range(runs):
      if COLLECT:  # (before the count: not one of the save's passes)
        gc.collect()
      full.clear()
      wall, cpu = _timed(lambda: ckptr.save(r + 1, state), collect=False)
      out["full_gcs"].append(len(full))
      ckptr.wait_until_finished()
      out["blocked_s"].append(wall)
      out["blocked_cpu_s"].append(cpu)
  finally:
    gc.callbacks.remove(on_gc)
    ckptr.close()
  return out


def limits_main(args) -> int:
  """``--limits``: every figure of issue 47 item 2 as a ratio to the limit."""
  global COLLECT
  COLLECT = not args.no_collect
  limits = _limits_module()
  with open("/proc/loadavg") as f:
    load = f.read().split()[:3]
  leaves = args.limits_leaves
  async_leaves = args.async_leaves
  runs = max(args.runs, 1)
  with workers.workdir(args.dir) as where:
    raw = limit_rounds(limits, where, runs, leaves)
    asy = limit_async(where, max(runs, 3), async_leaves)
  med = {k: (statistics.median(w for w, _ in v),
             statistics.median(c for _, c in v)) for k, v in raw.items()}
  print(f"issue 47 item 2: {leaves} leaves of 3-4 KB (limits.py 'small'), "
        f"{runs} rounds alternating, load {' '.join(load)}, "
        f"{'gc.collect() before each call' if COLLECT else 'no gc.collect()'}")
  print(f"{'':20s} {'wall s':>8s} {'(min-max)':>15s} {'CPU s':>7s} "
        f"{'wall/limit':>10s} {'CPU/limit':>9s} target")
  rows = [("limit_save", "limit_save", ""), ("limit_restore", "limit_restore", ""),
          ("process_first_save", "limit_save", "(report)"),
          ("first_save", "limit_save", "<= 2x"),
          ("later_save", "limit_save", "<= 1x"),
          ("restore", "limit_restore", "<= 1.3x")]
  out = {}
  for name, against, target in rows:
    walls = [w for w, _ in raw[name]]
    w, c = med[name]
    lw, lc = med[against]
    out[name] = {"wall_s": w, "cpu_s": c, "wall_ratio": w / lw,
                 "cpu_ratio": c / lc, "walls": walls}
    print(f"{name:20s} {w:8.3f} ({min(walls):.3f}-{max(walls):.3f}) {c:7.3f} "
          f"{w / lw:10.2f} {c / lc:9.2f} {target}")
  b = statistics.median(asy["blocked_s"])
  print(f"async save() blocked, {async_leaves} leaves of 4 KiB: {b:.3f} s "
        f"({min(asy['blocked_s']):.3f}-{max(asy['blocked_s']):.3f}; process "
        f"CPU {statistics.median(asy['blocked_cpu_s']):.3f} s; full GC passes "
        f"while blocked: {asy['full_gcs']}) = {b / 0.05:.2f}x the 0.05 s "
        "target")
  out["async"] = asy
  out_path = args.out or os.path.join(presets.ROOT, "out", "bench",
                                      "small_leaves_limits.json")
  report.write(out_path, {"rounds": runs, "load": load, "figures": out,
                          "machine": report.machine()})
  print(f"wrote {out_path}")
  return 0


def main(argv: list[str] | None = None) -> int:
  parser = report.arg_parser(__doc__)
  parser.add_argument("--limits", action="store_true",
                      help="issue 47 item 2: every figure against limits.py")
  parser.add_argument("--limits-leaves", type=int, default=10_000,
                      help="--limits: leaves of limits.small_state")
  parser.add_argument("--no-collect", action="store_true",
                      help="--limits: no gc.collect() before each timed call")
  parser.add_argument("--preset", default="small_leaves_10k")
  parser.add_argument("--async-leaves", type=int, default=5000)
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--dir", default=None)
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  os.environ.setdefault("XLA_FLAGS",
                        "--xla_force_host_platform_device_count=8")
  if args.limits:
    return limits_main(args)
  preset = presets.load_preset(args.preset)
  with workers.workdir(args.dir) as where:
    sync = sync_figures(preset, where, args.runs)
    asy = async_figures(preset, args.async_leaves, where, args.runs)
  limit = sync["plain"]
  print(f"{preset['name']}: {len(presets.leaf_specs(preset))} leaves, "
        f"median of {args.runs} runs (CPU: every thread of the process)")
  print(f"{'':10s} {'wall s':>8s} {'CPU s':>8s} {'CPU us/leaf':>12s} "
        f"{'wall / plain':>13s} {'CPU / plain':>12s}")
  for name, f in sync.items():
    print(f"{name:10s} {f['wall_s']:8.3f} {f['cpu_s']:8.3f} "
          f"{f['cpu_us_per_leaf']:12.1f} {f['wall_s'] / limit['wall_s']:13.2f}"
          f" {f['cpu_s'] / limit['cpu_s']:12.2f}")
  print(f"async, {asy['leaves']} replicated leaves of 4 KiB "
        f"({asy['state_bytes'] / report.MiB:.1f} MiB): blocked "
        f"{asy['blocked_s']:.3f} s (caller thread CPU "
        f"{asy['caller_cpu_s']:.3f} s, process CPU {asy['blocked_cpu_s']:.3f}"
        f" s), until finished {asy['total_s']:.3f} s,"
        f" extra peak RSS {asy['extra_rss'] / report.MiB:.1f} MiB "
        f"({asy['extra_rss'] / asy['state_bytes']:.2f}x the state)")
  out = {"preset": preset["name"], "runs": args.runs, "sync": sync,
         "async": asy, "machine": report.machine(),
         "command": report.command("scripts.bench_small_leaves", argv)}
  out_path = args.out or os.path.join(presets.ROOT, "out", "bench",
                                      "small_leaves.json")
  report.write(out_path, out)
  print(f"wrote {out_path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
