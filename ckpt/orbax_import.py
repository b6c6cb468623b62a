"""Reading an Orbax checkpoint for ``ckpt import``, with TensorStore alone.

Orbax is not needed: an Orbax PyTree checkpoint is a ``_METADATA`` JSON file
(the tree: each leaf's key path and value type) next to zarr arrays (in an
OCDBT database unless saved with ``use_ocdbt=False``; zarr v2 unless
``use_zarr3``), a ``_sharding`` JSON file (each ``jax.Array``'s saved
sharding: mesh axis names and sizes, PartitionSpec), ``_strings.json`` and
``array_metadatas/`` (typed PRNG keys). Everything is read through the
TensorStore kvstore of its URL, so a source may be a path, ``file://``,
``gs://`` or ``s3://`` (the same URLs and ``storage_options`` as a ckpt
root; Orbax itself reads buckets through etils/fsspec, which needs gcsfs
or s3fs).

What is imported:

- a PyTree item directory (with ``_METADATA``): its tree, at the root;
- an Orbax step directory (with ``_CHECKPOINT_METADATA``, as
  ``CheckpointManager`` writes): every item, each as a subtree named after
  it (``state/...``, ``extra/...``); the one item of a single-item manager
  (``default``) at the root. PyTree items (``StandardSave``,
  ``PyTreeSave``) keep their tree; ``ArraySave`` items are one array leaf;
  JSON items (``JsonSave``) become inline values (nested dicts, lists,
  numbers, strings, None); the ``metrics`` item (``CheckpointManager``'s
  ``metrics=``) becomes the step's metrics.
- Arrays are ``LeafSource`` leaves (ckpt/leafsource.py): read box by box
  while the save writes them, with their saved sharding; scalars become
  python numbers and strings python strings, as Orbax restores them;
  typed PRNG keys stay keys of their implementation; empty containers and
  None stay what they were; an Orbax ``PLACEHOLDER`` (saved without data)
  becomes None.

Anything else (an item of another handler, such as a data loader's; a leaf
of a custom TypeHandler or in Orbax's old aggregate file; the step's
``custom_metadata``; a metric that is not a number) is refused, naming it,
unless it is named in ``skip``; nothing is dropped silently.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
from typing import Any

import tensorstore as ts
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from ckpt import leafsource
from ckpt import ocdbt
from ckpt import save_extras
from ckpt import storage as storage_lib
from ckpt.errors import CheckpointError

STEP_METADATA = "_CHECKPOINT_METADATA"
TREE_METADATA = "_METADATA"
SHARDINGS = "_sharding"
STRINGS = "_strings.json"
ARRAY_METADATAS = "array_metadatas"
LEGACY_AGGREGATE = "checkpoint"  # msgpack of Orbax before _METADATA
DEFAULT_ITEM = "default"
METRICS_ITEM = "metrics"
CUSTOM_METADATA = "custom_metadata"
# Files in an item directory that are not the item's data.
_NOT_DATA = ("commit_success.txt",)
MAX_METADATA_BYTES = 256 << 20  # _METADATA of ~800,000 leaves
_PYTREE_HANDLERS = ("PyTreeCheckpointHandler", "StandardCheckpointHandler")
_ARRAY_HANDLERS = ("ArrayCheckpointHandler",)
_JSON_HANDLERS = ("JsonCheckpointHandler",)
_EMPTY = {"Dict": dict, "List": list, "Tuple": tuple, "None": lambda: None,
          "NamedTuple": lambda: None}
_ARRAY_TYPES = ("jax.Array", "np.ndarray")
_SEQUENCE, _DICT = 1, 2  # Orbax's KeyType


class OrbaxImportError(CheckpointError):
  """An Orbax checkpoint, or a part of one, that ckpt cannot import."""


@dataclasses.dataclass
class OrbaxStep:
  """What ``read_step`` found: the tree to save and what it holds."""
  url: str
  tree: Any
  items: dict[str, str]                     # item ("" bare) -> its kind
  metrics: dict[str, Any] | None = None     # for save(metrics=)
  skipped: list[str] = dataclasses.field(default_factory=list)
  leaves: int = 0
  bytes: int = 0
  cache: leafsource.RegionCache = dataclasses.field(
      default_factory=leafsource.RegionCache)


def open_source(src, storage_options: dict | None = None
                ) -> storage_lib.Storage:
  """The Storage of a source URL; a local one must be a directory."""
  spec, posix = storage_lib.kvstore_for_url(os.fspath(src), storage_options)
  if posix and "file_io_mode" not in (storage_options or {}):
    # pread, not mmap: an import reads each byte once, and mapped pages of
    # the source would count in its resident memory.
    storage_options = {**(storage_options or {}),
                       "file_io_mode": {"mode": "default"}}
  del spec
  storage = storage_lib.Storage(src, storage_options)
  if storage.is_posix:
    local = storage.spec["path"].rstrip("/") or "/"
    if not os.path.isdir(local):
      what = ("is not a directory" if os.path.exists(local) else
              "does not exist")
      raise OrbaxImportError(f"{os.fspath(src)} {what}")
  return storage


def kind_of(storage: storage_lib.Storage) -> str | None:
  """"item" (a PyTree item directory), "step" (an Orbax step directory) or
  None: what the directory of ``storage`` is."""
  if storage.exists(TREE_METADATA) or storage.exists(LEGACY_AGGREGATE):
    return "item"
  if storage.exists(STEP_METADATA):
    return "step"
  return None


def read_step(src, *, storage_options: dict | None = None,
              skip=()) -> OrbaxStep:
  """Opens an Orbax step or PyTree item directory at ``src`` (a path or
  URL) for import: arrays are opened (metadata read), not read."""
  storage = open_source(src, storage_options)
  url = storage.url.rstrip("/")
  skip = set(skip)
  kind = kind_of(storage)
  if kind is None:
    raise OrbaxImportError(
        f"{url} is not an Orbax checkpoint: it has no {TREE_METADATA} (a "
        f"PyTree item directory) and no {STEP_METADATA} (a step directory "
        "of a CheckpointManager)")
  out = OrbaxStep(url=url, tree=None, items={})
  reader = _Reader(storage, out.cache)
  if kind == "item":
    out.tree = reader.pytree("", "")
    out.items[""] = "pytree"
  else:
    out.tree = _read_items(storage, reader, out, skip)
  out.leaves, out.bytes = reader.leaves, reader.nbytes
  unknown = sorted(skip - set(out.skipped))
  if unknown:
    raise OrbaxImportError(
        f"{url}: asked to skip {unknown}, which this checkpoint does not "
        f"have (its items: {sorted(n for n in out.items if n)})")
  return out


def _read_items(storage, reader: "_Reader", out: OrbaxStep, skip: set) -> Any:
  meta = _json(storage, STEP_METADATA, "the step metadata")
  if not isinstance(meta, dict):
    raise OrbaxImportError(f"{out.url}/{STEP_METADATA} is not a JSON object")
  custom = meta.get(CUSTOM_METADATA)
  if custom:
    if CUSTOM_METADATA not in skip:
      raise OrbaxImportError(
          f"{out.url}: the step has custom_metadata {_brief(custom)}, which "
          f"ckpt cannot import; pass --skip {CUSTOM_METADATA} (skip="
          f"['{CUSTOM_METADATA}']) to import the rest without it")
    out.skipped.append(CUSTOM_METADATA)
  handlers = meta.get("item_handlers")
  if isinstance(handlers, str):  # a manager of one unnamed item
    handlers = {DEFAULT_ITEM: handlers}
  if not isinstance(handlers, dict) or not handlers:
    handlers = {name: None for name in _item_dirs(storage)}
  if not handlers:
    raise OrbaxImportError(f"{out.url} is an Orbax step directory with no "
                           "item in it")
  tree: dict[str, Any] = {}
  for name in sorted(handlers):
    handler = handlers[name] or ""
    short = handler.rsplit(".", 1)[-1] or "unknown handler"
    if name in skip:
      out.skipped.append(name)
      continue
    if not _item_exists(storage, name):
      raise OrbaxImportError(
          f"{out.url}: item {name!r} ({short}) is named in {STEP_METADATA} "
          f"but its directory {name}/ is missing or empty")
    if short in _JSON_HANDLERS:
      value = reader.json_item(name)
      if name == METRICS_ITEM:
        out.metrics = _metrics(value, out.url)
        out.items[name] = "metrics"
        continue
      out.items[name] = "json"
      reader.leaves += _count_json_leaves(value)
    elif short in _ARRAY_HANDLERS:
      value = reader.pytree(name, name)
      if isinstance(value, dict) and len(value) == 1:
        (value,) = value.values()  # {"checkpoint": array}
      out.items[name] = "array"
    elif short in _PYTREE_HANDLERS or (
        not handler and storage.exists(f"{name}/{TREE_METADATA}")):
      value = reader.pytree(name, name)
      out.items[name] = "pytree"
    else:
      raise OrbaxImportError(
          f"{out.url}: item {name!r} was saved by {handler or 'an unknown handler'}"
          ", which ckpt cannot import (it imports PyTree items: StandardSave, "
          "PyTreeSave, ArraySave; and JSON items: JsonSave). A data loader's "
          "position belongs in save(..., host_state=...). Pass --skip "
          f"{name} (skip=[{name!r}]) to import the rest without it")
    tree[name] = value
  if list(out.items) == [DEFAULT_ITEM]:
    return tree[DEFAULT_ITEM]  # a single-item manager: the item is the state
  return tree


def _metrics(value: Any, url: str) -> dict[str, Any]:
  def walk(prefix: str, node: Any) -> None:
    for k, v in node.items():
      if isinstance(v, dict):
        walk(f"{prefix}{k}/", v)
      elif isinstance(v, bool) or not isinstance(v, (int, float)):
        raise OrbaxImportError(
            f"{url}: metric {prefix}{k!r} is {_brief(v)}, not a number; ckpt "
            f"keeps numbers as a step's metrics. Pass --skip {METRICS_ITEM} "
            f"(skip=['{METRICS_ITEM}']) to import the rest without them")
  if not isinstance(value, dict):
    raise OrbaxImportError(f"{url}: the metrics item holds {_brief(value)}, "
                           "not a JSON object of numbers")
  walk("", value)
  save_extras.check_metrics(value)
  return value


def _brief(v: Any, limit: int = 80) -> str:
  text = json.dumps(v, sort_keys=True, default=str)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _json(storage, rel: str, what: str, limit: int | None = None,
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


def _list(storage, prefix: str) -> list[str]:
  """Keys (files) under ``prefix`` (a directory, ending in /), relative to
  it, recursively."""
  if storage.is_posix:
    top = os.path.join(os.fspath(storage.root), prefix)
    out = []
    for dirpath, _, files in os.walk(top):
      rel = os.path.relpath(dirpath, top)
      out.extend(f if rel == "." else f"{rel}/{f}" for f in files)
    return sorted(out)
  return sorted(k[len(prefix):] for k in storage.list_keys(prefix))


def _item_dirs(storage) -> list[str]:
  if storage.is_posix:
    top = os.fspath(storage.root)
    return sorted(d for d in os.listdir(top)
                  if os.path.isdir(os.path.join(top, d)) and
                  ".orbax-checkpoint-tmp" not in d)
  return sorted({k.split("/", 1)[0] for k in storage.list_keys("")
                 if "/" in k})


def _item_exists(storage, name: str) -> bool:
  if storage.is_posix:
    return os.path.isdir(os.path.join(os.fspath(storage.root), name))
  return bool(storage.list_keys(f"{name}/"))


def _mesh_sharding(d: Any) -> NamedSharding | None:
  """The NamedSharding (over an AbstractMesh) of one ``_sharding`` record;
  None for a single-device sharding; ValueError if it is not one."""
  kind = d.get("sharding_type")
  if kind != "NamedSharding":
    if kind == "SingleDeviceSharding":
      return None
    raise ValueError(f"sharding type {kind!r}")
  sizes, names = d["shape"], d["axis_names"]
  if (not isinstance(sizes, list) or not isinstance(names, list) or
      len(sizes) != len(names) or
      not all(type(n) is int and n > 0 for n in sizes) or
      not all(isinstance(a, str) for a in names)):
    raise ValueError(f"mesh {sizes} {names}")
  spec = []
  for entry in d["partition_spec"]:
    if isinstance(entry, list):
      entry = tuple(entry)
    for a in entry if isinstance(entry, tuple) else (entry,):
      if a is not None and a not in names:
        raise ValueError(f"axis {a!r} of the spec is not a mesh axis")
    spec.append(entry)
  return NamedSharding(AbstractMesh(tuple(sizes), tuple(names)),
                       PartitionSpec(*spec))


class _Reader:
  """Reads the items of one source (a Storage), counting what it found."""

  def __init__(self, storage: storage_lib.Storage,
               cache: leafsource.RegionCache):
    self.storage = storage
    self.url = storage.url.rstrip("/")
    self.cache = cache
    self.context = storage.context()
    self.leaves = 0
    self.nbytes = 0

  def json_item(self, name: str) -> Any:
    files = [f for f in _list(self.storage, f"{name}/") if f not in _NOT_DATA]
    if len(files) != 1:
      raise OrbaxImportError(
          f"{self.url}/{name}: a JSON item should hold one file, found "
          f"{files[:5]}")
    return _json(self.storage, f"{name}/{files[0]}", f"JSON item {name!r}")

  def pytree(self, rel: str, label: str) -> Any:
    """The tree of the PyTree item in directory ``rel`` ("" the source),
    its paths shown under ``label``."""
    base = f"{rel}/" if rel else ""
    where = f"{self.url}/{base}".rstrip("/")
    meta = _json(self.storage, base + TREE_METADATA, "the tree metadata",
                 limit=MAX_METADATA_BYTES, required=False)
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
    shardings = _json(self.storage, base + SHARDINGS, "the saved shardings",
                      limit=MAX_METADATA_BYTES, required=False) or {}
    strings = _json(self.storage, base + STRINGS, "the strings",
                    limit=MAX_METADATA_BYTES, required=False) or {}
    impls = self._key_impls(base)
    item_spec = storage_lib.join(self.storage.spec, rel)
    kv = ocdbt.database(item_spec) if meta.get("use_ocdbt") else None
    driver = "zarr3" if meta.get("use_zarr3") else "zarr"
    fill = not meta.get("store_array_data_equal_to_fill_value", False)

    flat: list[tuple[list[tuple[str, int]], Any]] = []
    opening: list[tuple[int, str, str, str, Any]] = []
    for keystr, entry in entries.items():
      try:
        keys = [(str(k["key"]), int(k["key_type"]))
                for k in entry["key_metadata"]]
        vm = entry["value_metadata"]
        vtype, skip_read = vm["value_type"], bool(vm.get("skip_deserialize"))
      except (KeyError, TypeError, ValueError):
        raise OrbaxImportError(f"{where}/{TREE_METADATA}: entry {keystr} is "
                               f"not an Orbax tree entry: {_brief(entry)}"
                               ) from None
      name = ".".join(k for k, _ in keys)  # Orbax's parameter name
      path = "/".join([label] * bool(label) + [k for k, _ in keys])
      if vtype in _EMPTY:
        flat.append((keys, _EMPTY[vtype]()))
        continue
      if vtype == "placeholder":  # saved with no data (ocp.PLACEHOLDER)
        flat.append((keys, None))
        continue
      if vtype == "string" and not skip_read:
        if not isinstance(strings.get(name), str):
          raise OrbaxImportError(
              f"leaf {path!r}: Orbax string {name!r} is missing from "
              f"{where}/{STRINGS}")
        flat.append((keys, strings[name]))
        self.leaves += 1
        continue
      if vtype not in (*_ARRAY_TYPES, "scalar") or skip_read:
        how = ("in Orbax's aggregate file (saved with aggregate=True)"
               if skip_read else f"of Orbax value type {vtype!r} (a custom "
               "TypeHandler)")
        raise OrbaxImportError(
            f"leaf {path!r} (Orbax {name!r} in {where}) is stored {how}, "
            "which ckpt cannot read; restore it with Orbax and save it with "
            "ckpt.Checkpointer")
      store_kv = ({**kv, "path": name + "/"} if kv is not None else
                  storage_lib.join(item_spec, name))
      spec = {"driver": driver, "kvstore": store_kv}
      if not fill:
        spec["fill_missing_data_reads"] = False  # a lost chunk is an error
      flat.append((keys, None))
      opening.append((len(flat) - 1, path, name, vtype,
                      ts.open(spec, open=True, read=True,
                              context=self.context)))

    scalars = []
    for i, path, name, vtype, future in opening:
      try:
        store = future.result()
      except Exception as e:  # pylint: disable=broad-except
        raise OrbaxImportError(
            f"leaf {path!r}: cannot open Orbax array {name!r} in {where}: "
            f"{e}") from e
      if vtype == "scalar":
        scalars.append((i, path, name, store[()].read()))
        continue
      sharding = None
      raw = shardings.get(base64.urlsafe_b64encode(name.encode()).decode())
      if vtype == "jax.Array" and raw is not None:
        try:
          sharding = _mesh_sharding(json.loads(raw))
        except (ValueError, TypeError, KeyError) as e:
          raise OrbaxImportError(
              f"leaf {path!r}: its saved sharding in {where}/{SHARDINGS} is "
              f"not one ckpt reads ({e}): {_brief(raw)}") from None
      source = leafsource.LeafSource(
          store, describe=f"Orbax array {name!r} in {where}",
          sharding=sharding, prng_impl=impls.get(name, ""), cache=self.cache)
      if sharding is not None and not _divides(sharding, source.shape):
        source.sharding = None  # uneven: kept, as a host value
      flat[i] = (flat[i][0], source)
      self.leaves += 1
      self.nbytes += source.nbytes
    for i, path, name, future in scalars:
      try:
        value = future.result()
      except Exception as e:  # pylint: disable=broad-except
        raise OrbaxImportError(f"leaf {path!r}: reading Orbax scalar {name!r} "
                               f"in {where} failed: {e}") from e
      flat[i] = (flat[i][0], value.item())  # as Orbax restores a scalar
      self.leaves += 1
    return _build(flat, where)

  def _key_impls(self, base: str) -> dict[str, str]:
    """Orbax parameter name -> PRNG implementation, of typed key arrays."""
    out: dict[str, str] = {}
    files = _list(self.storage, base + ARRAY_METADATAS + "/")
    for f in files:
      doc = _json(self.storage, f"{base}{ARRAY_METADATAS}/{f}",
                  "the array metadata", limit=MAX_METADATA_BYTES)
      for m in (doc or {}).get("array_metadatas", ()) or ():
        m = (m or {}).get("array_metadata") or {}
        impl = (m.get("ext_metadata") or {}).get("random_key_impl")
        if isinstance(impl, str) and isinstance(m.get("param_name"), str):
          out[m["param_name"]] = impl
    return out


def _divides(sharding: NamedSharding, shape: tuple[int, ...]) -> bool:
  try:
    sharding.shard_shape(shape)
    return True
  except Exception:  # pylint: disable=broad-except  (uneven or wrong rank)
    return False


def _count_json_leaves(v: Any) -> int:
  if isinstance(v, dict):
    return sum(_count_json_leaves(x) for x in v.values())
  if isinstance(v, list):
    return sum(_count_json_leaves(x) for x in v)
  return int(v is not None)


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
