"""Tests of ckpt.commit.retention.RetentionPolicy: which committed steps to delete.

Pure: steps and metrics in, steps out. The real multi-process runs of the
same policies are in tests/multiprocess/test_service.py.
"""

from __future__ import annotations

import pytest

from ckpt.commit.retention import RetentionPolicy


def kept(policy: RetentionPolicy, steps, metrics=None, protected=()):
  """The steps that survive, checking that only existing steps are deleted."""
  doomed = policy.to_delete(list(steps), metrics or {}, frozenset(protected))
  assert set(doomed) <= set(steps), doomed
  assert len(set(doomed)) == len(doomed), doomed
  return sorted(set(steps) - set(doomed))


def loss(**by_step):
  return {int(k[1:]): {"loss": v} for k, v in by_step.items()}


# ---- keep by count ---------------------------------------------------------


def test_no_keep_keeps_everything():
  assert kept(RetentionPolicy(), range(1, 10)) == list(range(1, 10))
  assert kept(RetentionPolicy(keep_period=4), range(1, 10)) == list(
      range(1, 10))
  assert kept(RetentionPolicy(best_metric="loss"), [1, 2, 3],
              loss(s1=3, s2=2, s3=1)) == [1, 2, 3]


def test_keep_newest_n():
  assert kept(RetentionPolicy(keep=2), [1, 2, 3, 4, 5]) == [4, 5]
  assert kept(RetentionPolicy(keep=1), [10, 20, 30]) == [30]
  assert kept(RetentionPolicy(keep=5), [1, 2, 3]) == [1, 2, 3]


def test_keep_is_by_step_not_by_order_given():
  assert kept(RetentionPolicy(keep=2), [5, 1, 4, 2, 3]) == [4, 5]
  assert kept(RetentionPolicy(keep=2), [100, 9, 20]) == [20, 100]


def test_empty_and_single():
  assert RetentionPolicy(keep=1).to_delete([], {}) == []
  assert kept(RetentionPolicy(keep=1), [7]) == [7]


# ---- keep_period -----------------------------------------------------------


def test_keep_period_multiples_never_deleted():
  policy = RetentionPolicy(keep=1, keep_period=3)
  assert kept(policy, range(1, 11)) == [3, 6, 9, 10]
  assert kept(policy, range(1, 10)) == [3, 6, 9]


def test_keep_period_includes_step_zero():
  assert kept(RetentionPolicy(keep=1, keep_period=5), [0, 1, 2, 3]) == [0, 3]


def test_keep_period_with_best_metric():
  policy = RetentionPolicy(keep=1, keep_period=2, best_metric="loss")
  metrics = loss(s1=0.1, s2=5.0, s3=3.0, s4=9.0, s5=4.0)
  # best (1) + newest (5) + even steps.
  assert kept(policy, [1, 2, 3, 4, 5], metrics) == [1, 2, 4, 5]


# ---- best metric -----------------------------------------------------------


def test_best_min_keeps_lowest_and_newest():
  policy = RetentionPolicy(keep=2, best_metric="loss", best_mode="min")
  metrics = loss(s1=5.0, s2=3.0, s3=4.0, s4=1.0, s5=2.0, s6=6.0)
  assert kept(policy, range(1, 7), metrics) == [4, 5, 6]  # 6 is the newest


def test_best_max_keeps_highest_and_newest():
  policy = RetentionPolicy(keep=2, best_metric="acc", best_mode="max")
  metrics = {1: {"acc": 0.1}, 2: {"acc": 0.9}, 3: {"acc": 0.5},
             4: {"acc": 0.7}, 5: {"acc": 0.2}}
  assert kept(policy, range(1, 6), metrics) == [2, 4, 5]


def test_best_min_and_max_are_opposite():
  metrics = loss(s1=1.0, s2=2.0, s3=3.0, s4=4.0, s5=2.5)
  assert kept(RetentionPolicy(keep=2, best_metric="loss"),
              range(1, 6), metrics) == [1, 2, 5]
  assert kept(RetentionPolicy(keep=2, best_metric="loss", best_mode="max"),
              range(1, 6), metrics) == [3, 4, 5]


def test_newest_kept_even_when_worst():
  policy = RetentionPolicy(keep=1, best_metric="loss")
  assert kept(policy, [1, 2, 3], loss(s1=0.5, s2=0.7, s3=99.0)) == [1, 3]
  policy = RetentionPolicy(keep=1, best_metric="acc", best_mode="max")
  assert kept(policy, [1, 2, 3], {1: {"acc": 0.9}, 2: {"acc": 0.1},
                                  3: {"acc": 0.0}}) == [1, 3]


