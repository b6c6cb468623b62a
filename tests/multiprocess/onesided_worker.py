"""One process of a job for tests/test_errors.py: process 0 calls ``save``
and process 1 does not (it waits for process 0's result, then ends), with
``barrier_timeout_s=3``: what process 0's error says."""

from __future__ import annotations

import dataclasses
import os

from tests.multiprocess import worker
from tests.multiprocess.worker import Outcome


@dataclasses.dataclass(frozen=True)
class Result:
  process: int
  save: Outcome | None  # process 0's save(1); None on process 1


def run(conf: dict) -> Result:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  mark = os.path.join(conf["dir"], "done")
  c = ckpt.Checkpointer(os.path.join(conf["dir"], "ck"), barrier_timeout_s=3,
                        async_save=False)
  if jax.process_index() == 0:
    got = worker.timed(c.save, 1, {"w": np.arange(4.0)})
    worker.touch(mark)
    return Result(0, got)
  worker.wait_for(mark, 120)
  return Result(jax.process_index(), None)


if __name__ == "__main__":
  worker.main(run)
