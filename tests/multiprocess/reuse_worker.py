"""Worker of tests/multiprocess/test_reuse_mp.py: 2 processes save a state
whose "frozen" leaves never change with ``reuse_unchanged=True``. Each
scenario returns a ``Result``."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from tests.multiprocess import worker

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


@dataclasses.dataclass(frozen=True)
class SaveStats:
  """One save's last_save_stats."""
  step: int
  written: int
  reused: int
  chunks_reused: int


@dataclasses.dataclass(frozen=True)
class Result:
  process: int
  stats: list[SaveStats]               # each save's, in order
  steps: list[int] | None = None       # all_steps() at the end
  exact: bool | None = None            # "resume": the last step restored
  exact_steps: dict[str, bool] | None = None  # "retention": by kept step


def _stats(c) -> SaveStats:
  s = c.last_save_stats
  return SaveStats(s.step, s.bytes_written, s.bytes_reused, s.chunks_reused)


def scenario_retention(conf: dict) -> Result:
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
      exact[str(step)] = all(
          np.asarray(got[k]).tobytes() == want[k].tobytes() for k in LEAVES)
  return Result(jax.process_index(), stats, steps, exact_steps=exact)


def scenario_killloop(conf: dict) -> Result:
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
  return Result(pid, stats, steps)


def scenario_resume(conf: dict) -> Result:
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
  return Result(jax.process_index(), stats, exact=exact)


def check_resumed(url: str, launch: Any) -> None:
  """Steps 0..2 saved by one job, then step 3 by a restarted one: its
  first save writes only the changing leaf (summed over the processes),
  reuses every frozen byte, and restores exactly."""
  launch("tests.multiprocess.reuse_worker",
         {"scenario": "resume", "dir": url, "steps": [0, 1, 2]},
         num_processes=2, devices_per_process=2, result=Result)
  out = launch("tests.multiprocess.reuse_worker",
               {"scenario": "resume", "dir": url, "steps": [3]},
               num_processes=2, devices_per_process=2, result=Result)
  assert all(r.exact for r in out), out
  assert sum(r.stats[0].written for r in out) == 256 * 1024 * 4, out
  assert sum(r.stats[0].reused for r in out) == frozen_bytes(), out


def check_retention(out: list) -> None:
  """The results of the "retention" scenario's processes: steps 2 and 3
  kept, exact; steps 0 and 1 wrote everything (two copies), steps 2 and 3
  reused every frozen byte (each process its share) and wrote only the
  changing leaf."""
  for r in out:
    assert r.steps == [2, 3]
    assert all(r.exact_steps.values()) and len(r.exact_steps) == 2, r
  for i in (0, 1):
    assert sum(r.stats[i].reused for r in out) == 0
  for i in (2, 3):
    assert sum(r.stats[i].reused for r in out) == frozen_bytes()
    assert sum(r.stats[i].written for r in out) == 256 * 1024 * 4


SCENARIOS = {"retention": scenario_retention, "killloop": scenario_killloop,
             "resume": scenario_resume}


if __name__ == "__main__":
  worker.main(SCENARIOS)
