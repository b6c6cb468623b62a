"""Per-file seconds of a test run, from pytest's ``--durations=0`` report.

Usage (from the repository root):
  ./scripts/test --durations=0 -q | tee /tmp/suite.log
  python -m scripts.suite_durations /tmp/suite.log [--top 40]

Sums each test file's setup, call and teardown seconds (what its pytest-xdist
worker spent on it: with ``--dist loadfile`` a file is one worker's) and
prints the files, longest first, with their share of all the files' sum and
the pytest wall time the log ends with: the sum over the workers is the
floor of the wall, the longest file what one worker cannot split.
"""

from __future__ import annotations

import argparse
import collections
import re

_LINE = re.compile(r"^([0-9.]+)s (setup|call|teardown)\s+(\S+?)::")
_WALL = re.compile(r" in ([0-9.]+)s(?: \([0-9:]+\))?(?: =+)?$")


def per_file(text: str) -> tuple[dict[str, float], float | None]:
  """{file: seconds} and the run's wall seconds (None if not found)."""
  files: dict[str, float] = collections.defaultdict(float)
  wall = None
  for line in text.splitlines():
    m = _LINE.match(line)
    if m:
      files[m.group(3)] += float(m.group(1))
    w = _WALL.search(line)
    if w:
      wall = float(w.group(1))
  return dict(files), wall


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("log", help="a pytest log with --durations=0's report")
  ap.add_argument("--top", type=int, default=40)
  args = ap.parse_args(argv)
  with open(args.log, errors="replace") as f:
    files, wall = per_file(f.read())
  total = sum(files.values())
  if not files:
    print("no durations found: run pytest with --durations=0")
    return 1
  print(f"{'seconds':>8} {'share':>6}  file")
  for name, s in sorted(files.items(), key=lambda kv: -kv[1])[:args.top]:
    print(f"{s:8.1f} {100 * s / total:5.1f}%  {name}")
  print(f"{total:8.1f} 100.0%  all {len(files)} files"
        + (f"; pytest wall {wall:.1f} s" if wall is not None else ""))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
