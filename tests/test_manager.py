"""The checkpoint manager's everyday calls, in one process (8 CPU devices).

save_interval_steps / should_save, time-based retention and best_fn,
metadata() and abstract_target, delete / is_saving_in_progress /
wait_until_finished(timeout) / reload, and non-float metrics. The
multi-process runs of delete and save_interval_steps under preemption are
in tests/multiprocess/test_manager_mp.py.
"""

from __future__ import annotations

import datetime
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ckpt
from ckpt.multihost import agreement
from ckpt.commit import protocol as commit_lib
from ckpt.commit import steps as steps_lib
from ckpt.save import runner as finalize
from ckpt.multihost import process as multihost
from tests.conftest import mesh, named, random_array, sharded


def small_state(step: int = 0):
  return {"w": np.full((4, 8), step, np.float32), "step": step}


class Counter:
  """Counts agreement rounds and directory listings (a skipped save must
  make neither)."""

  def __init__(self, monkeypatch):
    self.rounds = 0
    self.listings = 0
    for mod, name, attr in ((agreement, "read_round", "rounds"),
                            (agreement, "save_round", "rounds"),
                            (steps_lib, "committed_steps", "listings"),
                            (steps_lib, "is_committed", "listings")):
      monkeypatch.setattr(mod, name, self._wrap(getattr(mod, name), attr))

  def _wrap(self, fn, attr):
    def wrapped(*a, **k):
      setattr(self, attr, getattr(self, attr) + 1)
      return fn(*a, **k)
    return wrapped


# ---- 1. when to save --------------------------------------------------------


def test_interval_saves_every_nth_and_step_zero(make_ckptr):
  ck = make_ckptr(save_interval_steps=5, async_save=False)
  saved = [s for s in range(13) if ck.save(s, small_state(s))]
  assert saved == [0, 5, 10]
  assert ck.all_steps() == [0, 5, 10]
  assert ck.last_save_stats.step == 10  # the last save that wrote
  assert [ck.should_save(s) for s in (14, 15)] == [False, True]


def test_first_step_of_a_fresh_run_is_saved(make_ckptr, ckpt_dir):
  # As Orbax: a run whose directory holds no checkpoint saves its first step.
  ck = make_ckptr(save_interval_steps=5, async_save=False)
  saved = [s for s in range(1, 12) if ck.save(s, small_state(s))]
  assert saved == [1, 5, 10]
  ck.close()
  # A resumed run (the directory has steps) waits for the next multiple.
  ck = make_ckptr(ckpt_dir, save_interval_steps=5, async_save=False)
  saved = [s for s in range(11, 17) if ck.save(s, small_state(s))]
  assert saved == [15]


def test_skipped_saves_make_no_round_and_no_io(make_ckptr, monkeypatch):
  ck = make_ckptr(save_interval_steps=4, async_save=False)
  ck.save(0, small_state())
  counter = Counter(monkeypatch)
  for s in (1, 2, 3, 5, 6, 7):
    assert ck.save(s, small_state(s)) is False
    assert ck.should_save(s) is False
  assert (counter.rounds, counter.listings) == (0, 0)
  assert ck.save(8, small_state(8)) is True
  assert counter.rounds == 1  # the save round itself


def test_first_step_question_is_asked_once(make_ckptr, ckpt_dir, monkeypatch):
  make_ckptr(async_save=False).save(3, small_state(3))
  ck = make_ckptr(ckpt_dir, save_interval_steps=10)
  counter = Counter(monkeypatch)
  assert [ck.save(s, small_state(s)) for s in (4, 5, 6)] == [False] * 3
  assert counter.rounds == 1  # one round: "does the directory hold one?"


def test_preemption_step_is_always_saved(make_ckptr, monkeypatch):
  monkeypatch.setattr(multihost, "reached_preemption_sync_point",
                      lambda step: step == 7)
  ck = make_ckptr(save_interval_steps=5, async_save=False)
  saved = []
  for s in range(10):
    preempted = ck.reached_preemption(s)
    if ck.save(s, small_state(s)):
      saved.append(s)
    if preempted:
      ck.wait_until_finished()
      break
  assert saved == [0, 5, 7]
  assert ck.should_save(7) and not ck.should_save(8)


def test_force_and_no_interval(make_ckptr):
  ck = make_ckptr(save_interval_steps=100, async_save=False)
  ck.save(0, small_state())
  assert ck.save(3, small_state(3)) is False
  assert ck.save(3, small_state(3), force=True) is True
  assert ck.all_steps() == [0, 3]
  plain = make_ckptr(ck.storage.url + "-plain", async_save=False)
  assert all(plain.should_save(s) for s in (1, 2, 3))  # no interval: every step


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "5"])
def test_bad_interval(make_ckptr, bad):
  with pytest.raises(ValueError, match="save_interval_steps"):
    make_ckptr(save_interval_steps=bad)


