"""What ``ckpt export --to orbax`` writes besides the arrays: the plan of one
Orbax PyTree item from a ckpt index (pure, no I/O; ckpt/cli/orbax_export.py
writes it).

Orbax (0.12.8) reads a PyTree item directory as (the same files that
ckpt/cli/orbax_tree.py reads on ``ckpt import``):

- ``_METADATA``: JSON, ``tree_metadata`` keyed by the ``str`` of each leaf's
  key tuple, each with ``key_metadata`` (key and type: 1 a sequence index,
  2 a dict key or attribute) and ``value_metadata`` (``value_type``:
  ``jax.Array``, ``np.ndarray``, ``scalar``, ``string``, or an empty node
  ``Dict``/``List``/``Tuple``/``None``); and ``use_ocdbt``, ``use_zarr3``,
  ``store_array_data_equal_to_fill_value``;
- one zarr array per array or scalar leaf, named by its parameter name (its
  keys joined by "."), here in one OCDBT database at the item's root;
- ``_sharding``: JSON, base64 of each ``jax.Array``'s parameter name -> its
  sharding as a JSON string (mesh shape, axis names and types,
  PartitionSpec; no device ids: Orbax then lays the mesh over
  ``jax.devices()`` in order, as ckpt's saved shardings do);
- ``_strings.json``: parameter name -> string of each string leaf;
- ``array_metadatas/process_0``: write and chunk shapes, and the PRNG
  implementation of typed key arrays (stored as their key data).

A ckpt leaf becomes: a stored array with a mesh or device sharding a
``jax.Array``; a host numpy leaf (or a small array kept inline) an
``np.ndarray``; a python bool, int or float a ``scalar``; a str a
``string``; None and empty containers their empty node.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import itertools
import math
from typing import Any

import numpy as np

from ckpt.format import index as index_lib
from ckpt.format import tree
from ckpt.format.saved_sharding import SavedSharding
from ckpt.cli.convert import ConvertError
from ckpt.shards.plan import Box
from ckpt.format import entries as entries_lib

SEQUENCE, DICT = 1, 2  # Orbax's KeyType
_EMPTY = {"dict": "Dict", "object": "Dict", "list": "List", "tuple": "Tuple",
          "none": "None"}
EMPTY = frozenset(_EMPTY.values())  # value types with no data
_AXIS_TYPES = {"auto": "AxisType.Auto", "explicit": "AxisType.Explicit",
               "manual": "AxisType.Manual"}


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One entry of the Orbax tree."""
  keys: tuple[tuple[str, int], ...]    # (key, Orbax key type) from the root
  value_type: str
  entry: int | None = None             # its index.leaves position (data)
  value: Any = None                    # a scalar's or string's value
  shape: tuple[int, ...] = ()
  dtype: str = ""
  chunks: tuple[int, ...] = ()
  sharding: str | None = None          # its _sharding record (JSON text)
  prng_impl: str = ""

  @property
  def name(self) -> str:
    """Orbax's parameter name: where its array is stored."""
    return ".".join(k for k, _ in self.keys)

  @property
  def path(self) -> str:
    return tree.path_str(tuple(k for k, _ in self.keys))

  @property
  def stored(self) -> bool:
    """Whether it has an array (arrays and scalars)."""
    return self.value_type in ("jax.Array", "np.ndarray", "scalar")

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def plan(index: index_lib.Index) -> list[Leaf]:
  """The Orbax tree of a ckpt checkpoint, in the index's leaf order (empty
  nodes where the structure has them). Raises ConvertError for what Orbax
  cannot hold, naming the leaf."""
  if type(index.structure) is int:
    raise ConvertError(
        "the checkpoint's state is one array, not a tree; an Orbax PyTree "
        "item needs a tree (save {'state': x} to export it)")
  out: list[Leaf] = []

  def walk(node: Any, keys: tuple[tuple[str, int], ...]) -> None:
    if type(node) is int:
      out.append(_leaf(keys, index.leaves[node], node))
      return
    kind = node[0]
    k = tree.KEYED.get(kind)
    if k is not None:
      pairs = list(zip(node[k::2], node[k + 1::2]))
      key_type = DICT
    else:
      pairs = [(str(i), c) for i, c in enumerate(node[1:])]
      key_type = SEQUENCE
    if not pairs:
      if not keys:
        raise ConvertError("the checkpoint's tree is empty: nothing to export")
      out.append(Leaf(keys, _EMPTY[kind]))
      return
    for key, child in pairs:
      walk(child, keys + ((str(key), key_type),))

  walk(index.structure, ())
  seen: dict[str, str] = {}
  for leaf in out:
    other = seen.setdefault(leaf.name, leaf.path)
    if other != leaf.path:
      raise ConvertError(
          f"leaves {other!r} and {leaf.path!r} have the same Orbax parameter "
          f"name {leaf.name!r} (Orbax joins keys with '.'); rename one (a "
          "save transform) before exporting")
  return out


