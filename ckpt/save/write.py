"""The save data path, stage by stage (see DESIGN.md):

1. flatten   state -> named leaves                      (caller thread)
2. plan      leaf kinds, array specs, who writes what   (caller thread, pure)
3. stage     device -> host copies of owned boxes       (background, bounded)
4. write     TensorStore writes under one ByteLimiter   (background)
5. barrier   every process has written
6. index     process 0 writes index.msgpack
7. commit    rename (POSIX) or commit marker (object stores)
8. retention process 0 deletes what the policy drops (checkpointer.py)
9. barrier   the save is complete everywhere

Stages 3 and 4 are one pipeline: an owned box takes its bytes from the
limiter before it is staged and gives them back once TensorStore has
committed it, so host memory held by a save stays within the budget. The
caller is released (``on_staged``) when the last box is staged, so it may
then donate or delete its arrays.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from ckpt.format import index as index_lib
from ckpt.save import leafsource
from ckpt.multihost import process as multihost
from ckpt.store import ocdbt
from ckpt.save import polite
from ckpt.save import pack as pack_lib
from ckpt.shards import merge_groups
from ckpt.shards import placement as placement_lib
from ckpt.shards import plan as plan_lib
from ckpt.format import prng
from ckpt.format import tree
from ckpt.store import tsfuture
from ckpt.format import tsspec
from ckpt.format.crc import checksum
from ckpt.errors import (CheckpointError, CorruptCheckpointError,
                         InvalidStateError)
from ckpt.store.limiter import ByteLimiter

INLINE_MAX_BYTES = 256
# Staging and checksumming a box this small runs on the event loop: a hop to
# a worker thread and back (through the loop's self-pipe, under the GIL)
# costs more than the work itself, and with 10,000 leaves it dominates.
INLINE_WORK_BYTES = 256 << 10


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
class SaveStats:
  """What one process did in one save (``Checkpointer.last_save_stats``)."""
  step: int = -1
  bytes_written: int = 0
  boxes_written: int = 0
  array_leaves: int = 0
  inline_leaves: int = 0
  peak_bytes_in_flight: int = 0
  blocking_s: float = 0.0
  total_s: float = 0.0
  skipped: bool = False
  # Where the time went (seconds, this process): plan_save on the caller's
  # thread, and the calls into the coordination service over the whole save
  # (the agreement round, barriers, posts; the wait for other processes at
  # barriers included), with how many barriers and key-value calls it made.
  plan_s: float = 0.0
  coordination_s: float = 0.0
  barriers: int = 0
  kv_calls: int = 0
  # Leaves this save planned anew: 0 when it reused the plan of the
  # previous save (the same tree, shapes, dtypes and shardings; see
  # ckpt/save/plan_cache.py).
  planned_leaves: int = 0


HOST_REPLICATED = index_lib.HOST_REPLICATED


@dataclasses.dataclass
class LeafPlan:
  parts: tree.PathParts
  source: Any                       # the user's array (dropped after staging)
  entry: index_lib.Entry
  layout: plan_lib.LeafLayout | None = None

  @property
  def packed(self) -> bool:
    """Stored in this step's packs (ckpt/save/pack.py), not as an array."""
    return isinstance(self.entry, index_lib.PackedEntry)

  @property
  def host_replicated(self) -> bool:
    """A host numpy leaf saved with no partitioner sharding: one value for
    the whole job, whose chunks each process writes from its own copy (so
    every process must hold the same value; ckpt/multihost/agreement.py checks)."""
    return (isinstance(self.source, np.ndarray)
            and isinstance(self.entry, (index_lib.ArrayEntry,
                                        index_lib.PackedEntry))
            and self.entry.sharding == HOST_REPLICATED)


@dataclasses.dataclass
class SavePlan:
  structure: Any
  leaves: list[LeafPlan]
  writes: list[plan_lib.Write]      # this process's writes, nobody else's
  options: SaveOptions
  # The caller waits until the save is committed (async_save=False): its
  # arrays may be written from directly, with no staging copy.
  borrow: bool = False


def _stored_dtype(dtype: np.dtype, save_dtype) -> np.dtype:
  if save_dtype is not None and jnp.issubdtype(dtype, jnp.floating):
    return np.dtype(save_dtype)
  return np.dtype(dtype)


