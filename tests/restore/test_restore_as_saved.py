"""Restore as saved (issue 25, item 1), in one process with 8 CPU devices.

A target leaf that is a ``jax.ShapeDtypeStruct`` without a sharding (what
``jax.eval_shape(create_state)`` gives, as Orbax users restore) comes back
as a ``jax.Array`` in the sharding it was saved in, never as silent numpy;
a leaf saved from host numpy comes back as numpy, as saved (issue 36, item
9: what Orbax returns); when that sharding cannot be built here the error
names the leaf, the saved mesh and how to pass a sharding. ``Metadata.shardings`` are
``SavedSharding`` objects. The index field that records them
(``saved_sharding``) is validated like the rest of the index, and indexes
written before it (tests/golden/v1) restore as before. The real
2-process job is tests/multiprocess/test_restore_as_saved_mp.py.
"""

from __future__ import annotations

import pathlib
import shutil

from hypothesis import given, settings, strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import msgpack
from tests import sealed
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from ckpt.cli import convert
from ckpt.format import index as index_lib
from ckpt.format import index_codec
from ckpt.restore import transforms as T
from ckpt.errors import CorruptCheckpointError, TreeMismatchError
from ckpt.metadata import SavedSharding
from ckpt.format import entries
from ckpt.format import inline_values
from ckpt.format import saved_sharding
from tests.conftest import AdamState, TrainState, random_array, sharded
from tests.golden import make_golden

GOLDEN_V1 = pathlib.Path(__file__).resolve().parent.parent / "golden" / "v1"
BF16 = np.dtype(ml_dtypes.bfloat16)


def explicit_mesh():
  """jax.make_mesh's mesh (Explicit axes, as jax 0.10 makes them)."""
  return jax.make_mesh((2, 4), ("data", "model"))


