"""Benchmark: ckpt against Orbax's StandardCheckpointer and the limit.

Usage (from the repository root):
  python -m scripts.bench --preset large_f32_1g [--runs 3]
      [--systems ckpt,orbax,limit] [--ops save,restore_same,...]
      [--out out/bench/large_f32_1g.json] [--dir /tmp/ckpt-bench] [--evict]
      [--processes N --devices-per-process K]

The state is a preset's (``configs/<name>.json``, scripts/benchlib/presets.py):
random leaves sharded over 8 CPU devices in one process, or over N real
``jax.distributed`` processes. The systems (scripts/benchlib/systems.py):
ckpt, orbax and ``limit``, the functions of ``../shared/limits/limits.py``
loaded by path (the plainest code that moves the same bytes; its ``small``
case for a preset with ``"limit": "small"``). All of them run in ONE worker
process, the same state, timed in the same rounds (issue 47); every figure
is printed as a ratio to the limit and to Orbax.

Per run and system, in fresh directories: a synchronous save, a restore
onto the same mesh, a restore onto the preset's other mesh, and an
asynchronous save (the time the caller is blocked, and until it is
finished), each measured by scripts/benchlib/measure.py (wall seconds,
extra peak RSS over the RSS just before it). Bytes and files on disk come
from the synchronous save's directory. Runs are interleaved (run r runs
every system, starting with system r: who goes first rotates) so that drifts of the disk's speed
hit every system alike; each figure is the median of the runs with its
spread (min-max), and the ratios are ratios of medians. After the runs, ``--drift-saves`` consecutive async saves
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
  if not session.system.restores_onto(mesh):
    return {}  # the limit restores onto the saved mesh only
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


def run_ops(base: str, args, verify: bool,
            system: str) -> list[dict[str, Any]]:
  """One run's operations for one system, each in a fresh directory."""
  sync_dir, async_dir = f"{base}-sync", f"{base}-async"
  ops = [{"fn": "scripts.bench:save", "dir": sync_dir}]
  for mesh in ("same", "other"):
    if f"restore_{mesh}" in args.ops:
      ops.append({"fn": "scripts.bench:restore", "dir": sync_dir,
                  "mesh": mesh, "evict": args.evict, "verify": verify})
  if "async" in args.ops:
    ops.append({"fn": "scripts.bench:save_async", "dir": async_dir})
  return [dict(op, system=system) for op in ops]


# ---- the driver ---------------------------------------------------------------


