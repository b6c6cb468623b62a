"""Worker: every restore of a 2-process job ends alike when one process
reads damaged data (tests/multiprocess/test_restore_agree.py).

GridLeaf ``w`` (process 1 alone reads chunk ``1.0``) and ``r``, a
(256, 512) leaf saved sharded by rows over the 4 devices and restored
replicated on every device (read once splits its chunks between the
processes, and exchanges them).

- ``explicit``: steps 1 and 2; process 0 flips a byte of step 2's
  ``w/1.0``; ``restore(2)`` and ``restore(path=<step 2's directory>)`` are
  timed on each process, then ``restore(1)`` (every process is still in
  step: no process waits in a round the others left).
- ``fallback``: steps 1 and 2; process 0 flips a byte in every chunk of
  step 2's ``r``; a resume with ``read_once=True`` must fall back to step 1
  on both processes. With ``slow`` process 1 reads every decision of a
  round from the coordination service ``slow`` seconds late (its client's
  ``blocking_key_value_get`` waits first), as a loaded or descheduled
  process would: a decision process 0 deletes right after writing it is
  then certainly gone before process 1 reads it.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import time

from tests.multiprocess import worker

SHAPE = (256, 512)


@dataclasses.dataclass(frozen=True)
class Explicit:
  process: int
  step: worker.Outcome
  path: worker.Outcome
  after_exact: bool


@dataclasses.dataclass(frozen=True)
class Fallback:
  process: int
  resume: worker.Outcome
  step: int | None
  exact: bool


def flip(path: str) -> None:
  data = bytearray(open(path, "rb").read())
  data[len(data) // 2] ^= 1
  open(path, "wb").write(bytes(data))


class Leaves:
  """``w`` (GridLeaf) and ``r``; import after the job started."""

  def __init__(self):
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
    from tests.multiprocess.grid_leaf import GridLeaf  # pylint: disable=g-import-not-at-top
    self.grid = GridLeaf()
    self.rows = NamedSharding(self.grid.mesh, P(("x", "y")))
    self.everywhere = NamedSharding(self.grid.mesh, P())
    self.r = np.random.default_rng(1).standard_normal(SHAPE).astype(
        np.float32)
    self.target = {"w": self.grid.target["w"],
                   "r": jax.ShapeDtypeStruct(SHAPE, np.float32,
                                             sharding=self.everywhere)}

  def state(self, offset: float = 0.0) -> dict:
    import jax  # pylint: disable=g-import-not-at-top
    r = self.r + offset
    return {"w": self.grid.array(offset),
            "r": jax.make_array_from_callback(SHAPE, self.rows,
                                              lambda i: r[i])}

  def exact(self, tree: dict, offset: float = 0.0) -> bool:
    import numpy as np  # pylint: disable=g-import-not-at-top
    r = self.r + offset
    return self.grid.exact(tree, offset) and all(
        np.array_equal(np.asarray(s.data), r[s.index])
        for s in tree["r"].addressable_shards)


def _saved(conf: dict):
  import ckpt  # pylint: disable=g-import-not-at-top
  leaves = Leaves()
  c = ckpt.Checkpointer(conf["dir"], async_save=False, barrier_timeout_s=20)
  c.save(1, leaves.state())
  c.save(2, leaves.state(1))
  return c, leaves


def explicit(conf: dict) -> Explicit:
  import jax  # pylint: disable=g-import-not-at-top
  from ckpt.multihost import process as multihost  # pylint: disable=g-import-not-at-top
  c, leaves = _saved(conf)
  if jax.process_index() == 0:
    flip(f"{conf['dir']}/checkpoint_2/w/1.0")  # rows 128..: process 1's
  multihost.barrier("damaged", timeout_s=60)
  step = worker.timed(c.restore, 2, target=leaves.target)
  path = worker.timed(c.restore, path=f"{conf['dir']}/checkpoint_2",
                      target=leaves.target)
  after = leaves.exact(c.restore(1, target=leaves.target))
  c.close()
  return Explicit(jax.process_index(), dataclasses.replace(step, value=None),
                  dataclasses.replace(path, value=None), after)


class SlowDecisions:
  """The coordination client, whose ``blocking_key_value_get`` (how a
  process reads a round's decision) starts ``delay_s`` late."""

  def __init__(self, client, delay_s: float):
    self._client, self._delay_s = client, delay_s

  def __getattr__(self, name: str):
    attr = getattr(self._client, name)
    if name != "blocking_key_value_get":
      return attr

    def late(*args, **kwargs):
      time.sleep(self._delay_s)
      return attr(*args, **kwargs)
    return late


def fallback(conf: dict) -> Fallback:
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  from ckpt.multihost import process as multihost  # pylint: disable=g-import-not-at-top
  c, leaves = _saved(conf)
  c.close()
  me = jax.process_index()
  if me == 0:
    chunks = [p for p in glob.glob(f"{conf['dir']}/checkpoint_2/r/*")
              if not os.path.basename(p).startswith(".")]
    assert chunks, os.listdir(f"{conf['dir']}/checkpoint_2/r")
    for p in chunks:
      flip(p)
  multihost.barrier("damaged", timeout_s=60)
  import ckpt  # pylint: disable=g-import-not-at-top
  c = ckpt.Checkpointer(conf["dir"], async_save=False, barrier_timeout_s=20,
                        read_once=True)
  client = distributed.global_state.client
  if me == 1 and conf["slow"]:
    distributed.global_state.client = SlowDecisions(client, conf["slow"])
  try:
    got = worker.timed(c.restore, target=leaves.target)
  finally:
    distributed.global_state.client = client
  exact = got.ok and leaves.exact(got.value)
  step = c.last_restore_step if got.ok else None
  if got.ok:
    c.close()  # (after a failure, process 0 may be gone: no more rounds)
  return Fallback(me, dataclasses.replace(got, value=None), step, exact)


if __name__ == "__main__":
  worker.main({"explicit": explicit, "fallback": fallback})
