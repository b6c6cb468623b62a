"""One process of a job for tests/tiers/test_papercuts.py: process 0 calls
``save`` and process 1 does not (it waits for process 0's result, then
ends), with ``barrier_timeout_s=3``: what process 0's error says."""

from __future__ import annotations

import os

from tests.multiprocess import worker


def run(conf: dict) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  mark = os.path.join(conf["dir"], "done")
  c = ckpt.Checkpointer(os.path.join(conf["dir"], "ck"), barrier_timeout_s=3,
                        async_save=False)
  out = {"process": jax.process_index(), "error": None}
  if jax.process_index() == 0:
    got = worker.timed(c.save, 1, {"w": np.arange(4.0)})
    out["error"] = got.error and {"type": got.error.type,
                                  "msg": got.error.msg}
    out["seconds"] = got.seconds
    worker.touch(mark)
  else:
    worker.wait_for(mark, 120)
  return out


if __name__ == "__main__":
  worker.main(run)