def unsharded(tree):
  """The Orbax user's target: ``jax.eval_shape`` of a function that makes
  the state's arrays with no mesh (ShapeDtypeStructs without shardings;
  typed keys with their key dtype), python values kept. 64-bit leaves get
  numpy targets (jax without x64 would make them 32-bit)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  arrays = [i for i, x in enumerate(leaves)
            if isinstance(x, (jax.Array, np.ndarray, np.generic)) and
            x.dtype.itemsize != 8]

  def make():
    out = []
    for i in arrays:
      x = leaves[i]
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        out.append(jax.random.wrap_key_data(
            jnp.zeros(jax.random.key_data(x).shape, jnp.uint32),
            impl=jax.random.key_impl(x)))
      else:
        out.append(jnp.zeros(np.shape(x), x.dtype))
    return out

  sdss = jax.eval_shape(make)
  assert all(x.sharding is None for x in sdss)
  out = [np.zeros(np.shape(x), x.dtype)
         if isinstance(x, (np.ndarray, np.generic)) else x for x in leaves]
  for i, x in zip(arrays, sdss):
    out[i] = x
  return jax.tree_util.tree_unflatten(treedef, out)


def same_bits(got, want) -> bool:
  if isinstance(want, jax.Array) and jax.dtypes.issubdtype(
      want.dtype, jax.dtypes.prng_key):
    return (jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key) and
            np.asarray(jax.random.key_data(got)).tobytes() ==
            np.asarray(jax.random.key_data(want)).tobytes())
  got, want = np.asarray(got), np.asarray(want)
  return got.dtype == want.dtype and got.tobytes() == want.tobytes()


def assert_shards_exact(got: jax.Array, want) -> None:
  """Every addressable shard holds exactly its slice of the saved data."""
  host = np.asarray(jax.random.key_data(want) if jax.dtypes.issubdtype(
      want.dtype, jax.dtypes.prng_key) else want)
  data = (jax.random.key_data(got) if jax.dtypes.issubdtype(
      got.dtype, jax.dtypes.prng_key) else got)
  for shard in data.addressable_shards:
    assert np.asarray(shard.data).tobytes() == host[shard.index].tobytes()


def one_mesh_state(rng, mesh):
  """Every kind of leaf, the jax ones on one mesh."""
  w = random_array(rng, (16, 32))
  return {
      "params": {
          "w": sharded(w, NamedSharding(mesh, P("data", "model"))),
          "e": sharded(random_array(rng, (64, 8), BF16),
                       NamedSharding(mesh, P(None, "model"))),
          "flat": sharded(random_array(rng, (64,)),
                          NamedSharding(mesh, P(("data", "model")))),
          "rep": sharded(random_array(rng, (20, 20)),
                         NamedSharding(mesh, P())),   # stored, replicated
      },
      "step": jax.device_put(jnp.int32(7), NamedSharding(mesh, P())),  # inline
      "keys": jax.device_put(jax.random.split(jax.random.key(3), 16),
                             NamedSharding(mesh, P("data"))),
      "key": jax.device_put(jax.random.key(4), NamedSharding(mesh, P())),
      "single": jax.device_put(random_array(rng, (100,)), jax.devices()[0]),
      "table": random_array(rng, (300,), np.int32),   # host numpy
      "scale": np.float32(0.5), "epoch": 2, "name": "run",
  }


def flat(tree) -> dict:
  return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p): x
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# ---- restore as saved ------------------------------------------------------

@pytest.mark.parametrize("fmt", ["zarr", "ocdbt"])
def test_a_target_without_shardings_restores_in_the_saved_shardings(
    make_ckptr, rng, fmt):
  mesh = explicit_mesh()
  state = one_mesh_state(rng, mesh)
  make_ckptr(async_save=False, format=fmt).save(1, state)
  c = make_ckptr()
  got = flat(c.restore(1, target=unsharded(state)))
  want = flat(state)
  for name, x in want.items():
    g = got[name]
    if isinstance(x, (str, int)):
      assert g == x and type(g) is type(x), name
      continue
    assert same_bits(g, x), name
    if isinstance(x, jax.Array):
      assert isinstance(g, jax.Array), (name, type(g))  # never numpy
      assert g.sharding == x.sharding, (name, g.sharding, x.sharding)
      assert_shards_exact(g, x)
    else:  # host numpy, numpy scalar: as saved
      assert type(g) is type(x), (name, type(g))
  # A jitted step takes them together (jax refuses arguments on different
  # meshes of Explicit axes).
  out = c.restore(1, target=unsharded(state))
  total = jax.jit(lambda w, step, table, scale: (
      w.sum() * step + table.sum() * scale))(
          out["params"]["w"], out["step"], out["table"], out["scale"])
  assert np.isfinite(np.asarray(total))

  # lazy=True: each leaf is bound to its saved sharding (numpy: none).
  lazy = flat(c.restore(1, target=unsharded(state), lazy=True))
  for name in ("params/w", "keys", "table"):
    assert lazy[name].sharding == getattr(got[name], "sharding", None), name
    assert same_bits(lazy[name].read(), want[name]), name
  assert type(lazy["table"].read()) is np.ndarray


def test_numpy_targets_and_no_target_stay_numpy(make_ckptr, ckpt_dir, rng):
  mesh = explicit_mesh()
  state = one_mesh_state(rng, mesh)
  make_ckptr(async_save=False).save(1, state)
  c = make_ckptr()
  w = np.asarray(state["params"]["w"])
  got = c.restore(1, target={"params": {"w": np.zeros_like(w)},
                             "table": np.zeros(300, np.int32)})
  assert type(got["params"]["w"]) is np.ndarray and same_bits(
      got["params"]["w"], w)
  assert type(got["table"]) is np.ndarray
  whole = c.restore(1)
  assert type(whole["params"]["w"]) is np.ndarray
  assert type(ckpt.load(ckpt_dir, 1)["params"]["w"]) is np.ndarray


def test_leaves_of_several_meshes(make_ckptr, rng):
  """Each leaf on its own saved mesh; a host numpy leaf as numpy."""
  devs = np.asarray(jax.devices())
  m1 = Mesh(devs.reshape(2, 4), ("data", "model"))           # Auto axes
  m2 = Mesh(devs[::-1].reshape(4, 2), ("a", "b"))
  a, b = random_array(rng, (8, 8)), random_array(rng, (16, 4))
  state = {"a": sharded(a, NamedSharding(m1, P("data", "model"))),
           "b": sharded(b, NamedSharding(m2, P("b", None))),
           "t": random_array(rng, (100,))}
  make_ckptr(async_save=False).save(1, state)
  got = make_ckptr().restore(1, target=unsharded(state))
  assert got["a"].sharding == state["a"].sharding
  assert got["b"].sharding.spec == P("b", None)
  assert got["b"].sharding.mesh.shape == {"a": 4, "b": 2}
  assert type(got["t"]) is np.ndarray
  for k in state:
    assert same_bits(got[k], state[k]), k


def test_every_golden_leaf_kind_saved_today_restores_as_saved(tmp_path):
  """make_golden's state (every kind of leaf: bf16, keys of two
  implementations, inline, host numpy...) saved by today's code in each
  format, restored with an unsharded target."""
  state = make_golden.make_state(10)
  want = flat(state)
  for fmt in ("zarr", "zarr3", "ocdbt"):
    root = tmp_path / fmt
    with ckpt.Checkpointer(root, async_save=False, format=fmt,
                           chunk_bytes=make_golden.CHUNK_BYTES) as c:
      c.save(10, state)
      got = flat(c.restore(10, target=unsharded(state)))
    for name, x in want.items():
      g = got[name]
      if isinstance(x, jax.Array):
        assert isinstance(g, jax.Array) and g.sharding == x.sharding, name
        assert same_bits(g, x), (fmt, name)
      elif isinstance(x, (np.ndarray, np.generic)):  # as saved: numpy
        assert isinstance(g, (np.ndarray, np.generic)), (fmt, name, type(g))
        assert same_bits(g, x), (fmt, name)


@pytest.mark.parametrize("fmt", ["zarr", "ocdbt"])
def test_numpy_leaves_restore_as_numpy_and_jax_leaves_as_jax(make_ckptr, rng,
                                                             fmt):
  """Issue 36, item 9: a leaf saved from host numpy, restored into a
  ShapeDtypeStruct without a sharding (``ocp.utils.to_shape_dtype_struct``
  of a numpy array), comes back as numpy, as saved, in every way a leaf is
  stored (a zarr array, a pack, inline in the index); a leaf saved from a
  jax.Array in the same ways stays a jax.Array; a numpy leaf a partitioner
  saved on a mesh comes back on it."""
  mesh = explicit_mesh()
  rep = NamedSharding(mesh, P())
  state = {
      "np": {"stored": random_array(rng, (256, 128)),     # 128 KiB: an array
             "packed": random_array(rng, (32, 32), np.int32),  # 4 KiB: packed
             "inline": random_array(rng, (6,)),            # 24 bytes: index
             "scalar": np.float32(0.25), "zero_d": np.asarray(3, np.int16)},
      "jax": {"stored": sharded(random_array(rng, (256, 128)), rep),
              "packed": sharded(random_array(rng, (32, 32), np.int32), rep),
              "inline": sharded(random_array(rng, (6,)), rep)},
      "parted": random_array(rng, (64, 8))}
  by_rows = NamedSharding(mesh, P("data"))
  make_ckptr(async_save=False, format=fmt, partitioner=lambda name, shape: (
      by_rows if name == "parted" else None)).save(1, state)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype),
                        state)
  c = make_ckptr()
  for lazy in (False, True):
    got = flat(c.restore(1, target=target, lazy=lazy))
    if lazy:
      got = {k: v.read() for k, v in got.items()}
    for name, x in flat(state).items():
      g = got[name]
      assert same_bits(g, x), (name, lazy)
      if name.startswith("np/"):
        assert type(g) is type(x), (name, lazy, type(g))
      else:
        assert isinstance(g, jax.Array), (name, lazy, type(g))
    assert got["jax/stored"].sharding == rep
    assert got["parted"].sharding == by_rows
  # The saved kind is in the metadata (and abstract_target keeps it).
  md = c.metadata(1)
  for name in ("np/stored", "np/packed", "np/inline", "np/zero_d"):
    assert str(md.shardings[name]) == "replicated (host value)", name
  assert str(md.shardings["jax/inline"]) == (
      "NamedSharding(mesh={'data': 2, 'model': 4}, spec=(), axis_types="
      "('explicit', 'explicit'))")


def test_the_saved_kind_of_inline_values_is_recorded():
  """``host`` marks an inline value saved from host numpy; it round-trips
  and is refused where it cannot be (a hostile or broken index)."""
  def entry(**extra):
    return {"path": ["w"], "kind": "value", "value": inline_values.encode_value(
        np.arange(3, dtype=np.float32), ("w",)), **extra}
  assert index_lib.decode(_index(entry(host=True))).leaves[0].host is True
  assert index_lib.decode(_index(entry())).leaves[0].host is False
  for bad in (entry(host=1), entry(host="yes"),
              entry(host=True, saved_sharding={
                  "mesh_axes": [], "mesh_shape": [], "spec": []})):
    with pytest.raises(CorruptCheckpointError, match="host absent, or true"):
      index_lib.decode(_index(bad))
  scalar = {"path": ["w"], "kind": "value", "host": True,
            "value": inline_values.encode_value(np.float32(1), ("w",))}
  with pytest.raises(CorruptCheckpointError, match="host absent, or true"):
    index_lib.decode(_index(scalar))


# ---- what cannot be restored as saved --------------------------------------

def test_a_saved_mesh_this_job_cannot_build_names_the_leaf(make_ckptr, rng):
  small = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
  w = random_array(rng, (8, 8))
  make_ckptr(async_save=False).save(
      1, {"params": {"w": sharded(w, NamedSharding(small, P("data", "model")))}})
  c = make_ckptr()
  with pytest.raises(TreeMismatchError) as e:
    c.restore(1, target={"params": {"w": jax.ShapeDtypeStruct(w.shape,
                                                                w.dtype)}})
  msg = str(e.value)
  for part in ("'params/w'", "{'data': 2, 'model': 2}", "4 devices",
               "this job has 8", "sharding=", "ckpt.abstract_target"):
    assert part in msg, (part, msg)
  # The checkpoint is intact, and abstract_target gives a target that works.
  target = ckpt.abstract_target(c.metadata(1), explicit_mesh(),
                                [("params/w", P("model"))])
  assert same_bits(c.restore(1, target=target)["params"]["w"], w)
  assert same_bits(c.restore(1)["params"]["w"], w)


def test_leaves_a_transform_made_and_values_given_in_memory(make_ckptr, rng):
  mesh = explicit_mesh()
  layers = [random_array(rng, (8, 4)) for _ in range(2)]
  make_ckptr(async_save=False).save(1, {
      "layers_0": {"w": sharded(layers[0], NamedSharding(mesh, P("data")))},
      "layers_1": {"w": sharded(layers[1], NamedSharding(mesh, P("data")))}})
  c = make_ckptr()
  sds = jax.ShapeDtypeStruct
  with pytest.raises(TreeMismatchError,
                     match=r"leaf 'layers/w'.*a restore transform made this "
                           r"leaf.*sharding="):
    c.restore(1, target={"layers": {"w": sds((2, 8, 4), np.float32)}},
              transforms=[T.stack_layers()])
  stacked = NamedSharding(mesh, P(None, "data"))
  got = c.restore(1, target={"layers": {"w": sds((2, 8, 4), np.float32,
                                                 sharding=stacked)}},
                  transforms=[T.stack_layers()])
  assert got["layers"]["w"].sharding == stacked
  # fallback_state: numpy comes back replicated (on the checkpoint's mesh),
  # a jax.Array where it is.
  new_np, new_jax = random_array(rng, (6,)), jax.device_put(
      random_array(rng, (8,)), NamedSharding(mesh, P("model")))
  got = c.restore(1, target={"layers_0": {"w": sds((8, 4), np.float32)},
                             "new_np": sds((6,), np.float32),
                             "new_jax": sds((8,), np.float32)},
                  fallback_state={"new_np": new_np, "new_jax": new_jax})
  assert got["layers_0"]["w"].sharding == NamedSharding(mesh, P("data"))
  assert got["new_np"].sharding == NamedSharding(mesh, P())
  assert got["new_jax"].sharding == new_jax.sharding
  assert same_bits(got["new_np"], new_np) and same_bits(got["new_jax"],
                                                        new_jax)


def test_an_unrecordable_sharding_asks_for_one(make_ckptr, rng):
  """A mesh beyond what the index records (more than MAX_MESH_AXES axes)
  is kept as text only; a target without a sharding then names the leaf."""
  names = tuple(f"a{i}" for i in range(saved_sharding.MAX_MESH_AXES + 1))
  big = Mesh(np.asarray(jax.devices()[:1]).reshape((1,) * len(names)), names)
  w = random_array(rng, (16, 16))  # over 256 bytes: stored, not inline
  make_ckptr(async_save=False).save(
      1, {"w": sharded(w, NamedSharding(big, P("a0")))})
  c = make_ckptr()
  assert c.metadata(1).shardings["w"].kind == "unknown"
  with pytest.raises(TreeMismatchError, match=r"leaf 'w'.*no mesh was "
                     r"recorded.*sharding="):
    c.restore(1, target={"w": jax.ShapeDtypeStruct((16, 16), np.float32)})


# ---- Metadata.shardings ----------------------------------------------------

def test_metadata_shardings_are_objects(make_ckptr, rng):
  mesh = explicit_mesh()
  state = one_mesh_state(rng, mesh)
  make_ckptr(async_save=False).save(1, state)
  c = make_ckptr()
  md = c.metadata(1)
  w = md.shardings["params/w"]
  assert isinstance(w, SavedSharding) and w.kind == "mesh"
  assert w.mesh_shape == {"data": 2, "model": 4} and w.num_devices == 8
  assert w.spec == P("data", "model")
  assert w.axis_types == ("explicit", "explicit")
  assert str(w) == ("NamedSharding(mesh={'data': 2, 'model': 4}, spec=("
                    "'data', 'model'), axis_types=('explicit', 'explicit'))")
  assert w.to_sharding() == state["params"]["w"].sharding
  assert md.shardings["keys"].spec == P("data")  # over the keys' shape
  assert md.shardings["step"].spec == P()        # inline, on its mesh
  assert md.shardings["single"].kind == "device"
  assert str(md.shardings["single"]) == "SingleDeviceSharding"
  assert md.shardings["single"].to_sharding() == jax.sharding.\
      SingleDeviceSharding(jax.devices()[0])
  table = md.shardings["table"]
  assert table.kind == "replicated" and str(table) == "replicated (host value)"
  assert table.to_sharding().is_fully_replicated
  # Given devices: in the order given; as many as the saved mesh had.
  rev = w.to_sharding(jax.devices()[::-1])
  assert [d.id for d in rev.mesh.devices.flat] == list(range(7, -1, -1))
  with pytest.raises(ValueError, match=r"has 8 devices, the devices given "
                     r"are 4"):
    w.to_sharding(jax.devices()[:4])
  with pytest.raises(ValueError, match="no mesh was recorded"):
    SavedSharding("unknown", description="PositionalSharding").to_sharding()
  # Orbax's restore(step) with no args, in ckpt: the metadata's own tree
  # (ShapeDtypeStructs without shardings, values as saved) as the target.
  got = flat(c.restore(1, target=md.tree))
  assert got["params/w"].sharding == state["params"]["w"].sharding
  assert got["name"] == "run" and got["epoch"] == 2


def test_abstract_target_keeps_host_numpy_leaves_numpy(make_ckptr, rng):
  mesh = explicit_mesh()
  state = one_mesh_state(rng, mesh)
  make_ckptr(async_save=False).save(1, state)
  c = make_ckptr()
  target = ckpt.abstract_target(c.metadata(1), mesh,
                                [("params/w", P("model", "data"))])
  t = target["table"]
  assert type(t) is np.ndarray and t.shape == (300,) and t.nbytes == 1200
  assert t.base is not None and not t.flags.writeable  # no copy: a view
  got = c.restore(1, target=target)
  assert type(got["table"]) is np.ndarray
  assert same_bits(got["table"], state["table"])
  assert got["params"]["w"].sharding.spec == P("model", "data")


def test_abstract_target_keeps_the_containers_it_is_given(make_ckptr, rng):
  """Issue 36, item 2: given the model's own abstract tree (a flax.struct
  style dataclass, an optax style NamedTuple; an nnx.State in
  docs/flax.md), abstract_target keeps its containers, so the restored
  tree is the model's again; jax.Array leaves are taken as their shape."""
  mesh = explicit_mesh()
  w = random_array(rng, (8, 16))
  state = TrainState(params={"w": w}, step=np.int32(3),
                     opt_state=(AdamState(np.int32(1), {"w": w}, {"w": w}),))
  make_ckptr(async_save=False).save(1, state)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          state)
  abstract.opt_state[0].mu["w"] = jnp.zeros((8, 16))  # an array leaf
  target = ckpt.abstract_target(abstract, mesh,
                                [(r".*w", P("data", "model"))])
  assert type(target) is TrainState and type(target.opt_state[0]) is AdamState
  got = make_ckptr().restore(1, target=target)
  assert type(got) is TrainState and type(got.opt_state[0]) is AdamState
  assert got.opt_state[0].mu["w"].sharding.spec == P("data", "model")
  assert same_bits(got.params["w"], w) and same_bits(got.opt_state[0].nu["w"],
                                                     w)


