"""The restore data path:

discover -> read and validate the index -> match the target -> plan each
process's boxes from the target shardings -> read only those boxes under the
byte budget, cast, assemble ``jax.Array``s.

Matching the target (its shapes, dtypes and shardings) is in
ckpt/restore/targets.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax import tree_util

from ckpt.restore import assemble
from ckpt.restore import checksums
from ckpt.commit import steps as steps_lib
from ckpt.format import index as index_lib
from ckpt.restore import lazy
from ckpt.restore import pack_leaf
from ckpt.restore import pack_read
from ckpt.format import prng
from ckpt.restore import readcount
from ckpt.restore import readonce
from ckpt.restore import readsplit
from ckpt.restore import tasks
from ckpt.restore.targets import (AsSaved, check_divides, target_spec,
                                  out_dtype)
from ckpt.store import gcpause
from ckpt.store import storage as storage_lib
from ckpt.format import tree
from ckpt.errors import (CheckpointError, CheckpointNotFoundError,
                         MissingLeavesError, TreeMismatchError)
from ckpt.store.limiter import ByteLimiter
from ckpt.format import entries


def resolve_step(storage: storage_lib.Storage, step: int | None,
                 steps: list[int] | None = None) -> int:
  """``step`` (default: the latest) after checking it is committed."""
  if steps is None:
    steps = steps_lib.committed_steps(storage)
  if not steps:
    raise CheckpointNotFoundError(
        f"{storage.url!r} holds no committed checkpoint (no "
        f"checkpoint_<step>/ with an index; uncommitted *.tmp-* directories "
        "are ignored)")
  if step is None:
    return steps[-1]
  if step not in steps:
    raise steps_lib.not_committed(storage, step)
  return step


def read_index(storage: storage_lib.Storage, step_dir: str) -> index_lib.Index:
  key = storage.index_key(step_dir)
  where = f"{storage.url.rstrip('/')}/{key}"
  data = storage.read_bytes(key, limit=index_lib.MAX_INDEX_BYTES)
  if data is None:
    raise CheckpointNotFoundError(f"{where} does not exist")
  return index_lib.decode(data, where)


def step_leaves(index: index_lib.Index, storage: storage_lib.Storage,
                step_dir: str, context, budget: int
                ) -> dict[tree.PathParts, Any]:
  """``checkpoint_leaves`` of the step in ``step_dir`` of ``storage``: an
  array held by an earlier step (index version 6, a bucket's
  reuse_unchanged=True) is read from that step's data directory, which
  index.held_dir builds from a step number and a checked attempt name."""
  held = None
  if step_dir.startswith("checkpoint_"):  # opened from its root
    held = lambda ref: storage.step_spec(entries.held_dir(ref))
  return checkpoint_leaves(index, storage.step_spec(step_dir), context,
                           budget, held)


def checkpoint_leaves(index: index_lib.Index, step_kvstore: dict,
                      context, budget: int,
                      held: Callable[[tuple[int, str]], dict] | None = None
                      ) -> dict[tree.PathParts, Any]:
  """path parts -> a LazyLeaf (arrays, stored or inline) or a python value.
  ``held(held_by)``: the kvstore of an earlier step's data directory
  (None: the step was opened on its own, so an array held by another step
  cannot be read)."""
  out: dict[tree.PathParts, Any] = {}
  packed = pack_leaf.lazy_leaves(index, step_kvstore, context)
  for i, e in enumerate(index.leaves):
    if i in packed:
      leaf = packed[i]
    elif isinstance(e, entries.ArrayEntry):
      kvstore = step_kvstore
      if e.held_by is not None:
        if held is None:
          raise CheckpointError(
              f"leaf {tree.path_str(e.path)!r} of step {index.step} is held "
              f"by step {e.held_by[0]} (saved with reuse_unchanged=True on "
              "a bucket): open the checkpoint's root directory, not the "
              "step's, or make the step self-contained first (ckpt "
              "transfer)")
        kvstore = held(e.held_by)
      leaf = lazy.LazyArray(e, index.storage_format, kvstore, context)
    elif isinstance(e.value, (np.ndarray, np.generic)):
      leaf = lazy.LazyValue(e.value, tree.path_str(e.path),
                            prng_impl=e.prng_impl or None)
    else:
      out[e.path] = e.value
      continue
    leaf.budget = budget
    # For a target leaf without a sharding (AsSaved); a leaf a transform
    # derives has none.
    leaf.saved_sharding = index_lib.saved_sharding_of(e)
    out[e.path] = leaf
  return out


@dataclasses.dataclass(frozen=True)
class RestoreArgs:
  """What the caller asked of one restore (see Checkpointer.restore)."""
  target: Any = None
  restore_dtype: Any = None
  transforms: Sequence[Callable] = ()
  fallback_state: Any = None
  lazy: bool = False
  is_resuming: bool = False
  verify: bool = True
  # lazy: given to every leaf returned (see LazyLeaf.guard / keepalive).
  guard: Callable[[], None] | None = None
  keepalive: Any = None
  # Read once (ckpt/restore/readonce.py): the replica count from which a leaf is
  # read spread over its replicas and exchanged; None: never. The leaves it
  # picks come back from restore_tree as readonce.Deferred placeholders for
  # the caller's thread to read and exchange (readonce.finish).
  read_once_min: int | None = None
  # lazy, from a Checkpointer: given to every leaf returned (their reads
  # count in the restore's stats); with ``rounds``, the leaves read once
  # get a readonce.LazyPlan (read once when read later, a collective).
  lazy_reads: readonce.LazyReads | None = None


def _as_leaf(value: Any, name: str) -> Any:
  """Arrays become LazyLeafs (so every array source reads alike)."""
  if isinstance(value, lazy.LazyLeaf):
    return value
  if isinstance(value, (np.ndarray, np.generic)):
    return lazy.LazyValue(value, name)
  if isinstance(value, jax.Array) and value.is_fully_addressable:
    return lazy.LazyValue(np.asarray(value), name)
  return value


async def _resolve(name: str, src: Any, tgt: Any, args: RestoreArgs,
                   limiter: ByteLimiter, as_saved: AsSaved | None = None,
                   order: int = 0) -> Any:
  """One leaf (the ``order``-th of the target): check it against its
  target leaf, then read it (or bind it).

  A target ShapeDtypeStruct without a sharding restores the leaf in its
  saved sharding (``as_saved``). A typed PRNG key leaf (``src.prng_impl``)
  comes back as a typed key array of its implementation, placed by the
  target's sharding; with no target (``target=None``, ``ckpt.load``) on
  jax's default device.
  """
  shape, wanted, sharding, wants_array = target_spec(tgt, name)
  if (sharding is None and isinstance(tgt, jax.ShapeDtypeStruct) and
      as_saved is not None and isinstance(
          src, (lazy.LazyLeaf, jax.Array, np.ndarray, np.generic))):
    sharding = as_saved.sharding(name, src)
    check_divides(name, shape, sharding)
  if isinstance(src, jax.Array) and (not src.is_fully_addressable or
                                     prng.is_key_dtype(src.dtype)):
    # A fallback array spread over processes: place it, never gather it.
    # Fallback keys too (numpy cannot hold them).
    if shape is not None and tuple(src.shape) != shape:
      raise TreeMismatchError(
          f"leaf {name!r}: the fallback has shape {tuple(src.shape)}, the "
          f"target wants {shape}")
    if wanted is not None and (prng.is_key_dtype(wanted) or
                               prng.is_key_dtype(src.dtype)) and (
                                   src.dtype != wanted):
      raise TreeMismatchError(
          f"leaf {name!r}: the fallback has dtype "
          f"{prng.describe(src.dtype)}, the target wants "
          f"{prng.describe(wanted)}")
    if args.lazy:
      return lazy.LazyPlaced(src, name).bind(sharding, wanted)
    return jax.device_put(src, sharding) if sharding is not None else src
  src = _as_leaf(src, name)
  if not isinstance(src, lazy.LazyLeaf):
    return src  # a python value (int, str, ...): as saved
  impl = getattr(src, "prng_impl", None)
  out = out_dtype(name, src, shape, wanted, wants_array, args.restore_dtype)
  later = None
  # A lazy leaf reads once only with the rounds its later read needs.
  if (not impl and args.read_once_min is not None and
      sharding is not None and not isinstance(src, lazy.LazyValue) and
      (not args.lazy or (args.lazy_reads is not None and
                         args.lazy_reads.rounds is not None)) and
      checksums.stored_bases(src)):
    later = readonce.deferred(name, src, out, sharding, args.read_once_min,
                              order)
  if args.lazy:
    leaf = src.bind(sharding, out)
    leaf.guard, leaf.keepalive = args.guard, args.keepalive
    leaf.reads, leaf.read_once = args.lazy_reads, None
    if later is not None:
      leaf.read_once = readonce.LazyPlan(
          later.sharding, later.split, args.lazy_reads,
          args.lazy_reads.rounds)
    return leaf
  if later is not None:
    return later
  return await assemble.materialize(src, out, sharding, limiter)


def _apply_transforms(leaves: dict[tree.PathParts, Any], args: RestoreArgs
                      ) -> dict[tree.PathParts, Any]:
  ckpt_tree = tree.nest(leaves)
  target_tree = (None if args.target is None else
                 tree.nest(dict(tree.flatten(args.target))))
  for fn in args.transforms:
    ckpt_tree = fn(ckpt_tree, target_tree, is_resuming=args.is_resuming)
    if not isinstance(ckpt_tree, dict):
      raise TypeError(
          f"restore transform {getattr(fn, '__name__', fn)!r} returned a "
          f"{type(ckpt_tree).__name__}; it must return the (nested dict) "
          "checkpoint tree")
  return tree.unnest(ckpt_tree)


async def restore_tree(index: index_lib.Index,
                       leaves: dict[tree.PathParts, Any], args: RestoreArgs,
                       limiter: ByteLimiter) -> Any:
  """Transforms, fallback, then each wanted leaf read and placed."""
  if args.transforms:
    leaves = _apply_transforms(leaves, args)
  by_name = {tree.path_str(p): v for p, v in leaves.items()}
  packs = None if args.lazy else pack_leaf.packset_of(leaves.values())
  if packs is not None:  # each pack this restore needs, read once
    try:
      return await _restore_tree(index, leaves, by_name, args, limiter, packs)
    finally:
      packs.drop_cache()
  return await _restore_tree(index, leaves, by_name, args, limiter, None)


async def _restore_tree(index: index_lib.Index,
                        leaves: dict[tree.PathParts, Any], by_name: dict,
                        args: RestoreArgs, limiter: ByteLimiter,
                        packs: pack_read.PackSet | None) -> Any:
  if packs is not None and args.target is None:
    await packs.prefetch(pack_leaf.positions(leaves.values()))

  if args.target is None:
    names = list(by_name)
    values = await tasks.gather_or_cancel(
        *(_resolve(n, by_name[n], None, args, limiter) for n in names))
    values = dict(zip(names, values))
    if args.transforms:  # the saved structure no longer applies
      return tree.nest({p: values[tree.path_str(p)] for p in leaves})
    by_number = [values[tree.path_str(e.path)] for e in index.leaves]
    return tree.decode_structure(index.structure, by_number.__getitem__)

  named = tree.flatten(args.target)
  _, treedef = tree_util.tree_flatten(args.target)
  fallback = ({tree.path_str(p): v for p, v in tree.flatten(args.fallback_state)}
              if args.fallback_state is not None else {})
  sources, missing = [], []
  for parts, _ in named:
    name = tree.path_str(parts)
    if name in by_name:
      sources.append(by_name[name])
    elif name in fallback:
      sources.append(fallback[name])
    else:
      missing.append(name)
  if missing:
    raise MissingLeavesError(missing, list(by_name),
                             [tree.path_str(p) for p, _ in named])
  if packs is not None:
    await packs.prefetch(pack_leaf.positions(sources),
                         pack_leaf.boxes_placed(sources, [t for _, t in named]))
  as_saved = AsSaved(index)
  results = await tasks.gather_or_cancel(
      *(_resolve(tree.path_str(p), src, tgt, args, limiter, as_saved, i)
        for i, ((p, tgt), src) in enumerate(zip(named, sources))))
  return tree_util.tree_unflatten(treedef, results)


async def read_parts(batch: Sequence[readonce.Deferred], budget: int
                     ) -> list[readsplit.Part]:
  """Read once: this process's part of each leaf of ``batch`` (its share
  of the leaf's split over the replicas, ckpt/restore/readsplit.py), under one
  byte limiter."""
  limiter = ByteLimiter(budget)
  try:
    return await tasks.gather_or_cancel(
        *(d.split.read(d.src, d.out_dtype, limiter) for d in batch))
  finally:
    readcount.note_limiter(limiter)


def locate(storage: storage_lib.Storage, step: int | None
           ) -> tuple[int, str]:
  """(step, the relative directory that holds its index and data)."""
  step = resolve_step(storage, step)
  return step, steps_lib.step_dir(storage, step)


def locate_path(storage: storage_lib.Storage, step: int | None) -> str:
  """The data directory (relative) of a path given by a user: the path
  itself if it is one step's directory and no step is asked for, else the
  committed ``step`` (default: latest) under it as a root."""
  if step is None:
    here = steps_lib.own_step_dir(storage)
    if here is not None:
      return here
  return locate(storage, step)[1]


async def restore(storage: storage_lib.Storage, step_dir: str,
                  args: RestoreArgs, budget: int, context,
                  stats: Any = None) -> Any:
  """Reads the index in ``step_dir`` and restores it as ``args`` say
  (``stats``: a RestoreStats whose index_s it sets)."""
  t = time.perf_counter()
  index = await asyncio.to_thread(read_index, storage, step_dir)
  if stats is not None:
    stats.index_s = time.perf_counter() - t
  # Small leaves: the cyclic GC paused while a few objects per leaf are
  # made (ckpt/store/gcpause.py).
  with (gcpause.paused() if pack_read.has_packed(index) else
        contextlib.nullcontext()):
    leaves = step_leaves(index, storage, step_dir, context, budget)
    if args.verify:  # every read checks what it reads (restore/verified.py)
      await checksums.attach(leaves, storage, step_dir, index)
    limiter = ByteLimiter(budget)
    try:
      return await restore_tree(index, leaves, args, limiter)
    finally:
      readcount.note_limiter(limiter)


def load(path, step: int | None = None, *, storage_options: dict | None = None,
         concurrent_bytes: int = 1 << 30, verify: bool = True) -> Any:
  """The whole checkpoint as nested numpy values, with no target.

  Typed PRNG key leaves are the exception (numpy has no key dtype): they
  come back as ``jax.Array``s of their key dtype on jax's default device.

  ``path`` is a checkpoint root (then ``step``, default latest) or one step
  directory (a folder holding ``index.msgpack``).

  Args:
    path: a checkpoint root or one step directory (path or URL).
    step: a committed step of the root, or None for the latest.
    storage_options: merged into the TensorStore kvstore spec, as
      ``Checkpointer(storage_options=...)``.
    concurrent_bytes: the host-memory budget of the reads in flight.
    verify: check every stored chunk against the crc32c recorded at save as
      it is read (False opts out).

  Raises:
    CheckpointNotFoundError: no such committed step (or none at all).
    CorruptCheckpointError: an invalid index or stored array (naming it),
      or a chunk whose crc32c differs from the one recorded at save.

  Not collective: one process reads everything (use it on one process, or
  on each, independently).
  """
  storage = storage_lib.Storage(path, storage_options)
  step_dir = locate_path(storage, step)
  return tasks.run_sync(restore(storage, step_dir, RestoreArgs(verify=verify),
                               concurrent_bytes, storage.context()))
