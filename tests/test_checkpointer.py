"""End to end, one process with 8 CPU devices, real TensorStore on disk."""

import dataclasses
import enum
import hashlib
import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import msgpack
from tests import sealed
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding

import ckpt
from ckpt.format import index as index_lib
from ckpt.format import index_codec
from ckpt.format import checks
from ckpt.format import entries
from tests.conftest import (AdamState, TrainState, mesh, named,
                            random_array, sharded)

BF16 = np.dtype(ml_dtypes.bfloat16)
MiB = 1 << 20




# ---- helpers ----------------------------------------------------------------

def make_state(rng, m):
  """One of every leaf kind the issue lists, over mesh ``m`` (2 x 4)."""
  w = random_array(rng, (64, 32))
  return {
      "params": {
          "sharded": sharded(w, named(m, "data", "model")),
          "cols_bf16": sharded(random_array(rng, (16, 64), BF16),
                               named(m, None, "model")),
          "replicated": sharded(random_array(rng, (32, 16)), named(m)),
          "single": jax.device_put(random_array(rng, (40, 8), np.int32),
                                   jax.devices()[3]),
          "tiny_sharded": sharded(random_array(rng, (8,)), named(m, "model")),
          "scalar": jnp.asarray(random_array(rng, ())),
          "mask": sharded(random_array(rng, (32, 64), np.bool_),
                          named(m, "model", "data")),
          "u8": sharded(random_array(rng, (16, 64), np.uint8),
                        named(m, "data", None)),
      },
      "host": {
          "f32": random_array(rng, (30, 20)),
          "bf16": random_array(rng, (50, 10), BF16),
          "bools": random_array(rng, (700,), np.bool_),
          "i8_small": random_array(rng, (5,), np.int8),
          "u64": random_array(rng, (100,), np.uint64),
          "c64": (random_array(rng, (40,)) + 1j * random_array(rng, (40,))
                  ).astype(np.complex64),
          "zero_d": np.asarray(rng.standard_normal()),
          "empty": np.zeros((0, 3), np.float32),
      },
      "scalars": {
          "np_f32": np.float32(rng.standard_normal()),
          "np_i64": np.int64(rng.integers(-2**40, 2**40)),
          "np_bf16": BF16.type(rng.standard_normal()),
          "np_bool": np.bool_(rng.random() < 0.5),
          "py_int": int(rng.integers(-2**62, 2**62)),
          "py_float": float(rng.standard_normal()),
          "py_true": True,
          "py_false": False,
      },
      "text": "héllo wörld",
      "blob": bytes(rng.integers(0, 256, 17, dtype=np.uint8)),
      "nothing": None,
      "empty_dict": {},
      "empty_tuple": (),
      "train": TrainState(
          params={"w": sharded(w + 1, named(m, "model", None))},
          opt_state=(AdamState(
              count=np.int32(rng.integers(100)),
              mu={"w": sharded(random_array(rng, (64, 32)), named(m, "model"))},
              nu={"w": sharded(random_array(rng, (64, 32)), named(m, None, "data"))}),
                     ()),
          step=int(rng.integers(1000))),
      "layers": [sharded(random_array(rng, (24, 8)), named(m, "data")),
                 (random_array(rng, (3, 3)), "layer-1")],
  }


def to_host(x):
  """What restore(target=None) should give for a saved value."""
  if isinstance(x, TrainState):
    return {"params": to_host(x.params), "opt_state": to_host(x.opt_state),
            "step": to_host(x.step)}
  if isinstance(x, AdamState):
    return {k: to_host(v) for k, v in x._asdict().items()}
  if isinstance(x, dict):
    return {k: to_host(v) for k, v in x.items()}
  if isinstance(x, list):
    return [to_host(v) for v in x]
  if isinstance(x, tuple):
    return tuple(to_host(v) for v in x)
  if isinstance(x, jax.Array):
    return np.asarray(x)
  return x


def assert_same(actual, expected, path="<root>"):
  """Bit-exact, type-exact comparison of nested values."""
  if isinstance(expected, (jax.Array, np.ndarray)):
    assert type(actual) is type(expected) or (
        isinstance(expected, jax.Array) and isinstance(actual, jax.Array)), (
            path, type(actual), type(expected))
    assert actual.shape == expected.shape, (path, actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (path, actual.dtype, expected.dtype)
    assert np.asarray(actual).tobytes() == np.asarray(expected).tobytes(), path
    return
  assert type(actual) is type(expected), (path, type(actual), type(expected))
  if isinstance(expected, dict):
    # Key order is jax's (sorted), as with any pytree round trip.
    assert sorted(actual, key=repr) == sorted(expected, key=repr), (
        path, list(actual), list(expected))
    for k in expected:
      assert_same(actual[k], expected[k], f"{path}/{k}")
  elif isinstance(expected, (list, tuple)) and not hasattr(expected, "_fields"):
    assert len(actual) == len(expected), path
    for i, (a, e) in enumerate(zip(actual, expected)):
      assert_same(a, e, f"{path}/{i}")
  elif dataclasses.is_dataclass(expected) or hasattr(expected, "_fields"):
    fields = (expected._fields if hasattr(expected, "_fields") else
              [f.name for f in dataclasses.fields(expected)])
    for f in fields:
      assert_same(getattr(actual, f), getattr(expected, f), f"{path}/{f}")
  elif isinstance(expected, np.generic):
    assert actual.dtype == expected.dtype, path
    assert actual.tobytes() == expected.tobytes(), path
  else:
    assert actual == expected, (path, actual, expected)


def assert_placed(restored, target):
  """Every restored jax.Array has the target's sharding (and shape/dtype)."""
  for r, t in zip(jax.tree_util.tree_leaves(restored),
                  jax.tree_util.tree_leaves(target)):
    if isinstance(t, (jax.ShapeDtypeStruct, jax.Array)):
      assert isinstance(r, jax.Array), type(r)
      assert r.shape == t.shape and r.dtype == t.dtype
      assert r.sharding.is_equivalent_to(t.sharding, len(t.shape)), (
          r.sharding, t.sharding)


def sds_like(tree_):
  """ShapeDtypeStruct targets for the jax.Array leaves, other leaves as is."""
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      if isinstance(x, jax.Array) else x, tree_)


def tree_digest(root):
  """Hash of every file (path and content) under ``root``."""
  h = hashlib.sha256()
  for dirpath, dirnames, filenames in sorted(os.walk(root)):
    dirnames.sort()
    for f in sorted(filenames):
      p = os.path.join(dirpath, f)
      h.update(os.path.relpath(p, root).encode())
      with open(p, "rb") as fh:
        h.update(fh.read())
  return h.hexdigest()


