"""One process of the multi-process restore-transform tests.

Run by ``test_transforms_mp.py`` through ``ckpt.multihost.local_cluster`` as
``python -m tests.multiprocess.transforms_worker <json config>``; every
process of the job runs this same program (SPMD). Each regenerates the same
global arrays from fixed seeds, so it can check every shard it holds against
the truth, bit for bit, without talking to the others.

The saved model has one subtree per layer (``params/layers_<i>/...``), an
``embed`` table, an old ``head`` and optimizer state. The restored model
scans over layers (``params/layers/...`` with a leading layer axis), calls
the table ``embedding``, has a new ``norm`` (from ``fallback_state``) and no
head or optimizer state.

Operations (``config["op"]``):

- ``save`` (2 processes x 4 devices, mesh data=2 x model=4): save the
  per-layer state as step 1 into ``config["dir"]``; save it again into
  ``config["dir_xf"]`` through save transforms (drop the optimizer state,
  rename the table).
- ``restore`` (4 x 2 or 1 x 8): restore step 1 onto the stacked model with
  this layout's mesh and PartitionSpecs, through transforms and a fallback:
  ``own`` from the Checkpointer's own directory (is_resuming), ``copy`` from
  this process's private copy of the checkpoint from which every array this
  process does not need was deleted (the optimizer state, the head, and the
  layers its devices do not hold), ``lazy`` with ``lazy=True`` and
  ``read_async``, ``corrupt`` after deleting a layer this process needs
  (must fail naming it). With ``config["resave"]`` the stacked state is
  saved as step 2 into ``config["dir2"]``; with ``config["unstack"]`` step 2
  of ``config["dir2"]`` is restored back onto the per-layer model through
  ``unstack_layers``. Its result: a ``Restored``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import zlib
from typing import Any

import ml_dtypes
import numpy as np
from jax.sharding import PartitionSpec as P

from tests.multiprocess import worker
from tests.multiprocess.worker import Outcome

LAYERS = 4
STEP_VALUE = 500
_F32, _BF16 = np.dtype("float32"), np.dtype(ml_dtypes.bfloat16)
# Per-layer leaves: shape, dtype, PartitionSpec when saved (2 x 4 mesh,
# axes data, model), and of the stacked leaf (layer axis first) per layout.
LAYER_LEAVES: dict[str, dict[str, Any]] = {
    "attn/w": dict(shape=(32, 64), dtype=_F32, save=P("data", "model"),
                   stacked={"4x2": P("r", None, "c"),
                            "1x8": P(None, "a", "b")}),
    "mlp/w": dict(shape=(64, 32), dtype=_F32, save=P("model", None),
                  stacked={"4x2": P(None, "r", "c"),
                           "1x8": P("a", None, "b")}),
    "mlp/b": dict(shape=(256,), dtype=_BF16, save=P("model"),
                  stacked={"4x2": P("r", "c"), "1x8": P(None, ("a", "b"))}),
}
# Leaves outside the layers: shape, dtype, save spec, restore spec per layout.
OTHER_LEAVES: dict[str, dict[str, Any]] = {
    "params/embed/table": dict(shape=(128, 32), dtype=_F32,
                               save=P(None, "model")),
    "params/head/w": dict(shape=(32, 16), dtype=_F32, save=P()),
}
EMBEDDING_SPEC = {"4x2": P(("r", "c"), None), "1x8": P("b", "a")}
# The new leaf: the fallback holds it laid out one way, the target another.
NORM = dict(shape=(128,), dtype=_F32,
            fallback={"4x2": P(("r", "c")), "1x8": P()},
            target={"4x2": P("r"), "1x8": P("a")})
MESH_AXES = {"2x4": ("data", "model"), "1x8": ("a", "b"), "4x2": ("r", "c")}
MESH_SHAPE = {"2x4": (2, 4), "1x8": (4, 2), "4x2": (4, 2)}


def seed_of(path: str) -> int:
  return zlib.crc32(path.encode())


def global_value(path: str, shape, dtype) -> np.ndarray:
  """The global array at ``path``: the same bytes in every process."""
  rng = np.random.default_rng(seed_of(path))
  return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def saved_leaves() -> dict[str, dict[str, Any]]:
  """Every saved array leaf: path -> shape, dtype, save spec."""
  out = {}
  for prefix in ("params", "opt/mu"):
    for i in range(LAYERS):
      for leaf, spec in LAYER_LEAVES.items():
        out[f"{prefix}/layers_{i}/{leaf}"] = spec
    for path, spec in OTHER_LEAVES.items():
      out[path.replace("params", prefix, 1)] = spec
  return out


def truth(path: str) -> np.ndarray:
  """The saved value at a per-layer path, or the stack at a stacked one."""
  if path == "params/norm/scale":
    return global_value(path, NORM["shape"], NORM["dtype"])
  if path == "params/embedding/table":
    path = "params/embed/table"
  if path.startswith("params/layers/"):
    leaf = path[len("params/layers/"):]
    return np.stack([truth(f"params/layers_{i}/{leaf}") for i in range(LAYERS)])
  spec = saved_leaves()[path]
  return global_value(path, spec["shape"], spec["dtype"])


def same_bits(a: Any, b: np.ndarray) -> bool:
  a = np.asarray(a)
  return (a.dtype == b.dtype and a.shape == b.shape and
          np.ascontiguousarray(a).tobytes() ==
          np.ascontiguousarray(b).tobytes())


def nest(flat: dict[str, Any]) -> dict:
  out: dict = {}
  for path, v in flat.items():
    node = out
    parts = path.split("/")
    for p in parts[:-1]:
      node = node.setdefault(p, {})
    node[parts[-1]] = v
  return out


# ---- inside a job -----------------------------------------------------------


def _layout() -> str:
  import jax  # pylint: disable=g-import-not-at-top
  return f"{jax.process_count()}x{jax.local_device_count()}"


def _mesh(layout: str):
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  return Mesh(np.array(jax.devices()).reshape(MESH_SHAPE[layout]),
              MESH_AXES[layout])


def _global_array(value: np.ndarray, sharding):
  import jax  # pylint: disable=g-import-not-at-top
  return jax.make_array_from_callback(value.shape, sharding,
                                      lambda i: value[i])


def saved_state(mesh) -> dict:
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  flat = {path: _global_array(truth(path), NamedSharding(mesh, spec["save"]))
          for path, spec in saved_leaves().items()}
  flat["opt/count"] = np.int32(3)
  flat["step"] = STEP_VALUE
  return nest(flat)


def stacked_target(layout: str, mesh) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top

  def sds(shape, dtype, spec):
    return jax.ShapeDtypeStruct(shape, dtype,
                                sharding=NamedSharding(mesh, spec))

  flat = {f"params/layers/{leaf}": sds((LAYERS, *s["shape"]), s["dtype"],
                                       s["stacked"][layout])
          for leaf, s in LAYER_LEAVES.items()}
  emb = OTHER_LEAVES["params/embed/table"]
  flat["params/embedding/table"] = sds(emb["shape"], emb["dtype"],
                                       EMBEDDING_SPEC[layout])
  flat["params/norm/scale"] = sds(NORM["shape"], NORM["dtype"],
                                  NORM["target"][layout])
  flat["step"] = 0
  return nest(flat)


def per_layer_target(layout: str, mesh) -> dict:
  """The saved model's params on this layout (layer i gets the spec of the
  stacked leaf without its layer axis)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  flat = {}
  for i in range(LAYERS):
    for leaf, s in LAYER_LEAVES.items():
      spec = P(*tuple(s["stacked"][layout])[1:])
      flat[f"params/layers_{i}/{leaf}"] = jax.ShapeDtypeStruct(
          s["shape"], s["dtype"], sharding=NamedSharding(mesh, spec))
  emb = OTHER_LEAVES["params/embed/table"]
  flat["params/embed/table"] = jax.ShapeDtypeStruct(
      emb["shape"], emb["dtype"],
      sharding=NamedSharding(mesh, EMBEDDING_SPEC[layout]))
  flat["params/norm/scale"] = jax.ShapeDtypeStruct(
      NORM["shape"], NORM["dtype"],
      sharding=NamedSharding(mesh, NORM["target"][layout]))
  return nest(flat)