def _describe_sharding(x: Any, sharding) -> str:
  if sharding is None:
    return HOST_REPLICATED
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


def _saved_sharding(sharding, rank: int) -> index_lib.SavedSharding | None:
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
def _record(sharding, rank: int) -> index_lib.SavedSharding | None:
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
    return index_lib.decode_saved_sharding(doc, "", rank)
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
  for parts, x in flat:
    name = tree.path_str(parts)
    value = inline_leaf(parts, x, options)
    if value is not None:
      leaves.append(value)
      continue
    impl = ""
    if isinstance(x, jax.Array):
      # Recorded over the keys' dimensions for a key leaf.
      saved = _saved_sharding(x.sharding, x.ndim)
      if prng.is_key_dtype(x.dtype):  # stored as its key data (ckpt/format/prng.py)
        impl, x = _key_data(name, x)
      stored = _leaf_dtype(name, x.dtype, options.save_dtype)
      where = placement_lib.placement(x.sharding, x.shape, process)
      sharding_text = _describe_sharding(x, x.sharding)
    elif isinstance(x, np.ndarray):
      stored = _leaf_dtype(name, x.dtype, options.save_dtype)
      sharding = partitioner(name, x.shape) if partitioner else None
      if sharding is None:
        where = placement_lib.host_replicated(x.shape, process, process_count)
      else:
        where = placement_lib.placement(sharding, x.shape, process)
      sharding_text = _describe_sharding(x, sharding)
      saved = _saved_sharding(sharding, x.ndim)
    else:  # a LeafSource (inline_leaf rejected anything else)
      impl = x.prng_impl
      stored = _leaf_dtype(name, x.dtype, options.save_dtype)
      where = x.placement(process, process_count)
      sharding_text = _describe_sharding(x, x.sharding)
      saved = _saved_sharding(x.sharding, len(x.shape))
    layout = plan_lib.leaf_layout(x.shape, stored.itemsize, where,
                                  min(options.chunk_bytes, options.max_item_bytes))
    if pack_lib.packable(math.prod(layout.shape) * stored.itemsize):
      entry = index_lib.PackedEntry(
          path=parts, shape=layout.shape, dtype=stored.name,
          source_dtype=np.dtype(x.dtype).name, sharding=sharding_text,
          prng_impl=impl, saved_sharding=saved)
    else:
      entry = index_lib.ArrayEntry(
          path=parts, relpath=tree.storage_relpath(parts), shape=layout.shape,
          dtype=stored.name, chunks=layout.chunks,
          codec=options.codec.to_json(), source_dtype=np.dtype(x.dtype).name,
          sharding=sharding_text, prng_impl=impl, saved_sharding=saved)
    layout_leaf.append(len(leaves))
    layouts.append(layout)
    leaves.append(LeafPlan(parts, x, entry, layout))
  writes = [w._replace(leaf=layout_leaf[w.leaf])  # layout -> leaf
            for w in plan_lib.assign_writes(layouts, process,
                                            options.max_item_bytes)]
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
  if isinstance(x, jax.Array):
    if not (x.is_fully_replicated and x.nbytes <= options.inline_max_bytes):
      return None
    impl = ""
    saved = _saved_sharding(x.sharding, x.ndim)
    if prng.is_key_dtype(x.dtype):  # stored as its key data (ckpt/format/prng.py)
      impl, x = _key_data(name, x)
    stored = _leaf_dtype(name, x.dtype, options.save_dtype)
    if x.is_deleted():  # jax's own error would name no leaf (staging's,
      raise InvalidStateError(  # for the others, names it)
          f"leaf {name!r}: expected a live jax.Array, found one that has "
          "been deleted (donated to a jitted call, or .delete()d) before "
          "save(); save the state before donating it")
    value = np.asarray(x).astype(stored)
    return LeafPlan(parts, None, index_lib.ValueEntry(
        parts, value, impl, saved_sharding=saved))
  if isinstance(x, np.ndarray):
    if x.nbytes > options.inline_max_bytes:
      return None
    stored = _leaf_dtype(name, x.dtype, options.save_dtype)
    return LeafPlan(parts, None, index_lib.ValueEntry(parts, x.astype(stored)))
  if isinstance(x, leafsource.LeafSource):  # ckpt import: read per box
    if not (x.inline_ok and x.nbytes <= options.inline_max_bytes):
      return None
    stored = _leaf_dtype(name, x.dtype, options.save_dtype)
    return LeafPlan(parts, None, index_lib.ValueEntry(
        parts, x.read_all().astype(stored), x.prng_impl))
  if isinstance(x, (bool, int, float, str, bytes, np.generic)):
    value = x
    if isinstance(x, np.generic):
      stored = _leaf_dtype(name, x.dtype, options.save_dtype, inline=True)
      value = np.asarray(x).astype(stored)[()]
    index_lib.encode_value(value, parts)  # rejects what cannot be stored, now
    return LeafPlan(parts, None, index_lib.ValueEntry(parts, value))
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
  if dtype.name not in index_lib.ALLOWED_DTYPES:
    raise InvalidStateError(
        f"leaf {name!r} has dtype {dtype}, which ckpt cannot store; expected "
        f"one of {sorted(index_lib.ALLOWED_DTYPES)}")


