"""restore_async and progress on one process (the collective behaviour of
restore_async across real processes: tests/multiprocess/test_restore_async_mp.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import ckpt

SHAPE = (512, 512)


@pytest.fixture
def saved(tmp_path):
  v = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
  with ckpt.Checkpointer(tmp_path, async_save=False) as c:
    c.save(1, {"w": v})
    c.save(2, {"w": v + 1})
  return tmp_path, v


def test_result_is_the_restore(saved):
  root, v = saved
  target = {"w": jax.ShapeDtypeStruct(SHAPE, np.float32)}
  with ckpt.Checkpointer(root) as c:
    h = c.restore_async(target=target)
    got = h.result()
    assert h.done() and h.result() is got  # the same on every call
    assert np.array_equal(np.asarray(got["w"]), v + 1)
    assert c.last_restore_step == 2
    s = c.last_restore_stats
    assert s.total_s >= s.find_s + s.index_s + s.read_s > 0
    assert "find" in s.stages_text() and s.other_s >= 0


def test_save_and_restore_are_refused_until_result(saved):
  root, v = saved
  with ckpt.Checkpointer(root, async_save=False) as c:
    h = c.restore_async(1)
    for call in (lambda: c.save(3, {"w": v}), lambda: c.restore(1),
                 lambda: c.restore_async(1)):
      with pytest.raises(ckpt.CheckpointError,
                         match="restore_async of step 1 is in flight"):
        call()
    assert np.array_equal(h.result()["w"], v)
    c.save(3, {"w": v})  # then as usual
    assert c.all_steps() == [1, 2, 3]


def test_a_dropped_handle_holds_nothing(saved, caplog):
  """A handle dropped without result() (no reference left, or only a
  reference cycle) releases its claim: the next save and restore work,
  with a WARNING saying its reads were cancelled (before, both were
  refused until close())."""
  root, v = saved
  with ckpt.Checkpointer(root, async_save=False) as c:
    c.restore_async(1)  # dropped at once
    assert np.array_equal(c.restore(2)["w"], v + 1)
    h = c.restore_async(1)
    cycle = {"handle": h}
    cycle["self"] = cycle  # held by a cycle only, once h goes
    del h, cycle
    c.save(3, {"w": v})
    assert c.all_steps() == [1, 2, 3]
    held = c.restore_async(2)  # still referenced: refused, as before
    with pytest.raises(ckpt.CheckpointError, match="is in flight"):
      c.save(4, {"w": v})
    assert np.array_equal(held.result()["w"], v + 1)
  assert "was dropped without its result()" in caplog.text


def test_close_cancels_it(saved):
  root, _ = saved
  c = ckpt.Checkpointer(root)
  h = c.restore_async(1)
  c.close()
  with pytest.raises(ckpt.CheckpointError, match="cancelled: close"):
    h.result()
  assert h.done()


def test_a_failure_comes_from_result(saved):
  root, _ = saved
  with ckpt.Checkpointer(root) as c:
    h = c.restore_async(1, target={"w": jax.ShapeDtypeStruct((3, 3),
                                                            np.float32)})
    with pytest.raises(ckpt.TreeMismatchError, match="'w'"):
      h.result()
    with pytest.raises(ckpt.TreeMismatchError):  # the same error again
      h.result()
    assert c.restore(1)["w"].shape == SHAPE  # the next call works


def test_multi_tier_restore_async(tmp_path):
  v = np.random.default_rng(1).standard_normal(SHAPE, dtype=np.float32)
  opts = dict(local=str(tmp_path / "local"), persistent_interval=2,
              async_save=False)
  target = {"w": jax.ShapeDtypeStruct(SHAPE, np.float32)}
  with ckpt.MultiTierCheckpointer(str(tmp_path / "p"), **opts) as mt:
    mt.save(2, {"w": v})
    mt.save(3, {"w": v + 3})
    mt.wait_until_finished()
    h = mt.restore_async(target=target)  # step 3: the local tier
    assert h.done() and np.array_equal(np.asarray(h.result()["w"]), v + 3)
    assert (mt.last_restore_tier, mt.last_restore_step) == ("local", 3)
    same = lambda tree, target, is_resuming: tree  # only the persistent tier
    h = mt.restore_async(2, target=target, transforms=(same,))
    assert np.array_equal(np.asarray(h.result()["w"]), v)
    assert (mt.last_restore_tier, mt.last_restore_step) == ("persistent", 2)


def test_progress_of_a_save_and_a_restore(tmp_path):
  v = np.random.default_rng(2).standard_normal(SHAPE, dtype=np.float32)
  seen = []
  with ckpt.Checkpointer(tmp_path, async_save=False) as c:
    c.save(1, {"w": v}, progress=lambda done, total: seen.append((done,
                                                                   total)))
    assert seen[-1] == (v.nbytes, v.nbytes), seen
    seen.clear()
    target = {"w": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=(
        jax.sharding.SingleDeviceSharding(jax.devices()[0])))}
    c.restore(1, target=target, progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (v.nbytes, v.nbytes), seen
    seen.clear()
    c.restore(1, progress=lambda d, t: seen.append((d, t)))  # no target
    assert seen[-1] == (v.nbytes, None), seen
    with pytest.raises(ValueError, match="progress must be"):
      c.restore(1, progress="yes")
    c.restore(1, target=target, progress=True)  # a tqdm bar