def fallback_state(layout: str, mesh) -> dict:
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  scale = _global_array(truth("params/norm/scale"),
                        NamedSharding(mesh, NORM["fallback"][layout]))
  return {"params": {"norm": {"scale": scale}}}


def check(restored: Any, target: Any) -> tuple[list[str], list[str]]:
  """(mismatches, leaves checked): every addressable shard vs the truth."""
  import jax  # pylint: disable=g-import-not-at-top
  from ckpt.format import tree  # pylint: disable=g-import-not-at-top
  if jax.tree.structure(restored) != jax.tree.structure(target):
    return [f"structure {jax.tree.structure(restored)} != "
            f"{jax.tree.structure(target)}"], []
  got = {tree.path_str(p): x for p, x in tree.flatten(restored)}
  bad, checked = [], []
  for parts, want in tree.flatten(target):
    path = tree.path_str(parts)
    x = got[path]
    checked.append(path)
    if path == "step":
      if x != STEP_VALUE:
        bad.append(f"step: got {x!r}")
      continue
    t = truth(path)
    if not isinstance(x, jax.Array):
      bad.append(f"{path}: got a {type(x).__name__}, want a jax.Array")
      continue
    if (x.shape, x.dtype) != (t.shape, t.dtype):
      bad.append(f"{path}: got {x.shape} {x.dtype}, want {t.shape} {t.dtype}")
      continue
    if not x.sharding.is_equivalent_to(want.sharding, x.ndim):
      bad.append(f"{path}: sharding {x.sharding} is not {want.sharding}")
    if len(x.addressable_shards) != jax.local_device_count():
      bad.append(f"{path}: {len(x.addressable_shards)} addressable shards")
    for s in x.addressable_shards:
      if not same_bits(np.asarray(s.data), t[s.index]):
        bad.append(f"{path}: shard {s.index} on {s.device} differs")
  return bad, checked


