"""Benchmark: ckpt against Orbax's StandardCheckpointer and plain files.

Usage (from the repository root):
  python -m scripts.bench --preset large_f32_1g [--runs 3]
      [--systems ckpt,orbax,raw,rawpack] [--ops save,restore_same,...]
      [--out out/bench/large_f32_1g.json] [--dir /tmp/ckpt-bench] [--evict]
      [--processes N --devices-per-process K]

The state is a preset's (``configs/<name>.json``, scripts/benchlib/presets.py):
random leaves sharded over 8 CPU devices in one process, or over N real
``jax.distributed`` processes. Each system (scripts/benchlib/systems.py:
ckpt, orbax, raw, rawpack) runs in its own fresh worker process, so host
memory is attributed to one system only.

Per run and system, in fresh directories: a synchronous save, a restore
onto the same mesh, a restore onto the preset's other mesh, and an
asynchronous save (the time the caller is blocked, and until it is
finished), each measured by scripts/benchlib/measure.py (wall seconds,
extra peak RSS over the RSS just before it). Bytes and files on disk come
from the synchronous save's directory. Runs are interleaved (run r runs
every system, starting with system r) so that drifts of the disk's speed
hit every system alike; each figure is the median of the runs with its
spread (min-max). After the runs, ``--drift-saves`` consecutive async saves
into one root (``keep=2``) read the RSS after each (ckpt only).

The page cache is not dropped (that needs root and is global to the
machine): restores read files that were just written, so they usually come
from memory. ``--evict`` asks the kernel to drop the checkpoint's own pages
(``posix_fadvise(DONTNEED)``) before each restore.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Any

from scripts.benchlib import measure
from scripts.benchlib import presets
from scripts.benchlib import report
from scripts.benchlib import systems as systems_lib
from scripts.benchlib import workers

GiB = 1 << 30
OPS = ("save", "restore_same", "restore_other", "async")
ROWS = [
    ("save_s", "sync save (s)"),
    ("async_s", "async save: caller blocked (s)"),
    ("async_total_s", "async save: until finished (s)"),
    ("restore_same_s", "restore, same mesh (s)"),
    ("restore_other_s", "restore, other mesh (s)"),
    ("save_rss_extra", "sync save: extra peak RSS (MiB)"),
    ("async_rss_extra", "async save: extra peak RSS (MiB)"),
    ("restore_same_rss_extra", "restore same: extra peak RSS (MiB)"),
    ("restore_other_rss_extra", "restore other: extra peak RSS (MiB)"),
    ("drift_rss_5", "RSS after async save 5 (MiB)"),
    ("drift_rss_last", "RSS after the last async save (MiB)"),
    ("drift_ratio", "RSS drift, save 5 -> last"),
    ("disk_bytes", "bytes on disk (MiB)"),
    ("disk_files", "files on disk"),
]


# ---- the operations, run inside a worker (Session.run) ------------------------


def save(session, op) -> dict[str, Any]:
  from ckpt.multihost import process as multihost  # pylint: disable=g-import-not-at-top
  with measure.measure() as m:
    session.system.save(op["dir"], session.state)
  multihost.barrier(f"bench/saved/{op['dir']}", what="every process saved")
  size, files = measure.disk_usage(op["dir"])
  return {"save_s": m.wall_s, "save_rss_extra": m.extra_rss,
          "disk_bytes": size, "disk_files": files}


def save_async(session, op) -> dict[str, Any]:
  with measure.measure() as m:
    wait = session.system.save_async(op["dir"], session.state)
    if wait is None:
      return {}
    blocked = m.lap()
    wait()
  return {"async_s": blocked, "async_total_s": m.wall_s,
          "async_rss_extra": m.extra_rss}


def restore(session, op) -> dict[str, Any]:
  mesh = op["mesh"]
  if op.get("evict"):
    measure.evict(op["dir"])
  with measure.measure() as m:
    restored = session.system.restore(op["dir"], session.targets[mesh])
    session.jax.block_until_ready(restored)
  out = {f"restore_{mesh}_s": m.wall_s,
         f"restore_{mesh}_rss_extra": m.extra_rss}
  if op.get("verify"):
    out[f"restore_{mesh}_shards_verified"] = presets.verify(session.preset,
                                                            restored)
  return out


def drift(session, op) -> dict[str, Any]:
  measure.malloc_trim()
  rss = session.system.drift(op["dir"], session.state, op["saves"])
  if rss is None:
    return {}
  fifth = rss[min(4, len(rss) - 1)]
  return {"drift_rss_5": fifth, "drift_rss_last": rss[-1],
          "drift_ratio": rss[-1] / fifth - 1, "drift_saves": len(rss)}


def run_ops(base: str, args, verify: bool) -> list[dict[str, Any]]:
  """One run's operations for one system, each in a fresh directory."""
  sync_dir, async_dir = f"{base}-sync", f"{base}-async"
  ops = [{"fn": "scripts.bench:save", "dir": sync_dir}]
  for mesh in ("same", "other"):
    if f"restore_{mesh}" in args.ops:
      ops.append({"fn": "scripts.bench:restore", "dir": sync_dir,
                  "mesh": mesh, "evict": args.evict, "verify": verify})
  if "async" in args.ops:
    ops.append({"fn": "scripts.bench:save_async", "dir": async_dir})
  return ops