def read_index(step_dir):
  with open(os.path.join(step_dir, "index.msgpack"), "rb") as f:
    return index_lib.decode(f.read(), step_dir)


def entry(idx, name):
  (e,) = [e for e in idx.leaves if "/".join(e.path) == name]
  return e


# ---- round trips ------------------------------------------------------------

@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_round_trip_every_leaf_kind(make_ckptr, ckpt_dir, rng, mesh8,
                                    async_save):
  state = make_state(rng, mesh8)
  kwargs = {} if async_save else {"async_save": False}  # default is async
  ckptr = make_ckptr(**kwargs)
  assert ckptr.save(3, state, metrics={"loss": 0.5}) is True
  if async_save:
    ckptr.wait_until_finished()
  assert ckptr.all_steps() == [3] and ckptr.latest_step() == 3
  assert ckptr.metrics(3) == {"loss": 0.5}
  stats = ckptr.last_save_stats
  assert stats.step == 3 and not stats.skipped
  assert stats.array_leaves > 0 and stats.inline_leaves > 0
  assert stats.bytes_written > 64 * 32 * 4

  # No target: host values in the saved structure, custom nodes as dicts.
  restored = ckptr.restore()
  assert_same(restored, to_host(state))
  assert isinstance(restored["params"]["sharded"], np.ndarray)

  # ShapeDtypeStruct targets: the same shardings, types and custom nodes.
  target = sds_like(state)
  restored = ckptr.restore(3, target=target)
  assert_same(restored, state)
  assert isinstance(restored["train"], TrainState)
  assert isinstance(restored["train"].opt_state[0], AdamState)
  assert_placed(restored, target)

  # A fresh Checkpointer (nothing cached) and ckpt.load see the same.
  other = make_ckptr()
  assert_same(other.restore(3, target=target), state)
  assert_same(ckpt.load(ckpt_dir), to_host(state))


def test_async_save_returns_before_commit_and_data_is_copied(make_ckptr,
                                                             rng, mesh8):
  x = random_array(rng, (256, 64))
  state = {"host": x.copy(), "dev": sharded(x, named(mesh8, "data"))}
  ckptr = make_ckptr()
  assert ckptr.save(1, state)
  # The caller may now mutate or delete what it passed in.
  state["host"][:] = 0
  state["dev"].delete()
  ckptr.wait_until_finished()
  out = ckptr.restore(1)
  assert out["host"].tobytes() == x.tobytes()
  assert out["dev"].tobytes() == x.tobytes()
  assert ckptr.last_save_stats.total_s >= ckptr.last_save_stats.blocking_s


def test_consecutive_async_saves(make_ckptr, rng, mesh8):
  ckptr = make_ckptr()
  states = {}
  for step in (1, 2, 3):
    states[step] = {"w": sharded(random_array(rng, (64, 64)),
                                 named(mesh8, "data", "model"))}
    assert ckptr.save(step, states[step])
  ckptr.close()  # waits for the last one
  reader = make_ckptr()
  assert reader.all_steps() == [1, 2, 3]
  for step, s in states.items():
    assert_same(reader.restore(step, target=sds_like(s)), s)


def test_empty_and_bare_states(make_ckptr, rng, mesh8):
  ckptr = make_ckptr(async_save=False)
  ckptr.save(1, {})
  ckptr.save(2, ())
  x = sharded(random_array(rng, (16, 16)), named(mesh8, "model"))
  ckptr.save(3, x)
  ckptr.save(4, {"a": None, "b": {"c": {}}})
  assert ckptr.restore(1) == {}
  assert ckptr.restore(2) == ()
  assert_same(ckptr.restore(3), np.asarray(x))
  assert_same(ckptr.restore(3, target=sds_like(x)), x)
  assert ckptr.restore(4) == {"a": None, "b": {"c": {}}}


def test_zero_size_sharded_array(make_ckptr, mesh8):
  x = sharded(np.zeros((0, 8), np.float32), named(mesh8, None, "model"))
  ckptr = make_ckptr(async_save=False)
  ckptr.save(1, {"x": x})
  assert_same(ckptr.restore(1, target={"x": sds_like(x)}), {"x": x})
  assert ckptr.restore(1)["x"].shape == (0, 8)


class Phase(enum.IntEnum):
  WARMUP = 1
  DECAY = 2


def test_unusual_host_values(make_ckptr, rng):
  base = random_array(rng, (40, 30))
  state = {
      "big_endian_inline": random_array(rng, (10,)).astype(">f4"),
      "big_endian_array": random_array(rng, (50, 40)).astype(">f8"),
      "big_endian_int": random_array(rng, (300,), np.int32).astype(">i4"),
      "fortran": np.asfortranarray(base),
      "transposed": base.T,
      "strided": base[::3, 1::2],
      "small_transposed": base[:4, :5].T,
      "phase": Phase.DECAY,
  }
  ckptr = make_ckptr(async_save=False)
  ckptr.save(1, state)
  for out in (ckptr.restore(1), ckpt.load(ckptr.storage.url)):
    for k, v in state.items():
      if isinstance(v, np.ndarray):
        assert out[k].dtype == v.dtype.newbyteorder("="), k
        np.testing.assert_array_equal(out[k], v, err_msg=k)
    assert out["phase"] == 2 and type(out["phase"]) is int


@pytest.mark.usefixtures("no_packing")
def test_odd_leaf_names_round_trip(make_ckptr, ckpt_dir, rng):
  names = ["we ird/name", ".hidden", "\u20ac", " AC", "..", "-x", "%41"]
  state = {n: random_array(rng, (100,)) for n in names}  # stored arrays
  state["nested"] = {"..": {".": random_array(rng, (100,))}}
  ckptr = make_ckptr(async_save=False)
  ckptr.save(1, state)
  assert_same(ckptr.restore(1), state)
  # Every array lives inside the step directory, in its own folder.
  idx = read_index(ckpt_dir / "checkpoint_1")
  rels = [e.relpath for e in idx.leaves]
  assert len(set(rels)) == len(rels) == len(names) + 1
  for rel in rels:
    path = (ckpt_dir / "checkpoint_1" / rel).resolve()
    assert path.is_relative_to((ckpt_dir / "checkpoint_1").resolve())
    assert path.is_dir()


# ---- restore onto other meshes and shardings --------------------------------

