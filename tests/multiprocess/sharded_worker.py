"""One process of the multi-process sharded save/restore tests.

Run by ``test_sharded.py`` through ``ckpt.multihost.local_cluster`` as
``python -m tests.multiprocess.sharded_worker <json config>``; every process
of the job runs this same program (SPMD). Each process regenerates the same
global arrays from fixed seeds, so any process can check any slice it holds
against the truth, bit for bit, without talking to the others.

Operations (``config["op"]``):

- ``save``: build the training-state-like tree on the 2 x 4 mesh and save it
  as ``config["step"]`` with each entry of ``config["ckpts"]`` (name ->
  directory, format and Checkpointer options).
- ``restore``: restore each of ``config["steps"]`` from each entry onto a target
  whose mesh and PartitionSpecs depend on this job's process layout, and
  compare every addressable shard with the global arrays. With
  ``config["resave"]`` the last restored state is saved again as that step
  (so a checkpoint written by another process count is read later).
- With one process, ``restore`` also checks ``target=None`` and
  ``ckpt.load`` against the global arrays.

The result (a ``Saved`` or a ``Restored``, by entry of ``config["ckpts"]``)
holds save statistics or a list of mismatches (empty when everything is
bit-exact) and the leaves checked.
"""

from __future__ import annotations

import collections
import dataclasses
import zlib
from typing import Any, Callable

import ml_dtypes
import numpy as np
from jax.sharding import PartitionSpec as P

from tests.multiprocess import worker

# The (ckpt) paths of array leaves. For each: global shape, dtype, and
#   "kind": "jax" (a jax.Array on the job's devices) or "host" (a numpy array
#   that every process holds whole; a MeshPartitioner may say who owns what),
#   "save": its PartitionSpec on the 2 x 4 save mesh ("data", "model"), for
#     a host leaf the partitioner rule (None: no rule, replicated),
#   "1x8" / "4x2": its PartitionSpec on the restore mesh of that layout; for
#     a host leaf None means "restore as a host numpy array".
_F32, _BF16, _I32 = np.dtype("float32"), np.dtype(ml_dtypes.bfloat16), np.dtype("int32")
_PARAMS = {
    "embed/table": ((1024, 256), _F32, P(None, "model"), P("a", "b"), P(None, "c")),
    "layers/0/kernel": ((256, 512), _F32, P("data", "model"), P("b", "a"), P("c", "r")),
    "layers/0/bias": ((512,), _F32, P("model"), P(), P("r")),
    "layers/1/kernel": ((512, 256), _F32, P("model", "data"), P(None, "a"), P(("r", "c"))),
    "layers/1/bias": ((256,), _F32, P(), P("a"), P()),
    "head/kernel": ((256, 128), _BF16, P("data", None), P("b", "a"), P("r", "c")),
}
ARRAYS: dict[str, dict[str, Any]] = {}
for _name, (_shape, _dtype, _save, _r18, _r42) in _PARAMS.items():
  for _prefix in ("params", "opt/mu", "opt/nu"):
    ARRAYS[f"{_prefix}/{_name}"] = dict(
        shape=_shape, dtype=_dtype, kind="jax", save=_save,
        **{"1x8": _r18, "4x2": _r42})
ARRAYS.update({
    # 4 MiB replicated on every device: its chunks must be split between the
    # processes, not all written by process 0.
    "ema/table": dict(shape=(1024, 1024), dtype=_F32, kind="jax", save=P(),
                      **{"1x8": P("a"), "4x2": P(("r", "c"), None)}),
    # An optax-style step count: a replicated jax scalar (stored inline).
    "opt/count": dict(shape=(), dtype=_I32, kind="jax", save=P(),
                      **{"1x8": P(), "4x2": P()}),
    # Host numpy leaves: the partitioner shards "data/buffer" over "data"; the
    # others match no rule and are replicated (so split between processes).
    "data/buffer": dict(shape=(2048, 256), dtype=_F32, kind="host",
                        save=P("data"), **{"1x8": None, "4x2": P("r", "c")}),
    "data/tokens": dict(shape=(512, 512), dtype=_I32, kind="host", save=None,
                        **{"1x8": None, "4x2": P(None, "c")}),
    "data/mask": dict(shape=(1000,), dtype=np.dtype(bool), kind="host",
                      save=None, **{"1x8": None, "4x2": None}),
    "data/tiny": dict(shape=(4, 4), dtype=_F32, kind="host", save=None,
                      **{"1x8": None, "4x2": None}),
})
# Leaves that are plain values, restored as they were saved.
VALUES: dict[str, Any] = {
    "step": 1234, "lr": np.float32(3e-4), "done": False,
    "name": "sharded-test", "misc/pair/0": "a", "misc/pair/1": 2.5,
}
MESH_AXES = {"2x4": ("data", "model"), "1x8": ("a", "b"), "4x2": ("r", "c")}
MESH_SHAPE = {"2x4": (2, 4), "1x8": (4, 2), "4x2": (2, 4)}
INLINE_MAX_BYTES = 256  # ckpt.save.leaves.INLINE_MAX_BYTES: smaller leaves go inline

