"""One process of a multi-process job for tests/multiprocess/test_service.py.

Run as ``python -m tests.multiprocess.service_worker <json config>`` by
``ckpt.multihost.local_cluster``; ``config["scenario"]`` picks what to do. Every
scenario checks what it can inside the job and returns a typed result
(``RESULTS[scenario]``, tests/multiprocess/worker.py) that the test decodes
and asserts on. The state helpers at the top (``kill_state`` and
friends) are pure numpy so the test process can rebuild the expected values.
"""

from __future__ import annotations

import dataclasses
import json
import logging as std_logging
import os
import threading
import time
from typing import Any

import numpy as np

from tests.multiprocess import worker
from tests.multiprocess.worker import Error

# ---- deterministic states (pure numpy; also imported by the test) ---------

KILL_SHAPES = {
    # ~26 MB in all: saves take a noticeable time on a small CPU machine.
    "w": ((1024, 4096), "float32"),     # sharded over both mesh axes
    "emb": ((2048, 512), "float32"),    # sharded over x, replicated over y
    "r": ((512, 1024), "float32"),      # replicated on every device
    "i": ((1024, 1024), "int32"),       # sharded over y on axis 1
}
KILL_SPECS = {"w": ("x", "y"), "emb": ("x", None), "r": (), "i": (None, "y")}


def _base(name: str, shape, dtype: str, seed: int) -> np.ndarray:
  rng = np.random.default_rng([seed, sum(map(ord, name))])
  if np.dtype(dtype).kind == "f":
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)
  return rng.integers(-2**20, 2**20, size=shape, dtype=np.int64).astype(dtype)


_KILL_BASE: dict[str, np.ndarray] = {}


def kill_state(step: int) -> dict[str, Any]:
  """The state a kill-test job saves at ``step``: base + step, every element
  differs from one step to the next."""
  if not _KILL_BASE:
    for name, (shape, dtype) in KILL_SHAPES.items():
      _KILL_BASE[name] = _base(name, shape, dtype, 1234)
  out: dict[str, Any] = {
      name: base + np.asarray(step, dtype=base.dtype)
      for name, base in _KILL_BASE.items()}
  out["step"] = step
  return out


PREEMPT_SHAPES = {"a": ((64, 128), "float32"), "b": ((128, 32), "int32")}
PREEMPT_SPECS = {"a": ("x", "y"), "b": ("y", None)}


def preempt_base() -> dict[str, np.ndarray]:
  """Integers (also as float32) so that base + step is exact in any order."""
  out = {}
  for name, (shape, dtype) in PREEMPT_SHAPES.items():
    rng = np.random.default_rng([7, sum(map(ord, name))])
    out[name] = rng.integers(-1000, 1000, size=shape).astype(dtype)
  return out


def same_bits(a: Any, b: Any) -> bool:
  """Bit-exact equality of two arrays (NaN payloads and -0.0 included)."""
  a, b = np.asarray(a), np.asarray(b)
  return (a.dtype == b.dtype and a.shape == b.shape and
          np.ascontiguousarray(a).tobytes() ==
          np.ascontiguousarray(b).tobytes())


# ---- jax helpers (only in a worker, after init_from_env) ------------------


def _mesh(shape):
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  return Mesh(np.array(jax.devices()).reshape(shape), ("x", "y"))


def _sharding(mesh, spec):
  from jax import sharding  # pylint: disable=g-import-not-at-top
  return sharding.NamedSharding(mesh, sharding.PartitionSpec(*spec))


def _put(value: np.ndarray, sharding):
  import jax  # pylint: disable=g-import-not-at-top
  return jax.make_array_from_callback(value.shape, sharding,
                                      lambda idx: value[idx],
                                      dtype=value.dtype)


def _target(value: np.ndarray, sharding):
  import jax  # pylint: disable=g-import-not-at-top
  return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)


def _snapshot(arr) -> list[tuple[tuple, np.ndarray]]:
  """Host copies of this process's distinct shards of ``arr``."""
  out, seen = [], set()
  for s in arr.addressable_shards:
    key = tuple((sl.start, sl.stop) for sl in s.index)
    if key not in seen:
      seen.add(key)
      out.append((s.index, np.array(s.data, copy=True)))
  return out


def _shards_match(arr, expected_full: np.ndarray) -> bool:
  """Every addressable shard of ``arr`` equals ``expected_full`` there."""
  return (tuple(arr.shape) == expected_full.shape and
          all(same_bits(np.asarray(s.data), expected_full[s.index])
              for s in arr.addressable_shards))


def _snapshot_matches(restored, snap, *, full: bool) -> bool:
  """``restored`` (a host array if ``full``, else a jax.Array with the
  snapshot's sharding) equals every shard of a ``_snapshot``."""
  for index, data in snap:
    if full:
      got = np.asarray(restored)[index]
    else:
      got = next(np.asarray(s.data) for s in restored.addressable_shards
                 if s.index == index)
    if not same_bits(got, data):
      return False
  return True


