"""Stage 2 of a save, the plan: each leaf's kind (stored inline in the index, packed, or an
array), the dtype it is stored in (refusing, with the leaf's name, what cannot be stored), the
sharding the index records for it, and the boxes this process writes (ckpt/shards/plan.py).
Pure: it runs on the caller's thread and reads no bytes but those of inline leaves.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ckpt.save import leafsource
from ckpt.multihost import process as multihost
from ckpt.shards import merge_groups
from ckpt.save import pack as pack_lib
from ckpt.save import staging
from ckpt.shards import placement as placement_lib
from ckpt.shards import plan as plan_lib
from ckpt.format import prng
from ckpt.format import tree
from ckpt.format import tsspec
from ckpt.errors import CorruptCheckpointError, InvalidStateError
from ckpt.format import checks
from ckpt.format import entries
from ckpt.format import inline_values
from ckpt.format import pack_index
from ckpt.format import saved_sharding

INLINE_MAX_BYTES = 256


@dataclasses.dataclass(frozen=True)
class SaveOptions:
  storage_format: str = "zarr"
  codec: tsspec.Codec = tsspec.Codec()
  chunk_bytes: int = plan_lib.DEFAULT_CHUNK_BYTES
  save_dtype: Any = None
  inline_max_bytes: int = INLINE_MAX_BYTES
  # The byte budget: chunks and write items are cut to fit in it.
  max_item_bytes: int = 1 << 30


@dataclasses.dataclass
class LeafPlan:
  parts: tree.PathParts
  source: Any                       # the user's array (dropped after staging)
  entry: entries.Entry
  layout: plan_lib.LeafLayout | None = None

  @property
  def packed(self) -> bool:
    """Stored in this step's packs (ckpt/save/pack.py), not as an array."""
    return isinstance(self.entry, pack_index.PackedEntry)

  @property
  def host_replicated(self) -> bool:
    """A host numpy leaf saved with no partitioner sharding: one value for
    the whole job, whose chunks each process writes from its own copy (so
    every process must hold the same value; ckpt/multihost/agreement.py checks)."""
    return (isinstance(self.source, np.ndarray)
            and isinstance(self.entry, (entries.ArrayEntry,
                                        pack_index.PackedEntry))
            and self.entry.sharding == saved_sharding.HOST_REPLICATED)


@dataclasses.dataclass
class SavePlan:
  structure: Any
  leaves: list[LeafPlan]
  writes: list[plan_lib.Write]      # this process's writes, nobody else's
  options: SaveOptions
  # The caller waits until the save is committed (async_save=False): its
  # arrays may be written from directly, with no staging copy.
  borrow: bool = False
  # What is worked out from the layout alone (the writes, the array
  # entries), once: shared by every plan a PlanCache replays from this one.
  memo: dict = dataclasses.field(default_factory=dict, compare=False,
                                 repr=False)

  def agreed_leaves(self) -> list[LeafPlan]:
    """The leaves whose values every process must hold alike
    (``agreement.host_values``): values stored in the index and host numpy
    leaves saved once for the job. Which they are depends on the layout
    only: worked out once (``memo``)."""
    got = self.memo.get("agreed")
    if got is None:
      got = self.memo["agreed"] = [
          i for i, lp in enumerate(self.leaves)
          if isinstance(lp.entry, entries.ValueEntry) or lp.host_replicated]
    return [self.leaves[i] for i in got]


def _stored_dtype(dtype: np.dtype, save_dtype) -> np.dtype:
  if save_dtype is not None and jnp.issubdtype(dtype, jnp.floating):
    return np.dtype(save_dtype)
  return np.dtype(dtype)


def _describe_sharding(x: Any, sharding) -> str:
  if sharding is None:
    return saved_sharding.HOST_REPLICATED
  try:
    return _describe(sharding)
  except TypeError:  # not hashable
    return type(sharding).__name__


@functools.lru_cache(maxsize=1024)
def _describe(sharding) -> str:
  if isinstance(sharding, jax.sharding.NamedSharding):
    axes = dict(sharding.mesh.shape)  # a Mesh's or an AbstractMesh's
    return f"NamedSharding(mesh={axes}, spec={tuple(sharding.spec)})"
  return type(sharding).__name__


