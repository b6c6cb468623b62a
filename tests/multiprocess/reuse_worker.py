"""Worker of tests/multiprocess/test_reuse_mp.py: 2 processes save a state
whose "frozen" leaves never change with ``reuse_unchanged=True``."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

# name: (shape, sharding spec over the ("x", "y") mesh, frozen?)
LEAVES = {
    "frozen": ((512, 1024), ("x", "y"), True),     # 2 MiB, sharded
    "frozen_r": ((256, 512), (), True),            # 512 KiB, replicated
    "train": ((256, 1024), ("x", None), False),    # 1 MiB, changes each step
}
CHUNK_BYTES = 128 << 10


def state(step: int) -> dict[str, np.ndarray]:
  """The host value of every leaf at ``step`` (random, never constant)."""
  out = {}
  for name, (shape, _, frozen) in LEAVES.items():
    seed = [sum(map(ord, name))] + ([] if frozen else [step])
    out[name] = np.random.default_rng(seed).standard_normal(
        shape, dtype=np.float32)
  return out


def frozen_bytes() -> int:
  return sum(int(np.prod(s)) * 4 for s, _, f in LEAVES.values() if f)


def _arrays(step: int):
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("x", "y"))
  host = state(step)
  out = {}
  for name, (_, spec, _) in LEAVES.items():
    sh = NamedSharding(mesh, P(*spec))
    v = host[name]
    out[name] = jax.make_array_from_callback(v.shape, sh, lambda i, v=v: v[i])
  return out


def _stats(c) -> dict:
  s = c.last_save_stats
  return {"step": s.step, "written": s.bytes_written,
          "reused": s.bytes_reused, "chunks_reused": s.chunks_reused}


def scenario_retention(conf: dict) -> dict:
  """keep=2, sync saves of steps 0..3: retention deletes the steps whose
  chunk files the kept ones link to; each kept step restores exactly, here
  in the job too."""
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  stats = []
  with ckpt.Checkpointer(conf["dir"], keep=2, reuse_unchanged=True,
                         async_save=False, chunk_bytes=CHUNK_BYTES) as c:
    for step in range(4):
      c.save(step, _arrays(step))
      stats.append(_stats(c))
    steps = c.all_steps()
    exact = {}
    for step in steps:
      got = c.restore(step)
      want = state(step)
      exact[step] = all(np.asarray(got[k]).tobytes() == want[k].tobytes()
                        for k in LEAVES)
  return {"process": jax.process_index(), "stats": stats, "steps": steps,
          "exact": exact}


def scenario_killloop(conf: dict) -> dict:
  """Async saves of state(step) from the step after the latest committed
  one, until killed (or ``max_step``); says when its first is committed."""
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  pid = jax.process_index()
  c = ckpt.Checkpointer(conf["dir"], keep=3, reuse_unchanged=True,
                        chunk_bytes=CHUNK_BYTES, barrier_timeout_s=60)
  latest = c.latest_step()
  step = 0 if latest is None else latest + 1
  stats = []
  while step < conf["max_step"]:
    c.save(step, _arrays(step))
    c.wait_until_finished()
    stats.append(_stats(c))
    if pid == 0:  # the next save links (the test kills during it)
      open(os.path.join(conf["events"], f"saved_{conf['launch']}"), "a").close()
    step += 1
  steps = c.all_steps()
  c.close()
  return {"process": pid, "stats": stats, "steps": steps}


def scenario_resume(conf: dict) -> dict:
  """A job (a new Checkpointer, new processes) saves ``conf["steps"]``
  with keep=2, then restores the last one."""
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  stats = []
  with ckpt.Checkpointer(conf["dir"], keep=2, reuse_unchanged=True,
                         async_save=False, chunk_bytes=CHUNK_BYTES) as c:
    for step in conf["steps"]:
      c.save(step, _arrays(step))
      stats.append(_stats(c))
    got, want = c.restore(conf["steps"][-1]), state(conf["steps"][-1])
    exact = all(np.asarray(got[k]).tobytes() == want[k].tobytes()
                for k in LEAVES)
  return {"process": jax.process_index(), "stats": stats, "exact": exact}


def check_resumed(url: str, launch: Any) -> None:
  """Steps 0..2 saved by one job, then step 3 by a restarted one: its
  first save writes only the changing leaf (summed over the processes),
  reuses every frozen byte, and restores exactly."""
  launch("tests.multiprocess.reuse_worker",
         {"scenario": "resume", "dir": url, "steps": [0, 1, 2]},
         num_processes=2, devices_per_process=2)
  out = launch("tests.multiprocess.reuse_worker",
               {"scenario": "resume", "dir": url, "steps": [3]},
               num_processes=2, devices_per_process=2)
  assert all(r["exact"] for r in out), out
  assert sum(r["stats"][0]["written"] for r in out) == 256 * 1024 * 4, out
  assert sum(r["stats"][0]["reused"] for r in out) == frozen_bytes(), out


def check_retention(out: list) -> None:
  """The results of the "retention" scenario's processes: steps 2 and 3
  kept, exact; steps 0 and 1 wrote everything (two copies), steps 2 and 3
  reused every frozen byte (each process its share) and wrote only the
  changing leaf."""
  for r in out:
    assert r["steps"] == [2, 3]
    assert all(r["exact"].values()) and len(r["exact"]) == 2, r
  for i in (0, 1):
    assert sum(r["stats"][i]["reused"] for r in out) == 0
  for i in (2, 3):
    assert sum(r["stats"][i]["reused"] for r in out) == frozen_bytes()
    assert sum(r["stats"][i]["written"] for r in out) == 256 * 1024 * 4


SCENARIOS = {"retention": scenario_retention, "killloop": scenario_killloop,
             "resume": scenario_resume}


def main() -> None:
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  local_cluster.init_from_env()
  conf = json.loads(sys.argv[1])
  result: Any = SCENARIOS[conf["scenario"]](conf)
  local_cluster.write_result(result)


if __name__ == "__main__":
  main()
