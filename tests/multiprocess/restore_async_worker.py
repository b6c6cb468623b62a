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

import json
import sys
import time

from ckpt.multihost import local_cluster


def main():
  local_cluster.init_from_env()
  conf = json.loads(sys.argv[1])
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
  try:
    c.save(3, leaf.state())
    out["refused"] = None
  except ckpt.CheckpointError as e:
    out["refused"] = str(e)
  out["refused_then_exact"] = leaf.exact(h.result())

  if me == 0:
    path = f"{conf['dir']}/checkpoint_2/w/1.0"  # rows 128..: process 1's
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 1
    open(path, "wb").write(bytes(data))
  multihost.barrier("damaged", timeout_s=60)
  h = c.restore_async(2, target=target)
  t = time.monotonic()
  try:
    h.result()
    out["failure"] = None
  except ckpt.CheckpointError as e:
    out["failure"] = f"{type(e).__name__}: {e}"
  out["failure_s"] = time.monotonic() - t

  c.restore_async(1, target=target)  # its handle dropped at once
  h = c.restore_async(1, target=target)
  del h  # dropped, its reads maybe still running
  dropped = {"restore_exact": leaf.exact(c.restore(1, target=target))}
  try:
    c.save(4, leaf.state())
    dropped["save"] = None
  except ckpt.CheckpointError as e:
    dropped["save"] = str(e)
  out["dropped"] = dropped

  h = c.restore_async(1, target=target)
  c.close()
  try:
    h.result()
    out["closed"] = None
  except ckpt.CheckpointError as e:
    out["closed"] = str(e)
  local_cluster.write_result(out)


if __name__ == "__main__":
  main()
