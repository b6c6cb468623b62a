"""Matching a restore's target: what each target leaf asks for
(``target_spec``: shape, dtype, sharding), a saved leaf checked against it
and the dtype to read it in (``out_dtype``: keys against keys, the same
shape, only floating casts), target shardings on an abstract mesh put on
this job's devices (``concrete_sharding``, ``concrete_target``) and the
saved shardings of targets given without one (``AsSaved``). Used by the
restore (ckpt/restore/read.py) and the local tier alike, so both refuse
alike.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
from jax import tree_util

from ckpt.restore import assemble
from ckpt.format import index as index_lib
from ckpt.restore import lazy
from ckpt.format import prng
from ckpt.format import saved_sharding as saved_sharding_lib
from ckpt.format import tree
from ckpt.errors import TreeMismatchError
from ckpt.restore.keyshape import logical_shape


def _out_dtype(name: str, saved: np.dtype, wanted: np.dtype | None,
               restore_dtype) -> np.dtype:
  if restore_dtype is not None and assemble.is_floating(saved):
    return np.dtype(restore_dtype)
  if wanted is None or wanted == saved:
    return saved
  if assemble.is_floating(saved) and assemble.is_floating(wanted):
    return wanted
  raise TreeMismatchError(
      f"leaf {name!r}: the checkpoint has dtype {saved}, the target wants "
      f"{wanted}; only floating dtypes are cast on restore (pass a target "
      "with the saved dtype, or convert afterwards)")


def target_spec(x: Any, name: str = "<target>"):
  """(shape, dtype, sharding, wants_array) of one target leaf; the dtype of
  a typed PRNG key target is its key dtype (numpy has none)."""
  if isinstance(x, (jax.ShapeDtypeStruct, jax.Array)):
    sharding = concrete_sharding(name, x.sharding)
    if prng.is_key_dtype(x.dtype):
      return tuple(x.shape), x.dtype, sharding, True
    try:
      dtype = np.dtype(x.dtype)
    except TypeError as e:
      raise TreeMismatchError(
          f"leaf {name!r}: the target has dtype {x.dtype}, which ckpt cannot "
          "restore into; expected a numpy dtype or a typed PRNG key dtype"
      ) from e
    check_divides(name, tuple(x.shape), sharding)
    return tuple(x.shape), dtype, sharding, True
  if isinstance(x, np.ndarray):
    return tuple(x.shape), np.dtype(x.dtype), None, True
  return None, None, None, False


_HOW = ("pass a target leaf with a sharding (jax.ShapeDtypeStruct(shape, "
        "dtype, sharding=...)), e.g. a target from ckpt.abstract_target("
        "ckptr.metadata(step), mesh, rules); or a numpy array target leaf "
        "for host numpy")


class AsSaved:
  """The shardings of target leaves that are ``jax.ShapeDtypeStruct``s
  without one (what ``jax.eval_shape`` gives): each leaf is restored in the
  sharding it was saved in, built on this job's devices (``jax.devices()``,
  the same on every process, so every process decides alike, from the
  index), once per distinct saved sharding of a restore.

  Saved on a mesh (a stored leaf, or a small replicated jax.Array kept
  inline): that mesh (the same axis names, sizes and types; as many devices
  as it had) and its PartitionSpec. Saved on one device: this process's
  first device.
  Saved from host numpy without a partitioner (the index says so: the
  ``sharding`` text ``HOST_REPLICATED`` of a stored leaf, ``host`` of an
  inline one): no sharding, so it comes back as numpy, as saved (what
  Orbax returns for a numpy leaf).
  No mesh otherwise (a value given in memory by fallback_state or a
  transform, an inline value of an index that did not record its kind):
  replicated over all devices, on the checkpoint's mesh when its leaves
  were saved on one mesh (so a jitted step can take it with them: jax
  refuses arguments on different meshes of Explicit axes), else on a 1-D
  mesh of all devices; a fallback ``jax.Array`` keeps its own sharding.
  Anything else (no mesh recorded, a mesh this job cannot build, a leaf a
  transform derived) raises TreeMismatchError naming the leaf: never
  silent numpy."""

  def __init__(self, index: index_lib.Index):
    self._index = index
    self._built: dict[saved_sharding_lib.SavedSharding, Any] = {}
    self._replicated = None

  def sharding(self, name: str, src: Any) -> Any:
    """The sharding leaf ``name`` (``src``) is restored in; None: as host
    numpy (it was saved from host numpy)."""
    if isinstance(src, jax.Array):  # a fallback array: where it is
      return src.sharding
    saved = getattr(src, "saved_sharding", None)
    if saved == saved_sharding_lib.REPLICATED_HOST:
      return None
    if saved is None:
      if not isinstance(src, (lazy.LazyValue, np.ndarray, np.generic)):
        raise TreeMismatchError(
            f"leaf {name!r}: the target is a jax.ShapeDtypeStruct without a "
            "sharding, so it would come back in its saved sharding, but a "
            f"restore transform made this leaf ({src!r}), which has none; "
            f"{_HOW}")
      saved = saved_sharding_lib.REPLICATED_INLINE  # a value given in memory
    if saved.kind == "replicated":
      return self._replicated_sharding()
    built = self._build(saved)
    if isinstance(built, Exception):
      raise TreeMismatchError(
          f"leaf {name!r}: the target is a jax.ShapeDtypeStruct without a "
          f"sharding, so it would come back in its saved sharding "
          f"({saved}), which cannot be built here: {built}; {_HOW}"
      ) from None
    return built

  def _build(self, saved: saved_sharding_lib.SavedSharding) -> Any:
    built = self._built.get(saved)
    if built is None:
      try:
        built = saved.to_sharding()
      except Exception as e:  # pylint: disable=broad-except
        built = e  # raised, naming the leaf, by every leaf that needs it
      self._built[saved] = built
    return built

  def _replicated_sharding(self) -> Any:
    if self._replicated is None:
      meshes = {}
      for e in self._index.leaves:
        s = e.saved_sharding
        if s is not None and s.kind == "mesh":
          meshes.setdefault((s.axis_names, s.axis_sizes, s.axis_types), s)
      one = next(iter(meshes.values())) if len(meshes) == 1 else None
      built = self._build(one) if one is not None else None
      self._replicated = (
          jax.sharding.NamedSharding(built.mesh, jax.sharding.PartitionSpec())
          if isinstance(built, jax.sharding.NamedSharding) else
          saved_sharding_lib.REPLICATED_INLINE.to_sharding())
    return self._replicated


def concrete_sharding(name: str, sharding: Any) -> Any:
  """A target sharding on an ``AbstractMesh`` (what ``jax.eval_shape`` of
  a function that places arrays on a ``jax.make_mesh`` mesh with Explicit
  axes gives) on this job's devices: ``jax.make_mesh`` of the same axis
  names, sizes and types, the mesh such a function builds. Other
  shardings as they are; TreeMismatchError naming the leaf when this job
  has another number of devices."""
  mesh = getattr(sharding, "mesh", None)
  if not isinstance(mesh, jax.sharding.AbstractMesh):
    return sharding
  # The mesh make_mesh builds, as for a saved mesh of those axes.
  as_saved = saved_sharding_lib.SavedSharding(
      "mesh", tuple(mesh.axis_names), tuple(mesh.axis_sizes), sharding.spec,
      tuple(t.name.lower() for t in mesh.axis_types))
  try:
    return as_saved.to_sharding()
  except ValueError as e:
    raise TreeMismatchError(
        f"leaf {name!r}: the target's sharding is on an abstract mesh "
        f"{dict(mesh.shape)}, which ckpt builds on this job's devices with "
        f"jax.make_mesh: {e}; pass a target with a concrete sharding"
    ) from None


def concrete_target(target: Any) -> Any:
  """``target`` with every ShapeDtypeStruct on an abstract mesh put on this
  job's devices (``concrete_sharding``), for code that reads target
  shardings itself (the multi-tier checkpointer's local tier)."""
  def leaf(path, x):
    if (isinstance(x, jax.ShapeDtypeStruct) and
        isinstance(getattr(x.sharding, "mesh", None),
                   jax.sharding.AbstractMesh)):
      name = tree.path_str(tuple(tree.key_name(k) for k in path))
      return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                  sharding=concrete_sharding(name, x.sharding))
    return x
  return tree_util.tree_map_with_path(leaf, target)


