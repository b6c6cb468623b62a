"""Benchmark: ckpt against Orbax's StandardCheckpointer and plain files.

Usage:
  python scripts/bench.py --preset large_f32_1g [--runs 3] [--systems ckpt,orbax,raw]
      [--out out/bench/large_f32_1g.json] [--dir /tmp/ckpt-bench] [--evict]
      [--processes N --devices-per-process K]

A preset (``configs/<name>.json``) describes a random state: groups of leaves
with a shape, a dtype and a PartitionSpec over a save mesh, plus the mesh a
second restore goes to. Every worker builds the same state from the preset's
seed (``np.random.default_rng``, never constant data: constant arrays compress
to nothing), sharded over 8 CPU devices in one process (or over N real
``jax.distributed`` processes started by ``ckpt.multihost.local_cluster``).

Systems, each in its own fresh worker process (so host memory is attributed
to one system only):
- ``ckpt``: ``ckpt.Checkpointer`` with the preset's ``ckpt`` options.
- ``orbax``: ``orbax.checkpoint.StandardCheckpointer`` with its defaults
  (install it with ``pip install -e '.[bench]'``).
- ``raw``: the same bytes as plain files, one file per distinct shard
  (``ndarray.tofile`` + ``fsync``, on a thread pool), read back with
  ``np.fromfile``/``np.memmap``; no index, no atomic commit, no async mode.
- ``rawpack``: the bytes limit for many small leaves: every distinct shard
  this process holds, concatenated into ONE file per process with one
  ``fsync`` (plus a JSON table of offsets); restore reads that file once
  and places each leaf's boxes on their devices (one ``device_put`` per
  device and box, as ``raw`` does); no checksums, no index, no commit.

Per run and system, in fresh directories: a synchronous save (wall time),
a restore onto the same mesh, a restore onto the preset's other mesh, and an
asynchronous save (time the caller is blocked, and the time until it is
finished). During each, a thread samples the process's RSS every
``--rss-interval-ms`` (psutil) and the kernel's high-water mark (VmHWM, reset
before each operation) is read at the end; "extra RSS" is the peak minus the
RSS just before the operation (after ``gc.collect`` and ``malloc_trim``).
Bytes and files on disk come from the synchronous save's directory. Runs are
interleaved (round r runs every system, in a rotated order) so that drifts of
the disk's speed hit every system alike. Each figure is the median of the
runs with its spread (min-max).

``--ops ...,train`` (not in the default ops) adds training while saving
(scripts/bench_train.py): a jitted MLP step timed alone, then while an
asynchronous save of the state runs; its step time during vs. without the
save, the slowdown, and the save's own times.

The page cache is not dropped (that needs root and is global to the machine):
restores read files that were just written, so they usually come from memory.
``--evict`` asks the kernel to drop the checkpoint's own pages
(``posix_fadvise(DONTNEED)``) before each restore, which is closer to a cold
read, as far as the virtual disk's own cache allows.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
SYSTEMS = ("ckpt", "orbax", "raw", "rawpack")
RESULT_PREFIX = "@@bench "
GiB = 1 << 30
MiB = 1 << 20


# ---- the preset and the state ---------------------------------------------


def load_preset(name_or_path: str) -> dict[str, Any]:
  """A preset by name (configs/<name>.json) or by path."""
  path = pathlib.Path(name_or_path)
  if not path.suffix:
    path = CONFIGS / f"{name_or_path}.json"
  with open(path) as f:
    preset = json.load(f)
  preset.setdefault("name", path.stem)
  preset.setdefault("seed", 0)
  preset.setdefault("ckpt", {})
  preset.setdefault("scalars", {})
  return preset


def leaf_specs(preset: dict[str, Any]) -> list[dict[str, Any]]:
  """Every array leaf of the preset: path, shape, dtype, spec, in order.

  A group ``{"path": "w/{i}", "count": n, "shape", "dtype", "spec"}`` makes n
  leaves; with ``"prefixes": [[prefix, dtype], ...]`` it makes them under
  each prefix with that dtype (params in bfloat16, Adam moments in float32).
  """
  out = []
  for group in preset["leaves"]:
    prefixes = group.get("prefixes") or [["", group.get("dtype", "float32")]]
    for prefix, dtype in prefixes:
      for i in range(group.get("count", 1)):
        path = group["path"].format(i=i)
        out.append({"path": f"{prefix}/{path}" if prefix else path,
                    "shape": tuple(group["shape"]), "dtype": dtype,
                    "spec": group.get("spec", [])})
  return out


def state_nbytes(preset: dict[str, Any]) -> int:
  import ml_dtypes  # pylint: disable=g-import-not-at-top,unused-import
  return sum(math.prod(s["shape"]) * np.dtype(s["dtype"]).itemsize
             for s in leaf_specs(preset))


def leaf_value(preset: dict[str, Any], i: int, spec: dict[str, Any]) -> np.ndarray:
  """The global value of leaf i: random, the same in every process and run."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top,unused-import
  rng = np.random.default_rng([preset["seed"], i])
  dtype = np.dtype(spec["dtype"])
  if np.issubdtype(dtype, np.integer):
    return rng.integers(0, 1 << 20, spec["shape"], dtype=dtype)
  return rng.standard_normal(spec["shape"], dtype=np.float32).astype(dtype)


def nest(flat: dict[str, Any]) -> dict[str, Any]:
  """{"a/b": x} -> {"a": {"b": x}}."""
  from ckpt.format import tree  # pylint: disable=g-import-not-at-top
  return tree.nest({tuple(path.split("/")): v for path, v in flat.items()})