def held_layers(sharding, shape) -> list[int]:
  """The layers (indices of axis 0) this process's devices hold."""
  held = set()
  for index in sharding.addressable_devices_indices_map(shape).values():
    start, stop, _ = index[0].indices(shape[0])
    held.update(range(start, stop))
  return sorted(held)


def _recorder(flags: list):
  def record(ckpt_tree, target_tree, *, is_resuming):
    del target_tree
    flags.append(is_resuming)
    return ckpt_tree
  return record


def _transforms(layout: str, flags: list) -> list:
  """4 x 2: rename + stack_layers; 1 x 8: stack_layers + assignment_map."""
  from ckpt.restore import transforms as T  # pylint: disable=g-import-not-at-top
  if layout == "4x2":
    return [_recorder(flags),
            T.rename(r"params/embed/(.*)", r"params/embedding/\1"),
            T.stack_layers(r"layers_(\d+)", "layers")]
  return [_recorder(flags), T.stack_layers(),
          T.assignment_map([(r"params/embedding/(.*)", r"params/embed/\1"),
                            (r"params/norm/.*", None)])]


@dataclasses.dataclass(frozen=True)
class Checked:
  """A restore checked leaf by leaf against the truth."""
  mismatches: list[str]
  checked: list[str]        # the leaves checked
  is_resuming: list[bool]   # what the transforms were told


@dataclasses.dataclass(frozen=True)
class Copy(Checked):
  """From this process's copy without the arrays it does not need."""
  deleted: list[str]
  held: dict[str, list[int]]   # the layers this process holds, by leaf


@dataclasses.dataclass(frozen=True)
class Lazy:
  mismatches: list[str]
  checked: list[str]
  lazy_leaves: list[str]
  not_lazy: list[str]


@dataclasses.dataclass(frozen=True)
class Corrupt:
  deleted: str       # the layer this process needs, deleted
  restore: Outcome   # then restored


@dataclasses.dataclass(frozen=True)
class Resave:
  steps: list[int]


@dataclasses.dataclass(frozen=True)
class Saved:
  process: int
  layout: str
  steps: list[int]


@dataclasses.dataclass(frozen=True)
class Restored:
  process: int
  layout: str
  own: Checked
  copy: Copy
  lazy: Lazy
  corrupt: Corrupt
  resave: Resave | None     # with config["resave"]
  unstack: Checked | None   # with config["unstack"]


def _save(config: dict) -> dict:
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.restore import transforms as T  # pylint: disable=g-import-not-at-top
  state = saved_state(_mesh("2x4"))
  with ckpt.Checkpointer(config["dir"], async_save=False) as ckptr:
    ckptr.save(1, state)
  with ckpt.Checkpointer(config["dir_xf"], async_save=False) as ckptr:
    ckptr.save(1, state, transforms=[
        T.drop(r"opt/.*"),
        T.rename(r"params/embed/(.*)", r"params/embedding/\1")])
    steps = ckptr.all_steps()
  return {"steps": steps}


