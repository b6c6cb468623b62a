"""One process of the multi-process test of the Orbax calls (issue 25,
item 2): ``should_save_fn``/``save_on_steps``, ``best_step``,
``custom_metadata`` and ``cancel`` on real ``jax.distributed`` processes.

Run by ``test_orbax_calls_mp.py`` through ``ckpt.multihost.local_cluster`` as
``python -m tests.multiprocess.orbax_calls_worker <json config>``.

Operations (``config["op"]``):

- ``policy``: steps 0..23 through ``should_save`` with
  ``save_interval_steps=10``, ``save_on_steps={3}`` and a
  ``should_save_fn``; every accepted step is saved with a loss metric and
  custom metadata. Reports the steps saved, the ``(step, last_saved)``
  pairs the function saw, ``best_step()`` and ``metadata().custom_metadata``.
- ``cancel``: saves step 1, then step 2 with process 1 held after writing
  its data (the store write really happens; then it waits, as a slow store
  would) while process 0 waits at the "written" barrier; both call
  ``cancel()``. Reports what cancel returned and took, the steps committed,
  the entries left in the root, then saves step 3 and restores it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import threading
import time
from typing import Any

import numpy as np

from tests.multiprocess import worker
from tests.multiprocess.worker import Error

HOLD_S = 600.0  # the held save; cancel() ends it long before


def _state(step: int):
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((4,), ("data",))
  x = np.arange(4096 * 64, dtype=np.float32).reshape(4096, 64) + step
  arr = jax.make_array_from_callback(
      x.shape, NamedSharding(mesh, P("data")), lambda idx: x[idx])
  return {"w": arr, "step": step}


@dataclasses.dataclass(frozen=True)
class Policy:
  saved: list[int]         # the steps should_save accepted
  best_before: int | None  # best_step() before any save
  best: int
  custom: Any              # metadata(best).custom_metadata
  steps: list[int]
  seen: list[list[int]]    # (step, last_saved) as should_save_fn saw them


@dataclasses.dataclass(frozen=True)
class Cancel:
  cancel_idle: bool
  in_progress_before: bool
  work_dirs_before: list[str]
  cancelled: bool
  cancel_s: float
  in_progress_after: bool
  steps_after_cancel: list[int]
  left: list[str]          # attempt directories, pending records left
  steps_final: list[int]
  restore_ok: bool
  close_s: float
  p0_waiting: Any = None   # on process 0: where its save waited


@dataclasses.dataclass(frozen=True)
class Multitier:
  persistent: list[int]
  best: int
  custom: Any
  cancelled: bool
  cancel_s: float
  persistent_after: list[int]
  saving: bool
  persistent_final: list[int]


@dataclasses.dataclass(frozen=True)
class Result:
  """``config["op"]``'s result, or the error it raised."""
  process: int
  error: Error | None = None
  policy: Policy | None = None
  cancel: Cancel | None = None
  multitier: Multitier | None = None


def _policy(config: dict) -> Policy:
  import ckpt  # pylint: disable=g-import-not-at-top
  seen = []

  def fn(step, last_saved):
    seen.append([step, last_saved])
    return last_saved is not None and step - last_saved >= 7

  out: dict = {"saved": []}
  with ckpt.Checkpointer(config["dir"], best_metric="loss", best_mode="min",
                         save_interval_steps=10, save_on_steps={3},
                         should_save_fn=fn) as c:
    out["best_before"] = c.best_step()
    for step in range(24):
      if c.should_save(step):
        assert c.save(step, _state(step), metrics={"loss": abs(step - 10.5)},
                      custom_metadata={"data_pos": step * 100,
                                       "note": f"step {step}"})
        out["saved"].append(step)
    c.wait_until_finished()
    out["best"] = c.best_step()
    out["custom"] = c.metadata(out["best"]).custom_metadata
    out["steps"] = c.all_steps()
  out["seen"] = seen
  return Policy(**out)


