"""One process of the 2-process job of tests/cli/test_orbax_perhost.py.

Run through ``ckpt.multihost.local_cluster``: the job imports the Grain-style
Orbax step ``config["src"]`` together (each process writes its share of the
per-process host_state files) as step 10 of ``config["dir"]``, saves step 11
with each process's own host_state and step 12 without any, then every
process asks ``host_state(s)`` of each step of ``config["steps"]`` and of
10-12: its value, or the error it raised.
"""

from __future__ import annotations

import dataclasses

from tests.multiprocess import worker
from tests.multiprocess.worker import Outcome


@dataclasses.dataclass(frozen=True)
class Result:
  host_states: dict[str, Outcome]   # host_state(step), by step
  imported: int                     # the import's host_state_processes


def run(config: dict) -> Result:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.cli import convert  # pylint: disable=g-import-not-at-top
  pid, timeout = jax.process_index(), config["timeout"]
  report = convert.import_checkpoint(config["src"], config["dir"], 10,
                                     barrier_timeout_s=timeout)
  got = {}
  with ckpt.Checkpointer(config["dir"], async_save=False,
                         barrier_timeout_s=timeout) as c:
    c.save(11, {"x": np.float32(1)}, host_state={"me": pid})
    c.save(12, {"x": np.float32(2)})
    for s in [*config["steps"], 10, 11, 12]:
      got[str(s)] = worker.timed(c.host_state, s)
  return Result(got, report.host_state_processes)


if __name__ == "__main__":
  worker.main(run)