AdamState = collections.namedtuple("AdamState", ["count", "mu", "nu"])


def seed_of(path: str) -> int:
  """A fixed seed per leaf: the same in every process and run."""
  return zlib.crc32(path.encode())


def global_value(path: str) -> np.ndarray:
  """The global array of ``path``: the same bytes on every process."""
  spec = ARRAYS[path]
  rng = np.random.default_rng(seed_of(path))
  shape, dtype = spec["shape"], spec["dtype"]
  if dtype == np.dtype(bool):
    return rng.random(shape) < 0.5
  if dtype.kind in "iu":
    return rng.integers(-2**31, 2**31 - 1, size=shape, dtype=dtype)
  return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def stored_bytes() -> int:
  """Bytes of array data a save must write in all (each chunk once)."""
  return sum(int(np.prod(s["shape"])) * s["dtype"].itemsize
             for s in ARRAYS.values()
             if int(np.prod(s["shape"])) * s["dtype"].itemsize > INLINE_MAX_BYTES)


def build(leaf: Callable[[str], Any]) -> Any:
  """The training-state-like tree, with ``leaf(path)`` at each leaf."""

  def params(prefix):
    return {
        "embed": {"table": leaf(f"{prefix}/embed/table")},
        "layers": [{"kernel": leaf(f"{prefix}/layers/{i}/kernel"),
                    "bias": leaf(f"{prefix}/layers/{i}/bias")}
                   for i in range(2)],
        "head": {"kernel": leaf(f"{prefix}/head/kernel")},
    }

  return {
      "params": params("params"),
      "opt": AdamState(count=leaf("opt/count"), mu=params("opt/mu"),
                       nu=params("opt/nu")),
      "ema": {"table": leaf("ema/table")},
      "data": {k: leaf(f"data/{k}") for k in ("buffer", "tokens", "mask", "tiny")},
      "step": leaf("step"), "lr": leaf("lr"), "done": leaf("done"),
      "name": leaf("name"), "misc": {"pair": (leaf("misc/pair/0"),
                                              leaf("misc/pair/1"))},
      "nothing": None, "empty": {},
  }


def to_plain(node: Any) -> Any:
  """What a ``target=None`` restore returns for ``node``: custom nodes as dicts."""
  if isinstance(node, AdamState):
    return {k: to_plain(v) for k, v in node._asdict().items()}
  if isinstance(node, dict):
    return {k: to_plain(v) for k, v in node.items()}
  if isinstance(node, list):
    return [to_plain(v) for v in node]
  if isinstance(node, tuple):
    return tuple(to_plain(v) for v in node)
  return node


def same_bits(a: Any, b: np.ndarray) -> bool:
  a = np.asarray(a)
  return (a.dtype == b.dtype and a.shape == b.shape
          and a.tobytes() == np.ascontiguousarray(b).tobytes())


def compare_plain(got: Any, want: Any, path: str, out: list[str]) -> None:
  """Appends a line to ``out`` for every difference between two host trees."""
  if isinstance(want, dict):
    if not isinstance(got, dict) or set(got) != set(want):
      out.append(f"{path}: got {type(got).__name__} "
                 f"{sorted(got) if isinstance(got, dict) else got!r}, want keys "
                 f"{sorted(want)}")
      return
    for k in want:
      compare_plain(got[k], want[k], f"{path}/{k}", out)
  elif isinstance(want, (list, tuple)):
    if type(got) is not type(want) or len(got) != len(want):
      out.append(f"{path}: got {got!r}, want a {type(want).__name__} of "
                 f"{len(want)}")
      return
    for i, (g, w) in enumerate(zip(got, want)):
      compare_plain(g, w, f"{path}/{i}", out)
  elif isinstance(want, np.ndarray):
    if not isinstance(got, np.ndarray) or not same_bits(got, want):
      out.append(f"{path}: {_describe(got)} differs from {_describe(want)}")
  elif type(got) is not type(want) or got != want:
    out.append(f"{path}: got {got!r} ({type(got).__name__}), want {want!r} "
               f"({type(want).__name__})")