# ---- the index field -------------------------------------------------------

def _entry(shape=(8, 8), saved=None, **extra) -> dict:
  e = {"path": ["w"], "kind": "array", "relpath": "w", "shape": list(shape),
       "dtype": "float32", "chunks": list(shape), "codec": {},
       "source_dtype": "float32", "sharding": "NamedSharding(...)"}
  if saved is not None:
    e["saved_sharding"] = saved
  e.update(extra)
  return e


def _index(entry: dict) -> bytes:
  return sealed.packb({
      "format": "ckpt", "version": index_lib.VERSION, "step": 1, "time": 0.0,
      "storage_format": "zarr", "process_count": 1, "metrics": {},
      "structure": ["dict", "w", 0],
      "leaves": index_codec.columns([entry], entries.KINDS),
      "host_state": None}, use_bin_type=True)


GOOD = {"mesh_axes": ["data", "model"], "mesh_shape": [2, 4],
        "spec": [["data", "model"], None], "axis_types": ["explicit", "auto"]}


def test_the_field_round_trips():
  e = index_lib.decode(_index(_entry(saved=GOOD))).leaves[0]
  s = e.saved_sharding
  assert (s.kind, s.axis_names, s.axis_sizes, s.spec, s.axis_types) == (
      "mesh", ("data", "model"), (2, 4), P(("data", "model"), None),
      ("explicit", "auto"))
  assert s.to_json() == GOOD
  assert index_lib.decode(_index(e.to_json())).leaves[0] == e
  # Absent (an older index): nothing recorded, the text kept.
  old = index_lib.decode(_index(_entry())).leaves[0]
  assert old.saved_sharding is None
  assert index_lib.saved_sharding_of(old).kind == "unknown"
  # One object per distinct saved sharding, however many leaves.
  again = index_lib.decode(_index(_entry(saved=dict(GOOD)))).leaves[0]
  assert again.saved_sharding is s


