"""One process of a job for tests/multiprocess/test_tiers_rollback.py.

``config["phase"]``: "first" saves steps 1..22 with a
``MultiTierCheckpointer`` (local every step, persistent every 5th), checks
restore options and ``latest_step(target=)`` while the local tier is ahead
of the persistent one, then rolls back to step 10 (restore, a refused save
of 11, ``delete`` of the newer steps, saves of 11 and 12); then the same
rollback with a plain ``Checkpointer``: a ``First``. "restart" is a new job
on the same directories, what it resumes: a ``Restart``. Every call's
outcome is recorded (an ``Outcome``, or a ``Restored``), so the job ends
normally whatever the code under test does.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import time
from typing import Any

import numpy as np

from tests.multiprocess import worker
from tests.multiprocess.worker import Error, Outcome, timed

SHAPES = {"w": ((64, 32), "float32"), "b": ((32,), "float32"),
          "i": ((16, 8), "int32")}
SPECS = {"w": ("x", "y"), "b": ("y",), "i": ("x", None)}


def state_np(step: int) -> dict:
  rng = np.random.default_rng(5)
  out = {}
  for name, (shape, dtype) in SHAPES.items():
    base = (rng.standard_normal(shape).astype(dtype) if dtype == "float32"
            else rng.integers(-1000, 1000, size=shape).astype(dtype))
    out[name] = base + np.asarray(step, dtype)
  return out


@dataclasses.dataclass(frozen=True)
class Restored:
  """A restore: what it raised, or the step it returned, whether that is
  bit-exact on this process's shards and on the target's shardings, and the
  MultiTierCheckpointer's account of it."""
  error: Error | None = None
  step: int | None = None
  exact: bool | None = None
  tier: str | None = None
  last_restore_step: Any = None  # "missing" if it has no such attribute
  reason: str | None = None


@dataclasses.dataclass(frozen=True)
class Tiers:
  local: list[int]
  persistent: list[int]


@dataclasses.dataclass(frozen=True)
class Unchanged:
  """Whether each tier's directory listing is what it was."""
  local: bool
  persistent: bool


@dataclasses.dataclass(frozen=True)
class AfterDeletes:
  local: list[int]
  persistent: Outcome


@dataclasses.dataclass(frozen=True)
class AfterDelete:
  local: list[int]
  persistent: Outcome
  latest: Outcome
  all_steps: Outcome


@dataclasses.dataclass(frozen=True)
class After:
  local: list[int]
  local_entries: list[str]
  persistent: Outcome
  latest: Outcome
  all_steps: Outcome
  restore: Restored


@dataclasses.dataclass(frozen=True)
class CkAfter:
  steps: Outcome
  latest: Outcome


@dataclasses.dataclass(frozen=True)
class First:
  """The first job, one process."""
  pid: int
  before: Tiers
  latest: Outcome
  all_steps: Outcome
  latest_fit: Outcome
  latest_other: Outcome
  restore_other: Restored
  lazy: Restored
  transforms: Restored
  lazy_local_only_step: Restored
  verify: Restored
  restore_10: Restored
  save_11: Outcome
  save_15: Outcome
  unchanged: Unchanged
  delete_fails_on_1: Outcome
  delete_being_read: Outcome
  after_failed_deletes: AfterDeletes
  delete: dict[str, Outcome]
  delete_again: Outcome
  after_delete: AfterDelete
  save_new: list[Outcome]
  after: After
  check_s: float | None
  ck_before: list[int]
  ck_restore_10: Outcome
  ck_save_11: Outcome
  ck_unchanged: bool
  ck_delete: dict[str, Outcome]
  ck_save_new: list[Outcome]
  ck_after: CkAfter


@dataclasses.dataclass(frozen=True)
class Restart:
  """The restart, one process."""
  pid: int
  latest: Outcome
  restore: Restored
  host_state: Outcome
  ck_latest: Outcome
  ck_restore: Outcome


def _entries(path: str) -> list[str]:
  try:
    return sorted(os.listdir(path))
  except FileNotFoundError:
    return []