def _cancel(config: dict) -> Cancel:
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.save import write as save_lib  # pylint: disable=g-import-not-at-top
  pid = jax.process_index()
  root = config["dir"]
  held = threading.Event()
  hold = {"on": False}
  write_owned = save_lib.write_owned

  async def slow_write_owned(*args, **kwargs):
    on = hold["on"]  # (read before staging ends: save() returns then)
    out = await write_owned(*args, **kwargs)
    if on and pid == 1:  # the data is written; the store is slow
      held.set()
      await asyncio.sleep(HOLD_S)
    return out

  save_lib.write_owned = slow_write_owned
  out: dict = {}
  c = ckpt.Checkpointer(root)
  c.save(1, _state(1))
  c.wait_until_finished()
  out["cancel_idle"] = c.cancel()  # nothing in flight: False everywhere
  hold["on"] = True
  c.save(2, _state(2))
  hold["on"] = False
  # Cancel while the save is really held: process 1 has written its data
  # and waits; process 0 waits at the "written" barrier.
  deadline = time.monotonic() + 60
  if pid == 1:
    assert held.wait(60), "the held save never reached its hold"
  else:
    while not c._inflight.waiting() and time.monotonic() < deadline:  # pylint: disable=protected-access
      time.sleep(0.01)
    out["p0_waiting"] = c._inflight.waiting()  # pylint: disable=protected-access
  out["in_progress_before"] = c.is_saving_in_progress()
  out["work_dirs_before"] = sorted(n for n in os.listdir(root) if ".tmp-" in n)
  t0 = time.monotonic()
  out["cancelled"] = c.cancel()
  out["cancel_s"] = time.monotonic() - t0
  out["in_progress_after"] = c.is_saving_in_progress()
  c.check_for_errors()  # the cancel is not a failure to raise
  out["steps_after_cancel"] = c.all_steps()
  out["left"] = sorted(os.path.relpath(os.path.join(d, n), root)
                       for d, ds, fs in os.walk(root) for n in ds + fs
                       if ".tmp-" in n or "pending" in d)
  c.save(3, _state(3))
  c.wait_until_finished()
  out["steps_final"] = c.all_steps()
  want = _state(3)
  got = c.restore(3, target={"w": jax.ShapeDtypeStruct(
      want["w"].shape, want["w"].dtype, sharding=want["w"].sharding),
                             "step": 0})
  out["restore_ok"] = all(
      np.array_equal(np.asarray(a.data), np.asarray(b.data))
      for a, b in zip(got["w"].addressable_shards,
                      want["w"].addressable_shards)) and int(got["step"]) == 3
  t0 = time.monotonic()
  c.close()
  out["close_s"] = time.monotonic() - t0
  return Cancel(**out)


def _multitier(config: dict) -> Multitier:
  """The same calls on a MultiTierCheckpointer: should_save_fn adds a
  persistent save, custom_metadata and best_step come from the persistent
  tier, and cancel() abandons a held persistent save on both processes."""
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.save import write as save_lib  # pylint: disable=g-import-not-at-top
  pid = jax.process_index()
  held = threading.Event()
  hold = {"on": False}
  write_owned = save_lib.write_owned

  async def slow_write_owned(*args, **kwargs):
    on = hold["on"]
    out = await write_owned(*args, **kwargs)
    if on and pid == 1:
      held.set()
      await asyncio.sleep(HOLD_S)
    return out

  save_lib.write_owned = slow_write_owned
  root = config["dir"]
  out: dict = {}
  mt = ckpt.MultiTierCheckpointer(
      os.path.join(root, "p"), local=os.path.join(root, "l"),
      local_interval=1, persistent_interval=4, best_metric="loss",
      should_save_fn=lambda s, last: s == 3)
  for s in range(6):
    mt.save(s, _state(s), metrics={"loss": abs(s - 2.6)},
            custom_metadata={"s": s})
  mt.wait_until_finished(timeout=60)
  out["persistent"] = mt.persistent.all_steps()
  out["best"] = mt.best_step()
  out["custom"] = mt.metadata(3).custom_metadata
  hold["on"] = True
  mt.save(8, _state(8), force=True)
  hold["on"] = False
  if pid == 1:
    assert held.wait(60), "the held save never reached its hold"
  t0 = time.monotonic()
  out["cancelled"] = mt.cancel()
  out["cancel_s"] = time.monotonic() - t0
  out["persistent_after"] = mt.persistent.all_steps()
  out["saving"] = mt.is_saving_in_progress()
  mt.save(12, _state(12))
  mt.wait_until_finished(timeout=60)
  out["persistent_final"] = mt.persistent.all_steps()
  mt.close()
  return Multitier(**out)


def run(config: dict) -> Result:
  import jax  # pylint: disable=g-import-not-at-top
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  op = config["op"]
  got = worker.timed({"policy": _policy, "cancel": _cancel,
                      "multitier": _multitier}[op], config)
  if not got.ok:
    # Reported, and no exit hook waits for a held save: a failure ends the
    # job at once instead of at the launch timeout.
    local_cluster.write_result(worker.encode(
        Result(jax.process_index(), got.error)))
    sys.stdout.flush()
    os._exit(0)  # pylint: disable=protected-access
  return Result(jax.process_index(), **{op: got.value})


if __name__ == "__main__":
  worker.main(run)