def _saved_sharding(sharding, rank: int) -> saved_sharding.SavedSharding | None:
  """The sharding a leaf of ``rank`` dimensions is saved in, as the index
  records it (a mesh's axis names, sizes and types and a PartitionSpec; a
  single device), or None when it cannot be recorded: a sharding that is
  not a NamedSharding or SingleDeviceSharding, axis names that are not
  strings, a spec with UNCONSTRAINED or unreduced axes, or beyond what
  index.decode_saved_sharding accepts (then a restore asks for a target
  sharding, naming the leaf)."""
  if sharding is None:
    return None
  try:
    return _record(sharding, rank)
  except TypeError:  # not hashable
    return None


@functools.lru_cache(maxsize=1024)
def _record(sharding, rank: int) -> saved_sharding.SavedSharding | None:
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    doc = {"mesh_axes": [], "mesh_shape": [], "spec": []}
  elif (isinstance(sharding, jax.sharding.NamedSharding) and
        isinstance(sharding.mesh, (jax.sharding.Mesh,
                                   jax.sharding.AbstractMesh))):
    # An AbstractMesh: an imported Orbax leaf's saved mesh (ckpt/save/leafsource.py)
    mesh, spec = sharding.mesh, sharding.spec
    if getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
      return None
    parts = []
    for p in spec:
      if p is None or isinstance(p, str):
        parts.append(p)
      elif isinstance(p, tuple) and all(isinstance(a, str) for a in p):
        parts.append(list(p))
      else:  # PartitionSpec.UNCONSTRAINED, or a name that is not a str
        return None
    types = [getattr(t, "name", str(t)).lower()
             for t in getattr(mesh, "axis_types", ())]
    doc = {"mesh_axes": list(mesh.axis_names),
           "mesh_shape": [int(n) for n in dict(mesh.shape).values()],
           "spec": parts,
           "axis_types": types}
  else:
    return None
  try:
    return checks.decode_saved_sharding(doc, "", rank)
  except CorruptCheckpointError:  # readers would refuse it: not recorded
    return None


def plan_save(state: Any, options: SaveOptions, partitioner=None, *,
              process_count: int | None = None,
              process: int | None = None) -> SavePlan:
  """Stages 1 and 2: flatten the state and decide what this process writes
  (from its own shards only: ckpt/shards/placement.py, ckpt/shards/plan.py)."""
  return plan_leaves(tree.encode_structure(state), tree.flatten(state),
                     options, partitioner, process_count=process_count,
                     process=process)


def plan_leaves(structure: Any, flat: list, options: SaveOptions,
                partitioner=None, *, process_count: int | None = None,
                process: int | None = None) -> SavePlan:
  """``plan_save`` of an already flattened state: ``[(parts, leaf)]``."""
  process_count = process_count or multihost.process_count()
  process = multihost.process_index() if process is None else process
  leaves: list[LeafPlan] = []
  layouts: list[plan_lib.LeafLayout] = []
  layout_leaf: list[int] = []
  # jax.Array leaves of one (type, shape, dtype, sharding) are planned alike
  # (all but their path): the first of each group is planned in full, the
  # others copy its entry's fields (10,000 small leaves of a few layouts
  # spent most of a first save planning each alone).
  groups: dict[tuple, tuple | None] = {}
  for parts, x in flat:
    group = key = None
    if staging.is_array(x):
      try:
        key = (type(x), x.shape, x.dtype, x.sharding)
        group = groups.get(key)
      except TypeError:  # an unhashable sharding: planned alone
        key = None
      if group is not None:
        entry = group[0](path=parts, **group[1])
        layout_leaf.append(len(leaves))
        layouts.append(group[2])
        leaves.append(LeafPlan(parts, x, entry, group[2]))
        continue
    name = tree.path_str(parts)
    value = inline_leaf(parts, x, options)
    if value is not None:
      leaves.append(value)
      continue
    impl = ""
    if staging.is_array(x):
      if is_key(x.dtype):  # planned alone (its key data is a new array)
        key = None
      # Recorded over the keys' dimensions for a key leaf.
      saved = _saved_sharding(x.sharding, x.ndim)
      if is_key(x.dtype):  # stored as its key data (ckpt/format/prng.py)
        impl, x = key_data(name, x)
      stored = leaf_dtype(name, x.dtype, options.save_dtype)
      where = placement_lib.placement(x.sharding, x.shape, process)
      sharding_text = _describe_sharding(x, x.sharding)
    elif isinstance(x, np.ndarray):
      stored = leaf_dtype(name, x.dtype, options.save_dtype)
      sharding = partitioner(name, x.shape) if partitioner else None
      if sharding is None:
        where = placement_lib.host_replicated(x.shape, process, process_count)
      else:
        where = placement_lib.placement(sharding, x.shape, process)
      sharding_text = _describe_sharding(x, sharding)
      saved = _saved_sharding(sharding, x.ndim)
    else:  # a LeafSource (inline_leaf rejected anything else)
      impl = x.prng_impl
      stored = leaf_dtype(name, x.dtype, options.save_dtype)
      where = x.placement(process, process_count)
      sharding_text = _describe_sharding(x, x.sharding)
      saved = _saved_sharding(x.sharding, len(x.shape))
    layout = plan_lib.leaf_layout(x.shape, stored.itemsize, where,
                                  min(options.chunk_bytes, options.max_item_bytes))
    if pack_lib.packable(
        math.prod(layout.shape) * stored.itemsize):
      kind, fields = pack_index.PackedEntry, dict(
          shape=layout.shape, dtype=dtype_name(stored),
          source_dtype=dtype_name(x.dtype), sharding=sharding_text,
          prng_impl=impl, saved_sharding=saved)
    else:
      kind, fields = entries.ArrayEntry, dict(
          shape=layout.shape, dtype=dtype_name(stored), chunks=layout.chunks,
          codec=options.codec.to_json(), source_dtype=dtype_name(x.dtype),
          sharding=sharding_text, prng_impl=impl, saved_sharding=saved)
    if kind is entries.ArrayEntry:  # (its relpath and codec are its own)
      fields["relpath"] = tree.storage_relpath(parts)
    elif key is not None:
      groups[key] = (kind, fields, layout)
    layout_leaf.append(len(leaves))
    layouts.append(layout)
    leaves.append(LeafPlan(parts, x, kind(path=parts, **fields), layout))
  writes = plan_lib.assign_writes(layouts, process, options.max_item_bytes,
                                  leaves=layout_leaf)
  if options.storage_format == "ocdbt":
    _assign_ocdbt_groups(leaves, process_count)
  return SavePlan(structure, leaves, writes, options)