def saved_for_resharding(make_ckptr, rng, mesh8):
  state = {
      "a": sharded(random_array(rng, (64, 32)), named(mesh8, "data", "model")),
      "b": sharded(random_array(rng, (48, 40), BF16), named(mesh8, None, "model")),
      "c": sharded(random_array(rng, (32,), np.int32), named(mesh8)),
      "d": jax.device_put(random_array(rng, (12, 6)), jax.devices()[5]),
      "e": random_array(rng, (24, 16)),
  }
  ckptr = make_ckptr(async_save=False)
  ckptr.save(1, state)
  return ckptr, state


def other_shardings():
  devs = jax.devices()[::-1]  # a different device order too
  m2 = mesh((4, 2), ("x", "y"), devs)
  m1 = mesh((8,), ("z",), jax.devices()[2:] + jax.devices()[:2])
  return {
      "a": named(m2, "y", "x"),
      "b": named(m1, "z", None),
      "c": named(m2, ("x", "y")),
      "d": named(m2, "x", "y"),
      "e": SingleDeviceSharding(jax.devices()[7]),
  }


def test_restore_onto_other_mesh_via_shape_dtype_structs(make_ckptr, rng,
                                                          mesh8):
  ckptr, state = saved_for_resharding(make_ckptr, rng, mesh8)
  shardings = other_shardings()
  target = {k: jax.ShapeDtypeStruct(np.shape(v), v.dtype, sharding=shardings[k])
            for k, v in state.items()}
  out = ckptr.restore(1, target=target)
  assert_placed(out, target)
  for k, v in state.items():
    assert np.asarray(out[k]).tobytes() == np.asarray(v).tobytes(), k
    # Each device holds exactly its slice of the saved data.
    for shard in out[k].addressable_shards:
      assert np.asarray(shard.data).tobytes() == \
          np.asarray(v)[shard.index].tobytes(), (k, shard.device)


def test_restore_onto_other_mesh_via_array_targets(make_ckptr, rng, mesh8):
  ckptr, state = saved_for_resharding(make_ckptr, rng, mesh8)
  shardings = other_shardings()
  # Arrays of the right shape/dtype/sharding but other (random) contents.
  target = {k: sharded(random_array(rng, np.shape(v), v.dtype), shardings[k])
            for k, v in state.items()}
  out = ckptr.restore(target=target)
  assert_placed(out, target)
  for k, v in state.items():
    assert np.asarray(out[k]).tobytes() == np.asarray(v).tobytes(), k


def test_restore_subset_and_numpy_targets(make_ckptr, rng, mesh8):
  ckptr, state = saved_for_resharding(make_ckptr, rng, mesh8)
  # A target may ask for part of the checkpoint, and for host numpy arrays.
  out = ckptr.restore(target={"b": np.zeros((48, 40), BF16),
                              "e": jax.ShapeDtypeStruct((24, 16), np.float32)})
  assert list(out) == ["b", "e"]
  assert isinstance(out["b"], np.ndarray)
  # A ShapeDtypeStruct without a sharding: the leaf as saved ("e" is a
  # host numpy leaf: numpy; tests/restore/test_restore_as_saved.py).
  assert type(out["e"]) is np.ndarray
  assert out["b"].tobytes() == np.asarray(state["b"]).tobytes()
  assert np.asarray(out["e"]).tobytes() == state["e"].tobytes()


def test_non_array_target_leaf_gets_host_value(make_ckptr, rng):
  x = random_array(rng, (100,))
  make_ckptr(async_save=False).save(1, {"a": x, "b": 3, "c": "s"})
  # Placeholders that are not arrays: the stored value comes back on the host.
  out = make_ckptr().restore(1, target={"a": 0.0, "b": 0, "c": ""})
  assert_same(out, {"a": x, "b": 3, "c": "s"})


# ---- formats, compression, dtypes ------------------------------------------

@pytest.mark.usefixtures("no_packing")
@pytest.mark.parametrize("fmt", ["zarr", "zarr3"])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_formats_and_compression(make_ckptr, ckpt_dir, rng, mesh8, fmt,
                                 compression):
  # Compressible but not constant: small random integers as float32.
  w = rng.integers(0, 4, (128, 64)).astype(np.float32)
  state = {"w": sharded(w, named(mesh8, "data", "model")),
           "h": random_array(rng, (40, 40), BF16)}
  ckptr = make_ckptr(format=fmt, compression=compression, async_save=False)
  ckptr.save(1, state)
  assert_same(ckptr.restore(1, target=sds_like(state)), state)
  assert_same(ckpt.load(ckpt_dir), to_host(state))
  # The index says the format: a Checkpointer set to another one reads it.
  other = make_ckptr(format="zarr3" if fmt == "zarr" else "zarr")
  assert_same(other.restore(1, target=sds_like(state)), state)

  step_dir = ckpt_dir / "checkpoint_1"
  idx = read_index(step_dir)
  assert idx.storage_format == fmt
  e = entry(idx, "w")
  assert e.codec["compression"] == compression
  meta_name = ".zarray" if fmt == "zarr" else "zarr.json"
  meta = json.loads((step_dir / e.relpath / meta_name).read_text())
  if fmt == "zarr":
    assert (meta["compressor"] or {}).get("id") == compression
  else:
    names = [c["name"] for c in meta["codecs"]]
    assert ("zstd" in names) == (compression == "zstd"), names
  data_bytes = sum(f.stat().st_size for f in (step_dir / e.relpath).rglob("*")
                   if f.is_file() and f.name != meta_name)
  if compression is None:
    assert data_bytes >= w.nbytes
  else:
    assert data_bytes < w.nbytes / 2


@pytest.mark.usefixtures("no_packing")
def test_ocdbt_single_process(make_ckptr, ckpt_dir, rng, mesh8):
  state = {"w": sharded(random_array(rng, (64, 32)), named(mesh8, "model")),
           "h": random_array(rng, (100,))}
  ckptr = make_ckptr(format="ocdbt", async_save=False)
  ckptr.save(1, state)
  assert_same(ckptr.restore(1, target=sds_like(state)), state)
  assert (ckpt_dir / "checkpoint_1" / "manifest.ocdbt").exists()