def flat_items(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
  if isinstance(tree, dict):
    out = []
    for k, v in tree.items():
      out.extend(flat_items(v, f"{prefix}/{k}" if prefix else k))
    return out
  return [(prefix, tree)]


class Topology:
  """The save mesh and the other mesh of a preset, over jax.devices()."""

  def __init__(self, preset: dict[str, Any]):
    import jax  # pylint: disable=g-import-not-at-top
    from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
    axes = tuple(preset["mesh"]["axes"])
    devices = np.array(jax.devices())
    self.save_mesh = Mesh(devices.reshape(preset["mesh"]["shape"]), axes)
    # The other mesh: another shape over the devices in reverse order, so
    # every device holds a different box than it saved.
    other = preset.get("restore_mesh", {}).get(
        "shape", list(reversed(preset["mesh"]["shape"])))
    self.other_mesh = Mesh(devices[::-1].reshape(other), axes)

  @staticmethod
  def sharding(mesh, spec):
    from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
    return NamedSharding(mesh, P(*[tuple(a) if isinstance(a, list) else a
                                   for a in spec]))


def build_state(preset: dict[str, Any], topo: Topology) -> dict[str, Any]:
  import jax  # pylint: disable=g-import-not-at-top
  flat = {}
  for i, spec in enumerate(leaf_specs(preset)):
    value = leaf_value(preset, i, spec)
    sharding = topo.sharding(topo.save_mesh, spec["spec"])
    flat[spec["path"]] = jax.make_array_from_callback(
        value.shape, sharding, lambda idx, v=value: v[idx])
    del value
  jax.block_until_ready(list(flat.values()))
  flat.update(preset["scalars"])
  return nest(flat)


def abstract_state(preset: dict[str, Any], topo: Topology, mesh) -> dict[str, Any]:
  import jax  # pylint: disable=g-import-not-at-top
  import ml_dtypes  # pylint: disable=g-import-not-at-top,unused-import
  flat = {s["path"]: jax.ShapeDtypeStruct(
      s["shape"], np.dtype(s["dtype"]),
      sharding=topo.sharding(mesh, s["spec"])) for s in leaf_specs(preset)}
  flat.update(preset["scalars"])
  return nest(flat)


def verify(preset: dict[str, Any], restored: dict[str, Any],
           max_leaves: int = 64) -> int:
  """Checks every addressable shard of up to ``max_leaves`` leaves (spread
  over the state) bit for bit; returns how many shards it checked."""
  flat = dict(flat_items(restored))
  checked = 0
  specs = leaf_specs(preset)
  stride = max(1, len(specs) // max_leaves)
  for i, spec in enumerate(specs):
    if i % stride:
      continue
    truth = leaf_value(preset, i, spec)
    x = flat[spec["path"]]
    for s in x.addressable_shards:
      got = np.asarray(s.data)
      if got.dtype != truth.dtype or not np.array_equal(
          got.view(np.uint8), np.ascontiguousarray(truth[s.index]).view(np.uint8)):
        raise AssertionError(f"restored {spec['path']} {s.index} differs")
      checked += 1
  for k, v in preset["scalars"].items():
    if flat[k] != v and np.asarray(flat[k]).item() != v:
      raise AssertionError(f"restored scalar {k}={flat[k]!r}, saved {v!r}")
  return checked


# ---- measuring ------------------------------------------------------------


def _malloc_trim() -> None:
  with contextlib.suppress(Exception):
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_hwm() -> bool:
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def _hwm_bytes() -> int | None:
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


class Measure:
  """Wall time and extra peak RSS of the code in a ``with`` block."""

  def __init__(self, interval_s: float):
    self.interval_s = interval_s

  def __enter__(self) -> "Measure":
    import psutil  # pylint: disable=g-import-not-at-top
    gc.collect()
    _malloc_trim()
    self._proc = psutil.Process()
    self.baseline = self._proc.memory_info().rss
    self._hwm_ok = _reset_hwm()
    self._peak = self.baseline
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()
    self.t0 = time.perf_counter()
    return self

  def _sample(self) -> None:
    while not self._stop.is_set():
      self._peak = max(self._peak, self._proc.memory_info().rss)
      time.sleep(self.interval_s)

  def lap(self) -> float:
    return time.perf_counter() - self.t0

  def __exit__(self, *exc) -> None:
    self.seconds = time.perf_counter() - self.t0
    self._stop.set()
    self._thread.join()
    self.sampled_peak = max(self._peak, self._proc.memory_info().rss)
    hwm = _hwm_bytes() if self._hwm_ok else None
    self.peak = max(self.sampled_peak, hwm or 0)
    self.extra_rss = self.peak - self.baseline
    self.extra_rss_sampled = self.sampled_peak - self.baseline


def disk_usage(path: str) -> tuple[int, int]:
  """(bytes, files) under ``path`` (apparent file sizes)."""
  n = size = 0
  for root, _, files in os.walk(path):
    for name in files:
      size += os.lstat(os.path.join(root, name)).st_size
      n += 1
  return size, n


def evict(path: str) -> None:
  """Asks the kernel to drop the page cache of every file under ``path``."""
  for root, _, files in os.walk(path):
    for name in files:
      fd = os.open(os.path.join(root, name), os.O_RDONLY)
      try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


# ---- the systems ----------------------------------------------------------


class System:
  """Save and restore of one checkpointer; every method blocks until done."""

  def save(self, path: str, state: Any) -> None:
    raise NotImplementedError

  def save_async(self, path: str, state: Any) -> Callable[[], None] | None:
    """Starts a save; returns the wait function, or None if unsupported."""
    return None

  def restore(self, path: str, target: Any) -> Any:
    raise NotImplementedError

  def drift(self, path: str, state: Any, saves: int) -> list[int] | None:
    """RSS (bytes) after each of ``saves`` consecutive async saves of
    ``state`` into one root, or None if unsupported."""
    return None


class CkptSystem(System):

  def __init__(self, options: dict[str, Any]):
    import ckpt  # pylint: disable=g-import-not-at-top
    self.ckpt = ckpt
    self.options = dict(options)

  def save(self, path, state):
    with self.ckpt.Checkpointer(path, async_save=False, **self.options) as c:
      c.save(1, state)

  def save_async(self, path, state):
    c = self.ckpt.Checkpointer(path, async_save=True, **self.options)
    c.save(1, state)

    def wait():
      c.wait_until_finished()
      c.close()
    return wait

  def restore(self, path, target):
    with self.ckpt.Checkpointer(path, **self.options) as c:
      return c.restore(1, target=target)

  def drift(self, path, state, saves):
    import psutil  # pylint: disable=g-import-not-at-top
    proc, rss = psutil.Process(), []
    # keep=2: old steps are deleted as a training job's would be.
    with self.ckpt.Checkpointer(path, async_save=True, keep=2,
                                **self.options) as c:
      for step in range(1, saves + 1):
        c.save(step, state)
        c.wait_until_finished()
        rss.append(proc.memory_info().rss)
    return rss


class OrbaxSystem(System):
  """StandardCheckpointer with its defaults (ocdbt, zarr3, zstd)."""

  def __init__(self, options: dict[str, Any]):
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    self.ocp = ocp
    self.options = dict(options)

  def save(self, path, state):
    with self.ocp.StandardCheckpointer(**self.options) as c:
      c.save(os.path.join(path, "1"), state)
      c.wait_until_finished()

  def save_async(self, path, state):
    c = self.ocp.StandardCheckpointer(**self.options)
    c.save(os.path.join(path, "1"), state)

    def wait():
      c.wait_until_finished()
      c.close()
    return wait

  def restore(self, path, target):
    with self.ocp.StandardCheckpointer(**self.options) as c:
      return c.restore(os.path.join(path, "1"), target)


def _write_meta(path: str, pid: int, meta: dict, fsync: bool) -> None:
  """A raw baseline's table of this process's files (meta.<pid>.json), then
  the directory fsynced, as a checkpointer must before it commits."""
  with open(os.path.join(path, f"meta.{pid}.json"), "w") as f:
    json.dump(meta, f)
    f.flush()
    if fsync:
      os.fsync(f.fileno())
  if fsync:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


class RawSystem(System):
  """The same bytes as plain files: one per distinct shard, then fsync."""

  def __init__(self, options: dict[str, Any]):
    self.threads = int(options.get("threads", 4))
    self.fsync = bool(options.get("fsync", True))

  def _pool(self):
    import concurrent.futures  # pylint: disable=g-import-not-at-top
    return concurrent.futures.ThreadPoolExecutor(self.threads)

  def save(self, path, state):
    import jax  # pylint: disable=g-import-not-at-top
    pid = jax.process_index()
    os.makedirs(path, exist_ok=True)
    meta, jobs = {}, []
    for li, (name, x) in enumerate(flat_items(state)):
      if not isinstance(x, jax.Array):
        meta[name] = {"value": x}
        continue
      files = []
      for k, s in enumerate(x.addressable_shards):
        if s.replica_id != 0:
          continue
        fname = f"{li}.{pid}.{k}.bin"
        box = [list(sl.indices(n)[:2]) for sl, n in zip(s.index, x.shape)]
        files.append({"file": fname, "box": box})
        jobs.append((os.path.join(path, fname), s.data))
      meta[name] = {"shape": list(x.shape), "dtype": x.dtype.name,
                    "files": files}

    def write(job):
      fname, data = job
      with open(fname, "wb") as f:
        np.asarray(data).tofile(f)
        if self.fsync:
          f.flush()
          os.fsync(f.fileno())

    with self._pool() as pool:
      list(pool.map(write, jobs))
    _write_meta(path, pid, meta, self.fsync)

  def restore(self, path, target):
    import jax  # pylint: disable=g-import-not-at-top
    import ml_dtypes  # pylint: disable=g-import-not-at-top,unused-import
    meta: dict[str, Any] = {}
    for name in sorted(os.listdir(path)):
      if name.startswith("meta."):
        with open(os.path.join(path, name)) as f:
          for k, v in json.load(f).items():
            if "files" in v and k in meta:
              meta[k]["files"].extend(v["files"])
            else:
              meta[k] = v
    out, jobs = {}, []
    leaves = flat_items(target)
    for name, t in leaves:
      if not isinstance(t, jax.ShapeDtypeStruct):
        out[name] = meta[name]["value"]
        continue
      by_box: dict[tuple, list] = {}
      for d, idx in t.sharding.addressable_devices_indices_map(t.shape).items():
        box = tuple(tuple(sl.indices(n)[:2]) for sl, n in zip(idx, t.shape))
        by_box.setdefault(box, []).append(d)
      for box, devices in by_box.items():
        jobs.append((name, box, devices, meta[name]))
    placed: dict[str, dict] = {}

    def read(job):
      name, box, devices, m = job
      dtype = np.dtype(m["dtype"])
      exact = [f for f in m["files"] if tuple(map(tuple, f["box"])) == box]
      if exact:
        data = np.fromfile(os.path.join(path, exact[0]["file"]), dtype=dtype)
        data = data.reshape([b - a for a, b in box])
      else:  # another mesh: assemble from every file that overlaps
        data = np.empty([b - a for a, b in box], dtype)
        for f in m["files"]:
          fbox = f["box"]
          lo = [max(a, fa) for (a, _), (fa, _) in zip(box, fbox)]
          hi = [min(b, fb) for (_, b), (_, fb) in zip(box, fbox)]
          if any(l >= h for l, h in zip(lo, hi)):
            continue
          src = np.memmap(os.path.join(path, f["file"]), dtype=dtype, mode="r",
                          shape=tuple(fb - fa for fa, fb in fbox))
          data[tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, box))] = (
              src[tuple(slice(l - fa, h - fa)
                        for l, h, (fa, _) in zip(lo, hi, fbox))])
          del src
      arrays = [jax.device_put(data, d) for d in devices]
      return name, dict(zip(devices, arrays))

    with self._pool() as pool:
      for name, arrays in pool.map(read, jobs):
        placed.setdefault(name, {}).update(arrays)
    for name, t in leaves:
      if isinstance(t, jax.ShapeDtypeStruct):
        index_map = t.sharding.addressable_devices_indices_map(t.shape)
        out[name] = jax.make_array_from_single_device_arrays(
            t.shape, t.sharding, [placed[name][d] for d in index_map])
    return nest(out)


