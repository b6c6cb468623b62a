"""Packed small leaves in an async save (ckpt/save/pack.py, ckpt/save/staging.py):
what save() takes before it returns, and what the writes after it hold.

save() returns once every packed box is staged: from a CPU device a view of
its buffer (``memoryview`` where the buffer protocol has the dtype, an
ndarray for bfloat16), which must outlive the caller's delete or donation
of its arrays. The packs are then joined and written at most
``PACKS_IN_FLIGHT`` at once, so the host holds a few packs' copies, not one
of the whole state. Real TensorStore on the local disk, 8 CPU devices.
"""

from __future__ import annotations

import gc
import pathlib
import threading
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt
from ckpt.cli import integrity
from ckpt.save import leaves as leaves_lib
from ckpt.save import pack
from ckpt.save import staging

MiB = 1 << 20


def _small_state(count: int = 120):
  """``count`` small leaves of each kind the staging tells apart:
  replicated float32 (a memoryview), bfloat16 (an ndarray view), int32
  sharded over ``model`` (a memoryview of each shard), uint8 of an odd size
  (padding in its pack)."""
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  rng = np.random.default_rng(7)

  def put(x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))

  state = {}
  for i in range(count):
    state[f"f{i}"] = put(rng.standard_normal((24, 32), dtype=np.float32))
    state[f"b{i}"] = put(rng.standard_normal((16, 8)).astype(jnp.bfloat16))
    state[f"s{i}"] = put(rng.integers(-9, 9, (64, 16), dtype=np.int32),
                         "model")
    state[f"u{i}"] = put(rng.integers(0, 255, (37,), dtype=np.uint8))
  return state


def _donating_step(state):
  fn = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 + 3, s),
               donate_argnums=0)
  return fn(state)


@pytest.mark.parametrize("what", ["delete", "donate"])
def test_small_leaves_let_go_right_after_save_restore_bit_exact(
    tmp_path, monkeypatch, what):
  """Later saves (the plan cached, the staging recipes kept) of 480 small
  leaves in about 60 packs: no pack is joined before the caller deleted or
  donated every array; each save restores bit-exact."""
  monkeypatch.setattr(pack, "MAX_PACK_OBJECT_BYTES", 16 << 10)
  let_go = threading.Event()
  join = pack.PackWriter._join  # pylint: disable=protected-access

  def join_after_let_go(self, *args):
    assert let_go.wait(60)
    return join(self, *args)

  monkeypatch.setattr(pack.PackWriter, "_join", join_after_let_go)
  root = tmp_path / "async"
  with ckpt.Checkpointer(root, async_save=True, keep=5) as c:
    for step in range(1, 4):
      state = _small_state()
      want = {k: np.array(v) for k, v in state.items()}
      let_go.clear()
      c.save(step, state)
      if what == "delete":
        for x in state.values():
          x.delete()
      else:  # a training step: its output reuses no buffer save() holds
        state = _donating_step(state)
        jax.block_until_ready(state)
        assert all(np.all(np.asarray(x) == 3) for x in state.values())
      del state
      gc.collect()
      let_go.set()
      c.wait_until_finished()
      assert c.last_save_stats.planned_leaves == (len(want) if step == 1
                                                  else 0)
      packs = list((root / f"checkpoint_{step}" / ".packs").iterdir())
      assert len(packs) > 30
      got = ckpt.load(root, step)
      for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        np.testing.assert_array_equal(np.asarray(got[k]), v, err_msg=k)
  assert integrity.verify(str(root)) == []


def test_staging_recipes_by_dtype_and_source():
  """One recipe per kind of box: the buffer protocol's view for float32,
  an ndarray view for bfloat16 (the protocol refuses it), a started copy
  for a leaf stored in another dtype, and the generic path for a host
  numpy leaf."""
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  rep = NamedSharding(mesh, P())
  state = {
      "f": jax.device_put(np.arange(12, dtype=np.float32).reshape(3, 4), rep),
      "b": jax.device_put(np.ones((3, 4), jnp.bfloat16), rep),
      "s": jax.device_put(np.arange(32, dtype=np.int32).reshape(8, 4),
                          NamedSharding(mesh, P("model"))),
      "h": np.ones((3, 4), np.float32),
  }
  options = leaves_lib.SaveOptions(inline_max_bytes=0)
  plan = leaves_lib.plan_save(state, options, process_count=1, process=0)
  shards = staging.ShardLookup()
  kinds = {}
  for w in plan.writes:
    leaf = plan.leaves[w.leaf]
    where, kind = shards.recipe(leaf, w)
    kinds.setdefault(leaf.parts[-1], set()).add(kind)
    if kind in (staging.VIEW_BUFFER, staging.VIEW_ARRAY):
      got = np.asarray(staging.take(leaf, w, where, kind))
      np.testing.assert_array_equal(got, np.asarray(leaf.source)[
          w.box.slices()])
  assert kinds == {"f": {staging.VIEW_BUFFER}, "b": {staging.VIEW_ARRAY},
                   "s": {staging.VIEW_BUFFER}, "h": {staging.OTHER}}
  cast = leaves_lib.plan_save(
      state, leaves_lib.SaveOptions(inline_max_bytes=0,
                                    save_dtype=jnp.bfloat16),
      process_count=1, process=0)
  w = next(w for w in cast.writes if cast.leaves[w.leaf].parts[-1] == "f")
  assert shards.recipe(cast.leaves[w.leaf], w)[1] == staging.PIECE