@pytest.mark.parametrize("fmt", ["zarr", "zarr3"])
def test_every_allowed_dtype_round_trips(make_ckptr, ckpt_dir, rng, fmt):
  # Stored arrays (1000 elements) and inline values (8) of every dtype the
  # index accepts: a dtype TensorStore cannot store must be refused at plan
  # time instead.
  state = {}
  for name in sorted(checks.ALLOWED_DTYPES):
    dtype = np.dtype(name)
    state[name] = {"array": rng.integers(0, 7, 1000).astype(dtype),
                   "inline": rng.integers(0, 7, 8).astype(dtype)}
  ckptr = make_ckptr(format=fmt, async_save=False)
  ckptr.save(1, state)
  out = ckptr.restore(1)
  assert_same(out, state)
  idx = read_index(ckpt_dir / "checkpoint_1")
  for name in state:
    assert entry(idx, f"{name}/array").dtype == name
  uint4 = np.dtype(ml_dtypes.uint4)
  if uint4.name not in checks.ALLOWED_DTYPES:
    with pytest.raises(ckpt.InvalidStateError, match="'x'.*uint4"):
      ckptr.save(2, {"x": rng.integers(0, 7, 1000).astype(uint4)})


def test_unknown_format_and_compression_are_rejected(ckpt_dir):
  with pytest.raises(ValueError, match="n5"):
    ckpt.Checkpointer(ckpt_dir, format="n5")
  with pytest.raises(ValueError, match="gzip"):
    ckpt.Checkpointer(ckpt_dir, compression="gzip")


def test_save_dtype_bfloat16(make_ckptr, ckpt_dir, rng, mesh8):
  x = random_array(rng, (64, 32))
  state = {"w": sharded(x, named(mesh8, "data", "model")),
           "h": x[:16].copy(),
           "i": random_array(rng, (100,), np.int32),
           "s": np.float32(1.1), "p": 1.1}
  ckptr = make_ckptr(save_dtype="bfloat16", async_save=False)
  ckptr.save(1, state)
  idx = read_index(ckpt_dir / "checkpoint_1")
  assert entry(idx, "w").dtype == "bfloat16"
  assert entry(idx, "w").source_dtype == "float32"
  assert entry(idx, "i").dtype == "int32"  # not floating: untouched

  out = ckptr.restore(1)
  assert out["w"].dtype == BF16 and out["h"].dtype == BF16
  assert out["w"].tobytes() == x.astype(BF16).tobytes()
  assert out["h"].tobytes() == x[:16].astype(BF16).tobytes()
  assert out["i"].tobytes() == state["i"].tobytes()
  assert out["s"].dtype == BF16 and out["s"] == BF16.type(1.1)
  assert out["p"] == 1.1 and type(out["p"]) is float

  # A float32 target gets the bfloat16 values widened back.
  out = ckptr.restore(1, target={"w": sds_like(state["w"])})
  assert out["w"].dtype == np.float32
  np.testing.assert_array_equal(np.asarray(out["w"]),
                                x.astype(BF16).astype(np.float32))
  assert not np.array_equal(np.asarray(out["w"]), x)  # it was rounded


def test_restore_dtype_casts_floating_leaves(make_ckptr, ckpt_dir, rng,
                                             mesh8):
  x = random_array(rng, (64, 32))
  state = {"w": sharded(x, named(mesh8, "model")), "h": x[:8].copy(),
           "i": random_array(rng, (100,), np.int64), "s": np.float32(2.5)}
  make_ckptr(async_save=False).save(1, state)

  reader = make_ckptr(restore_dtype="bfloat16")
  out = reader.restore(1)
  assert out["w"].dtype == BF16 and out["h"].dtype == BF16
  assert out["w"].tobytes() == x.astype(BF16).tobytes()
  assert out["i"].dtype == np.int64 and out["i"].tobytes() == state["i"].tobytes()
  assert out["s"].dtype == BF16
  out = reader.restore(1, target={"w": sds_like(state["w"]),
                                  "i": np.zeros(100, np.int64)})
  assert out["w"].dtype == BF16 and isinstance(out["w"], jax.Array)
  assert out["w"].sharding.is_equivalent_to(state["w"].sharding, 2)
  assert out["i"].tobytes() == state["i"].tobytes()


def test_target_dtype_casts_between_floats_only(make_ckptr, rng, mesh8):
  x = random_array(rng, (32, 16))
  make_ckptr(async_save=False).save(1, {"w": x})
  reader = make_ckptr()
  out = reader.restore(1, target={"w": jax.ShapeDtypeStruct(
      (32, 16), jnp.bfloat16, sharding=named(mesh8, "data"))})
  assert out["w"].dtype == jnp.bfloat16
  assert np.asarray(out["w"]).tobytes() == x.astype(BF16).tobytes()


# ---- partitioner for host numpy leaves -------------------------------------

@pytest.mark.usefixtures("no_packing")
def test_mesh_partitioner_for_host_numpy_leaves(make_ckptr, ckpt_dir, rng,
                                                mesh8):
  big = random_array(rng, (64, 32))
  other = random_array(rng, (48, 16), BF16)
  state = {"params": {"big": big, "other": other}}
  part = ckpt.MeshPartitioner(mesh8, [(r"params/big", P("data", "model"))])
  assert part("params/big", big.shape) == named(mesh8, "data", "model")
  assert part("params/other", other.shape) is None
  assert part("xparams/big", big.shape) is None  # a full match only

  ckptr = make_ckptr(partitioner=part, async_save=False, chunk_bytes=1 << 30)
  ckptr.save(1, state)
  # One box per distinct shard (2 x 4) for big, one for the replicated leaf.
  assert ckptr.last_save_stats.boxes_written == 8 + 1
  idx = read_index(ckpt_dir / "checkpoint_1")
  e = entry(idx, "params/big")
  assert "'data', 'model'" in e.sharding
  assert e.chunks == (32, 8)  # the chunk grid follows the shards
  assert entry(idx, "params/other").chunks == (48, 16)
  assert_same(ckptr.restore(1), state)
  out = ckptr.restore(1, target={"params": {"big": jax.ShapeDtypeStruct(
      big.shape, big.dtype, sharding=named(mesh8, "model", "data"))}})
  assert np.asarray(out["params"]["big"]).tobytes() == big.tobytes()


# ---- load, discovery -------------------------------------------------------

def test_load_root_and_step_dir(make_ckptr, ckpt_dir, rng, mesh8):
  ckptr = make_ckptr(async_save=False)
  s1 = {"w": sharded(random_array(rng, (16, 32)), named(mesh8, "model")),
        "n": 1}
  s2 = {"w": sharded(random_array(rng, (16, 32)), named(mesh8, "model")),
        "n": 2}
  ckptr.save(1, s1)
  ckptr.save(2, s2)
  assert_same(ckpt.load(ckpt_dir), to_host(s2))          # latest
  assert_same(ckpt.load(str(ckpt_dir), step=1), to_host(s1))
  assert_same(ckpt.load(ckpt_dir / "checkpoint_1"), to_host(s1))
  assert_same(ckpt.load(f"file://{ckpt_dir}/checkpoint_2"), to_host(s2))
  # restore(path=...) reads one step directory, too.
  assert_same(ckptr.restore(path=str(ckpt_dir / "checkpoint_1")), to_host(s1))