class RawPackSystem(System):
  """Every distinct shard of this process in one file, one fsync."""

  def __init__(self, options: dict[str, Any]):
    self.fsync = bool(options.get("fsync", True))

  def save(self, path, state):
    import jax  # pylint: disable=g-import-not-at-top
    pid = jax.process_index()
    os.makedirs(path, exist_ok=True)
    meta, pieces, offset = {}, [], 0
    for name, x in flat_items(state):
      if not isinstance(x, jax.Array):
        meta[name] = {"value": x}
        continue
      boxes = []
      for s in x.addressable_shards:
        if s.replica_id != 0:
          continue
        data = np.asarray(s.data)
        box = [list(sl.indices(n)[:2]) for sl, n in zip(s.index, x.shape)]
        boxes.append({"box": box, "offset": offset})
        pieces.append(data.reshape(-1).view(np.uint8))
        offset += data.nbytes
      meta[name] = {"shape": list(x.shape), "dtype": x.dtype.name,
                    "boxes": boxes}
    with open(os.path.join(path, f"pack.{pid}.bin"), "wb") as f:
      f.write(np.concatenate(pieces) if pieces else b"")
      f.flush()
      if self.fsync:
        os.fsync(f.fileno())
    _write_meta(path, pid, meta, self.fsync)

  def restore(self, path, target):
    import jax  # pylint: disable=g-import-not-at-top
    import ml_dtypes  # pylint: disable=g-import-not-at-top,unused-import
    meta: dict[str, Any] = {}
    packs: dict[int, np.ndarray] = {}
    for name in sorted(os.listdir(path)):
      if name.startswith("meta."):
        pid = int(name.split(".")[1])
        with open(os.path.join(path, f"pack.{pid}.bin"), "rb") as f:
          packs[pid] = np.frombuffer(f.read(), np.uint8)  # one read
        with open(os.path.join(path, name)) as f:
          for k, v in json.load(f).items():
            for b in v.get("boxes", ()):
              b["pack"] = pid
            if "boxes" in v and k in meta:
              meta[k]["boxes"].extend(v["boxes"])
            else:
              meta[k] = v
    out = {}
    for name, t in flat_items(target):
      if not isinstance(t, jax.ShapeDtypeStruct):
        out[name] = meta[name]["value"]
        continue
      m = meta[name]
      dtype = np.dtype(m["dtype"])
      stored = {}
      for b in m["boxes"]:
        shape = tuple(hi - lo for lo, hi in b["box"])
        n = math.prod(shape) * dtype.itemsize
        stored[tuple(map(tuple, b["box"]))] = packs[b["pack"]][
            b["offset"]:b["offset"] + n].view(dtype).reshape(shape)
      index_map = t.sharding.addressable_devices_indices_map(t.shape)
      arrays = []
      for d, idx in index_map.items():
        box = tuple(tuple(sl.indices(n)[:2]) for sl, n in zip(idx, t.shape))
        data = stored.get(box)
        if data is None:  # another mesh: assemble from the stored boxes
          data = np.empty([b - a for a, b in box], dtype)
          for sbox, src in stored.items():
            lo = [max(a, fa) for (a, _), (fa, _) in zip(box, sbox)]
            hi = [min(b, fb) for (_, b), (_, fb) in zip(box, sbox)]
            if any(l >= h for l, h in zip(lo, hi)):
              continue
            data[tuple(slice(l - a, h - a) for l, h, (a, _) in
                       zip(lo, hi, box))] = src[tuple(
                           slice(l - fa, h - fa) for l, h, (fa, _) in
                           zip(lo, hi, sbox))]
        arrays.append(jax.device_put(data, d))
      out[name] = jax.make_array_from_single_device_arrays(
          t.shape, t.sharding, arrays)
    return nest(out)


