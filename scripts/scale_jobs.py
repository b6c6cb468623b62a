"""Scale harness, part "jobs": real multi-process saves and restores.

For each N in ``processes`` it starts N local ``jax.distributed`` processes
(``ckpt.multihost.local_cluster``, one CPU device each, gloo collectives; this file is
also the worker) that hold the same state: ``leaves`` float32 leaves of
``min_kib``..``max_kib`` of random data, a ``sharded_fraction`` of them split
over the N devices, the rest replicated on every device. Each job makes one
warm-up save and restore (not counted), then ``saves`` saves (each followed
by ``wait_until_finished``) and ``restores`` restores onto the same
shardings, every one started by all processes together after a barrier of
their own, then ``empty_rounds`` empty barrier rounds and key-value sets
(what the coordination service costs at this N with nothing else to do).

Where a save's time goes, per process (``Checkpointer.last_save_stats`` and
two wrappers this worker puts around library functions):
- plan: ``plan_save`` (``SaveStats.plan_s``);
- data: ``save.write_owned`` (stage and write this process's boxes);
- coordination: every call into the coordination service during the save
  (``SaveStats.coordination_s``; ckpt/multihost/process.py times them), split into
  the barriers' floor (for each barrier, the wait of the process that came
  last: the service's own cost), the wait for other processes at barriers
  (skew: the others' data, process 0's index and commit), and key-value
  calls (a blocking get waits for process 0's decision);
- rest: the remainder (process 0's merge, index and commit, thread hops).
A restore: index (reading and decoding the index, opening the leaves),
data (reading and placing the leaves), coordination (its agreement round).

The second table splits a save's coordination: barrier floor and skew (as
above), kv (seconds in key-value calls), coord max (the process that spent
the most), the cost of an empty barrier round and of one key-value set at
this N with nothing else going on, floor/empty (the floor per barrier over
an empty round: near 1 when a save's barriers cost what the service costs),
the CPU seconds every process together spent per save (over the cores of
the machine, a lower bound on the save's wall time when they share it) and
per process, and the boxes (stored chunks) each process wrote per save.

Each figure of a row is the median over the saves (restores) of the mean
over the processes, except "save" and "restore", the median of the slowest
process's time (the job's), and the call counts, the largest per process.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from scripts.benchlib import measure
from scripts.benchlib.report import markdown

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULTS: dict[str, Any] = {
    "processes": [2, 4, 8, 16],
    "leaves": 500,
    "min_kib": 4,
    "max_kib": 64,
    "sharded_fraction": 0.5,
    "saves": 3,
    "restores": 3,
    "empty_rounds": 20,
    "idle_s": 1.0,  # each process sleeps this long, its CPU measured
    "format": "zarr",
    "async_save": True,
    "seed": 0,
    # Rows of every leaf are a multiple of this (so any N dividing it
    # splits them evenly); the default keeps the rows of earlier runs.
    "row_multiple": 16,
    # A mixed tree alongside the leaves: replicated and host numpy arrays,
    # inline small arrays, scalars and strings (``mixed_tree``).
    "mixed": False,
    "timeout_s": 900,
    "barrier_timeout_s": 300,
    "dir": None,  # where the jobs write (default: a temporary directory)
    # A path prefix: process 0 writes py-spy samples (collapsed stacks) of
    # its later saves and its restores to <prefix>.<N>.save.txt / .restore.txt.
    "profile": None,
}
COLUMNS = [
    ("N", "processes", "{:d}"),
    ("save s", "save_s", "{:.3f}"),
    ("plan s", "plan_s", "{:.3f}"),
    ("data s", "data_s", "{:.3f}"),
    ("coord s", "coordination_s", "{:.3f}"),
    ("rest s", "rest_s", "{:.3f}"),
    ("#barriers", "barriers", "{:d}"),
    ("#kv calls", "kv_calls", "{:d}"),
    ("restore s", "restore_s", "{:.3f}"),
    ("r.index s", "restore_index_s", "{:.3f}"),
    ("r.data s", "restore_data_s", "{:.3f}"),
    ("r.coord s", "restore_coordination_s", "{:.3f}"),
]
DETAIL_COLUMNS = [
    ("N", "processes", "{:d}"),
    ("coord s", "coordination_s", "{:.3f}"),
    ("barrier floor s", "barrier_floor_s", "{:.3f}"),
    ("barrier skew s", "barrier_skew_s", "{:.3f}"),
    ("kv s", "kv_s", "{:.3f}"),
    ("coord max s", "coordination_max_s", "{:.3f}"),
    ("empty barrier ms", "empty_barrier_ms", "{:.2f}"),
    ("kv set ms", "kv_set_ms", "{:.2f}"),
    ("floor/empty", "floor_over_empty", "{:.1f}"),
    ("job CPU s/save", "save_cpu_s", "{:.2f}"),
    ("CPU s/process", "cpu_per_process_s", "{:.2f}"),
    ("boxes/process", "boxes_per_process", "{:.0f}"),
    ("kv calls p0", "kv_calls_p0", "{:d}"),
    ("kv calls others", "kv_calls_others", "{:d}"),
]


# ---- the state --------------------------------------------------------------

def leaf_shapes(conf: dict[str, Any]) -> list[tuple[tuple[int, int], bool]]:
  """(shape, sharded) of every leaf: the same for every N, so rows compare.

  A shape is ``(m * a, 64)`` float32, ``m`` = ``row_multiple`` (rows
  divisible by any N dividing it): ``a`` from ``min_kib`` / 4 to
  ``max_kib`` / 4 (times 16 / m, so the sizes stay what they were).
  """
  rng = np.random.default_rng([conf["seed"], 1])
  m = conf["row_multiple"]
  lo = max(1, conf["min_kib"] // 4)
  hi = max(lo, conf["max_kib"] // 4)
  n_sharded = round(conf["leaves"] * conf["sharded_fraction"])
  return [((m * max(1, 16 * int(rng.integers(lo, hi + 1)) // m), 64),
           i < n_sharded) for i in range(conf["leaves"])]


def mixed_tree(conf: dict[str, Any], mesh) -> dict[str, Any]:
  """What a training state holds besides its sharded weights: arrays
  replicated on every device, a host numpy array, small (inline) arrays,
  scalars and a string; the same on every process."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng([conf["seed"], 3])
  replicated = NamedSharding(mesh, P())
  m = conf["row_multiple"]
  return {
      "step": 1000, "lr": 3e-4, "name": "run-a",
      "counts": np.arange(8, dtype=np.int32),
      "host_table": rng.standard_normal((m * 8, 32)).astype(np.float32),
      "ema": {f"r{i}": jax.device_put(
          rng.standard_normal((m * 4, 64)).astype(np.float32), replicated)
              for i in range(8)},
      "small": {f"s{i}": jax.device_put(jnp.full((4,), i, jnp.float32),
                                        replicated) for i in range(8)},
      "bf16": jax.device_put(
          rng.standard_normal((m * 2, 128)).astype(jnp.bfloat16),
          NamedSharding(mesh, P("x"))),
  }


