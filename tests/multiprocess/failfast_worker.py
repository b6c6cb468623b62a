"""Worker: process 1's save fails mid-write; every process must learn it at
the next barrier (not at the barrier timeout) and nothing is committed."""

from __future__ import annotations

import dataclasses

from tests.multiprocess import worker
from tests.multiprocess.worker import Outcome


@dataclasses.dataclass(frozen=True)
class Result:
  save: Outcome        # save(2) and its wait, the failure under test
  steps: list[int]     # all_steps() afterwards
  step1_exact: bool    # step 1 restores bit-exact afterwards


def run(conf: dict) -> Result:
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

  def save_2():
    c.save(2, {"w": x})
    c.wait_until_finished()
  save = worker.timed(save_2)
  restored = c.restore(1)["w"]
  out = Result(save, c.all_steps(), bool(np.array_equal(restored, g)))
  c.close()
  return out


if __name__ == "__main__":
  worker.main(run)
