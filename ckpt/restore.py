"""The restore data path:

discover -> read and validate the index -> match the target -> plan each
process's boxes from the target shardings -> read only those boxes under the
byte budget, cast, assemble ``jax.Array``s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import jax
import numpy as np
from jax import tree_util

from ckpt import index as index_lib
from ckpt import lazy
from ckpt import storage as storage_lib
from ckpt import tree
from ckpt.errors import (CheckpointNotFoundError,
                         MissingLeavesError, TreeMismatchError)
from ckpt.limiter import ByteLimiter


def resolve_step(storage: storage_lib.Storage, step: int | None) -> int:
  steps = storage.committed_steps()
  if not steps:
    raise CheckpointNotFoundError(
        f"{storage.url!r} holds no committed checkpoint (no "
        f"checkpoint_<step>/ with an index; uncommitted *.tmp-* directories "
        "are ignored)")
  if step is None:
    return steps[-1]
  if step not in steps:
    raise CheckpointNotFoundError(
        f"step {step} is not a committed checkpoint in {storage.url!r}; "
        f"committed steps: {steps}")
  return step


def read_index(storage: storage_lib.Storage, step_dir: str) -> index_lib.Index:
  key = storage.index_key(step_dir)
  where = f"{storage.url.rstrip('/')}/{key}"
  data = storage.read_bytes(key)
  if data is None:
    raise CheckpointNotFoundError(f"{where} does not exist")
  return index_lib.decode(data, where)


def checkpoint_leaves(index: index_lib.Index, step_kvstore: dict,
                      context) -> dict[str, Any]:
  """path -> LazyArray (stored arrays) or the inline value."""
  out: dict[str, Any] = {}
  for e in index.leaves:
    name = tree.path_str(e.path)
    if isinstance(e, index_lib.ArrayEntry):
      out[name] = lazy.LazyArray(e, index.storage_format, step_kvstore, context)
    else:
      out[name] = e.value
  return out


def _out_dtype(name: str, saved: np.dtype, wanted: np.dtype | None,
               restore_dtype) -> np.dtype:
  if restore_dtype is not None and lazy.is_floating(saved):
    return np.dtype(restore_dtype)
  if wanted is None or wanted == saved:
    return saved
  if lazy.is_floating(saved) and lazy.is_floating(wanted):
    return wanted
  raise TreeMismatchError(
      f"leaf {name!r}: the checkpoint has dtype {saved}, the target wants "
      f"{wanted}; only floating dtypes are cast on restore (pass a target "
      "with the saved dtype, or convert afterwards)")


def _target_spec(x: Any):
  """(shape, dtype, sharding, wants_array) of one target leaf."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return tuple(x.shape), np.dtype(x.dtype), x.sharding, True
  if isinstance(x, jax.Array):
    return tuple(x.shape), np.dtype(x.dtype), x.sharding, True
  if isinstance(x, np.ndarray):
    return tuple(x.shape), np.dtype(x.dtype), None, True
  return None, None, None, False


async def restore_leaves(ckpt_leaves: dict[str, Any], target: Any,
                         restore_dtype, limiter: ByteLimiter) -> Any:
  """Builds the restored tree (the target's structure, or the saved one)."""
  if target is None:
    raise ValueError("use restore_saved_structure for target=None")
  flat, treedef = tree_util.tree_flatten(target)
  named = tree.flatten(target)
  missing = [tree.path_str(p) for p, _ in named
             if tree.path_str(p) not in ckpt_leaves]
  if missing:
    raise MissingLeavesError(missing, list(ckpt_leaves))

  async def one(parts, tgt):
    name = tree.path_str(parts)
    src = ckpt_leaves[name]
    shape, wanted, sharding, wants_array = _target_spec(tgt)
    if not wants_array:
      if isinstance(src, lazy.LazyArray):  # never hand out a LazyArray
        out = _out_dtype(name, src.dtype, None, restore_dtype)
        return await lazy.materialize(src, out, None, limiter)
      return _cast_value(name, src, restore_dtype)
    src_shape = tuple(np.shape(src)) if not isinstance(src, lazy.LazyArray) else src.shape
    if src_shape != shape:
      raise TreeMismatchError(
          f"leaf {name!r}: the checkpoint has shape {src_shape}, the target "
          f"wants {shape}")
    saved = src.dtype if isinstance(src, lazy.LazyArray) else np.asarray(src).dtype
    out = _out_dtype(name, np.dtype(saved), wanted, restore_dtype)
    return await lazy.materialize(src, out, sharding, limiter)

  leaves = await asyncio.gather(*(one(p, t) for p, t in named))
  return tree_util.tree_unflatten(treedef, leaves)


async def restore_saved_structure(index: index_lib.Index,
                                  ckpt_leaves: dict[str, Any], restore_dtype,
                                  limiter: ByteLimiter) -> Any:
  """target=None: every leaf as a host value, in the saved structure."""
  names = list(ckpt_leaves)

  async def one(name):
    src = ckpt_leaves[name]
    if isinstance(src, lazy.LazyArray):
      out = _out_dtype(name, src.dtype, None, restore_dtype)
      return await lazy.materialize(src, out, None, limiter)
    return _cast_value(name, src, restore_dtype)

  values = dict(zip(names, await asyncio.gather(*(one(n) for n in names))))
  return tree.decode_structure(index.structure, values.__getitem__)


def _cast_value(name: str, value: Any, restore_dtype) -> Any:
  if (restore_dtype is not None and isinstance(value, (np.ndarray, np.generic))
      and lazy.is_floating(value.dtype)):
    out = np.asarray(value).astype(restore_dtype)
    return out[()] if isinstance(value, np.generic) else out
  return value


def locate(storage: storage_lib.Storage, step: int | None
           ) -> tuple[int, str]:
  step = resolve_step(storage, step)
  return step, storage_lib.step_dirname(step)


async def restore(storage: storage_lib.Storage, step_dir: str, target: Any,
                  restore_dtype, limiter: ByteLimiter, context) -> Any:
  """Reads the index in ``step_dir`` and restores onto ``target``."""
  index = await asyncio.to_thread(read_index, storage, step_dir)
  leaves = checkpoint_leaves(index, storage.step_spec(step_dir), context)
  if target is None:
    return await restore_saved_structure(index, leaves, restore_dtype, limiter)
  return await restore_leaves(leaves, target, restore_dtype, limiter)


def load(path, step: int | None = None, *, storage_options: dict | None = None,
         concurrent_bytes: int = 1 << 30) -> Any:
  """The whole checkpoint as nested numpy values, with no target.

  ``path`` is a checkpoint root (then ``step``, default latest) or one step
  directory (a folder holding ``index.msgpack``).
  """
  storage = storage_lib.Storage(path, storage_options)
  if step is None and storage.read_bytes(storage_lib.INDEX_NAME) is not None:
    step_dir = ""
  else:
    _, step_dir = locate(storage, step)
  coro = restore(storage, step_dir, None, None, ByteLimiter(concurrent_bytes),
                 storage.context())
  # A private thread: never nest asyncio.run in a caller that has a loop.
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(asyncio.run, coro).result()
