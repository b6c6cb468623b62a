"""Typed PRNG keys (``jax.random.key``) as checkpoint leaves.

A key array is stored as its key data (uint32 with the implementation's
trailing dimensions) plus the implementation's name in the index entry, and
restored as typed keys of that implementation with the target's sharding.
"""

from __future__ import annotations

import json

import jax
import msgpack
from tests import sealed
import numpy as np
import pytest

import ckpt
from ckpt.cli import main as cli
from ckpt.format import index as index_lib
from ckpt.format import index_codec
from ckpt.restore import read as restore_lib
from ckpt.store import storage as storage_lib
from ckpt.restore import transforms
from ckpt.format import entries as entries_lib
from tests.conftest import mesh, named

THREEFRY = jax.random.key(0).dtype
RBG = jax.random.key(0, impl="rbg").dtype


@pytest.fixture(autouse=True, scope="module")
def _stored_keys(arrays_only):
  """Keys stored as TensorStore arrays, as before packing; packed keys are
  tests/save/test_pack.py's."""


def key_bits(x) -> np.ndarray:
  return np.asarray(jax.random.key_data(x))


def same_keys(got, want) -> bool:
  """Same key dtype (so same implementation), shape and bits."""
  got_bits, want_bits = key_bits(got), key_bits(want)
  return (got.dtype == want.dtype and got.shape == want.shape and
          got_bits.dtype == want_bits.dtype and
          np.array_equal(got_bits, want_bits))


def read_index(directory, step: int = 1) -> index_lib.Index:
  storage = storage_lib.Storage(str(directory))
  _, step_dir = restore_lib.locate(storage, step)
  return restore_lib.read_index(storage, step_dir)


def entries(directory, step: int = 1) -> dict[str, entries_lib.Entry]:
  return {"/".join(e.path): e for e in read_index(directory, step).leaves}


def split8(mesh_, *spec, impl=None):
  """8 keys split from one, laid out by NamedSharding(mesh_, P(*spec))."""
  keys = jax.random.split(jax.random.key(7, impl=impl), 8)
  return jax.device_put(keys, named(mesh_, *spec))


def sds_like(x, sharding):
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def abstract_split8(sharding):
  """A target as a training script makes one: jax.eval_shape + a sharding."""
  a = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), 8))
  return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)


# ---- save and restore ----------------------------------------------------------

def test_default_threefry_key(make_ckptr, ckpt_dir):
  key = jax.random.key(0)
  c = make_ckptr()
  c.save(1, {"rng": key, "step": 3})
  c.wait_until_finished()
  out = c.restore(1, target={"rng": key, "step": 0})
  assert isinstance(out["rng"], jax.Array) and out["rng"].dtype == THREEFRY
  assert same_keys(out["rng"], key) and out["step"] == 3
  assert out["rng"].sharding == key.sharding
  # still a working key
  assert np.array_equal(jax.random.normal(out["rng"], (4,)),
                        jax.random.normal(key, (4,)))
  e = entries(ckpt_dir)["rng"]
  assert e.prng_impl == "threefry2x32"


def test_rbg_key(make_ckptr, mesh8):
  key = jax.random.key(3, impl="rbg")
  many = split8(mesh8, "model", impl="rbg")
  c = make_ckptr()
  c.save(1, {"one": key, "many": many})
  c.wait_until_finished()
  target = {"one": jax.ShapeDtypeStruct((), RBG),
            "many": sds_like(many, named(mesh8, "data"))}
  out = c.restore(1, target=target)
  assert out["one"].dtype == RBG and out["many"].dtype == RBG
  assert same_keys(out["one"], key) and same_keys(out["many"], many)
  assert out["many"].sharding == named(mesh8, "data")
  assert key_bits(out["many"]).shape == (8, 4)  # rbg keys are 4 uint32


