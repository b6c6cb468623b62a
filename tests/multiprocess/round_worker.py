"""Worker: the save round costs a process whose post did not change no
key-value set (ckpt/multihost/agreement.py ``PostMemory``), and a post that
did change (a host value that differs now) is still heard."""

from __future__ import annotations

import dataclasses

from tests.multiprocess import worker
from tests.multiprocess.worker import Outcome


@dataclasses.dataclass(frozen=True)
class Result:
  kv_calls: list[int]   # last_save_stats.kv_calls of saves 1, 2, 4, 5
  barriers: list[int]   # last_save_stats.barriers of saves 1, 2, 4, 5
  posted: list[int]     # this process's sets in the round of saves 1, 2, 4, 5
  mismatch: Outcome     # save 3: "lr" differs on process 1
  steps: list[int]      # all_steps() afterwards
  exact: bool           # step 5 restores bit-exact


def run(conf: dict) -> Result:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top

  mesh = Mesh(np.array(jax.devices()), ("x",))
  g = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
  x = jax.make_array_from_callback(g.shape, NamedSharding(mesh, P("x")),
                                   lambda i: g[i])
  state = {"w": x, "lr": 0.5, "table": np.arange(16, dtype=np.int32)}
  c = ckpt.Checkpointer(conf["dir"], async_save=False,
                        barrier_timeout_s=conf["timeout"])
  calls, posted, barriers = [], [], []

  from ckpt.multihost import coordination  # pylint: disable=g-import-not-at-top

  def save(step, s):
    coordination.trace_coordination(True)
    c.save(step, s)
    posted.append(sum(m == "key_value_set" and "/start/in/" in a
                      for m, a, _, _ in coordination.trace_coordination(False)))
    calls.append(c.last_save_stats.kv_calls)
    barriers.append(c.last_save_stats.barriers)

  save(1, state)
  save(2, state)
  odd = {**state, "lr": 0.25 if jax.process_index() == 1 else 0.5}
  mismatch = worker.timed(c.save, 3, odd)
  save(4, state)  # posted in full again: the round before refused
  save(5, state)
  restored = c.restore(5)
  exact = bool(np.array_equal(np.asarray(jax.device_get(restored["w"])), g)
               and restored["lr"] == 0.5)
  out = Result(calls, barriers, posted, mismatch, c.all_steps(), exact)
  c.close()
  return out


if __name__ == "__main__":
  worker.main(run)