def system_kind(label: str) -> str:
  """``ckpt@/path/to/other/ckpt_parent`` is ckpt imported from that path."""
  return label.split("@", 1)[0]


def make_system(name: str, preset: dict[str, Any]) -> System:
  name = system_kind(name)
  options = preset.get(name, {})
  if name == "ckpt":
    return CkptSystem(options)
  if name == "orbax":
    return OrbaxSystem(options)
  if name == "raw":
    return RawSystem(options)
  if name == "rawpack":
    return RawPackSystem(options)
  raise ValueError(f"unknown system {name!r}; expected one of {SYSTEMS}")


# ---- a worker: one system, one state, many operations ---------------------


class Worker:
  """Builds the state once, then runs operations on one system."""

  def __init__(self, system: str, preset: dict[str, Any], rss_interval_s: float):
    import jax  # pylint: disable=g-import-not-at-top
    self.jax = jax
    self.preset = preset
    self.name = system
    self.rss_interval_s = rss_interval_s
    t0 = time.perf_counter()
    self.system = make_system(system, preset)
    self.topo = Topology(preset)
    self.state = build_state(preset, self.topo)
    self.build_s = time.perf_counter() - t0
    self.train_loop = None  # built by the first train op
    self.targets = {
        "same": abstract_state(preset, self.topo, self.topo.save_mesh),
        "other": abstract_state(preset, self.topo, self.topo.other_mesh)}

  def _barrier(self, name: str) -> None:
    from ckpt.multihost import process as multihost  # pylint: disable=g-import-not-at-top
    multihost.barrier(f"bench/{name}", what=f"benchmark step {name}")

  def run(self, op: dict[str, Any]) -> dict[str, Any]:
    kind, path = op["op"], op.get("dir")
    if op.get("barrier"):
      self._barrier(op["barrier"])
    m = Measure(self.rss_interval_s)
    out: dict[str, Any] = {"op": kind}
    if kind == "save":
      with m:
        self.system.save(path, self.state)
      out.update(seconds=m.seconds)
    elif kind == "save_async":
      with m:
        wait = self.system.save_async(path, self.state)
        if wait is None:
          return {"op": kind, "unsupported": True}
        blocked = m.lap()
        wait()
      out.update(seconds=blocked, total_seconds=m.seconds)
    elif kind == "restore":
      if op.get("evict"):
        evict(path)
      with m:
        restored = self.system.restore(path, self.targets[op["mesh"]])
        self.jax.block_until_ready(restored)
      out.update(seconds=m.seconds)
      if op.get("verify"):
        out["shards_verified"] = verify(self.preset, restored)
      del restored
    elif kind == "disk":
      out["bytes"], out["files"] = disk_usage(path)
      return out
    elif kind == "train":
      if self.train_loop is None:
        self.train_loop = bench_train.TrainLoop(self.topo.save_mesh,
                                                op["width"])
      return bench_train.train_while_saving(
          self.train_loop, op["steps"],
          lambda: self.system.save_async(path, self.state))
    elif kind == "drift":
      _malloc_trim()
      rss = self.system.drift(path, self.state, op["saves"])
      if rss is None:
        return {"op": kind, "unsupported": True}
      return {"op": kind, "rss": rss}
    else:
      raise ValueError(f"unknown op {kind!r}")
    out.update(rss_extra=m.extra_rss, rss_extra_sampled=m.extra_rss_sampled,
               rss_baseline=m.baseline)
    return out


def _emit(value: dict[str, Any]) -> None:
  sys.stdout.write(RESULT_PREFIX + json.dumps(value) + "\n")
  sys.stdout.flush()


def worker_main(system: str, preset_path: str, rss_interval_s: float) -> int:
  """A worker on stdin/stdout: one JSON operation per line, one result each."""
  preset = load_preset(preset_path)
  try:
    w = Worker(system, preset, rss_interval_s)
  except Exception as e:  # pylint: disable=broad-except
    _emit({"error": f"{type(e).__name__}: {e}"})
    raise
  _emit({"ready": True, "build_s": w.build_s,
         "devices": w.jax.device_count(), "processes": w.jax.process_count()})
  for line in sys.stdin:
    op = json.loads(line)
    if op["op"] == "quit":
      break
    try:
      _emit(w.run(op))
    except Exception as e:  # pylint: disable=broad-except
      import traceback  # pylint: disable=g-import-not-at-top
      traceback.print_exc()
      _emit({"error": f"{type(e).__name__}: {e}"})
  return 0


def cluster_worker_main(config: dict[str, Any]) -> int:
  """One process of a local jax.distributed job: runs a fixed list of ops."""
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  local_cluster.init_from_env()
  preset = load_preset(config["preset"])
  w = Worker(config["system"], preset, config["rss_interval_s"])
  results = []
  for i, op in enumerate(config["ops"]):
    results.append(w.run({**op, "barrier": f"{config['job']}/{i}"}))
  w._barrier(f"{config['job']}/end")  # pylint: disable=protected-access
  local_cluster.write_result({"build_s": w.build_s, "results": results})
  return 0


# ---- the driver -----------------------------------------------------------


class WorkerProcess:
  """A worker subprocess: one system, its own memory, fed over stdin."""

  def __init__(self, system: str, preset_path: str, args, log_dir: str):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count="
                        f"{args.devices}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    if "@" in system:  # an A/B run: this worker imports ckpt from elsewhere
      env["PYTHONPATH"] = os.pathsep.join(
          [system.split("@", 1)[1]] + ([env["PYTHONPATH"]]
                                       if env.get("PYTHONPATH") else []))
    self.system = system
    self.log_path = os.path.join(
        log_dir, f"{system.replace('@', '-').replace('/', '_')}.log")
    self._log = open(self.log_path, "w")
    self.proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", system,
         "--preset", preset_path, "--rss-interval-ms",
         str(args.rss_interval_ms)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
        text=True, env=env, cwd=str(ROOT))
    self.ready = self._read()

  def _read(self) -> dict[str, Any]:
    while True:
      line = self.proc.stdout.readline()
      if not line:
        self.proc.wait()
        raise RuntimeError(f"{self.system} worker exited ({self.proc.returncode});"
                           f" its log:\n{self._tail()}")
      if line.startswith(RESULT_PREFIX):
        value = json.loads(line[len(RESULT_PREFIX):])
        if "error" in value:
          raise RuntimeError(f"{self.system} worker: {value['error']}\n"
                             f"{self._tail()}")
        return value

  def _tail(self) -> str:
    self._log.flush()
    with open(self.log_path) as f:
      return f.read()[-6000:]

  def run(self, op: dict[str, Any]) -> dict[str, Any]:
    self.proc.stdin.write(json.dumps(op) + "\n")
    self.proc.stdin.flush()
    return self._read()

  def close(self) -> None:
    if self.proc.poll() is None:
      with contextlib.suppress(Exception):
        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.proc.stdin.close()
      try:
        self.proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    self._log.close()