def inline_leaf(parts: tree.PathParts, x: Any, options: SaveOptions
                ) -> LeafPlan | None:
  """The plan of a leaf stored in the index itself (a scalar, str, bytes,
  or an array of at most ``options.inline_max_bytes`` that every process
  holds whole), its value read now; None for a leaf stored as an array.
  InvalidStateError naming the leaf for what cannot be stored."""
  name = tree.path_str(parts)
  if staging.is_array(x):
    if not (x.is_fully_replicated and x.nbytes <= options.inline_max_bytes):
      return None
    impl = ""
    saved = _saved_sharding(x.sharding, x.ndim)
    if is_key(x.dtype):  # stored as its key data (ckpt/format/prng.py)
      impl, x = key_data(name, x)
    stored = leaf_dtype(name, x.dtype, options.save_dtype)
    if x.is_deleted():  # jax's own error would name no leaf (staging's,
      raise InvalidStateError(  # for the others, names it)
          f"leaf {name!r}: expected a live jax.Array, found one that has "
          "been deleted (donated to a jitted call, or .delete()d) before "
          "save(); save the state before donating it")
    value = np.asarray(x).astype(stored)
    return LeafPlan(parts, None, entries.ValueEntry(
        parts, value, impl, saved_sharding=saved))
  if isinstance(x, np.ndarray):
    if x.nbytes > options.inline_max_bytes:
      return None
    stored = leaf_dtype(name, x.dtype, options.save_dtype)
    return LeafPlan(parts, None, entries.ValueEntry(parts, x.astype(stored),
                                                      host=True))
  if isinstance(x, leafsource.LeafSource):  # ckpt import: read per box
    if not (x.inline_ok and x.nbytes <= options.inline_max_bytes):
      return None
    stored = leaf_dtype(name, x.dtype, options.save_dtype)
    return LeafPlan(parts, None, entries.ValueEntry(
        parts, x.read_all().astype(stored), x.prng_impl))
  if isinstance(x, (bool, int, float, str, bytes, np.generic)):
    value = x
    if isinstance(x, np.generic):
      stored = leaf_dtype(name, x.dtype, options.save_dtype, inline=True)
      value = np.asarray(x).astype(stored)[()]
    # rejects what cannot be stored, now
    inline_values.encode_value(value, parts)
    return LeafPlan(parts, None, entries.ValueEntry(parts, value))
  raise InvalidStateError(
      f"leaf {name!r} is a {type(x).__module__}.{type(x).__qualname__}; "
      "expected a jax.Array, numpy array, scalar, str, bytes or None. "
      "Register custom containers as pytree nodes.")