def _leaf(keys, e: entries_lib.Entry, i: int) -> Leaf:
  path = tree.path_str(tuple(k for k, _ in keys))
  if isinstance(e, entries_lib.ValueEntry) and not isinstance(
      e.value, (np.ndarray, np.generic)):
    v = e.value
    if isinstance(v, str):
      return Leaf(keys, "string", value=v)
    if isinstance(v, (bool, int, float)):
      arr = np.asarray(v)
      if arr.dtype.hasobject:
        raise ConvertError(f"leaf {path!r}: the int {v} does not fit in "
                           "int64, which is what Orbax stores a scalar as")
      return Leaf(keys, "scalar", i, value=v, dtype=arr.dtype.name,
                  chunks=())
    raise ConvertError(
        f"leaf {path!r} is a {type(v).__name__}; an Orbax PyTree holds "
        "arrays, numbers and strings (export to npz, or drop the leaf with "
        "a save transform)")
  if isinstance(e, entries_lib.ValueEntry):
    shape, dtype, chunks = e.value.shape, e.value.dtype.name, ()
  else:
    shape, dtype = tuple(e.shape), e.dtype
    chunks = tuple(getattr(e, "chunks", ()) or ())
  if not chunks or len(chunks) != len(shape):
    chunks = tuple(max(1, n) for n in shape)  # one chunk
  saved = index_lib.saved_sharding_of(e)
  kind = "jax.Array" if saved.kind in ("mesh", "device") or e.prng_impl \
      else "np.ndarray"
  return Leaf(keys, kind, i, shape=tuple(shape), dtype=dtype, chunks=chunks,
              sharding=_sharding_record(saved), prng_impl=e.prng_impl)


def _sharding_record(s: SavedSharding) -> str | None:
  """The ``_sharding`` value of a leaf saved on a mesh (None otherwise:
  Orbax restores onto the target's sharding, which a restore gives)."""
  if s.kind != "mesh":
    return None
  record: dict[str, Any] = {
      "sharding_type": "NamedSharding", "shape": list(s.axis_sizes),
      "axis_names": list(s.axis_names)}
  if s.axis_types:
    record["axis_types"] = [_AXIS_TYPES[t] for t in s.axis_types]
  record["partition_spec"] = [list(p) if isinstance(p, tuple) else p
                              for p in s.spec]
  return json.dumps(record)


def tree_metadata(leaves: list[Leaf], use_zarr3: bool = False) -> dict:
  """The ``_METADATA`` document."""
  entries = {}
  for leaf in leaves:
    value: dict[str, Any] = {"value_type": leaf.value_type,
                             "skip_deserialize": leaf.value_type in EMPTY}
    if leaf.value_type == "jax.Array":
      value["write_shape"] = list(leaf.chunks)
    entries[str(tuple(k for k, _ in leaf.keys))] = {
        "key_metadata": [{"key": k, "key_type": t} for k, t in leaf.keys],
        "value_metadata": value}
  return {"tree_metadata": entries, "use_ocdbt": True,
          "use_zarr3": use_zarr3,
          "store_array_data_equal_to_fill_value": True,
          "custom_metadata": None}


def shardings(leaves: list[Leaf]) -> dict[str, str]:
  """The ``_sharding`` document: every ``jax.Array`` has an entry (Orbax
  reads one for each it restores), "" (Orbax: none recorded) for those not
  saved on a mesh."""
  return {base64.urlsafe_b64encode(leaf.name.encode()).decode():
          leaf.sharding or "" for leaf in leaves
          if leaf.value_type == "jax.Array"}


def strings(leaves: list[Leaf]) -> dict[str, str]:
  """The ``_strings.json`` document (empty: not written)."""
  return {leaf.name: leaf.value for leaf in leaves
          if leaf.value_type == "string"}


def array_metadatas(leaves: list[Leaf]) -> dict:
  """``array_metadatas/process_0``: each jax.Array's shapes, and the PRNG
  implementation of typed keys."""
  out = []
  for leaf in leaves:
    if leaf.value_type != "jax.Array":
      continue
    ext = {"random_key_impl": leaf.prng_impl} if leaf.prng_impl else None
    out.append({"array_metadata": {
        "param_name": leaf.name, "write_shape": list(leaf.chunks),
        "chunk_shape": list(leaf.chunks), "ext_metadata": ext}})
  return {"array_metadatas": out}


def step_metadata(handlers: dict[str, str], metrics: dict, time_s: float,
                  custom: dict) -> dict:
  """The ``_CHECKPOINT_METADATA`` of a step: its items' handlers, metrics,
  custom_metadata, and the save time of the ckpt step as both times."""
  ns = int(time_s * 1e9)
  return {"item_handlers": handlers, "metrics": metrics,
          "performance_metrics": {}, "init_timestamp_nsecs": ns,
          "commit_timestamp_nsecs": ns, "custom_metadata": custom}


def boxes(shape: tuple[int, ...], chunks: tuple[int, ...], itemsize: int,
          budget: int) -> list[Box]:
  """The boxes one array is copied in: whole chunks, so no chunk is written
  twice; rows of chunks (along the first axis) as many as fit in
  ``budget`` bytes, else one chunk each (a chunk larger than the budget
  then goes alone: the limiter lets it through by itself)."""
  if any(n == 0 for n in shape):
    return []
  if not shape:
    return [Box((), ())]
  row = chunks[0] * math.prod(shape[1:]) * itemsize  # one row of chunks
  if row <= budget:
    step = chunks[0] * max(1, budget // row)
    return [Box((a,) + (0,) * (len(shape) - 1),
                (min(a + step, shape[0]),) + tuple(shape[1:]))
            for a in range(0, shape[0], step)]
  grid = [range(0, n, c) for n, c in zip(shape, chunks)]
  return [Box(tuple(start), tuple(min(a + c, n) for a, c, n in
                                  zip(start, chunks, shape)))
          for start in itertools.product(*grid)]