@pytest.mark.parametrize("saved,why", [
    ("data", "as a map"),
    ({**GOOD, "mesh_axes": ["data", 3]}, "mesh_axes"),
    ({**GOOD, "mesh_axes": ["data", "data"]}, "mesh_axes"),
    ({**GOOD, "mesh_axes": ["", "model"]}, "mesh_axes"),
    ({**GOOD, "mesh_axes": ["x" * 129, "model"]}, "mesh_axes"),
    ({**GOOD, "mesh_axes": [f"a{i}" for i in range(17)],
      "mesh_shape": [1] * 17, "spec": [], "axis_types": []}, "mesh_axes"),
    ({**GOOD, "mesh_shape": [2]}, "mesh_shape"),
    ({**GOOD, "mesh_shape": [2, 0]}, "mesh_shape"),
    ({**GOOD, "mesh_shape": [2, -4]}, "mesh_shape"),
    ({**GOOD, "mesh_shape": [2, True]}, "mesh_shape"),
    ({**GOOD, "mesh_shape": [2, 4.0]}, "mesh_shape"),
    ({**GOOD, "mesh_shape": [1 << 12, 1 << 13]}, "mesh_shape"),
    ({**GOOD, "axis_types": ["explicit"]}, "axis_types"),
    ({**GOOD, "axis_types": ["explicit", "typo"]}, "axis_types"),
    ({**GOOD, "spec": "data"}, "spec as a list"),
    ({**GOOD, "spec": ["data", None, None]}, "at most 2"),
    ({**GOOD, "spec": [["data"], ["data"]]}, "each mesh axis once"),
    ({**GOOD, "spec": ["other"]}, "spec entries"),
    ({**GOOD, "spec": [["data", "nope"]]}, "spec entries"),
    ({**GOOD, "spec": [3]}, "spec entries"),
    ({**GOOD, "spec": [{"a": 1}]}, "spec entries"),
    ({**GOOD, "spec": ["data", "data"]}, "each mesh axis once"),
    ({**GOOD, "spec": [["data", "model"], "model"]}, "each mesh axis once"),
])
def test_a_hostile_field_is_refused(saved, why):
  with pytest.raises(CorruptCheckpointError, match="saved_sharding") as e:
    index_lib.decode(_index(_entry(saved=saved)))
  assert why in str(e.value) and "leaf 0 (w)" in str(e.value)


