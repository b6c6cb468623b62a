"""The leaves of the local tier (ckpt/tiers/local_tier.py) as a
``Checkpointer`` treats them: ``flatten`` names them as the persistent tier
names them, ``prepare_leaves`` stores them as a save stores them (dtype
casts, PRNG keys as key data, host values), and ``restore_plan`` with its
helpers (``place``, ``host_value``) restores each target leaf as a restore
does, with the same refusals naming the leaf.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

import jax

from ckpt.format import index as index_lib
from ckpt.restore import lazy
from ckpt.format import prng
from ckpt.restore import read as restore_lib
from ckpt.save import leaves as save_lib
from ckpt.format import saved_sharding as saved_sharding_lib
from ckpt.format import tree as tree_lib
from ckpt.tiers.local_manifest import box_index
from ckpt.errors import (CheckpointError, CorruptCheckpointError,
                         InvalidStateError, MissingLeavesError)

# ---- leaves -----------------------------------------------------------------

def flatten(tree):
  """[(name, leaf)] named as the persistent tier names leaves ("params/w",
  ckpt/format/tree.py: so both tiers' errors name a leaf alike), and the treedef."""
  return ([(tree_lib.path_str(p), v) for p, v in tree_lib.flatten(tree)],
          jax.tree_util.tree_structure(tree))


def prepare_leaves(leaves, save_dtype, devices) -> tuple[list, dict, dict]:
  """The leaves of a local save, stored as a ``Checkpointer`` stores them
  (ckpt/save/write.py ``plan_save``), or refused with its error naming the leaf.

  Returns ``(arrays, host_vals, info)``:

  - ``arrays``: ``[(name, jax.Array)]``, the leaves with a shard on every
    device of the job, in the dtype they are stored in: floating leaves cast
    to ``save_dtype`` on the host with numpy, as the persistent tier casts
    (so both tiers hold the same bits), typed PRNG keys as their key data;
  - ``host_vals``: ``{name: index.encode_value(...)}``, numpy and Python
    values and the jax arrays one process holds whole (an uncommitted
    ``jnp.asarray(10)`` lives on one device of each process: a host value
    of each, as the persistent tier stores it inline), cast as above;
  - ``info``: ``{"arrays": {name: [dtype, shape]}, "prng": {name: impl},
    "device": [names of the host values that were one-device jax arrays]}``,
    saved with the host values, so every process (one restoring from its
    partner too) knows each leaf's stored dtype and PRNG implementation.

  Raises InvalidStateError naming the leaf for what a Checkpointer refuses,
  for an array whose shards are uneven, and for one on some devices only.
  """
  job = set(devices)
  arrays, host_vals = [], {}
  info: dict[str, Any] = {"arrays": {}, "prng": {}, "device": []}
  for name, x in leaves:
    if isinstance(x, jax.Array):
      if prng.is_key_dtype(x.dtype):  # stored as its key data (ckpt/format/prng.py)
        info["prng"][name], x = save_lib._key_data(name, x)  # pylint: disable=protected-access
      stored = save_lib._leaf_dtype(name, x.dtype, save_dtype)  # pylint: disable=protected-access
      if x.sharding.device_set != job:
        if not x.is_fully_addressable:
          raise InvalidStateError(
              f"leaf {name!r} is on {len(x.sharding.device_set)} of the job's "
              f"{len(job)} devices, spread over processes; the local tier "
              "stores arrays with a shard on every device, or held whole by "
              "each process")
        host_vals[name] = index_lib.encode_value(
            np.asarray(x).astype(stored), (name,))
        info["device"].append(name)  # restored as saved: on one device
        continue
      try:  # the partner exchange stacks equal shards
        x.sharding.shard_shape(tuple(x.shape))
      except ValueError as e:
        raise InvalidStateError(
            f"leaf {name!r} has uneven shards (shape {tuple(x.shape)}, "
            f"{x.sharding}), which the local tier cannot store: {e}") from e
      if stored != x.dtype:
        x = jax.make_array_from_single_device_arrays(
            x.shape, x.sharding,
            [jax.device_put(np.asarray(s.data).astype(stored), s.device)
             for s in x.addressable_shards])
      arrays.append((name, x))
      info["arrays"][name] = [stored.name, list(x.shape)]
    elif isinstance(x, np.ndarray):
      stored = save_lib._leaf_dtype(name, x.dtype, save_dtype)  # pylint: disable=protected-access
      host_vals[name] = index_lib.encode_value(x.astype(stored), (name,))
    elif isinstance(x, (bool, int, float, str, bytes, np.generic)):
      if isinstance(x, np.generic):
        stored = save_lib._leaf_dtype(name, x.dtype, save_dtype, inline=True)  # pylint: disable=protected-access
        x = np.asarray(x).astype(stored)[()]
      host_vals[name] = index_lib.encode_value(x, (name,))
    else:
      raise InvalidStateError(
          f"leaf {name!r} is a {type(x).__module__}.{type(x).__qualname__}; "
          "expected a jax.Array, numpy array, scalar, str, bytes or None. "
          "Register custom containers as pytree nodes.")
  return arrays, host_vals, info


# ---- restore: what a Checkpointer does with each target leaf -------------------

@functools.lru_cache(maxsize=64)
def _key_dims(dtype) -> tuple[int, ...]:
  """The trailing key-data dimensions of a typed PRNG key dtype."""
  return tuple(jax.eval_shape(jax.random.key_data,
                              jax.ShapeDtypeStruct((), dtype)).shape)


def target_sig(t) -> tuple | None:
  """(stored shape, {device: stored index}) of a target leaf with a
  sharding (a key target: its key data's, with the key dimensions whole);
  None with no sharding, or one that cannot hold the shape (the restore
  then raises for it as a Checkpointer does: restore_plan)."""
  sh = getattr(t, "sharding", None)
  if sh is None or not hasattr(t, "shape"):
    return None
  shape = tuple(t.shape)
  tail = _key_dims(t.dtype) if prng.is_key_dtype(t.dtype) else ()
  try:
    imap = sh.devices_indices_map(shape)
  except ValueError:  # uneven: jax's IndivisibleError
    return None
  whole = (slice(None),) * len(tail)
  return (list(shape + tail),
          {d: tuple(idx) + whole for d, idx in imap.items()})


class _Leaf(NamedTuple):
  """How the local tier restores one target leaf (see restore_plan)."""
  kind: str              # "array" (own.bin / partner.bin), "host", "python"
  sharding: Any          # the target's (None: a numpy value, as saved)
  shape: tuple = ()      # as stored (keys: their key data's shape)
  logical: tuple = ()    # as restored (keys: without the key dimensions)
  stored: Any = None     # the stored dtype
  out: Any = None        # the restored dtype (key data: the stored one)
  impl: str | None = None  # a typed PRNG key leaf's implementation
  value: Any = None      # "host" / "python": the saved value

  @property
  def block(self) -> tuple:
    """One device's block as stored (the partner exchange's unit)."""
    tail = self.shape[len(self.logical):]
    return tuple(self.sharding.shard_shape(self.logical)) + tail

  def box(self, index) -> tuple:
    """The stored box of a device's index into the restored shape."""
    whole = (slice(None),) * (len(self.shape) - len(self.logical))
    return box_index(tuple(index) + whole, self.shape)


def check_shardings(target_leaves) -> None:
  """A target sharding that cannot hold its leaf's shape (uneven: a
  dimension the mesh axis does not divide) raises what a Checkpointer
  restore raises (TreeMismatchError naming the leaf). From the target
  alone, so every process raises the same (the first such leaf)."""
  for name, t in target_leaves:
    sh = getattr(t, "sharding", None)
    if sh is not None and hasattr(t, "shape"):
      restore_lib._check_divides(name, tuple(t.shape), sh)  # pylint: disable=protected-access


def restore_plan(blob: Any, target_leaves, restore_dtype, where: str
                  ) -> dict[str, _Leaf]:
  """What a ``Checkpointer`` restore does with each target leaf, from the
  saved leaves a host.msgpack part records (``values``, ``arrays``,
  ``prng``: prepare_leaves): ckpt/restore/read.py ``_resolve``'s checks, with
  its functions, so the local tier refuses what it refuses with the same
  error (TreeMismatchError naming the leaf: a float32 leaf into an int32
  target, keys of another implementation, another shape), applies
  ``restore_dtype`` to the same (floating) leaves and casts only floating
  dtypes. Local: no I/O, no collective. (Uneven target shardings:
  check_shardings.)"""
  maps = [blob.get(k) if isinstance(blob, dict) else None
          for k in ("values", "arrays", "prng")]
  if not all(isinstance(x, dict) for x in maps):
    raise CorruptCheckpointError(
        f"{where}: host.msgpack records no saved leaves (values, arrays, "
        "prng): not written by this version of the local tier")
  values, arrays, impls = maps
  on_device = blob.get("device", [])
  if not isinstance(on_device, list):
    raise CorruptCheckpointError(
        f"{where}: expected a list of leaf names under 'device', found "
        f"{str(on_device)[:200]!r}")
  missing = [n for n, _ in target_leaves if n not in values and n not in arrays]
  if missing:
    raise MissingLeavesError(missing, sorted({*values, *arrays}),
                             [n for n, _ in target_leaves])
  plan = {}
  for name, t in target_leaves:
    shape, wanted, sharding, wants_array = restore_lib._target_spec(t, name)  # pylint: disable=protected-access
    impl = impls.get(name) or None
    if impl is not None and not isinstance(impl, str):
      raise CorruptCheckpointError(
          f"{where}: leaf {name!r}: expected a PRNG implementation's name, "
          f"found {impl!r}")
    if name in values:
      value = index_lib.decode_value(values[name], f"{where}: leaf {name!r}")
      if not isinstance(value, (np.ndarray, np.generic)):
        plan[name] = _Leaf("python", None, value=value)  # as saved
        continue
      src = lazy.LazyValue(value, name, prng_impl=impl)
    else:
      a = arrays[name]
      try:
        dtype, stored_shape = np.dtype(a[0]), tuple(int(d) for d in a[1])
        if dtype.hasobject or any(d < 0 for d in stored_shape):
          raise ValueError(a)
      except (TypeError, ValueError, IndexError) as e:
        raise CorruptCheckpointError(
            f"{where}: leaf {name!r}: expected [dtype, shape], found "
            f"{str(a)[:200]!r}") from e
      # Shape and dtype only (a view of one element): what the checks read.
      src = lazy.LazyValue(np.broadcast_to(np.zeros((), dtype), stored_shape),
                           name, prng_impl=impl)
    out = restore_lib.out_dtype(name, src, shape, wanted, wants_array,
                                restore_dtype)
    logical = lazy.logical_shape(src)
    if sharding is None and name in arrays:  # usable() sends these elsewhere
      raise CheckpointError(
          f"{where}: leaf {name!r} has no sharding in the target; the local "
          "tier places arrays on the target's shardings")
    if (sharding is None and name in on_device and
        isinstance(t, (jax.ShapeDtypeStruct, jax.Array))):
      sharding = _as_saved()  # host numpy values stay numpy, as saved
    plan[name] = _Leaf("array" if name in arrays else "host", sharding,
                       tuple(src.shape), tuple(logical), np.dtype(src.dtype),
                       np.dtype(out), impl, None if name in arrays else value)
  return plan


def _as_saved() -> jax.sharding.Sharding:
  """Where a one-device jax array saved as a host value goes for a jax
  target without a sharding, as the persistent tier restores it as saved
  (ckpt/restore/targets.py ``AsSaved``): on this process's first device. (A
  numpy value comes back as numpy, as the persistent tier returns it.)"""
  return saved_sharding_lib.SavedSharding("device").to_sharding()


def _wrap(x: jax.Array, p: _Leaf) -> jax.Array:
  return prng.wrap(x, p.impl) if p.impl else x


def _assemble(p: _Leaf, bufs) -> jax.Array:
  return jax.make_array_from_single_device_arrays(
      p.logical, p.sharding, bufs,
      dtype=prng.info(p.impl).dtype if p.impl else p.out)


def place(p: _Leaf, datas, devices) -> jax.Array:
  """An array leaf from each local device's block as stored (numpy, or a
  jax.Array on that device): cast with numpy as a Checkpointer casts,
  typed keys wrapped around their data (no copy)."""
  bufs = []
  for x, d in zip(datas, devices):
    if np.dtype(x.dtype) != p.out:
      x = np.asarray(x).astype(p.out)
    if not isinstance(x, jax.Array):
      x = jax.device_put(x, d)
    bufs.append(_wrap(x, p))
  return _assemble(p, bufs)


def host_value(p: _Leaf) -> Any:
  """A host value restored as a Checkpointer restores an inline value
  (ckpt/restore/assemble.py ``materialize``): numpy (or typed keys on jax's default
  device) with no target sharding, else placed on the target's sharding."""
  if p.kind == "python":
    return p.value
  data = np.asarray(p.value).astype(p.out, copy=False)
  if p.sharding is None:
    if p.impl:
      return prng.wrap(data, p.impl)
    return data[()] if isinstance(p.value, np.generic) else data
  whole = (slice(None),) * (len(p.shape) - len(p.logical))
  imap = p.sharding.addressable_devices_indices_map(p.logical)
  bufs = [_wrap(jax.device_put(np.array(data[tuple(idx) + whole], order="C"),
                               d), p) for d, idx in imap.items()]
  return _assemble(p, bufs)