OPS = ("save", "restore_same", "restore_other", "async", "train")
DEFAULT_OPS = ("save", "restore_same", "restore_other", "async")


def round_ops(base: str, args) -> list[dict[str, Any]]:
  """One run's operations for one system, each in a fresh directory."""
  sync_dir, async_dir = f"{base}-sync", f"{base}-async"
  ops = [{"op": "save", "dir": sync_dir}, {"op": "disk", "dir": sync_dir}]
  for mesh in ("same", "other"):
    if f"restore_{mesh}" in args.ops:
      ops.append({"op": "restore", "dir": sync_dir, "mesh": mesh,
                  "evict": args.evict, "verify": args.verify_run})
  ops.append({"op": "rmtree", "dir": sync_dir})
  if "async" in args.ops:
    ops += [{"op": "save_async", "dir": async_dir},
            {"op": "rmtree", "dir": async_dir}]
  if "train" in args.ops:
    ops += [{"op": "train", "dir": f"{base}-train", "steps": args.train_steps,
             "width": args.train_width},
            {"op": "rmtree", "dir": f"{base}-train"}]
  return ops


def _record(raw: dict[str, dict[str, list]], system: str, op: dict[str, Any],
            r: dict[str, Any]) -> None:
  fig = raw.setdefault(system, {})
  kind = op["op"]
  if kind == "disk":
    fig.setdefault("disk_bytes", []).append(r["bytes"])
    fig.setdefault("disk_files", []).append(r["files"])
    return
  if r.get("unsupported"):
    return
  if kind == "train":
    for key in bench_train.FIGURES:
      fig.setdefault(f"train_{key}", []).append(r[key])
    return
  if kind == "drift":
    rss, fifth = r["rss"], r["rss"][min(4, len(r["rss"]) - 1)]
    fig.setdefault("drift_rss_5", []).append(fifth)
    fig.setdefault("drift_rss_last", []).append(rss[-1])
    fig.setdefault("drift_ratio", []).append(rss[-1] / fifth - 1)
    fig.setdefault("drift_saves", []).append(len(rss))
    return
  name = {"save": "save", "save_async": "async",
          "restore": f"restore_{op.get('mesh')}"}[kind]
  fig.setdefault(f"{name}_s", []).append(r["seconds"])
  if kind == "save_async":
    fig.setdefault("async_total_s", []).append(r["total_seconds"])
  fig.setdefault(f"{name}_rss_extra", []).append(r["rss_extra"])
  fig.setdefault(f"{name}_rss_extra_sampled", []).append(r["rss_extra_sampled"])
  if "shards_verified" in r:
    fig.setdefault(f"{name}_shards_verified", []).append(r["shards_verified"])


