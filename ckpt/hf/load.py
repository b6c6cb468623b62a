"""``load_safetensors``: safetensors files restored onto a target's shardings.

The stages, as a ckpt restore's (ckpt/restore/read.py):

1. open the source and read every file's header (ckpt/hf/files.py; each
   header parsed as untrusted input, ckpt/hf/header.py);
2. each tensor becomes a lazy leaf (ckpt/hf/leaves.py), placed by ``names``
   (ckpt/hf/names.py): ``.T`` wraps it in a transposed view, ``[i]`` makes
   it member i of a ``LazyStack`` (ckpt/restore/lazy_derived.py), so
   per-layer tensors are read straight into their slice of the scanned
   array, never gathered unstacked; then the ``transforms`` (as
   ``Checkpointer.restore``'s: functions of the nested tree of lazy leaves);
3. the leaves are matched to the target (ckpt/restore/targets.py: shape,
   the floating cast, the sharding), and what is missing and left over is
   refused together, naming keys and paths;
4. each leaf is read as a restore reads it (``assemble.materialize``): only
   the boxes this process's devices hold, each as the byte ranges of the
   rows that cover it, under one ``ByteLimiter`` of ``concurrent_bytes``.
   On an object store in a multi-process job, a leaf replicated across
   processes is read once (ckpt/restore/readonce.py, the same policy as a
   restore: each process reads a distinct part, then one jit program
   all-gathers them).

Collective when a target is given in a multi-process job: every process
calls it with the same arguments; one round after the reads (and one
before each read-once exchange) makes every process raise if any failed,
naming it, or if their files hold different tensors (names, dtypes,
shapes; the paths may differ from host to host) (rounds of ckpt/multihost/
process.py, bounded by its DEFAULT_TIMEOUT_S: a process that never comes
fails the others' round, naming it). ``target=None`` reads everything on
this process, alone.

Counting: a ``readcount.ReadCounter`` set as ``readcount.COUNTER`` by the
caller counts every tensor read (the bytes its boxes asked, the whole rows
fetched) and the byte limiter's peak, as a restore's reads count
(tests/hf, scripts/bench_safetensors.py).
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Any, Sequence

import numpy as np
from jax import tree_util
from jax.sharding import NamedSharding, PartitionSpec

from ckpt.errors import TreeMismatchError
from ckpt.format import tree
from ckpt.hf import files as files_lib
from ckpt.hf import leaves as leaves_lib
from ckpt.hf import names as names_lib
from ckpt.multihost import process as multihost
from ckpt.restore import assemble
from ckpt.restore import read as read_lib
from ckpt.restore import readcount
from ckpt.restore import readonce
from ckpt.restore import readsplit
from ckpt.restore.targets import out_dtype, target_spec
from ckpt.restore.tasks import gather_or_cancel, run_sync
from ckpt.store.limiter import ByteLimiter

_SHOWN = 20  # names listed in an error, at most


def _some(names: Sequence[str]) -> str:
  names = sorted(names)
  more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
  return ", ".join(repr(n) for n in names[:_SHOWN]) + more


class _Source:
  """What the files provide: target path -> (lazy leaf, the keys it
  comes from), and the keys no rule placed."""

  def __init__(self, source: files_lib.Source, rules: names_lib.Names):
    headers = run_sync(source.headers())
    tensors: dict[str, leaves_lib.Tensor] = {}
    for name, head in headers.items():
      for key, t in head.tensors.items():
        if key in tensors:
          raise TreeMismatchError(
              f"tensor {key!r} is in both {tensors[key].file} and {name} of "
              f"{source.src}")
        tensors[key] = leaves_lib.Tensor(source, name, t, head.data_start)
    # What every process of a collective load must agree on: the tensors
    # (names, dtypes, shapes), not the path, which may differ per host.
    digest = hashlib.sha256()
    for key in sorted(tensors):
      t = tensors[key]
      digest.update(f"{key}|{t.dtype.name}|{t.shape};".encode())
    self.signature = f"{len(tensors)} tensors, digest {digest.hexdigest()[:16]}"
    self.left_over: list[str] = []
    slots: dict[str, dict[int | None, tuple[str, Any]]] = {}
    for key, t in tensors.items():
      text = rules.forward(key)
      if text is names_lib.UNMATCHED:
        self.left_over.append(key)
        continue
      if text is None:
        continue
      place = names_lib.parse_place(text, key)
      leaf = leaves_lib.Transposed(t, f"{key}.T") if place.transpose else t
      slot = slots.setdefault(place.path, {})
      if place.index in slot or (slot and (place.index is None) != (
          None in slot)):
        other = next(iter(slot.values()))[0]
        raise TreeMismatchError(
            f"names maps both {other!r} and {key!r} to {place.path!r} "
            f"({text!r}); each target leaf takes one key, or one per index "
            "[i] of its leading axis")
      slot[place.index] = (key, leaf)
    self.leaves: dict[str, Any] = {}
    self.keys: dict[str, str] = {}
    for path, slot in slots.items():
      if None in slot:
        key, self.leaves[path] = slot[None]
        self.keys[path] = repr(key)
        continue
      have = sorted(slot)
      gaps = sorted(set(range(have[-1] + 1)) - set(have))
      if gaps:
        raise TreeMismatchError(
            f"{path!r} stacks keys at indices {have[:_SHOWN]}, but no key is "
            f"placed at [{', '.join(map(str, gaps[:_SHOWN]))}] (e.g. "
            f"{slot[have[0]][0]!r} is [{have[0]}])")
      self.leaves[path] = leaves_lib.Stacked([slot[i][1] for i in have], path)
      self.keys[path] = (f"{slot[have[0]][0]!r}..{slot[have[-1]][0]!r} "
                         f"({len(have)} keys stacked)")

  def transform(self, transforms, target) -> None:
    """Applies restore transforms to the nested tree of leaves."""
    state = tree.nest({tuple(p.split("/")): v for p, v in self.leaves.items()})
    target_tree = (None if target is None else
                   tree.nest(dict(tree.flatten(target))))
    for fn in transforms:
      state = fn(state, target_tree, is_resuming=False)
      if not isinstance(state, dict):
        raise TypeError(f"transform {getattr(fn, '__name__', fn)!r} "
                        f"returned a {type(state).__name__}, not the nested "
                        "dict of leaves")
    self.leaves = {tree.path_str(p): v for p, v in tree.unnest(state).items()}

  def describe(self, path: str) -> str:
    return self.keys.get(path) or "a transform"


def load_safetensors(src, *, target: Any, names: Any = None,
                     transforms: Sequence[Any] = (),
                     concurrent_bytes: int = 1 << 30,
                     storage_options: dict | None = None) -> Any:
  """Restores safetensors weights onto ``target``'s shardings.

  Args:
    src: a ``.safetensors`` file, a ``model.safetensors.index.json``, or a
      directory holding either (a path, ``file://``, ``gs://`` or ``s3://``).
    target: a tree of ``jax.ShapeDtypeStruct`` (with shardings), jax or
      numpy arrays: each leaf is read onto its sharding (without one: as
      host numpy), cast to its dtype (floating casts). None: every tensor
      as host numpy, in a flat dict keyed by the files' names (or the
      paths ``names`` gives).
    names: Hugging Face keys to target paths (docs/huggingface.md "The
      names rules"): None, a dict, a list of ``(regex, replacement)``
      pairs or a function; a path may end in ``[i]`` (stacked at index i
      of the leading axis) and ``.T`` (transposed); None drops a key.
    transforms: restore transforms (``ckpt.transforms``), applied to the
      nested tree of lazy leaves after ``names``.
    concurrent_bytes: host memory for the reads in flight.
    storage_options: merged into the TensorStore kvstore spec, as
      ``Checkpointer(storage_options=...)``.

  Raises:
    CorruptCheckpointError: a file or index that is not what it claims
      (naming the file and the tensor).
    TreeMismatchError: keys and target leaves that do not match (every
      missing and left-over name listed), a shape that differs (naming the
      key and the path), a cast that is not floating.

  Collective in a multi-process job when ``target`` is given.
  """
  if target is not None and multihost.is_multiprocess():
    return _collective(src, target, names, transforms, concurrent_bytes,
                       storage_options)
  return _read(src, target, names, transforms, concurrent_bytes,
               storage_options, None)[0]


def _collective(src, target, names, transforms, budget, storage_options):
  # The key counts the calls (the same on every process), never the source:
  # a process given another source still meets the others, and the round
  # says that the sources differ.
  key = multihost.call_key("load_safetensors")
  what = f"load_safetensors({os.fspath(src)!r})"
  timeout = multihost.DEFAULT_TIMEOUT_S
  result, error, signature = None, None, ""
  counter = readcount.COUNTER.get()
  try:
    result, signature = _read(src, target, names, transforms, budget,
                              storage_options, "collective")
  except Exception as e:  # pylint: disable=broad-except
    error = e
  multihost.all_ok(f"{key}/read", error, what, timeout,
                   same=f"files of {signature}",
                   differ="Every process must load the same tensors (the "
                   "same model, at any path).")
  # The round keys stay (a few bytes a call, as import's): a process may
  # still be reading a decision when another returns, so none deletes them.
  return readonce.finish(
      result,
      lambda batch: run_sync(readcount.counted(
          read_lib.read_parts(batch, budget), counter)),
      budget, readonce.RestoreStats(),
      lambda i, e: multihost.all_ok(f"{key}/{i}", e, what, timeout))


def _read_once(name: str, leaf, dtype, sharding, min_r: int, order: int
               ) -> readonce.Deferred | None:
  """The leaf read once over its replica processes (ckpt/restore/readonce.py),
  each reading an even part along a dimension of whole rows of the files'
  tensors (``leaves.row_dims``: a stack's layers, a weight's rows), so no
  process fetches rows another one fetches; else as a restore splits it;
  None: not read once."""
  got = readsplit.replica_axes(sharding, leaf.ndim, min_r)
  if got is None:
    return None
  spec, axes, r = got
  mesh = sharding.mesh

  def names(entry) -> tuple:
    return () if entry is None else (
        tuple(entry) if isinstance(entry, (tuple, list)) else (entry,))
  ways = [math.prod(mesh.shape[a] for a in names(e)) for e in spec]
  for d in leaves_lib.row_dims(leaf):
    if leaf.shape[d] % (ways[d] * r) == 0:
      break
  else:
    return readonce.deferred(name, leaf, dtype, sharding, min_r, order)
  new = list(spec)
  new[d] = names(spec[d]) + tuple(axes)
  split = readsplit.EvenSplit(sharding, r, NamedSharding(
      mesh, PartitionSpec(*new), memory_kind=sharding.memory_kind))
  return readonce.Deferred(
      name, leaf, np.dtype(dtype), sharding, split, readsplit.per_process_bytes(
          split, tuple(leaf.shape), np.dtype(dtype).itemsize))


def _read(src, target, names, transforms, budget: int, storage_options,
          mode: str | None) -> tuple[Any, str]:
  """(the result, the files' signature); in a collective load, leaves to
  read once are ``readonce.Deferred`` placeholders."""
  # The caller's read counter (readcount.COUNTER), if any, counts the reads
  # of the private loop's thread too.
  counter = readcount.COUNTER.get()
  source = files_lib.Source(src, storage_options)
  found = _Source(source, names_lib.Names(names))
  if transforms:
    found.transform(transforms, target)
  limiter = ByteLimiter(budget)
  if target is None:
    if found.left_over:
      raise TreeMismatchError(
          f"{source.src}: names places no key {_some(found.left_over)} "
          "(map a key to None to drop it)")
    paths = sorted(found.leaves)
    values = run_sync(readcount.counted(gather_or_cancel(*(
        assemble.materialize(found.leaves[p], found.leaves[p].dtype, None,
                             limiter) for p in paths)), counter))
    return dict(zip(paths, values)), found.signature
  named = tree.flatten(target)
  _, treedef = tree_util.tree_flatten(target)
  want = [tree.path_str(p) for p, _ in named]
  missing = [p for p in want if p not in found.leaves]
  extra = sorted(set(found.leaves) - set(want))
  if missing or extra or found.left_over:
    parts = []
    if missing:
      parts.append(f"missing (target leaves no key is placed at): "
                   f"{_some(missing)}")
    if extra:
      parts.append("left over (placed at paths the target does not have): "
                   + ", ".join(f"{p!r} from {found.describe(p)}"
                               for p in extra[:_SHOWN]))
    if found.left_over:
      parts.append(f"left over (keys no rule of names places): "
                   f"{_some(found.left_over)}")
    raise TreeMismatchError(
        f"load_safetensors({source.src!r}): the files and the target do not "
        "match; " + "; ".join(parts) + ". Map a key to None to drop it.")
  min_r = (readonce.min_replicas(None, source.storage.url)
           if mode == "collective" else None)

  async def one(i: int, name: str, tgt: Any) -> Any:
    src_leaf = found.leaves[name]
    label = f"{name} (from {found.describe(name)})"
    shape, wanted, sharding, wants_array = target_spec(tgt, label)
    if not wants_array:
      raise TreeMismatchError(
          f"target leaf {name!r} is a {type(tgt).__name__}; expected a "
          "jax.ShapeDtypeStruct, a jax.Array or a numpy array")
    if tuple(src_leaf.shape) != shape:
      raise TreeMismatchError(
          f"target leaf {name!r} has shape {shape}; {found.describe(name)} "
          f"gives {tuple(src_leaf.shape)}")
    dtype = out_dtype(label, src_leaf, shape, wanted, True, None)
    if min_r is not None and sharding is not None:
      later = _read_once(label, src_leaf, dtype, sharding, min_r, i)
      if later is not None:
        return later
    return await assemble.materialize(src_leaf, dtype, sharding, limiter)

  try:
    values = run_sync(readcount.counted(gather_or_cancel(*(
        one(i, name, tgt) for i, (name, (_, tgt)) in
        enumerate(zip(want, named)))), counter))
  finally:
    readcount.note_limiter(limiter)
  return tree_util.tree_unflatten(treedef, values), found.signature