@pytest.mark.parametrize("async_save", [True, False])
def test_packs_joined_and_written_at_most_two_at_once(tmp_path, monkeypatch,
                                                      async_save):
  monkeypatch.setattr(pack, "MAX_PACK_OBJECT_BYTES", 8 << 10)
  held = [0, 0]  # packs joined and not yet written; the most at once
  lock = threading.Lock()
  join, put = pack.PackWriter._join, pack.PackWriter._put  # pylint: disable=protected-access

  def counted_join(self, *args):
    with lock:
      held[0] += 1
      held[1] = max(held)
    return join(self, *args)

  async def counted_put(self, *args):
    try:
      return await put(self, *args)
    finally:
      with lock:
        held[0] -= 1

  monkeypatch.setattr(pack.PackWriter, "_join", counted_join)
  monkeypatch.setattr(pack.PackWriter, "_put", counted_put)
  state = _small_state(40)
  want = {k: np.array(v) for k, v in state.items()}
  root = tmp_path / "bounded"
  with ckpt.Checkpointer(root, async_save=async_save) as c:
    c.save(1, state)
    c.wait_until_finished()
  assert len(list((root / "checkpoint_1" / ".packs").iterdir())) > 20
  assert held == [0, pack.PACKS_IN_FLIGHT]
  got = ckpt.load(root, 1)
  for k, v in want.items():
    np.testing.assert_array_equal(np.asarray(got[k]), v, err_msg=k)


@pytest.fixture
def tracing():
  """tracemalloc on for the test, stopped after it (its Checkpointers are
  closed by then: stopping it while a save's threads run crashed CPython
  3.11, see tests/save/test_zero_copy.py)."""
  tracemalloc.start()
  yield
  tracemalloc.stop()


def test_async_save_holds_a_few_packs_not_the_state(tracing, tmp_path,
                                                    monkeypatch):
  """4 MiB of small leaves in packs of 128 KiB: the host memory a later
  save allocates (numpy and Python objects, which tracemalloc sees: the
  joined packs) until it is written stays near two packs, not the state's
  4 MiB (all packs joined at once)."""
  monkeypatch.setattr(pack, "MAX_PACK_OBJECT_BYTES", 128 << 10)
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  rng = np.random.default_rng(3)
  state = {f"x{i}": jax.device_put(
      rng.standard_normal((64, 64), dtype=np.float32),
      NamedSharding(mesh, P())) for i in range(256)}
  root = pathlib.Path(tmp_path / "mem")
  with ckpt.Checkpointer(root, async_save=True) as c:
    c.save(1, state)  # the first save plans
    c.wait_until_finished()
    gc.collect()
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    c.save(2, state)
    c.wait_until_finished()
    peak = tracemalloc.get_traced_memory()[1] - base
  assert peak < 1.5 * MiB, f"the save allocated {peak / MiB:.2f} MiB"
  got = ckpt.load(root, 2)
  for k in ("x0", "x255"):
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(state[k]))


class _Seen:
  """A pytree node that records, each time jax flattens it (the plan of a
  save does, on the caller's thread), whether Python's cyclic GC was on."""

  gc_on: list[bool] = []

  def __init__(self, leaves: dict):
    self.leaves = leaves


jax.tree_util.register_pytree_with_keys(
    _Seen,
    lambda n: (_Seen.gc_on.append(gc.isenabled()) or
               [(jax.tree_util.DictKey(k), n.leaves[k]) for k in sorted(n.leaves)],
               sorted(n.leaves)),
    lambda keys, children: _Seen(dict(zip(keys, children))))


@pytest.mark.parametrize("async_save", [True, False])
def test_gc_paused_while_save_blocks_then_as_it_was(tmp_path, async_save):
  """Planning and staging thousands of small leaves ran full collections
  of the whole process inside save() (issue 47: most of an async save's
  blocking time when it happened): the cyclic GC is paused until the
  arrays are staged, and afterwards is as the caller left it, after a
  failed save too."""
  state = {"n": _Seen({f"x{i}": jnp.full((8,), i, jnp.float32)
                       for i in range(50)})}
  with ckpt.Checkpointer(tmp_path / "c", async_save=async_save) as c:
    for step in range(2):  # planned, then replayed from the cached plan
      _Seen.gc_on.clear()
      c.save(step, state)
      assert gc.isenabled()
      assert _Seen.gc_on and not any(_Seen.gc_on), _Seen.gc_on
      c.wait_until_finished()
    gc.disable()  # the caller's choice stays
    try:
      c.save(2, state)
      c.wait_until_finished()
      assert not gc.isenabled()
    finally:
      gc.enable()
    with pytest.raises(Exception, match="object"):  # a leaf ckpt refuses
      c.save(3, {"bad": object()})
    assert gc.isenabled()


def test_gc_paused_while_small_leaves_restore_then_as_it_was(tmp_path):
  """A restore of a step with packed leaves makes a few objects per leaf
  and ran full collections of the whole process (issue 47): the cyclic GC
  is paused while it runs (the target is flattened inside), and is on
  again once restore() returns."""
  state = {"n": _Seen({f"x{i}": jnp.full((24, 32), i, jnp.float32)
                       for i in range(50)})}  # packed, not inline
  with ckpt.Checkpointer(tmp_path / "c", async_save=False) as c:
    c.save(0, state)
    _Seen.gc_on.clear()
    got = c.restore(0, target=state)
    assert gc.isenabled()
    assert not all(_Seen.gc_on), _Seen.gc_on  # the restore's own flatten
    assert all(np.array_equal(got["n"].leaves[k], state["n"].leaves[k])
               for k in state["n"].leaves)
