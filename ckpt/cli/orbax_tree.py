"""One Orbax PyTree item, read with TensorStore (see ckpt/cli/orbax_import.py).

``read_pytree`` turns an item directory (``_METADATA``, zarr arrays in an
OCDBT database or in directories, ``_sharding``, ``_strings.json``,
``array_metadatas/``) into nested dicts and lists whose arrays are
``LeafSource`` leaves (ckpt/save/leafsource.py) carrying their saved sharding,
scalars python numbers, strings python strings, as Orbax restores them.
"""

from __future__ import annotations

import base64
import json
import math
import os
from typing import Any

import tensorstore as ts
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from ckpt.cli import orbax_bounds
from ckpt.save import leafsource
from ckpt.store import ocdbt
from ckpt.store import storage as storage_lib
from ckpt.errors import OrbaxImportError
from ckpt.store import urls

TREE_METADATA = "_METADATA"
SHARDINGS = "_sharding"
STRINGS = "_strings.json"
ARRAY_METADATAS = "array_metadatas"
LEGACY_AGGREGATE = "checkpoint"  # msgpack of Orbax before _METADATA
MAX_METADATA_BYTES = 256 << 20  # _METADATA of ~800,000 leaves
_EMPTY = {"Dict": dict, "List": list, "Tuple": tuple, "None": lambda: None,
          "NamedTuple": lambda: None}
_ARRAY_TYPES = ("jax.Array", "np.ndarray")
_SEQUENCE = 1  # Orbax's KeyType (2: a dict key)


def brief(v: Any, limit: int = 80) -> str:
  try:
    text = json.dumps(v, sort_keys=True, default=str)
  except (RecursionError, ValueError):  # nested too deep, a cycle
    text = f"(a {type(v).__name__} nested too deep to show)"
  return text if len(text) <= limit else text[:limit - 3] + "..."


def read_json(storage, rel: str, what: str, limit: int | None = None,
              required: bool = True) -> Any:
  data = storage.read_bytes(rel, limit=limit)
  where = f"{storage.url.rstrip('/')}/{rel}"
  if data is None:
    if required:
      raise OrbaxImportError(f"{where} ({what}) does not exist")
    return None
  try:
    return json.loads(data)
  except ValueError as e:
    raise OrbaxImportError(f"{where} ({what}) is not JSON: {e}") from None
  except RecursionError:
    raise OrbaxImportError(
        f"{where} ({what}): JSON nested deeper than Python's parser allows "
        f"(a few hundred levels); refusing it") from None


def list_files(storage, prefix: str) -> list[str]:
  """Keys (files) under ``prefix`` (a directory, ending in /), relative to
  it, recursively."""
  if storage.is_posix:
    top = os.path.join(os.fspath(storage.root), prefix)
    out = []
    for dirpath, _, files in os.walk(top):
      rel = os.path.relpath(dirpath, top)
      out.extend(f if rel == "." else f"{rel}/{f}" for f in files)
    return sorted(out)
  where = f"{storage.url.rstrip('/')}/{prefix}"
  return sorted(orbax_bounds.check_listed(k[len(prefix):], where)
                for k in storage.list_keys(prefix))


