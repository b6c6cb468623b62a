"""What a checkpoint holds, without its data (``Checkpointer.metadata``), and
a restore target built from it for any mesh (``abstract_target``).

Read from the index alone: array leaves become ``jax.ShapeDtypeStruct``s of
the saved shape and dtype (typed PRNG keys: their key dtype and shape),
inline scalars and python values come back as saved; each array leaf's
saved sharding is a ``SavedSharding`` (mesh axis names and sizes and a
PartitionSpec; ``.to_sharding(devices)`` builds it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax import tree_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ckpt.format import index as index_lib
from ckpt.format import prng
from ckpt.restore import transforms
from ckpt.format import tree
from ckpt.errors import CorruptCheckpointError, TreeMismatchError
from ckpt.shards.partition import MeshPartitioner
from ckpt.format.saved_sharding import HOST_REPLICATED, SavedSharding
from ckpt.format import entries
from ckpt.format import pack_index


@dataclasses.dataclass(frozen=True)
class Metadata:
  """One step's contents: ``tree`` is the saved tree (dicts, lists, tuples;
  custom nodes as dicts) with a ShapeDtypeStruct per array leaf and the
  inline values; the dicts are keyed by leaf path (``params/w``).

  ``shardings[path]`` is a ``SavedSharding``: ``.kind`` ("mesh", "device",
  "replicated" or "unknown"), ``.mesh_shape`` (``{"data": 2, "model":
  4}``), ``.spec`` (a PartitionSpec), ``.to_sharding(devices=None)`` (a
  NamedSharding on this job's devices) and a readable ``str()``.

  Fields: ``tree``, ``shardings``, ``step``, ``time`` (the save time, seconds
  since the epoch), ``metrics``, ``source_dtypes`` (the dtype of each leaf
  before ``save_dtype``), ``process_count`` (processes that saved it),
  ``storage_format`` ("zarr", "zarr3" or "ocdbt") and ``custom_metadata``
  (``save(..., custom_metadata=)``, ``{}`` when none). Returned by
  ``Checkpointer.metadata``; not built by hand, so it raises nothing and
  nothing about it is collective.
  """
  step: int
  time: float
  metrics: dict[str, Any]
  tree: Any
  shardings: dict[str, SavedSharding]  # by array leaf path
  source_dtypes: dict[str, str]  # the dtype before save_dtype cast it
  process_count: int
  storage_format: str
  # save(custom_metadata=...) of this step ({} if none was given).
  custom_metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


def _sds(shape, dtype, impl: str) -> jax.ShapeDtypeStruct:
  if impl:
    key = prng.info(impl)
    if key is None:
      raise CorruptCheckpointError(f"unknown PRNG implementation {impl!r}")
    return jax.ShapeDtypeStruct(tuple(shape)[:len(shape) - len(key.key_shape)],
                                key.dtype)
  return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))


def from_index(index: index_lib.Index) -> Metadata:
  """The Metadata of one decoded index (no data is read)."""
  leaves: dict[str, Any] = {}
  shardings: dict[str, SavedSharding] = {}
  source: dict[str, str] = {}
  for e in index.leaves:
    name = tree.path_str(e.path)
    if isinstance(e, (entries.ArrayEntry, pack_index.PackedEntry)):
      leaves[name] = _sds(e.shape, e.dtype, e.prng_impl)
      shardings[name] = index_lib.saved_sharding_of(e)
      source[name] = e.source_dtype
    elif isinstance(e.value, np.ndarray) or e.prng_impl:
      v = np.asarray(e.value)
      leaves[name] = _sds(v.shape, v.dtype, e.prng_impl)
      shardings[name] = index_lib.saved_sharding_of(e)
      source[name] = v.dtype.name
    else:
      leaves[name] = e.value  # python values and numpy scalars, as saved
  return Metadata(
      step=index.step, time=index.time, metrics=dict(index.metrics),
      # leaves holds one value per leaf, in the index's order
      tree=tree.decode_structure(index.structure,
                                 list(leaves.values()).__getitem__),
      shardings=shardings, source_dtypes=source,
      process_count=index.process_count, storage_format=index.storage_format,
      custom_metadata=index_lib.custom_metadata_of(index))


def abstract_target(metadata: Metadata | Any, mesh: Mesh,
                    rules: Sequence[tuple[str, PartitionSpec]] = (), *,
                    strict: bool = True) -> Any:
  """A restore target for ``mesh`` from ``metadata``, or from any tree of
  ``jax.ShapeDtypeStruct``s or arrays (its ``.tree``; ``nnx.state`` of
  ``nnx.eval_shape(create_model)``; ``jax.eval_shape(create_state)``).

  The target keeps the container types of the tree it is given: a flax
  ``nnx.State`` (its Variables too), a ``flax.struct`` or other dataclass,
  an optax state come back as such, so ``nnx.merge``/``nnx.update`` take
  the restored tree. ``Metadata.tree`` itself is plain dicts, lists and
  tuples (the index keeps no custom node types): give the model's
  abstract state to get its containers back.

  ``rules``: ``[(regex, PartitionSpec)]`` as ``ckpt.MeshPartitioner``; the
  first regex that fully matches a leaf path gives its spec. An array leaf
  no rule matches is replicated over ``mesh``, except host numpy leaves
  that were saved without a partitioner: they stay host numpy (their
  target leaf is a read-only numpy placeholder of the saved shape and
  dtype, ``np.broadcast_to`` of one zero: no memory; a ShapeDtypeStruct
  without a sharding would restore them as a replicated jax.Array). Inline
  values are kept as they are. A rule that matches no array leaf raises
  TreeMismatchError naming it (usually a typo that would leave the leaves
  it meant replicated), unless ``strict=False``.

  Args:
    metadata: ``Checkpointer.metadata(step)``, its ``.tree`` or any tree
      of ``jax.ShapeDtypeStruct``s / ``jax.Array``s (each array leaf gets
      its shape and dtype, and the sharding ``rules`` give; other leaves
      are kept as they are).
    mesh: the mesh of the restore.
    rules: ``[(regex, PartitionSpec)]``, first full match wins.
    strict: refuse a rule that matches no array leaf.

  Raises:
    TreeMismatchError: a rule that matches no leaf (with ``strict``), or a
      spec that does not fit its leaf (too many dimensions, a size the mesh
      axes do not divide), naming the leaf.

  Not collective (no I/O): every process builds the same target.
  """
  partition = MeshPartitioner(mesh, rules)
  used: set[int] = set()
  names: list[str] = []
  saved = metadata.shardings if isinstance(metadata, Metadata) else {}
  src = metadata.tree if isinstance(metadata, Metadata) else metadata

  def leaf(path, x):
    if not isinstance(x, (jax.ShapeDtypeStruct, jax.Array)):
      return x
    name = tree.path_str(tuple(tree.key_name(k) for k in path))
    names.append(name)
    used.update(i for i, (regex, _) in enumerate(partition.rules)
                if regex.fullmatch(name))
    sharding = partition(name, tuple(x.shape))
    if sharding is None:
      was = saved.get(name)
      if was is not None and was.description == HOST_REPLICATED:
        return np.broadcast_to(np.zeros((), x.dtype), x.shape)
      sharding = NamedSharding(mesh, PartitionSpec())
    spec = sharding.spec
    if len(spec) > len(x.shape):
      raise TreeMismatchError(
          f"leaf {name!r}: the rule gives {spec} ({len(spec)} dimensions), "
          f"the leaf has shape {tuple(x.shape)} ({len(x.shape)} dimensions)")
    for d, axes in enumerate(spec):
      if axes is None:
        continue
      n = int(np.prod([mesh.shape[a] for a in
                       (axes if isinstance(axes, tuple) else (axes,))]))
      if x.shape[d] % n:
        raise TreeMismatchError(
            f"leaf {name!r}: dimension {d} has size {x.shape[d]}, which "
            f"{spec} splits over {n} devices of the mesh {dict(mesh.shape)}; "
            "expected a multiple of it (give this leaf another rule)")
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  out = tree_util.tree_map_with_path(leaf, src)
  unused = [r for i, r in enumerate(rules) if i not in used]
  if strict and unused:
    raise transforms.unmatched("abstract_target rule", unused[0][0], names)
  return out