def test_best_ties_prefer_newer():
  policy = RetentionPolicy(keep=1, best_metric="loss")
  assert kept(policy, [1, 2, 3, 4], loss(s1=1.0, s2=1.0, s3=1.0, s4=5.0)) == [
      3, 4]
  policy = RetentionPolicy(keep=2, best_metric="loss")
  assert kept(policy, [1, 2, 3, 4], loss(s1=1.0, s2=1.0, s3=1.0, s4=5.0)) == [
      2, 3, 4]


def test_other_metrics_are_ignored():
  policy = RetentionPolicy(keep=1, best_metric="eval/loss")
  metrics = {1: {"eval/loss": 1.0, "acc": 0.0},
             2: {"eval/loss": 2.0, "acc": 1.0},
             3: {"eval/loss": 3.0, "acc": 0.5}}
  assert kept(policy, [1, 2, 3], metrics) == [1, 3]


def test_nan_metric_ranks_worst():
  # A diverged run (NaN loss) must not push out the real best checkpoint.
  nan = float("nan")
  policy = RetentionPolicy(keep=2, best_metric="loss")
  metrics = loss(s1=1.0, s2=nan, s3=0.5, s4=2.0, s5=3.0)
  assert kept(policy, [1, 2, 3, 4, 5], metrics) == [1, 3, 5]
  assert kept(policy, [5, 4, 3, 2, 1], metrics) == [1, 3, 5]
  policy = RetentionPolicy(keep=2, best_metric="loss", best_mode="max")
  assert kept(policy, [1, 2, 3, 4, 5], metrics) == [4, 5]
  metrics = loss(s1=nan, s2=1.0, s3=0.5, s4=2.0, s5=3.0)
  assert kept(RetentionPolicy(keep=2, best_metric="loss"),
              [1, 2, 3, 4, 5], metrics) == [2, 3, 5]


# ---- steps without the metric ----------------------------------------------


def test_missing_metric_kept_by_default():
  policy = RetentionPolicy(keep=1, best_metric="loss")
  metrics = {1: {"loss": 3.0}, 2: {}, 3: {"loss": 1.0}, 4: {"other": 0.0},
             5: {"loss": 2.0}}
  # 2 and 4 have no "loss": kept; best is 3; 5 is the newest.
  assert kept(policy, [1, 2, 3, 4, 5], metrics) == [2, 3, 4, 5]
  # A step absent from the metrics mapping counts as having none.
  assert kept(policy, [1, 2, 3], {1: {"loss": 1.0}, 3: {"loss": 2.0}}) == [
      1, 2, 3]


def test_missing_metric_first_to_go():
  policy = RetentionPolicy(keep=2, best_metric="loss",
                           keep_checkpoints_without_metrics=False)
  metrics = {1: {"loss": 3.0}, 2: {}, 3: {"loss": 1.0}, 4: {}, 5: {"loss": 2.0}}
  assert kept(policy, [1, 2, 3, 4, 5], metrics) == [3, 5]
  # With too few scored steps, unscored ones do not fill the rest: only
  # the newest (never deleted) stays among them.
  metrics = {1: {"loss": 3.0}, 2: {}, 3: {}, 4: {}}
  assert kept(policy, [1, 2, 3, 4], metrics) == [1, 4]
  policy = RetentionPolicy(keep=3, best_metric="loss",
                           keep_checkpoints_without_metrics=False)
  assert kept(policy, [1, 2, 3, 4, 5], {1: {"loss": 3.0}, 5: {}}) == [1, 5]


def test_orbax_best_n_without_metrics():
  """Orbax's preservation_policy_test.test_best_n_policy: BestN(n=4,
  keep_checkpoints_without_metrics=False) over steps 0..4 with losses
  [5, None, 4, None, 7] keeps [0, 2, 4] (before: [0, 2, 3, 4], step 3
  filling the spare slot)."""
  losses = [5, None, 4, None, 7]
  metrics = {s: ({} if v is None else {"loss": v}) for s, v in enumerate(losses)}
  policy = RetentionPolicy(keep=4, best_metric="loss",
                           keep_checkpoints_without_metrics=False)
  assert kept(policy, range(5), metrics) == [0, 2, 4]
  # keep_checkpoints_without_metrics=True (its n=4 case): all five.
  assert kept(RetentionPolicy(keep=4, best_metric="loss"), range(5),
              metrics) == [0, 1, 2, 3, 4]


def test_all_missing_metric():
  keep_them = RetentionPolicy(keep=1, best_metric="loss")
  assert kept(keep_them, [1, 2, 3], {}) == [1, 2, 3]
  drop_them = RetentionPolicy(keep=1, best_metric="loss",
                              keep_checkpoints_without_metrics=False)
  assert kept(drop_them, [1, 2, 3], {}) == [3]


# ---- protected steps -------------------------------------------------------