# ---- the driver ---------------------------------------------------------------


def run_single_process(preset_file: str, systems: list[str], args,
                       workdir: str) -> tuple[dict, dict]:
  raw: dict[str, dict[str, list]] = {}
  with workers.Workers(systems, preset_file, args.devices) as pool:
    for r, s, worker in pool.rounds(args.runs):
      t0 = time.perf_counter()
      base = os.path.join(workdir, f"{s}-r{r}")
      for op in run_ops(base, args, verify=args.verify and r == 0):
        report.record(raw, s, worker.run(op))
      for suffix in ("-sync", "-async"):
        shutil.rmtree(base + suffix, ignore_errors=True)
      print(f"  run {r + 1}/{args.runs} {s}: save {raw[s]['save_s'][-1]:.2f} s"
            f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    for s in systems if args.drift_saves > 0 else ():
      where = os.path.join(workdir, f"{s}-drift")
      report.record(raw, s, pool.procs[s].run(
          {"fn": "scripts.bench:drift", "dir": where,
           "saves": args.drift_saves}))
      shutil.rmtree(where, ignore_errors=True)
    return raw, pool.info


def run_multi_process(preset_file: str, systems: list[str], args,
                      workdir: str) -> tuple[dict, dict]:
  raw: dict[str, dict[str, list]] = {}
  info: dict[str, Any] = {}
  for s in systems:
    ops = [op for r in range(args.runs) for op in run_ops(
        os.path.join(workdir, f"{s}-r{r}"), args, args.verify and r == 0)]
    t0 = time.perf_counter()
    results = workers.run_job(s, preset_file, ops, processes=args.processes,
                              devices_per_process=args.devices_per_process,
                              timeout_s=args.timeout)
    info[s] = {"build_s": max(p["build_s"] for p in results),
               "processes": args.processes, "job_s": time.perf_counter() - t0}
    for i in range(len(ops)):
      per = [p["results"][i] for p in results]
      # The slowest process's time, the largest process's memory; the
      # shards verified add up.
      report.record(raw, s, {k: (sum if k.endswith("verified") else max)(
          p[k] for p in per) for k in per[0]})
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir, exist_ok=True)
    print(f"  {s}: {args.runs} runs on {args.processes} processes in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
  return raw, info


def targets(figures: dict[str, dict], budget: int | None,
            ckpt: str = "ckpt", state_bytes: int = 0) -> list[dict]:
  """The issues' targets for system ``ckpt``, as ratios of medians."""
  out = []

  def med(system, key):
    return figures.get(system, {}).get(key, {}).get("median")

  def add(name, value, limit, kind, detail):
    if value is None:
      return
    met = value >= limit if kind == ">=" else value <= limit
    out.append({"system": ckpt, "target": name, "value": value, "limit": limit,
                "comparison": kind, "met": bool(met), "detail": detail})

  def ratio(name, a, b, limit, kind):
    (sa, ka), (sb, kb) = a, b
    if med(sa, ka) and med(sb, kb):
      add(name, med(sa, ka) / med(sb, kb), limit, kind,
          f"{'ckpt' if sa == ckpt else sa} {ka} / "
          f"{'ckpt' if sb == ckpt else sb} {kb}")

  # Issue 16's targets.
  ratio("sync save within 1.2x of raw", (ckpt, "save_s"), ("raw", "save_s"),
        1.2, "<=")
  ratio("sync save faster than Orbax", ("orbax", "save_s"), (ckpt, "save_s"),
        1.0, ">=")
  ratio("async blocking <= Orbax's", (ckpt, "async_s"), ("orbax", "async_s"),
        1.0, "<=")
  for mesh in ("same", "other"):
    key = f"restore_{mesh}_s"
    ratio(f"restore ({mesh} mesh) within 1.2x of raw", (ckpt, key),
          ("raw", key), 1.2, "<=")
    ratio(f"restore ({mesh} mesh) faster than Orbax", ("orbax", key),
          (ckpt, key), 1.0, ">=")
  # Issue 26 item 1: many small leaves against the packed-bytes limit.
  ratio("sync save within 2x of rawpack", (ckpt, "save_s"),
        ("rawpack", "save_s"), 2.0, "<=")
  ratio("restore (same mesh) within 1.3x of rawpack", (ckpt, "restore_same_s"),
        ("rawpack", "restore_same_s"), 1.3, "<=")
  c = lambda k: med(ckpt, k)
  if budget:
    for key, what in (("save_rss_extra", "sync save"),
                      ("async_rss_extra", "async save")):
      if c(key) is not None:
        add(f"{what} extra peak RSS <= concurrent_bytes + 10%",
            c(key) / budget, 1.1, "<=",
            f"ckpt {key} / concurrent_bytes ({budget / GiB:.2f} GiB)")
    if c("restore_same_rss_extra") is not None and state_bytes:
      add("restore extra peak RSS, less the restored state, <= "
          "concurrent_bytes + 10%",
          (c("restore_same_rss_extra") - state_bytes) / budget, 1.1, "<=",
          "(ckpt restore_same_rss_extra - state bytes) / concurrent_bytes")
  if c("drift_ratio") is not None:
    add("RSS drift over the async saves < 5%", c("drift_ratio"), 0.05, "<=",
        "RSS after the last save / RSS after the 5th - 1")
  return out


def main(argv: list[str] | None = None) -> int:
  parser = report.arg_parser(__doc__)
  workers.add_flags(parser)
  parser.add_argument("--ops", default=None,
                      help=f"comma-separated, from {','.join(OPS)} (default: "
                      "the preset's \"ops\", else all); the sync save "
                      "always runs")
  parser.add_argument("--evict", action="store_true",
                      help="drop the checkpoint's pages from the page cache "
                      "(posix_fadvise) before each restore")
  parser.add_argument("--no-verify", dest="verify", action="store_false",
                      help="do not check restored data (checked in run 1, "
                      "outside the timed part)")
  parser.add_argument("--drift-saves", type=int, default=50,
                      help="after the runs, this many consecutive async "
                      "saves of the state into one root (keep=2), RSS read "
                      "after each (0: skip); single-process runs only")
  parser.add_argument("--processes", type=int, default=1,
                      help="> 1: run each system as a local jax.distributed "
                      "job of this many processes")
  parser.add_argument("--devices-per-process", type=int, default=None)
  parser.add_argument("--timeout", type=float, default=1800.0,
                      help="seconds a multi-process job may take")
  args = parser.parse_args(argv)
  preset = presets.load_preset(args.preset)
  args.ops = (args.ops.split(",") if args.ops else preset.get("ops", list(OPS)))
  for op in args.ops:
    if op not in OPS:
      parser.error(f"unknown op {op!r}; expected some of {OPS}")
  if args.processes > 1:
    args.devices_per_process = args.devices_per_process or max(
        1, args.devices // args.processes)
  systems, notes = workers.pick_systems(parser, args, systems_lib.SYSTEMS)
  notes = [
      "page cache not dropped (needs root, global to the machine): restores "
      "read files just written" + (", evicted per file with "
                                   "posix_fadvise(DONTNEED) first" if args.evict
                                   else ", usually from memory"),
      "extra RSS = peak RSS during the operation (the kernel's VmHWM and "
      "samples every 2 ms) minus RSS just before it; restore figures include "
      "the restored state itself",
      "each system runs in its own worker process; runs are interleaved "
      "across systems; figures are medians with (min-max) over the runs",
      "raw: one file per distinct shard, tofile + fsync on a thread pool; "
      "rawpack: every distinct shard and its table in one file per process, "
      "one write, one fsync; neither has an index, a commit or an async mode",
  ] + notes
  preset_file = str(presets.preset_path(args.preset))
  topo_text = (f"{args.processes} processes x {args.devices_per_process} "
               f"devices" if args.processes > 1 else
               f"1 process x {args.devices} devices")
  nbytes, n_leaves = presets.state_nbytes(preset), len(presets.leaf_specs(preset))
  print(f"bench {preset['name']}: {n_leaves} array leaves, "
        f"{nbytes / report.MiB:,.1f} MiB, {topo_text}, {args.runs} runs of "
        f"{', '.join(systems)}", flush=True)
  t_start = time.perf_counter()
  with workers.workdir(args.dir) as where:
    if args.processes > 1:
      raw, info = run_multi_process(preset_file, systems, args, where)
    else:
      raw, info = run_single_process(preset_file, systems, args, where)
  budget = preset["ckpt"].get("concurrent_bytes")
  if budget is None and any(systems_lib.system_kind(s) == "ckpt"
                            for s in systems):
    from ckpt import checkpointer  # pylint: disable=g-import-not-at-top
    budget = checkpointer.DEFAULT_CONCURRENT_BYTES
  figures = {s: {k: report.summarize(v) for k, v in raw.get(s, {}).items()}
             for s in systems}
  out = {
      "preset": preset["name"], "config": preset, "runs": args.runs,
      "systems": figures,
      "targets": [t for s in systems if systems_lib.system_kind(s) == "ckpt"
                  for t in targets(figures, budget, s, nbytes)],
      "ckpt_concurrent_bytes": budget,
      "state": {"array_leaves": n_leaves, "bytes": nbytes,
                "scalars": len(preset["scalars"])},
      "topology": {"processes": args.processes,
                   "devices": (args.devices if args.processes == 1 else
                               args.processes * args.devices_per_process)},
      "workers": info, "machine": report.machine(), "notes": notes,
      "command": report.command("scripts.bench", argv),
      "wall_s": time.perf_counter() - t_start,
  }
  out_path = args.out or os.path.join(presets.ROOT, "out", "bench",
                                      f"{preset['name']}.json")
  report.write(out_path, out)
  print(f"\n{preset['name']}: {n_leaves} array leaves, "
        f"{nbytes / report.MiB:,.1f} MiB, {topo_text}, median (min-max) of "
        f"{args.runs} runs")
  print(report.figure_table(figures, ROWS))
  if out["targets"]:
    print("\ntargets (ratios of medians from this run):")
    for t in out["targets"]:
      who = "" if t["system"] == "ckpt" else f"{t['system']}: "
      print(f"  [{'met' if t['met'] else 'MISSED'}] {who}{t['target']}: "
            f"{t['value']:.2f} (limit {t['comparison']} {t['limit']}; "
            f"{t['detail']})")
  print()
  for n in notes:
    print(f"note: {n}")
  print(f"wrote {out_path} ({out['wall_s']:.0f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