@pytest.mark.parametrize("fmt", ["zarr", "ocdbt"])
def test_sharded_split_keys_restore_onto_another_sharding(make_ckptr, ckpt_dir,
                                                          mesh8, fmt):
  keys = split8(mesh8, "data")  # 2 distinct shards of 4 keys
  c = make_ckptr(format=fmt)
  c.save(1, {"rng": keys})
  c.wait_until_finished()
  e = entries(ckpt_dir)["rng"]
  assert isinstance(e, entries_lib.ArrayEntry)  # sharded: stored, not inline
  assert (e.shape, e.dtype, e.prng_impl) == ((8, 2), "uint32", "threefry2x32")
  # One process: each of the 2 distinct shards written once (replicas skip).
  assert c.last_save_stats.boxes_written == 2
  if fmt == "zarr":  # and checksummed in the process's file
    doc = sealed.unpackb((ckpt_dir / "checkpoint_1" / index_lib.process_file(
        index_lib.CHECKSUMS_DIR, 0)).read_bytes(), raw=False)
    assert sorted((tuple(a), tuple(b)) for _, a, b, _ in doc["boxes"]) == [
        ((0, 0), (4, 2)), ((4, 0), (8, 2))]

  other = mesh((4, 2), ("x", "y"))
  for sharding in (named(mesh8, "model"), named(other, ("x", "y")),
                   named(other, None), jax.sharding.SingleDeviceSharding(
                       jax.devices()[5])):
    out = c.restore(1, target={"rng": abstract_split8(sharding)})["rng"]
    assert out.dtype == keys.dtype and out.shape == (8,)
    assert np.array_equal(key_bits(out), key_bits(keys))
    assert out.sharding.is_equivalent_to(sharding, 1)
    if not isinstance(sharding, jax.sharding.NamedSharding) or sharding.spec:
      assert out.sharding == sharding
    for shard in out.addressable_shards:  # every device holds its own part
      assert np.array_equal(key_bits(shard.data), key_bits(keys)[shard.index])
  # a typed key jax.Array as the target gives its sharding too
  like = jax.device_put(jax.random.split(jax.random.key(1), 8),
                        named(mesh8, ("model", "data")))
  out = c.restore(1, target={"rng": like})["rng"]
  assert same_keys(out, keys) and out.sharding == like.sharding


def test_target_none_gives_typed_keys_on_the_default_device(make_ckptr,
                                                            mesh8):
  state = {"one": jax.random.key(5), "many": split8(mesh8, "model"),
           "rbg": jax.random.key(9, impl="rbg"), "w": np.arange(3.0)}
  c = make_ckptr()
  c.save(1, state)
  c.wait_until_finished()
  out = c.restore(1)
  for name in ("one", "many", "rbg"):
    assert isinstance(out[name], jax.Array), name
    assert same_keys(out[name], state[name]), name
    assert out[name].sharding.device_set == {jax.devices()[0]}, name
  assert isinstance(out["w"], np.ndarray)


def test_load(make_ckptr, ckpt_dir, mesh8):
  state = {"opt": {"rng": split8(mesh8, "data")}, "seed": jax.random.key(1)}
  c = make_ckptr()
  c.save(4, state)
  c.wait_until_finished()
  out = ckpt.load(ckpt_dir)
  assert same_keys(out["opt"]["rng"], state["opt"]["rng"])
  assert same_keys(out["seed"], state["seed"])


@pytest.mark.parametrize("n", [1, 64])  # 8 bytes: inline; 512: stored
def test_inline_and_stored_keys_keep_their_implementation(make_ckptr,
                                                          ckpt_dir, n):
  state = {"fry": jax.random.split(jax.random.key(0), n),
           "rbg": jax.random.split(jax.random.key(0, impl="rbg"), n)}
  c = make_ckptr()
  c.save(1, state)
  c.wait_until_finished()
  e = entries(ckpt_dir)
  kind = entries_lib.ValueEntry if n == 1 else entries_lib.ArrayEntry
  assert isinstance(e["fry"], kind) and isinstance(e["rbg"], kind)
  assert (e["fry"].prng_impl, e["rbg"].prng_impl) == ("threefry2x32", "rbg")
  out = c.restore(1)
  assert same_keys(out["fry"], state["fry"])
  assert same_keys(out["rbg"], state["rbg"])
  out = c.restore(1, target={k: jax.ShapeDtypeStruct(v.shape, v.dtype)
                             for k, v in state.items()})
  assert same_keys(out["fry"], state["fry"])
  assert same_keys(out["rbg"], state["rbg"])