def test_protected_steps_never_deleted():
  policy = RetentionPolicy(keep=1)
  assert kept(policy, [1, 2, 3, 4], protected={2}) == [2, 4]
  policy = RetentionPolicy(keep=1, best_metric="loss")
  metrics = loss(s1=0.1, s2=9.0, s3=8.0, s4=7.0)
  assert kept(policy, [1, 2, 3, 4], metrics, protected={3}) == [1, 3, 4]
  # A protected step that is not committed changes nothing else.
  assert kept(RetentionPolicy(keep=2), [1, 2, 3], protected={99}) == [2, 3]


def test_newest_never_deleted_in_any_mode():
  for policy in (RetentionPolicy(keep=1),
                 RetentionPolicy(keep=1, best_metric="loss"),
                 RetentionPolicy(keep=1, best_metric="loss", best_mode="max"),
                 RetentionPolicy(keep=1, best_metric="loss",
                                 keep_checkpoints_without_metrics=False)):
    for metrics in ({}, loss(s1=1.0, s2=2.0, s3=3.0), loss(s1=3.0, s2=2.0)):
      assert 3 in kept(policy, [1, 2, 3], metrics), (policy, metrics)


# ---- validation ------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {"keep": 0}, {"keep": -1}, {"keep": 1.5}, {"keep": True}, {"keep": "3"},
    {"keep_period": 0}, {"keep_period": -2}, {"keep_period": 2.0},
    {"best_mode": "median"}, {"best_mode": "MIN"},
])
def test_invalid_policy(kwargs):
  with pytest.raises(ValueError):
    RetentionPolicy(**kwargs)


# ---- best_fn and the time rule (issue 15) ------------------------------------


def test_best_fn_ranks_like_best_metric():
  policy = RetentionPolicy(keep=1, best_fn=lambda m: m["loss"] + m["penalty"])
  metrics = {1: {"loss": 1.0, "penalty": 0.0}, 2: {"loss": 0.2, "penalty": 0.3},
             3: {"loss": 0.1, "penalty": 2.0}, 4: {"loss": 0.1}, 5: {}}
  # 2 is best (0.5); 4 (KeyError) and 5 (no metrics) count as unscored.
  assert kept(policy, [1, 2, 3, 4, 5], metrics) == [2, 4, 5]
  drop = RetentionPolicy(keep=1, best_fn=lambda m: m["loss"] + m["penalty"],
                         best_mode="max", keep_checkpoints_without_metrics=False)
  assert kept(drop, [1, 2, 3, 4, 5], metrics) == [3, 5]


def test_int_metrics_rank():
  policy = RetentionPolicy(keep=1, best_metric="errors")
  assert kept(policy, [1, 2, 3], {1: {"errors": 3}, 2: {"errors": 1},
                                  3: {"errors": 7}}) == [2, 3]


def test_time_rule_keeps_oldest_of_each_bucket_in_window():
  now = 1000.0
  policy = RetentionPolicy(keep=1, keep_time_interval=100,
                           keep_time_window=500, clock=lambda: now)
  times = {s: 300.0 + 40 * s for s in range(16)}  # 300, 340, ... 900
  # The oldest step of each 100 s bucket: 0, 3, 5, 8, 10, 13, 15; those of
  # age < 500 s are kept (5 is exactly 500 s old: out).
  assert kept(policy, range(16), {}, ()) == [15]  # no times given: none kept
  doomed = policy.to_delete(list(range(16)), {}, frozenset(), times)
  assert sorted(set(range(16)) - set(doomed)) == [8, 10, 13, 15]
  # The clock is a callable, also one returning a datetime.
  import datetime
  dt = RetentionPolicy(keep=1, keep_time_interval=datetime.timedelta(
      seconds=100), clock=lambda: datetime.datetime.fromtimestamp(
          now, datetime.timezone.utc))
  assert dt.kept_by_time(list(range(16)), times) == {0, 3, 5, 8, 10, 13, 15}


@pytest.mark.parametrize("kwargs", [
    {"best_fn": 3}, {"best_fn": len, "best_metric": "loss"},
    {"keep_time_interval": 0}, {"keep_time_interval": "1h"},
    {"keep_time_interval": float("inf")}, {"keep_time_window": 60},
])
def test_invalid_new_options(kwargs):
  with pytest.raises(ValueError):
    RetentionPolicy(keep=1, **kwargs)


# ---- keep_steps (Orbax's CustomSteps) ----------------------------------------


def test_keep_steps_with_latest_n():
  """Orbax's v1 Checkpointer test_preservation: AnyPreservationPolicy of
  LatestN(3) and CustomSteps([1, 3, 9]) over steps 0..9 keeps
  [1, 3, 7, 8, 9]; the issue's {1, 3, 7} keeps the same."""
  for pins in ([1, 3, 9], {1, 3, 7}):
    policy = RetentionPolicy(keep=3, keep_steps=pins)
    assert kept(policy, range(10)) == [1, 3, 7, 8, 9]


