"""One process of a job whose store dies for process 1 only, mid-save.

Run by ``test_store_dies.py`` through ``ckpt.multihost.local_cluster``. Process 1
reaches the S3 server (moto) through the test's proxy (``http_proxy``: curl
sends every request there), process 0 directly, so both name the same
endpoint in their kvstore spec (the coordination keys derive from it).
Every process saves step 1 (committed), says so with a file, waits for the
test's "go" file (the test has black-holed the proxy by then) and saves
step 2 with ``save_timeout_s=config["bound"]``; it reports the error and
how long the failed save took.
"""

from __future__ import annotations

import dataclasses
import os
import time

from tests.multiprocess import worker
from tests.multiprocess.worker import Outcome


@dataclasses.dataclass(frozen=True)
class Result:
  process: int
  save: Outcome   # save(2), the store gone (process 1's) meanwhile


def run(config: dict) -> Result:
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_index() == 1:
    # Before TensorStore's first request; after the coordinator's channel
    # is up, and gRPC told to ignore it (it reads http_proxy too).
    os.environ["no_grpc_proxy"] = "*"
    os.environ["http_proxy"] = config["proxy"]
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top

  me = jax.process_index()
  mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
  g = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
  x = jax.make_array_from_callback(g.shape, NamedSharding(mesh, P("x", "y")),
                                   lambda i: g[i])
  c = ckpt.Checkpointer(config["url"], async_save=False, barrier_timeout_s=90,
                        save_timeout_s=config["bound"],
                        query_timeout_s=config["bound"])
  c.save(1, {"w": x})
  with open(os.path.join(config["sync"], f"saved_{me}"), "w"):
    pass
  go = os.path.join(config["sync"], "go")
  deadline = time.monotonic() + 60
  while not os.path.exists(go):
    if time.monotonic() > deadline:
      raise RuntimeError("the test never said go")
    time.sleep(0.02)
  out = Result(me, worker.timed(c.save, 2, {"w": x}))
  c.close()
  return out


if __name__ == "__main__":
  worker.main(run)
