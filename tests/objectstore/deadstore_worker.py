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

import json
import os
import sys
import time


def main(argv: list[str]) -> None:
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  config = json.loads(argv[1])
  local_cluster.init_from_env()
  if local_cluster.config_from_env()["process_id"] == 1:
    # Before TensorStore's first request; after the coordinator's channel
    # is up, and gRPC told to ignore it (it reads http_proxy too).
    os.environ["no_grpc_proxy"] = "*"
    os.environ["http_proxy"] = config["proxy"]
  import jax  # pylint: disable=g-import-not-at-top
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
  t = time.monotonic()
  error = kind = None
  try:
    c.save(2, {"w": x})
  except Exception as e:  # pylint: disable=broad-except
    error, kind = str(e), type(e).__name__
  local_cluster.write_result({"process": me, "error": error, "type": kind,
                              "seconds": time.monotonic() - t})
  c.close()


if __name__ == "__main__":
  main(sys.argv)