def test_keep_steps_beside_every_other_rule():
  """Orbax's checkpoint_manager_test.test_preservation_joint_policy:
  BestN(2) + EveryNSteps(4) + CustomSteps([0, 3]) over 12 saves keeps
  [0, 1, 3, 4, 8, 11]."""
  losses = [5, 2, 4, 3, 7, 10, 11, 9, 8, 6, 12, 1]
  metrics = {s: {"loss": v} for s, v in enumerate(losses)}
  policy = RetentionPolicy(keep=2, best_metric="loss", keep_period=4,
                           keep_steps=[0, 3])
  assert kept(policy, range(12), metrics) == [0, 1, 3, 4, 8, 11]
  # Pinned steps stay with keep=1 and after later saves, and a pin on a
  # step not saved (yet) is harmless.
  policy = RetentionPolicy(keep=1, keep_steps=[2, 50])
  assert kept(policy, range(10)) == [2, 9]


@pytest.mark.parametrize("bad", [[-1], ["a"], 3, [1.5]])
def test_keep_steps_invalid(bad):
  with pytest.raises(ValueError, match="keep_steps"):
    RetentionPolicy(keep=1, keep_steps=bad)


# ---- keep_period_exact=False (Flax's keep_every_n_steps) ---------------------


def test_inexact_period_orbax():
  """Orbax's test_every_n_steps_policy, EveryNSteps(3, exact_interval=False):
  steps [0, 1, 2, 4, 5, 8, 9, 13, 14, 25] keep [0, 4, 8, 13, 25]; [0, 1, 2,
  4] keep [0, 4]. The exact rule (default) keeps multiples only."""
  steps = [0, 1, 2, 4, 5, 8, 9, 13, 14, 25]
  inexact = RetentionPolicy(keep=1, keep_period=3, keep_period_exact=False)
  assert kept(inexact, steps) == [0, 4, 8, 13, 25]
  assert kept(inexact, [0, 1, 2, 4]) == [0, 4]
  exact = RetentionPolicy(keep=1, keep_period=3)
  assert kept(exact, [0, 1, 2, 4]) == [0, 4]  # 4: the newest
  assert kept(exact, steps) == [0, 9, 25]


def test_inexact_period_is_stable_step_by_step():
  """Applied after each save (as retention is), the inexact rule keeps
  what it kept over the whole list at once: [0, 4, 8, 13, 25]."""
  policy = RetentionPolicy(keep=1, keep_period=3, keep_period_exact=False)
  present: list[int] = []
  for s in [0, 1, 2, 4, 5, 8, 9, 13, 14, 25]:
    present = kept(policy, present + [s])
  assert present == [0, 4, 8, 13, 25]


def test_inexact_period_flax():
  """Flax's checkpoints_test.test_keep (keep=3, keep_every_n_steps=7, saves
  every 5 steps from 17 to 32): all of 17, 22, 27, 32 stay."""
  policy = RetentionPolicy(keep=3, keep_period=7, keep_period_exact=False)
  present: list[int] = []
  for s in range(17, 37, 5):
    present = kept(policy, present + [s])
  assert present == [17, 22, 27, 32]
  # The exact rule: 17 (not a multiple of 7, not among the 3 newest) goes.
  exact = RetentionPolicy(keep=3, keep_period=7)
  assert kept(exact, range(17, 37, 5)) == [22, 27, 32]


def test_inexact_period_needs_keep_period():
  with pytest.raises(ValueError, match="keep_period_exact"):
    RetentionPolicy(keep=1, keep_period_exact=False)
  with pytest.raises(ValueError, match="keep_period_exact"):
    RetentionPolicy(keep=1, keep_period=2, keep_period_exact=0)


# ---- temporary steps (Levanter's temporary checkpoints) ----------------------


def temp_kept(policy, steps, temporary, metrics=None):
  doomed = policy.to_delete(list(steps), metrics or {}, frozenset(),
                            temporary=frozenset(temporary))
  return sorted(set(steps) - set(doomed))


def test_temporary_steps_go_once_a_newer_one_commits():
  policy = RetentionPolicy(temporary_time_saves=True)  # keep=None: all else
  assert temp_kept(policy, [2, 3], {3}) == [2, 3]  # the newest stays
  assert temp_kept(policy, [2, 3, 4], {3}) == [2, 4]
  assert temp_kept(policy, [2, 3, 5], {3, 5}) == [2, 5]
  # keep counts permanent steps only; pins and protection still hold.
  policy = RetentionPolicy(keep=2, temporary_time_saves=True, keep_steps=[3])
  assert temp_kept(policy, [1, 2, 3, 4, 5, 6], {3, 5, 6}) == [2, 3, 4, 6]
  # Without temporary_time_saves the marks are ignored.
  assert temp_kept(RetentionPolicy(keep=2), [1, 2, 3], {2}) == [2, 3]
