"""Runs a benchmark of scripts/ as its docs say, for the smoke tests of
tests/test_benchmarks*_smoke.py: ``python -m scripts.<name> ...`` from the
repository root, in a subprocess with its own CPU devices."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from scripts.benchlib import systems as systems_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
ORBAX = ["orbax"] if systems_lib.orbax_installed() else []


def run(module: str, *args: str, timeout: float = 200) -> str:
  """``python -m scripts.<module> args``; its stdout (asserts it exited 0,
  with the end of its output in the message)."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  # Never the whole machine's page cache: other tests run beside this one
  # (scripts/benchlib/measure.py drop_page_cache).
  env["CKPT_KEEP_PAGE_CACHE"] = "1"
  proc = subprocess.run([sys.executable, "-m", f"scripts.{module}", *args],
                        cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  return proc.stdout
