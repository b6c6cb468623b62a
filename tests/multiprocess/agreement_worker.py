"""One process of a job for tests/multiprocess/test_agreement.py.

Run as ``python -m tests.multiprocess.agreement_worker <json config>`` by
``ckpt.multihost.local_cluster``; ``config["scenario"]`` picks what to do. Each
scenario makes one process behave differently from the others (fail, lag,
hold other data) and reports what every process saw.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np


def _err(e: BaseException | None) -> dict | None:
  return None if e is None else {"type": type(e).__name__, "msg": str(e)}


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


def _timed_save(ck, step, state, **kw) -> tuple[dict | None, float, Any]:
  t0 = time.monotonic()
  try:
    ok = ck.save(step, state, **kw)
    ck.wait_until_finished()
    return None, time.monotonic() - t0, ok
  except Exception as e:  # pylint: disable=broad-except
    return _err(e), time.monotonic() - t0, None


def scenario_one_fails(conf: dict) -> dict:
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
  out["tmp_left"] = sorted(n for n in os.listdir(conf["dir"]) if ".tmp-" in n)
  ck.close()
  return out


def scenario_restore_race(conf: dict) -> dict:
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
    out["differ"] = _err(e)
  out["after"] = ck.restore(1, target=target)["step"]
  ck.close()
  return out


def scenario_host_mismatch(conf: dict) -> dict:
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
  out["tmp_left"] = sorted(n for n in os.listdir(conf["dir"]) if ".tmp-" in n)
  ck.close()
  return out


def scenario_planned_differently(conf: dict) -> dict:
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
    def lying(layouts, process, max_item_bytes=None, fault=fault):
      writes = honest(layouts, process, max_item_bytes)
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
  out["tmp_left"] = sorted(n for n in os.listdir(conf["dir"]) if ".tmp-" in n)
  ck.close()
  return out


def scenario_ocdbt_groups(conf: dict) -> dict:
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
  return out


def _timed(fn, *args, **kwargs) -> tuple[dict | None, float, Any]:
  """(error or None, seconds, result) of one call."""
  t0 = time.monotonic()
  try:
    out = fn(*args, **kwargs)
    return None, time.monotonic() - t0, out
  except Exception as e:  # pylint: disable=broad-except
    return _err(e), time.monotonic() - t0, None


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


def scenario_each_call_fails_once(conf: dict) -> dict:
  """One process fails at the start of each collective call in turn; the
  call fails on every process within seconds, and the next call of the same
  kind works everywhere (no key drifted)."""
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.commit import steps as steps_lib  # pylint: disable=g-import-not-at-top
  pid = jax.process_index()
  mesh = _mesh()
  out: dict[str, Any] = {"pid": pid}
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

  out["setup"] = _timed(saved, 1)
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
    out[name] = [_timed(call), _timed(again)]
  # Natural failures on process 1: a path it cannot open, a bad argument.
  out["bad_path"] = [_timed(lambda: ck.restore(
      path=step_dir if pid == 0 else "nosuchscheme://bucket/x",
      target=target)["step"]),
                     _timed(lambda: ck.restore(path=step_dir,
                                               target=target)["step"])]
  out["bad_arg"] = [_timed(lambda: ck.restore(
      target=target, read_once=None if pid == 0 else "sometimes")["step"]),
                    _timed(lambda: ck.restore(target=target)["step"])]
  # The read-only queries are not collective: each process lists for
  # itself, so a failure there is that process's alone (process 0's listing
  # for latest_step, process 1's for metadata), and the others answer.
  if pid == 0:
    _fail_once(steps_lib, "committed_steps", "latest_step")
  out["latest_step"] = [_timed(ck.latest_step), _timed(ck.latest_step)]
  if pid == 1:
    _fail_once(steps_lib, "committed_steps", "metadata")
  out["metadata"] = [_timed(lambda: ck.metadata().step),
                     _timed(lambda: ck.metadata().step)]
  out["steps"] = ck.all_steps()
  ck.close()

  # The two-tier checkpointer: its local save and its restore.
  mt = ckpt.MultiTierCheckpointer(
      conf["persistent"], local=conf["local"], local_interval=1,
      barrier_timeout_s=conf["timeout_s"])
  out["mt_setup"] = _timed(mt.save, 1, _state(1, mesh), force=True)
  if pid == 1:
    _fail_once(mt.local, "wait", "the local save")
  out["mt_save"] = [_timed(mt.save, 2, _state(2, mesh)),
                    _timed(mt.save, 3, _state(3, mesh))]
  restores = []
  for inject in (True, False):
    if inject and pid == 1:
      _fail_once(mt.local, "usable", "the multi-tier restore")
    err, took, got = _timed(mt.restore, target=target)
    restores.append([err, took, None if got is None else got["step"],
                     mt.last_restore_tier, mt.last_restore_reason,
                     None if got is None else first_w(got)])
  out["mt_restore"] = restores
  mt.close()
  return out


SCENARIOS = {"planned_differently": scenario_planned_differently,
             "ocdbt_groups": scenario_ocdbt_groups,
             "one_fails": scenario_one_fails,
             "restore_race": scenario_restore_race,
             "host_mismatch": scenario_host_mismatch,
             "each_call_fails_once": scenario_each_call_fails_once}


def main() -> None:
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  conf = json.loads(sys.argv[1])
  local_cluster.init_from_env()
  local_cluster.write_result(SCENARIOS[conf["scenario"]](conf))


if __name__ == "__main__":
  main()
