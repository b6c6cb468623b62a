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
- per-process items (Grain's ``process_<i>-of-<n>.json`` files, JSON items
  named ``<name>_process_<i>-of-<n>``): each source process's
  ``host_state`` (ckpt/cli/orbax_perhost.py).
- Arrays are ``LeafSource`` leaves (ckpt/save/leafsource.py): read box by box
  while the save writes them, with their saved sharding; scalars become
  python numbers and strings python strings, as Orbax restores them;
  typed PRNG keys stay keys of their implementation; empty containers and
  None stay what they were; an Orbax ``PLACEHOLDER`` (saved without data)
  becomes None.

Anything else (an item of another handler in another layout; a leaf
of a custom TypeHandler or in Orbax's old aggregate file; the step's
``custom_metadata``; a metric that is not a number) is refused, naming it,
unless it is named in ``skip``; nothing is dropped silently.

The source is untrusted input: ckpt/cli/orbax_bounds.py lists what it is
held to (names that stay inside their directory, extents, meshes, JSON
nesting, and arrays claiming at most SPARSE_FACTOR times the bytes stored
unless ``allow_sparse``); every refusal is an OrbaxImportError naming the
file and the problem, raised before the import writes anything.
"""

from __future__ import annotations

import dataclasses
import os
import urllib.parse
from typing import Any

from ckpt.save import leafsource
from ckpt.cli import orbax_bounds
from ckpt.cli import orbax_perhost
from ckpt.cli import orbax_tree
from ckpt.errors import CheckpointError
from ckpt.format import extras as save_extras
from ckpt.store import storage as storage_lib
from ckpt.cli.orbax_tree import (LEGACY_AGGREGATE, TREE_METADATA, brief,
                                 read_json)
from ckpt.errors import OrbaxImportError

STEP_METADATA = "_CHECKPOINT_METADATA"
DEFAULT_ITEM = "default"
METRICS_ITEM = "metrics"
CUSTOM_METADATA = "custom_metadata"
_PYTREE_HANDLERS = ("PyTreeCheckpointHandler", "StandardCheckpointHandler")
_ARRAY_HANDLERS = ("ArrayCheckpointHandler",)
_JSON_HANDLERS = ("JsonCheckpointHandler",)


@dataclasses.dataclass
class OrbaxStep:
  """What ``read_step`` found: the tree to save and what it holds."""
  url: str
  tree: Any
  items: dict[str, str]                     # item ("" bare) -> its kind
  metrics: dict[str, Any] | None = None     # for save(metrics=)
  skipped: list[str] = dataclasses.field(default_factory=list)
  # Each source process's host_state (orbax_perhost); None: no such items.
  host_states: list | None = None
  leaves: int = 0
  bytes: int = 0
  cache: leafsource.RegionCache = dataclasses.field(
      default_factory=leafsource.RegionCache)


def local_path(src: str) -> str | None:
  """The local path of ``src`` (a path or file:// URL); None for a bucket."""
  parsed = urllib.parse.urlparse(src)
  scheme = parsed.scheme if len(parsed.scheme) > 1 else ""  # C:\\ on Windows
  if scheme == "file":
    return parsed.path
  return None if scheme else src


def is_orbax_dir(path: str) -> bool:
  """Whether the local directory ``path`` is an Orbax item or step."""
  return os.path.isdir(path) and any(
      os.path.exists(os.path.join(path, f)) for f in (
          TREE_METADATA, STEP_METADATA, LEGACY_AGGREGATE, "manifest.ocdbt"))


def open_source(src, storage_options: dict | None = None
                ) -> storage_lib.Storage:
  """The Storage of a source URL; a local one must be a directory."""
  if (local_path(os.fspath(src)) is not None and
      "file_io_mode" not in (storage_options or {})):
    # pread, not mmap: an import reads each byte once, and mapped pages of
    # the source would count in its resident memory.
    storage_options = {**(storage_options or {}),
                       "file_io_mode": {"mode": "default"}}
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
              skip=(), allow_sparse: bool = False) -> OrbaxStep:
  """Opens an Orbax step or PyTree item directory at ``src`` (a path or
  URL) for import: arrays are opened (metadata read), not read.

  ``allow_sparse``: accept arrays claiming more than
  orbax_bounds.SPARSE_FACTOR times the bytes the source stores (arrays of
  zeros an Orbax did not store); refused by default."""
  storage = open_source(src, storage_options)
  url = storage.url.rstrip("/")
  try:
    return _read_step(storage, url, set(skip), allow_sparse)
  except CheckpointError:
    raise
  except (RecursionError, MemoryError, OverflowError, RuntimeError,
          ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
    # What the checks of orbax_bounds did not foresee: still named.
    raise OrbaxImportError(
        f"{url}: reading the Orbax checkpoint failed ({type(e).__name__}: "
        f"{str(e)[:300]}); a corrupt or hostile checkpoint, or one ckpt "
        "cannot read") from e


def _read_step(storage, url: str, skip: set, allow_sparse: bool
               ) -> OrbaxStep:
  kind = kind_of(storage)
  if kind is None:
    raise OrbaxImportError(
        f"{url} is not an Orbax checkpoint: it has no {TREE_METADATA} (a "
        f"PyTree item directory) and no {STEP_METADATA} (a step directory "
        "of a CheckpointManager)")
  out = OrbaxStep(url=url, tree=None, items={})
  reader = orbax_tree.ItemReader(storage, out.cache)
  if kind == "item":
    out.tree = reader.pytree("", "")
    out.items[""] = "pytree"
  else:
    out.tree = _read_items(storage, reader, out, skip)
  out.leaves, out.bytes = reader.leaves, reader.nbytes
  orbax_bounds.check_claims(storage, reader.claims, url, allow_sparse)
  unknown = sorted(skip - set(out.skipped))
  if unknown:
    raise OrbaxImportError(
        f"{url}: asked to skip {unknown}, which this checkpoint does not "
        f"have (its items: {sorted(n for n in out.items if n)})")
  return out


def _read_items(storage, reader: orbax_tree.ItemReader, out: OrbaxStep,
                skip: set) -> Any:
  meta = read_json(storage, STEP_METADATA, "the step metadata")
  if not isinstance(meta, dict):
    raise OrbaxImportError(f"{out.url}/{STEP_METADATA} is not a JSON object")
  custom = meta.get(CUSTOM_METADATA)
  if custom:
    if CUSTOM_METADATA not in skip:
      raise OrbaxImportError(
          f"{out.url}: the step has custom_metadata {brief(custom)}, which "
          f"ckpt cannot import; pass --skip {CUSTOM_METADATA} (skip="
          f"['{CUSTOM_METADATA}']) to import the rest without it")
    out.skipped.append(CUSTOM_METADATA)
  handlers = meta.get("item_handlers")
  if isinstance(handlers, str):  # a manager of one unnamed item
    handlers = {DEFAULT_ITEM: handlers}
  if not isinstance(handlers, dict) or not handlers:
    handlers = {name: None for name in _item_dirs(storage)}
  for name in handlers:  # each one a directory: nothing opened before
    orbax_bounds.check_key(name, f"{out.url}/{STEP_METADATA}", "item name")
  if not handlers:
    raise OrbaxImportError(f"{out.url} is an Orbax step directory with no "
                           "item in it")
  tree: dict[str, Any] = {}
  groups: dict[str, dict[int, str]] = {}  # per-process: {process: file}
  named: dict[str, dict[int, str]] = {}   # ... JSON items: {process: item}
  for name in sorted(handlers):
    handler = handlers[name] or ""
    short = handler.rsplit(".", 1)[-1] or "unknown handler"
    per = (orbax_perhost.item_process(name) if short in _JSON_HANDLERS
           else None)
    if name in skip or (per and per[0] in skip):
      if (hit := name if name in skip else per[0]) not in out.skipped:
        out.skipped.append(hit)
      continue
    if not _item_exists(storage, name):
      raise OrbaxImportError(
          f"{out.url}: item {name!r} ({short}) is named in {STEP_METADATA} "
          f"but its directory {name}/ is missing or empty")
    if per is not None:
      named.setdefault(per[0], {})[per[1]] = name
      out.items[name] = "host_state"
      continue
    if (short not in _PYTREE_HANDLERS + _ARRAY_HANDLERS and
        not (not handler and storage.exists(f"{name}/{TREE_METADATA}")) and
        (files := orbax_perhost.grain_files(storage, name)) is not None):
      groups[name] = files
      out.items[name] = "host_state"
      continue
    if short in _JSON_HANDLERS:
      value = _json_item(storage, name)
      orbax_bounds.json_depth(value, f"{out.url}/{name} (JSON item)")
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
          f"{out.url}: item {name!r} was saved by "
          f"{handler or 'an unknown handler'}, which ckpt cannot import (it "
          "imports PyTree items: StandardSave, PyTreeSave, ArraySave; JSON "
          "items: JsonSave; and per-process items, such as Grain's "
          "process_<i>-of-<n>.json files, as host_state). Pass --skip "
          f"{name} (skip=[{name!r}]) to import the rest without it")
    tree[name] = value
  for group, names in sorted(named.items()):
    if group in groups or group in tree:
      raise OrbaxImportError(
          f"{out.url}: per-process JSON items {sorted(names.values())[:3]} "
          f"and item {group!r} share the name {group!r}")
    groups[group] = orbax_perhost.json_group(storage, names)
  if groups:
    out.host_states = orbax_perhost.host_states(storage, groups)
  if list(tree) == [DEFAULT_ITEM]:
    # a single-item manager (its metrics item aside): the item is the state
    return tree[DEFAULT_ITEM]
  return tree


