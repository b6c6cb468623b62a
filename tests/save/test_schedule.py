"""SaveSchedule alone: the step rules of ``save_interval_steps``,
``save_on_steps`` and ``should_save_fn``, checked and applied without the
directory (ckpt/save/schedule.py: pure)."""

from __future__ import annotations

import pytest

from ckpt.save.schedule import SaveSchedule


def test_no_rule_is_every_step():
  assert SaveSchedule.of().every_step
  assert not SaveSchedule.of(interval=2).every_step
  assert not SaveSchedule.of(on_steps=[3]).every_step
  assert not SaveSchedule.of(fn=lambda s, last: True).every_step


def test_the_interval_the_steps_and_the_preemption_step():
  sched = SaveSchedule.of(interval=5, on_steps=[7])
  assert [s for s in range(13) if sched.by_rule(s, None)] == [0, 5, 7, 10]
  assert sched.by_rule(3, preemption_step=3)
  assert sched.by_rule(4, None, interval=2)  # the caller's interval


def test_on_steps_alone_and_fn_alone_accept_nothing_by_rule():
  assert not SaveSchedule.of(on_steps=[]).by_rule(0, None)
  assert not SaveSchedule.of(fn=lambda s, last: True).by_rule(4, None)
  assert SaveSchedule.of(on_steps=range(3)).on_steps == frozenset({0, 1, 2})


@pytest.mark.parametrize("kwargs, names", [
    (dict(interval=0), "save_interval_steps must be a positive int"),
    (dict(interval=2.0), "save_interval_steps must be a positive int"),
    (dict(interval=True), "save_interval_steps must be a positive int"),
    (dict(on_steps=[1, -2]), "save_on_steps must be a collection"),
    (dict(on_steps=5), "save_on_steps must be a collection"),
    (dict(on_steps=["a"]), "save_on_steps must be a collection"),
    (dict(fn=3), "should_save_fn must be a callable"),
])
def test_bad_arguments_name_the_argument(kwargs, names):
  with pytest.raises(ValueError, match=names):
    SaveSchedule.of(**kwargs)