def test_discovery_sees_only_committed_steps(make_ckptr, ckpt_dir, rng):
  ckptr = make_ckptr(async_save=False)
  s = {"w": random_array(rng, (100,))}
  ckptr.save(1, s)
  ckptr.save(3, s)
  # An abandoned save, complete with an index, and a step dir with none.
  fake = ckpt_dir / "checkpoint_9.tmp-abc"
  fake.mkdir()
  (fake / "index.msgpack").write_bytes(
      (ckpt_dir / "checkpoint_3" / "index.msgpack").read_bytes())
  (ckpt_dir / "checkpoint_8").mkdir()
  (ckpt_dir / "checkpoint_8" / "junk").write_bytes(b"x")
  (ckpt_dir / "checkpoint_x").mkdir()
  (ckpt_dir / "notes.txt").write_text("hi")
  (ckpt_dir / "checkpoint_10").write_text("a file, not a directory")
  assert ckptr.all_steps() == [1, 3]
  assert ckptr.latest_step() == 3
  with pytest.raises(ckpt.CheckpointNotFoundError, match=r"\[1, 3\]"):
    ckptr.restore(9)
  with pytest.raises(ckpt.CheckpointNotFoundError):
    ckptr.restore(8)
  with pytest.raises(ckpt.CheckpointNotFoundError):
    ckpt.load(ckpt_dir, step=9)
  assert_same(ckptr.restore(), s)
  # Saving step 8 (from a new Checkpointer) replaces the uncommitted
  # directory in the way, and abandoned saves are cleaned up by then.
  s8 = {"w": random_array(rng, (100,))}
  writer = make_ckptr(async_save=False)
  assert writer.save(8, s8)
  assert ckptr.all_steps() == [1, 3, 8]
  assert not (ckpt_dir / "checkpoint_8" / "junk").exists()
  assert_same(ckptr.restore(8), s8)
  # The fake attempt is not older than the lease: it may be a live save of
  # another job, so it stays; once it is old enough, it goes.
  assert fake.exists()
  os.utime(fake, (time.time() - 3600, time.time() - 3600))
  assert make_ckptr(async_save=False).save(11, s8)
  assert not fake.exists()
  assert sorted(p.name for p in ckpt_dir.iterdir()) == [
      "checkpoint_1", "checkpoint_10", "checkpoint_11", "checkpoint_3",
      "checkpoint_8", "checkpoint_x", "notes.txt"]


@pytest.mark.parametrize("fmt", ["zarr", "ocdbt"])
def test_a_step_without_its_index_is_not_committed(make_ckptr, ckpt_dir, rng,
                                                   fmt):
  """T5X's own test (issue 22, item 4): a step directory whose index is
  gone is no checkpoint. Nobody lists or restores it, latest falls back to
  the step before, retention neither counts nor deletes it, and a new save
  of that step sets it aside (renamed, never deleted: its arrays may be
  worth recovering by hand) instead of failing on it."""
  c = make_ckptr(format=fmt, async_save=False)
  s42 = {"w": random_array(rng, (64, 32)), "n": 42}
  s100 = {"w": random_array(rng, (64, 32)), "n": 100}
  c.save(42, s42)
  c.save(100, s100)
  broken = ckpt_dir / "checkpoint_100"
  os.unlink(broken / "index.msgpack")  # OCDBT too: the index is a plain file
  assert c.all_steps() == [42]
  assert c.latest_step() == 42
  assert_same(c.restore(), s42)
  assert_same(ckpt.load(ckpt_dir), s42)
  with pytest.raises(ckpt.CheckpointNotFoundError,
                     match=r"step 100 .*checkpoint_100.* no index\.msgpack"):
    c.restore(100)
  before = sorted(p.relative_to(broken) for p in broken.rglob("*"))
  s100b = {"w": random_array(rng, (64, 32)), "n": 100}
  assert c.save(100, s100b)
  assert c.all_steps() == [42, 100]
  assert_same(c.restore(100), s100b)
  assert_same(c.restore(), s100b)
  [aside] = [p for p in ckpt_dir.iterdir()
             if p.name.startswith("checkpoint_100.")]
  assert aside.name.startswith("checkpoint_100.broken-"), aside
  assert sorted(p.relative_to(aside) for p in aside.rglob("*")) == before
  # Retention counts committed steps only, and leaves the broken one be.
  os.unlink(ckpt_dir / "checkpoint_100" / "index.msgpack")
  r = make_ckptr(format=fmt, async_save=False, keep=1)
  assert r.save(101, s42)
  r.wait_until_finished()
  assert r.all_steps() == [101]
  assert (ckpt_dir / "checkpoint_100" / "commit_success").exists()
  assert aside.exists()


def test_a_bucket_step_without_its_index_fails_loudly(make_ckptr, memory_url,
                                                      rng):
  """On object stores the commit record alone makes a step committed (one
  listing finds every step; checking each index would cost a request per
  step): a step whose index was deleted behind ckpt's back stays listed,
  and restoring it fails naming the step and the missing index, never
  another step silently."""
  from ckpt.commit import steps as steps_lib  # pylint: disable=g-import-not-at-top
  from ckpt.store import storage as storage_lib  # pylint: disable=g-import-not-at-top
  c = make_ckptr(memory_url, async_save=False)
  s42 = {"w": random_array(rng, (64, 32))}
  c.save(42, s42)
  c.save(100, {"w": random_array(rng, (64, 32))})
  store = storage_lib.Storage(memory_url)
  index = store.index_key(steps_lib.step_dir(store, 100))
  store.delete_key(index)
  assert c.all_steps() == [42, 100]
  with pytest.raises(ckpt.CheckpointNotFoundError) as e:
    c.restore()
  assert index in str(e.value) and "checkpoint_100/" in str(e.value)
  assert_same(c.restore(42), s42)