def run_single_process(preset_file: str, systems: list[str], args,
                       workdir: str) -> tuple[dict, dict]:
  raw: dict[str, dict[str, list]] = {}
  with workers.Workers(systems, preset_file, args.devices) as pool:
    for r, s, worker in pool.rounds(args.runs):
      t0 = time.perf_counter()
      base = os.path.join(workdir, f"{s}-r{r}")
      for op in run_ops(base, args, args.verify and r == 0, s):
        report.record(raw, s, worker.run(op))
      for suffix in ("-sync", "-async"):
        shutil.rmtree(base + suffix, ignore_errors=True)
      print(f"  run {r + 1}/{args.runs} {s}: save {raw[s]['save_s'][-1]:.2f} s"
            f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    for s in systems if args.drift_saves > 0 else ():
      where = os.path.join(workdir, f"{s}-drift")
      report.record(raw, s, pool.procs[s].run(
          {"fn": "scripts.bench:drift", "dir": where, "system": s,
           "saves": args.drift_saves}))
      shutil.rmtree(where, ignore_errors=True)
    return raw, pool.info


def remove(session, op) -> dict[str, Any]:
  """Process 0 removes a run's directories (every process has passed the
  barrier before this op, so none still reads them)."""
  if session.jax.process_index() == 0:
    for path in op["dirs"]:
      shutil.rmtree(path, ignore_errors=True)
  return {}


def run_multi_process(preset_file: str, systems: list[str], args,
                      workdir: str) -> tuple[dict, dict]:
  """Every system of a group (workers.groups) in one job, who goes first
  rotating per run, as in one process."""
  raw: dict[str, dict[str, list]] = {}
  info: dict[str, Any] = {}
  for labels in workers.groups(systems).values():
    ops, owner = [], []
    for r in range(args.runs):
      for s in workers.rotated(labels, r):
        base = os.path.join(workdir, f"{s}-r{r}")
        ops += run_ops(base, args, args.verify and r == 0, s)
        ops.append({"fn": "scripts.bench:remove",
                    "dirs": [base + "-sync", base + "-async"]})
        owner += [s] * (len(ops) - len(owner))
    t0 = time.perf_counter()
    results = workers.run_job(",".join(labels), preset_file, ops,
                              processes=args.processes,
                              devices_per_process=args.devices_per_process,
                              timeout_s=args.timeout)
    for s in labels:
      info[s] = {"build_s": max(p["build_s"] for p in results),
                 "processes": args.processes, "job_s": time.perf_counter() - t0}
    for i, s in enumerate(owner):
      per = [p["results"][i] for p in results]
      if not per[0]:
        continue
      # The slowest process's time, the largest process's memory; the
      # shards verified add up.
      report.record(raw, s, {k: (sum if k.endswith("verified") else max)(
          p[k] for p in per) for k in per[0]})
    print(f"  {', '.join(labels)}: {args.runs} runs on {args.processes} "
          f"processes in {time.perf_counter() - t0:.0f} s", flush=True)
  return raw, info


def targets(figures: dict[str, dict], budget: int | None,
            ckpt: str = "ckpt", state_bytes: int = 0,
            limit_case: str = "dense") -> list[dict]:
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

  # Issue 47: every ratio against the limit (../shared/limits/limits.py),
  # timed in the same process and rounds; the small case has its own.
  small = limit_case == "small"
  ratio("sync save <= 1x the limit" if small else
        "sync save within 1.2x of the limit", (ckpt, "save_s"),
        ("limit", "save_s"), 1.0 if small else 1.2, "<=")
  ratio("restore (same mesh) within 1.3x of the limit" if small else
        "restore (same mesh) within 1.25x of the limit",
        (ckpt, "restore_same_s"), ("limit", "restore_same_s"),
        1.3 if small else 1.25, "<=")
  ratio("sync save faster than Orbax", ("orbax", "save_s"), (ckpt, "save_s"),
        1.0, ">=")
  ratio("async blocking <= Orbax's", (ckpt, "async_s"), ("orbax", "async_s"),
        1.0, "<=")
  for mesh in ("same", "other"):
    key = f"restore_{mesh}_s"
    ratio(f"restore ({mesh} mesh) faster than Orbax", ("orbax", key),
          (ckpt, key), 1.0, ">=")
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


TIMED = [(k, label) for k, label in ROWS if k.endswith("_s")]
HEADLINE = [("save_s", "sync save"), ("async_s", "async save: caller blocked"),
            ("restore_same_s", "restore, same mesh"),
            ("restore_other_s", "restore, other mesh"),
            ("save_rss_extra", "sync save: extra peak host memory")]


def ratios(figures: dict[str, dict]) -> dict[str, dict[str, dict]]:
  """{system: {figure: {"limit": x, "orbax": y}}}: each timed median of
  every system but the limit over the limit's and over Orbax's median."""
  def med(s, k):
    return figures.get(s, {}).get(k, {}).get("median")
  out: dict[str, dict[str, dict]] = {}
  for s in figures:
    if s == "limit":
      continue
    for key, _ in TIMED:
      for base in ("limit", "orbax"):
        if base != s and med(s, key) is not None and med(base, key):
          out.setdefault(s, {}).setdefault(key, {})[base] = (
              med(s, key) / med(base, key))
  return out


def ratio_table(rat: dict[str, dict[str, dict]]) -> str:
  """One line per timed figure: each system's ratio to the limit and to
  Orbax."""
  cols = [(s, b) for s in rat for b in ("limit", "orbax")
          if any(b in v for v in rat[s].values())]
  cells = [["figure"] + [f"{s} / {b}" for s, b in cols]]
  for key, label in TIMED:
    if any(key in rat[s] for s, _ in cols):
      cells.append([label] + [
          f"{rat[s][key][b]:.2f}x" if b in rat[s].get(key, {}) else "-"
          for s, b in cols])
  widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
  return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(r, widths)))
                   for r in cells)


def headline(figures: dict[str, dict], rat: dict[str, dict[str, dict]]) -> str:
  """The README's headline table: ckpt, Orbax and the limit, and ckpt's
  ratios to the limit and to Orbax (medians of this run)."""
  shown = [s for s in ("ckpt", "orbax", "limit") if s in figures]
  head = ["", *({"ckpt": "ckpt", "orbax": "Orbax", "limit": "the limit"}[s]
                for s in shown), "ckpt / limit", "ckpt / Orbax"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for key, label in HEADLINE:
    if not any(key in figures[s] for s in shown):
      continue
    row = [label]
    for s in shown:
      f = figures[s].get(key)
      row.append("-" if f is None else (
          f"{f['median'] / report.MiB:,.0f} MiB" if "rss" in key else
          f"{f['median']:.2f} s"))
    for base in ("limit", "orbax"):
      r = rat.get("ckpt", {}).get(key, {}).get(base)
      row.append("-" if r is None else f"{r:.2f}x")
    lines.append("| " + " | ".join(row) + " |")
  return "\n".join(lines)


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
  limit_case = preset.get("limit", "dense")
  notes = [
      "page cache not dropped (needs root, global to the machine): restores "
      "read files just written" + (", evicted per file with "
                                   "posix_fadvise(DONTNEED) first" if args.evict
                                   else ", usually from memory"),
      "extra RSS = peak RSS during the operation (the kernel's VmHWM and "
      "samples every 2 ms) minus RSS just before it; restore figures include "
      "the restored state itself",
      "every system runs in one worker process (--processes N: one job of N "
      "processes; ckpt@PATH in its own), the same state; runs are "
      "interleaved, who goes first rotates; figures are medians with "
      "(min-max) over the runs, ratios are ratios of medians",
      f"limit: ../shared/limits/limits.py's {limit_case}_save/"
      f"{limit_case}_restore, loaded by path; no checksums, index, commit "
      "or async mode; it restores onto the saved mesh only",
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
                  for t in targets(figures, budget, s, nbytes, limit_case)],
      "ratios": ratios(figures),
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
  if out["ratios"]:
    print("\nratios of medians, to the limit and to Orbax (< 1: faster):")
    print(ratio_table(out["ratios"]))
  print("\nthe README's headline (markdown, from this run):")
  print(headline(figures, out["ratios"]))
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