def _leaf_dtype(name: str, dtype: Any, save_dtype, *,
                inline: bool = False) -> np.dtype:
  """The dtype a leaf is stored in; InvalidStateError naming the leaf if
  it has none (a jax extended dtype, or one numpy does not know). Inline
  scalars are checked by index.encode_value instead."""
  if prng.is_extended_dtype(dtype):
    raise InvalidStateError(
        f"leaf {name!r} has the jax extended dtype {dtype}, which ckpt cannot "
        "store; expected a numpy dtype or a typed PRNG key "
        f"(jax.random.key), or one of {sorted(index_lib.ALLOWED_DTYPES)}")
  try:
    stored = _stored_dtype(dtype, save_dtype)
  except TypeError as e:
    raise InvalidStateError(
        f"leaf {name!r} has dtype {dtype}, which ckpt cannot store (no numpy "
        f"dtype: {e}); expected one of {sorted(index_lib.ALLOWED_DTYPES)}"
    ) from e
  if not inline:
    _check_dtype(name, stored)
  return stored


def _key_data(name: str, x: jax.Array) -> tuple[str, jax.Array]:
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


def _device_piece(leaf: LeafPlan, write: plan_lib.Write) -> Any:
  """Stage 3a: where one owned box comes from, its device-to-host copy
  started.

  A jax.Array's box is its device buffer, or on an accelerator a slice of
  it cut on the device (so only the box moves); ``copy_to_host_async``
  starts the transfer without waiting, so the transfers of every box that
  fits in the budget (of all local devices) overlap and ``_host_box`` only
  waits for them. The same calls run on CPU devices, where nothing is
  copied (``_host_box`` takes a view of the buffer, cut on the host). A
  host numpy leaf is cut as a view.
  """
  src = leaf.source
  if isinstance(src, leafsource.LeafSource):
    return src.read(write.box)  # started now, waited for by _host_box
  if not isinstance(src, jax.Array):
    return src[write.box.slices()]
  shard = next(s for s in src.addressable_shards if s.device.id == write.device)
  piece = shard.data
  if write.box != write.shard and _cut_on_device(shard.device):
    piece = piece[write.box.relative_to(write.shard)]  # only the box moves
  piece.copy_to_host_async()  # CPU: nothing to copy (np.asarray is a view)
  return piece


def _cut_on_device(device) -> bool:
  """Whether a box that is part of a shard is sliced on the device before
  its transfer (accelerators), not on the host (CPU: a view, no copy)."""
  return device.platform != "cpu"


def _is_view(leaf: LeafPlan, piece: Any) -> bool:
  """Whether ``_host_box`` of ``piece`` only takes a view (a CPU device
  buffer in the stored dtype): work too small for a worker thread."""
  return (isinstance(piece, jax.Array)
          and piece.dtype == np.dtype(leaf.entry.dtype)
          and all(d.platform == "cpu" for d in piece.devices()))


