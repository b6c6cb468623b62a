"""Scale harness: how ckpt's costs grow with processes, leaves and keys.

Usage (from the repository root):
  python -m scripts.scale [--config configs/scale.json]
      [--part plan|jobs|requests|merge|all] [--out out/scale.json]

Each part is a module next to this file (``scripts.scale_<part>``) with ``run(conf) -> list[dict]``
and ``table(rows) -> str``; ``conf`` is the config's section of that name:
- ``plan`` (scale_plan.py): pure planning at many processes and leaves;
- ``jobs`` (scale_jobs.py): real local ``jax.distributed`` jobs of 2 to 16
  processes; where a save's and a restore's time goes (plan, data,
  coordination);
- ``requests`` (scale_requests.py): object-store requests per save/restore;
- ``merge`` (scale_merge.py): the OCDBT merge of P per-process databases.
A part whose module or section is missing is skipped with a message.
Presets: ``configs/scale.json`` (full: minutes) and
``configs/scale_smoke.json`` (seconds).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import platform
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
PARTS = ("plan", "jobs", "requests", "merge")


def load_part(part: str):
  """The part's module, or None if it does not exist (yet)."""
  name = f"scripts.scale_{part}"
  try:
    return importlib.import_module(name)
  except ModuleNotFoundError as e:
    if e.name != name:
      raise  # the module exists but something it imports does not
    return None


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=__doc__.split("\n\n", 1)[1])
  parser.add_argument("--config", default=str(ROOT / "configs" / "scale.json"),
                      help="a JSON file with one section per part")
  parser.add_argument("--part", default="all", choices=PARTS + ("all",))
  parser.add_argument("--out", default=None, help="also write the rows as JSON")
  args = parser.parse_args(argv)

  with open(args.config) as f:
    config = json.load(f)
  parts = PARTS if args.part == "all" else (args.part,)
  report = {"config": os.path.relpath(os.path.abspath(args.config), ROOT),
            "machine": {"cpus": os.cpu_count(),
                        "platform": platform.platform()},
            "parts": {}, "skipped": {}}
  for part in parts:
    if part not in config:
      why = f"no {part!r} section in {args.config}"
    elif (module := load_part(part)) is None:
      why = f"scripts/scale_{part}.py does not exist"
    else:
      why = None
    print(f"## {part}\n", flush=True)
    if why:
      print(f"skipped: {why}\n", flush=True)
      report["skipped"][part] = why
      continue
    section = config[part]
    if section.get("description"):
      print(section["description"] + "\n")
    t0 = time.perf_counter()
    rows = module.run({k: v for k, v in section.items() if k != "description"})
    print(module.table(rows))
    load = os.getloadavg()
    print(f"\n({part}: {time.perf_counter() - t0:.0f} s; load average "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} "
          "cores)\n", flush=True)
    report["parts"][part] = rows
    report.setdefault("load_average", {})[part] = load
  if args.out:
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