def run_single_process(preset_path: str, systems: list[str], args,
                       workdir: str, log_dir: str) -> tuple[dict, dict]:
  workers: dict[str, WorkerProcess] = {}
  info: dict[str, Any] = {}
  raw: dict[str, dict[str, list]] = {}
  try:
    for s in systems:  # one at a time: building the state takes the cores
      t0 = time.perf_counter()
      workers[s] = WorkerProcess(s, preset_path, args, log_dir)
      info[s] = {**workers[s].ready, "start_s": time.perf_counter() - t0}
      print(f"  {s}: worker ready, state built in "
            f"{workers[s].ready['build_s']:.1f} s", flush=True)
    for r in range(args.runs):
      order = systems[r % len(systems):] + systems[:r % len(systems)]
      for s in order:
        t0 = time.perf_counter()
        args.verify_run = args.verify and r == 0
        for op in round_ops(os.path.join(workdir, f"{s}-r{r}"), args):
          if op["op"] == "rmtree":
            shutil.rmtree(op["dir"], ignore_errors=True)
            continue
          _record(raw, s, op, workers[s].run(op))
        restore = raw[s].get("restore_same_s", [math.nan])[-1]
        print(f"  run {r + 1}/{args.runs} {s}: "
              f"save {raw[s]['save_s'][-1]:.2f} s, "
              f"restore {restore:.2f} s "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    for s in systems:  # one long job per system, after the timed runs
      if args.drift_saves <= 0:
        break
      t0 = time.perf_counter()
      op = {"op": "drift", "dir": os.path.join(workdir, f"{s}-drift"),
            "saves": args.drift_saves}
      r = workers[s].run(op)
      shutil.rmtree(op["dir"], ignore_errors=True)
      _record(raw, s, op, r)
      if not r.get("unsupported"):
        print(f"  {s}: {args.drift_saves} async saves, RSS "
              f"{r['rss'][min(4, len(r['rss']) - 1)] / MiB:,.0f} MiB after "
              f"the 5th, {r['rss'][-1] / MiB:,.0f} MiB after the last "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
  finally:
    for w in workers.values():
      w.close()
  return raw, info


def run_multi_process(preset_path: str, systems: list[str], args,
                      workdir: str) -> tuple[dict, dict]:
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  raw: dict[str, dict[str, list]] = {}
  info: dict[str, Any] = {}
  for s in systems:
    ops = []
    for r in range(args.runs):
      args.verify_run = args.verify and r == 0
      ops.extend(op for op in round_ops(os.path.join(workdir, f"{s}-r{r}"), args)
                 if op["op"] != "rmtree")
    config = {"system": s, "preset": str(preset_path), "ops": ops, "job": s,
              "rss_interval_s": args.rss_interval_ms / 1000}
    t0 = time.perf_counter()
    results = local_cluster.check(local_cluster.run(
        "bench", config, num_processes=args.processes,
        devices_per_process=args.devices_per_process,
        timeout_s=args.timeout, cwd=str(ROOT / "scripts")))
    info[s] = {"build_s": max(p["build_s"] for p in results),
               "processes": args.processes, "job_s": time.perf_counter() - t0}
    for i, op in enumerate(ops):
      per = [p["results"][i] for p in results]
      if op["op"] == "disk":
        merged = per[0]
      elif per[0].get("unsupported"):
        merged = per[0]
      else:  # the slowest process's time, the largest process's memory
        merged = {k: max(p[k] for p in per) for k in per[0]
                  if isinstance(per[0][k], (int, float))}
        if "shards_verified" in per[0]:
          merged["shards_verified"] = sum(p["shards_verified"] for p in per)
      _record(raw, s, op, merged)
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir, exist_ok=True)
    print(f"  {s}: {args.runs} runs on {args.processes} processes in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
  return raw, info


def summarize(values: list[float]) -> dict[str, Any]:
  return {"median": statistics.median(values), "min": min(values),
          "max": max(values), "values": values}


def targets(figures: dict[str, dict], budget: int | None,
            ckpt: str = "ckpt", state_bytes: int = 0) -> list[dict]:
  """The issue's targets for system ``ckpt``, as ratios of medians."""
  out = []

  def med(system, key):
    return figures.get(system, {}).get(key, {}).get("median")

  def add(name, value, limit, kind, detail):
    if value is None:
      return
    met = value >= limit if kind == ">=" else value <= limit
    out.append({"system": ckpt, "target": name, "value": value, "limit": limit,
                "comparison": kind, "met": bool(met), "detail": detail})

  c, o, r = (lambda k: med(ckpt, k)), (lambda k: med("orbax", k)), (
      lambda k: med("raw", k))
  # Issue #16's targets (ratios of medians of one run).
  if c("save_s") and r("save_s"):
    add("sync save within 1.2x of raw", c("save_s") / r("save_s"), 1.2, "<=",
        "ckpt save_s / raw save_s")
  if c("save_s") and o("save_s"):
    add("sync save faster than Orbax", o("save_s") / c("save_s"), 1.0, ">=",
        "orbax save_s / ckpt save_s")
  if c("async_s") and o("async_s"):
    add("async blocking <= Orbax's", c("async_s") / o("async_s"), 1.0, "<=",
        "ckpt async_s / orbax async_s")
  for mesh in ("same", "other"):
    key = f"restore_{mesh}_s"
    if c(key) and r(key):
      add(f"restore ({mesh} mesh) within 1.2x of raw", c(key) / r(key), 1.2,
          "<=", f"ckpt {key} / raw {key}")
    if c(key) and o(key):
      add(f"restore ({mesh} mesh) faster than Orbax", o(key) / c(key), 1.0,
          ">=", f"orbax {key} / ckpt {key}")
  p = lambda k: med("rawpack", k)
  # Issue #26 item 1: many small leaves against the packed-bytes limit.
  if c("save_s") and p("save_s"):
    add("sync save within 2x of rawpack", c("save_s") / p("save_s"), 2.0,
        "<=", "ckpt save_s / rawpack save_s")
  if c("restore_same_s") and p("restore_same_s"):
    add("restore (same mesh) within 1.3x of rawpack",
        c("restore_same_s") / p("restore_same_s"), 1.3, "<=",
        "ckpt restore_same_s / rawpack restore_same_s")
  if budget:
    for key, what in (("save_rss_extra", "sync save"),
                      ("async_rss_extra", "async save")):
      if c(key) is not None:
        add(f"{what} extra peak RSS <= concurrent_bytes + 10%",
            c(key) / budget, 1.1, "<=",
            f"ckpt {key} / concurrent_bytes ({budget / GiB:.2f} GiB)")
    if c("restore_same_rss_extra") is not None and state_bytes:
      add("restore extra peak RSS, less the restored state, <= "
          "concurrent_bytes + 10%",
          (c("restore_same_rss_extra") - state_bytes) / budget, 1.1, "<=",
          "(ckpt restore_same_rss_extra - state bytes) / concurrent_bytes")
  if c("drift_ratio") is not None:
    add("RSS drift over the async saves < 5%", c("drift_ratio"), 0.05, "<=",
        "RSS after the last save / RSS after the 5th - 1")
  return out


def _fmt_value(key: str, v: float) -> str:
  if key.startswith("train_step"):
    return f"{v:.3f}"
  if key == "train_slowdown":
    return f"{v:.2f}"
  if key == "drift_ratio":
    return f"{100 * v:+.1f}%"
  if key.endswith("_s"):
    return f"{v:.2f}"
  if "rss" in key or key == "disk_bytes":
    return f"{v / MiB:,.0f}"
  return f"{v:,.0f}"


ROWS = [
    ("save_s", "sync save (s)"),
    ("async_s", "async save: caller blocked (s)"),
    ("async_total_s", "async save: until finished (s)"),
    ("restore_same_s", "restore, same mesh (s)"),
    ("restore_other_s", "restore, other mesh (s)"),
    ("save_rss_extra", "sync save: extra peak RSS (MiB)"),
    ("async_rss_extra", "async save: extra peak RSS (MiB)"),
    ("restore_same_rss_extra", "restore same: extra peak RSS (MiB)"),
    ("restore_other_rss_extra", "restore other: extra peak RSS (MiB)"),
    ("drift_rss_5", "RSS after async save 5 (MiB)"),
    ("drift_rss_last", "RSS after the last async save (MiB)"),
    ("drift_ratio", "RSS drift, save 5 -> last"),
    ("disk_bytes", "bytes on disk (MiB)"),
    ("disk_files", "files on disk"),
    *bench_train.ROWS,
]


def table(report: dict[str, Any]) -> str:
  systems = list(report["systems"])
  cells = [["figure"] + systems]
  for key, label in ROWS:
    row = [label]
    for s in systems:
      f = report["systems"][s].get(key)
      if f is None:
        row.append("-")
      elif f["min"] == f["max"] or len(f["values"]) == 1:
        row.append(_fmt_value(key, f["median"]))
      else:
        row.append(f"{_fmt_value(key, f['median'])} "
                   f"({_fmt_value(key, f['min'])}-{_fmt_value(key, f['max'])})")
    cells.append(row)
  widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
  lines = []
  for j, r in enumerate(cells):
    lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])
                           for i, c in enumerate(r)).rstrip())
    if j == 0:
      lines.append("  ".join("-" * w for w in widths))
  if report["targets"]:
    lines.append("")
    lines.append("targets (ratios of medians from this run):")
    for t in report["targets"]:
      who = "" if t["system"] == "ckpt" else f"{t['system']}: "
      lines.append(f"  [{'met' if t['met'] else 'MISSED'}] {who}{t['target']}: "
                   f"{t['value']:.2f} (limit {t['comparison']} {t['limit']}; "
                   f"{t['detail']})")
  return "\n".join(lines)


def _versions() -> dict[str, str]:
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  out = {"python": platform.python_version()}
  for pkg in ("jax", "jaxlib", "tensorstore", "numpy", "orbax-checkpoint"):
    with contextlib.suppress(metadata.PackageNotFoundError):
      out[pkg] = metadata.version(pkg)
  return out


def _orbax_installed() -> bool:
  import importlib.util  # pylint: disable=g-import-not-at-top
  try:
    return importlib.util.find_spec("orbax.checkpoint") is not None
  except ModuleNotFoundError:
    return False