def _host_box(leaf: LeafPlan, write: plan_lib.Write, piece: Any,
              borrow: bool = False) -> np.ndarray:
  """Stage 3b: one owned box on the host, in the stored dtype, safe to
  write after save() returns (the caller may then delete, donate or
  overwrite its arrays).

  From a CPU device the box is a read-only view of the device buffer, not
  a copy, in async mode too: the view keeps the buffer alive when the
  caller deletes its array or drops the last reference, and XLA does not
  donate a buffer that has outside references (a jitted step that donates
  it allocates its output instead, with no error), so the data cannot
  change under the write; tests/save/test_zero_copy.py shows each case. From an
  accelerator ``np.asarray`` waits for the transfer ``_device_piece``
  started and is ckpt's own copy; a cast makes a new array anyway. A host
  numpy leaf is mutable, so it is copied unless the caller waits for the
  whole save (``borrow``).
  """
  if isinstance(piece, leafsource.PendingRead):
    host, owned = piece.result(), True  # a new array, ckpt's own
  elif isinstance(piece, jax.Array):
    host = np.asarray(piece)  # CPU: a view; accelerator: the host copy
    if host.shape != write.box.shape:  # a CPU device's whole buffer
      host = host[write.box.relative_to(write.shard)]  # a view of the box
    owned = True
  else:
    host, owned = piece, borrow
  dtype = np.dtype(leaf.entry.dtype)
  if host.dtype != dtype:
    return host.astype(dtype, order="C")
  return host if owned else np.array(host, order="C", copy=True)


async def _open_arrays(plan: SavePlan, step_kvstore: dict, context: ts.Context,
                       process: int,
                       process_count: int = 1) -> dict[int, ts.TensorStore]:
  """Each array is created (its metadata written) by one process, the
  arrays dealt round-robin over the processes (``creates``), so no process
  creates more than its share of them; the others open the ones they write
  without reading anything (``assume_metadata``). Every array is created
  before the "written" barrier, whether or not anybody writes a box of it.

  With format "ocdbt" each process writes into its own database, merged at
  finalize (ckpt/store/ocdbt.py); process 0 creates every array, so its database
  holds the metadata of every array.
  """
  if plan.options.storage_format == "ocdbt":
    process_count = 1
  arrays_in = [i for i, lp in enumerate(plan.leaves)
               if lp.layout is not None and not lp.packed]
  mine = {w.leaf for w in plan.writes}
  creates = {i for k, i in enumerate(arrays_in)
             if k % process_count == process}
  wanted = [i for i in arrays_in if i in creates or i in mine]
  # In OCDBT every commit adds files: the metadata goes in one transaction.
  txn = ts.Transaction() if plan.options.storage_format == "ocdbt" else None

  async def open_one(i: int):
    e = plan.leaves[i].entry
    kvstore = step_kvstore
    if plan.options.storage_format == "ocdbt":  # this process's database
      kvstore = ocdbt.process_database(step_kvstore, process, e.ocdbt_group)
    spec = tsspec.array_spec(plan.options.storage_format, kvstore,
                             e.relpath, e.shape, np.dtype(e.dtype), e.chunks,
                             plan.options.codec)
    if i in creates:
      return i, await tsfuture.wait(ts.open(spec, create=True,
                                            context=context, transaction=txn))
    return i, await tsfuture.wait(ts.open(spec, open=True, assume_metadata=True,
                                          context=context))

  arrays = dict(await asyncio.gather(*(open_one(i) for i in wanted)))
  if txn is not None:
    await tsfuture.wait(txn.commit_async())
    arrays = {i: a.with_transaction(None) for i, a in arrays.items()}
  return arrays


