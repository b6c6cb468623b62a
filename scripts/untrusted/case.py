"""One hostile case of scripts/untrusted/cases.py, read in this process:

    python -m scripts.untrusted.case CASE PATH

prints ``CASE: <wall> s, cpu <cpu> s, peak RSS +<MiB> MiB; <outcome>``,
measured by scripts/benchlib/measure.py around the one call a reader makes:
``ckpt.load`` (nils, huge), ``ckpt.format.index.decode`` of the file (dups),
or a lazy restore and the read of one row of its leaf (bomb). The outcome
is what the call returned or the error it raised (its first 150 characters).
Run it in a fresh process per case (``python -m scripts.untrusted`` does):
the peak of one case must not hide another's.
"""

from __future__ import annotations

import argparse
from typing import Callable

from scripts.benchlib import measure

CASES = ("nils", "dups", "huge", "bomb")


def _read_one_row(path: str) -> str:
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.restore import tasks  # pylint: disable=g-import-not-at-top
  from ckpt.shards.plan import Box  # pylint: disable=g-import-not-at-top
  with ckpt.Checkpointer(path) as c:
    leaf = c.restore(1, lazy=True)["w"]
    x = tasks.run_sync(leaf.read_box(Box((0, 0), (1, leaf.shape[1]))))
  return f"read a {x.shape} box"


def reader(case: str, path: str) -> Callable[[], str]:
  """The call a reader of ``case`` makes (what it prints when it returns);
  the file of "dups" is read here, outside the measured call."""
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.format import index as index_lib  # pylint: disable=g-import-not-at-top
  if case == "dups":
    with open(path, "rb") as f:
      data = f.read()
    return lambda: (index_lib.decode(data), "decoded")[1]
  if case == "bomb":
    return lambda: _read_one_row(path)
  return lambda: (ckpt.load(path), "loaded")[1]


def run(case: str, path: str) -> str:
  """The line this case prints."""
  fn = reader(case, path)
  m = measure.measure()
  try:
    with m:
      out = fn()
  except Exception as e:  # pylint: disable=broad-except
    out = f"{type(e).__name__}: {str(e)[:150]}"
  return (f"{case}: {m.wall_s:.3f} s, cpu {m.cpu_s:.3f} s, peak RSS "
          f"+{m.extra_rss / 2**20:.0f} MiB; {out}")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("case", choices=CASES)
  ap.add_argument("path")
  args = ap.parse_args()
  print(run(args.case, args.path), flush=True)


if __name__ == "__main__":
  main()
