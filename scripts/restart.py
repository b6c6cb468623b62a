"""Benchmark: from a restart to the first training step.

Usage (from the repository root):
  python -m scripts.restart [--processes 1,2,4] [--mib 512] [--width 2048]
      [--runs 3] [--cold] [--out F] [--dir D]

A job of N processes (``ckpt.multihost.local_cluster``: real
``jax.distributed`` processes on 127.0.0.1, 8 // N CPU devices each) saves a
random state of ``--mib`` MiB (float32 leaves sharded over every device,
plus an MLP's weights) once. Then, ``--runs`` times for each variant, a
fresh job is started and times, on every process, what a restarted trainer
does: start (from the launch until ckpt is imported and the cluster is
joined), build the target (``jax.eval_shape``), then

- ``sequential``: ``restore()``, then compile the train step;
- ``overlap``: ``restore_async()``, compile the train step meanwhile, then
  ``result()``;

then run the first training step (to ``block_until_ready``). It reports, per
process count and variant, the medians over runs of the slowest process's
seconds: start, restore (and its stages from ``last_restore_stats``:
find, index, read, finish), compile, and launch to the end of the first
step; and for ``overlap`` the ratio of restore+compile to the longer of the
two measured apart. ``--cold`` drops the page cache of the checkpoint before
each run (POSIX_FADV_DONTNEED on its files: the machine's whole cache is
left alone).

The floor of the overlap (issue 47, item 4): restore and compile compete for
the same cores, so it is max(restore, compile, (restore CPU + compile CPU) /
cores), each term from the ``sequential`` runs (walls of the slowest
process, CPU seconds summed over the processes, ``cores`` this machine's).
Printed after the table, per process count: the three terms, the
overlapped seconds, their ratio to the floor (target <= 1.1x) and whether
every overlapped run beat the sequential sum of its round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from scripts.benchlib import measure
from scripts.benchlib import report
from scripts.benchlib import workers


def _train_step(jax, jnp):
  """A two-layer MLP's SGD step: its compile takes seconds at width 2048."""
  def loss(p, x):
    h = jnp.tanh(x @ p["w1"])
    return jnp.mean((h @ p["w2"]) ** 2)

  def step(p, x):
    g = jax.grad(loss)(p, x)
    return jax.tree_util.tree_map(lambda a, b: a - 1e-3 * b, p, g)
  return step