def test_scalar_key_inline_restores_sharded(make_ckptr, mesh8):
  key = jax.random.key(11)
  c = make_ckptr()
  c.save(1, {"rng": key})
  c.wait_until_finished()
  sharding = named(mesh8)
  out = c.restore(1, target={"rng": sds_like(key, sharding)})["rng"]
  assert same_keys(out, key) and out.sharding == sharding
  assert len(out.addressable_shards) == 8


def test_rename_transform(make_ckptr, mesh8):
  state = {"old": {"rng": split8(mesh8, "data"), "seed": jax.random.key(2)}}
  c = make_ckptr()
  c.save(1, state)
  c.wait_until_finished()
  sharding = named(mesh8, "model")
  target = {"new": {"rng": sds_like(state["old"]["rng"], sharding),
                    "seed": jax.ShapeDtypeStruct((), THREEFRY)}}
  out = c.restore(1, target=target,
                  transforms=[transforms.rename(r"old/(.*)", r"new/\1")])
  assert same_keys(out["new"]["rng"], state["old"]["rng"])
  assert out["new"]["rng"].sharding == sharding
  assert same_keys(out["new"]["seed"], state["old"]["seed"])
  # and with no target
  out = c.restore(1, transforms=[transforms.rename(r"old/(.*)", r"new/\1")])
  assert same_keys(out["new"]["rng"], state["old"]["rng"])


def test_stack_layers_of_keys(make_ckptr, mesh8):
  layers = {f"layers_{i}": {"rng": split8(mesh8, "data")} for i in range(2)}
  layers["layers_1"]["rng"] = jax.random.split(jax.random.key(3), 8)
  c = make_ckptr()
  c.save(1, layers)
  c.wait_until_finished()
  sharding = named(mesh8, None, "model")
  target = {"layers": {"rng": jax.ShapeDtypeStruct((2, 8), THREEFRY,
                                                   sharding=sharding)}}
  out = c.restore(1, target=target, transforms=[transforms.stack_layers()])
  got = out["layers"]["rng"]
  assert got.dtype == THREEFRY and got.sharding == sharding
  assert np.array_equal(key_bits(got), np.stack(
      [key_bits(layers[f"layers_{i}"]["rng"]) for i in range(2)]))


def test_lazy_restore_and_fallback(make_ckptr, mesh8):
  keys = split8(mesh8, "data")
  c = make_ckptr()
  c.save(1, {"rng": keys})
  c.wait_until_finished()
  sharding = named(mesh8, "model")
  target = {"rng": sds_like(keys, sharding),
            "extra": jax.ShapeDtypeStruct((), RBG)}
  extra = jax.random.key(4, impl="rbg")
  out = c.restore(1, target=target, lazy=True,
                  fallback_state={"extra": extra})
  assert isinstance(out["rng"], ckpt.LazyLeaf)
  assert out["rng"].prng_impl == "threefry2x32"
  got = out["rng"].read()
  assert same_keys(got, keys) and got.sharding == sharding
  assert same_keys(out["extra"].read(), extra)
  out = c.restore(1, target=target, fallback_state={"extra": extra})
  assert same_keys(out["extra"], extra) and same_keys(out["rng"], keys)


