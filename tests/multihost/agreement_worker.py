"""One process of a job for tests/multiprocess/test_agreement.py.

Run as ``python -m tests.multihost.agreement_worker <json config>`` by
``ckpt.multihost.local_cluster``: one job runs every scenario in turn
(``scenario_all``). Each scenario makes one process behave differently from
the others (fail, lag, hold other data) and reports what every process saw;
the job must go on after each.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import numpy as np

from tests.multiprocess import worker
from tests.multiprocess.worker import Error, Outcome, timed


def _state(step: int, mesh) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  host = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + step
  sharding = NamedSharding(mesh, P("x", None))
  w = jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])
  return {"w": w, "step": step}


def _mesh():
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  return Mesh(np.array(jax.devices()), ("x",))


def _timed_save(ck, step, state, **kw) -> Outcome:
  """save then wait_until_finished: the Outcome's value is what save
  returned."""
  def save():
    ok = ck.save(step, state, **kw)
    ck.wait_until_finished()
    return ok
  return timed(save)


def _tmp_left(root: str) -> list[str]:
  """The work directories a save left in ``root``."""
  return sorted(n for n in os.listdir(root) if ".tmp-" in n)


@dataclasses.dataclass(frozen=True)
class OneFails:
  pid: int
  s1: Outcome
  s2: Outcome  # a save transform raises on process 1
  s3: Outcome
  s4: Outcome  # host_state process 1 cannot pack
  s5: Outcome  # a leaf process 1 cannot plan
  s6: Outcome
  s6_again: Outcome  # a committed step saved again: skipped everywhere
  steps: list[int]
  tmp_left: list[str]


def scenario_one_fails(conf: dict) -> OneFails:
  """Process 1 alone fails to prepare some saves; the job goes on."""
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  pid = jax.process_index()
  mesh = _mesh()
  out: dict[str, Any] = {"pid": pid}
  ck = ckpt.Checkpointer(conf["dir"], barrier_timeout_s=conf["timeout_s"])
  out["s1"] = _timed_save(ck, 1, _state(1, mesh))

  def flaky(tree):  # a save transform that raises on process 1 only
    if pid == 1:
      raise ValueError("the data pipeline of process 1 is broken")
    return tree
  out["s2"] = _timed_save(ck, 2, _state(2, mesh), transforms=[flaky])
  out["s3"] = _timed_save(ck, 3, _state(3, mesh))
  # host_state that only process 1 cannot pack.
  hs = {"pos": 7} if pid == 0 else {"pos": object()}
  out["s4"] = _timed_save(ck, 4, _state(4, mesh), host_state=hs)
  # A leaf only process 1 cannot store (planning fails there).
  bad = _state(5, mesh)
  if pid == 1:
    bad["extra"] = object()
  else:
    bad["extra"] = 0
  out["s5"] = _timed_save(ck, 5, bad)
  out["s6"] = _timed_save(ck, 6, _state(6, mesh))
  # A committed step: every process skips it (process 0 decides).
  out["s6_again"] = _timed_save(ck, 6, _state(6, mesh))
  out["steps"] = ck.all_steps()
  out["tmp_left"] = _tmp_left(conf["dir"])
  ck.close()
  return OneFails(**out)


@dataclasses.dataclass(frozen=True)
class RestoreRace:
  pid: int
  restored_step: int
  w_matches_step: list[int]  # the step each local shard's values come from
  latest: int
  differ: Error | None  # processes asking for different steps
  after: int  # the step the next restore returned


def scenario_restore_race(conf: dict) -> RestoreRace:
  """Another job commits step 2 between two processes' restore calls."""
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.multihost import process as multihost  # pylint: disable=g-import-not-at-top
  pid = jax.process_index()
  mesh = _mesh()
  root, other = conf["dir"], conf["other"]
  out: dict[str, Any] = {"pid": pid}
  ck = ckpt.Checkpointer(root, async_save=False)
  ck.save(1, _state(1, mesh))
  # "The trainer" has step 2 ready in another directory (same layout).
  ck2 = ckpt.Checkpointer(other, async_save=False)
  ck2.save(2, _state(2, mesh))
  ck2.close()
  multihost.barrier("test/ready", timeout_s=60)
  if pid == 1:  # process 1 is late; the trainer commits meanwhile
    time.sleep(1.0)
    os.rename(os.path.join(other, "checkpoint_2"),
              os.path.join(root, "checkpoint_2"))
  target = {"w": jax.ShapeDtypeStruct((64, 32), np.float32,
                                      sharding=_state(0, mesh)["w"].sharding),
            "step": 0}
  got = ck.restore(target=target)
  out["restored_step"] = got["step"]
  out["w_matches_step"] = [
      int(np.asarray(s.data)[0, 0] - s.index[0].start * 32)
      for s in got["w"].addressable_shards]
  out["latest"] = ck.latest_step()
  # Processes that ask for different steps all raise, naming both.
  try:
    ck.restore(1 if pid == 0 else 2, target=target)
    out["differ"] = None
  except ckpt.CheckpointError as e:
    out["differ"] = Error.of(e)
  out["after"] = ck.restore(1, target=target)["step"]
  ck.close()
  return RestoreRace(**out)