def check_divides(name: str, shape: tuple, sharding: Any) -> None:
  """A target sharding must split each dimension evenly (jax's own error,
  IndivisibleError, names no leaf)."""
  if sharding is None:
    return
  try:
    sharding.shard_shape(shape)
  except ValueError as e:
    spec = getattr(sharding, "spec", sharding)
    mesh = getattr(getattr(sharding, "mesh", None), "shape", None)
    m = re.search(r"axis (\d+) is partitioned (\d+) times", str(e))
    found = (f"dimension {m[1]} has size {shape[int(m[1])]}, split over "
             f"{m[2]} devices" if m else str(e)[:300])
    raise TreeMismatchError(
        f"leaf {name!r}: the target's sharding {spec}"
        f"{f' over the mesh {dict(mesh)}' if mesh else ''} does not divide "
        f"its shape {shape}: expected each sharded dimension to be a multiple "
        f"of the devices it is split over, found {found}; give this leaf "
        "another PartitionSpec") from None


def _check_keys(name: str, src: lazy.LazyLeaf, impl: str, shape, wanted
                ) -> np.dtype:
  """A saved PRNG key leaf against its target leaf; the dtype to read its
  key data in (as stored: key data is never cast)."""
  key = prng.info(impl)
  if key is None:
    raise TreeMismatchError(
        f"leaf {name!r}: holds PRNG keys of implementation {impl!r}, which "
        "this jax does not know")
  logical = logical_shape(src)
  if wanted is not None and wanted != key.dtype:
    raise TreeMismatchError(
        f"leaf {name!r}: the checkpoint has {prng.describe(key.dtype)}, the "
        f"target wants {prng.describe(wanted)}; restore keys into a target "
        "of the same implementation (or drop the leaf and give it in "
        "fallback_state)")
  if shape is not None and logical != shape:
    raise TreeMismatchError(
        f"leaf {name!r}: the checkpoint has {impl} keys of shape {logical}, "
        f"the target wants {shape}")
  return np.dtype(src.dtype)


def out_dtype(name: str, src: Any, shape, wanted, wants_array: bool,
              restore_dtype) -> np.dtype:
  """A saved leaf (a LazyLeaf, or anything with its shape, dtype and
  ``prng_impl``) against its target leaf (``target_spec``): the dtype to
  read it in, or TreeMismatchError naming the leaf (keys against non-keys,
  another shape, a cast restore does not make). Also the local tier's
  check (ckpt/tiers/local_tier.py), so both tiers refuse alike."""
  impl = getattr(src, "prng_impl", None)
  if impl:
    return _check_keys(name, src, impl, shape, wanted)
  if wanted is not None and prng.is_key_dtype(wanted):
    raise TreeMismatchError(
        f"leaf {name!r}: the checkpoint has dtype {np.dtype(src.dtype)} "
        f"(not PRNG keys), the target wants {prng.describe(wanted)}")
  if wants_array and tuple(src.shape) != shape:
    raise TreeMismatchError(
        f"leaf {name!r}: the checkpoint has shape {tuple(src.shape)}, the "
        f"target wants {shape}")
  return _out_dtype(name, np.dtype(src.dtype), wanted, restore_dtype)
