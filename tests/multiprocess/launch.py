"""One real multi-process job for a test: the worker module run on
``num_processes`` processes (ckpt.multihost.local_cluster), its results checked and
returned in process order."""

from __future__ import annotations

import pathlib

from ckpt.multihost import local_cluster
from tests.multiprocess import worker as worker_lib

REPO = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 180


def launch(worker: str, config: dict, num_processes: int,
           devices_per_process: int, result: type | None = None) -> list:
  """``result``: the dataclass (with a ``process`` field) each process's
  result is decoded into (tests/multiprocess/worker.py); None: the JSON."""
  out = local_cluster.check(local_cluster.run(
      worker, config, num_processes=num_processes,
      devices_per_process=devices_per_process, timeout_s=TIMEOUT_S,
      cwd=str(REPO)))
  assert [r["process"] for r in out] == list(range(num_processes))
  return out if result is None else [worker_lib.decode(result, r)
                                     for r in out]