def build_state(conf: dict[str, Any]):
  """(state, target): random arrays and their ShapeDtypeStructs."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices()), ("x",))
  state, target = {}, {}
  for i, (shape, sharded) in enumerate(leaf_shapes(conf)):
    sharding = NamedSharding(mesh, P("x") if sharded else P())
    value = np.random.default_rng([conf["seed"], 2, i]).standard_normal(
        shape, dtype=np.float32)
    name = f"layer_{i // 50}"
    state.setdefault(name, {})[f"w{i % 50}"] = jax.make_array_from_callback(
        shape, sharding, lambda idx, v=value: v[idx])
    target.setdefault(name, {})[f"w{i % 50}"] = jax.ShapeDtypeStruct(
        shape, np.float32, sharding=sharding)
  if conf["mixed"]:
    state["mixed"] = mixed_tree(conf, mesh)
    target["mixed"] = jax.tree_util.tree_map(
        lambda x: (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                   if isinstance(x, jax.Array) else x), state["mixed"])
  jax.block_until_ready(jax.tree_util.tree_leaves(state))
  return state, target

PER_PROCESS_COLUMNS = [
    ("leaves", "leaves", "{:d}"),
    ("N", "processes", "{:d}"),
    *[(f"{which} {name}", f"{prefix}{key}", "{:.3f}")
      for which, prefix in (("1st", "first_"), ("2nd+", "later_"))
      for name, key in (("save s", "save_s"), ("plan s", "plan_s"),
                        ("coord s", "coordination_s"), ("write s", "data_s"),
                        ("index s", "index_s"), ("tiling s", "tiling_s"))],
    ("2nd+ planned leaves", "later_planned_leaves", "{:d}"),
    ("CPU s/process/save", "cpu_per_process_s", "{:.3f}"),
    ("largest CPU s/save", "cpu_max_s", "{:.3f}"),
    ("p0 CPU s/save", "cpu_p0_s", "{:.3f}"),
    ("others' largest", "cpu_others_max_s", "{:.3f}"),
    ("p0 idle CPU s/s", "idle_cpu_p0_per_s", "{:.3f}"),
    ("others' idle CPU s/s", "idle_cpu_others_per_s", "{:.3f}"),
    ("p0 CPU s/save less idle", "cpu_p0_net_s", "{:.3f}"),
    ("restore s", "restore_s", "{:.3f}"),
    ("restore CPU s/process", "restore_cpu_s", "{:.3f}"),
]


# ---- the worker ---------------------------------------------------------------

class _Timer:
  """Wraps ``module.name`` (a sync or async function) to add up its time."""

  def __init__(self, module, name: str):
    import inspect  # pylint: disable=g-import-not-at-top
    self.seconds = 0.0
    fn = getattr(module, name)
    if inspect.iscoroutinefunction(fn):
      async def wrapped(*args, **kwargs):
        t = time.perf_counter()
        try:
          return await fn(*args, **kwargs)
        finally:
          self.seconds += time.perf_counter() - t
    else:
      def wrapped(*args, **kwargs):
        t = time.perf_counter()
        try:
          return fn(*args, **kwargs)
        finally:
          self.seconds += time.perf_counter() - t
    setattr(module, name, wrapped)

  def take(self) -> float:
    s, self.seconds = self.seconds, 0.0
    return s


def _barrier_waits(trace: list) -> list[list]:
  return [[arg, sec] for method, arg, _, sec in trace
          if method == "wait_at_barrier"]


class _Profile:
  """py-spy samples of some operations of one process, every thread
  (``conf["profile"]``: needs ``py-spy``, in the ``bench`` extra)."""

  def __init__(self, prefix: str | None, n: int):
    self.prefix, self.n = prefix, n

  @contextlib.contextmanager
  def of(self, what: str):
    if self.prefix is None:
      yield
      return
    out = f"{self.prefix}.{self.n}.{what}.txt"
    spy = subprocess.Popen(
        [shutil.which("py-spy") or "py-spy", "record", "--pid",
         str(os.getpid()), "--rate", "250", "--format", "raw", "--threads",
         "--output", out, "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attaches
    try:
      yield
    finally:
      spy.send_signal(signal.SIGINT)
      spy.wait(timeout=60)


def worker(conf: dict[str, Any]) -> None:
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  local_cluster.init_from_env()
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.multihost import process as multihost  # pylint: disable=g-import-not-at-top
  from ckpt.multihost import coordination  # pylint: disable=g-import-not-at-top
  from ckpt.restore import read as restore_lib  # pylint: disable=g-import-not-at-top
  from ckpt.save import write as save_lib  # pylint: disable=g-import-not-at-top
  from ckpt.commit import protocol as commit_lib  # pylint: disable=g-import-not-at-top
  from ckpt.multihost import agreement  # pylint: disable=g-import-not-at-top
  from ckpt.format import index as index_lib  # pylint: disable=g-import-not-at-top

  pid = jax.process_index()
  write_timer = _Timer(save_lib, "write_owned")
  index_timer = _Timer(restore_lib, "read_index")
  leaves_timer = _Timer(restore_lib, "checkpoint_leaves")
  read_timer = _Timer(restore_lib, "restore_tree")
  make_index_timer = _Timer(save_lib, "make_index")      # process 0
  encode_timer = _Timer(index_lib, "encode")             # process 0
  tiling_timer = _Timer(agreement, "_tiling_wrong")      # process 0
  commit_timer = _Timer(commit_lib, "commit")            # process 0
  state, target = build_state(conf)
  sync = iter(range(1 << 30))

  def together():
    multihost.barrier(f"scale-jobs/sync/{next(sync)}")

  ckptr = ckpt.Checkpointer(conf["dir"], format=conf["format"],
                            async_save=conf["async_save"],
                            barrier_timeout_s=conf["barrier_timeout_s"])

  def one_save(step: int) -> dict[str, Any]:
    together()
    coordination.trace_coordination(True)
    cpu, t = time.process_time(), time.perf_counter()
    ckptr.save(step, state)
    ckptr.wait_until_finished()
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    trace = coordination.trace_coordination(False)
    s = ckptr.last_save_stats
    return {
        "total_s": s.total_s, "wall_s": wall, "cpu_s": cpu,
        "plan_s": s.plan_s, "data_s": write_timer.take(),
        "index_s": make_index_timer.take() + encode_timer.take(),
        "tiling_s": tiling_timer.take(), "commit_s": commit_timer.take(),
        "planned_leaves": getattr(s, "planned_leaves", -1),
        "coordination_s": s.coordination_s, "barriers": s.barriers,
        "kv_calls": s.kv_calls,
        "kv_s": sum(sec for m, _, _, sec in trace if m != "wait_at_barrier"),
        "barrier_waits": _barrier_waits(trace),
        "bytes_written": s.bytes_written, "boxes_written": s.boxes_written}

  # The first save (first-use costs: TensorStore context, the first-step
  # round, and planning the tree the first time), reported on its own.
  first_save = one_save(0)
  restored = ckptr.restore(0, target=target)
  first = jax.tree_util.tree_leaves(restored)[0]
  truth = jax.tree_util.tree_leaves(state)[0]
  for a, b in zip(first.addressable_shards, truth.addressable_shards):
    if not np.array_equal(np.asarray(a.data), np.asarray(b.data)):
      raise AssertionError("the warm-up restore differs from the state")
  del restored
  index_timer.take(), leaves_timer.take(), read_timer.take()

  profile = _Profile(conf["profile"] if pid == 0 else None,
                     jax.process_count())
  threads0, labels = measure.thread_cpu(), measure.python_threads()
  cpu0 = time.process_time()
  with profile.of("save"):
    saves = [one_save(step) for step in range(1, conf["saves"] + 1)]
  cpu_saves = time.process_time() - cpu0
  labels.update(measure.python_threads())
  threads = {k: (g["user_s"] + g["sys_s"]) / conf["saves"]
             for k, g in measure.thread_cpu_by_name(
                 threads0, measure.thread_cpu(), labels).items()}
  # Threads that ended meanwhile (a coordination call's own thread, say).
  threads["ended"] = max(0.0, cpu_saves / conf["saves"]
                         - sum(threads.values()))

  restores = []
  for r in range(conf["restores"]):
    step = 1 + r % conf["saves"]
    together()
    coordination.trace_coordination(True)
    c0 = coordination.coordination_stats()
    cpu, t = time.process_time(), time.perf_counter()
    with profile.of("restore"):
      restored = ckptr.restore(step, target=target)
      jax.block_until_ready(jax.tree_util.tree_leaves(restored))
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    c = coordination.coordination_stats() - c0
    trace = coordination.trace_coordination(False)
    restores.append({
        "total_s": wall, "cpu_s": cpu,
        "index_s": index_timer.take() + leaves_timer.take(),
        "data_s": read_timer.take(), "coordination_s": c.seconds,
        "barriers": c.barriers, "kv_calls": c.kv_calls, "kv_s": c.kv_s,
        "barrier_waits": _barrier_waits(trace)})
    del restored
  ckptr.close()

  # What the service costs with nothing else going on.
  empty, kv = [], []
  client = multihost.coordination_client()
  together()
  # The CPU this process spends per second doing nothing (JAX's runtime;
  # on process 0 also the coordination service's background work for
  # every process): a save pays it for as long as it lasts.
  cpu, t = time.process_time(), time.perf_counter()
  time.sleep(conf["idle_s"])
  idle = (time.process_time() - cpu) / (time.perf_counter() - t)
  together()
  for i in range(conf["empty_rounds"]):
    t = time.perf_counter()
    multihost.barrier(f"scale-jobs/empty/{i}")
    empty.append(time.perf_counter() - t)
  together()
  for i in range(conf["empty_rounds"]):
    t = time.perf_counter()
    client.key_value_set(f"scale-jobs/kv/{i}/{pid}", "x")
    kv.append(time.perf_counter() - t)
  together()
  local_cluster.write_result({
      "process": pid, "leaves": len(jax.tree_util.tree_leaves(state)),
      "first_save": first_save, "saves": saves, "thread_cpu": threads,
      "restores": restores,
      "idle_cpu_per_s": idle,
      "empty_barrier_s": statistics.median(empty),
      "kv_set_s": statistics.median(kv)})


# ---- the driver ---------------------------------------------------------------

def _mean(xs) -> float:
  return sum(xs) / len(xs)


def _barrier_split(ops: list[dict]) -> tuple[float, float]:
  """(floor, skew) of one save or restore over the processes: the floor is
  the sum over its barriers of the shortest wait (the last arrival's), the
  skew the mean over processes of the rest of their barrier waits."""
  by_name: dict[str, list[float]] = {}
  for op in ops:
    for name, sec in op["barrier_waits"]:
      by_name.setdefault(name, []).append(sec)
  floor = sum(min(v) for v in by_name.values())
  total = _mean([sum(sec for _, sec in op["barrier_waits"]) for op in ops])
  return floor, total - floor


def summarize(n: int, results: list[dict]) -> dict[str, Any]:
  saves = list(zip(*(r["saves"] for r in results)))       # [save][process]
  restores = list(zip(*(r["restores"] for r in results)))
  med = statistics.median

  def per_save(ops, key, agg=_mean):
    return med([agg([p[key] for p in op]) for op in ops])

  splits = [_barrier_split(op) for op in saves]
  row = {
      "processes": n,
      "save_s": per_save(saves, "total_s", max),
      "plan_s": per_save(saves, "plan_s"),
      "data_s": per_save(saves, "data_s"),
      "coordination_s": per_save(saves, "coordination_s"),
      "coordination_max_s": per_save(saves, "coordination_s", max),
      "rest_s": med([_mean([p["total_s"] - p["plan_s"] - p["data_s"]
                            - p["coordination_s"] for p in op])
                     for op in saves]),
      "barrier_floor_s": med([f for f, _ in splits]),
      "barrier_skew_s": med([s for _, s in splits]),
      "kv_s": per_save(saves, "kv_s"),
      "barriers": max(p["barriers"] for op in saves for p in op),
      "kv_calls": max(p["kv_calls"] for op in saves for p in op),
      "kv_calls_p0": max(op[0]["kv_calls"] for op in saves),
      "kv_calls_others": max(p["kv_calls"] for op in saves for p in op[1:]),
      "save_cpu_s": per_save(saves, "cpu_s", sum),
      "restore_s": per_save(restores, "total_s", max),
      "restore_cpu_s": per_save(restores, "cpu_s"),
      "restore_index_s": per_save(restores, "index_s"),
      "restore_data_s": per_save(restores, "data_s"),
      "restore_coordination_s": per_save(restores, "coordination_s"),
      "restore_barriers": max(p["barriers"] for op in restores for p in op),
      "restore_kv_calls": max(p["kv_calls"] for op in restores for p in op),
      "empty_barrier_ms": 1e3 * _mean([r["empty_barrier_s"] for r in results]),
      "kv_set_ms": 1e3 * _mean([r["kv_set_s"] for r in results]),
      "bytes_written": per_save(saves, "bytes_written", sum),
      "boxes_per_process": per_save(saves, "boxes_written"),
  }
  firsts = [r["first_save"] for r in results]
  row["leaves"] = results[0]["leaves"]
  for prefix, ops in (("first_", [firsts]), ("later_", saves)):
    row[prefix + "save_s"] = per_save(ops, "total_s", max)
    for k in ("plan_s", "coordination_s", "data_s"):
      row[prefix + k] = per_save(ops, k)
    for k in ("index_s", "tiling_s", "commit_s"):  # process 0's
      row[prefix + k] = med([op[0][k] for op in ops])
    row[prefix + "planned_leaves"] = max(p["planned_leaves"] for op in ops
                                         for p in op)
  row["cpu_per_process_s"] = row["save_cpu_s"] / n
  # The largest per-process CPU of a later save (process 0 included): the
  # median over the saves of the largest over the processes; process 0's
  # and the largest of the others apart (process 0 alone commits).
  row["cpu_max_s"] = per_save(saves, "cpu_s", max)
  row["cpu_p0_s"] = med([op[0]["cpu_s"] for op in saves])
  row["cpu_others_max_s"] = (med([max(p["cpu_s"] for p in op[1:])
                                  for op in saves]) if n > 1 else 0.0)
  # Process 0's CPU per second idle, and its CPU per later save less that
  # rate times the save's wall time (what the save itself costs it).
  row["idle_cpu_p0_per_s"] = results[0].get("idle_cpu_per_s", 0.0)
  row["idle_cpu_others_per_s"] = (_mean([r.get("idle_cpu_per_s", 0.0)
                                         for r in results[1:]])
                                  if n > 1 else 0.0)
  row["cpu_p0_net_s"] = med([op[0]["cpu_s"] - row["idle_cpu_p0_per_s"]
                             * op[0]["wall_s"] for op in saves])
  # Per save, the mean over the processes, by thread name (the largest).
  names = {k for r in results for k in r.get("thread_cpu", {})}
  by_thread = {k: _mean([r.get("thread_cpu", {}).get(k, 0.0)
                         for r in results]) for k in names}
  row["thread_cpu_s"] = dict(sorted(by_thread.items(),
                                    key=lambda kv: -kv[1])[:10])
  row["thread_cpu_p0_s"] = dict(sorted(
      results[0].get("thread_cpu", {}).items(), key=lambda kv: -kv[1])[:12])
  row["floor_over_empty"] = (row["barrier_floor_s"] / max(row["barriers"], 1)
                             / max(row["empty_barrier_ms"] / 1e3, 1e-9))
  return row


def run(conf: dict[str, Any]) -> list[dict[str, Any]]:
  """One row per process count (see the module docstring)."""
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  conf = {**DEFAULTS, **conf}
  own = conf["dir"] is None
  base = tempfile.mkdtemp(prefix="ckpt-scale-jobs-") if own else conf["dir"]
  rows = []
  counts = conf["leaves"] if isinstance(conf["leaves"], list) else [
      conf["leaves"]]
  try:
    for leaves in counts:
      for n in conf["processes"]:
        job_dir = os.path.join(base, f"l{leaves}n{n}")
        t0 = time.perf_counter()
        results = local_cluster.check(local_cluster.run(
            "scripts.scale_jobs", {**conf, "leaves": leaves, "dir": job_dir},
            num_processes=n, devices_per_process=1,
            timeout_s=conf["timeout_s"], cwd=str(ROOT)))
        rows.append(summarize(n, results))
        rows[-1]["job_s"] = time.perf_counter() - t0
        shutil.rmtree(job_dir, ignore_errors=True)
        print(f"  jobs: {leaves} leaves, {n} processes done in "
              f"{rows[-1]['job_s']:.0f} s", file=sys.stderr, flush=True)
  finally:
    if own:
      shutil.rmtree(base, ignore_errors=True)
  return rows


def table(rows: list[dict]) -> str:
  if not rows:
    return "(no rows)"
  text = [markdown(COLUMNS, rows), "",
          "Coordination of a save, split (seconds per process, mean):", "",
          markdown(DETAIL_COLUMNS, rows), "",
          "Per-process cost of a save, the 1st and the 2nd and later "
          "(seconds; plan, coord, write: mean over processes; index, "
          "tiling: process 0's; save: the slowest process):", "",
          markdown(PER_PROCESS_COLUMNS, rows), "",
          "CPU seconds per save and process (mean), by thread name:", ""]
  text += [f"- N={r['processes']}, {r['leaves']} leaves: " + ", ".join(
      f"{k} {v:.3f}" for k, v in r.get("thread_cpu_s", {}).items())
           for r in rows]
  text += ["", "Process 0's CPU seconds per save, by thread name:", ""]
  text += [f"- N={r['processes']}, {r['leaves']} leaves: " + ", ".join(
      f"{k} {v:.3f}" for k, v in r.get("thread_cpu_p0_s", {}).items())
           for r in rows]
  for leaves in sorted({r["leaves"] for r in rows}):
    text += _ratios([r for r in rows if r["leaves"] == leaves])
  return "\n".join(text)


def _ratios(rows: list[dict]) -> list[str]:
  """What grew from the first process count to the last (one leaf count)."""
  first, last = rows[0], rows[-1]
  if last["processes"] == first["processes"]:
    return []
  ratio = last["coordination_s"] / max(first["coordination_s"], 1e-9)
  floor = ((last["barrier_floor_s"] + last["kv_s"]) /
           max(first["barrier_floor_s"] + first["kv_s"], 1e-9))
  empty = last["empty_barrier_ms"] / max(first["empty_barrier_ms"], 1e-9)
  skew = last["barrier_skew_s"] / max(last["coordination_s"], 1e-9)
  cpu = last["cpu_per_process_s"] / max(first["cpu_per_process_s"], 1e-9)
  largest = last["cpu_max_s"] / max(first["cpu_max_s"], 1e-9)
  return ["", (
      f"{first['leaves']} leaves, {last['processes']} processes / "
      f"{first['processes']}: 1st save "
      f"{last['first_save_s'] / max(first['first_save_s'], 1e-9):.1f}x, 2nd "
      f"and later {last['later_save_s'] / max(first['later_save_s'], 1e-9):.1f}x"
      f", CPU per process per save {cpu:.1f}x (the mean), the LARGEST "
      f"per-process CPU per save {first['cpu_max_s']:.3f} -> "
      f"{last['cpu_max_s']:.3f} s: {largest:.2f}x (process 0 "
      f"{first['cpu_p0_s']:.3f} -> {last['cpu_p0_s']:.3f} s, the largest "
      f"other {first['cpu_others_max_s']:.3f} -> "
      f"{last['cpu_others_max_s']:.3f} s; target <= 1.3x: "
      f"{'met' if largest <= 1.3 else 'MISSED'}; process 0 idle "
      f"{first['idle_cpu_p0_per_s']:.3f} -> {last['idle_cpu_p0_per_s']:.3f}"
      f" CPU s/s, its CPU per save less that over the save's wall "
      f"{first['cpu_p0_net_s']:.3f} -> {last['cpu_p0_net_s']:.3f} s) "
      "(the job's CPU over "
      f"{os.cpu_count()} cores: {last['save_cpu_s'] / os.cpu_count():.3f} s "
      f"at {last['processes']}), restore "
      f"{last['restore_s'] / max(first['restore_s'], 1e-9):.1f}x (CPU per "
      f"process {last['restore_cpu_s'] / max(first['restore_cpu_s'], 1e-9):.1f}"
      "x). "
      f"Coordination per save {ratio:.1f}x (target: within 2x: "
      f"{'met' if ratio <= 2 else 'MISSED'}); at {last['processes']}, "
      f"{100 * skew:.0f}% of it is the wait at barriers for slower "
      f"processes. The service's own cost (barrier floor + kv): "
      f"{floor:.1f}x; an empty barrier round on this machine: {empty:.1f}x "
      f"(N processes share {os.cpu_count()} cores), so {floor / empty:.1f}x "
      f"with that contention divided out. Calls per save per process: "
      f"{first['barriers']} -> {last['barriers']} barriers, "
      f"{first['kv_calls']} -> {last['kv_calls']} key-value calls.")]


if __name__ == "__main__":
  from ckpt.multihost import local_cluster as _lc  # pylint: disable=g-import-not-at-top
  if os.environ.get(_lc.ENV_CONFIG) and len(sys.argv) == 2:
    worker(json.loads(sys.argv[1]))
    sys.exit(0)
  from scripts import scale  # pylint: disable=g-import-not-at-top
  sys.exit(scale.main(["--part", "jobs", *sys.argv[1:]]))