# --read-once: the states (worker module, its config, what it is).
READ_ONCE_STATES = {
    "aligned": ("tests.multiprocess.readonce_worker", {"format": "zarr"},
                "tests/multiprocess/readonce_worker.py: leaves replicated "
                "over every process, over 2, and fully sharded; every box "
                "a union of whole chunks"),
    "awkward": ("tests.multiprocess.fetch_worker", {"format": "zarr3"},
                "tests/multiprocess/fetch_worker.py: shapes that divide by "
                "neither the replica count nor their chunks, all replicated "
                "over every process"),
}


def run_read_once(args) -> dict[str, Any]:
  """The multi-process restore figure of read once (ckpt/restore/readonce.py).

  For each state (``--read-once-states``: READ_ONCE_STATES, both
  ``--read-once-scale`` times their base size), store (the local disk;
  moto's S3 server, started here, behind a counting proxy) and process
  count (2, 4; 2 CPU devices each), one job saves the state, then restores
  it (``--read-once-budget``: with that concurrent_bytes) with read_once True, False, True, False: times are the second (warm:
  jit compiled, TensorStore opened) restore of each policy, the slowest
  process's ``last_restore_stats.total_s``. Bytes fetched: on S3 the bodies
  of the GETs the proxy saw during that restore (counted at the store,
  tests/objectstore/proxy.py); on the disk the bytes TensorStore's file
  driver read, summed over the processes (its kvstore counter, read by the
  worker around the restore: what each host's disk would serve without a
  page cache shared between the processes). ``x stored``: over the bytes
  of every object of the step.
  """
  import tempfile  # pylint: disable=g-import-not-at-top
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, str(ROOT))
  from tests.objectstore import proxy as proxy_lib  # pylint: disable=g-import-not-at-top
  from tests.objectstore import servers  # pylint: disable=g-import-not-at-top
  from tests.objectstore import storeutil  # pylint: disable=g-import-not-at-top
  rows = []
  logs = tempfile.mkdtemp(prefix="ckpt-bench-moto-")
  moto = servers.start_moto(logs)
  host, port = moto.endpoint.rsplit("//", 1)[1].split(":")
  counter = proxy_lib.HttpCounter()
  px = proxy_lib.Proxy((host, int(port)), counter).start()
  policies = [True, False, True, False]
  try:
    for state in args.read_once_states.split(","):
      module, config, _ = READ_ONCE_STATES[state]
      for store in ("disk", "s3"):
        for n in (2, 4):
          counter.reset()
          if store == "disk":
            url, env = tempfile.mkdtemp(prefix="ckpt-bench-ro-") + "/ck", {}
          else:
            os.environ.update(moto.env)  # the listing below: direct
            url = servers.new_bucket(moto) + "/ck"
            env = {**moto.env, "AWS_ENDPOINT_URL": px.endpoint}
          out = local_cluster.check(local_cluster.run(
              module, {**config, "dir": url, "op": "both",
                       "scale": args.read_once_scale, "policies": policies,
                       **({"concurrent_bytes": args.read_once_budget}
                          if args.read_once_budget else {}),
                       **({"count_url": px.endpoint} if store == "s3" else {})},
              num_processes=n, devices_per_process=2, timeout_s=900,
              extra_env=env, cwd=str(ROOT)))
          stored = _stored_bytes(url, storeutil)
          for i in (2, 3):  # the warm restore of each policy
            policy = str(policies[i])
            recs = [r.get(f"{i}-{policy}", r.get(policy)) for r in out]
            st = [x["stats"] for x in recs]
            if store == "s3":
              _, bodies = counter.between(
                  "start" if i == 0 else f"{i - 1}-{policies[i - 1]}",
                  f"{i}-{policy}")
              fetched = sum(bodies.values())
            else:
              fetched = sum(x["ts_fetched"] for x in recs)
            rows.append({
                "state": state, "store": store, "processes": n,
                "read_once": policy == "True",
                "time_s": max(x["total_s"] for x in st),
                "exchange_s": max(x["exchange_s"] for x in st),
                "batches": max(x["batches"] for x in st),
                "overlapped": min(x.get("overlapped_batches", 0) for x in st),
                "bytes_read_per_process": [x["bytes_read"] for x in st],
                "fetched_per_process": [x["ts_fetched"] for x in recs],
                "fetched_total": fetched, "stored": stored,
                "bit_exact": not any(x["bad"] for x in recs)})
  finally:
    px.close()
    moto.stop()
  lines = ["| state | store | processes | read once | restore s (slowest) | "
           "exchange s | batches (read overlapped) | MiB fetched per process | "
           "MiB fetched, all | x stored |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    per = "/".join(f"{b / 2**20:.1f}" for b in r["fetched_per_process"])
    lines.append(f"| {r['state']} | {r['store']} | {r['processes']} | "
                 f"{'on' if r['read_once'] else 'off'} | {r['time_s']:.3f} | "
                 f"{r['exchange_s']:.3f} | {r['batches']} ({r['overlapped']}) | "
                 f"{per} | "
                 f"{r['fetched_total'] / 2**20:.1f} | "
                 f"{r['fetched_total'] / r['stored']:.2f} |")
  return {"rows": rows, "table": "\n".join(lines)}


def _stored_bytes(url: str, storeutil) -> int:
  """Bytes of every object (file) of step 1 under ``url``."""
  if "://" not in url:
    return sum(os.path.getsize(os.path.join(d, f))
               for d, _, files in os.walk(os.path.join(url, "checkpoint_1"))
               for f in files)
  store = storeutil.kvstore(url)
  return sum(len(store.read(k).result().value) for k in store.list().result()
             if k.decode().startswith("checkpoint_1/"))


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=__doc__.split("\n\n", 1)[1])
  parser.add_argument("--preset", default="smoke",
                      help="a name in configs/ or a path to a JSON preset")
  parser.add_argument("--read-once", action="store_true",
                      help="only the multi-process read-once restore figure "
                      "(disk and moto S3, 2 and 4 processes)")
  parser.add_argument("--read-once-scale", type=int, default=8,
                      help="--read-once: state sizes in units of their base "
                      "(aligned: 3.5 MiB; awkward: 3.2 MiB, an even scale "
                      "rounded up to odd)")
  parser.add_argument("--read-once-budget", type=int, default=None,
                      help="--read-once: the restores' concurrent_bytes "
                      "(default: the workers' 1 GiB, one exchange batch); "
                      "small: several batches, read while exchanging")
  parser.add_argument("--read-once-states", default="aligned,awkward",
                      help="--read-once: comma-separated, from "
                      f"{','.join(READ_ONCE_STATES)}")
  parser.add_argument("--runs", type=int, default=None,
                      help="runs per system (default: the preset's, else 3)")
  parser.add_argument("--systems", default=None,
                      help=f"comma-separated, from {','.join(SYSTEMS)} "
                      "(default: all; orbax is skipped if not installed)")
  parser.add_argument("--out", default=None,
                      help="JSON report (default out/bench/<preset>.json)")
  parser.add_argument("--dir", default=None,
                      help="where checkpoints are written (default: a new "
                      "temporary directory, removed at the end)")
  parser.add_argument("--ops", default=None,
                      help=f"comma-separated, from {','.join(OPS)} (default: "
                      "the preset's \"ops\", else all but train); the sync "
                      "save always runs")
  parser.add_argument("--train-steps", type=int, default=30,
                      help="train op: steps timed without a save, before "
                      "the steps during one (scripts/bench_train.py)")
  parser.add_argument("--train-width", type=int, default=512,
                      help="train op: the MLP's width (hidden: 4x)")
  parser.add_argument("--evict", action="store_true",
                      help="drop the checkpoint's pages from the page cache "
                      "(posix_fadvise) before each restore")
  parser.add_argument("--no-verify", dest="verify", action="store_false",
                      help="do not check restored data (checked in run 1, "
                      "outside the timed part)")
  parser.add_argument("--drift-saves", type=int, default=50,
                      help="after the runs, this many consecutive async "
                      "saves of the state into one root (keep=2) per system "
                      "that supports it, RSS read after each (0: skip); "
                      "single-process runs only")
  parser.add_argument("--rss-interval-ms", type=float, default=2.0)
  parser.add_argument("--devices", type=int, default=8,
                      help="CPU devices of the single worker process")
  parser.add_argument("--processes", type=int, default=1,
                      help="> 1: run each system as a local jax.distributed "
                      "job of this many processes")
  parser.add_argument("--devices-per-process", type=int, default=None)
  parser.add_argument("--timeout", type=float, default=1800.0,
                      help="seconds a multi-process job may take")
  parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)

  if args.worker:
    return worker_main(args.worker, args.preset, args.rss_interval_ms / 1000)

  if args.read_once:
    report = run_read_once(args)
    print(report["table"])
    if args.out:
      os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
      with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0

  preset = load_preset(args.preset)
  preset_path = (CONFIGS / f"{args.preset}.json"
                 if not pathlib.Path(args.preset).suffix else
                 pathlib.Path(args.preset).resolve())
  runs = args.runs or preset.get("runs", 3)
  args.runs = runs
  args.ops = (args.ops.split(",") if args.ops else
              preset.get("ops", list(DEFAULT_OPS)))
  for op in args.ops:
    if op not in OPS:
      parser.error(f"unknown op {op!r}; expected some of {OPS}")
  if args.processes > 1:
    args.devices_per_process = args.devices_per_process or max(
        1, args.devices // args.processes)
  systems = [s.strip() for s in (args.systems or ",".join(SYSTEMS)).split(",")
             if s.strip()]
  for s in systems:
    if system_kind(s) not in SYSTEMS:
      parser.error(f"unknown system {s!r}; expected some of {SYSTEMS} "
                   "(ckpt@PATH: ckpt imported from PATH, for A/B runs)")
  notes = [
      "page cache not dropped (needs root, global to the machine): restores "
      "read files just written" + (", evicted per file with "
                                   "posix_fadvise(DONTNEED) first" if args.evict
                                   else ", usually from memory"),
      "extra RSS = peak RSS during the operation (max of psutil samples every "
      f"{args.rss_interval_ms:g} ms and the kernel's VmHWM) minus RSS just "
      "before it; restore figures include the restored state itself",
      "each system runs in its own worker process; runs are interleaved "
      "across systems; figures are medians with (min-max) over the runs",
      "raw: one file per distinct shard, tofile + fsync on a thread pool; no "
      "index, no commit, no async mode",
  ]
  if "orbax" in systems and not _orbax_installed():
    if args.systems:
      parser.error("orbax-checkpoint is not installed: pip install -e "
                   "'.[bench]', or leave orbax out of --systems")
    systems.remove("orbax")
    notes.append("orbax skipped: orbax-checkpoint is not installed "
                 "(pip install -e '.[bench]')")
  out_path = pathlib.Path(args.out or ROOT / "out" / "bench" /
                          f"{preset['name']}.json")
  out_path.parent.mkdir(parents=True, exist_ok=True)

  nbytes = state_nbytes(preset)
  n_leaves = len(leaf_specs(preset))
  topo_text = (f"{args.processes} processes x {args.devices_per_process} devices"
               if args.processes > 1 else f"1 process x {args.devices} devices")
  print(f"bench {preset['name']}: {n_leaves} array leaves, "
        f"{nbytes / MiB:,.1f} MiB, {topo_text}, {runs} runs of "
        f"{', '.join(systems)}", flush=True)
  own_dir = args.dir is None
  workdir = (tempfile.mkdtemp(prefix="ckpt-bench-") if own_dir else
             os.path.abspath(args.dir))
  os.makedirs(workdir, exist_ok=True)
  log_dir = tempfile.mkdtemp(prefix="ckpt-bench-logs-")
  t_start = time.perf_counter()
  try:
    if args.processes > 1:
      raw, info = run_multi_process(preset_path, systems, args, workdir)
    else:
      raw, info = run_single_process(str(preset_path), systems, args, workdir,
                                     log_dir)
  finally:
    if own_dir:
      shutil.rmtree(workdir, ignore_errors=True)
  shutil.rmtree(log_dir, ignore_errors=True)  # kept only if a worker failed
  budget = preset["ckpt"].get("concurrent_bytes")
  if budget is None and any(system_kind(s) == "ckpt" for s in systems):
    from ckpt import checkpointer  # pylint: disable=g-import-not-at-top
    budget = checkpointer.DEFAULT_CONCURRENT_BYTES
  figures = {s: {k: summarize(v) for k, v in raw[s].items()} for s in systems}
  report = {
      "preset": preset["name"], "config": preset, "runs": runs,
      "systems": figures,
      "targets": [t for s in systems if system_kind(s) == "ckpt"
                  for t in targets(figures, budget, s, nbytes)],
      "ckpt_concurrent_bytes": budget,
      "state": {"array_leaves": n_leaves, "bytes": nbytes,
                "scalars": len(preset["scalars"])},
      "topology": {"processes": args.processes,
                   "devices": (args.devices if args.processes == 1 else
                               args.processes * args.devices_per_process)},
      "workers": info, "machine": {
          "cpus": os.cpu_count(), "platform": platform.platform(),
          **_versions()},
      "notes": notes, "command": " ".join([os.path.relpath(__file__, ROOT)] +
                                          (argv or sys.argv[1:])),
      "wall_s": time.perf_counter() - t_start,
  }
  with open(out_path, "w") as f:
    json.dump(report, f, indent=1)
  print()
  print(f"{preset['name']}: {n_leaves} array leaves, {nbytes / MiB:,.1f} MiB, "
        f"{topo_text}, median (min-max) of {runs} runs")
  print(table(report))
  print()
  for n in notes:
    print(f"note: {n}")
  print(f"wrote {out_path} ({report['wall_s']:.0f} s)")
  return 0


if __name__ == "__main__":
  if os.environ.get("CKPT_CLUSTER") and len(sys.argv) == 2:
    sys.exit(cluster_worker_main(json.loads(sys.argv[1])))
  sys.exit(main())
