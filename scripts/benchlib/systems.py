"""The systems a benchmark compares; every method blocks until done.

- ``ckpt``: ``ckpt.Checkpointer`` with the preset's ``ckpt`` options.
- ``orbax``: ``orbax.checkpoint.StandardCheckpointer`` with its defaults
  (ocdbt, zarr3, zstd; ``pip install -e '.[bench]'``).
- ``limit``: the yardstick every ratio is taken against, the functions of
  ``../shared/limits/limits.py`` (loaded by path, never copied): the
  plainest code that moves the same bytes. ``dense_save``/``dense_restore``
  (one file per distinct shard, ``tofile`` + ``fsync`` on 8 threads, read
  back with ``np.fromfile`` and placed with no extra copy), or for a preset
  with ``"limit": "small"`` ``small_save``/``small_restore`` (one packed
  file, one ``device_put`` of every leaf). Same mesh only (the limit has no
  resharding restore), no async mode.

``RawSystem`` and ``RawPackSystem`` below are the earlier plain-file
baselines (the raw restore assembles every box into a fresh array: about
twice the plain read, issue 47); the benchmark no longer offers them, and
only scripts that have not moved to the limit yet use them.

A label ``ckpt@/path/to/tree`` is ckpt imported from that tree (A/B runs;
``workers`` puts it first on the worker's PYTHONPATH).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import math
import os
from typing import Any, Callable

import numpy as np

from scripts.benchlib import presets

SYSTEMS = ("ckpt", "orbax", "limit")
LIMITS = presets.ROOT.parent / "shared" / "limits" / "limits.py"
Box = tuple[tuple[int, int], ...]


class System:
  """Save and restore of one checkpointer into a fresh directory."""

  def save(self, path: str, state: Any) -> None:
    raise NotImplementedError

  def save_async(self, path: str, state: Any) -> Callable[[], None] | None:
    """Starts a save; returns the wait function, or None if unsupported."""
    return None

  def restore(self, path: str, target: Any) -> Any:
    raise NotImplementedError

  def restores_onto(self, mesh: str) -> bool:
    """Whether ``restore`` can place onto the preset's ``mesh`` ("same" or
    "other")."""
    return True

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
    from scripts.benchlib import measure  # pylint: disable=g-import-not-at-top
    rss = []
    # keep=2: old steps are deleted as a training job's would be.
    with self.ckpt.Checkpointer(path, async_save=True, keep=2,
                                **self.options) as c:
      for step in range(1, saves + 1):
        c.save(step, state)
        c.wait_until_finished()
        rss.append(measure.rss())
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


class LimitSystem(System):
  """The limit's functions (../shared/limits/limits.py) on a preset's state.

  Only the array leaves are written (the limit has no place for scalars;
  a restore gives back the saved scalars as they are). In a job of several
  processes each writes its own folder ``p<index>``.
  """

  def __init__(self, options: dict[str, Any], case: str = "dense"):
    del options
    self.limits = load_limits()
    if case not in ("dense", "small"):
      raise ValueError(f"preset \"limit\": expected \"dense\" or \"small\", "
                       f"found {case!r}")
    self.case = case
    self.saved: dict[str, Any] = {}  # path -> the state saved there

  def _where(self, path: str) -> str:
    import jax  # pylint: disable=g-import-not-at-top
    return os.path.join(path, f"p{jax.process_index()}")

  def save(self, path, state):
    import jax  # pylint: disable=g-import-not-at-top
    arrays = [x for _, x in presets.flat_items(state)
              if isinstance(x, jax.Array)]
    getattr(self.limits, f"{self.case}_save")(self._where(path), arrays)
    self.saved[path] = state

  def restore(self, path, target):
    import jax  # pylint: disable=g-import-not-at-top
    # The limit places onto the saved arrays' shardings: it needs them.
    state = self.saved[path]
    items = presets.flat_items(state)
    arrays = [x for _, x in items if isinstance(x, jax.Array)]
    values = iter(getattr(self.limits, f"{self.case}_restore")(
        self._where(path), arrays))
    return presets.nest({name: next(values) if isinstance(x, jax.Array)
                         else x for name, x in items})

  def restores_onto(self, mesh):
    return mesh == "same"


def load_limits():
  """../shared/limits/limits.py as its docstring says: by path, no copy."""
  if not LIMITS.is_file():
    raise FileNotFoundError(
        f"the limit {LIMITS} is missing: the benchmark measures every ratio "
        "against it (../shared/limits/limits.py next to the repository)")
  spec = importlib.util.spec_from_file_location("limits", LIMITS)
  limits = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(limits)
  return limits


# ---- the earlier plain-file baselines (not offered by the benchmark) ----------------------------------------------------


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
  return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))


_DISTINCT: dict[tuple, tuple[tuple[int, Box], ...]] = {}


def distinct_shards(x) -> list[tuple[np.ndarray, Box]]:
  """(host bytes, box) of every shard of ``x`` this process writes: the
  replica 0 of each box it holds. Which shards those are depends only on
  the sharding and the shape, so it is worked out once per pair (from
  ``addressable_shards``); every other leaf costs one ``addressable_data``
  and one zero-copy ``np.asarray`` per written shard."""
  key = (x.sharding, x.shape)
  chosen = _DISTINCT.get(key)
  if chosen is None:
    chosen = _DISTINCT[key] = tuple(
        (i, _box(s.index, x.shape)) for i, s in enumerate(x.addressable_shards)
        if s.replica_id == 0)
  if x.is_fully_replicated and chosen:  # one box: the array itself
    return [(np.asarray(x), chosen[0][1])]
  return [(np.asarray(x.addressable_data(i)), box) for i, box in chosen]


def _fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _overlap(box: Box, stored: Box) -> tuple[tuple, tuple] | None:
  """(destination slices in ``box``, source slices in ``stored``) of the
  part of ``stored`` inside ``box``, or None if they do not meet."""
  lo = [max(a, sa) for (a, _), (sa, _) in zip(box, stored)]
  hi = [min(b, sb) for (_, b), (_, sb) in zip(box, stored)]
  if any(l >= h for l, h in zip(lo, hi)):
    return None
  return (tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, box)),
          tuple(slice(l - sa, h - sa) for l, h, (sa, _) in zip(lo, hi, stored)))


def _assemble(box: Box, dtype, stored: dict[Box, Callable[[bool], np.ndarray]]
              ) -> np.ndarray:
  """The values of ``box``: a stored box as is (``load(True)``), else copied
  together from every stored box that overlaps it (another mesh; ``load(False)``
  may map the box rather than read it)."""
  if box in stored:
    return stored[box](True)
  out = np.empty([b - a for a, b in box], dtype)
  for sbox, load in stored.items():
    where = _overlap(box, sbox)
    if where is not None:
      out[where[0]] = load(False)[where[1]]
  return out


def _place(t, boxes: Callable[[Box], np.ndarray]):
  """A jax.Array of target ``t`` whose device buffers are ``boxes(box)``,
  each box read once for all the devices that hold it."""
  import jax  # pylint: disable=g-import-not-at-top
  index_map = t.sharding.addressable_devices_indices_map(t.shape)
  by_box: dict[Box, list] = {}
  for d, idx in index_map.items():
    by_box.setdefault(_box(idx, t.shape), []).append(d)
  placed = {}
  for box, devices in by_box.items():
    data = boxes(box)
    placed.update((d, jax.device_put(data, d)) for d in devices)
  return jax.make_array_from_single_device_arrays(
      t.shape, t.sharding, [placed[d] for d in index_map])


class RawSystem(System):
  """The same bytes as plain files: one per distinct shard, then fsync."""

  def __init__(self, options: dict[str, Any]):
    self.threads = int(options.get("threads", 4))

  def save(self, path, state):
    import jax  # pylint: disable=g-import-not-at-top
    pid = jax.process_index()
    os.makedirs(path, exist_ok=True)
    meta, jobs = {}, []
    for li, (name, x) in enumerate(presets.flat_items(state)):
      if not isinstance(x, jax.Array):
        meta[name] = {"value": x}
        continue
      files = []
      for k, (data, box) in enumerate(distinct_shards(x)):
        fname = f"{li}.{pid}.{k}.bin"
        files.append({"file": fname, "box": box})
        jobs.append((os.path.join(path, fname), data))
      meta[name] = {"dtype": _dtype_name(x.dtype), "files": files}

    def write(job):
      fname, data = job
      with open(fname, "wb") as f:
        data.tofile(f)
        f.flush()
        os.fsync(f.fileno())

    with concurrent.futures.ThreadPoolExecutor(self.threads) as pool:
      list(pool.map(write, jobs))
    with open(os.path.join(path, f"meta.{pid}.json"), "w") as f:
      json.dump(meta, f)
      f.flush()
      os.fsync(f.fileno())
    _fsync_dir(path)

  def restore(self, path, target):
    import jax  # pylint: disable=g-import-not-at-top
    meta: dict[str, Any] = {}
    for name in sorted(os.listdir(path)):
      if name.startswith("meta."):
        with open(os.path.join(path, name)) as f:
          for k, v in json.load(f).items():
            if "files" in v and k in meta:
              meta[k]["files"].extend(v["files"])
            else:
              meta[k] = v
    leaves = presets.flat_items(target)

    def read(leaf):
      name, t = leaf
      if not isinstance(t, jax.ShapeDtypeStruct):
        return meta[name]["value"]
      dtype = np.dtype(meta[name]["dtype"])
      stored = {}
      for f in meta[name]["files"]:
        box = tuple(map(tuple, f["box"]))
        shape = tuple(b - a for a, b in box)
        file = os.path.join(path, f["file"])
        stored[box] = (lambda whole, file=file, shape=shape: np.fromfile(
            file, dtype=dtype).reshape(shape) if whole else np.memmap(
                file, dtype=dtype, mode="r", shape=shape))
      return _place(t, lambda box: _assemble(box, dtype, stored))

    with concurrent.futures.ThreadPoolExecutor(self.threads) as pool:
      values = list(pool.map(read, leaves))
    return presets.nest({name: v for (name, _), v in zip(leaves, values)})


class RawPackSystem(System):
  """Every distinct shard of this process and its table in one file.

  The table is what a reader needs and nothing more: one row per layout
  (sharding, shape and dtype: its boxes and their offsets from the leaf's
  first byte) and one ``[path, layout, offset]`` per leaf, so that its cost
  does not grow with the boxes. Profiled against the plain write of the same
  bytes (concatenate, write, fsync) on ``small_leaves_10k``: per-shard
  ``addressable_shards`` and ``replica_id``, ``dtype.name`` per leaf and a
  JSON table of nested dicts were 90% of the old baseline's CPU time.
  """

  def __init__(self, options: dict[str, Any]):
    del options

  def save(self, path, state):
    import jax  # pylint: disable=g-import-not-at-top
    os.makedirs(path, exist_ok=True)
    layouts: dict[tuple, int] = {}
    table: dict[str, list] = {"layouts": [], "leaves": []}
    pieces, offset = [], 0
    for name, x in presets.flat_items(state):
      if not isinstance(x, jax.Array):
        table["leaves"].append([name, x])
        continue
      shards = distinct_shards(x)
      key = (x.sharding, x.shape, x.dtype)
      layout = layouts.get(key)
      if layout is None:
        layout = layouts[key] = len(table["layouts"])
        starts = np.cumsum([0] + [d.nbytes for d, _ in shards[:-1]])
        table["layouts"].append([_dtype_name(x.dtype), [
            [box, int(start)] for (_, box), start in zip(shards, starts)]])
      table["leaves"].append([name, layout, offset])
      for data, _ in shards:
        pieces.append(data)
        offset += data.nbytes
    # The table after the data, then its length: one buffer, one write.
    pieces.append(json.dumps(table).encode())
    pieces.append(len(pieces[-1]).to_bytes(8, "little"))
    pack = os.path.join(path, f"pack.{jax.process_index()}.bin")
    with open(pack, "wb") as f:
      f.write(b"".join(pieces))  # one concatenation
      f.flush()
      os.fsync(f.fileno())
    _fsync_dir(path)

  def restore(self, path, target):
    import jax  # pylint: disable=g-import-not-at-top
    values: dict[str, Any] = {}
    boxes: dict[str, list] = {}
    for name in sorted(os.listdir(path)):
      if not name.startswith("pack."):
        continue
      with open(os.path.join(path, name), "rb") as f:
        pack = np.frombuffer(f.read(), np.uint8)  # one read
      n = int.from_bytes(pack[-8:].tobytes(), "little")
      table = json.loads(pack[-8 - n:-8].tobytes())
      layouts = [(np.dtype(dtype), [(tuple(map(tuple, box)), start)
                                    for box, start in stored])
                 for dtype, stored in table["layouts"]]
      for entry in table["leaves"]:
        if len(entry) == 2:
          values[entry[0]] = entry[1]
          continue
        leaf, layout, offset = entry
        dtype, stored = layouts[layout]
        for box, start in stored:
          shape = tuple(b - a for a, b in box)
          begin = offset + start
          data = pack[begin:begin + math.prod(shape) * dtype.itemsize]
          boxes.setdefault(leaf, []).append(
              (box, data.view(dtype).reshape(shape)))
    out = {}
    for name, t in presets.flat_items(target):
      if not isinstance(t, jax.ShapeDtypeStruct):
        out[name] = values[name]
        continue
      stored = {box: (lambda _, d=d: d) for box, d in boxes[name]}
      out[name] = _place(t, lambda box, stored=stored, dt=np.dtype(t.dtype):
                         _assemble(box, dt, stored))
    return presets.nest(out)


_NAMES: dict[Any, str] = {}


def _dtype_name(dtype) -> str:
  """``dtype.name``, cached: numpy computes it anew on every call."""
  name = _NAMES.get(dtype)
  if name is None:
    name = _NAMES[dtype] = dtype.name
  return name


def system_kind(label: str) -> str:
  """``ckpt@/path/to/other/tree`` is ckpt imported from that tree."""
  return label.split("@", 1)[0]


def make_system(label: str, preset: dict[str, Any]) -> System:
  name = system_kind(label)
  options = preset.get(name, {})
  if name == "limit":
    return LimitSystem(options, preset.get("limit", "dense"))
  kinds = {"ckpt": CkptSystem, "orbax": OrbaxSystem}
  if name not in kinds:
    raise ValueError(f"unknown system {name!r}; expected one of {SYSTEMS}")
  return kinds[name](options)


def orbax_installed() -> bool:
  import importlib.util  # pylint: disable=g-import-not-at-top
  try:
    return importlib.util.find_spec("orbax.checkpoint") is not None
  except ModuleNotFoundError:
    return False