class ItemReader:
  """Reads the PyTree items of one source (a Storage), counting the leaves
  and array bytes it found."""

  def __init__(self, storage: storage_lib.Storage,
               cache: leafsource.RegionCache):
    self.storage = storage
    self.url = storage.url.rstrip("/")
    self.cache = cache
    self.context = storage.context()
    self.leaves = 0
    self.nbytes = 0
    self.claims: list[tuple[int, str]] = []  # (bytes, which array)

  def _read(self, rel: str, what: str, required: bool = False,
            kind: type | None = None) -> Any:
    """The JSON document ``rel``; with ``kind``, refused unless one."""
    doc = read_json(self.storage, rel, what, limit=MAX_METADATA_BYTES,
                    required=required)
    if kind is not None and doc is not None and not isinstance(doc, kind):
      raise OrbaxImportError(f"{self.url}/{rel} ({what}): expected a JSON "
                             f"{'object' if kind is dict else 'array'}, "
                             f"found {brief(doc)}")
    return doc

  def pytree(self, rel: str, label: str) -> Any:
    """The tree of the PyTree item in directory ``rel`` ("" the source),
    its paths shown under ``label``: arrays open (not read), scalars and
    strings read."""
    base = f"{rel}/" if rel else ""
    where = f"{self.url}/{base}".rstrip("/")
    meta = self._read(base + TREE_METADATA, "the tree metadata")
    if meta is None:
      raise OrbaxImportError(
          f"{where} was written by an Orbax older than 0.5 (no "
          f"{TREE_METADATA}, a msgpack '{LEGACY_AGGREGATE}' file); ckpt "
          "cannot read it: restore it with that Orbax, then save it with "
          "ckpt.Checkpointer")
    entries = meta.get("tree_metadata") if isinstance(meta, dict) else None
    if not isinstance(entries, dict):
      raise OrbaxImportError(f"{where}/{TREE_METADATA} has no tree_metadata "
                             "object: not an Orbax PyTree checkpoint")
    strings = self._read(base + STRINGS, "the strings", kind=dict) or {}
    flat: list[tuple[list[tuple[str, int]], Any]] = []
    arrays: list[tuple[int, str, str, str]] = []  # (index, path, name, type)
    for keystr, entry in entries.items():
      try:
        if len(entry["key_metadata"]) > orbax_bounds.MAX_JSON_DEPTH:
          raise OrbaxImportError(
              f"{where}/{TREE_METADATA}: entry {brief(keystr)} has a key path "
              f"of {len(entry['key_metadata'])} keys; expected at most "
              f"{orbax_bounds.MAX_JSON_DEPTH}")
        keys = [(_key(k["key"]), int(k["key_type"]))
                for k in entry["key_metadata"]]
        vm = entry["value_metadata"]
        vtype, skip_read = vm["value_type"], bool(vm.get("skip_deserialize"))
      except (KeyError, TypeError, ValueError, AttributeError):
        raise OrbaxImportError(f"{where}/{TREE_METADATA}: entry "
                               f"{brief(keystr)} is not an Orbax tree entry: "
                               f"{brief(entry)}") from None
      for k, _ in keys:
        orbax_bounds.check_key(k, f"{where}/{TREE_METADATA}: entry "
                               f"{brief(keystr)}", "key")
      name = ".".join(k for k, _ in keys)  # Orbax's parameter name
      path = "/".join([label] * bool(label) + [k for k, _ in keys])
      value = None  # also an Orbax PLACEHOLDER's: saved with no data
      if vtype in _EMPTY:
        value = _EMPTY[vtype]()
      elif vtype == "string" and not skip_read:
        value = strings.get(name)
        if not isinstance(value, str):
          raise OrbaxImportError(f"leaf {path!r}: Orbax string {name!r} is "
                                 f"missing from {where}/{STRINGS}")
        self.leaves += 1
      elif vtype in (*_ARRAY_TYPES, "scalar") and not skip_read:
        arrays.append((len(flat), path, name, vtype))
      elif vtype != "placeholder":
        how = ("in Orbax's aggregate file (saved with aggregate=True)"
               if skip_read else f"of Orbax value type {vtype!r} (a custom "
               "TypeHandler)")
        raise OrbaxImportError(
            f"leaf {path!r} (Orbax {name!r} in {where}) is stored {how}, "
            "which ckpt cannot read; restore it with Orbax and save it with "
            "ckpt.Checkpointer")
      flat.append((keys, value))
    for i, value in self._arrays(rel, meta, arrays, where):
      flat[i] = (flat[i][0], value)
    return _build(flat, where)

  def _arrays(self, rel: str, meta: dict, arrays: list, where: str):
    """(index, value) of every array and scalar of one item: arrays as
    LeafSources with their saved sharding, scalars read (python values)."""
    base = f"{rel}/" if rel else ""
    shardings = self._read(base + SHARDINGS, "the saved shardings",
                           kind=dict) or {}
    impls = self._key_impls(base)
    item_spec = urls.join(self.storage.spec, rel)
    kv = ocdbt.database(item_spec) if meta.get("use_ocdbt") else None
    spec = {"driver": "zarr3" if meta.get("use_zarr3") else "zarr"}
    zmeta = "zarr.json" if meta.get("use_zarr3") else ".zarray"
    if meta.get("store_array_data_equal_to_fill_value"):
      spec["fill_missing_data_reads"] = False  # a lost chunk is an error
    opening = [
        ts.open({**spec, "kvstore": {**kv, "path": name + "/"} if kv else
                 urls.join(item_spec, name)},
                open=True, read=True, context=self.context)
        for _, _, name, _ in arrays]
    scalars = []
    for (i, path, name, vtype), future in zip(arrays, opening):
      try:
        store = future.result()
      except Exception as e:  # pylint: disable=broad-except
        raise OrbaxImportError(f"leaf {path!r}: cannot open Orbax array "
                               f"{name!r} in {where}: {e}") from e
      file = (f"{where} (OCDBT key {name}/{zmeta})" if kv else
              f"{where}/{name}/{zmeta}")
      what = f"leaf {path!r} ({file})"
      if vtype == "scalar":
        if math.prod(store.shape) != 1:
          raise OrbaxImportError(f"{what}: an Orbax scalar of shape "
                                 f"{list(store.shape)}; expected one element")
        scalars.append((i, path, name, store.read()))
        continue
      sharding = None
      raw = shardings.get(base64.urlsafe_b64encode(name.encode()).decode())
      if vtype == "jax.Array" and raw:  # "": none recorded, as for Orbax
        try:
          sharding = _mesh_sharding(json.loads(raw), store.rank)
        except (ValueError, TypeError, KeyError, AttributeError,
                RuntimeError, RecursionError) as e:
          raise OrbaxImportError(
              f"leaf {path!r}: its saved sharding in {where}/{SHARDINGS} is "
              f"not one ckpt reads ({e}): {brief(raw)}") from None
      source = leafsource.LeafSource(
          store, describe=f"Orbax array {name!r} in {where}",
          sharding=sharding, prng_impl=impls.get(name, ""), cache=self.cache)
      self.claims.append((orbax_bounds.check_array(
          source.shape, source.chunks, source.dtype, what), what))
      self.leaves += 1
      self.nbytes += source.nbytes
      yield i, source
    for i, path, name, future in scalars:
      try:
        value = future.result()
      except Exception as e:  # pylint: disable=broad-except
        raise OrbaxImportError(f"leaf {path!r}: reading Orbax scalar {name!r} "
                               f"in {where} failed: {e}") from e
      self.leaves += 1
      yield i, value.reshape(()).item()  # a python value, as Orbax's

  def _key_impls(self, base: str) -> dict[str, str]:
    """Orbax parameter name -> PRNG implementation, of typed key arrays."""
    out: dict[str, str] = {}
    for f in list_files(self.storage, base + ARRAY_METADATAS + "/"):
      doc = self._read(f"{base}{ARRAY_METADATAS}/{f}", "the array metadata",
                       kind=dict)
      for m in (doc or {}).get("array_metadatas", ()) or ():
        m = (m.get("array_metadata") if isinstance(m, dict) else None) or {}
        ext = m.get("ext_metadata") if isinstance(m, dict) else None
        impl = ext.get("random_key_impl") if isinstance(ext, dict) else None
        if isinstance(impl, str) and isinstance(m.get("param_name"), str):
          out[m["param_name"]] = impl
    return out


