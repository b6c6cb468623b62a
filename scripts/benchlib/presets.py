"""The benchmarks' states: presets (``configs/<name>.json``) made real.

A preset describes a random state: groups of leaves with a shape, a dtype
and a PartitionSpec over a save mesh, the mesh a second restore goes to, a
seed, scalars, and the options of each system. Every process and run builds
the same values from the seed (``np.random.default_rng``; never constant
data: constant arrays compress to nothing).
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import ml_dtypes  # noqa: F401  pylint: disable=unused-import  (bfloat16 names)
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


def preset_path(name_or_path: str) -> pathlib.Path:
  """``configs/<name>.json`` for a name, else the path itself."""
  path = pathlib.Path(name_or_path)
  return CONFIGS / f"{name_or_path}.json" if not path.suffix else path.resolve()


def load_preset(name_or_path: str) -> dict[str, Any]:
  """A preset by name (configs/<name>.json) or by path, with defaults."""
  path = preset_path(name_or_path)
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
  return sum(math.prod(s["shape"]) * np.dtype(s["dtype"]).itemsize
             for s in leaf_specs(preset))


def leaf_value(preset: dict[str, Any], i: int, spec: dict[str, Any]) -> np.ndarray:
  """The global value of leaf i: random, the same in every process and run."""
  rng = np.random.default_rng([preset["seed"], i])
  dtype = np.dtype(spec["dtype"])
  if np.issubdtype(dtype, np.integer):
    return rng.integers(0, 1 << 20, spec["shape"], dtype=dtype)
  return rng.standard_normal(spec["shape"], dtype=np.float32).astype(dtype)


def nest(flat: dict[str, Any]) -> dict[str, Any]:
  """{"a/b": x} -> {"a": {"b": x}}."""
  out: dict[str, Any] = {}
  for path, v in flat.items():
    *parents, last = path.split("/")
    node = out
    for p in parents:
      node = node.setdefault(p, {})
    node[last] = v
  return out


def flat_items(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
  """[("a/b", x), ...] of a nested dict, in insertion order."""
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
  """The preset's random state, sharded over the save mesh."""
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


def abstract_state(preset: dict[str, Any], mesh) -> dict[str, Any]:
  """The state's ShapeDtypeStructs sharded over ``mesh`` (a restore target)."""
  import jax  # pylint: disable=g-import-not-at-top
  flat = {s["path"]: jax.ShapeDtypeStruct(
      s["shape"], np.dtype(s["dtype"]),
      sharding=Topology.sharding(mesh, s["spec"])) for s in leaf_specs(preset)}
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
