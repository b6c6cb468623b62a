"""Worker: the "log from rank 0" pattern. Two processes save steps 1-3;
process 0 alone asks every read-only query between the saves, process 1
alone asks some too; the job's later save and restore must work on both,
and no query may wait for the other process."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from tests.multiprocess import worker


@dataclasses.dataclass(frozen=True)
class Rank0:
  """What process 0 alone asked after saving a step."""
  all: list[int]
  latest: int
  best: int
  metrics: dict[str, float]
  meta: list[str]        # the leaf paths of metadata(step).shardings
  host_state: Any
  should: bool           # should_save(step + 1)


@dataclasses.dataclass(frozen=True)
class Rank1:
  """What process 1 alone asked after saving step 2."""
  all: list[int]
  host_state: Any


@dataclasses.dataclass(frozen=True)
class Result:
  process: int
  rank0: dict[str, Rank0]   # by step, on process 0
  rank1: dict[str, Rank1]   # by step, on process 1
  slowest_query_s: float
  exact: bool               # the collective restore afterwards
  restored: int


def run(conf: dict) -> Result:
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from tests.multiprocess.grid_leaf import GridLeaf  # pylint: disable=g-import-not-at-top

  me = jax.process_index()
  leaf = GridLeaf()
  state = leaf.state

  c = ckpt.Checkpointer(conf["dir"], barrier_timeout_s=conf["timeout"],
                        best_metric="loss", keep=5)
  rank0, rank1, slowest = {}, {}, 0.0
  for s in (1, 2, 3):
    c.save(s, state(s), metrics={"loss": 10.0 - s}, host_state={"p": me})
    c.wait_until_finished()
    t = time.monotonic()
    if me == 0:  # rank-0 logging: the other process does not call these
      rank0[str(s)] = Rank0(c.all_steps(), c.latest_step(), c.best_step(),
                            c.metrics(s), sorted(c.metadata(s).shardings),
                            c.host_state(s), c.should_save(s + 1))
    elif s == 2:
      rank1[str(s)] = Rank1(c.all_steps(), c.host_state())
    slowest = max(slowest, time.monotonic() - t)
  got = c.restore(target=leaf.target)  # collective, on both
  exact = leaf.exact(got, 3)
  c.save(4, state(4))
  c.close()
  return Result(me, rank0, rank1, slowest, exact, c.last_restore_step)


if __name__ == "__main__":
  worker.main(run)
