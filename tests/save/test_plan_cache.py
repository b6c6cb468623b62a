"""The save-plan cache (ckpt/save/plan_cache.py): the second save of the same
layout plans nothing new, and every change of layout replans, saving and
restoring correctly."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ckpt.save import plan_cache
from ckpt.save import leaves as leaves_lib
from ckpt.errors import InvalidStateError
from ckpt.format import entries
from tests.conftest import mesh, named, sharded


def _state(m, scale=1.0, **over):
  rng = np.random.default_rng(0)
  state = {
      "w": sharded(scale * rng.standard_normal((16, 8)).astype(np.float32),
                   named(m, "data", "model")),
      "rep": sharded(scale * rng.standard_normal((8, 8)).astype(np.float32),
                     named(m)),
      "small": jax.device_put(jnp.full((3,), scale, jnp.float32), named(m)),
      "host": scale * np.arange(64, dtype=np.float32).reshape(8, 8),
      "key": jax.random.split(jax.random.key(int(scale)), 8),
      "bf16": sharded((scale * rng.standard_normal((8, 16))).astype(
          jnp.bfloat16), named(m, None, "model")),
      "step": int(scale * 10), "name": f"run-{scale}", "lr": np.float32(scale),
  }
  state.update(over)
  return state


def _check(restored, state):
  for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(restored),
                               jax.tree_util.tree_leaves(state)):
    if isinstance(want, jax.Array) and jax.dtypes.issubdtype(
        want.dtype, jax.dtypes.prng_key):
      got, want = jax.random.key_data(got), jax.random.key_data(want)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                  err_msg=jax.tree_util.keystr(path))


def test_second_save_plans_nothing_new(make_ckptr):
  m = mesh()
  c = make_ckptr()
  c.save(1, _state(m))
  first = c.last_save_stats.planned_leaves
  assert first == len(jax.tree_util.tree_leaves(_state(m)))
  # New arrays, new inline values, the same layout: reused.
  new = _state(m, scale=2.0)
  c.save(2, new)
  assert c.last_save_stats.planned_leaves == 0
  c.save(3, _state(m, scale=3.0))
  assert c.last_save_stats.planned_leaves == 0
  c.wait_until_finished()
  _check(c.restore(2), new)
  _check(c.restore(3), _state(m, scale=3.0))
  assert c.restore(2)["name"] == "run-2.0"


def _plans_equal(a, b):
  assert a.structure == b.structure
  assert len(a.leaves) == len(b.leaves)
  for x, y in zip(a.leaves, b.leaves):
    if isinstance(x.entry, entries.ValueEntry):
      assert type(y.entry) is entries.ValueEntry
      assert (x.entry.path, x.entry.prng_impl, x.entry.saved_sharding) == (
          y.entry.path, y.entry.prng_impl, y.entry.saved_sharding)
      assert type(x.entry.value) is type(y.entry.value)
      np.testing.assert_array_equal(x.entry.value, y.entry.value)
    else:
      assert x.entry == y.entry
  assert a.writes == b.writes
  for x, y in zip(a.leaves, b.leaves):
    assert (x.layout is None) == (y.layout is None)
    if isinstance(x.source, (jax.Array, np.ndarray)):
      assert type(x.source) is type(y.source)
      np.testing.assert_array_equal(np.asarray(x.source), np.asarray(y.source))
    else:
      assert x.source is y.source


@pytest.mark.parametrize("process,count", [(0, 1), (1, 4)])
def test_reused_plan_equals_a_fresh_one(process, count):
  m = mesh()
  cache = plan_cache.PlanCache()
  opts = leaves_lib.SaveOptions()
  cache.plan(_state(m), opts, process=process, process_count=count)
  new = _state(m, scale=5.0)
  got, planned = cache.plan(new, opts, process=process, process_count=count)
  assert planned == 0 and cache.hits == 1
  _plans_equal(got, leaves_lib.plan_save(new, opts, process=process,
                                       process_count=count))


def _changes(m):
  """(what changed, the new state): each must replan."""
  base = _state(m)
  return [
      ("sharding", {**base, "w": jax.device_put(base["w"],
                                                named(m, "model", "data"))}),
      ("mesh", {**base, "w": jax.device_put(
          base["w"], named(mesh((4, 2)), "data", "model"))}),
      ("shape", {**base, "rep": sharded(np.ones((8, 4), np.float32),
                                        named(m))}),
      ("dtype", {**base, "rep": base["rep"].astype(jnp.bfloat16)}),
      ("host dtype", {**base, "host": base["host"].astype(np.float64)}),
      ("inline to stored", {**base, "small": jax.device_put(
          jnp.ones((128,), jnp.float32), named(m))}),
      ("stored to inline", {**base, "rep": jax.device_put(
          jnp.ones((2,), jnp.float32), named(m))}),
      ("scalar type", {**base, "step": 10.5}),
      ("structure", {**base, "extra": np.float32(1.0)}),
      ("list to tuple", {**base, "name": ("run", "a")}),
  ]


@pytest.mark.parametrize("i", range(10))
def test_every_change_replans_and_restores(make_ckptr, i):
  m = mesh()
  what, changed = _changes(m)[i]
  c = make_ckptr()
  c.save(1, _state(m))
  c.save(2, changed)
  assert c.last_save_stats.planned_leaves == len(
      jax.tree_util.tree_leaves(changed)), what
  c.wait_until_finished()
  _check(c.restore(2), changed)
  _check(c.restore(1), _state(m))
  # ... and the changed layout is the cached one now.
  c.save(3, changed)
  assert c.last_save_stats.planned_leaves == 0, what


@pytest.mark.parametrize("field,value", [
    ("save_dtype", jnp.bfloat16), ("storage_format", "zarr3"),
    ("storage_format", "ocdbt"), ("chunk_bytes", 256),
    ("inline_max_bytes", 4), ("max_item_bytes", 128)])
def test_changed_options_replan(field, value):
  m = mesh()
  cache = plan_cache.PlanCache()
  opts = leaves_lib.SaveOptions()
  cache.plan(_state(m), opts)
  new = dataclasses.replace(opts, **{field: value})
  got, planned = cache.plan(_state(m), new)
  assert planned > 0 and cache.misses == 2
  _plans_equal(got, leaves_lib.plan_save(_state(m), new))


@pytest.mark.parametrize("process,count", [(1, 1), (0, 2), (3, 4)])
def test_changed_process_layout_replans(process, count):
  m = mesh()
  cache = plan_cache.PlanCache()
  opts = leaves_lib.SaveOptions()
  cache.plan(_state(m), opts, process=0, process_count=1)
  got, planned = cache.plan(_state(m), opts, process=process,
                            process_count=count)
  assert planned > 0
  _plans_equal(got, leaves_lib.plan_save(_state(m), opts, process=process,
                                       process_count=count))


def test_changed_partitioner_replans():
  m = mesh()
  cache = plan_cache.PlanCache()
  opts = leaves_lib.SaveOptions()

  def rows(name, shape):
    return named(m, "data") if name == "host" else None

  cache.plan(_state(m), opts)
  got, planned = cache.plan(_state(m), opts, rows)
  assert planned > 0
  _plans_equal(got, leaves_lib.plan_save(_state(m), opts, rows))
  assert cache.plan(_state(m), opts, rows)[1] == 0


def test_an_uncacheable_leaf_plans_every_time():
  cache = plan_cache.PlanCache()
  opts = leaves_lib.SaveOptions()
  state = {"a": np.ones((4, 4), np.float32), "none": None}
  cache.plan(state, opts)
  assert cache.plan(state, opts)[1] == 0  # None is a node, not a leaf
  bad = {"a": np.ones((4, 4), np.float32), "obj": object()}
  for _ in range(2):
    with pytest.raises(InvalidStateError, match="leaf 'obj'"):
      cache.plan(bad, opts)


def test_a_deleted_inline_array_is_named_on_a_reused_plan(make_ckptr):
  m = mesh()
  c = make_ckptr()
  c.save(1, _state(m))
  state = _state(m, scale=2.0)
  state["small"].delete()
  with pytest.raises(InvalidStateError, match="leaf 'small'.*deleted"):
    c.save(2, state)


def test_host_values_of_a_reused_plan_are_this_saves(make_ckptr):
  """A host numpy leaf is written from this save's array, not the cached
  plan's (the plan keeps no source)."""
  m = mesh()
  c = make_ckptr()
  c.save(1, _state(m))
  state = _state(m, host=np.full((8, 8), 7.0, np.float32))
  c.save(2, state)
  assert c.last_save_stats.planned_leaves == 0
  c.wait_until_finished()
  np.testing.assert_array_equal(c.restore(2)["host"], np.full((8, 8), 7.0))


def test_a_failed_save_is_planned_afresh(make_ckptr, monkeypatch):
  from ckpt.save import runner as finalize  # pylint: disable=g-import-not-at-top
  m = mesh()
  c = make_ckptr(async_save=False)
  c.save(1, _state(m))
  plain = finalize.run_save

  async def failing(*args, **kwargs):
    raise OSError("disk on fire")

  monkeypatch.setattr(finalize, "run_save", failing)
  with pytest.raises(Exception, match="disk on fire"):
    c.save(2, _state(m))
  assert c.last_save_stats.planned_leaves == 0  # step 2 reused step 1's
  monkeypatch.setattr(finalize, "run_save", plain)
  c.save(3, _state(m, scale=3.0))
  assert c.last_save_stats.planned_leaves > 0
  _check(c.restore(3), _state(m, scale=3.0))