class _Warnings(std_logging.Handler):
  """Collects absl/python log records at WARNING and above."""

  def __init__(self):
    super().__init__(std_logging.WARNING)
    self.messages: list[str] = []

  def emit(self, record):
    self.messages.append(record.getMessage())


def _capture_warnings() -> _Warnings:
  h = _Warnings()
  std_logging.getLogger("absl").addHandler(h)
  return h


def _sync(name: str, timeout_s: float = 120.0) -> None:
  from ckpt.multihost import process as multihost  # pylint: disable=g-import-not-at-top
  multihost.barrier(f"test/{name}", timeout_s=timeout_s, what="test sync")


def _wait_file(path: str, timeout_s: float) -> bool:
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if os.path.exists(path):
      return True
    time.sleep(0.02)
  return False


def _touch(path: str) -> None:
  with open(path + ".partial", "w") as f:
    f.write(str(time.time()))
  os.replace(path + ".partial", path)


# ---- the results (tests/multiprocess/worker.py) ---------------------------


@dataclasses.dataclass(frozen=True)
class StatRow:
  """One save's last_save_stats."""
  step: int
  blocking_s: float
  total_s: float
  bytes_written: int
  skipped: bool


@dataclasses.dataclass(frozen=True)
class Async:
  saved: list[bool]
  stats: list[StatRow]
  in_flight_at_return: list[bool]
  prev_committed_at_return: list[bool]
  donated: list[bool]
  reader_saw: list[list[int]]
  exact_sharded: dict[str, bool]    # by step
  exact_full: dict[str, bool]       # by step
  scalars: dict[str, list[Any]]     # by step: step, note (sharded, full)
  all_steps: list[int]
  sync_committed: bool
  sync_stats: list[float]           # blocking_s, total_s


@dataclasses.dataclass(frozen=True)
class BgFail:
  pid: int
  a_returned: bool
  a: Error | None
  a_wait_s: float
  a_again: Error | None
  b_returned: bool
  b: Error | None
  b_step4_exists: bool
  c_returned: bool
  c: Error | None
  c_closed: Error | None
  tmp_before: list[str]
  tmp_after: list[str]
  all_steps: list[int]
  exact: dict[str, bool]            # by step


@dataclasses.dataclass(frozen=True)
class BudgetCase:
  peak_bytes_in_flight: int
  bytes_written: int
  boxes_written: int
  rss_delta: int
  exact: bool
  total_s: float
  blocking_s: float


@dataclasses.dataclass(frozen=True)
class Budget:
  cases: dict[str, BudgetCase]      # by label


@dataclasses.dataclass(frozen=True)
class Phase:
  """One phase of the barrier timeout, on one process: the saver's error
  and time, or the late process's wait for the saver's mark."""
  error: Error | None = None
  barrier_error: bool | None = None
  seconds: float | None = None
  waited: bool | None = None


@dataclasses.dataclass(frozen=True)
class BarrierTimeout:
  pid: int
  phases: dict[str, Phase]          # "0", "1"
  committed: list[list[int]]
  wall_s: float


@dataclasses.dataclass(frozen=True)
class RetentionCase:
  history: list[list[int]]
  metrics: dict[str, dict[str, Any]]
  metrics_fresh: dict[str, dict[str, Any]]
  on_disk: list[str]


@dataclasses.dataclass(frozen=True)
class Retention:
  cases: dict[str, RetentionCase]   # by name


@dataclasses.dataclass(frozen=True)
class P1Mesh:
  local_shards: int
  exact: bool


@dataclasses.dataclass(frozen=True)
class Resave:
  """One phase of resave_host_state (fields of the other phases: None)."""
  pid: int
  saved: list[bool] | None = None
  hs: dict[str, Any] | None = None  # host_state values, jsonable
  resave: list[Any] | None = None   # first: [the lower save's error, 3's]
  resaved: bool | None = None       # restart: the resume step's save
  resave_skipped_stat: bool | None = None
  warnings: list[str] | None = None
  exact: dict[str, bool] | None = None
  hs_after: Any = None
  resume: int | None = None
  resume_exact: bool | None = None
  next: bool | None = None
  all_steps: list[int] | None = None
  p1_mesh: P1Mesh | None = None
  p1_mesh_error: Error | None = None
  error: Error | None = None


@dataclasses.dataclass(frozen=True)
class Preempt:
  pid: int
  step: int | None
  t_notice: float | None = None
  last: int | None = None


@dataclasses.dataclass(frozen=True)
class KillLoop:
  pid: int
  latest_before: int | None
  resume_exact: bool | None
  all_steps: list[int]