_ANY = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 1 << 26) |
    st.sampled_from(["data", "model", "x", "", "auto", "explicit"]) |
    st.floats(allow_nan=False),
    lambda inner: st.lists(inner, max_size=4) |
    st.dictionaries(st.sampled_from(["a", "spec"]), inner, max_size=2),
    max_leaves=12)
_AXES = st.sampled_from(["data", "model", "x", ""])
_FIELD = st.fixed_dictionaries({
    "mesh_axes": st.lists(_AXES, max_size=3) | _ANY,
    "mesh_shape": st.lists(st.integers(-1, 9), max_size=3) | _ANY,
    "spec": st.lists(st.none() | _AXES | st.lists(_AXES, max_size=3),
                     max_size=3) | _ANY,
}, optional={"axis_types": st.lists(st.sampled_from(
    ["auto", "explicit", "manual", "typo"]), max_size=3) | _ANY})


@st.composite
def _coherent(draw):
  """Mostly valid fields (one thing may be off)."""
  names = draw(st.lists(st.sampled_from(["data", "model", "x"]),
                        max_size=3, unique=True))
  sizes = draw(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=len(names),
                        max_size=len(names)))
  pick = st.none() | st.sampled_from(names + ["zz"]) | st.lists(
      st.sampled_from(names + ["zz"]), max_size=2) if names else st.none()
  out = {"mesh_axes": names, "mesh_shape": sizes,
         "spec": draw(st.lists(pick, max_size=3))}
  if draw(st.booleans()):
    out["axis_types"] = draw(st.lists(st.sampled_from(
        ["auto", "explicit", "manual"]), min_size=len(names),
        max_size=len(names)))
  return out


