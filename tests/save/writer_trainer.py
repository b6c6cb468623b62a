"""A trainer for tests/save/test_writer_process.py, killed by the test.

``python -m tests.save.writer_trainer ROOT STEP MiB``: saves a state of
about ``MiB`` MiB (``state(STEP, MiB)``) with ``writer="process"``
asynchronously; once ``save()`` returned it stops its writer (SIGSTOP: the
test decides when it goes on), prints one JSON line (the writer's pid) and
waits to be killed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np


def state(step: int, mib: int) -> dict:
  rng = np.random.default_rng(step)
  n = mib << 18  # float32
  return {"big": rng.standard_normal(n, dtype=np.float32).reshape(-1, 1024),
          "small": rng.integers(0, 1 << 30, (64, 3), dtype=np.int64),
          "step": step}


def writer_pids() -> list[int]:
  import psutil  # pylint: disable=import-outside-toplevel
  return [p.pid for p in psutil.Process().children()
          if "ckpt.save.writer_main" in " ".join(p.cmdline())]


def main(argv: list[str]) -> int:
  root, step, mib = argv[1], int(argv[2]), int(argv[3])
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax  # pylint: disable=import-outside-toplevel
  import ckpt  # pylint: disable=import-outside-toplevel
  s = state(step, mib)
  s["big"] = jax.device_put(s["big"])
  ckptr = ckpt.Checkpointer(root, writer="process", chunk_bytes=1 << 20,
                            concurrent_bytes=(mib + 64) << 20)
  t0 = time.monotonic()
  ckptr.save(step, s)
  returned = time.monotonic() - t0
  pids = writer_pids()
  for pid in pids:
    os.kill(pid, signal.SIGSTOP)
  print(json.dumps({"writers": pids, "save_s": returned}), flush=True)
  time.sleep(600)
  return 1


if __name__ == "__main__":
  sys.exit(main(sys.argv))
