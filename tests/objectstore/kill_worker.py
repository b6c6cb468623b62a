"""One process of a job whose save is killed (SIGKILL) part way.

Run by ``test_commit.py`` through ``ckpt.multihost.local_cluster``. Every process saves
step 1 (committed), then starts saving step 2 and one process kills itself
with SIGKILL at ``config["kill"]``:

- ``"mid_write"``: process ``config["victim"]`` as it stages its third box.
  The byte budget is one box, so staging waits for the previous box to be
  written: some of the step's data is in the store, some is not.
- ``"after_index"``: process 0 right after it wrote ``index.msgpack`` (every
  process wrote its data, OCDBT databases were merged), before the commit
  marker.

The others then wait at a barrier until ``local_cluster`` ends them.

``config["writer"] == "process"``: the job saves with
``writer="process"``, and the kill point hits the process that writes,
the writer (tests/multiprocess/writer_faults.py, at step 2 only): with
``"mid_write"`` process ``config["victim"]``'s writer as it starts writing
its third box; with ``"after_index"`` process 0's writer right after it
wrote the index; with ``"trainer_after_index"`` process 0's trainer, killed
by its writer at that point (the writer goes on and commits). A process
whose save(2) raised returns ``Failed`` (what it raised).

The state is ``state(step)``, the same in every process and in the test.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

import numpy as np
from ckpt.store import names
from tests.multiprocess import worker

BOX = (128, 128)           # one shard of "w" on the 2 x 4 mesh: 64 KiB
BUDGET = 64 << 10          # one box: staging waits for writes


def state_values(step: int) -> dict[str, np.ndarray]:
  """The global values of ``step``'s state (fixed seeds)."""
  rng = np.random.default_rng(1000 + step)
  return {"w": rng.standard_normal((256, 512), np.float32),
          "h": rng.standard_normal((64, 1024), np.float32),
          "step": np.int64(step)}


def _die() -> None:
  sys.stdout.flush()
  os.kill(os.getpid(), signal.SIGKILL)


@dataclasses.dataclass(frozen=True)
class Survived:
  """Written only by a process whose save(2) returned (the thread: the
  test fails)."""
  process: int


@dataclasses.dataclass(frozen=True)
class Failed:
  """writer="process": save(2) raised this (its class and message)."""
  process: int
  error: str


WRITER_KILLS = {  # config["kill"] -> (writer_faults point, whose writer)
    "mid_write": ("mid write", None),  # None: config["victim"]
    "after_index": ("after index", 0),
    "trainer_after_index": ("trainer after index", 0),
}


def _writer_kill_point(config: dict, me: int) -> None:
  """This process's writer runs tests/multiprocess/writer_faults.py with
  the kill point of ``config["kill"]`` (at step 2), if it is the victim."""
  from ckpt.save import writer_client  # pylint: disable=g-import-not-at-top
  from tests.multiprocess import writer_faults  # pylint: disable=g-import-not-at-top
  point, victim = WRITER_KILLS[config["kill"]]
  if me == (config["victim"] if victim is None else victim):
    writer_client.WRITER_MODULE = "tests.multiprocess.writer_faults"
    os.environ[writer_faults.KILL_AT] = point
    os.environ[writer_faults.KILL_STEP] = "2"


def run(config: dict) -> Survived | Failed:
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.save import staging  # pylint: disable=g-import-not-at-top
  from ckpt.store import storage as storage_lib  # pylint: disable=g-import-not-at-top

  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))

  def state(step):
    v = state_values(step)
    w = jax.make_array_from_callback(
        v["w"].shape, NamedSharding(mesh, P("data", "model")),
        lambda i: v["w"][i])
    return {"w": w, "h": v["h"], "step": v["step"]}

  me = jax.process_index()
  writer = config.get("writer", "thread")
  if writer == "process":
    _writer_kill_point(config, me)
  ckptr = ckpt.Checkpointer(config["url"], format=config["format"],
                            concurrent_bytes=BUDGET, async_save=False,
                            barrier_timeout_s=60, writer=writer)
  ckptr.save(1, state(1))
  print(f"process {me}: step 1 committed", flush=True)

  if writer == "process":
    try:
      ckptr.save(2, state(2))
    except Exception as e:  # pylint: disable=broad-except
      print(f"process {me}: step 2 raised {type(e).__name__}: {e}",
            flush=True)
      return Failed(me, f"{type(e).__name__}: {e}")
    print(f"process {me}: step 2 returned", flush=True)
    return Survived(me)
  if config["kill"] == "mid_write" and me == config["victim"]:
    staged = []
    plain_stage = staging._host_box  # pylint: disable=protected-access

    def stage_then_die(leaf, write, *args):
      staged.append(write)  # each box lands on the host here
      if len(staged) == 3:
        print(f"process {me}: SIGKILL while staging box 3", flush=True)
        _die()
      return plain_stage(leaf, write, *args)

    staging._host_box = stage_then_die  # pylint: disable=protected-access
  elif config["kill"] == "after_index" and me == 0:
    plain_write = storage_lib.Storage.write_bytes

    def write_then_die(self, rel, data):
      plain_write(self, rel, data)
      if rel.endswith(names.INDEX_NAME):
        print(f"process {me}: SIGKILL after writing {rel}", flush=True)
        _die()

    storage_lib.Storage.write_bytes = write_then_die
  ckptr.save(2, state(2))
  print(f"process {me}: step 2 returned (it should not have)", flush=True)
  return Survived(me)


if __name__ == "__main__":
  worker.main(run)