@dataclasses.dataclass(frozen=True)
class Race:
  restore_s: float
  all_steps: list[int]
  committed_before: bool | None = None
  restore: str | None = None        # "ok", "not_found", "error"
  exact: bool | None = None
  error: Error | None = None


@dataclasses.dataclass(frozen=True)
class RestoreRace:
  pid: int
  variants: dict[str, Race]


@dataclasses.dataclass(frozen=True)
class Files:
  files: list[str]
  hs: Any
  exact: bool
  verify: list[str]
  big: Error | None
  steps: list[int]
  left: list[str]


@dataclasses.dataclass(frozen=True)
class ProcessFiles:
  pid: int
  formats: dict[str, Files]         # "zarr", "zarr3"


@dataclasses.dataclass(frozen=True)
class Several:
  bgfail: BgFail | None = None
  retention: Retention | None = None
  restore_race: RestoreRace | None = None
  barrier_timeout: BarrierTimeout | None = None


# ---- scenarios ------------------------------------------------------------


def scenario_async(conf: dict) -> Async:
  """Async saves in a row, each followed by donating jitted steps."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top

  root = conf["dir"]
  mesh = _mesh((4, 2))
  specs = {"w": ("x", "y"), "b": ("y",), "r": (), "i": ("x", None),
           "h": (None, "x")}
  host = {"w": _base("w", (512, 1024), "float32", 1),
          "b": _base("b", (1024,), "float32", 2),
          "r": _base("r", (256, 256), "float32", 3),
          "i": _base("i", (128, 512), "int32", 4),
          "h": _base("h", (256, 512), "bfloat16", 5)}
  shardings = {k: _sharding(mesh, specs[k]) for k in host}
  params = {k: _put(v, shardings[k]) for k, v in host.items()}

  def _step(p):
    return {k: (v * 3 + 1 if jnp.issubdtype(v.dtype, jnp.integer)
                else v * 1.5 + 0.25) for k, v in p.items()}
  step_fn = jax.jit(_step, donate_argnums=0)

  steps = [10, 20, 30, 40]
  snaps, stats, notes = {}, [], []
  in_flight_at_return, prev_committed_at_return, donated = [], [], []
  reader_saw = []
  ck = ckpt.Checkpointer(root, async_save=True)
  for k, step in enumerate(steps):
    snaps[step] = {name: _snapshot(a) for name, a in params.items()}
    ok = ck.save(step, {"params": params, "step": step, "note": f"s{step}"})
    st = ck.last_save_stats
    committed_now = os.path.exists(
        os.path.join(root, f"checkpoint_{step}", "index.msgpack"))
    in_flight_at_return.append(ok and not committed_now)
    if k == 1:  # open (and close) a reader while this save is in flight
      reader = ckpt.Checkpointer(root)
      reader_saw.append(reader.all_steps())
      reader.close()
    if k:
      prev_committed_at_return.append(os.path.exists(
          os.path.join(root, f"checkpoint_{steps[k - 1]}", "index.msgpack")))
    old = params
    for _ in range(3):  # donate the saved buffers right away
      params = step_fn(params)
    donated.append(all(a.is_deleted() for a in old.values()))
    del old
    stats.append(st)
    notes.append(ok)
  ck.wait_until_finished()
  stat_rows = [StatRow(s.step, s.blocking_s, s.total_s, s.bytes_written,
                       s.skipped) for s in stats]
  # Bit-exact restore of every step: onto the saving shardings, and as full
  # host values (which also covers the other processes' shards).
  exact_sharded, exact_full, scalars = {}, {}, {}
  for step in steps:
    target = {"params": {k: _target(host[k], shardings[k]) for k in host},
              "step": 0, "note": ""}
    out = ck.restore(step, target=target)
    exact_sharded[str(step)] = all(
        _snapshot_matches(out["params"][k], snaps[step][k], full=False)
        for k in host)
    full = ck.restore(step)
    exact_full[str(step)] = all(
        _snapshot_matches(full["params"][k], snaps[step][k], full=True)
        for k in host)
    scalars[str(step)] = [int(out["step"]), str(out["note"]),
                          int(full["step"]), str(full["note"])]
  all_steps = ck.all_steps()
  ck.close()
  # A synchronous save returns only once it is committed.
  sync = ckpt.Checkpointer(os.path.join(root, "sync"), async_save=False)
  sync.save(1, {"params": params})
  sync_committed = os.path.exists(
      os.path.join(root, "sync", "checkpoint_1", "index.msgpack"))
  sync_stats = sync.last_save_stats
  sync.close()
  return Async(notes, stat_rows, in_flight_at_return,
               prev_committed_at_return, donated, reader_saw, exact_sharded,
               exact_full, scalars, all_steps, sync_committed,
               [sync_stats.blocking_s, sync_stats.total_s])


def scenario_bgfail(conf: dict) -> BgFail:
  """Failures on the background thread, re-raised by wait/save/close.

  Process 0 commits by renaming the work directory to ``checkpoint_<step>``;
  a plain file of that name makes the rename fail on process 0 only, after
  every process has written. Process 1, waiting at the last barrier, must
  fail too (told by process 0, or at worst by the barrier timeout).
  """
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top

  root = conf["dir"]
  pid = jax.process_index()
  mesh = _mesh((2, 2))
  host = {"w": _base("w", (256, 128), "float32", 11),
          "i": _base("i", (64, 64), "int32", 12)}
  sh = {"w": _sharding(mesh, ("x", "y")), "i": _sharding(mesh, (None, "x"))}
  state = {k: _put(v, sh[k]) for k, v in host.items()}
  timeout = conf["barrier_timeout_s"]
  out: dict[str, Any] = {"pid": pid}

  def block(step):
    if pid == 0:
      with open(os.path.join(root, f"checkpoint_{step}"), "w") as f:
        f.write("not a directory")
    _sync(f"block{step}")

  ck = ckpt.Checkpointer(root, barrier_timeout_s=timeout)
  ck.save(1, state)
  ck.wait_until_finished()

  # (a) wait_until_finished re-raises.
  block(2)
  out["a_returned"] = ck.save(2, state)
  t0 = time.monotonic()
  try:
    ck.wait_until_finished()
    out["a"] = None
  except ckpt.CheckpointError as e:
    out["a"] = Error.of(e)
  out["a_wait_s"] = time.monotonic() - t0
  try:
    ck.wait_until_finished()  # reported once, then cleared
    out["a_again"] = None
  except ckpt.CheckpointError as e:
    out["a_again"] = Error.of(e)
  _sync("after_a")

  # (b) the next save re-raises, and does not save its own step.
  block(3)
  out["b_returned"] = ck.save(3, state)
  try:
    ck.save(4, state)
    out["b"] = None
  except ckpt.CheckpointError as e:
    out["b"] = Error.of(e)
  _sync("after_b")
  out["b_step4_exists"] = any(
      n.startswith("checkpoint_4") for n in os.listdir(root))

  # (c) close re-raises.
  block(5)
  out["c_returned"] = ck.save(5, state)
  try:
    ck.close()
    out["c"] = None
  except ckpt.CheckpointError as e:
    out["c"] = Error.of(e)
  try:
    ck.save(6, state)
    out["c_closed"] = None
  except ckpt.CheckpointError as e:
    out["c_closed"] = Error.of(e)
  _sync("after_c")

  # A new Checkpointer (process 0) cleans up; saving works again.
  out["tmp_before"] = sorted(n for n in os.listdir(root) if ".tmp-" in n)
  _sync("listed")
  if pid == 0:
    for s in (2, 3, 5):
      os.remove(os.path.join(root, f"checkpoint_{s}"))
  ck2 = ckpt.Checkpointer(root, barrier_timeout_s=60)
  ck2.save(6, state)  # process 0 removes abandoned work at its first save
  ck2.wait_until_finished()
  out["tmp_after"] = sorted(n for n in os.listdir(root) if ".tmp-" in n)
  out["all_steps"] = ck2.all_steps()
  tgt = {k: _target(v, sh[k]) for k, v in host.items()}
  out["exact"] = {str(s): all(
      _shards_match(ck2.restore(s, target=tgt)[k], host[k]) for k in host)
                  for s in (1, 6)}
  ck2.close()
  return BgFail(**out)


def _rss_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRss:
  """Samples this process's resident memory while a save runs."""

  def __init__(self):
    self.base = _rss_bytes()
    self.peak = self.base
    self._stop = threading.Event()
    self._t = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    while not self._stop.is_set():
      self.peak = max(self.peak, _rss_bytes())
      time.sleep(0.0005)

  def __enter__(self):
    self._t.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._t.join()
    self.peak = max(self.peak, _rss_bytes())


