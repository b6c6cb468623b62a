"""Moving checkpoints in and out of ckpt: safetensors, npz and Orbax.

Export (ckpt/cli/export.py) streams a checkpoint one leaf at a time through
the same lazy leaves that restore uses, so it holds one leaf in memory, not
the whole checkpoint. Keys are leaf paths (``params/layers/0/kernel``).

- safetensors has BF16 and the float8 types, so those leaves keep their
  dtype; int4 is widened to int8 and float8_e4m3b11fnuz to float32 (both
  exact); complex128 has no safetensors type and is refused. Leaves that are
  not arrays (python ints, floats, bools, strings, bytes) go into the header's
  ``__metadata__`` as JSON under ``ckpt.values``, and ``import`` puts them
  back.
- npz is read by plain numpy, which has no bfloat16 or float8: those leaves
  are widened to float32 and int4 to int8 (exact; the saved bits are not
  kept). Python values become 0-d arrays (strings as numpy unicode), so
  ``np.load(allow_pickle=False)`` reads every entry.

Import reads an Orbax checkpoint (ckpt/cli/orbax_import.py: every item, leaf by
leaf, with TensorStore; Orbax itself is not needed) or safetensors files,
whose keys ``a/b/c`` become nested dicts, and writes an ordinary ckpt
checkpoint; an Orbax step's per-process items (ckpt/cli/orbax_perhost.py)
become the host_state of each of its processes.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import os
from typing import Any, Callable, Iterator

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16, float8, int4)
import numpy as np

from ckpt.format import extras as save_extras
from ckpt.format import index as index_lib
from ckpt.restore import lazy
from ckpt.multihost import process as multihost
from ckpt.cli import orbax_import
from ckpt.restore import read as restore_lib
from ckpt.store import storage as storage_lib
from ckpt.format import tree
from ckpt.checkpointer import Checkpointer
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.format import entries
from ckpt.format import pack_index
from ckpt.hf import header as st_header

Progress = Callable[[int, int], None]  # (done, total), cumulative

VALUES_KEY = "ckpt.values"  # safetensors __metadata__: the non-array leaves


class ConvertError(CheckpointError):
  """An export or import that cannot be done as asked."""


# ---- reading a ckpt checkpoint ---------------------------------------------

def open_checkpoint(path, step: int | None = None,
                    storage_options: dict | None = None
                    ) -> tuple[storage_lib.Storage, str, index_lib.Index]:
  """(storage, step directory, index) of a root (+ step) or a step directory.

  Like ``ckpt.load``: ``path`` holding ``index.msgpack`` is one checkpoint;
  otherwise it is a root and ``step`` (default: latest committed) picks one.
  """
  storage = storage_lib.Storage(path, storage_options)
  local = storage.spec["path"].rstrip("/") or "/"
  if storage.is_posix and not os.path.isdir(local):
    what = "is not a directory" if os.path.exists(local) else "does not exist"
    raise CheckpointError(f"{os.fspath(path)} {what}")
  step_dir = restore_lib.locate_path(storage, step)
  return storage, step_dir, restore_lib.read_index(storage, step_dir)


def leaf_nbytes(entry: entries.Entry) -> int:
  if isinstance(entry, (entries.ArrayEntry, pack_index.PackedEntry)):
    return math.prod(entry.shape) * np.dtype(entry.dtype).itemsize
  return getattr(entry.value, "nbytes", 0)


def iter_leaves(storage: storage_lib.Storage, step_dir: str,
                index: index_lib.Index, progress: Progress | None = None,
                budget: int = lazy.DEFAULT_READ_BUDGET
                ) -> Iterator[tuple[str, Any]]:
  """(leaf path, value) in index order, each read when the caller asks:
  arrays as numpy, inline leaves as saved (python or numpy values); typed
  PRNG keys as their key data (uint32), which is what other formats hold."""
  leaves = restore_lib.step_leaves(
      index, storage, step_dir, storage.context(), budget)
  total = sum(leaf_nbytes(e) for e in index.leaves)
  done = 0
  for e in index.leaves:
    value = leaves[e.path]
    if isinstance(value, lazy.LazyLeaf):
      value = value.read()
      if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        value = np.asarray(jax.random.key_data(value))
    done += leaf_nbytes(e)
    if progress:
      progress(done, total)
    yield tree.path_str(e.path), value


# ---- inline python values in safetensors metadata ---------------------------

def encode_py(name: str, v: Any) -> dict[str, Any]:
  if isinstance(v, bytes):
    return {"py": "bytes", "v": base64.b64encode(v).decode()}
  if isinstance(v, (bool, int, float, str)):
    return {"py": type(v).__name__, "v": v}
  raise ConvertError(f"leaf {name!r}: cannot export a {type(v).__name__}")


def _decode_py(name: str, d: Any) -> Any:
  kinds = {"bool": bool, "int": int, "float": float, "str": str}
  if not isinstance(d, dict) or d.get("py") not in (*kinds, "bytes"):
    raise ConvertError(f"{VALUES_KEY}: leaf {name!r} is not a value record: "
                       f"{str(d)[:100]}")
  if d["py"] == "bytes":
    return base64.b64decode(d["v"])
  return kinds[d["py"]](d["v"])


# ---- import: safetensors ------------------------------------------------------

def read_safetensors(path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """(tensors by key, header metadata) of one file; arrays are read-only
  views of a memory map (read when used). The header is parsed as
  untrusted input (ckpt/hf/header.py)."""
  path = os.fspath(path)
  size = os.path.getsize(path)
  try:
    with open(path, "rb") as f:
      n = st_header.header_length(f.read(8), path)
      if n > size - 8:
        raise ConvertError(f"{path}: the safetensors header claims {n} "
                           f"bytes in a file of {size}")
      head = st_header.parse(f.read(n), path)
  except CorruptCheckpointError as e:
    raise ConvertError(str(e)) from None
  body = size - 8 - n
  if head.data_end > body:
    raise ConvertError(f"{path}: its tensors end at data byte "
                       f"{head.data_end}, outside the file's {body} bytes")
  data = (np.memmap(path, np.uint8, "r", offset=8 + n, shape=(body,))
          if body else np.zeros(0, np.uint8))
  out = {key: data[t.begin:t.end].view(t.dtype.newbyteorder("<")).reshape(
      t.shape) for key, t in head.tensors.items()}
  return out, dict(head.metadata)


def safetensors_files(src) -> list[str]:
  """A .safetensors file, or every one in a directory (sharded models)."""
  src = os.fspath(src)
  if os.path.isdir(src):
    files = sorted(os.path.join(src, f) for f in os.listdir(src)
                   if f.endswith(".safetensors"))
    if not files:
      raise ConvertError(f"{src} holds no .safetensors files")
    return files
  return [src]


def nest_keys(flat: dict[str, Any], sep: str = "/") -> dict[str, Any]:
  """{"a/b/c": x} -> {"a": {"b": {"c": x}}}; a key that is also a prefix of
  another (``a/b`` and ``a/b/c``) is an error."""
  out: dict[str, Any] = {}
  for key, value in flat.items():
    parts = key.split(sep) if sep else [key]
    if not all(parts):
      raise ConvertError(f"key {key!r} has an empty part (split on {sep!r})")
    node = out
    for i, p in enumerate(parts[:-1]):
      node = node.setdefault(p, {})
      if not isinstance(node, dict):
        raise ConvertError(f"key {key!r}: {sep.join(parts[:i + 1])!r} is "
                           "both a tensor and a prefix of other keys")
    if parts[-1] in node:
      raise ConvertError(f"key {key!r} is both a tensor and a prefix of "
                         "other keys (or appears twice)")
    node[parts[-1]] = value
  return out


def read_safetensors_tree(src, sep: str = "/",
                          progress: Progress | None = None) -> dict[str, Any]:
  """Every tensor (and ckpt.values) of the file(s) at ``src``, nested."""
  flat: dict[str, Any] = {}
  files = safetensors_files(src)
  for i, path in enumerate(files):
    tensors, meta = read_safetensors(path)
    raw = meta.get(VALUES_KEY)
    if raw is not None:
      try:
        values = json.loads(raw)
      except ValueError:
        raise ConvertError(f"{path}: {VALUES_KEY} metadata is not JSON"
                           ) from None
      if not isinstance(values, dict):
        raise ConvertError(f"{path}: {VALUES_KEY} metadata is not an object")
      tensors.update({k: _decode_py(k, v) for k, v in values.items()})
    for key, value in tensors.items():
      if key in flat:
        raise ConvertError(f"key {key!r} is in more than one file "
                           f"({os.path.basename(path)} and an earlier one)")
      flat[key] = value
    if progress:
      progress(i + 1, len(files))
  return nest_keys(flat, sep)


# ---- import: Orbax and safetensors ---------------------------------------------

def detect(src) -> str:
  """"orbax" or "safetensors": what kind of checkpoint ``src`` is (a path,
  a file:// URL, or a bucket URL: Orbax)."""
  src = os.fspath(src)
  local = orbax_import.local_path(src)
  if local is None:
    return "orbax"  # gs://, s3://: only Orbax checkpoints are read there
  if not os.path.exists(local):
    raise ConvertError(f"{src} does not exist")
  if os.path.isfile(local):
    with open(local, "rb") as f:
      head = f.read(9)
    if local.endswith(".safetensors") or head[8:9] == b"{":
      return "safetensors"
    raise ConvertError(f"{src} is a file but not a safetensors file")
  if orbax_import.is_orbax_dir(local):
    return "orbax"
  if any(f.endswith(".safetensors") for f in os.listdir(local)):
    return "safetensors"
  steps = sorted((d for d in os.listdir(local) if d.isdigit() and
                  orbax_import.is_orbax_dir(os.path.join(local, d))), key=int)
  if steps:
    raise ConvertError(
        f"{src} is an Orbax CheckpointManager directory with steps "
        f"{steps[:10]}; pass one step's directory, e.g. "
        f"{os.path.join(src, steps[-1])}")
  raise ConvertError(f"{src} is neither an Orbax PyTree checkpoint (no "
                     "_METADATA, _CHECKPOINT_METADATA or manifest.ocdbt) nor "
                     "a safetensors file or directory of them")


@dataclasses.dataclass
class ImportReport:
  source: str
  kind: str
  directory: str
  step: int
  leaves: int = 0
  bytes: int = 0
  # Orbax: each item imported ("" for a PyTree item directory) and its kind
  # ("pytree", "array", "json", "metrics", "host_state"); what ``skip``
  # left out; how many source processes' host_state the step holds (0:
  # none, then host_state(step) is None on any number of processes).
  items: dict[str, str] = dataclasses.field(default_factory=dict)
  skipped: list[str] = dataclasses.field(default_factory=list)
  metrics: dict[str, Any] | None = None
  host_state_processes: int = 0
  # This process's save: the most data bytes it held at once (within
  # concurrent_bytes) and the bytes it wrote (its share in a job of several).
  peak_bytes_in_flight: int = 0
  bytes_written: int = 0

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def import_checkpoint(src, directory, step: int, *, kind: str = "auto",
                      sep: str = "/", storage_options: dict | None = None,
                      source_storage_options: dict | None = None,
                      skip=(), progress: Progress | None = None,
                      allow_sparse: bool = False,
                      **checkpointer_options) -> ImportReport:
  """Reads ``src`` (Orbax or safetensors) and saves it as ``step`` of the
  ckpt checkpoint root ``directory``.

  An Orbax source (a path or a file://, gs:// or s3:// URL, opened with
  ``source_storage_options``) is read leaf by leaf while the save writes
  it: host memory holds at most ``concurrent_bytes`` (a Checkpointer
  option) of its data, plus one Orbax chunk when a chunk is larger than
  that. Every item is imported or refused by name (see
  ckpt/cli/orbax_import.py); ``skip`` names items (or "metrics",
  "custom_metadata") to leave out on purpose. The source is untrusted
  input (ckpt/cli/orbax_bounds.py): what it cannot be is refused with an
  OrbaxImportError naming the file, before anything is written; arrays that
  claim more than orbax_bounds.SPARSE_FACTOR times the bytes the source
  stores are refused unless ``allow_sparse``.
  """
  src = os.fspath(src)
  report = ImportReport(source=src, kind=kind, directory=os.fspath(directory),
                        step=step)
  # In a job of several processes (each calls this; each reads and writes
  # its share of every leaf), what one process fails to read reaches the
  # others here, before the save's own rounds.
  key = multihost.call_key("import", os.fspath(directory), step)
  state, metrics, error, host_states = None, None, None, None
  try:
    state, metrics, host_states = _read_source(
        src, kind, sep, source_storage_options, skip, progress, report,
        allow_sparse)
  except Exception as e:  # pylint: disable=broad-except
    error = e
  multihost.all_ok(
      key, error, f"importing {src} as step {step}",
      timeout_s=checkpointer_options.get("barrier_timeout_s",
                                         multihost.DEFAULT_TIMEOUT_S),
      same=f"{report.kind} {src}: {report.leaves} leaves, {report.bytes} bytes",
      differ="Every process must import the same source.")
  with Checkpointer(directory, async_save=False,
                    storage_options=storage_options,
                    **checkpointer_options) as ckptr:
    if step in ckptr.all_steps():
      raise ConvertError(f"step {step} already exists in "
                         f"{os.fspath(directory)}; pick another --step")
    # Per-process items: one host_state file per source process, read back
    # by a job of as many processes (host_state(step)); else none.
    ckptr.save(step, state, metrics=metrics, host_state=(
        save_extras.EveryProcess(host_states) if host_states else None))
    stats = ckptr.last_save_stats
    report.peak_bytes_in_flight = stats.peak_bytes_in_flight
    report.bytes_written = stats.bytes_written
  return report


def _read_source(src: str, kind: str, sep: str, storage_options, skip,
                 progress, report: ImportReport,
                 allow_sparse: bool = False) -> tuple[Any, Any, Any]:
  """(state to save, metrics, every source process's host_state or None)
  of the source; fills in ``report``."""
  kind = report.kind = detect(src) if kind == "auto" else kind
  if kind == "orbax":
    found = orbax_import.read_step(src, storage_options=storage_options,
                                   skip=skip, allow_sparse=allow_sparse)
    report.leaves, report.bytes = found.leaves, found.bytes
    report.items, report.skipped = found.items, found.skipped
    report.metrics = found.metrics
    report.host_state_processes = len(found.host_states or ())
    return found.tree, found.metrics, found.host_states
  if kind != "safetensors":
    raise ConvertError(f"unknown source kind {kind!r}: expected orbax or "
                       "safetensors")
  local = orbax_import.local_path(src)
  if local is None:
    raise ConvertError(f"{src}: safetensors are read from local files only")
  if skip:
    raise ConvertError(f"skip={list(skip)} is for Orbax items; {src} is "
                       "safetensors")
  state = read_safetensors_tree(local, sep, progress)
  flat = tree.flatten(state)
  report.leaves = len(flat)
  report.bytes = sum(getattr(x, "nbytes", 0) for _, x in flat)
  return state, None, None
