"""Worker: the "log from rank 0" pattern. Two processes save steps 1-3;
process 0 alone asks every read-only query between the saves, process 1
alone asks some too; the job's later save and restore must work on both,
and no query may wait for the other process."""

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

  me = jax.process_index()
  mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
  sharding = NamedSharding(mesh, P("x", "y"))
  g = np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32)

  def state(s):
    return {"w": jax.make_array_from_callback(g.shape, sharding,
                                              lambda i: g[i] + s)}

  c = ckpt.Checkpointer(conf["dir"], barrier_timeout_s=conf["timeout"],
                        best_metric="loss", keep=5)
  answers, slowest = {}, 0.0
  for s in (1, 2, 3):
    c.save(s, state(s), metrics={"loss": 10.0 - s}, host_state={"p": me})
    c.wait_until_finished()
    t = time.monotonic()
    if me == 0:  # rank-0 logging: the other process does not call these
      answers[s] = {"all": c.all_steps(), "latest": c.latest_step(),
                    "best": c.best_step(), "metrics": c.metrics(s),
                    "meta": sorted(c.metadata(s).shardings),
                    "host_state": c.host_state(s),
                    "should": c.should_save(s + 1)}
    elif s == 2:
      answers[s] = {"all": c.all_steps(), "host_state": c.host_state()}
    slowest = max(slowest, time.monotonic() - t)
  target = {"w": jax.ShapeDtypeStruct(g.shape, g.dtype, sharding=sharding)}
  got = c.restore(target=target)  # collective, on both
  exact = all(np.array_equal(np.asarray(x.data), g[x.index] + 3)
              for x in got["w"].addressable_shards)
  c.save(4, state(4))
  c.close()
  local_cluster.write_result({"process": me, "answers": answers,
                              "slowest_query_s": slowest, "exact": exact,
                              "restored": c.last_restore_step})


if __name__ == "__main__":
  main()