@settings(max_examples=300, deadline=None)
@given(saved=_coherent() | _FIELD | _ANY)
def test_any_field_decodes_valid_or_is_refused(saved):
  """Whatever the field holds: CorruptCheckpointError, or a sharding whose
  every part is what the docs promise (and that builds or says why not)."""
  try:
    e = index_lib.decode(_index(_entry(saved=saved))).leaves[0]
  except CorruptCheckpointError:
    return
  s = e.saved_sharding
  if saved is None:  # the field absent
    assert s is None
    return
  assert all(isinstance(n, str) and n for n in s.axis_names)
  assert len(set(s.axis_names)) == len(s.axis_names) == len(s.axis_sizes)
  assert all(type(n) is int and n > 0 for n in s.axis_sizes)
  used = [a for p in s.spec if p is not None
          for a in ((p,) if isinstance(p, str) else p)]
  assert len(used) == len(set(used)) and set(used) <= set(s.axis_names)
  assert len(s.spec) <= 2
  assert index_lib.decode(_index(e.to_json())).leaves[0] == e
  try:
    built = s.to_sharding()
  except ValueError as err:  # a mesh of other than 8 devices
    assert s.num_devices != 8 and "devices" in str(err)
  else:
    if s.kind == "device":
      assert built == jax.sharding.SingleDeviceSharding(jax.devices()[0])
    else:
      assert built.mesh.shape == s.mesh_shape and built.spec == s.spec


