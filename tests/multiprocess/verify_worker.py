"""Worker: 2 processes save steps 1 and 2 of a leaf sharded by rows (each
process holds half); process 0 then damages a chunk of step 2 that only
process 1 reads. A resume (restore() with no step) must fall back to step 1
on both processes; an explicit restore(2) raises on both, naming process 1
(the one that reads the damaged chunk)."""

from __future__ import annotations

import dataclasses

from tests.multiprocess import worker
from tests.multiprocess.worker import Outcome


@dataclasses.dataclass(frozen=True)
class Result:
  process: int
  rows: list[int]     # the first rows of this process's shards
  step: int           # the step the resume restored
  exact: bool         # ... bit-exact
  explicit: Outcome   # restore(2)
  steps: list[int]    # all_steps() after saving step 3


def run(conf: dict) -> Result:
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.multihost import process as multihost  # pylint: disable=g-import-not-at-top
  from tests.multiprocess.grid_leaf import GridLeaf  # pylint: disable=g-import-not-at-top

  leaf = GridLeaf()

  with ckpt.Checkpointer(conf["dir"], async_save=False) as c:
    c.save(1, leaf.state())
    c.save(2, leaf.state(1))
  # Rows 128.. live on process 1's devices: chunk (1, 0) of the zarr grid.
  rows = {s.index[0].start for s in leaf.array().addressable_shards}
  if jax.process_index() == 0:
    path = f"{conf['dir']}/checkpoint_2/w/1.0"
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 1
    open(path, "wb").write(bytes(data))
  multihost.barrier("damaged", timeout_s=60)
  c = ckpt.Checkpointer(conf["dir"], async_save=False, keep=1,
                        barrier_timeout_s=60)
  target = leaf.target
  got = c.restore(target=target)
  resumed = c.last_restore_step
  exact = leaf.exact(got)
  explicit = worker.timed(c.restore, 2, target=target)
  c.save(3, leaf.state(3))  # training goes on; keep=1 keeps 2 and 3
  out = Result(jax.process_index(), sorted(rows), resumed, exact, explicit,
               c.all_steps())
  c.close()
  return out


if __name__ == "__main__":
  worker.main(run)
