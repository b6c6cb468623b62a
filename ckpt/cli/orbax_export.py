"""``ckpt export --to orbax`` (and ``ckpt.export_orbax``): one ckpt checkpoint
written as one step of an Orbax ``CheckpointManager``, which Orbax restores
bit-exact with its own ``StandardCheckpointer`` or ``CheckpointManager``:

  <out>/<step>/
    _CHECKPOINT_METADATA      item handlers, the step's metrics, custom_metadata
    default/                  the PyTree item (StandardCheckpointer.restore path)
      _METADATA  _sharding  _strings.json  array_metadatas/process_0
      manifest.ocdbt  d/...   one OCDBT database of zarr arrays
    metrics/metrics           the step's metrics (when it has some), as Orbax
                              writes them with ``best_fn``

Why the layout is written with TensorStore and not with Orbax's own save:
Orbax's save takes the whole state in memory (every leaf as a ``jax.Array``
or numpy array at once), and a checkpoint may be larger than the host that
exports it. Here each array is copied box by box (whole chunks of the ckpt
array, rows of chunks where they fit) from ckpt's lazy leaves (each box
verified against its recorded crc32c as it is read) into its zarr array,
under one byte budget for every box in flight: memory stays within
``concurrent_bytes`` whatever the checkpoint's size. The files Orbax reads
besides the arrays are small JSON documents (ckpt/cli/orbax_layout.py);
their format is pinned by a test that restores an export with Orbax itself.
Orbax's defaults are kept (OCDBT, zarr v2, every chunk stored), but chunks
are raw unless ``compression="zstd"``.

The step is written under ``<step>.orbax-checkpoint-tmp-<ns>`` and renamed
(a local directory), as Orbax commits; on an object store it is written in
place and ``commit_success.txt`` (Orbax's commit marker there) comes last.
One process writes (export is not collective).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import time
from typing import Any

import numpy as np
import tensorstore as ts

from ckpt.cli import orbax_layout
from ckpt.cli.convert import ConvertError, Progress, open_checkpoint
from ckpt.format import index as index_lib
from ckpt.restore import checksums
from ckpt.restore import read as restore_lib
from ckpt.restore import tasks
from ckpt.store import ocdbt
from ckpt.store import storage as storage_lib
from ckpt.store import tsfuture
from ckpt.store.limiter import ByteLimiter
from ckpt.store.urls import join

ITEM = "default"
METRICS_ITEM = "metrics"
STEP_METADATA = "_CHECKPOINT_METADATA"
COMMIT_FILE = "commit_success.txt"
TMP_MARK = ".orbax-checkpoint-tmp-"
_HANDLERS = "orbax.checkpoint._src.handlers."
PYTREE_HANDLER = (_HANDLERS +
                  "standard_checkpoint_handler.StandardCheckpointHandler")
JSON_HANDLER = _HANDLERS + "json_checkpoint_handler.JsonCheckpointHandler"
DEFAULT_CONCURRENT_BYTES = 1 << 30
_LEAVES_AT_ONCE = 16  # leaves opened and copied concurrently
# Orbax's OCDBT write options (tensorstore_utils._add_ocdbt_write_options).
_OCDBT_CONFIG = {"max_inline_value_bytes": 1024,
                 "max_decoded_node_bytes": 100_000_000,
                 "manifest_kind": "single"}


@dataclasses.dataclass
class OrbaxExportReport:
  """What ``export_orbax`` wrote."""
  out: str           # the Orbax root (a CheckpointManager directory)
  step_dir: str      # <out>/<step>
  item_dir: str      # <out>/<step>/default: StandardCheckpointer's path
  step: int
  arrays: int = 0    # zarr arrays written (arrays and scalars)
  values: int = 0    # strings and empty nodes (no array)
  bytes: int = 0     # array bytes copied
  peak_bytes: int = 0  # the most bytes in flight at once (<= the budget)
  metrics: bool = False

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def export_orbax(path, out, *, step: int | None = None,
                 storage_options: dict | None = None,
                 out_storage_options: dict | None = None,
                 concurrent_bytes: int = DEFAULT_CONCURRENT_BYTES,
                 compression: str | None = None, verify: bool = True,
                 progress: Progress | None = None) -> OrbaxExportReport:
  """Writes one ckpt checkpoint as step ``<step>`` of the Orbax root ``out``.

  Args:
    path: a ckpt root (then ``step``, default the latest committed) or one
      step directory; a path or URL.
    out: the Orbax ``CheckpointManager`` root (a path or URL); its step
      directory must not exist yet.
    storage_options / out_storage_options: merged into the TensorStore
      kvstore spec of ``path`` / ``out``.
    concurrent_bytes: the host memory for array data in flight (read and
      being written); a box larger than it proceeds alone.
    compression: None (raw chunks) or "zstd" (Orbax's default codec).
    verify: check every chunk read against the crc32c recorded at save.
    progress: ``fn(done_bytes, total_bytes)``.

  Returns an ``OrbaxExportReport``; restore the export with
  ``ocp.StandardCheckpointer().restore(report.item_dir, target)`` or
  ``ocp.CheckpointManager(out).restore(step, args=ocp.args.StandardRestore(
  target))``.

  Raises:
    ConvertError: a leaf Orbax cannot hold (naming it), or ``out`` already
      has the step.
    CorruptCheckpointError: a chunk whose crc32c differs from the recorded one.

  Not collective: one process reads and writes everything.
  """
  if compression not in (None, "zstd"):
    raise ConvertError(f"compression must be None or 'zstd', got "
                       f"{compression!r}")
  if int(concurrent_bytes) <= 0:
    raise ValueError(f"concurrent_bytes must be positive, got "
                     f"{concurrent_bytes!r}")
  storage, step_dir, index = open_checkpoint(path, step, storage_options)
  leaves = orbax_layout.plan(index)  # refuses what Orbax cannot hold first
  dest = storage_lib.Storage(out, out_storage_options)
  name = str(index.step)
  root = dest.url.rstrip("/")
  report = OrbaxExportReport(out=root, step_dir=f"{root}/{name}",
                             item_dir=f"{root}/{name}/{ITEM}",
                             step=index.step)
  if _exists(dest, name):
    raise ConvertError(f"{report.step_dir} exists already: Orbax steps are "
                       "never overwritten; export into another root, or "
                       "delete that step first")
  work = f"{name}{TMP_MARK}{time.time_ns()}" if dest.is_posix else name
  try:
    tasks.run_sync(_copy_arrays(
        storage, step_dir, index, leaves,
        join(dest.spec, f"{work}/{ITEM}"), dest.context(),
        _Copy(int(concurrent_bytes), compression, verify, progress), report))
    _write_documents(dest, work, index, leaves, report)
    if dest.is_posix:
      os.rename(os.path.join(dest.root, work), os.path.join(dest.root, name))
  except BaseException:
    _remove(dest, work)
    raise
  return report


@dataclasses.dataclass(frozen=True)
class _Copy:
  budget: int
  compression: str | None
  verify: bool
  progress: Progress | None


def _exists(dest: storage_lib.Storage, name: str) -> bool:
  if dest.is_posix:
    return os.path.exists(os.path.join(dest.root, name))
  return bool(dest.list_keys(f"{name}/"))


def _remove(dest: storage_lib.Storage, work: str) -> None:
  """A failed export leaves nothing behind (as far as it can)."""
  try:
    if dest.is_posix:
      shutil.rmtree(os.path.join(dest.root, work), ignore_errors=True)
    else:
      dest.delete_prefix(f"{work}/", "a failed Orbax export")
  except Exception:  # pylint: disable=broad-except
    pass  # the error that got us here matters more


def _array_spec(db: dict, leaf: orbax_layout.Leaf, compression) -> dict:
  """The zarr v2 array of one leaf, as Orbax writes it (every chunk stored,
  zeros too: Orbax reads with ``fill_missing_data_reads=False``)."""
  return {"driver": "zarr", "kvstore": {**db, "path": leaf.name + "/"},
          "dtype": np.dtype(leaf.dtype).name,
          "metadata": {"shape": list(leaf.shape), "chunks": list(leaf.chunks),
                       "compressor": ({"id": "zstd", "level": 1}
                                      if compression else None)},
          "store_data_equal_to_fill_value": True}


async def _copy_arrays(storage, step_dir: str, index: index_lib.Index,
                       leaves: list[orbax_layout.Leaf], item_spec: dict,
                       context: ts.Context, opts: _Copy,
                       report: OrbaxExportReport) -> None:
  """Every array and scalar, box by box, under one byte limiter."""
  source = restore_lib.step_leaves(
      index, storage, step_dir, storage.context(), opts.budget)
  if opts.verify:  # every read checks what it reads (restore/verified.py)
    await checksums.attach(source, storage, step_dir, index)
  db = {**ocdbt.database(item_spec), "config": _OCDBT_CONFIG,
        "assume_config": True}
  limiter = ByteLimiter(opts.budget)
  stored = [leaf for leaf in leaves if leaf.stored]
  total = sum(leaf.nbytes for leaf in stored)
  at_once = asyncio.Semaphore(_LEAVES_AT_ONCE)

  async def copy_box(leaf, src, store, box) -> None:
    extra = src.read_bytes(box) if hasattr(src, "read_bytes") else 0
    grant = await limiter.acquire(box.size * np.dtype(leaf.dtype).itemsize +
                                  extra)
    try:
      data = await src.read_box(box)
      await tsfuture.wait(store[box.slices()].write(data))
    finally:
      limiter.release(grant)
    report.bytes += data.nbytes
    if opts.progress:
      opts.progress(report.bytes, total)

  async def copy_leaf(leaf: orbax_layout.Leaf) -> None:
    async with at_once:
      try:
        store = await tsfuture.wait(ts.open(
            _array_spec(db, leaf, opts.compression), create=True,
            context=context))
      except Exception as e:
        raise ConvertError(
            f"leaf {leaf.path!r}: cannot create its Orbax array "
            f"{leaf.name!r} (shape {leaf.shape}, dtype {leaf.dtype}): {e}"
        ) from e
      if leaf.value_type == "scalar":
        await tsfuture.wait(store.write(np.asarray(leaf.value, leaf.dtype)))
        report.bytes += leaf.nbytes
      else:
        src = source[index.leaves[leaf.entry].path]
        await tasks.gather_or_cancel(*(
            copy_box(leaf, src, store, box) for box in orbax_layout.boxes(
                leaf.shape, leaf.chunks, np.dtype(leaf.dtype).itemsize,
                opts.budget)))
      report.arrays += 1

  try:
    await tasks.gather_or_cancel(*(copy_leaf(leaf) for leaf in stored))
  finally:
    report.peak_bytes = limiter.peak_in_use


def _write_documents(dest: storage_lib.Storage, work: str,
                     index: index_lib.Index, leaves: list[orbax_layout.Leaf],
                     report: OrbaxExportReport) -> None:
  """The JSON files Orbax reads besides the arrays, the commit files last."""
  item = f"{work}/{ITEM}"

  def put(rel: str, doc: Any) -> None:
    dest.write_bytes(rel, json.dumps(doc).encode())

  put(f"{item}/{orbax_layout.TREE_METADATA}",
      orbax_layout.tree_metadata(leaves))
  put(f"{item}/{orbax_layout.SHARDINGS}", orbax_layout.shardings(leaves))
  strings = orbax_layout.strings(leaves)
  if strings:
    put(f"{item}/{orbax_layout.STRINGS}", strings)
  put(f"{item}/{orbax_layout.ARRAY_METADATAS}/process_0",
      orbax_layout.array_metadatas(leaves))
  handlers = {ITEM: PYTREE_HANDLER}
  metrics = dict(index.metrics)
  if metrics:
    put(f"{work}/{METRICS_ITEM}/{METRICS_ITEM}", metrics)
    handlers[METRICS_ITEM] = JSON_HANDLER
    report.metrics = True
  put(f"{work}/{STEP_METADATA}", orbax_layout.step_metadata(
      handlers, metrics, index.time, index_lib.custom_metadata_of(index)))
  report.values = sum(not leaf.stored for leaf in leaves)
  for rel in (item, work):  # what Orbax writes last, in this order
    dest.write_bytes(f"{rel}/{COMMIT_FILE}", (
        f"Checkpoint commit was successful to {dest.url.rstrip('/')}/"
        f"{rel}").encode())