def test_the_field_on_key_and_inline_leaves_is_checked():
  # Key data (8, 2) of threefry keys: the spec is over the keys' 1 dim.
  keys = _entry((8, 2), dtype="uint32", source_dtype="uint32",
                prng_impl="threefry2x32",
                saved={"mesh_axes": ["d"], "mesh_shape": [8],
                       "spec": ["d", None]})
  with pytest.raises(CorruptCheckpointError, match="at most 1 entries"):
    index_lib.decode(_index(keys))
  value = {"path": ["w"], "kind": "value",
           "value": inline_values.encode_value(3, ("w",)),
           "saved_sharding": {"mesh_axes": [], "mesh_shape": [], "spec": []}}
  with pytest.raises(CorruptCheckpointError, match="a python value"):
    index_lib.decode(_index(value))


# ---- checkpoints written before the field ----------------------------------

@pytest.mark.parametrize("name", ["zarr", "ocdbt"])
def test_an_index_written_before_the_field(tmp_path, name):
  """A v1 golden (no saved_sharding): its sharded leaves have no recorded
  mesh, so an unsharded jax target names the leaf (never numpy); host
  numpy leaves come back as numpy; targets with shardings restore as
  before (tests/format/test_golden.py checks every leaf)."""
  root = tmp_path / name
  shutil.copytree(GOLDEN_V1 / name, root,
                  ignore=shutil.ignore_patterns("expected.json"))
  with ckpt.Checkpointer(root) as c:
    md = c.metadata(10)
    kernel = md.shardings["params/dense/kernel"]
    assert kernel.kind == "unknown" and str(kernel) == (
        "NamedSharding(mesh={'x': 2, 'y': 4}, spec=('x', None))")
    assert md.shardings["data/tokens"].kind == "replicated"
    sds = jax.ShapeDtypeStruct
    with pytest.raises(TreeMismatchError) as e:
      c.restore(10, target={"params": {"dense": {"kernel": sds(
          (16, 8), np.float32)}}})
    msg = str(e.value)
    for part in ("'params/dense/kernel'", "no mesh was recorded",
                 "spec=('x', None)", "sharding=", "ckpt.abstract_target"):
      assert part in msg, (part, msg)
    tokens = c.restore(10, target={"data": {"tokens": sds((8, 16),
                                                          np.int32)}})
    t = tokens["data"]["tokens"]
    assert type(t) is np.ndarray  # saved from host numpy (stored leaf)
    # An inline value of an index that did not record its kind (a jax.Array
    # here): a jax.Array, never silent numpy.
    bias = c.restore(10, target={"params": {"dense": {"bias": sds(
        (8,), np.float32)}}})["params"]["dense"]["bias"]
    assert isinstance(bias, jax.Array) and bias.is_fully_replicated
    assert same_bits(t, ckpt.load(root, 10)["data"]["tokens"])
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("x", "y"))
    target = ckpt.abstract_target(md, mesh, [("params/dense/kernel",
                                              P("x", None))])
    got = c.restore(10, target={"params": {"dense": {
        "kernel": target["params"]["dense"]["kernel"]}}})
    got = got["params"]["dense"]["kernel"]
    assert got.sharding == NamedSharding(mesh, P("x", None))