def scenario_budget(conf: dict) -> Budget:
  """Saves under a byte budget much smaller than the state, one per case.

  Each case is ``{"shapes": {name: [shape, dtype]}, "specs": {name: spec or
  None}}``; a None spec makes a host numpy leaf. Resident memory is sampled
  during the second save of each case: the first (into another directory)
  pays the one-time costs (thread pools, allocator arenas, compression
  contexts) that are not what the budget bounds.
  """
  import gc  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top

  root = conf["dir"]
  mesh = _mesh((2, 2))
  budget, chunk = conf["budget"], conf["chunk_bytes"]
  out: dict[str, Any] = {}
  for label, case in conf["cases"].items():
    specs = case["specs"]
    host = {name: _base(name, tuple(shape), dtype, 21 + i)
            for i, (name, (shape, dtype)) in enumerate(case["shapes"].items())}
    sh = {k: _sharding(mesh, specs[k]) for k in host if specs[k] is not None}
    state = {k: (_put(v, sh[k]) if k in sh else v) for k, v in host.items()}
    with ckpt.Checkpointer(os.path.join(root, f"warmup_{label}"),
                           concurrent_bytes=budget, chunk_bytes=chunk) as warm:
      warm.save(1, state)
    ck = ckpt.Checkpointer(os.path.join(root, label), concurrent_bytes=budget,
                           chunk_bytes=chunk)
    gc.collect()
    _sync(f"before_{label}")
    with _PeakRss() as rss:
      ck.save(1, state)
      ck.wait_until_finished()
    st = ck.last_save_stats
    tgt = {k: (_target(v, sh[k]) if k in sh else v) for k, v in host.items()}
    restored = ck.restore(1, target=tgt)
    exact = all(_shards_match(restored[k], host[k]) if k in sh
                else same_bits(restored[k], host[k]) for k in host)
    full = ck.restore(1)
    exact = exact and all(same_bits(full[k], host[k]) for k in host)
    out[label] = BudgetCase(st.peak_bytes_in_flight, st.bytes_written,
                            st.boxes_written, rss.peak - rss.base, exact,
                            st.total_s, st.blocking_s)
    ck.close()
    del restored, full, state
  return Budget(out)