@dataclasses.dataclass(frozen=True)
class HostMismatch:
  pid: int
  equal: Outcome  # the same host values everywhere
  array: Outcome  # a host array that differs
  scalar: Outcome  # a host scalar that differs
  host_state: Outcome  # per-process values in host_state
  steps: list[int]
  hs: Any  # host_state(4)
  tmp_left: list[str]


def scenario_host_mismatch(conf: dict) -> HostMismatch:
  """Host values saved once for the job differ between processes."""
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  pid = jax.process_index()
  mesh = _mesh()
  out: dict[str, Any] = {"pid": pid}
  ck = ckpt.Checkpointer(conf["dir"], barrier_timeout_s=conf["timeout_s"])
  same = np.linspace(0, 1, 4096, dtype=np.float32)
  rng_state = np.random.default_rng(pid).random(4096, dtype=np.float32)
  base = {**_state(1, mesh), "loader": {"table": same}}
  out["equal"] = _timed_save(ck, 1, base)
  out["array"] = _timed_save(ck, 2, {**base, "loader": {"table": same,
                                                        "rng": rng_state}})
  out["scalar"] = _timed_save(ck, 3, {**base, "data_pos": 100 + pid})
  # Per-process values belong in host_state: that works.
  out["host_state"] = _timed_save(ck, 4, base, host_state={"rng": pid})
  out["steps"] = ck.all_steps()
  out["hs"] = ck.host_state(4)
  out["tmp_left"] = _tmp_left(conf["dir"])
  ck.close()
  return HostMismatch(**out)


@dataclasses.dataclass(frozen=True)
class PlannedDifferently:
  pid: int
  s1: Outcome
  s2: Outcome  # process 1 leaves a box out
  s3: Outcome  # process 1 writes a box twice, another never
  s4: Outcome
  steps: list[int]
  tmp_left: list[str]


def scenario_planned_differently(conf: dict) -> PlannedDifferently:
  """Process 1 plans its writes differently from the others (as a host
  running another ckpt version would): for step 2 it leaves out one box,
  for step 3 it writes one box twice instead of another."""
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.shards import plan as plan_lib  # pylint: disable=g-import-not-at-top
  pid = jax.process_index()
  mesh = _mesh()
  out: dict[str, Any] = {"pid": pid}
  ck = ckpt.Checkpointer(conf["dir"], barrier_timeout_s=conf["timeout_s"],
                         chunk_bytes=1024, concurrent_bytes=1024)
  out["s1"] = _timed_save(ck, 1, _state(1, mesh))
  honest = plan_lib.assign_writes
  for step, fault in ((2, "drop"), (3, "twice")):
    def lying(layouts, process, max_item_bytes=None, leaves=None, *,
              fault=fault):
      writes = honest(layouts, process, max_item_bytes, leaves)
      if process != 1:
        return writes
      return writes[1:] if fault == "drop" else [writes[0]] + writes[:-1]
    plan_lib.assign_writes = lying
    # The planner must run (the plan cache would reuse the honest plan of
    # the step before), and its lie must not be reused by the next step.
    ck._saver.forget_plan()  # pylint: disable=protected-access
    out[f"s{step}"] = _timed_save(ck, step, _state(step, mesh))
    plan_lib.assign_writes = honest
    ck._saver.forget_plan()  # pylint: disable=protected-access
  out["s4"] = _timed_save(ck, 4, _state(4, mesh))
  out["steps"] = ck.all_steps()
  out["tmp_left"] = _tmp_left(conf["dir"])
  ck.close()
  return PlannedDifferently(**out)


