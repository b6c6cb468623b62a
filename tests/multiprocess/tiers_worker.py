"""One process of a multi-tier job for tests/multiprocess/test_tiers.py.

``config["scenario"]``: "train" saves every step to the local tier and every
``persistent_interval`` steps to the persistent one, writing
``<flags>/saved_<process>_<step>`` after each ``save()`` returns (the test
SIGKILLs the job while a local save is in flight); "restore" runs the
``phases`` (optionally wiping some processes' local directories first) and
reports what each restore returned and whether it is bit-exact
(``Phases``); "one_fails" (``OneFails``) and "integrity" (``Integrity``)
are described where they run.
"""

from __future__ import annotations

import dataclasses
import logging as std_logging
import os
import shutil
import time
from typing import Any

import numpy as np

from tests.multiprocess import worker
from tests.multiprocess.worker import Error, Outcome

SHAPES = {
    "w": ((1024, 1024), "float32"),     # sharded over both mesh axes
    "emb": ((512, 256), "float32"),     # sharded over x, replicated over y
    "r": ((256, 128), "float32"),       # replicated on every device
    "i": ((256, 512), "int32"),         # sharded over y on axis 1
}
SPECS = {"w": ("x", "y"), "emb": ("x", None), "r": (), "i": (None, "y")}
_BASE: dict = {}


def state_np(step: int) -> dict:
  """Random (np.random) base + step: every element changes every step."""
  if not _BASE:
    for name, (shape, dtype) in SHAPES.items():
      rng = np.random.default_rng([7, sum(map(ord, name))])
      _BASE[name] = (rng.standard_normal(shape, dtype=np.float32).astype(dtype)
                     if dtype.startswith("float") else
                     rng.integers(-2**20, 2**20, size=shape).astype(dtype))
  return {n: b + np.asarray(step, b.dtype) for n, b in _BASE.items()}


@dataclasses.dataclass(frozen=True)
class Trained:
  done: bool


@dataclasses.dataclass(frozen=True)
class OneFails:
  saves: dict[str, Outcome]   # save + wait, by step
  local_steps: list[int]


@dataclasses.dataclass(frozen=True)
class Restored:
  """One phase's restore."""
  step: int
  tier: str
  reason: str | None
  exact: bool        # bit-exact on this process's shards and shardings
  host_state: Any
  seconds: float
  from_partner: bool | None


@dataclasses.dataclass(frozen=True)
class SavedAfter:
  saved: int            # the step saved after the phases
  entries: list[str]    # then in this process's local directory


@dataclasses.dataclass(frozen=True)
class Phases:
  restores: list[Restored]
  after: SavedAfter | None   # with config["save_after"]


@dataclasses.dataclass(frozen=True)
class Attempt:
  """A restore after one phase of damage: what it raised, or the step, and
  the MultiTierCheckpointer's account in both cases."""
  error: Error | None
  step: int | None
  exact: bool | None
  host_state: Any
  tier: str | None
  reason: str | None
  from_partner: bool | None


@dataclasses.dataclass(frozen=True)
class Other:
  """The run of another persistent root over the same local directory."""
  latest: int | None
  error: Error | None     # its restore's
  step: int | None
  exact: bool | None
  tier: str | None
  reason: str | None
  entries: list[str]      # the local directory after its save of step 1
  restored_after_save: list   # [step, exact]


@dataclasses.dataclass(frozen=True)
class Integrity:
  phases: list[Attempt]
  other: Other