def _assign_ocdbt_groups(leaves: list[LeafPlan], process_count: int) -> None:
  """Format "ocdbt": the merge group of each array (ckpt/store/ocdbt.py), from
  its chunk count, the same on every process; none for a step that one
  merge handles."""
  arrays = [lp for lp in leaves if lp.layout is not None and not lp.packed]
  keys = [1 + math.prod(-(-n // c) for n, c in zip(lp.entry.shape,
                                                    lp.entry.chunks))
          for lp in arrays]
  for lp, g in zip(arrays, merge_groups.assign_groups(keys, process_count)):
    if g is not None:
      lp.entry = dataclasses.replace(lp.entry, ocdbt_group=g)


def _check_dtype(name: str, dtype: np.dtype) -> None:
  if dtype.name not in checks.ALLOWED_DTYPES:
    raise InvalidStateError(
        f"leaf {name!r} has dtype {dtype}, which ckpt cannot store; expected "
        f"one of {sorted(checks.ALLOWED_DTYPES)}")


# (dtype, save_dtype, inline) -> the stored dtype, once checked: planning
# 10,000 leaves asked numpy the same few questions 10,000 times (a dtype's
# ``name`` alone is a Python property of several us).
_STORED: dict[tuple, np.dtype] = {}
_NAMES: dict[Any, str] = {}


_KEYS: dict[Any, bool] = {}


def is_key(dtype: Any) -> bool:
  """``prng.is_key_dtype``, remembered per dtype."""
  try:
    got = _KEYS.get(dtype)
  except TypeError:  # an unhashable dtype: asked every time
    return prng.is_key_dtype(dtype)
  if got is None:
    got = _KEYS[dtype] = prng.is_key_dtype(dtype)
  return got


def dtype_name(dtype: Any) -> str:
  """``np.dtype(dtype).name``, remembered per dtype."""
  got = _NAMES.get(dtype)
  if got is None:
    got = _NAMES[dtype] = np.dtype(dtype).name
  return got


def leaf_dtype(name: str, dtype: Any, save_dtype, *,
                inline: bool = False) -> np.dtype:
  """The dtype a leaf is stored in; InvalidStateError naming the leaf if
  it has none (a jax extended dtype, or one numpy does not know). Inline
  scalars are checked by inline_values.encode_value instead. A dtype that
  passed is remembered (``_STORED``); one that fails is checked anew."""
  try:
    key = (dtype, save_dtype, inline)
    got = _STORED.get(key)
  except TypeError:  # an unhashable save_dtype: never remembered
    key, got = None, None
  if got is not None:
    return got
  got = _leaf_dtype(name, dtype, save_dtype, inline)
  if key is not None:
    _STORED[key] = got
  return got


def _leaf_dtype(name: str, dtype: Any, save_dtype, inline: bool) -> np.dtype:
  if prng.is_extended_dtype(dtype):
    raise InvalidStateError(
        f"leaf {name!r} has the jax extended dtype {dtype}, which ckpt cannot "
        "store; expected a numpy dtype or a typed PRNG key "
        f"(jax.random.key), or one of {sorted(checks.ALLOWED_DTYPES)}")
  try:
    stored = _stored_dtype(dtype, save_dtype)
  except TypeError as e:
    raise InvalidStateError(
        f"leaf {name!r} has dtype {dtype}, which ckpt cannot store (no numpy "
        f"dtype: {e}); expected one of {sorted(checks.ALLOWED_DTYPES)}"
    ) from e
  if not inline:
    _check_dtype(name, stored)
  return stored


def key_data(name: str, x: jax.Array) -> tuple[str, jax.Array]:
  """(implementation name, key data) of a typed PRNG key array; the data is
  the keys' own buffers (no copy), sharded like the keys."""
  try:
    impl = prng.impl_name(x)
  except (TypeError, ValueError) as e:
    raise InvalidStateError(
        f"leaf {name!r}: cannot tell the PRNG implementation of its keys "
        f"(dtype {x.dtype}): {e}") from e
  if prng.info(impl) is None:
    raise InvalidStateError(
        f"leaf {name!r} holds PRNG keys of implementation {impl!r} (dtype "
        f"{x.dtype}), which jax.random.key(..., impl=name) does not know, so "
        "they could not be restored; expected a registered implementation "
        "such as 'threefry2x32' or 'rbg'")
  return impl, jax.random.key_data(x)