@dataclasses.dataclass(frozen=True)
class OcdbtGroups:
  pid: int
  save: Outcome
  exact: bool  # restored onto the job's mesh bit-exact
  exact_host: bool  # restored as host values bit-exact


def scenario_ocdbt_groups(conf: dict) -> OcdbtGroups:
  """format "ocdbt" with merge groups (a tiny KEYS_PER_MERGE stands in for a
  step of millions of keys): each process merges its group."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.store import ocdbt  # pylint: disable=g-import-not-at-top
  from ckpt.save import pack  # pylint: disable=g-import-not-at-top
  pack.MAX_LEAF_BYTES = 0  # small arrays stand in for large ones: no packs
  pid = jax.process_index()
  mesh = _mesh()
  ocdbt.KEYS_PER_MERGE = conf["keys_per_merge"]
  rng = np.random.default_rng(7)
  host = {f"w{i}": rng.standard_normal((32, 16)).astype(np.float32)
          for i in range(6)}
  host["r"] = rng.standard_normal((40,)).astype(np.float32)
  specs = {k: (P("x") if k != "r" else P()) for k in host}
  state = {k: jax.make_array_from_callback(
      v.shape, NamedSharding(mesh, specs[k]), lambda i, v=v: v[i])
           for k, v in host.items()}
  out: dict[str, Any] = {"pid": pid}
  ck = ckpt.Checkpointer(conf["dir"], format="ocdbt", chunk_bytes=512,
                         barrier_timeout_s=conf["timeout_s"])
  out["save"] = _timed_save(ck, 1, state)
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                    sharding=NamedSharding(mesh, specs[k]))
            for k, v in host.items()}
  got = ck.restore(1, target=target)
  out["exact"] = all(
      all(np.array_equal(np.asarray(s.data), host[k][s.index])
          for s in got[k].addressable_shards) for k in host)
  whole = ck.restore(1)
  out["exact_host"] = all(np.array_equal(whole[k], host[k]) for k in host)
  ck.close()
  return OcdbtGroups(**out)


def _fail_once(obj, name: str, what: str) -> None:
  """Makes ``obj.name()`` raise once, then puts back what was there (a
  module's function; for an instance, the class's method)."""
  own = vars(obj).get(name)

  def once(*args, **kwargs):
    del args, kwargs
    if own is None:
      delattr(obj, name)
    else:
      setattr(obj, name, own)
    raise RuntimeError(f"injected failure at the start of {what}")
  setattr(obj, name, once)


@dataclasses.dataclass(frozen=True)
class Again:
  """A call that fails on one process, then the same call again."""
  first: Outcome
  again: Outcome


@dataclasses.dataclass(frozen=True)
class TierRestore:
  """A MultiTierCheckpointer.restore: its Outcome (value: the step), the
  tier and reason it reported, the first value of each local shard of w."""
  outcome: Outcome
  tier: str | None
  reason: str | None
  first_w: list[float] | None


@dataclasses.dataclass(frozen=True)
class EachCall:
  pid: int
  setup: Outcome
  calls: dict[str, Again]  # by call: save, restore, ..., latest_step
  steps: list[int]
  mt_setup: Outcome
  mt_save: Again
  mt_restore: list[TierRestore]  # with the failure, then without


def scenario_each_call_fails_once(conf: dict) -> EachCall:
  """One process fails at the start of each collective call in turn; the
  call fails on every process within seconds, and the next call of the same
  kind works everywhere (no key drifted)."""
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.commit import steps as steps_lib  # pylint: disable=g-import-not-at-top
  pid = jax.process_index()
  mesh = _mesh()
  out: dict[str, Any] = {"pid": pid}
  calls_out: dict[str, Again] = {}
  ck = ckpt.Checkpointer(conf["dir"], barrier_timeout_s=conf["timeout_s"])
  sharding = _state(0, mesh)["w"].sharding
  target = {"w": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=sharding),
            "step": 0}

  def first_w(tree):
    return [float(np.asarray(s.data).flat[0])
            for s in tree["w"].addressable_shards]

  def saved(step):
    ck.save(step, _state(step, mesh))
    ck.wait_until_finished()
    return True

  out["setup"] = timed(saved, 1)
  step_dir = os.path.join(conf["dir"], "checkpoint_1")
  calls = {  # name: (first call, with the failure; the same call again)
      "save": (lambda: saved(10), lambda: saved(3)),
      "restore": (lambda: ck.restore(target=target)["step"],) * 2,
      "restore_path": (lambda: ck.restore(path=step_dir,
                                          target=target)["step"],) * 2,
      "delete": (lambda: ck.delete(3),) * 2,
  }
  for name, (call, again) in calls.items():
    if pid == 1:
      _fail_once(ck._loop, "check_open", name)  # pylint: disable=protected-access
    calls_out[name] = Again(timed(call), timed(again))
  # Natural failures on process 1: a path it cannot open, a bad argument.
  calls_out["bad_path"] = Again(
      timed(lambda: ck.restore(
          path=step_dir if pid == 0 else "nosuchscheme://bucket/x",
          target=target)["step"]),
      timed(lambda: ck.restore(path=step_dir, target=target)["step"]))
  calls_out["bad_arg"] = Again(
      timed(lambda: ck.restore(
          target=target, read_once=None if pid == 0 else "sometimes")["step"]),
      timed(lambda: ck.restore(target=target)["step"]))
  # The read-only queries are not collective: each process lists for
  # itself, so a failure there is that process's alone (process 0's listing
  # for latest_step, process 1's for metadata), and the others answer.
  if pid == 0:
    _fail_once(steps_lib, "committed_steps", "latest_step")
  calls_out["latest_step"] = Again(timed(ck.latest_step),
                                   timed(ck.latest_step))
  if pid == 1:
    _fail_once(steps_lib, "committed_steps", "metadata")
  calls_out["metadata"] = Again(timed(lambda: ck.metadata().step),
                                timed(lambda: ck.metadata().step))
  out["calls"] = calls_out
  out["steps"] = ck.all_steps()
  ck.close()

  # The two-tier checkpointer: its local save and its restore.
  mt = ckpt.MultiTierCheckpointer(
      conf["persistent"], local=conf["local"], local_interval=1,
      barrier_timeout_s=conf["timeout_s"])
  out["mt_setup"] = timed(mt.save, 1, _state(1, mesh), force=True)
  if pid == 1:
    _fail_once(mt.local, "wait", "the local save")
  out["mt_save"] = Again(timed(mt.save, 2, _state(2, mesh)),
                        timed(mt.save, 3, _state(3, mesh)))
  restores = []
  for inject in (True, False):
    if inject and pid == 1:
      _fail_once(mt.local, "usable", "the multi-tier restore")
    got = timed(mt.restore, target=target)
    restores.append(TierRestore(
        dataclasses.replace(
            got, value=None if got.value is None else got.value["step"]),
        mt.last_restore_tier, mt.last_restore_reason,
        None if got.value is None else first_w(got.value)))
  out["mt_restore"] = restores
  mt.close()
  return EachCall(**out)


@dataclasses.dataclass(frozen=True)
class All:
  """Every scenario, one after the other in one job (each in its own
  directory under ``conf["root"]``): one start-up of the job for all."""
  one_fails: OneFails
  restore_race: RestoreRace
  host_mismatch: HostMismatch
  planned_differently: PlannedDifferently
  each_call: EachCall
  ocdbt_groups: OcdbtGroups


def scenario_all(conf: dict) -> All:
  root, timeout_s = conf["root"], conf["timeout_s"]
  out = {
      "one_fails": scenario_one_fails(
          {"dir": os.path.join(root, "one_fails"), "timeout_s": timeout_s}),
      "restore_race": scenario_restore_race(
          {"dir": os.path.join(root, "race", "run"),
           "other": os.path.join(root, "race", "trainer")}),
      "host_mismatch": scenario_host_mismatch(
          {"dir": os.path.join(root, "mismatch"), "timeout_s": timeout_s}),
      "planned_differently": scenario_planned_differently(
          {"dir": os.path.join(root, "planned"), "timeout_s": timeout_s}),
      "each_call": scenario_each_call_fails_once(
          {"dir": os.path.join(root, "each_call", "ckpt"),
           "persistent": os.path.join(root, "each_call", "persistent"),
           "local": os.path.join(root, "each_call", "local"),
           "timeout_s": timeout_s}),
      # Last: it changes module globals (no packs, small merge groups).
      "ocdbt_groups": scenario_ocdbt_groups(
          {"dir": os.path.join(root, "ocdbt"), "timeout_s": timeout_s,
           "keys_per_merge": conf["keys_per_merge"]}),
  }
  return All(**out)




if __name__ == "__main__":
  worker.main(scenario_all)