def scenario_barrier_timeout(conf: dict) -> BarrierTimeout:
  """One process never arrives; the other raises within the timeout."""
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top

  started = time.monotonic()
  root, marks = conf["dir"], conf["marks"]
  timeout = conf["barrier_timeout_s"]
  pid = jax.process_index()
  mesh = _mesh((2, 2))
  host = _base("w", (128, 256), "float32", 31)
  state = {"w": _put(host, _sharding(mesh, ("x", "y")))}
  phases: dict[str, Phase] = {}
  # Same Checkpointers in the same order on both (keys line up).
  ck1 = ckpt.Checkpointer(os.path.join(root, "a"), barrier_timeout_s=timeout)
  ck2 = ckpt.Checkpointer(os.path.join(root, "b"), barrier_timeout_s=timeout)
  for phase, (ck, saver, step) in enumerate(((ck1, 0, 7), (ck2, 1, 8))):
    if pid == saver:
      t0 = time.monotonic()
      error = barrier_error = None
      try:
        ck.save(step, state)
        ck.wait_until_finished()
      except ckpt.CheckpointError as e:
        error = Error.of(e)
        barrier_error = isinstance(e, ckpt.BarrierTimeoutError)
      phases[str(phase)] = Phase(error, barrier_error,
                                 time.monotonic() - t0)
      _touch(os.path.join(marks, f"phase{phase}_done"))
    else:  # never arrives: sleeps (bounded) until the other gave up
      phases[str(phase)] = Phase(waited=_wait_file(
          os.path.join(marks, f"phase{phase}_done"), 4 * timeout + 30))
    _sync(f"phase{phase}")
  return BarrierTimeout(pid, phases, [ck1.all_steps(), ck2.all_steps()],
                        time.monotonic() - started)


def scenario_retention(conf: dict) -> Retention:
  """Real saves with retention policies; all_steps() after each save."""
  import ckpt  # pylint: disable=g-import-not-at-top

  mesh = _mesh((2, 2))
  host = _base("w", (64, 64), "float32", 41)
  state = {"w": _put(host, _sharding(mesh, ("x", "y")))}
  out = {}
  for case in conf["cases"]:
    root = os.path.join(conf["dir"], case["name"])
    kwargs = case["kwargs"]
    history = []
    ck = ckpt.Checkpointer(root, **kwargs)
    for i, (step, metrics) in enumerate(case["saves"]):
      if i == case.get("restart_after", -1):  # a new job on the same dir
        ck.close()
        ck = ckpt.Checkpointer(root, **kwargs)
      ck.save(step, state, metrics=metrics)
      ck.wait_until_finished()
      history.append(ck.all_steps())
    # metrics() from a fresh Checkpointer (read from the index, no cache).
    fresh = ckpt.Checkpointer(root)
    out[case["name"]] = RetentionCase(
        history, {str(s): ck.metrics(s) for s in ck.all_steps()},
        {str(s): fresh.metrics(s) for s in fresh.all_steps()},
        sorted(n for n in os.listdir(root)))
    fresh.close()
    ck.close()
  return Retention(out)


def hs_value(pid: int, step: int) -> dict:
  return {"pid": pid, "pos": 1000 * step + pid, "seed": [pid, step],
          "blob": bytes([pid, step, 255]), "name": f"proc{pid}"}


