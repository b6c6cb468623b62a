"""Worker: process 1's save fails mid-write; every process must learn it at
the next barrier (not at the barrier timeout) and nothing is committed."""

import json
import sys
import time

from ckpt.multihost import local_cluster


def main():
  local_cluster.init_from_env()
  conf = json.loads(sys.argv[1])
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top

  mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
  g = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)
  x = jax.make_array_from_callback(g.shape, NamedSharding(mesh, P("x", "y")),
                                   lambda i: g[i])
  c = ckpt.Checkpointer(conf["dir"], async_save=conf["async"],
                        barrier_timeout_s=conf["timeout"])
  c.save(1, {"w": x})
  c.wait_until_finished()
  if jax.process_index() == 1:
    for s in x.addressable_shards:
      s.data.delete()  # process 1 cannot stage its part of step 2
  t = time.monotonic()
  try:
    c.save(2, {"w": x})
    c.wait_until_finished()
    msg = None
  except ckpt.CheckpointError as e:
    msg = str(e)
  elapsed = time.monotonic() - t
  restored = c.restore(1)["w"]
  local_cluster.write_result({
      "msg": msg, "elapsed": elapsed, "steps": c.all_steps(),
      "step1_exact": bool(np.array_equal(restored, g))})
  c.close()


if __name__ == "__main__":
  main()
