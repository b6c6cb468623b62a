"""One process of a job for tests/tiers/test_restart_drift.py: a LoRA
fine-tuning job (a small Flax NNX model: a frozen base ``nnx.Linear`` and
an ``nnx.LoRA`` adapter) checkpointed with a ``MultiTierCheckpointer``, its
persistent tier on S3 (moto), killed and restarted. Every save and restore
runs inside ``with jax.set_mesh(mesh):``, as docs/flax.md trains.

``config["phase"]``:

- "first": saves steps 5..30 (local every 5, persistent every 20) with the
  adapter sharded as XLA shards the output of a train step for leaves the
  model does not annotate (``lora_a`` on ``data``, across the processes;
  ``lora_b`` on ``model``, within each);
- "drift": a restart whose target comes from ``nnx.eval_shape`` under the
  mesh (the adapter replicated: half of ``lora_a`` is on the other
  process): it resumes, then saves 25 and 30 again;
- "lost": a restart after process 1 lost its local directory, with the
  first job's shardings again: it resumes, then saves 25 again;
- "resume": a restart with ``lora_b`` replicated (each process holds all
  of it): what it resumes, resharded from its own shards.

Every phase but "resume" writes its result, marks ``done_<phase>_<pid>``
and waits to be killed (SIGKILL, by the test). A step's values say which
job wrote it: the adapter holds ``step + 1000 * timeline``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import zlib
from typing import Any

import numpy as np

from tests.multiprocess import worker

TIMELINES = {"first": 0, "drift": 1, "lost": 2, "resume": 2}


@dataclasses.dataclass
class Restored:
  step: int | None
  tier: str | None
  timeline: int | None  # which job wrote the restored step
  exact: bool           # bit-exact, on the target's shardings


@dataclasses.dataclass
class Phase:
  process: int
  local_before: list[int]            # this process's local steps at start
  latest_before: Any = None         # latest_step() before the restore
  latest_target_before: Any = None  # latest_step(target=) before it
  restore: Restored | None = None
  latest_after: Any = None          # latest_step() after the restore
  all_steps_after: Any = None
  saves: dict[str, worker.Outcome] = dataclasses.field(default_factory=dict)
  latest_end: Any = None
  local_end: list[int] = dataclasses.field(default_factory=list)
  warnings: list[str] = dataclasses.field(default_factory=list)  # ckpt's
  # ckpt's INFO lines that give a local step's reason (once per restore).
  reason_lines: int = 0


class _Capture(logging.Handler):
  def __init__(self):
    super().__init__(logging.INFO)
    self.records: list[logging.LogRecord] = []

  def emit(self, record):
    if "ckpt" in str(record.msg):
      self.records.append(record)


def run(conf: dict) -> Phase:
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top

  capture = _Capture()
  logging.getLogger("absl").addHandler(capture)
  phase, pid = conf["phase"], jax.process_index()
  timeline = TIMELINES[phase]
  mesh = jax.make_mesh((2, 2), ("data", "model"),
                       axis_types=(AxisType.Auto, AxisType.Auto))

  class LoRAModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      init = nnx.initializers.lecun_normal()
      self.base = nnx.Linear(16, 32, rngs=rngs, kernel_init=(
          nnx.with_partitioning(init, (None, "model"))))
      self.lora = nnx.LoRA(16, 4, 32, rngs=rngs)  # not annotated

    def __call__(self, x):
      return self.base(x) + self.lora(x)

  with jax.set_mesh(mesh):
    graphdef, abstract = nnx.split(nnx.eval_shape(
        lambda: LoRAModel(nnx.Rngs(0))))

  def name(path) -> str:
    return jax.tree_util.keystr(path)

  def values(path, leaf, line: int, step: int) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(name(path).encode()))
    base = rng.standard_normal(leaf.shape).astype(leaf.dtype)
    return base + np.asarray(step + 1000 * line if "lora" in name(path)
                             else 0, leaf.dtype)

  def sharding(path, leaf, mode: str):
    """The target's sharding: "eval" is nnx.eval_shape's (the adapter
    replicated); "xla" the one a jitted train step gives its output for
    the unannotated adapter (lora_a on "data": half of it on each
    process; lora_b on "model": whole on each process); "half" lora_a as
    "xla", lora_b replicated."""
    if mode in ("xla", "half") and "lora_a" in name(path):
      return NamedSharding(mesh, P("data", None))
    if mode == "xla" and "lora_b" in name(path):
      return NamedSharding(mesh, P(None, "model"))
    return NamedSharding(mesh, leaf.sharding.spec)

  def state(step: int, line: int, mode: str):
    def make(path, leaf):
      v = values(path, leaf, line, step)
      return jax.make_array_from_callback(
          v.shape, sharding(path, leaf, mode), lambda i: v[i])
    return {"model": jax.tree_util.tree_map_with_path(make, abstract)}

  def target(mode: str):
    return {"model": jax.tree_util.tree_map_with_path(
        lambda p, l: jax.ShapeDtypeStruct(l.shape, l.dtype,
                                          sharding=sharding(p, l, mode)),
        abstract)}

  def check(got, mode: str) -> Restored:
    """Which job wrote ``got`` (from an adapter leaf), and whether every
    leaf is that job's, bit for bit, on the target's shardings."""
    flat = jax.tree_util.tree_flatten_with_path(got["model"])[0]
    want = jax.tree_util.tree_flatten_with_path(target(mode)["model"])[0]
    lora = [x for p, x in flat if "lora_a" in name(p)][0]
    shard = lora.addressable_shards[0]
    first = np.asarray(shard.data).reshape(-1)[0]
    ok, line, step = True, None, None
    for (p, x), (_, t) in zip(flat, want):
      ok &= x.sharding == t.sharding
      if step is None and "lora_a" in name(p):
        base = values(p, t, 0, 0)[shard.index].reshape(-1)[0]
        n = int(round(float(first - base)))
        line, step = n // 1000, n % 1000
      for s in x.addressable_shards:
        ok &= bool(np.array_equal(np.asarray(s.data),
                                  values(p, t, line, step)[s.index]))
    return Restored(step, None, line, bool(ok))

  mt = ckpt.MultiTierCheckpointer(
      conf["persistent"], local=conf["local"], local_interval=5,
      local_keep=2, persistent_interval=20, barrier_timeout_s=60)
  out = Phase(pid, mt.local.committed_steps())
  mode = {"first": "xla", "drift": "eval", "lost": "xla", "resume": "half"}[
      phase]
  # Inside the mesh, as docs/flax.md trains (issue 45 item 2: the local
  # tier's save raised there).
  with jax.set_mesh(mesh):
    _steps(mt, out, phase, timeline, mode, state, target, check)
  out.latest_end = worker.timed(mt.latest_step).value
  out.local_end = mt.local.committed_steps()
  out.warnings = [r.getMessage() for r in capture.records
                  if r.levelno >= logging.WARNING]
  out.reason_lines = sum("sharded differently" in r.getMessage()
                         for r in capture.records
                         if r.levelno < logging.WARNING)
  if phase == "resume":
    mt.close()
    return out
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  local_cluster.write_result(worker.encode(out))
  worker.touch(os.path.join(conf["marks"], f"done_{phase}_{pid}"))
  time.sleep(150)  # killed by the test (SIGKILL) long before
  return out


def _steps(mt, out: Phase, phase: str, timeline: int, mode: str, state,
           target, check) -> None:
  """What the job does: saves, or a resume and then saves."""
  if phase == "first":
    for step in range(5, 31, 5):
      out.saves[str(step)] = worker.timed(
          mt.save, step, state(step, timeline, mode))
  else:
    t = target(mode)
    out.latest_before = worker.timed(mt.latest_step).value
    out.latest_target_before = worker.timed(
        lambda: mt.latest_step(target=t)).value
    got = check(mt.restore(target=t), mode)
    out.restore = dataclasses.replace(got, tier=mt.last_restore_tier)
    out.latest_after = worker.timed(mt.latest_step).value
    out.all_steps_after = worker.timed(mt.all_steps).value
    steps = {"drift": (25, 30), "lost": (25,), "resume": ()}[phase]
    for step in steps:  # the restored state, trained on: its shardings
      out.saves[str(step)] = worker.timed(
          mt.save, step, state(step, timeline, mode))
  mt.wait_until_finished()


if __name__ == "__main__":
  worker.main(run)