def _key(k: Any) -> Any:
  """An Orbax key as text (a sequence index may be a JSON number)."""
  return str(k) if type(k) is int else k


def _mesh_sharding(d: Any, rank: int) -> NamedSharding | None:
  """The NamedSharding (over an AbstractMesh) of one ``_sharding`` record,
  of an array of ``rank``; None for a single-device sharding; ValueError if
  it is not one (or one out of bounds)."""
  kind = d.get("sharding_type")
  if kind != "NamedSharding":
    if kind == "SingleDeviceSharding":
      return None
    raise ValueError(f"sharding type {kind!r}")
  sizes, names = d["shape"], d["axis_names"]
  orbax_bounds.check_mesh(sizes, names)
  entries = d["partition_spec"]
  if not isinstance(entries, list) or len(entries) > rank:
    raise ValueError(f"a partition spec of at most {rank} entries (the "
                     f"array's rank), found {str(entries)[:100]}")
  spec = []
  for entry in entries:
    if isinstance(entry, list):
      entry = tuple(entry)
    for a in entry if isinstance(entry, tuple) else (entry,):
      if a is not None and a not in names:
        raise ValueError(f"axis {a!r} of the spec is not a mesh axis")
    spec.append(entry)
  return NamedSharding(AbstractMesh(tuple(sizes), tuple(names)),
                       PartitionSpec(*spec))


def _build(flat: list[tuple[list[tuple[str, int]], Any]], where: str) -> Any:
  """Nested dicts and lists from (Orbax key path, value) pairs."""
  if len(flat) == 1 and not flat[0][0]:
    return flat[0][1]
  root: dict[str, Any] = {}
  kinds: dict[int, int] = {id(root): 0}  # inner node -> its keys' type

  def clash(keys):
    return OrbaxImportError(
        f"{where}/{TREE_METADATA}: key path {[k for k, _ in keys]} clashes "
        "with another entry (a leaf and a subtree, or keys of two kinds at "
        "one node)")

  for keys, value in flat:
    if not keys:
      raise clash(keys)
    node = root
    for depth, (k, t) in enumerate(keys):
      if kinds[id(node)] not in (0, t):
        raise clash(keys)
      kinds[id(node)] = t
      if depth == len(keys) - 1:
        if k in node:
          raise clash(keys)
        node[k] = value
        break
      child = node.get(k)
      if child is None and k not in node:
        child = node[k] = {}
        kinds[id(child)] = 0
      elif not isinstance(child, dict) or id(child) not in kinds:
        raise clash(keys)  # a leaf there already
      node = child

  def convert(node: dict[str, Any]) -> Any:
    out = {k: convert(v) if isinstance(v, dict) and id(v) in kinds else v
           for k, v in node.items()}
    if kinds[id(node)] != _SEQUENCE:
      return out
    indices = sorted(int(k) for k in out if k.isdigit())
    if indices != list(range(len(out))):
      raise OrbaxImportError(f"{where}/{TREE_METADATA}: sequence indices "
                             f"{sorted(out)[:10]} are not 0..{len(out) - 1}")
    return [out[str(i)] for i in indices]

  return convert(root)