def _describe(x: Any) -> str:
  if hasattr(x, "dtype") and hasattr(x, "shape"):
    return f"{type(x).__name__}{tuple(x.shape)} {x.dtype}"
  return repr(x)


# ---- inside a job -----------------------------------------------------------


def _layout() -> str:
  import jax  # pylint: disable=g-import-not-at-top
  return f"{jax.process_count()}x{jax.local_device_count()}"


def _mesh(layout: str):
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  return Mesh(np.array(jax.devices()).reshape(MESH_SHAPE[layout]),
              MESH_AXES[layout])


def make_state(mesh) -> tuple[Any, Any]:
  """(the state on ``mesh`` as the 2 x 4 save lays it out, its partitioner)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top

  def leaf(path):
    if path in VALUES:
      return VALUES[path]
    spec, value = ARRAYS[path], global_value(path)
    if spec["kind"] == "host":
      return value
    return jax.make_array_from_callback(
        value.shape, NamedSharding(mesh, spec["save"]), lambda i: value[i])

  rules = [(p, s["save"]) for p, s in ARRAYS.items()
           if s["kind"] == "host" and s["save"] is not None]
  return build(leaf), ckpt.MeshPartitioner(mesh, rules)


def make_target(layout: str, mesh) -> Any:
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top

  def leaf(path):
    if path in VALUES:
      return VALUES[path]
    spec = ARRAYS[path]
    if spec[layout] is None:  # a host leaf restored as a host array
      return np.zeros(spec["shape"], spec["dtype"])
    return jax.ShapeDtypeStruct(spec["shape"], spec["dtype"],
                                sharding=NamedSharding(mesh, spec[layout]))

  return build(leaf)


def check_restored(restored: Any, target: Any) -> tuple[list[str], list[str]]:
  """(mismatches, leaves checked): each addressable shard against the truth."""
  import jax  # pylint: disable=g-import-not-at-top
  from ckpt.format import tree  # pylint: disable=g-import-not-at-top
  bad: list[str] = []
  checked: list[str] = []
  if jax.tree_util.tree_structure(restored) != jax.tree_util.tree_structure(target):
    return [f"tree structure {jax.tree_util.tree_structure(restored)} != "
            f"target {jax.tree_util.tree_structure(target)}"], []
  got = dict((tree.path_str(p), x) for p, x in tree.flatten(restored))
  for parts, want in tree.flatten(target):
    path = tree.path_str(parts)
    x = got[path]
    if path in VALUES:
      if type(x) is not type(VALUES[path]) or x != VALUES[path]:
        bad.append(f"{path}: got {x!r} ({type(x).__name__}), want "
                   f"{VALUES[path]!r}")
      checked.append(path)
      continue
    truth = global_value(path)
    if isinstance(want, np.ndarray):
      if not isinstance(x, np.ndarray) or not same_bits(x, truth):
        bad.append(f"{path}: host value {_describe(x)} differs from "
                   f"{_describe(truth)}")
      checked.append(path)
      continue
    if not isinstance(x, jax.Array):
      bad.append(f"{path}: got {type(x).__name__}, want a jax.Array")
      continue
    if x.dtype != truth.dtype or x.shape != truth.shape:
      bad.append(f"{path}: got {x.shape} {x.dtype}, want {truth.shape} "
                 f"{truth.dtype}")
      continue
    if not x.sharding.is_equivalent_to(want.sharding, len(x.shape)):
      bad.append(f"{path}: sharding {x.sharding} is not the target's "
                 f"{want.sharding}")
    shards = x.addressable_shards
    if len(shards) != jax.local_device_count():
      bad.append(f"{path}: {len(shards)} addressable shards, want "
                 f"{jax.local_device_count()}")
    for s in shards:
      if not same_bits(np.asarray(s.data), truth[s.index]):
        bad.append(f"{path}: shard {s.index} on {s.device} differs")
    checked.append(path)
  return bad, checked


def _checkpointer(options: dict, **kwargs):
  """A Checkpointer from one entry of ``config["ckpts"]``."""
  import ckpt  # pylint: disable=g-import-not-at-top
  return ckpt.Checkpointer(
      options["dir"], format=options["format"],
      compression=options.get("compression"),
      concurrent_bytes=options.get("concurrent_bytes") or (1 << 30),
      async_save=options.get("async_save", False), **kwargs)


@dataclasses.dataclass(frozen=True)
class SaveStats:
  """One entry's save (its last_save_stats) and its steps afterwards."""
  bytes_written: int
  boxes_written: int
  array_leaves: int
  inline_leaves: int
  peak_bytes_in_flight: int
  blocking_s: float
  total_s: float
  steps: list[int]