def _metrics(value: Any, url: str) -> dict[str, Any]:
  def walk(prefix: str, node: Any) -> None:
    for k, v in node.items():
      if isinstance(v, dict):
        walk(f"{prefix}{k}/", v)
      elif isinstance(v, bool) or not isinstance(v, (int, float)):
        raise OrbaxImportError(
            f"{url}: metric {prefix}{k!r} is {brief(v)}, not a number; ckpt "
            f"keeps numbers as a step's metrics. Pass --skip {METRICS_ITEM} "
            f"(skip=['{METRICS_ITEM}']) to import the rest without them")
  if not isinstance(value, dict):
    raise OrbaxImportError(f"{url}: the metrics item holds {brief(value)}, "
                           "not a JSON object of numbers")
  walk("", value)
  save_extras.check_metrics(value)
  return value


def _item_dirs(storage) -> list[str]:
  if storage.is_posix:
    top = os.fspath(storage.root)
    return sorted(d for d in os.listdir(top)
                  if os.path.isdir(os.path.join(top, d)) and
                  ".orbax-checkpoint-tmp" not in d)
  return sorted({k.split("/", 1)[0] for k in storage.list_all() if "/" in k})


def _item_exists(storage, name: str) -> bool:
  if storage.is_posix:
    return os.path.isdir(os.path.join(os.fspath(storage.root), name))
  return bool(storage.list_keys(f"{name}/"))


def _json_item(storage, name: str) -> Any:
  files = orbax_perhost.data_files(storage, name)
  if len(files) != 1:
    raise OrbaxImportError(
        f"{storage.url.rstrip('/')}/{name}: a JSON item should hold one "
        f"file, found {files[:5]}")
  return read_json(storage, f"{name}/{files[0]}", f"JSON item {name!r}")


def _count_json_leaves(v: Any) -> int:
  if isinstance(v, dict):
    return sum(_count_json_leaves(x) for x in v.values())
  if isinstance(v, list):
    return sum(_count_json_leaves(x) for x in v)
  return int(v is not None)