def test_no_checkpoint_anywhere(make_ckptr, ckpt_dir, tmp_path):
  ckptr = make_ckptr()
  assert ckptr.all_steps() == [] and ckptr.latest_step() is None
  with pytest.raises(ckpt.CheckpointNotFoundError) as e:  # wording:
    ckptr.restore()  # tests/test_errors.py
  assert str(ckpt_dir) in str(e.value)
  (tmp_path / "empty").mkdir()
  with pytest.raises(ckpt.CheckpointNotFoundError) as e:
    ckpt.load(tmp_path / "empty")
  assert "empty" in str(e.value)
  with pytest.raises(ckpt.CheckpointNotFoundError):
    ckpt.load(tmp_path / "does-not-exist")
  with pytest.raises(ckpt.CheckpointNotFoundError):
    ckptr.host_state()


def test_missing_step(make_ckptr, rng):
  ckptr = make_ckptr(async_save=False)
  ckptr.save(4, {"w": random_array(rng, (10,))})
  with pytest.raises(ckpt.CheckpointNotFoundError) as e:
    ckptr.restore(5)
  assert "step 5" in str(e.value) and "[4]" in str(e.value)
  with pytest.raises(ckpt.CheckpointNotFoundError, match="step 5"):
    ckptr.metrics(5)


# ---- budget -----------------------------------------------------------------

@pytest.mark.timeout(90)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_leaf_bigger_than_concurrent_bytes(make_ckptr, ckpt_dir, rng, mesh8,
                                           async_save):
  budget = 1 * MiB
  big = random_array(rng, (1024, 2048))  # 8 MiB, one leaf
  state = {
      "replicated": sharded(big, named(mesh8)),        # one 8 MiB write
      "host": big[:512].copy(),                        # 4 MiB host array
      "sharded": sharded(big, named(mesh8, "model")),  # 2 MiB per shard
      "small": random_array(rng, (64, 64)),
  }
  ckptr = make_ckptr(concurrent_bytes=budget, chunk_bytes=256 << 10,
                     async_save=async_save)
  ckptr.save(1, state)
  ckptr.wait_until_finished()
  stats = ckptr.last_save_stats
  largest = big.nbytes
  assert 0 < stats.peak_bytes_in_flight <= max(budget, largest)
  assert stats.peak_bytes_in_flight <= budget  # grants are capped
  # Items over the budget are cut into chunks: no write item holds more host
  # memory than the budget (8 MiB -> 32 x 256 KiB, 4 MiB -> 16, 8 shards).
  assert stats.boxes_written >= 32 + 16 + 8 + 1
  assert stats.bytes_written == 2 * big.nbytes + big.nbytes // 2 + 64 * 64 * 4

  e = entry(read_index(ckpt_dir / "checkpoint_1"), "replicated")
  assert np.prod(e.chunks) * 4 <= 256 << 10
  n_chunks = sum(1 for f in (ckpt_dir / "checkpoint_1" / e.relpath).iterdir()
                 if not f.name.startswith("."))
  assert n_chunks == big.nbytes // (np.prod(e.chunks) * 4) >= 32

  reader = make_ckptr(concurrent_bytes=budget)
  out = reader.restore(1, target=sds_like(state))
  assert_same(out, state)
  out = reader.restore(1)
  assert out["replicated"].tobytes() == big.tobytes()


# ---- errors -----------------------------------------------------------------

def test_shape_mismatch_names_leaf_and_both_shapes(make_ckptr, rng, mesh8):
  ckptr = make_ckptr(async_save=False)
  ckptr.save(1, {"p": {"w": random_array(rng, (64, 32))}})
  with pytest.raises(ckpt.TreeMismatchError) as e:
    ckptr.restore(1, target={"p": {"w": jax.ShapeDtypeStruct(
        (64, 16), np.float32, sharding=named(mesh8, "data"))}})
  msg = str(e.value)
  assert "'p/w'" in msg and "(64, 32)" in msg and "(64, 16)" in msg


@pytest.mark.parametrize("saved,wanted", [(np.int32, np.float32),
                                          (np.float32, np.int32),
                                          (np.bool_, np.int8)])
def test_dtype_mismatch_names_leaf_and_both_dtypes(make_ckptr, rng, mesh8,
                                                    saved, wanted):
  ckptr = make_ckptr(async_save=False)
  ckptr.save(1, {"opt": {"count": random_array(rng, (64,), saved)}})
  with pytest.raises(ckpt.TreeMismatchError) as e:
    ckptr.restore(1, target={"opt": {"count": jax.ShapeDtypeStruct(
        (64,), wanted, sharding=named(mesh8, "model"))}})
  msg = str(e.value)
  assert "'opt/count'" in msg
  assert np.dtype(saved).name in msg and np.dtype(wanted).name in msg


def test_missing_leaves_are_all_listed(make_ckptr, rng, mesh8):
  ckptr = make_ckptr(async_save=False)
  ckptr.save(1, {"a": random_array(rng, (10,)), "b": 1})
  sds = jax.ShapeDtypeStruct((10,), np.float32, sharding=named(mesh8))
  with pytest.raises(ckpt.MissingLeavesError) as e:
    ckptr.restore(1, target={"a": sds, "c": sds, "d": {"e": sds}})
  assert e.value.missing == ["c", "d/e"]
  msg = str(e.value)
  assert "c" in msg and "d/e" in msg and "2 target leaves" in msg
  assert "a, b" in msg  # what the checkpoint has


@pytest.mark.usefixtures("no_packing")
@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty",
                                    "bad_relpath"])