def run(conf: dict) -> First | Restart:
  import faulthandler  # pylint: disable=g-import-not-at-top
  faulthandler.dump_traceback_later(150, exit=True)  # a hang shows where
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.tiers import timeline as tier_timeline  # pylint: disable=g-import-not-at-top
  pid = jax.process_index()
  mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
  shard = {n: NamedSharding(mesh, P(*SPECS[n])) for n in SHAPES}
  # Another sharding of "w" on the same mesh: the local tier cannot serve it.
  other = dict(shard, w=NamedSharding(mesh, P("y", "x")))

  def make(step):
    s = state_np(step)
    return {"params": {n: jax.make_array_from_callback(
        s[n].shape, shard[n], lambda idx, a=s[n]: a[idx]) for n in s},
            "step": np.int64(step)}

  def target(sh):
    return {"params": {n: jax.ShapeDtypeStruct(SHAPES[n][0], SHAPES[n][1],
                                               sharding=sh[n])
                       for n in SHAPES}, "step": np.int64(0)}

  def exact(got, sh=shard):
    """(step, bit-exact on this process's shards and on the target's
    shardings)."""
    step = int(got["step"])
    want = state_np(step)
    ok = all(np.array_equal(np.asarray(s.data), want[n][s.index])
             for n in SHAPES for s in got["params"][n].addressable_shards)
    ok &= all(got["params"][n].sharding == sh[n] for n in SHAPES)
    return [step, bool(ok)]

  def restored(m, fn, sh=shard) -> Restored:
    """What a restore returned, with the MultiTierCheckpointer's account."""
    def go():
      got = jax.tree_util.tree_map(  # lazy=True: read every leaf
          lambda v: v.read() if hasattr(v, "read") else v, fn(),
          is_leaf=lambda v: hasattr(v, "read"))
      step, ok = exact(got, sh)
      return Restored(None, step, ok, m.last_restore_tier,
                      getattr(m, "last_restore_step", "missing"),
                      m.last_restore_reason)
    got = timed(go)
    return got.value if got.ok else Restored(got.error)

  local_dir = os.path.join(conf["local"], f"process_{pid}")

  def tiers():
    return ckpt.MultiTierCheckpointer(
        conf["persistent"], local=conf["local"], local_interval=1,
        local_keep=3, persistent_interval=5, persistent_keep=4,
        barrier_timeout_s=60)

  if conf["phase"] == "restart":
    m = tiers()
    latest = timed(m.latest_step)
    restore = restored(m, lambda: m.restore(target=target(shard)))
    host_state = timed(m.host_state)
    m.close()
    c = ckpt.Checkpointer(conf["ck"], barrier_timeout_s=60)
    ck_latest = timed(c.latest_step)
    ck_restore = timed(lambda: exact(c.restore(target=target(shard))))
    c.close()
    return Restart(pid, latest, restore, host_state, ck_latest, ck_restore)

  out: dict = {"pid": pid}
  # ---- MultiTierCheckpointer: the local tier ahead of the persistent one --
  m = tiers()
  for step in range(1, 23):
    m.save(step, make(step), host_state={"pos": step * 100 + pid})
  m.wait_until_finished()
  out["before"] = Tiers(m.local.committed_steps(), m.persistent.all_steps())
  t, t_other = target(shard), target(other)
  # Item 6: which step a restore onto each target returns.
  out["latest"] = timed(m.latest_step)
  out["all_steps"] = timed(m.all_steps)  # issue 36 item 6: both tiers
  out["latest_fit"] = timed(lambda: m.latest_step(target=t))
  out["latest_other"] = timed(lambda: m.latest_step(target=t_other))

  def probe(fn, sh=shard):
    """A resume that returns an older step than the local tier's newest
    sets the newer local steps aside for the job that made it (issue 45
    item 1): each such probe runs on a MultiTierCheckpointer of its own,
    as another job's resume would, so ``m`` keeps them."""
    p = tiers()
    try:
      return restored(p, lambda: fn(p), sh)
    finally:
      p.close()
  out["restore_other"] = probe(lambda p: p.restore(target=t_other), other)
  # Item 5: restore options the local tier does not take, and verify.
  out["lazy"] = probe(lambda p: p.restore(target=t, lazy=True))
  out["transforms"] = probe(lambda p: p.restore(
      target=t, transforms=[lambda c, t_, *, is_resuming: c]))
  out["lazy_local_only_step"] = restored(
      m, lambda: m.restore(21, target=t, lazy=True))
  out["verify"] = restored(m, lambda: m.restore(target=t, verify=True))

  # ---- item 4: the rollback ---------------------------------------------
  out["restore_10"] = restored(m, lambda: m.restore(10, target=t))
  local_before = _entries(local_dir)
  persistent_before = _entries(conf["persistent"])
  out["save_11"] = timed(lambda: m.save(11, make(11),
                                        host_state={"pos": 1100 + pid}))
  out["save_15"] = timed(lambda: m.save(15, make(15),
                                        host_state={"pos": 1500 + pid}))
  timed(m.wait_until_finished)
  out["unchanged"] = Unchanged(
      _entries(local_dir) == local_before,
      _entries(conf["persistent"]) == persistent_before)
  # delete() is all or nothing: a failure on one process (its rename), or
  # the persistent tier refusing (a step being read), changes no tier.
  if pid == 1 and hasattr(m.local, "hide_step"):
    real = m.local.hide_step

    def fail_once(step):
      m.local.hide_step = real
      raise OSError(f"injected: cannot rename step_{step}")
    m.local.hide_step = fail_once
  out["delete_fails_on_1"] = timed(lambda: m.delete(22))
  held = timed(lambda: m.restore(20, target=t, lazy=True))  # being read
  out["delete_being_read"] = timed(lambda: m.delete(20))
  del held
  gc.collect()
  out["after_failed_deletes"] = AfterDeletes(
      m.local.committed_steps(), timed(m.persistent.all_steps))
  newer = [s for s in (15, 20, 21, 22)]
  out["delete"] = {str(s): timed(lambda s=s: m.delete(s)) for s in newer}
  out["delete_again"] = timed(lambda: m.delete(20))
  out["after_delete"] = AfterDelete(
      m.local.committed_steps(), timed(m.persistent.all_steps),
      timed(m.latest_step), timed(m.all_steps))
  out["save_new"] = [timed(lambda s=s: m.save(
      s, make(s), host_state={"pos": s * 100 + pid})) for s in (11, 12)]
  timed(m.wait_until_finished)
  out["after"] = After(
      m.local.committed_steps(), _entries(local_dir),
      timed(m.persistent.all_steps), timed(m.latest_step),
      timed(m.all_steps), restored(m, lambda: m.restore(target=t)))
  # What the save's timeline round costs (it runs at every save).
  times = []
  for _ in range(20):
    t0 = time.perf_counter()
    tier_timeline.check(m.persistent, m.local, 13)
    times.append(time.perf_counter() - t0)
  out["check_s"] = statistics.median(times) if times else None
  m.close()

  # ---- the same rollback with a plain Checkpointer ------------------------
  c = ckpt.Checkpointer(conf["ck"], keep=3, keep_period=5,
                        barrier_timeout_s=60)
  for step in range(1, 21):
    c.save(step, make(step))
  c.wait_until_finished()
  out["ck_before"] = c.all_steps()
  out["ck_restore_10"] = timed(lambda: exact(c.restore(10, target=t)))
  ck_before = _entries(conf["ck"])
  out["ck_save_11"] = timed(lambda: c.save(11, make(11)))
  timed(c.wait_until_finished)
  out["ck_unchanged"] = _entries(conf["ck"]) == ck_before
  out["ck_delete"] = {str(s): timed(lambda s=s: c.delete(s))
                      for s in (15, 18, 19, 20)}
  out["ck_save_new"] = [timed(lambda s=s: c.save(s, make(s)))
                        for s in (11, 12)]
  timed(c.wait_until_finished)
  out["ck_after"] = CkAfter(timed(c.all_steps), timed(c.latest_step))
  c.close()
  return First(**out)


if __name__ == "__main__":
  worker.main(run)
