"""One process of the 2-process job of tests/cli/test_orbax_perhost.py.

Run through ``ckpt.multihost.local_cluster``: the job imports the Grain-style
Orbax step ``config["src"]`` together (each process writes its share of the
per-process host_state files) as step 10 of ``config["dir"]``, saves step 11
with each process's own host_state and step 12 without any, then every
process asks ``host_state(s)`` of each step of ``config["steps"]`` and of
10-12: its value, or the error it raised.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  local_cluster.init_from_env()
  config = json.loads(argv[1])
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
      try:
        got[s] = {"value": c.host_state(s)}
      except Exception as e:  # pylint: disable=broad-except
        got[s] = {"error": f"{type(e).__name__}: {e}"}
  local_cluster.write_result({"host_states": got,
                              "imported": report.host_state_processes})


if __name__ == "__main__":
  main(sys.argv)
