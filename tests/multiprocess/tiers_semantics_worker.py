"""One process of a job for tests/multiprocess/test_tiers_semantics.py.

For each case, the same state is saved and restored twice: by a plain
``ckpt.Checkpointer`` and by a ``MultiTierCheckpointer`` whose persistent
tier stays empty (``persistent_interval=None``), so that what it returns or
raises comes from its local tier. Each outcome is reported as data (a
``Got``: type, dtype, shape, sharding, the bytes of every addressable shard
of each leaf; or the error) for the test to compare.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np

from tests.multiprocess import worker
from tests.multiprocess.worker import Error


@dataclasses.dataclass(frozen=True)
class Leaf:
  """What a restored leaf is, down to its bits (keys: their key data's)."""
  type: str
  dtype: str | None = None
  shape: list[int] | None = None
  sharding: str | None = None   # a jax.Array's, as repr()
  shards: list | None = None    # a jax.Array's: [(device, index, hex)]
  bytes: str | None = None      # a numpy value's, as hex
  value: str | None = None      # a Python value's, as repr()


@dataclasses.dataclass(frozen=True)
class Got:
  """What a call returned ({leaf path: Leaf}), or what it raised."""
  error: Error | None = None
  leaves: dict[str, Leaf] | None = None


@dataclasses.dataclass(frozen=True)
class Restores:
  """One target restored by both."""
  ckptr: Got                 # the Checkpointer's restore
  mt: Got                    # the MultiTierCheckpointer's
  tier: str | None           # its last_restore_tier
  from_partner: bool | None  # its local tier's last_restore_stats'


@dataclasses.dataclass(frozen=True)
class Case:
  save: Got                  # the MultiTierCheckpointer's save
  wait: Got                  # ... wait_until_finished
  manifest: dict[str, str]   # each leaf's dtype in the local tier
  restores: dict[str, Restores]  # by target ("<name>/wiped": after a wipe)
  close: Got


@dataclasses.dataclass(frozen=True)
class SaveThenClose:
  save: Got
  close: Got


@dataclasses.dataclass(frozen=True)
class Result:
  refusal: Case
  restore_dtype: Case
  save_dtype: Case
  keys: Case
  save_then_close: SaveThenClose
  uncommitted: Case
  uneven: Case


def describe(x) -> Leaf:
  """What a restored leaf is, down to its bits (keys: their key data's)."""
  import jax  # pylint: disable=g-import-not-at-top
  from ckpt.format import prng  # pylint: disable=g-import-not-at-top
  if isinstance(x, jax.Array):
    data = jax.random.key_data(x) if prng.is_key_dtype(x.dtype) else x
    return Leaf("jax.Array", dtype=str(x.dtype), shape=list(x.shape),
                sharding=repr(x.sharding),
                shards=[list(t) for t in sorted(
                    (s.device.id, str(s.index),
                     np.asarray(s.data).tobytes().hex())
                    for s in data.addressable_shards)])
  if isinstance(x, (np.ndarray, np.generic)):
    return Leaf(type(x).__name__, dtype=str(x.dtype),
                shape=list(np.shape(x)),
                bytes=np.asarray(x).tobytes().hex())
  return Leaf(type(x).__name__, value=repr(x))


def outcome(fn) -> Got:
  """{leaf: describe(value)} of what fn() returns, or its error."""
  import jax  # pylint: disable=g-import-not-at-top
  got = worker.timed(fn)
  if not got.ok:
    return Got(error=got.error)
  flat, _ = jax.tree_util.tree_flatten_with_path(got.value)
  return Got(leaves={jax.tree_util.keystr(p): describe(v) for p, v in flat})


def run(conf: dict) -> Result:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.multihost import process as multihost  # pylint: disable=g-import-not-at-top
  pid = jax.process_index()
  root = conf["root"]
  mesh = Mesh(np.array(jax.devices()), ("x",))   # 2 processes x 2 devices
  by_x, whole = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
  rng = np.random.default_rng(3)
  w = rng.standard_normal((8, 16)).astype(np.float32) + 0.7
  ints = rng.integers(-1000, 1000, (8, 4)).astype(np.int32)

  def put(a, sharding):
    return jax.make_array_from_callback(a.shape, sharding, lambda i: a[i])

  def sds(shape, dtype, sharding=None):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

  def keys(n, seed, sharding, impl=None):
    """n typed keys laid out by ``sharding`` (built from their key data:
    device_put cannot place onto other processes' devices)."""
    data = np.asarray(jax.random.key_data(
        jax.random.split(jax.random.key(seed, impl=impl), n)))
    spec = NamedSharding(sharding.mesh, P(*sharding.spec, None))
    return jax.random.wrap_key_data(put(data, spec), impl=impl)

  state_arrays = {"w": put(w, by_x), "i": put(ints, by_x),
                  "r": put(w[:2], whole)}
  host_leaves = {"h": w[0, :3].copy(), "s": np.float32(1.7), "p": 0.3,
                 "step": np.int64(7)}
  res: dict = {}
  n = [0]

  def both(case, state, targets, kwargs=None, wipe=False):
    """Saves ``state`` with a Checkpointer and a MultiTierCheckpointer
    (local tier only), then restores each target with both; with ``wipe``
    process 1's local directory goes before a second round of restores
    (its part then comes from its partner's replica)."""
    kwargs = kwargs or {}
    n[0] += 1
    base = os.path.join(root, f"{case}_{n[0]}")
    c = ckpt.Checkpointer(os.path.join(base, "persistent"), **kwargs)
    c.save(1, state)
    c.wait_until_finished()
    mt = ckpt.MultiTierCheckpointer(
        os.path.join(base, "mt_persistent"), local=os.path.join(base, "local"),
        persistent_interval=None, barrier_timeout_s=60, **kwargs)
    save = outcome(lambda: mt.save(1, state) and None)
    wait = outcome(mt.wait_until_finished)
    manifest = _manifest(os.path.join(base, "local"), pid)
    restores = {}
    rounds = [False, True] if wipe else [False]
    for wiped in rounds:
      if wiped:
        multihost.barrier(f"{case}-{n[0]}-wipe")
        if pid == 1:
          shutil.rmtree(os.path.join(base, "local", "process_1"))
        multihost.barrier(f"{case}-{n[0]}-wiped")
      for name, target in targets.items():
        label = f"{name}{'/wiped' if wiped else ''}"
        mt.last_restore_tier = None
        mt.local.restorer.last_restore_stats = {}
        ckptr = outcome(lambda t=target: c.restore(1, target=t))
        got = outcome(lambda t=target: mt.restore(target=t))
        restores[label] = Restores(
            ckptr, got, mt.last_restore_tier,
            mt.local.last_restore_stats.get("from_partner"))
    close = outcome(mt.close)
    c.close()
    res[case] = Case(save, wait, manifest, restores, close)
    return mt

  # A float32 leaf (sharded, and a numpy one) into an int32 target: refused,
  # and a good target afterwards still restores (the rounds stay in step).
  good = {"w": sds((8, 16), np.float32, by_x), "i": sds((8, 4), np.int32, by_x),
          "h": np.zeros(3, np.float32)}
  both("refusal", {**state_arrays, "h": host_leaves["h"]}, {
      "w_int": {**good, "w": sds((8, 16), np.int32, by_x)},
      "h_int": {**good, "h": np.zeros(3, np.int32)},
      "i_float": {**good, "i": sds((8, 4), np.float32, by_x)},
      "w_shape": {**good, "w": sds((16, 8), np.float32, by_x)},
      "good": good}, wipe=True)

  # restore_dtype / save_dtype: floating leaves only, as the persistent tier.
  arrays = {"w": sds((8, 16), np.float32, by_x),
            "i": sds((8, 4), np.int32, by_x),
            "r": sds((2, 16), np.float32, whole), "h": np.zeros(3, np.float32),
            "s": np.float32(0), "p": 0.0, "step": np.int64(0)}
  targets = {"arrays": arrays,  # a numpy leaf onto a sharding, too:
             "all": {**arrays, "h": sds((3,), np.float32, whole)}}
  state = {**state_arrays, **host_leaves}
  both("restore_dtype", state, targets, {"restore_dtype": "bfloat16"},
       wipe=True)
  both("save_dtype", state, targets, {"save_dtype": "bfloat16"}, wipe=True)

  # Typed PRNG keys: sharded, replicated (rbg), one uncommitted key per
  # process (a host value), and a target of another implementation.
  ks = {"k": keys(8, 7, by_x), "rbg": keys(4, 3, whole, "rbg"),
        "u": jax.random.key(5), "w": state_arrays["w"]}
  fry, rbg = ks["k"].dtype, ks["rbg"].dtype
  ktarget = {"k": sds((8,), fry, by_x), "rbg": sds((4,), rbg, whole),
             "u": sds((), fry), "w": sds((8, 16), np.float32, by_x)}
  both("keys", ks, {"all": ktarget,
                    "other_impl": {**ktarget, "k": sds((8,), rbg, by_x)},
                    "not_keys": {**ktarget, "w": sds((8, 16), fry, by_x)}},
       wipe=True)

  # Uncommitted single-device arrays (each process's own default device):
  # saved, then closed with no other call between.
  unc = {"c": jnp.asarray(10), "f": jnp.asarray(2.5, np.float32),
         "w": state_arrays["w"]}
  mt = ckpt.MultiTierCheckpointer(
      os.path.join(root, "close", "persistent"),
      local=os.path.join(root, "close", "local"), persistent_interval=None,
      barrier_timeout_s=60)
  saved = outcome(lambda: mt.save(1, unc) and None)
  res["save_then_close"] = SaveThenClose(saved, outcome(mt.close))
  both("uncommitted", unc, {"all": {
      "c": sds((), np.int32), "f": jnp.asarray(0.0, np.float32),
      "w": sds((8, 16), np.float32, by_x)}})

  # A target sharding that does not divide the leaf (5 rows over 4 devices).
  u = np.arange(15, dtype=np.float32).reshape(5, 3)
  both("uneven", {"u": put(u, whole), "w": state_arrays["w"]},
       {"uneven": {"u": sds((5, 3), np.float32, by_x),
                   "w": sds((8, 16), np.float32, by_x)}})
  return Result(**res)


def _manifest(local: str, pid: int) -> dict:
  """Each stored leaf's dtype in this process's newest local step."""
  d = os.path.join(local, f"process_{pid}")
  steps = sorted(n for n in (os.listdir(d) if os.path.isdir(d) else ())
                 if n.startswith("step_") and "." not in n)
  if not steps:
    return {}
  with open(os.path.join(d, steps[-1], "manifest.json")) as f:
    m = json.load(f)
  return {name: e["dtype"] for name, e in m["own"].items()}


if __name__ == "__main__":
  worker.main(run)