def worker(conf: dict) -> None:
  """One process of a job (``conf["mode"]``: "save", "sequential" or
  "overlap")."""
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  local_cluster.init_from_env()
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  started = time.time() - conf["launched"]
  mesh = Mesh(np.array(jax.devices()), ("d",))
  rows = len(jax.devices()) * 256
  leaves = max(1, conf["mib"] * 2**20 // (rows * 1024 * 4))
  width = conf["width"]
  shapes = {f"l{i:03d}": ((rows, 1024), P("d", None)) for i in range(leaves)}
  shapes["w1"] = ((width, width), P(None, "d"))
  shapes["w2"] = ((width, width), P("d", None))
  target = {k: jax.ShapeDtypeStruct(s, jnp.float32,
                                    sharding=NamedSharding(mesh, spec))
            for k, (s, spec) in shapes.items()}
  c = ckpt.Checkpointer(conf["dir"], async_save=False)
  out = {"process": jax.process_index(), "start_s": started}
  if conf["mode"] == "save":
    rng = np.random.default_rng(0)
    state = {k: jax.make_array_from_callback(
        t.shape, t.sharding, lambda i, s=t.shape: rng.standard_normal(
            s, dtype=np.float32)[i]) for k, t in target.items()}
    c.save(1, state)
    c.close()
    local_cluster.write_result(out)
    return
  step = jax.jit(_train_step(jax, jnp))
  x_sharding = NamedSharding(mesh, P("d", None))
  x = jax.make_array_from_callback((rows, width), x_sharding,
                                   lambda i: np.ones((rows, width), np.float32)[i])
  params_t = {"w1": target["w1"], "w2": target["w2"]}
  t0 = time.perf_counter()
  c0 = time.process_time()
  if conf["mode"] == "sequential":
    state = c.restore(target=target)
    t1, c1 = time.perf_counter(), time.process_time()
    compiled = step.lower(params_t, x).compile()
    t2, c2 = time.perf_counter(), time.process_time()
    out["restore_s"], out["compile_s"] = t1 - t0, t2 - t1
    out["restore_cpu"], out["compile_cpu"] = c1 - c0, c2 - c1
  else:
    handle = c.restore_async(target=target)
    compiled = step.lower(params_t, x).compile()
    t1 = time.perf_counter()
    state = handle.result()
    t2 = time.perf_counter()
    out["compile_s"], out["wait_s"] = t1 - t0, t2 - t1
    out["restore_s"] = c.last_restore_stats.total_s
  out["both_s"] = time.perf_counter() - t0
  out["both_cpu"] = time.process_time() - c0
  params = jax.block_until_ready(compiled({"w1": state["w1"],
                                           "w2": state["w2"]}, x))
  del params
  out["first_step_s"] = time.time() - conf["launched"]
  s = c.last_restore_stats
  out.update(find_s=s.find_s, index_s=s.index_s, read_s=s.read_s,
             finish_s=s.finish_s, bytes=s.bytes_read)
  c.close()
  local_cluster.write_result(out)


def job(mode: str, n: int, conf: dict, cold: bool) -> dict:
  """One job of ``n`` processes; the slowest process's figures."""
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  if cold:
    measure.evict(conf["dir"])
  got = local_cluster.check(local_cluster.run(
      "scripts.restart", {**conf, "mode": mode, "launched": time.time()},
      num_processes=n, devices_per_process=max(1, 8 // n), timeout_s=600,
      cwd=os.getcwd()))
  # Walls: the slowest process's; CPU seconds: all processes' (the floor's
  # cores are the machine's).
  return {k: (sum if k.endswith("_cpu") else max)(r[k] for r in got)
          for k in got[0] if k != "process"}


def floor_line(n: int, runs: dict[str, list[dict]], cores: int) -> str:
  """The overlap against its floor (module docstring), from one process
  count's runs."""
  med = statistics.median
  seq, ovl = runs["sequential"], runs["overlap"]
  restore = med(g["restore_s"] for g in seq)
  compile_ = med(g["compile_s"] for g in seq)
  cpu = (med(g["restore_cpu"] for g in seq) +
         med(g["compile_cpu"] for g in seq))
  floor = max(restore, compile_, cpu / cores)
  both = med(g["both_s"] for g in ovl)
  below = all(o["both_s"] < s["restore_s"] + s["compile_s"]
              for o, s in zip(ovl, seq))
  return (f"{n} process(es), {cores} cores: restore alone {restore:.2f} s "
          f"(CPU {med(g['restore_cpu'] for g in seq):.2f}), compile alone "
          f"{compile_:.2f} s (CPU {med(g['compile_cpu'] for g in seq):.2f}), "
          f"(restore CPU + compile CPU) / cores {cpu / cores:.2f} s; floor "
          f"{floor:.2f} s; overlapped {both:.2f} s (CPU "
          f"{med(g['both_cpu'] for g in ovl):.2f}) = {both / floor:.2f}x the "
          f"floor (target <= 1.1x); below the sequential sum in every run: "
          f"{'yes' if below else 'NO'}")


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--processes", default="1,2,4")
  ap.add_argument("--mib", type=int, default=512)
  ap.add_argument("--width", type=int, default=2048)
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--cold", action="store_true")
  ap.add_argument("--out", default=None)
  ap.add_argument("--dir", default=None)
  a = ap.parse_args(argv)
  rows, floors = [], []
  cores = len(os.sched_getaffinity(0)) if hasattr(
      os, "sched_getaffinity") else os.cpu_count()
  with workers.workdir(a.dir) as root:
    for n in [int(p) for p in a.processes.split(",")]:
      conf = {"dir": os.path.join(root, f"p{n}"), "mib": a.mib,
              "width": a.width}
      job("save", n, conf, False)
      runs: dict[str, list[dict]] = {"sequential": [], "overlap": []}
      for r in range(a.runs):
        for mode in workers.rotated(["sequential", "overlap"], r):
          runs[mode].append(job(mode, n, conf, a.cold))
      floors.append(floor_line(n, runs, cores))
      for mode, got in runs.items():
        med = {k: statistics.median(g[k] for g in got) for k in got[0]}
        row = {"processes": n, "variant": mode, **med}
        if mode == "overlap":
          apart = runs["sequential"]
          longer = max(statistics.median(g["restore_s"] for g in apart),
                       statistics.median(g["compile_s"] for g in apart))
          row["ratio"] = med["both_s"] / longer
        else:
          row["ratio"] = float("nan")
        rows.append(row)
  cols = [("processes", "processes", "{}"), ("variant", "variant", "{}"),
          ("start s", "start_s", "{:.2f}"), ("restore s", "restore_s", "{:.2f}"),
          ("find", "find_s", "{:.3f}"), ("index", "index_s", "{:.3f}"),
          ("read", "read_s", "{:.2f}"), ("finish", "finish_s", "{:.3f}"),
          ("compile s", "compile_s", "{:.2f}"),
          ("restore+compile s", "both_s", "{:.2f}"),
          ("vs the longer", "ratio", "{:.2f}x"),
          ("launch to first step s", "first_step_s", "{:.2f}")]
  print(report.markdown(cols, rows))
  print()
  print("\n".join(floors))
  print(f"load {open('/proc/loadavg').read().split()[:3]}")
  if a.out:
    report.write(a.out, {"command": report.command("scripts.restart", argv),
                         "machine": report.machine(), "rows": rows,
                         "floors": floors})
  return 0


if __name__ == "__main__":
  if len(sys.argv) > 1 and sys.argv[1].startswith("{"):
    worker(json.loads(sys.argv[1]))
  else:
    sys.exit(main())