# ---- an Orbax checkpoint, imported -----------------------------------------

@pytest.fixture(scope="module")
def orbax_imported(tmp_path_factory):
  """An Orbax checkpoint saved on a 2x4 (data, model) mesh, imported with
  ``ckpt import`` (convert.import_checkpoint): (root, the saved state)."""
  ocp = pytest.importorskip("orbax.checkpoint")
  tmp = tmp_path_factory.mktemp("orbax_import")
  mesh = explicit_mesh()
  rng = np.random.default_rng(25)
  state = {"params": {
      "w": sharded(random_array(rng, (16, 32)),
                   NamedSharding(mesh, P("data", "model"))),
      "b": sharded(random_array(rng, (64,), BF16),
                   NamedSharding(mesh, P("model")))},
           "step": jax.device_put(jnp.int32(12), NamedSharding(mesh, P()))}
  with ocp.CheckpointManager(tmp / "orbax") as mgr:
    mgr.save(12, args=ocp.args.StandardSave(state))
    mgr.wait_until_finished()
  convert.import_checkpoint(tmp / "orbax" / "12", tmp / "ckpt", 12)
  return tmp / "ckpt", state


def test_an_imported_orbax_checkpoint_restores_as_jax_arrays(orbax_imported):
  """Restored with the Orbax user's unsharded target: jax.Arrays, placed as
  the imported index records (never silent numpy), bit-exact."""
  root, state = orbax_imported
  with ckpt.Checkpointer(root) as c:
    md = c.metadata(12)
    got = flat(c.restore(12, target=unsharded(state)))
  for name, x in flat(state).items():
    g = got[name]
    assert isinstance(g, jax.Array), (name, type(g))
    assert same_bits(g, x), name
    recorded = md.shardings[name]
    if recorded.kind == "replicated":  # no mesh: on the checkpoint's, or all
      assert g.is_fully_replicated and g.sharding.device_set == set(
          jax.devices()), name
    else:
      assert g.sharding == recorded.to_sharding(), name


def test_an_imported_orbax_checkpoint_keeps_the_saved_shardings(
    orbax_imported):
  root, state = orbax_imported
  with ckpt.Checkpointer(root) as c:
    md = c.metadata(12)
    assert md.shardings["params/w"].spec == P("data", "model")
    got = c.restore(12, target=unsharded(state))
  for name, x in flat(state).items():
    assert flat(got)[name].sharding.spec == x.sharding.spec, name


def test_a_jax_eval_shape_target_on_an_explicit_mesh_restores(tmp_path):
  """``jax.eval_shape(create_state)`` where create_state places arrays on
  a ``jax.make_mesh`` mesh gives shardings on an AbstractMesh: they are
  built on this job's devices (jax's own error named no leaf)."""
  m = jax.make_mesh((4, 2), ("data", "model"))

  def create():
    return {"w": jax.device_put(jnp.arange(32.0).reshape(8, 4),
                                NamedSharding(m, P("data", "model"))),
            "b": jnp.zeros(3)}

  target = jax.eval_shape(create)
  assert isinstance(target["w"].sharding.mesh, jax.sharding.AbstractMesh)
  with ckpt.Checkpointer(tmp_path / "run") as c:
    c.save(1, create())
    c.wait_until_finished()
    for kw in ({}, {"lazy": True}):
      got = c.restore(target=target, **kw)
      w = got["w"].read() if kw else got["w"]
      assert isinstance(w, jax.Array) and w.sharding.spec == P("data", "model")
      assert w.sharding.mesh.shape == m.shape
      np.testing.assert_array_equal(np.asarray(w), np.arange(32.0).reshape(8, 4))
  bad = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(
      jax.sharding.AbstractMesh((3,), ("x",)), P("x")))
  with ckpt.Checkpointer(tmp_path / "run") as c:
    with pytest.raises(ckpt.TreeMismatchError, match=r"leaf 'w': the target's "
                       r"sharding is on an abstract mesh \{'x': 3\}"):
      c.restore(target={"w": bad, "b": target["b"]})