@dataclasses.dataclass(frozen=True)
class Resave:
  saved: bool
  bytes_written: int
  peak_bytes_in_flight: int
  planned_leaves: int
  steps: list[int]


@dataclasses.dataclass(frozen=True)
class ResaveAgain:
  saved: bool
  planned_leaves: int
  bytes_written: int


@dataclasses.dataclass(frozen=True)
class Restore:
  """One entry's restores."""
  mismatches: list[str]
  checked: dict[str, list[str]]   # the leaves checked, by step
  steps: list[int]
  resave: Resave | None = None              # with config["resave"]
  resave_again: ResaveAgain | None = None   # with config["resave_again"]


@dataclasses.dataclass(frozen=True)
class Saved:
  process: int
  layout: str
  ckpts: dict[str, SaveStats]   # by entry of config["ckpts"]


@dataclasses.dataclass(frozen=True)
class Restored:
  process: int
  layout: str
  ckpts: dict[str, Restore]


def _save(config: dict, state, partitioner) -> dict:
  out = {}
  for name, options in config["ckpts"].items():
    with _checkpointer(options, partitioner=partitioner) as ckptr:
      ckptr.save(config["step"], state, metrics={"loss": 0.5})
      ckptr.wait_until_finished()
      s = ckptr.last_save_stats
      out[name] = SaveStats(s.bytes_written, s.boxes_written,
                            s.array_leaves, s.inline_leaves,
                            s.peak_bytes_in_flight, s.blocking_s, s.total_s,
                            ckptr.all_steps())
  return out


def _restore(config: dict, layout: str, mesh) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  out = {}
  target = make_target(layout, mesh)
  for name, options in config["ckpts"].items():
    directory = options["dir"]
    with _checkpointer(options) as ckptr:
      r = {"mismatches": [], "checked": {}, "steps": ckptr.all_steps()}
      for step in config["steps"]:
        restored = ckptr.restore(step, target=target)
        bad, checked = check_restored(restored, target)
        r["mismatches"] += [f"step {step}: {b}" for b in bad]
        r["checked"][str(step)] = checked
        if jax.process_count() == 1:
          # target=None and ckpt.load: the whole checkpoint as host values.
          want = to_plain(build(
              lambda p: VALUES[p] if p in VALUES else global_value(p)))
          for how, got in (("target=None", ckptr.restore(step)),
                           ("ckpt.load", ckpt.load(directory, step))):
            compare_plain(got, want, f"step {step}: {how}", r["mismatches"])
      if config.get("resave") is not None:
        # Save what was restored, from this layout and its shardings.
        saved = ckptr.save(config["resave"], restored)
        ckptr.wait_until_finished()
        s = ckptr.last_save_stats
        r["resave"] = Resave(saved, s.bytes_written, s.peak_bytes_in_flight,
                             s.planned_leaves, ckptr.all_steps())
        if config.get("resave_again"):
          # The same tree and shardings again: the plan cache's save.
          again = ckptr.save(config["resave"] + 1, restored)
          ckptr.wait_until_finished()
          s = ckptr.last_save_stats
          r["resave_again"] = ResaveAgain(again, s.planned_leaves,
                                          s.bytes_written)
    out[name] = Restore(**r)
  return out


def run(config: dict) -> Saved | Restored:
  layout = _layout()
  mesh = _mesh("2x4" if config["op"] == "save" else layout)
  if config["op"] == "save":
    state, partitioner = make_state(mesh)
    result, ckpts = Saved, _save(config, state, partitioner)
  elif config["op"] == "restore":
    result, ckpts = Restored, _restore(config, layout, mesh)
  else:
    raise ValueError(f"unknown op {config['op']!r}")
  import jax  # pylint: disable=g-import-not-at-top
  return result(jax.process_index(), layout, ckpts)


if __name__ == "__main__":
  worker.main(run)