def run(conf: dict) -> Trained | OneFails | Phases | Integrity:
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.INFO)
  std_logging.getLogger("absl").setLevel(std_logging.INFO)
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.multihost import process as multihost  # pylint: disable=g-import-not-at-top
  pid = jax.process_index()
  mesh = Mesh(np.array(jax.devices()).reshape(conf["mesh"]), ("x", "y"))
  shard = {n: NamedSharding(mesh, P(*SPECS[n])) for n in SHAPES}

  def make(step):
    s = state_np(step)
    return {"params": {n: jax.make_array_from_callback(
        s[n].shape, shard[n], lambda idx, a=s[n]: a[idx]) for n in s},
            "step": np.int64(step)}

  ckptr = ckpt.MultiTierCheckpointer(
      conf["persistent"], local=conf["local"], local_interval=1, local_keep=2,
      persistent_interval=conf.get("persistent_interval", 5),
      persistent_keep=3, concurrent_bytes=conf.get("budget", 1 << 30),
      barrier_timeout_s=60)
  if conf["scenario"] == "train":
    for step in range(1, conf["steps"] + 1):
      ckptr.save(step, make(step), host_state={"pos": step * 100 + pid})
      open(os.path.join(conf["flags"], f"saved_{pid}_{step}"), "w").close()
      time.sleep(conf.get("sleep", 0.0))
    ckptr.close()
    return Trained(True)

  if conf["scenario"] == "one_fails":  # process 1 alone fails at step 2
    saves = {}
    for step in (1, 2, 3):
      big = step == 2 and pid == 1
      hs = {"pos": step, "blob": b"x" * ((17 << 20) if big else 8)}

      def save(step=step, hs=hs):
        ckptr.save(step, make(step), host_state=hs, force=False)
        ckptr.wait_until_finished()
      saves[str(step)] = worker.timed(save)
    out = OneFails(saves, ckptr.local.committed_steps())
    ckptr.close()
    return out

  target = {"params": {n: jax.ShapeDtypeStruct(SHAPES[n][0], SHAPES[n][1],
                                               sharding=shard[n])
                       for n in SHAPES}, "step": np.int64(0)}

  def check(got):
    step = int(got["step"])
    want = state_np(step)
    exact = all(
        np.array_equal(np.asarray(s.data), want[n][s.index])
        for n in SHAPES for s in got["params"][n].addressable_shards)
    return step, bool(exact and all(got["params"][n].sharding == shard[n]
                                    for n in SHAPES))

  if conf["scenario"] == "integrity":
    if conf.get("dump_after_s"):
      import faulthandler  # pylint: disable=g-import-not-at-top
      faulthandler.dump_traceback_later(conf["dump_after_s"], exit=True)
    return integrity(conf, pid, ckptr, make, target, check)
  out = []
  for k, phase in enumerate(conf["phases"]):
    multihost.barrier(f"phase-{k}-start")
    if pid in phase.get("wipe", []):
      shutil.rmtree(os.path.join(conf["local"], f"process_{pid}"),
                    ignore_errors=True)
    multihost.barrier(f"phase-{k}-wiped")
    t0 = time.perf_counter()
    got = ckptr.restore(target=target)
    dt = time.perf_counter() - t0
    step = int(got["step"])
    want = state_np(step)
    exact = all(
        np.array_equal(np.asarray(s.data), want[n][s.index])
        for n in SHAPES for s in got["params"][n].addressable_shards)
    exact &= all(got["params"][n].sharding == shard[n] for n in SHAPES)
    out.append(Restored(step, ckptr.last_restore_tier,
                        ckptr.last_restore_reason, bool(exact),
                        ckptr.host_state(), dt,
                        ckptr.local.last_restore_stats.get("from_partner")))
  after = None
  if conf.get("save_after"):
    step = out[-1].step + 1
    ckptr.save(step, make(step), host_state={"pos": step * 100 + pid},
               force=True)
    ckptr.wait_until_finished()
    mine = os.path.join(conf["local"], f"process_{pid}")
    after = SavedAfter(step, sorted(os.listdir(mine)))
  ckptr.close()
  return Phases(out, after)


def _damage(path: str, how: str) -> None:
  """Damages one local-tier file in place."""
  if how == "remove":
    shutil.rmtree(os.path.dirname(path))
  elif how == "flip":  # one bit of the byte in the middle of the file
    with open(path, "r+b") as f:
      f.seek(os.path.getsize(path) // 2)
      b = f.read(1)
      f.seek(-1, 1)
      f.write(bytes([b[0] ^ 0x08]))
  elif how == "truncate":
    os.truncate(path, os.path.getsize(path) // 2)
  elif how == "empty":
    os.truncate(path, 0)
  elif how == "huge":  # 40 MiB (sparse): more than any manifest may hold
    with open(path, "wb") as f:
      f.truncate(40 << 20)
  else:  # the file's new content
    with open(path, "w") as f:
      f.write(how)


def integrity(conf, pid, ckptr, make, target, check) -> Integrity:
  """Saves steps 1..5 (local: 4, 5; persistent: 5), then per phase puts the
  local directories back and damages the files the phase names before
  restoring; last, a checkpointer of another persistent root (empty) over
  the same local directory restores, saves step 1 and lists what is left."""
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.multihost import process as multihost  # pylint: disable=g-import-not-at-top
  for step in range(1, 6):
    ckptr.save(step, make(step), host_state={"pos": step * 100 + pid})
  ckptr.wait_until_finished()
  mine = os.path.join(conf["local"], f"process_{pid}")
  backup = os.path.join(conf["flags"], f"backup_{pid}")
  shutil.copytree(mine, backup)
  out = []

  def put_back(k, damage):
    multihost.barrier(f"integrity-{k}-start")
    shutil.rmtree(mine)
    shutil.copytree(backup, mine)
    for p, step, fname, how in damage:
      if p == pid:
        _damage(os.path.join(mine, f"step_{step}", fname or "x"), how)
    multihost.barrier(f"integrity-{k}-damaged")

  for k, damage in enumerate(conf["phases"]):
    put_back(k, damage)
    got = worker.timed(lambda: (*check(ckptr.restore(target=target)),
                                ckptr.host_state()))
    step, exact, host_state = got.value if got.ok else (None, None, None)
    out.append(Attempt(
        got.error, step, exact, host_state, ckptr.last_restore_tier,
        ckptr.last_restore_reason,
        ckptr.local.last_restore_stats.get("from_partner")))
    ckptr.local.restorer.last_restore_stats = {}
  ckptr.close()
  # Another run: an empty persistent root, the local directory of this one.
  put_back("other", [])
  other = ckpt.MultiTierCheckpointer(
      conf["persistent"] + "_other", local=conf["local"], local_interval=1,
      local_keep=2, persistent_interval=100, barrier_timeout_s=60)
  latest = other.latest_step()
  got = worker.timed(lambda: check(other.restore(target=target)))
  step, exact = got.value if got.ok else (None, None)
  tier, reason = other.last_restore_tier, other.last_restore_reason
  other.save(1, make(1), host_state={"pos": 100 + pid})
  other.wait_until_finished()
  entries = sorted(os.listdir(mine))
  after = list(check(other.restore(target=target)))
  other.close()
  return Integrity(out, Other(latest, got.error, step, exact, tier, reason,
                              entries, after))


if __name__ == "__main__":
  worker.main(run)