def _restore(config: dict, layout: str, mesh) -> dict:
  import asyncio  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.restore import transforms as T  # pylint: disable=g-import-not-at-top
  from ckpt.format import tree  # pylint: disable=g-import-not-at-top
  pid = jax.process_index()
  target = stacked_target(layout, mesh)
  fallback = fallback_state(layout, mesh)
  out: dict[str, Any] = {"resave": None, "unstack": None}

  # own: the Checkpointer's own latest step.
  ckptr = ckpt.Checkpointer(config["dir"], async_save=False)
  flags: list = []
  restored = ckptr.restore(target=target, transforms=_transforms(layout, flags),
                           fallback_state=fallback)
  bad, checked = check(restored, target)
  out["own"] = Checked(bad, checked, flags)

  # copy: a private copy without any array this process does not need.
  mine = os.path.join(config["scratch"], f"process_{pid}")
  shutil.copytree(os.path.join(config["dir"], "checkpoint_1"), mine)
  deleted, held = [], {}
  for name in ("opt", "params/head"):
    shutil.rmtree(os.path.join(mine, name))
    deleted.append(name)
  for leaf, s in LAYER_LEAVES.items():
    t = tree_get(target, ("params", "layers", *leaf.split("/")))
    held[leaf] = held_layers(t.sharding, t.shape)
    for i in range(LAYERS):
      if i not in held[leaf]:
        shutil.rmtree(os.path.join(mine, "params", f"layers_{i}", leaf))
        deleted.append(f"params/layers_{i}/{leaf}")
  flags = []
  try:
    restored_copy = ckptr.restore(path=mine, target=target,
                                  transforms=_transforms(layout, flags),
                                  fallback_state=fallback)
    bad, checked = check(restored_copy, target)
  except ckpt.CheckpointError as e:  # it read an array it does not need
    bad, checked = [f"restore failed: {type(e).__name__}: {e}"[:1000]], []
  out["copy"] = Copy(bad, checked, flags, deleted, held)

  # lazy: bound to the target's shardings, read with read_async.
  lazy_tree = ckptr.restore(target=target, transforms=_transforms(layout, []),
                            fallback_state=fallback, lazy=True)
  pairs = [(parts, x) for parts, x in tree.flatten(lazy_tree)
           if isinstance(x, ckpt.LazyLeaf)]
  wrong = [f"{tree.path_str(p)}: sharding {x.sharding}" for p, x in pairs
           if x.sharding != tree_get(target, p).sharding]

  async def read_all():
    return await asyncio.gather(*(x.read_async() for _, x in pairs))

  arrays = asyncio.run(read_all())
  flat_read = {tree.path_str(p): x for p, x in tree.flatten(lazy_tree)}
  flat_read.update((tree.path_str(p), a) for (p, _), a in zip(pairs, arrays))
  eager = sorted(n for n, x in flat_read.items() if n != "step" and not any(
      n == tree.path_str(p) for p, _ in pairs))
  bad, checked = check(nest(flat_read), target)
  out["lazy"] = Lazy(wrong + bad, checked,
                    sorted(tree.path_str(p) for p, _ in pairs), eager)

  # corrupt: a layer this process needs is gone from its own copy; every
  # process raises the same error, naming each process's missing layer.
  leaf = "attn/w"
  gone = f"params/layers_{held[leaf][0]}/{leaf}"
  shutil.rmtree(os.path.join(mine, *gone.split("/")))
  out["corrupt"] = Corrupt(gone, worker.timed(
      lambda: ckptr.restore(
          path=mine, transforms=[T.stack_layers()],
          target={"params": {"layers": {"attn": {"w": tree_get(
              target, ("params", "layers", "attn", "w"))}}}}) and None))

  if config.get("resave"):
    # The stacked state, saved from this layout: a checkpoint written by all
    # processes of this job, in the new layout.
    with ckpt.Checkpointer(config["dir2"], async_save=False) as c2:
      c2.save(2, restored)
      out["resave"] = Resave(c2.all_steps())

  if config.get("unstack"):
    # Back to one subtree per layer, from the stacked checkpoint.
    target2 = per_layer_target(layout, mesh)
    flags = []
    with ckpt.Checkpointer(config["dir2"]) as c2:
      back = c2.restore(target=target2, transforms=[
          _recorder(flags), T.unstack_layers("layers", "layers_{}"),
          T.rename(r"params/embedding/(.*)", r"params/embed/\1")])
    bad, checked = check(back, target2)
    out["unstack"] = Checked(bad, checked, flags)
  ckptr.close()
  return out


def tree_get(t, parts):
  for p in parts:
    t = t[p]
  return t


def run(config: dict) -> Saved | Restored:
  # These tests delete leaves' array directories (to show they are never
  # read): every leaf is an array, none packed (tests/save/test_pack.py).
  from ckpt.save import pack  # pylint: disable=g-import-not-at-top
  pack.MAX_LEAF_BYTES = 0
  layout = _layout()
  if config["op"] == "save":
    result, fields = Saved, _save(config)
  elif config["op"] == "restore":
    result, fields = Restored, _restore(config, layout, _mesh(layout))
  else:
    raise ValueError(f"unknown op {config['op']!r}")
  import jax  # pylint: disable=g-import-not-at-top
  return result(process=jax.process_index(), layout=layout, **fields)


if __name__ == "__main__":
  worker.main(run)
