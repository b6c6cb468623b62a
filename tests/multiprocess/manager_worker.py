"""One process of a job for tests/multiprocess/test_manager_mp.py.

Run as ``python -m tests.multiprocess.manager_worker <json config>`` by
``ckpt.multihost.local_cluster`` (2 processes x 2 CPU devices). One launch does both
parts, in order, and reports what every process saw:

1. ``delete`` and the calls around it in a real job: a committed step,
   a missing one, the step of a save in flight (process 0's commit is held
   back), ``wait_until_finished(timeout=...)``, ``metadata`` and
   ``abstract_target`` onto the job's mesh.
2. A training loop calling ``save`` every step with
   ``save_interval_steps``, stopped by SIGTERM (jax's preemption sync
   point); it logs what each save call returned and how many agreement
   rounds it made.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import numpy as np

from tests.multiprocess import worker
from tests.multiprocess.worker import Error


def _state(step: int, mesh) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  host = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + step
  w = jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("x")),
                                   lambda i: host[i])
  return {"w": w, "step": step}


@dataclasses.dataclass(frozen=True)
class DeletePart:
  metrics: dict[str, Any]  # metrics(3)
  after_delete: list[int]  # steps after delete(2)
  missing: Error | None  # delete(2) again
  in_progress: bool  # is_saving_in_progress() while step 4 commits
  inflight: Error | None  # delete(4) while step 4 commits
  timeout: Error | None  # wait_until_finished(timeout=0.3) then
  still_tracked: bool
  done: bool  # not saving once wait_until_finished() returned
  before_delete_4: list[int]
  final: list[int]
  restored_ok: bool  # restore onto abstract_target bit-exact
  restored_spec: str


def part_delete(conf: dict, mesh) -> DeletePart:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.commit import protocol as commit_lib  # pylint: disable=g-import-not-at-top
  pid = jax.process_index()
  out: dict[str, Any] = {}
  ck = ckpt.Checkpointer(conf["dir"], barrier_timeout_s=60)
  # A metric that is a jax scalar replicated over both processes' devices.
  loss = jax.device_put(jnp.float32(0.5), NamedSharding(mesh, P()))
  for s in (1, 2, 3):
    ck.save(s, _state(s, mesh), metrics={"loss": loss, "eval": {"n": s}})
  ck.wait_until_finished()
  out["metrics"] = ck.metrics(3)
  ck.delete(2)
  out["after_delete"] = ck.all_steps()
  out["missing"] = worker.timed(ck.delete, 2).error
  # A save in flight: process 0's commit waits 3 s.
  commit = commit_lib.commit

  def slow(*a, **k):
    time.sleep(3)
    return commit(*a, **k)
  if pid == 0:
    commit_lib.commit = slow
  try:
    ck.save(4, _state(4, mesh))
    out["in_progress"] = ck.is_saving_in_progress()
    out["inflight"] = worker.timed(ck.delete, 4).error
    out["timeout"] = worker.timed(ck.wait_until_finished, timeout=0.3).error
    out["still_tracked"] = ck.is_saving_in_progress()
    ck.wait_until_finished()
  finally:
    commit_lib.commit = commit
  out["done"] = not ck.is_saving_in_progress()
  out["before_delete_4"] = ck.all_steps()
  ck.delete(4)
  out["final"] = ck.all_steps()
  # metadata -> abstract_target -> restore, on the job's (2-process) mesh.
  md = ck.metadata(3)
  target = ckpt.abstract_target(md, mesh, [(r"w", P(None, "x"))])
  got = ck.restore(3, target=target)
  host = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + 3
  out["restored_ok"] = all(
      np.array_equal(np.asarray(s.data), host[s.index])
      for s in got["w"].addressable_shards)
  out["restored_spec"] = str(got["w"].sharding.spec)
  ck.close()
  return DeletePart(**out)


@dataclasses.dataclass(frozen=True)
class IntervalPart:
  log: list[list[Any]]  # [step, what save returned, agreement rounds]
  preempted_at: int | None
  steps: list[int]


def part_interval(conf: dict, mesh) -> IntervalPart:
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.multihost import process as multihost  # pylint: disable=g-import-not-at-top
  pid = jax.process_index()
  rounds = [0]
  agree = multihost.agree

  def counted(*a, **k):
    rounds[0] += 1
    return agree(*a, **k)
  multihost.agree = counted
  ck = ckpt.Checkpointer(conf["interval_dir"], barrier_timeout_s=60,
                         save_interval_steps=conf["interval"])
  state = _state(0, mesh)
  inc = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s))
  log = []  # [step, saved, rounds] of every save call
  deadline = time.monotonic() + conf["max_s"]
  step, preempted_at = 1, None
  while time.monotonic() < deadline:
    preempted = ck.reached_preemption(step)
    before = rounds[0]
    saved = ck.save(step, {"w": state["w"], "step": step})
    log.append([step, saved, rounds[0] - before])
    if preempted:
      preempted_at = step
      ck.wait_until_finished()
      break
    state = inc(state)
    step += 1
    if step == 20:
      worker.touch(os.path.join(conf["marks"], f"looping_{pid}"))
    time.sleep(0.005)
  steps = ck.all_steps()
  ck.close()
  multihost.agree = agree
  return IntervalPart(log, preempted_at, steps)


@dataclasses.dataclass(frozen=True)
class Result:
  pid: int
  delete: DeletePart
  interval: IntervalPart


def run(conf: dict) -> Result:
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices()), ("x",))
  return Result(jax.process_index(), part_delete(conf, mesh),
                part_interval(conf, mesh))


if __name__ == "__main__":
  worker.main(run)