def scenario_resave_host_state(conf: dict) -> Resave:
  """Phase "first": saves with host_state and re-saves a committed step.
  Phase "restart": a new job resumes and saves its resume step again.
  Phase "other_count": a job with another process count asks for host_state.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top

  root = conf["dir"]
  pid, n = jax.process_index(), jax.process_count()
  host = _base("w", (128, 64), "float32", 51)
  mesh = _mesh((n, len(jax.devices()) // n))
  sh = _sharding(mesh, ("x", "y"))
  warn = _capture_warnings()
  out: dict[str, Any] = {"pid": pid}

  def state(step):
    return {"w": _put(host + np.float32(step), sh), "step": step}

  def exact(ck, step):
    r = ck.restore(step, target={"w": _target(host, sh), "step": 0})
    return bool(_shards_match(r["w"], host + np.float32(step))
                and r["step"] == step)

  ck = ckpt.Checkpointer(root)
  if conf["phase"] == "first":
    out["saved"] = [ck.save(1, state(1), host_state=hs_value(pid, 1)),
                    ck.save(2, state(2), host_state=hs_value(pid, 2)),
                    ck.save(3, state(3))]
    ck.wait_until_finished()
    out["hs"] = jsonable({"1": ck.host_state(1), "2": ck.host_state(2),
                          "3": ck.host_state(3), "latest": ck.host_state()})
    n_warn = len(warn.messages)
    try:  # lower than the newest committed step (3): refused on every process
      lower = ck.save(2, state(99), host_state=hs_value(pid, 99))
    except ckpt.CheckpointError as e:
      lower = f"{type(e).__name__}: {e}"
    out["resave"] = [lower, ck.save(3, state(99))]
    out["resave_skipped_stat"] = ck.last_save_stats.skipped
    ck.wait_until_finished()
    out["warnings"] = warn.messages[n_warn:]
    out["exact"] = {str(s): exact(ck, s) for s in (1, 2, 3)}
    out["hs_after"] = jsonable(ck.host_state(2))
  elif conf["phase"] == "restart":
    resume = ck.latest_step()
    out["resume"] = resume
    out["resume_exact"] = exact(ck, resume)
    n_warn = len(warn.messages)
    out["resaved"] = ck.save(resume, state(resume),
                             host_state=hs_value(pid, 77))
    out["warnings"] = warn.messages[n_warn:]
    out["next"] = ck.save(resume + 1, state(resume + 1),
                          host_state=hs_value(pid, resume + 1))
    ck.wait_until_finished()
    out["all_steps"] = ck.all_steps()
    out["hs"] = jsonable({"2": ck.host_state(2),
                          "next": ck.host_state(resume + 1)})
    out["exact"] = {str(s): exact(ck, s) for s in ck.all_steps()}
    # Onto process 1's devices only: process 0 holds no part of the result.
    from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
    p1 = Mesh(np.array([d for d in jax.devices() if d.process_index == 1]
                       ).reshape(1, -1), ("x", "y"))
    try:
      got = ck.restore(2, target={
          "w": _target(host, _sharding(p1, (None, "y"))), "step": 0})
      out["p1_mesh"] = P1Mesh(len(got["w"].addressable_shards),
                              _shards_match(got["w"], host + np.float32(2)))
    except Exception as e:  # pylint: disable=broad-except
      out["p1_mesh_error"] = Error.of(e)
  else:  # other_count
    try:
      out["hs"] = jsonable(ck.host_state(2))
      out["error"] = None
    except ckpt.CheckpointError as e:
      out["error"] = Error.of(e)
    out["exact"] = {str(s): exact(ck, s) for s in ck.all_steps()}
  ck.close()
  return Resave(**out)


def scenario_preempt(conf: dict) -> Preempt:
  """A training loop that saves where a preemption notice arrived."""
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top

  root, marks = conf["dir"], conf["marks"]
  pid = jax.process_index()
  mesh = _mesh((2, 2))
  base = preempt_base()
  sh = {k: _sharding(mesh, PREEMPT_SPECS[k]) for k in base}
  state = {k: _put(v, sh[k]) for k, v in base.items()}
  inc = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
  ck = ckpt.Checkpointer(root, barrier_timeout_s=60)
  deadline = time.monotonic() + conf["max_s"]
  step = 0
  while time.monotonic() < deadline:
    if ck.reached_preemption(step):
      t_notice = time.time()
      ck.save(step, {"params": state, "step": step})
      ck.wait_until_finished()
      ck.close()
      return Preempt(pid, step, t_notice=t_notice)
    state = inc(state)
    step += 1
    if step == 20:
      _touch(os.path.join(marks, f"looping_{pid}"))
    time.sleep(0.005)
  return Preempt(pid, None, last=step)


def scenario_killloop(conf: dict) -> KillLoop:
  """Back-to-back saves of kill_state(step) until killed (or max_step)."""
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top

  root, events_dir, launch = conf["dir"], conf["events"], conf["launch"]
  pid = jax.process_index()
  log = open(os.path.join(events_dir, f"p{pid}.log"), "a", buffering=1)
  log_lock = threading.Lock()

  def ev(name: str, step: int = -1) -> None:
    with log_lock:  # one write(2) per line
      log.write(f"{time.time():.6f} {launch} {name} {step}\n")

  # The background part of a save ends when its stats get total_s; a watcher
  # logs that moment, so the test knows whether a kill hit a save in flight.
  watched: list = [None]

  def watch():
    done = None
    while True:
      st = watched[0]
      if st is not None and st.step != done and st.total_s > 0:
        ev("bg_done", st.step)
        done = st.step
      time.sleep(0.002)

  threading.Thread(target=watch, daemon=True).start()

  ev("init")
  mesh = _mesh((2, len(jax.devices()) // 2))
  sh = {k: _sharding(mesh, spec) for k, spec in KILL_SPECS.items()}
  tmp_before = sorted(n for n in os.listdir(root) if ".tmp-" in n) if (
      os.path.isdir(root)) else []
  # The default lease (30 s): a killed job's attempts go at the next job's
  # first save because their holder (process 0, on this host) is provably
  # dead, not because the lease expired (ckpt/commit/lease.py).
  ck = ckpt.Checkpointer(root, keep=conf["keep"],
                         barrier_timeout_s=conf["barrier_timeout_s"],
                         writer=conf.get("writer", "thread"))

  def report_cleanup():
    # Process 0 removed abandoned work at this job's first save; nothing of
    # an earlier job may be left once that save has committed.
    if pid == 0:
      after = sorted(n for n in os.listdir(root) if ".tmp-" in n)
      path = os.path.join(events_dir, f"cleanup_{launch}.json")
      with open(path + ".partial", "w") as f:
        json.dump({"before": tmp_before, "after": after,
                   "time": time.time()}, f)
      os.replace(path + ".partial", path)
  latest = ck.latest_step()
  resume_exact = None
  if latest is not None:  # the job restores its latest step, bit-exact
    want = kill_state(latest)
    tgt = {k: _target(want[k], sh[k]) for k in KILL_SPECS}
    tgt["step"] = 0
    got = ck.restore(latest, target=tgt)
    resume_exact = bool(got["step"] == latest) and all(
        _shards_match(got[k], want[k]) for k in KILL_SPECS)
    if not resume_exact:
      ev("resume_mismatch", latest)
  ready = os.path.join(events_dir, f"ready_{launch}_{pid}")
  with open(ready + ".partial", "w") as f:
    json.dump({"latest": latest, "resume_exact": resume_exact}, f)
  os.replace(ready + ".partial", ready)
  ev("ready", -1 if latest is None else latest)
  step = 0 if latest is None else latest + 1
  prev, first = None, True
  while step < conf["max_step"]:
    host = kill_state(step)
    state = {k: _put(host[k], sh[k]) for k in KILL_SPECS}
    state["step"] = step
    ck.wait_until_finished()
    if prev is not None:
      ev("committed", prev)
      if first:
        report_cleanup()
        first = False
    ev("save_start", step)
    ck.save(step, state)
    ev("staged", step)
    watched[0] = ck.last_save_stats
    prev, step = step, step + 1
    del state, host
  ck.wait_until_finished()
  if prev is not None:
    ev("committed", prev)
    if first:
      report_cleanup()
  steps = ck.all_steps()
  ck.close()
  return KillLoop(pid, latest, resume_exact, steps)


def scenario_restore_race(conf: dict) -> RestoreRace:
  """Restores a step while the in-flight save's retention would drop it.

  keep=1: committing step 2 makes step 1 eligible for deletion (process 0,
  right after the commit, on its background thread). Step 1 is big, so
  reading it takes far longer than saving the small step 2, and process 0
  commits step 2 while step 1 is still being read. ``conf["variants"]``, each
  in its own directory: "all" restores step 1 on every process (the SPMD
  way); a name starting with "p1" restores it on process 1 only.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top

  pid = jax.process_index()
  mesh = _mesh((2, 2))
  n_leaves, shape = conf["leaves"], tuple(conf["shape"])
  big = {f"l{i:03d}": _base(f"l{i:03d}", shape, "float32", 60 + i)
         for i in range(n_leaves)}
  sh = _sharding(mesh, ("x", "y"))
  state = {k: _put(v, sh) for k, v in big.items()}
  second = {"t": _put(_base("t", tuple(conf["second_shape"]), "float32", 70),
                      sh)}
  out: dict[str, Race] = {}
  for variant in conf["variants"]:
    res: dict[str, Any] = {}
    ck = ckpt.Checkpointer(os.path.join(conf["dir"], variant), keep=1,
                           barrier_timeout_s=60,
                           concurrent_bytes=conf["budget"])
    ck.save(1, state)
    ck.wait_until_finished()
    _sync(f"before_{variant}")
    ck.save(2, second)
    t0 = time.monotonic()
    if variant == "all" or pid == 1:
      from ckpt.commit import steps as steps_lib  # pylint: disable=g-import-not-at-top
      res["committed_before"] = steps_lib.is_committed(ck.storage, 1)
      try:
        got = ck.restore(1)
        res["restore"] = "ok"
        res["exact"] = all(same_bits(got[k], big[k]) for k in big)
        del got
      except ckpt.CheckpointNotFoundError as e:
        res["restore"] = "not_found"
        res["error"] = Error.of(e)
      except ckpt.CheckpointError as e:
        res["restore"] = "error"
        res["error"] = Error.of(e)
    res["restore_s"] = time.monotonic() - t0
    ck.wait_until_finished()
    res["all_steps"] = ck.all_steps()
    ck.close()
    out[variant] = Race(**res)
  return RestoreRace(pid, out)


