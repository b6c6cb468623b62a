"""One process of a job that imports an Orbax checkpoint (test_orbax_import).

Run through ``ckpt.multihost.local_cluster``: every process calls
``convert.import_checkpoint`` on the same source and destination, so each
reads and writes its share of every leaf. Scenario "one_bad": process 1 is
given a source that does not exist; every process records the error it
raised and how long it took to raise it (an ``Imported``). Scenario
"orbax_save": the job
saves ``orbax_state()`` with Orbax instead (a source written by 2 processes:
an OCDBT database per process, merged).
"""

from __future__ import annotations

import dataclasses

from tests.multiprocess import worker
from tests.multiprocess.worker import Outcome


@dataclasses.dataclass(frozen=True)
class Imported:
  """import_checkpoint: its report's JSON as the value, or its error."""
  process: int
  imported: Outcome


@dataclasses.dataclass(frozen=True)
class Saved:
  process: int


def orbax_value(name: str):
  import numpy as np  # pylint: disable=g-import-not-at-top
  shape = {"w": (64, 32), "r": (16,)}[name]
  return np.arange(np.prod(shape), dtype=np.float32).reshape(shape) / 7


def orbax_save(config: dict) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
  specs = {"w": P("data", "model"), "r": P()}
  state = {k: jax.make_array_from_callback(
      orbax_value(k).shape, NamedSharding(mesh, spec),
      lambda i, k=k: orbax_value(k)[i]) for k, spec in specs.items()}
  state["step"] = config["step"]
  with ocp.CheckpointManager(config["dst"]) as mgr:
    mgr.save(config["step"], args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        extra=ocp.args.JsonSave({"data_pos": 7})))
    mgr.wait_until_finished()


def run(config: dict) -> Imported | Saved:
  import jax  # pylint: disable=g-import-not-at-top
  me = jax.process_index()
  if config["scenario"] == "orbax_save":
    orbax_save(config)
    return Saved(me)
  from ckpt.cli import convert  # pylint: disable=g-import-not-at-top
  src = config["src"]
  if config["scenario"] == "one_bad" and me == 1:
    src += "-missing"
  return Imported(me, worker.timed(lambda: convert.import_checkpoint(
      src, config["dst"], config["step"], concurrent_bytes=1 << 20,
      barrier_timeout_s=config["timeout"]).to_json()))


if __name__ == "__main__":
  worker.main(run)