async def write_owned(plan: SavePlan, step_kvstore: dict, context: ts.Context,
                      limiter: ByteLimiter, stats: SaveStats,
                      on_staged: Callable[[], None]) -> list[list]:
  """Stages 3 and 4 for this process's boxes.

  With ``plan.borrow`` (the caller waits for the whole save) boxes are
  written straight from its arrays, with no staging copy.

  Returns ``[leaf, start, stop, crc32c]`` for every box written with
  format "zarr" (zarr v2 has no checksum codec; finalize writes them to this
  process's checksum file): checksums are taken of the staged data while
  TensorStore writes it, off the caller's path. Empty for "zarr3" and
  "ocdbt", whose chunks carry their own crc32c (tsspec.default_checksum).
  """
  process = multihost.process_index()
  stats.array_leaves = sum(lp.layout is not None for lp in plan.leaves)
  stats.inline_leaves = len(plan.leaves) - stats.array_leaves
  packed = [w for w in plan.writes if plan.leaves[w.leaf].packed]
  array_writes = (plan.writes if not packed else
                  [w for w in plan.writes if not plan.leaves[w.leaf].packed])
  # The arrays are created (metadata written) while staging runs, not
  # before it: in async mode the caller waits for staging only.
  opening = asyncio.ensure_future(
      _open_arrays(plan, step_kvstore, context, process,
                   multihost.process_count()))
  arrays: dict[int, ts.TensorStore] = {}
  tasks: list[asyncio.Task] = []
  staged: list[tuple[plan_lib.Write, np.ndarray, int]] = []  # not writing yet
  sums: list[list] = []
  take_sums = (plan.options.codec.resolved_checksum(
      plan.options.storage_format) == "none")

  async def write_box(w: plan_lib.Write, data: np.ndarray, txn=None):
    try:
      if not arrays:
        arrays.update(await opening)
      store = arrays[w.leaf] if txn is None else arrays[w.leaf].with_transaction(txn)
      # ``data`` never changes from here on (a view of an immutable
      # jax.Array, or ckpt's own copy), so TensorStore may keep a reference
      # to it instead of copying it into its chunk cache.
      write = store[w.box.slices()].write(
          data, can_reference_source_data_indefinitely=True)
      crc = None
      if take_sums:
        crc = (checksum(data) if data.nbytes <= INLINE_WORK_BYTES else
               await asyncio.to_thread(checksum, data))
      await tsfuture.wait(write)
      if take_sums:
        sums.append([w.leaf, list(w.box.start), list(w.box.stop), crc])
    except Exception as e:
      raise CheckpointError(
          f"leaf {tree.path_str(plan.leaves[w.leaf].parts)!r}: writing "
          f"{w.box.start}..{w.box.stop} failed: {e}") from e

  async def write_one(w: plan_lib.Write, data: np.ndarray, grant: int):
    try:
      await write_box(w, data)
      stats.bytes_written += data.nbytes
      stats.boxes_written += 1
    finally:
      limiter.release(grant)

  async def write_batch(batch: list[tuple[plan_lib.Write, np.ndarray, int]]):
    """format "ocdbt": the staged boxes in ONE transaction, so one OCDBT
    commit (a data file and a few B+tree nodes) per batch, not per box;
    their bytes stay granted until it is committed (TensorStore holds its
    copy of them in the transaction; ours are dropped once it has it)."""
    txn = ts.Transaction()
    grants = [grant for _, _, grant in batch]
    nbytes = sum(data.nbytes for _, data, _ in batch)
    writes = [w for w, _, _ in batch]
    try:
      await asyncio.gather(*(write_box(w, data, txn) for w, data, _ in batch))
      batch.clear()
      try:
        await tsfuture.wait(txn.commit_async())
      except Exception as e:
        names = sorted({tree.path_str(plan.leaves[w.leaf].parts)
                        for w in writes})
        raise CheckpointError(
            f"committing {len(writes)} boxes of leaves {names[:5]}"
            f"{' ...' if len(names) > 5 else ''} to the OCDBT database of "
            f"process {process} failed: {e}") from e
      stats.bytes_written += nbytes
      stats.boxes_written += len(writes)
    except BaseException:
      if not txn.commit_started:
        txn.abort()
      raise
    finally:
      batch.clear()
      for grant in grants:
        limiter.release(grant)

  write_failed = []  # set by the first write that fails: O(1) to check

  def on_done(t: asyncio.Task) -> None:
    if not t.cancelled() and t.exception() is not None:
      write_failed.append(True)

  def start_writes():
    first = len(tasks)
    if plan.options.storage_format == "ocdbt":
      if staged:
        tasks.append(asyncio.create_task(write_batch(list(staged))))
    else:
      for w, data, grant in staged:
        tasks.append(asyncio.create_task(write_one(w, data, grant)))
    for t in tasks[first:]:
      t.add_done_callback(on_done)
    staged.clear()

  # Staging runs ahead of writing while the budget allows, so that the
  # caller (released once everything is staged) does not wait for writes
  # competing for the same cores; when the budget is full, the staged boxes
  # start writing and free it. Device-to-host copies of every box granted
  # so far start together (``_device_piece``) and are waited for in order
  # (``land``), so the transfers of all local devices overlap.
  started: collections.deque[tuple[plan_lib.Write, Any, int]] = (
      collections.deque())  # copies in flight, oldest first

  async def land():
    while started:
      w, piece, grant = started[0]
      leaf = plan.leaves[w.leaf]
      try:
        data = (_host_box(leaf, w, piece, plan.borrow)
                if w.nbytes <= INLINE_WORK_BYTES or _is_view(leaf, piece)
                else await asyncio.to_thread(
                    _host_box, leaf, w, piece, plan.borrow))
      except CheckpointError as e:  # a LeafSource's read: it says what failed
        raise CheckpointError(f"leaf {tree.path_str(leaf.parts)!r}: {e}") from e
      except Exception as e:
        raise CheckpointError(
            f"leaf {tree.path_str(leaf.parts)!r}: copying {w.box.start}.."
            f"{w.box.stop} to the host failed (was the array deleted or "
            f"donated before save() returned?): {e}") from e
      started.popleft()
      staged.append((w, data, grant))

  def counted(boxes: int, nbytes: int) -> None:
    stats.boxes_written += boxes
    stats.bytes_written += nbytes

  try:
    if packed:  # small leaves: staged into a few packs (ckpt/save/pack.py)
      pack_tasks = await pack_lib.write_packs(
          packed, plan.leaves, functools.partial(pack_lib.host_boxes, plan),
          step_kvstore, context, limiter, process, counted)
      for t in pack_tasks:
        t.add_done_callback(on_done)
      tasks.extend(pack_tasks)
    for w in array_writes:
      if w.box.size == 0:
        continue  # a zero-size shard: nothing to store
      if write_failed:
        break  # a write failed: stop staging, report it below
      grant = limiter.try_acquire(w.nbytes)  # stored bytes, after the cast
      if grant is None:
        await land()
        start_writes()
        grant = await limiter.acquire(w.nbytes)
      leaf = plan.leaves[w.leaf]
      try:
        started.append((w, _device_piece(leaf, w), grant))
      except Exception as e:
        limiter.release(grant)
        raise CheckpointError(
            f"leaf {tree.path_str(leaf.parts)!r}: starting the copy of "
            f"{w.box.start}..{w.box.stop} to the host failed (was the array "
            f"deleted or donated before save() returned?): {e}") from e
    await land()
  except BaseException:
    for _, _, grant in [*started, *staged]:
      limiter.release(grant)
    started.clear()
    staged.clear()
    # Writes already started finish (they hold at most the budget) instead
    # of being cancelled mid-flight: once this raises, this process writes
    # nothing more into the attempt, which is what the "written" barrier
    # tells the others before process 0 removes the failed attempt.
    await asyncio.gather(*tasks, opening, return_exceptions=True)
    raise
  finally:
    for lp in plan.leaves:
      lp.source = None  # the caller's arrays are no longer needed
    on_staged()
  start_writes()
  if not plan.borrow:  # the pool has grown for these writes (polite.py)
    polite.lower_tensorstore_threads()
  try:
    arrays.update(await opening)  # every array exists, even with no box here
  except BaseException:
    await asyncio.gather(*tasks, return_exceptions=True)
    raise
  results = await asyncio.gather(*tasks, return_exceptions=True)
  errors = [r for r in results if isinstance(r, BaseException)]
  if errors:
    raise errors[0]
  stats.peak_bytes_in_flight = limiter.peak_in_use
  return sums


def make_index(plan: SavePlan, step: int, metrics: dict | None,
               process_count: int) -> index_lib.Index:
  """The index. Its size depends on the leaves only, never on the number
  of processes: checksums and host states are in per-process files
  (index.process_file), and each array's entry records its checksum codec
  (crc32c for "zarr3" and "ocdbt", so a reader opens it with the same
  codec chain it was written with)."""
  fmt = plan.options.storage_format
  checksum = plan.options.codec.resolved_checksum(fmt)
  entries = []
  for lp in plan.leaves:
    e = lp.entry
    if (isinstance(e, index_lib.ArrayEntry) and checksum != "none" and
        e.codec.get("checksum") != checksum):
      e = dataclasses.replace(e, codec={**e.codec, "checksum": checksum})
    entries.append(e)
  return index_lib.Index(
      step=step, time=time.time(), storage_format=plan.options.storage_format,
      process_count=process_count, structure=plan.structure,
      leaves=tuple(entries),
      # ints stay ints (the index has always accepted int or float values)
      metrics={k: v if type(v) is int else float(v)
               for k, v in (metrics or {}).items()})


# ---- the other arguments of save() -----------------------------------------