# ---- 2. time-based retention and best_fn ------------------------------------


class FakeClock:
  def __init__(self, t=1_700_000_000.0):
    self.t = t

  def __call__(self):
    return self.t


HOUR = 3600.0


def test_one_per_hour_within_the_window(make_ckptr, ckpt_dir):
  """A save every 30 minutes for 9 hours, one kept per hour for the last 6
  (a window of hours, not a day: every save is a commit with its fsyncs,
  and the rule is the same), the 2 newest kept too."""
  clock = FakeClock(1_700_002_800.0)  # 40 minutes into an hour bucket
  ck = make_ckptr(keep=2, keep_time_interval=datetime.timedelta(hours=1),
                  keep_time_window=datetime.timedelta(hours=6), clock=clock,
                  async_save=False)
  times = {}
  for step in range(0, 9 * 2 + 1):  # a save every 30 minutes for 9 hours
    times[step] = clock.t
    ck.save(step, small_state(step))
    clock.t += 1800
  clock.t -= 1800
  ck.wait_until_finished()
  steps = ck.all_steps()
  hourly = {}
  for s in range(19):  # the oldest save of each hour bucket
    hourly.setdefault(int(times[s] // HOUR), s)
  recent = {s for s in hourly.values() if clock.t - times[s] < 6 * HOUR}
  assert set(steps) == recent | {17, 18}
  assert len(recent) == 6 and len(steps) == 7
  # Step times come from the injected clock (written into the index).
  assert ck.metadata(steps[0]).time == times[steps[0]]


def test_time_rule_is_stable_and_pure():
  policy = ckpt.commit.retention.RetentionPolicy(keep=1, keep_time_interval=10,
                                          clock=lambda: 100.0)
  times = {1: 1.0, 2: 5.0, 3: 12.0, 4: 19.0, 5: 25.0}
  kept = set(times) - set(policy.to_delete(list(times), {}, times=times))
  assert kept == {1, 3, 5}
  # Deleting the others, or adding newer steps, keeps the same ones.
  times2 = {1: 1.0, 3: 12.0, 5: 25.0, 6: 27.0, 7: 31.0}
  kept2 = set(times2) - set(policy.to_delete(list(times2), {}, times=times2))
  assert kept2 == {1, 3, 5, 7}
  windowed = ckpt.commit.retention.RetentionPolicy(
      keep=1, keep_time_interval=10, keep_time_window=90,
      clock=lambda: 100.0)
  assert set(times) - set(windowed.to_delete(list(times), {},
                                             times=times)) == {3, 5}
  with pytest.raises(ValueError, match="keep_time_window needs"):
    ckpt.commit.retention.RetentionPolicy(keep=1, keep_time_window=10)
  with pytest.raises(ValueError, match="keep_time_interval"):
    ckpt.commit.retention.RetentionPolicy(keep=1, keep_time_interval=-1)


def test_best_fn(make_ckptr):
  # "best" is a combination of metrics; steps without them are kept.
  ck = make_ckptr(keep=1, best_fn=lambda m: m["loss"] - m["acc"],
                  async_save=False)
  ck.save(1, small_state(1), metrics={"loss": 1.0, "acc": 0.9})   # 0.1
  ck.save(2, small_state(2), metrics={"loss": 0.5, "acc": 0.5})   # 0.0 best
  ck.save(3, small_state(3), metrics={"loss": 2.0, "acc": 0.1})   # 1.9
  ck.save(4, small_state(4), metrics={"other": 1})                 # KeyError
  ck.save(5, small_state(5), metrics={"loss": 3.0, "acc": 0.0})   # newest
  ck.wait_until_finished()
  assert ck.all_steps() == [2, 4, 5]
  with pytest.raises(ValueError, match="not both"):
    make_ckptr(keep=1, best_metric="loss", best_fn=lambda m: 0.0)


# ---- 3. metadata and abstract_target -----------------------------------------


@pytest.fixture
def saved_state(make_ckptr, mesh8, rng):
  w = random_array(rng, (16, 32))
  e = random_array(rng, (64, 8), ml_dtypes.bfloat16)
  table = random_array(rng, (128,), np.int32)
  state = {
      "params": {"w": sharded(w, named(mesh8, "data", "model")),
                 "e": sharded(e, named(mesh8, None, "model"))},
      "opt": {"count": jnp.asarray(3, jnp.int32), "mu": [
          sharded(w * 2, named(mesh8, "model", None))]},
      "table": table,                  # host numpy, no partitioner
      "key": jax.random.key(1),         # a typed PRNG key
      "lr": np.float32(0.5), "name": "run", "epoch": 2, "none": None,
  }
  ck = make_ckptr(async_save=False, save_dtype="bfloat16")
  ck.save(10, state, metrics={"loss": 0.25})
  return ck, {"w": w, "e": e, "table": table}


def test_metadata_describes_without_reading(saved_state):
  ck, _ = saved_state
  md = ck.metadata()
  assert md.step == 10 and md.metrics == {"loss": 0.25}
  t = md.tree
  assert t["params"]["w"] == jax.ShapeDtypeStruct((16, 32), ml_dtypes.bfloat16)
  assert t["params"]["e"].dtype == ml_dtypes.bfloat16
  assert md.source_dtypes["params/w"] == "float32"  # cast by save_dtype
  assert t["opt"]["count"] == jax.ShapeDtypeStruct((), np.int32)
  assert isinstance(t["opt"]["mu"], list) and t["opt"]["mu"][0].shape == (16, 32)
  assert t["table"] == jax.ShapeDtypeStruct((128,), np.int32)
  assert t["key"].shape == () and jax.dtypes.issubdtype(
      t["key"].dtype, jax.dtypes.prng_key)
  assert (t["lr"], t["name"], t["epoch"], t["none"]) == (0.5, "run", 2, None)
  assert "'data', 'model'" in str(md.shardings["params/w"])
  assert md.shardings["params/w"].spec == P("data", "model")
  assert str(md.shardings["table"]) == "replicated (host value)"
  assert ck.metadata(10) == md


@pytest.mark.parametrize("shape,names,rules", [
    ((8,), ("x",), [(r"params/.*", P("x")), (r"opt/mu/0", P(None, "x"))]),
    ((4, 2), ("a", "b"), [(r"params/w", P("b", "a")), (r"params/e", P("a")),
                          (r".*mu.*", P(("a", "b")))]),
])
def test_restore_onto_another_mesh_from_metadata(saved_state, shape, names,
                                                 rules):
  ck, values = saved_state
  m = mesh(shape, names)
  target = ckpt.abstract_target(ck.metadata(10), m, rules)
  assert target["params"]["w"].sharding.mesh.shape == dict(zip(names, shape))
  got = ck.restore(10, target=target)
  bf = lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(got["params"]["w"], np.float32),
                                bf(values["w"]))
  np.testing.assert_array_equal(np.asarray(got["opt"]["mu"][0], np.float32),
                                bf(values["w"] * 2))
  assert got["params"]["w"].sharding == target["params"]["w"].sharding
  assert got["params"]["e"].sharding.spec == target["params"]["e"].sharding.spec
  assert got["opt"]["count"].sharding.is_fully_replicated  # no rule: replicated
  assert int(got["opt"]["count"]) == 3
  assert isinstance(got["table"], np.ndarray)  # saved as a host value
  np.testing.assert_array_equal(got["table"], values["table"])
  assert jax.dtypes.issubdtype(got["key"].dtype, jax.dtypes.prng_key)
  assert (got["name"], got["epoch"]) == ("run", 2)


def test_abstract_target_refuses_specs_that_do_not_fit(saved_state):
  ck, _ = saved_state
  with pytest.raises(ckpt.TreeMismatchError, match="params/w"):
    ckpt.abstract_target(ck.metadata(), mesh((8,), ("x",)),
                         [(r"params/w", P(None, None, "x"))])
  with pytest.raises(ckpt.TreeMismatchError, match="params/w.*multiple"):
    ckpt.abstract_target(ck.metadata(), mesh((3,), ("x",)),
                         [(r"params/w", P("x"))])


# ---- 4. delete, is_saving_in_progress, wait_until_finished(timeout), reload --


@pytest.fixture
def slow_commit(monkeypatch):
  """Commits wait until ``release`` is set (a save that stays in flight)."""
  release = threading.Event()
  commit = commit_lib.commit

  def slow(*a, **k):
    release.wait(30)
    return commit(*a, **k)
  monkeypatch.setattr(finalize.commit_lib, "commit", slow)
  yield release
  release.set()


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_delete(make_ckptr, ckpt_dir, memory_url, where):
  ck = make_ckptr(memory_url if where == "memory" else None, async_save=False)
  assert not ck.is_saving_in_progress()
  for s in (1, 2, 3):
    ck.save(s, small_state(s), metrics={"loss": s})
  ck.delete(2)
  assert ck.all_steps() == [1, 3]
  if where == "disk":
    assert not any(p.name.startswith("checkpoint_2")
                   for p in ckpt_dir.iterdir())
  else:
    assert not ck.storage.list_keys("checkpoint_2")
  ck.delete(3)  # the newest may go (an explicit call, unlike retention)
  assert ck.latest_step() == 1
  with pytest.raises(ckpt.CheckpointNotFoundError, match="committed steps: "
                     r"\[1\]"):
    ck.delete(2)
  ck.save(3, small_state(30), metrics={"loss": 30})  # saved again, new data
  assert ck.metrics(3) == {"loss": 30}
  assert ck.restore(3)["step"] == 30


def test_delete_refuses_the_step_being_saved(make_ckptr, slow_commit):
  ck = make_ckptr()
  ck.save(1, small_state(1))
  assert ck.is_saving_in_progress()
  with pytest.raises(ckpt.CheckpointError, match="step 1 .*being saved"):
    ck.delete(1)
  slow_commit.set()
  ck.wait_until_finished()
  assert not ck.is_saving_in_progress()
  ck.delete(1)
  assert ck.all_steps() == []


def test_delete_refuses_a_step_read_by_lazy_leaves(make_ckptr):
  ck = make_ckptr(async_save=False)
  ck.save(1, {"w": np.arange(4096, dtype=np.float32)})
  leaves = ck.restore(1, lazy=True)
  with pytest.raises(ckpt.CheckpointError, match="being read"):
    ck.delete(1)
  np.testing.assert_array_equal(leaves["w"].read(), np.arange(4096))
  del leaves
  import gc
  gc.collect()
  ck.delete(1)
  assert ck.all_steps() == []


def test_wait_timeout_keeps_the_save_tracked(make_ckptr, slow_commit):
  ck = make_ckptr()
  ck.save(1, small_state(1))
  with pytest.raises(ckpt.WaitTimeoutError, match="step 1 .* 0.2 s") as e:
    ck.wait_until_finished(timeout=0.2)
  assert isinstance(e.value, TimeoutError)
  assert ck.is_saving_in_progress()  # still tracked
  slow_commit.set()
  ck.wait_until_finished(timeout=30)
  assert not ck.is_saving_in_progress()
  assert ck.all_steps() == [1]
  with pytest.raises(ValueError, match="timeout"):
    ck.wait_until_finished(timeout=-1)


def test_reload_drops_cached_metrics(make_ckptr, ckpt_dir):
  ck = make_ckptr(async_save=False)
  ck.save(1, small_state(1), metrics={"loss": 1.0})
  assert ck.metrics(1) == {"loss": 1.0}
  other = make_ckptr(ckpt_dir, async_save=False)  # another job
  other.delete(1)
  other.save(1, small_state(1), metrics={"loss": 9.0})
  assert ck.metrics(1) == {"loss": 1.0}  # cached
  ck.reload()
  assert ck.metrics(1) == {"loss": 9.0}


# ---- 5. metrics that are not floats ------------------------------------------


def test_metrics_of_every_kind(make_ckptr, mesh8):
  ck = make_ckptr(async_save=False)
  metrics = {
      "loss": 0.5, "tokens": 10**12, "ok": True,
      "np_i": np.int32(7), "np_f": np.float16(0.25), "np_0d": np.array(3.5),
      "jax_f": jnp.float32(1.5), "jax_i": jnp.int32(4),
      "jax_bf16": jnp.asarray(2.0, jnp.bfloat16),
      "jax_repl": jax.device_put(jnp.float32(6.0), named(mesh8)),
      "eval": {"loss": 0.75, "acc": {"top1": np.float64(0.5)}},
  }
  ck.save(1, small_state(1), metrics=metrics)
  want = {"loss": 0.5, "tokens": 10**12, "ok": 1, "np_i": 7, "np_f": 0.25,
          "np_0d": 3.5, "jax_f": 1.5, "jax_i": 4, "jax_bf16": 2.0,
          "jax_repl": 6.0, "eval/loss": 0.75, "eval/acc/top1": 0.5}
  for got in (ck.metrics(1), make_ckptr(ck.storage.url).metrics(1),
              ck.metadata(1).metrics):
    assert got == want
    assert {k for k, v in got.items() if type(v) is int} == {
        "tokens", "ok", "np_i", "jax_i"}


def test_int_metric_ranks_with_best_metric(make_ckptr):
  ck = make_ckptr(keep=1, best_metric="eval/errors", async_save=False)
  for s, errors in ((1, 5), (2, 3), (3, 9)):
    ck.save(s, small_state(s), metrics={"eval": {"errors": np.int64(errors)}})
  ck.wait_until_finished()
  assert ck.all_steps() == [2, 3]


@pytest.mark.parametrize("metrics,match", [
    ({"a": "high"}, "'a' must be a number"),
    ({"a": np.zeros(3)}, "'a' must be a scalar"),
    ({"a": jnp.zeros(2)}, "'a' must be a scalar"),
    ({"a/b": 1, "a": {"b": 2}}, "'a/b' is given twice"),
    ({"a": 2**70}, "64 bits"),
    ({"a": None}, "'a' must be a number"),
])
def test_bad_metrics(make_ckptr, metrics, match):
  ck = make_ckptr(async_save=False)
  with pytest.raises(ckpt.InvalidStateError, match=match):
    ck.save(1, small_state(1), metrics=metrics)
  assert ck.all_steps() == []