def test_corrupt_index(make_ckptr, ckpt_dir, rng, damage):
  ckptr = make_ckptr(async_save=False)
  ckptr.save(1, {"w": random_array(rng, (100,))})
  path = ckpt_dir / "checkpoint_1" / "index.msgpack"
  data = path.read_bytes()
  if damage == "truncate":
    data = data[:len(data) // 2]
  elif damage == "garbage":
    data = bytes(rng.integers(0, 256, 64, dtype=np.uint8)) + b"\xc1"
  elif damage == "empty":
    data = b""
  else:
    doc = sealed.unpackb(data, raw=False)
    leaves = index_codec.rows(doc["leaves"])
    leaves[0]["relpath"] = "../../../etc"
    doc["leaves"] = index_codec.columns(leaves, entries.KINDS)
    data = sealed.packb(doc, use_bin_type=True)
  path.write_bytes(data)
  with pytest.raises(ckpt.CorruptCheckpointError) as e:
    ckptr.restore(1)
  assert "checkpoint_1/index.msgpack" in str(e.value)
  with pytest.raises(ckpt.CorruptCheckpointError):
    ckpt.load(ckpt_dir)


@pytest.mark.usefixtures("no_packing")
def test_missing_array_data_is_corrupt(make_ckptr, ckpt_dir, rng):
  ckptr = make_ckptr(async_save=False)
  ckptr.save(1, {"w": random_array(rng, (100,))})
  shutil.rmtree(ckpt_dir / "checkpoint_1" / "w")
  with pytest.raises(ckpt.CorruptCheckpointError, match="'w'"):
    ckptr.restore(1)


@pytest.mark.usefixtures("no_packing")
@pytest.mark.parametrize("fmt", ["zarr", "zarr3"])
def test_missing_chunk_file_is_corrupt_not_zeros(make_ckptr, ckpt_dir, rng,
                                                 fmt):
  x = random_array(rng, (64, 64))
  x[:16] = 0  # a whole chunk of zeros (the fill value) is stored too
  ckptr = make_ckptr(format=fmt, chunk_bytes=16 * 64 * 4, async_save=False)
  ckptr.save(1, {"w": x})
  assert ckptr.restore(1)["w"].tobytes() == x.tobytes()
  meta = {".zarray", ".zattrs", "zarr.json"}
  chunk_files = sorted(p for p in (ckpt_dir / "checkpoint_1" / "w").rglob("*")
                       if p.is_file() and p.name not in meta)
  assert len(chunk_files) == 4
  chunk_files[0].unlink()  # the zero chunk: would read back as zeros
  with pytest.raises(ckpt.CorruptCheckpointError, match="'w'.*missing"):
    ckptr.restore(1)
  with pytest.raises(ckpt.CorruptCheckpointError, match="'w'"):
    ckpt.load(ckpt_dir)


def test_unsupported_leaf_type_at_save(make_ckptr, ckpt_dir, rng):
  ckptr = make_ckptr(async_save=False)
  for bad, fragment in [(object(), "object"), (np.array([object()] * 100), "object"),
                        (2**70, "64 bits"), (np.array(["x"] * 100), "<U1"),
                        ({1.5: 2}, "1.5")]:
    with pytest.raises(ckpt.InvalidStateError) as e:
      ckptr.save(1, {"params": {"good": random_array(rng, (10,)), "bad": bad}})
    assert "params" in str(e.value) and fragment in str(e.value)
    if not isinstance(bad, dict):
      assert "'params/bad'" in str(e.value)
  assert ckptr.all_steps() == []
  assert not ckpt_dir.exists() or not any(ckpt_dir.iterdir())


# ---- failed saves never touch committed checkpoints -------------------------

def test_invalid_state_after_good_save_changes_nothing(make_ckptr, ckpt_dir,
                                                       rng, mesh8):
  state = {"w": sharded(random_array(rng, (64, 32)), named(mesh8, "data"))}
  ckptr = make_ckptr()
  ckptr.save(1, state)
  ckptr.wait_until_finished()
  before = tree_digest(ckpt_dir)
  with pytest.raises(ckpt.InvalidStateError, match="'w2'"):
    ckptr.save(2, {**state, "w2": object()})
  ckptr.wait_until_finished()
  assert tree_digest(ckpt_dir) == before
  assert ckptr.all_steps() == [1]
  assert_same(ckptr.restore(target=sds_like(state)), state)
  assert ckptr.save(2, state)  # and the Checkpointer still works
  ckptr.wait_until_finished()
  assert ckptr.all_steps() == [1, 2]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_failed_write_leaves_committed_untouched(make_ckptr, ckpt_dir, rng,
                                                 mesh8, async_save):
  x = random_array(rng, (64, 32))
  good = {"a": sharded(x, named(mesh8, "data")), "b": random_array(rng, (99,))}
  ckptr = make_ckptr(async_save=async_save)
  ckptr.save(1, good)
  ckptr.wait_until_finished()
  before = tree_digest(ckpt_dir / "checkpoint_1")

  # A leaf whose device buffers are gone: staging it fails mid-save, after
  # the work directory exists and other leaves may have been written.
  doomed = sharded(random_array(rng, (64, 32)), named(mesh8, "model"))
  doomed.delete()
  with pytest.raises(ckpt.CheckpointError) as e:
    ckptr.save(2, {**good, "z": doomed})
    ckptr.wait_until_finished()
  assert "step 2" in str(e.value)

  assert ckptr.all_steps() == [1]
  assert tree_digest(ckpt_dir / "checkpoint_1") == before
  assert not (ckpt_dir / "checkpoint_2").exists()
  assert_same(ckptr.restore(target=sds_like(good)), good)
  # The error was reported once; the next save of that step works.
  ckptr.wait_until_finished()
  assert ckptr.save(2, good)
  ckptr.wait_until_finished()
  assert ckptr.all_steps() == [1, 2]
  # The abandoned work directory is gone once a later save has run.
  make_ckptr(async_save=False).save(3, good)
  assert sorted(p.name for p in ckpt_dir.iterdir()) == [
      "checkpoint_1", "checkpoint_2", "checkpoint_3"]


def test_opening_a_reader_does_not_break_an_async_save(make_ckptr, ckpt_dir,
                                                       rng):
  big = random_array(rng, (16 * 1024, 1024))  # 64 MiB: the write takes a while
  writer = make_ckptr(compression="zstd")
  writer.save(1, {"big": big})
  if not list(ckpt_dir.glob("checkpoint_1.tmp-*")):
    pytest.skip("the save committed before a reader could be opened")
  reader = make_ckptr()
  writer.wait_until_finished()
  assert writer.all_steps() == [1]
  assert reader.restore(1)["big"].tobytes() == big.tobytes()


def test_saving_a_committed_step_is_skipped(make_ckptr, ckpt_dir, rng):
  first = {"w": random_array(rng, (100,))}
  ckptr = make_ckptr(async_save=False)
  assert ckptr.save(5, first) is True
  before = tree_digest(ckpt_dir)
  assert ckptr.save(5, {"w": random_array(rng, (100,)), "x": 1}) is False
  assert ckptr.last_save_stats.skipped
  assert tree_digest(ckpt_dir) == before
  assert_same(ckptr.restore(5), first)
  # Also from another Checkpointer, in async mode.
  other = make_ckptr()
  assert other.save(5, {"w": random_array(rng, (100,))}) is False
  other.wait_until_finished()
  assert tree_digest(ckpt_dir) == before


@pytest.mark.parametrize("bad", [-1, 1.5, "3", None])
def test_bad_step_values(make_ckptr, rng, bad):
  ckptr = make_ckptr(async_save=False)
  with pytest.raises(ValueError, match="non-negative int"):
    ckptr.save(bad, {"w": random_array(rng, (10,))})
  assert ckptr.all_steps() == []


def test_closed_checkpointer_refuses(make_ckptr, rng):
  with make_ckptr() as ckptr:
    ckptr.save(1, {"w": random_array(rng, (10,))})
  assert ckptr.all_steps() == [1]  # close() waited for the save
  with pytest.raises(ckpt.CheckpointError):  # wording: tests/test_errors.py
    ckptr.save(2, {"w": random_array(rng, (10,))})
  with pytest.raises(ckpt.CheckpointError, match="closed"):
    ckptr.restore()


# ---- host_state, metrics ----------------------------------------------------

def test_host_state_round_trip(make_ckptr, rng):
  ckptr = make_ckptr(async_save=False)
  hs = {"seed": int(rng.integers(1 << 30)), "data": [1, 2.5, "x"],
        "blob": b"\x00\x01", "nested": {"epoch": 3}}
  ckptr.save(1, {"w": random_array(rng, (10,))}, host_state=hs)
  ckptr.save(2, {"w": random_array(rng, (10,))}, host_state=[7, 8])
  ckptr.save(3, {"w": random_array(rng, (10,))})
  assert ckptr.host_state(1) == hs
  assert ckptr.host_state(2) == [7, 8]
  assert ckptr.host_state() is None  # step 3 had none
  assert make_ckptr().host_state(1) == hs
  with pytest.raises(ckpt.InvalidStateError, match="msgpack"):
    ckptr.save(4, {"w": random_array(rng, (10,))}, host_state=object())
  assert ckptr.all_steps() == [1, 2, 3]


def test_metrics_round_trip(make_ckptr, rng):
  ckptr = make_ckptr(async_save=False)
  ckptr.save(1, {"w": random_array(rng, (10,))},
             metrics={"eval/loss": 0.125, "acc": np.float32(0.75)})
  ckptr.save(2, {"w": random_array(rng, (10,))})
  assert make_ckptr().metrics(1) == {"eval/loss": 0.125, "acc": 0.75}
  assert ckptr.metrics(2) == {}


# ---- other storage ----------------------------------------------------------

def test_memory_url(make_ckptr, memory_url, rng, mesh8):
  state = make_state(rng, mesh8)
  ckptr = make_ckptr(memory_url)
  assert ckptr.all_steps() == []
  ckptr.save(1, state)
  ckptr.save(2, state, host_state={"k": 1})
  ckptr.wait_until_finished()
  assert ckptr.all_steps() == [1, 2] and ckptr.latest_step() == 2
  assert_same(ckptr.restore(1, target=sds_like(state)), state)
  assert_same(ckptr.restore(), to_host(state))
  assert ckptr.host_state() == {"k": 1}
  # Another Checkpointer and ckpt.load on the same URL see it too.
  assert make_ckptr(memory_url).all_steps() == [1, 2]
  assert_same(ckpt.load(memory_url, step=1), to_host(state))
  assert ckptr.save(2, state) is False
  with pytest.raises(ckpt.CheckpointNotFoundError):
    ckptr.restore(3)
  with pytest.raises(ckpt.CheckpointNotFoundError):
    make_ckptr(memory_url + "-other").restore()


def test_memory_url_needs_the_commit_marker(make_ckptr, memory_url, rng):
  from ckpt.store import storage as storage_lib  # pylint: disable=g-import-not-at-top
  ckptr = make_ckptr(memory_url, async_save=False)
  ckptr.save(1, {"w": random_array(rng, (100,))})
  # Copy step 1 as step 2 without its commit marker: an interrupted save.
  store = storage_lib.Storage(memory_url)
  store.write_bytes("checkpoint_2/index.msgpack",
                    store.read_bytes("checkpoint_1/index.msgpack"))
  assert store.read_bytes("checkpoint_1/commit_success") is not None
  assert ckptr.all_steps() == [1]
  with pytest.raises(ckpt.CheckpointNotFoundError):
    ckptr.restore(2)
  # Saving step 2 replaces the leftovers and commits.
  s2 = {"v": random_array(rng, (100,))}
  assert ckptr.save(2, s2)
  assert ckptr.all_steps() == [1, 2]
  assert_same(ckptr.restore(2), s2)


def test_file_url_and_relative_path(make_ckptr, tmp_path, rng, monkeypatch):
  state = {"w": random_array(rng, (100,))}
  make_ckptr(f"file://{tmp_path}/a", async_save=False).save(1, state)
  assert (tmp_path / "a" / "checkpoint_1" / "index.msgpack").exists()
  monkeypatch.chdir(tmp_path)
  assert make_ckptr("a").all_steps() == [1]
  assert_same(make_ckptr("a").restore(1), state)


def test_checkpoint_can_be_moved(make_ckptr, ckpt_dir, tmp_path, rng, mesh8):
  state = {"w": sharded(random_array(rng, (64, 32)), named(mesh8, "model"))}
  make_ckptr(async_save=False).save(1, state)
  moved = tmp_path / "elsewhere"
  os.rename(ckpt_dir, moved)
  assert_same(make_ckptr(moved).restore(1, target=sds_like(state)), state)


def test_local_files_are_read_mapped(make_ckptr, ckpt_dir, rng, mesh8):
  # Local chunks are read through mmap (one copy from the page cache into
  # the restore's buffer, see storage.FILE_IO_MODE); storage_options can ask
  # for pread back. Both restore the same bytes, onto another mesh too
  # (boxes that need part of a chunk) and as host numpy values.
  from ckpt.store import storage as storage_lib  # pylint: disable=g-import-not-at-top
  mode = lambda opts: storage_lib.Storage(str(ckpt_dir), opts).context()[
      "file_io_mode"].to_json()
  pread = {"file_io_mode": {"mode": "default"}}
  assert mode(None) == {"mode": "memmap"} and mode(pread) == {}
  state = {"w": sharded(random_array(rng, (64, 32)), named(mesh8, "data",
                                                            "model")),
           "b": random_array(rng, (7,), ml_dtypes.bfloat16)}
  make_ckptr(async_save=False).save(1, state)
  other = named(mesh((4, 2), devices=jax.devices()[::-1]), "data", "model")
  for options in (None, pread):
    c = make_ckptr(storage_options=options)
    assert_same(c.restore(1, target=sds_like(state)), state)
    assert_same(c.restore(1), to_host(state))
    got = c.restore(1, target={
        "w": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=other),
        "b": state["b"]})
    assert got["w"].sharding == other
    assert_same(np.asarray(got["w"]), np.asarray(state["w"]))
