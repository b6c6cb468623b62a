"""Draws the charts of the docs' Benchmarks page as SVGs.

Reads the JSON files the benchmark scripts write with --out:
  scripts/bench.py --preset P --out F        -> P.svg (seconds and extra RSS
                                                per operation, per system)
  scripts/bench.py --read-once --out F       -> read_once_fetched.svg,
                                                read_once_time.svg
  scripts/scale.py --part jobs --out F       -> scale_jobs.svg
  scripts/bench_index.py rows per version    -> index.svg

  python scripts/charts.py                   # the files in docs/benchmarks/data
  python scripts/charts.py --bench out/bench/large_f32_1g.json --out /tmp/c

With no file arguments it reads docs/benchmarks/data/ (each file says where
its figures come from: a run's own --out file, or figures transcribed from
an earlier table) and writes the SVGs next to it, in docs/benchmarks/. Needs matplotlib (in the `docs` extra).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "benchmarks" / "data"
MiB = 1 << 20
SYSTEM_COLORS = {"ckpt": "#1f6fb4", "orbax": "#e8892b", "limit": "#4d4d4d",
                 "raw": "#7a7a7a",
                 "rawpack": "#b0b0b0"}
TIME_OPS = [("save_s", "sync save"), ("async_s", "async save:\ncaller blocked"),
            ("async_total_s", "async save:\nuntil finished"),
            ("restore_same_s", "restore,\nsame mesh"),
            ("restore_other_s", "restore,\nother mesh")]
RSS_OPS = [("save_rss_extra", "sync save"), ("async_rss_extra", "async save"),
           ("restore_same_rss_extra", "restore,\nsame mesh"),
           ("restore_other_rss_extra", "restore,\nother mesh")]


def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("svg")
  # Reproducible files: no date, fixed ids, text kept as text.
  matplotlib.rcParams.update({"svg.hashsalt": "ckpt-docs",
                              "svg.fonttype": "none",
                              "font.size": 9})
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def _save(fig, path: pathlib.Path) -> pathlib.Path:
  fig.tight_layout()
  fig.savefig(path, format="svg", metadata={"Date": None, "Creator": None})
  _pyplot().close(fig)
  return path


def _grouped_bars(ax, systems: dict, ops, scale: float, unit: str):
  names = [s for s in systems if any(k in systems[s] for k, _ in ops)]
  width = 0.8 / max(1, len(names))
  for i, s in enumerate(names):
    xs, meds, errs = [], [], [[], []]
    for j, (key, _) in enumerate(ops):
      f = systems[s].get(key)
      if f is None:
        continue
      xs.append(j + (i - (len(names) - 1) / 2) * width)
      meds.append(f["median"] / scale)
      errs[0].append((f["median"] - f["min"]) / scale)
      errs[1].append((f["max"] - f["median"]) / scale)
    ax.bar(xs, meds, width, yerr=errs, capsize=2, label=s,
           color=SYSTEM_COLORS.get(s.split("@")[0]))
  ax.set_xticks(range(len(ops)), [label for _, label in ops])
  ax.set_ylabel(unit)
  ax.legend(frameon=False)
  ax.spines[["top", "right"]].set_visible(False)


def bench_chart(report: dict, out_dir: pathlib.Path) -> pathlib.Path:
  """Seconds and extra peak RSS per operation and system, one preset."""
  plt = _pyplot()
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6),
                                    gridspec_kw={"width_ratios": [5, 4]})
  systems = report["systems"]

  def measured(ops):  # the operations this run measured
    return [(k, label) for k, label in ops
            if any(k in figures for figures in systems.values())]

  _grouped_bars(left, systems, measured(TIME_OPS), 1,
                "seconds (median, min-max)")
  left.set_title(f"{report['preset']}: time")
  _grouped_bars(right, systems, measured(RSS_OPS), MiB,
                "MiB (median, min-max)")
  right.set_title(f"{report['preset']}: extra peak RSS")
  return _save(fig, out_dir / f"{report['preset']}.svg")


def _read_once_groups(rows):
  keys = []
  for r in rows:
    k = (r["state"], r["store"], r["processes"])
    if k not in keys:
      keys.append(k)
  return keys


def read_once_charts(report: dict, out_dir: pathlib.Path) -> list[pathlib.Path]:
  """MiB fetched over all processes and restore seconds, read once on/off."""
  plt = _pyplot()
  rows = report["rows"]
  groups = _read_once_groups(rows)
  labels = [f"{s}\n{st}, {n} proc" for s, st, n in groups]
  out = []
  for name, key, scale, unit in (
      ("read_once_fetched", "fetched_total", MiB, "MiB fetched, all processes"),
      ("read_once_time", "time_s", 1, "restore seconds (slowest process)")):
    fig, ax = plt.subplots(figsize=(10, 3.4))
    for i, on in enumerate((True, False)):
      xs, ys = [], []
      for j, g in enumerate(groups):
        for r in rows:
          if (r["state"], r["store"], r["processes"]) == g and r["read_once"] == on:
            xs.append(j + (i - 0.5) * 0.4)
            ys.append(r[key] / scale)
      ax.bar(xs, ys, 0.4, label=f"read once {'on' if on else 'off'}",
             color="#1f6fb4" if on else "#b0b0b0")
    if key == "fetched_total":
      stored = [next(r["stored"] for r in rows
                     if (r["state"], r["store"], r["processes"]) == g) / MiB
                for g in groups]
      ax.plot(range(len(groups)), stored, "k_", markersize=22,
              label="stored (1.00x)")
    ax.set_xticks(range(len(groups)), labels)
    ax.set_ylabel(unit)
    ax.legend(frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    out.append(_save(fig, out_dir / f"{name}.svg"))
  return out


def scale_jobs_chart(report: dict, out_dir: pathlib.Path) -> pathlib.Path:
  """Save and restore seconds against the process count (a line per leaf
  count), with the save's floor on this machine: the job's CPU seconds per
  save divided by its cores."""
  plt = _pyplot()
  rows = report["parts"]["jobs"]
  cores = report.get("machine", {}).get("cpus") or 1
  fig, ax = plt.subplots(figsize=(6.4, 3.6))
  for leaves in sorted({r["leaves"] for r in rows}):
    mine = sorted((r for r in rows if r["leaves"] == leaves),
                  key=lambda r: r["processes"])
    n = [r["processes"] for r in mine]
    for key, label, style in (
        ("later_save_s", "save", "o-"), ("restore_s", "restore", "s-"),
        ("save_cpu_s", f"save: job CPU / {cores} cores", "--")):
      if all(key in r for r in mine):
        div = cores if key == "save_cpu_s" else 1
        ax.plot(n, [r[key] / div for r in mine], style,
                label=f"{label} ({leaves} leaves)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(n, [str(x) for x in n])
  ax.set_yscale("log")
  ax.set_xlabel(f"processes (one CPU device each, {cores} shared cores)")
  ax.set_ylabel("seconds (median)")
  ax.legend(frameon=False, fontsize=7)
  ax.spines[["top", "right"]].set_visible(False)
  return _save(fig, out_dir / "scale_jobs.svg")


def index_chart(report: dict, out_dir: pathlib.Path) -> pathlib.Path:
  """Encode and decode CPU seconds at 100,000 leaves, per index version
  (``report["versions"]``: version -> scripts/bench_index.py rows)."""
  plt = _pyplot()
  versions = sorted(report["versions"])
  fig, ax = plt.subplots(figsize=(5.6, 3.2))
  width = 0.38
  for j, (key, label) in enumerate((("encode_cpu_s", "encode"),
                                    ("decode_cpu_s", "decode"))):
    vals = [max(report["versions"][v], key=lambda r: r["leaves"])[key]
            for v in versions]
    xs = [i + (j - 0.5) * width for i in range(len(versions))]
    ax.bar(xs, vals, width, label=label)
  ax.axhline(1.0, color="#7a7a7a", linewidth=0.8, linestyle=":")
  ax.set_xticks(range(len(versions)), [f"version {v}" for v in versions])
  ax.set_ylabel("CPU seconds, 100,000 leaves")
  ax.legend(frameon=False)
  ax.spines[["top", "right"]].set_visible(False)
  return _save(fig, out_dir / "index.svg")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--bench", action="append", default=[],
                      help="a scripts/bench.py --preset report (repeatable)")
  parser.add_argument("--read-once", default=None,
                      help="a scripts/bench.py --read-once report")
  parser.add_argument("--scale", default=None,
                      help="a scripts/scale.py report with a 'jobs' part")
  parser.add_argument("--index", default=None,
                      help="scripts/bench_index.py rows per index version "
                      '({"versions": {"3": [row, ...]}})')
  parser.add_argument("--out", default=str(DATA.parent),
                      help="where the SVGs go (default docs/benchmarks)")
  args = parser.parse_args(argv)
  if not (args.bench or args.read_once or args.scale or args.index):
    args.bench = [str(p) for p in sorted(DATA.glob("*.json"))
                  if "preset" in json.loads(p.read_text())]
    args.read_once = str(DATA / "read_once.json")
    args.scale = str(DATA / "scale_jobs.json")
    args.index = str(DATA / "index.json")
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  written = [bench_chart(json.loads(pathlib.Path(f).read_text()), out_dir)
             for f in args.bench]
  if args.read_once:
    written += read_once_charts(
        json.loads(pathlib.Path(args.read_once).read_text()), out_dir)
  if args.scale:
    report = json.loads(pathlib.Path(args.scale).read_text())
    if "jobs" in report.get("parts", {}):
      written.append(scale_jobs_chart(report, out_dir))
  if args.index:
    written.append(index_chart(
        json.loads(pathlib.Path(args.index).read_text()), out_dir))
  for path in written:
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
