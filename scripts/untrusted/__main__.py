"""``python -m scripts.untrusted``: see scripts/untrusted/__init__.py."""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys

from scripts.untrusted import cases
from scripts.untrusted import dense

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The index size of the dense items per preset (None: the cap).
DENSE_BYTES = {"full": None, "smoke": 1 << 20}


def _fresh(module: str, *args: str) -> str:
  """``python -m module args`` in a fresh process; its output line."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, check=False,
                        timeout=1800)
  if proc.returncode != 0:
    raise RuntimeError(f"{module} {' '.join(args)} failed:\n"
                       f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
  return proc.stdout.strip().splitlines()[-1]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--preset", choices=sorted(cases.PRESETS), default="full")
  ap.add_argument("--dir", default="/tmp/ckpt-untrusted",
                  help="where the hostile files are built (emptied first)")
  ap.add_argument("--items", default=",".join(dense.ITEMS),
                  help="the dense items to decode, comma-separated hex")
  args = ap.parse_args()
  paths = cases.build(args.dir, args.preset)
  for case, path in paths.items():
    print(_fresh("scripts.untrusted.case", case, path), flush=True)
  size = DENSE_BYTES[args.preset]
  for item in args.items.split(","):
    extra = () if size is None else ("--bytes", str(size))
    print(_fresh("scripts.untrusted.dense", item, *extra), flush=True)


if __name__ == "__main__":
  main()
