"""Planning by group (ckpt/save/leaves.py plan_leaves): jax.Array leaves of
one (type, shape, dtype, sharding) are planned once per group, the others
copying the group's entry. Neighbouring leaves that differ in exactly one
field of that key must each get their own plan (a key that missed a field
would hand one leaf its neighbour's dtype, shape or sharding), and a save of
such a tree restores every leaf as it was."""

import jax
import numpy as np

from ckpt.format import pack_index
from ckpt.format import tree
from ckpt.save import leaves as leaves_lib
from ckpt.shards import placement as placement_lib
from tests.conftest import mesh, named, sharded


def _state(m):
  rng = np.random.default_rng(0)
  arr = lambda shape, dtype, *spec: sharded(  # noqa: E731
      (rng.standard_normal(shape) * 100).astype(dtype), named(m, *spec))
  # Each pair differs from "a" in one field of the group key only.
  return {
      "a0": arr((8, 16), np.float32, None, "model"),
      "a1": arr((8, 16), np.float32, None, "model"),  # same group as a0
      "dtype": arr((8, 16), np.int32, None, "model"),
      "shape": arr((16, 8), np.float32, None, "model"),
      "sharding": arr((8, 16), np.float32, "model", None),
      "replicated": arr((8, 16), np.float32),
      "a2": arr((8, 16), np.float32, None, "model"),  # the group again
      "big": arr((256, 128), np.float32, None, "model"),  # an array, not packed
      "big2": arr((256, 128), np.float32, None, "model"),
      "key": jax.random.split(jax.random.key(0), 256),
  }


def _plan(state):
  return leaves_lib.plan_save(state, leaves_lib.SaveOptions(),
                              process_count=1, process=0)


def test_each_leaf_planned_as_if_alone():
  m = mesh()
  state = _state(m)
  plan = _plan(state)
  assert len(plan.leaves) == len(state)
  for lp in plan.leaves:
    (name,) = lp.parts
    (alone,) = _plan({name: state[name]}).leaves
    assert lp.entry == alone.entry, name  # dtype, shape, sharding, path...
    assert lp.layout.shape == alone.layout.shape, name
    assert lp.layout.chunks == alone.layout.chunks, name
    assert lp.layout.local == alone.layout.local, name
    if isinstance(lp.entry, pack_index.PackedEntry):
      assert lp.entry.relpath == tree.storage_relpath(lp.parts)
    else:
      assert lp.entry.relpath == alone.entry.relpath
  by = {lp.parts[0]: lp for lp in plan.leaves}
  assert isinstance(by["a0"].entry, pack_index.PackedEntry)
  assert not isinstance(by["big"].entry, pack_index.PackedEntry)
  assert by["big"].entry.relpath != by["big2"].entry.relpath
  assert by["dtype"].entry.dtype == "int32"
  assert by["shape"].entry.shape == (16, 8)
  assert by["sharding"].entry.sharding != by["a0"].entry.sharding
  assert by["replicated"].entry.saved_sharding != by["a0"].entry.saved_sharding
  assert by["key"].entry.prng_impl


def test_one_placement_per_group(monkeypatch):
  """The work per leaf is done once per group: 3 leaves of one group and
  one of another cost two placements, not four."""
  calls = []
  real = placement_lib.placement

  def counted(*args, **kwargs):
    calls.append(args[1])
    return real(*args, **kwargs)

  monkeypatch.setattr(placement_lib, "placement", counted)
  m = mesh()
  x = lambda: sharded(np.ones((8, 16), np.float32), named(m, None, "model"))  # noqa: E731
  y = sharded(np.ones((16, 8), np.float32), named(m, None, "model"))
  plan = _plan({"a": x(), "b": x(), "c": x(), "d": y})
  assert calls == [(8, 16), (16, 8)]
  assert [lp.entry.path for lp in plan.leaves] == [("a",), ("b",), ("c",),
                                                    ("d",)]


def test_groups_round_trip(make_ckptr):
  m = mesh()
  state = _state(m)
  c = make_ckptr()
  c.save(1, state)
  c.wait_until_finished()
  got = c.restore(1, target=state)
  for name, want in state.items():
    have = got[name]
    if name == "key":
      have, want = jax.random.key_data(have), jax.random.key_data(want)
    assert have.dtype == want.dtype and have.shape == want.shape, name
    assert have.sharding == want.sharding, name
    np.testing.assert_array_equal(np.asarray(have), np.asarray(want),
                                  err_msg=name)
