"""Benchmark: training while an asynchronous save runs.

Usage (from the repository root):
  python -m scripts.bench_train --preset large_f32_1g [--systems ckpt,orbax]
      [--runs 5] [--steps 30] [--width 512] [--nice N] [--out F] [--dir D]

Each system (ckpt, orbax: the ones with an async mode) runs in its own
worker process holding the preset's random state (scripts/benchlib). There a
jitted training step (a two-layer MLP and its SGD update, data-parallel
over the preset mesh's first axis, the hidden layer split over its second)
runs ``--steps`` times with nothing else going on, then again while an
asynchronous save of the state runs, until that save is finished. Every
step is timed to ``block_until_ready``. Figures per run: the median and
90th percentile step time without and during the save, their ratio (the
slowdown a training job sees), the time the caller was blocked in
``save()`` and the save's total time; the table shows their medians (min-max)
over the runs, interleaved across systems. On a shared machine, where wall
times mean little, the CPU figures say what the save costs the job: the
process's CPU per step without and during the save, the save's own CPU
(the process's CPU during the save less the steps' CPU at the idle rate)
and that over the save's wall time (how many cores it kept busy), and in
the JSON each group of threads' CPU during the save (``train_cpu_<name>_s``:
``ts_pool_worker``, ``ckpt_fsync_``, ...).

``--width`` sets the step's time: 512 gives about 50-150 ms on 8 CPU devices
over 2 cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import time
from typing import Any

import numpy as np

from scripts.benchlib import measure
from scripts.benchlib import presets
from scripts.benchlib import report
from scripts.benchlib import workers

# A save that does not finish within this many steps is reported as such
# (the loop stops; the save is still waited for).
MAX_STEPS_DURING = 100_000
ROWS = [
    ("train_step_idle_s", "train step, no save: median (s)"),
    ("train_step_idle_p90_s", "train step, no save: p90 (s)"),
    ("train_step_during_s", "train step during async save: median (s)"),
    ("train_step_during_p90_s", "train step during async save: p90 (s)"),
    ("train_slowdown", "train slowdown during save (x)"),
    ("train_save_blocked_s", "train: save() blocked (s)"),
    ("train_save_total_s", "train: async save until finished (s)"),
    ("train_steps_during", "train: steps during the save"),
    ("train_cpu_step_idle_s", "train: process CPU per step, no save (s)"),
    ("train_cpu_step_during_s", "train: process CPU per step during (s)"),
    ("train_save_cpu_s", "train: the save's CPU (s)"),
    ("train_save_cpu_share", "train: the save's CPU / its wall (cores)"),
]


class TrainLoop:
  """The model, its sharded parameters and batch, and the jitted step."""

  def __init__(self, mesh, width: int, seed: int = 0):
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
    self.jax = jax
    rng = np.random.default_rng([seed, 1])
    hidden = 4 * width
    batch_axis, model_axis = mesh.axis_names[:2]

    def put(shape, spec, scale):
      x = rng.standard_normal(shape, dtype=np.float32) * scale
      return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    self.params = {
        "w1": put((width, hidden), (None, model_axis), width ** -0.5),
        "w2": put((hidden, width), (model_axis, None), hidden ** -0.5)}
    self.batch = put((width, width), (batch_axis, None), 1.0)

    def loss(params, x):
      h = jnp.tanh(x @ params["w1"])
      return jnp.mean((h @ params["w2"] - x) ** 2)

    def step(params, x):
      value, grads = jax.value_and_grad(loss)(params, x)
      params = jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)
      return params, value

    self._step = jax.jit(step, donate_argnums=0)
    for _ in range(3):  # compile and warm up
      self.step()

  def step(self) -> float:
    """One step, to block_until_ready; its wall time."""
    with measure.measure(interval_s=0) as m:
      self.params, value = self._step(self.params, self.batch)
      self.jax.block_until_ready((self.params, value))
    return m.wall_s


def train(session, op) -> dict[str, Any]:
  """In a worker: ``op["steps"]`` steps alone, then steps until an async
  save of the session's state is finished."""
  loop = session.cache.get("train")
  if loop is None:
    loop = session.cache["train"] = TrainLoop(session.topo.save_mesh,
                                              op["width"])
  if op.get("nice") is not None:  # before the first save of this worker
    from ckpt.save import polite  # pylint: disable=g-import-not-at-top
    polite.BACKGROUND_NICE = op["nice"]
  with measure.measure(interval_s=0) as idle_m:
    idle = [loop.step() for _ in range(op["steps"])]
  threads_before = measure.thread_cpu()
  with measure.measure(interval_s=0) as m:
    wait = session.system.save_async(op["dir"], session.state)
    if wait is None:
      return {}
    blocked = m.lap()
    finished = threading.Event()
    end: dict[str, Any] = {}

    def waiter():
      try:
        wait()
      except BaseException as e:  # pylint: disable=broad-except
        end["error"] = e
      finished.set()

    thread = threading.Thread(target=waiter, name="bench-save-wait",
                              daemon=True)
    thread.start()
    during = [loop.step()]  # at least one: it starts while the save runs
    while not finished.is_set() and len(during) < MAX_STEPS_DURING:
      during.append(loop.step())
    thread.join()
    total = m.lap()
  groups = measure.thread_cpu_by_name(threads_before, measure.thread_cpu())
  if "error" in end:
    raise end["error"]
  p90 = lambda v: float(np.percentile(v, 90))
  cpu_idle = idle_m.cpu_s / len(idle)
  # What the process spent beyond the steps' own CPU: the save's work.
  save_cpu = max(0.0, m.cpu_s - cpu_idle * len(during))
  by_thread = {f"train_cpu_{name.replace('-', '_')}_s": g["user_s"] + g["sys_s"]
               for name, g in groups.items()}
  return {**by_thread,
          "train_cpu_step_idle_s": cpu_idle,
          "train_cpu_step_during_s": m.cpu_s / len(during),
          "train_save_cpu_s": save_cpu,
          "train_save_cpu_share": save_cpu / max(total, 1e-9),
          "train_sys_s_during": m.sys_s,
          "train_steps_idle": len(idle), "train_steps_during": len(during),
          "train_step_idle_s": float(np.median(idle)),
          "train_step_idle_p90_s": p90(idle),
          "train_step_during_s": float(np.median(during)),
          "train_step_during_p90_s": p90(during),
          "train_slowdown": float(np.median(during) / np.median(idle)),
          "train_save_blocked_s": blocked, "train_save_total_s": total}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=__doc__.split("\n\n", 1)[1])
  workers.add_flags(parser)
  parser.add_argument("--steps", type=int, default=30,
                      help="steps timed without a save, before the steps "
                      "during one")
  parser.add_argument("--width", type=int, default=512,
                      help="the MLP's width (hidden: 4x)")
  parser.add_argument("--nice", type=int, default=None,
                      help="ckpt.save.polite.BACKGROUND_NICE in the ckpt "
                      "workers (default: the module's), for an A/B")
  args = parser.parse_args(argv)
  systems, notes = workers.pick_systems(parser, args, ("ckpt", "orbax"))
  preset = presets.load_preset(args.preset)
  print(f"bench_train {preset['name']}: {args.runs} runs of "
        f"{', '.join(systems)}, width {args.width}", flush=True)
  raw: dict[str, dict[str, list]] = {}
  with workers.workdir(args.dir) as where, workers.Workers(
      systems, str(presets.preset_path(args.preset)), args.devices,
      shared=False) as pool:  # a save's threads must not slow another's steps
    for r, s, worker in pool.rounds(args.runs):
      path = os.path.join(where, f"{s}-r{r}")
      report.record(raw, s, worker.run({
          "fn": "scripts.bench_train:train", "dir": path,
          "steps": args.steps, "width": args.width, "nice": args.nice}))
      shutil.rmtree(path, ignore_errors=True)
      print(f"  run {r + 1}/{args.runs} {s}: slowdown "
            f"{raw[s]['train_slowdown'][-1]:.2f}x", flush=True)
    info = pool.info
  figures = {s: {k: report.summarize(v) for k, v in raw[s].items()}
             for s in systems}
  out = {"preset": preset["name"], "runs": args.runs, "systems": figures,
         "steps": args.steps, "width": args.width, "workers": info,
         "machine": report.machine(), "notes": notes,
         "command": report.command("scripts.bench_train", argv)}
  if args.out:
    report.write(args.out, out)
  print()
  print(report.figure_table(figures, ROWS))
  for n in notes:
    print(f"note: {n}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
