"""Worker: restore_async in a 2-process job (tests/multiprocess/test_restore_async_mp.py).

Steps 1 and 2 of a leaf sharded by rows (each process holds half); then:
- overlap: restore_async(1), a jitted step compiled meanwhile, result()
  bit-exact;
- refused: a save while a restore_async is in flight is refused on both
  processes, and result() still works;
- failure: a chunk of step 2 that only process 1 reads is damaged;
  restore_async(2).result() raises on both processes (process 1 its
  CorruptCheckpointError, process 0 an error naming process 1);
- dropped: restore_async handles dropped without result(); the next
  restore and save work on both processes;
- close: close() while a restore_async is in flight; result() raises the
  cancellation on both, and nothing hangs.
"""

from __future__ import annotations

import dataclasses

from tests.multiprocess import worker
from tests.multiprocess.worker import Outcome, timed


@dataclasses.dataclass(frozen=True)
class Dropped:
  """After restore_async handles dropped without result()."""
  restore_exact: bool   # the next restore(1), bit-exact
  save: Outcome         # save(4)


@dataclasses.dataclass(frozen=True)
class Result:
  process: int
  overlap_exact: bool        # restore_async(1) with a compile meanwhile
  stats_total: float         # its last_restore_stats.total_s
  refused: Outcome           # save(3) while a restore_async is in flight
  refused_then_exact: bool   # ... that restore's result()
  failure: Outcome           # restore_async(2).result(), a damaged chunk
  dropped: Dropped
  closed: Outcome            # result() of a restore_async close() ended


def run(conf: dict) -> Result:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.multihost import process as multihost  # pylint: disable=g-import-not-at-top
  from tests.multiprocess.grid_leaf import GridLeaf  # pylint: disable=g-import-not-at-top

  me = jax.process_index()
  leaf = GridLeaf()
  target = leaf.target
  out = {"process": me}
  c = ckpt.Checkpointer(conf["dir"], async_save=False, barrier_timeout_s=60)
  c.save(1, leaf.state())
  c.save(2, leaf.state(1))

  h = c.restore_async(1, target=target)
  step_fn = jax.jit(lambda w: jnp.tanh(w) * 2 + w.sum())
  step_fn.lower(leaf.array()).compile()  # the compile overlaps the reads
  out["overlap_exact"] = leaf.exact(h.result())
  out["stats_total"] = c.last_restore_stats.total_s

  h = c.restore_async(1, target=target)
  out["refused"] = timed(c.save, 3, leaf.state())
  out["refused_then_exact"] = leaf.exact(h.result())

  if me == 0:
    path = f"{conf['dir']}/checkpoint_2/w/1.0"  # rows 128..: process 1's
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 1
    open(path, "wb").write(bytes(data))
  multihost.barrier("damaged", timeout_s=60)
  h = c.restore_async(2, target=target)
  out["failure"] = timed(h.result)

  c.restore_async(1, target=target)  # its handle dropped at once
  h = c.restore_async(1, target=target)
  del h  # dropped, its reads maybe still running
  restore_exact = leaf.exact(c.restore(1, target=target))
  out["dropped"] = Dropped(restore_exact, timed(c.save, 4, leaf.state()))

  h = c.restore_async(1, target=target)
  c.close()
  out["closed"] = timed(h.result)
  return Result(**out)


if __name__ == "__main__":
  worker.main(run)