def test_keys_untouched_by_save_and_restore_dtype(make_ckptr):
  key = jax.random.split(jax.random.key(0), 64)
  c = make_ckptr(save_dtype="bfloat16", restore_dtype="bfloat16")
  c.save(1, {"rng": key, "w": np.ones(100, np.float32)})
  c.wait_until_finished()
  out = c.restore(1)
  assert same_keys(out["rng"], key) and out["w"].dtype.name == "bfloat16"


# ---- mismatches and bad input --------------------------------------------------

def test_key_of_another_implementation_is_a_mismatch(make_ckptr, mesh8):
  c = make_ckptr()
  c.save(1, {"opt": {"rng": split8(mesh8, "data")},
             "seed": jax.random.key(0), "w": np.zeros((8, 2), np.uint32)})
  c.wait_until_finished()
  with pytest.raises(ckpt.TreeMismatchError, match=r"'opt/rng'.*threefry2x32"
                     r".*rbg"):
    c.restore(1, target={"opt": {"rng": jax.ShapeDtypeStruct((8,), RBG)}})
  with pytest.raises(ckpt.TreeMismatchError, match=r"'seed'.*rbg"):
    c.restore(1, target={"seed": jax.random.key(0, impl="rbg")})
  # keys are not their raw data, nor the other way round
  with pytest.raises(ckpt.TreeMismatchError, match=r"'opt/rng'.*uint32"):
    c.restore(1, target={"opt": {"rng": jax.ShapeDtypeStruct((8, 2),
                                                             np.uint32)}})
  with pytest.raises(ckpt.TreeMismatchError, match=r"'w'.*not PRNG keys"):
    c.restore(1, target={"w": jax.ShapeDtypeStruct((8,), THREEFRY)})
  with pytest.raises(ckpt.TreeMismatchError, match=r"'opt/rng'.*\(4,\)"):
    c.restore(1, target={"opt": {"rng": jax.ShapeDtypeStruct((4,),
                                                             THREEFRY)}})


def _unregistered_impl_key():
  from jax.extend import random as jex_random  # pylint: disable=g-import-not-at-top
  impl = jex_random.define_prng_impl(
      key_shape=(2,), seed=lambda s: jax.numpy.stack([s, s]).astype("uint32"),
      split=lambda k, shape: jax.numpy.zeros((*shape, 2), "uint32"),
      random_bits=lambda k, bits, shape: jax.numpy.zeros(shape, "uint32"),
      fold_in=lambda k, d: k, name="ckpt_test_unregistered")
  return jax.random.key(0, impl=impl)


@pytest.mark.parametrize("leaf", ["object_array", "big_object_array",
                                  "unregistered_key"])
def test_leaves_ckpt_cannot_store_name_the_path(make_ckptr, leaf):
  value = {"object_array": lambda: np.array([1, "a"], dtype=object),
           "big_object_array": lambda: np.array([object()] * 100),
           "unregistered_key": _unregistered_impl_key}[leaf]()
  c = make_ckptr()
  with pytest.raises(ckpt.InvalidStateError, match=r"'model/bad'"):
    c.save(1, {"model": {"bad": value, "rng": jax.random.key(0)}})
  c.save(2, {"model": {"rng": jax.random.key(0)}})  # the key alone is fine
  c.wait_until_finished()
  assert c.all_steps() == [2]


# ---- the index -----------------------------------------------------------------

def _index_doc(leaf: dict) -> bytes:
  doc = {"format": index_lib.FORMAT_NAME, "version": index_lib.VERSION,
         "step": 1, "time": 0.0, "storage_format": "zarr", "process_count": 1,
         "metrics": {}, "structure": 0,
         "leaves": index_codec.columns([leaf], entries_lib.KINDS),
         "host_state": None}
  return sealed.packb(doc, use_bin_type=True)


def _array_leaf(**changes) -> dict:
  """An index entry as saved for 8 threefry keys (plain data, so that this
  module loads whatever ArrayEntry accepts)."""
  return {"path": ["rng"], "kind": "array", "relpath": "rng", "shape": [8, 2],
          "dtype": "uint32", "chunks": [8, 2], "codec": {"compression": None},
          "source_dtype": "uint32", "sharding": "", "checksums": [],
          "prng_impl": "threefry2x32", **changes}


