"""Reports: medians with their spread, text and markdown tables, JSON out.

A benchmark collects ``{system: {figure: [value per run]}}``; ``summarize``
turns each list into ``{"median", "min", "max", "values"}`` (what
``scripts/charts.py`` reads), ``figure_table`` prints one row per figure
and one column per system as "median (min-max)", ``markdown`` prints rows
of dicts, and ``write`` saves the report with the machine and the command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import statistics
import sys
from typing import Any, Callable, Sequence

MiB = 1 << 20


def summarize(values: list[float]) -> dict[str, Any]:
  return {"median": statistics.median(values), "min": min(values),
          "max": max(values), "values": values}


def record(raw: dict[str, dict[str, list]], system: str,
           figures: dict[str, float]) -> None:
  """Appends one run's ``figures`` of ``system`` to ``raw``."""
  for key, value in figures.items():
    raw.setdefault(system, {}).setdefault(key, []).append(value)


def fmt(key: str, v: float) -> str:
  """A figure by its name: seconds, MiB of RSS and disk, ratios, counts."""
  if key.startswith("train_step"):
    return f"{v:.3f}"
  if key.endswith(("slowdown", "_share")):
    return f"{v:.2f}"
  if key == "drift_ratio":
    return f"{100 * v:+.1f}%"
  if key.endswith("_s"):
    return f"{v:.2f}"
  if "rss" in key or key == "disk_bytes":
    return f"{v / MiB:,.0f}"
  return f"{v:,.0f}"


def figure_table(figures: dict[str, dict[str, dict]],
                 rows: Sequence[tuple[str, str]],
                 format_value: Callable[[str, float], str] = fmt) -> str:
  """One line per (key, label) of ``rows``, one column per system."""
  systems = list(figures)
  cells = [["figure"] + systems]
  for key, label in rows:
    if not any(key in figures[s] for s in systems):
      continue
    row = [label]
    for s in systems:
      f = figures[s].get(key)
      if f is None:
        row.append("-")
      elif f["min"] == f["max"]:
        row.append(format_value(key, f["median"]))
      else:
        row.append(f"{format_value(key, f['median'])} "
                   f"({format_value(key, f['min'])}-"
                   f"{format_value(key, f['max'])})")
    cells.append(row)
  widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
  lines = []
  for j, r in enumerate(cells):
    lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])
                           for i, c in enumerate(r)).rstrip())
    if j == 0:
      lines.append("  ".join("-" * w for w in widths))
  return "\n".join(lines)


def markdown(columns: Sequence[tuple[str, str, str]], rows: list[dict]) -> str:
  """A markdown table: ``columns`` are (header, key, format)."""
  head = "| " + " | ".join(c for c, _, _ in columns) + " |"
  rule = "|" + "|".join("---:" for _ in columns) + "|"
  body = ["| " + " | ".join(f.format(r[k]) for _, k, f in columns) + " |"
          for r in rows]
  return "\n".join([head, rule, *body])


def machine() -> dict[str, Any]:
  """CPUs, platform and the versions of what is measured."""
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  out = {"cpus": os.cpu_count(), "platform": platform.platform(),
         "python": platform.python_version()}
  for pkg in ("jax", "jaxlib", "tensorstore", "numpy", "orbax-checkpoint"):
    with contextlib.suppress(metadata.PackageNotFoundError):
      out[pkg] = metadata.version(pkg)
  return out


def command(module: str, argv: list[str] | None) -> str:
  """The command line that ran a benchmark, as the docs write it."""
  return " ".join(["python -m", module, *(sys.argv[1:] if argv is None
                                         else argv)])


def write(path: str | os.PathLike, report: dict[str, Any]) -> None:
  """``report`` as indented JSON at ``path`` (its folder made)."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(report, indent=1, default=str))


def arg_parser(doc: str) -> argparse.ArgumentParser:
  """A benchmark's parser: its module docstring's first paragraph as the
  description, the rest (usage, what it measures) as the epilog."""
  return argparse.ArgumentParser(
      description=doc.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=doc.split("\n\n", 1)[1])