def scenario_process_files(conf: dict) -> ProcessFiles:
  """Each process writes its own host_state (and, for zarr v2, checksum)
  file into the attempt; verify and restore(verify=True) use them; an index
  over the readers' limit fails the save on every process and keeps the
  earlier step."""
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.format import index as index_lib  # pylint: disable=g-import-not-at-top

  pid, n = jax.process_index(), jax.process_count()
  host = _base("w", (128, 64), "float32", 7)
  mesh = _mesh((n, len(jax.devices()) // n))
  sh = _sharding(mesh, ("x", "y"))
  out: dict[str, Files] = {}
  for fmt in ("zarr", "zarr3"):
    d = os.path.join(conf["dir"], fmt)
    step_dir = os.path.join(d, "checkpoint_1")
    res: dict[str, Any] = {}
    ck = ckpt.Checkpointer(d, format=fmt, async_save=False, chunk_bytes=4096)
    ck.save(1, {"w": _put(host, sh), "h": host[:4]}, host_state={"pid": pid})
    res["files"] = sorted(
        os.path.relpath(os.path.join(r, f), step_dir)
        for r, _, fs in os.walk(step_dir) for f in fs
        if f.endswith(".msgpack") and f != "index.msgpack")
    res["hs"] = ck.host_state(1)
    got = ck.restore(1, target={"w": _target(host, sh), "h": host[:4]},
                     verify=True)
    res["exact"] = (_shards_match(got["w"], host) and
                    bool(np.array_equal(got["h"], host[:4])))
    res["verify"] = [p.path for p in ckpt.integrity.verify(d)]
    limit = index_lib.MAX_INDEX_BYTES
    if pid == 0:  # only process 0 encodes the index
      with open(os.path.join(step_dir, "index.msgpack"), "rb") as f:
        index_lib.MAX_INDEX_BYTES = len(f.read()) + 10
    big = {"w": _put(host, sh),
           **{f"v{i}": np.full((80,), i, np.float32) for i in range(40)}}
    try:
      ck.save(2, big)
      res["big"] = None
    except ckpt.CheckpointError as e:
      res["big"] = Error.of(e)
    index_lib.MAX_INDEX_BYTES = limit
    res["steps"] = ck.all_steps()
    res["left"] = sorted(os.listdir(d))
    ck.close()
    out[fmt] = Files(**res)
  return ProcessFiles(pid, out)


def scenario_several(conf: dict) -> Several:
  """``conf["parts"]``: [scenario, its config] pairs, run in turn in this
  one job (one start-up for all); each scenario's result by its name."""
  return Several(**{name: SCENARIOS[name](part)
                    for name, part in conf["parts"]})


SCENARIOS = {
    "several": scenario_several,
    "process_files": scenario_process_files,
    "async": scenario_async,
    "bgfail": scenario_bgfail,
    "budget": scenario_budget,
    "barrier_timeout": scenario_barrier_timeout,
    "retention": scenario_retention,
    "resave_host_state": scenario_resave_host_state,
    "preempt": scenario_preempt,
    "killloop": scenario_killloop,
    "restore_race": scenario_restore_race,
}


# What each scenario returns (the test decodes it: worker.decode).
RESULTS = {
    "several": Several, "process_files": ProcessFiles, "async": Async,
    "bgfail": BgFail, "budget": Budget, "barrier_timeout": BarrierTimeout,
    "retention": Retention, "resave_host_state": Resave, "preempt": Preempt,
    "killloop": KillLoop, "restore_race": RestoreRace,
}


def jsonable(x: Any) -> Any:
  """Host-state values as JSON holds them (bytes as {"bytes": [...]})."""
  if isinstance(x, dict):
    return {str(k): jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [jsonable(v) for v in x]
  if isinstance(x, bytes):
    return {"bytes": list(x)}
  if isinstance(x, np.generic):
    return x.item()
  return x


if __name__ == "__main__":
  worker.main(SCENARIOS)