def _value_leaf(**changes) -> dict:
  """An inline entry as saved for one rbg key."""
  data = np.arange(4, dtype=np.uint32)
  return {"path": ["rng"], "kind": "value", "prng_impl": "rbg",
          "value": {"np": "uint32", "shape": [4], "scalar": False,
                    "data": data.tobytes()}, **changes}


def test_index_round_trip_and_old_indexes():
  for leaf, impl in ((_array_leaf(), "threefry2x32"), (_value_leaf(), "rbg")):
    entry = index_lib.decode(_index_doc(leaf)).leaves[0]
    assert entry.prng_impl == impl
    again = index_lib.decode(_index_doc(entry.to_json())).leaves[0]
    assert again.prng_impl == impl and again.to_json() == entry.to_json()
    old = {k: v for k, v in leaf.items() if k != "prng_impl"}
    assert index_lib.decode(_index_doc(old)).leaves[0].prng_impl == ""
  plain = entries_lib.ValueEntry(("rng",), np.zeros(2, np.uint32)).to_json()
  assert "prng_impl" not in plain  # non-key entries are as before


@pytest.mark.parametrize("leaf,match", [
    (_array_leaf(prng_impl="no_such_prng"), "PRNG implementation"),
    (_array_leaf(prng_impl=7), "PRNG implementation"),
    (_array_leaf(prng_impl="rbg"), r"rbg key data"),  # (8, 2) is not rbg's
    (_array_leaf(dtype="int32", source_dtype="int32"), "key data"),
    (_value_leaf(prng_impl="threefry2x32"), "key data"),  # 4 != (2,)
    (_value_leaf(prng_impl="x" * 10_000), "PRNG implementation"),
    ({"path": ["rng"], "kind": "value", "value": {"py": "int", "v": 3},
      "prng_impl": "rbg"}, "key data"),
])
def test_index_rejects_bad_prng_impl(leaf, match):
  with pytest.raises(ckpt.CorruptCheckpointError, match=match):
    index_lib.decode(_index_doc(leaf), "idx")


# ---- ckpt inspect --------------------------------------------------------------

def test_inspect_shows_keys_and_implementation(make_ckptr, ckpt_dir, mesh8,
                                               capsys):
  c = make_ckptr()
  c.save(1, {"rng": split8(mesh8, "data"), "seed": jax.random.key(0),
             "rbg": jax.random.key(0, impl="rbg"), "w": np.ones(3)})
  c.wait_until_finished()
  assert cli.main(["inspect", str(ckpt_dir), "--json"]) == 0
  doc = json.loads(capsys.readouterr().out)
  leaves = {x["path"]: x for x in doc["leaves"]}
  assert leaves["rng"]["prng_impl"] == "threefry2x32"
  assert leaves["rng"]["keys_shape"] == [8] and leaves["rng"]["shape"] == [8, 2]
  assert leaves["seed"]["prng_impl"] == "threefry2x32"
  assert leaves["seed"]["kind"] == "value" and leaves["seed"]["keys_shape"] == []
  assert leaves["rbg"]["prng_impl"] == "rbg"
  assert leaves["w"]["prng_impl"] is None

  assert cli.main(["inspect", str(ckpt_dir)]) == 0
  out = capsys.readouterr().out
  rows = {line.split()[0]: line.split() for line in out.splitlines()
          if line.split() and line.split()[0] in leaves}
  assert rows["rng"][1:3] == ["(8,)", "key<threefry2x32>"]
  assert rows["seed"][1:4] == ["()", "key<threefry2x32>", "inline"]
  assert rows["rbg"][1:3] == ["()", "key<rbg>"]
  assert "3 leaves hold typed PRNG keys (rbg, threefry2x32)" in out
