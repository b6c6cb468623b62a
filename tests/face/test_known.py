"""KnownSteps alone, on a real directory: what process 0 knows of the
committed steps without listing them, given the save in flight and the
damaged steps as arguments (ckpt/face/known.py)."""

from __future__ import annotations

import time

from ckpt.commit import steps as steps_lib
from ckpt.commit.retention import RetentionPolicy
from ckpt.face import known as known_lib
from ckpt.store import deadline as deadline_lib
from ckpt.store import names as names_lib
from tests.face.conftest import save_steps


def test_a_listing_notes_the_newest_and_later_answers_need_no_listing(
    storage):
  save_steps(storage.url, [1, 2])
  known = known_lib.KnownSteps(storage)
  assert known.newest_bound(None) == 2  # listed: unknown before
  save_steps(storage.url, [3])  # another job commits: not seen
  assert known.newest_bound(None) == 2  # no listing once known
  known.forget_newest()
  assert known.newest_bound(None) == 3


def test_the_damaged_steps_are_not_the_newest(storage):
  save_steps(storage.url, [1, 2, 3])
  known = known_lib.KnownSteps(storage)
  assert known.committed_now(None, damaged={3}) == [1, 2, 3]
  assert known.newest_bound(None) == 2


def test_a_save_in_flight_counts_and_its_listing_notes_nothing(storage):
  save_steps(storage.url, [1, 2])
  known = known_lib.KnownSteps(storage)
  assert known.newest_bound(7) == 7  # unknown: listed, the flying counted
  assert known.committed_now(7) == [1, 2]
  save_steps(storage.url, [4])
  assert known.newest_bound(None) == 4  # nothing was noted: listed again


def test_a_save_begun_or_committed_is_the_newest(storage):
  save_steps(storage.url, [1])
  known = known_lib.KnownSteps(storage)
  known.will_commit(5, known.newest_bound(None))
  assert known.newest_bound(5) == 5  # in flight: what it will be
  known.committed(5, {"loss": 0.5}, temporary=True)
  assert known.newest_bound(None) == 5  # committed: no listing
  assert known.read_metrics(5) == {"loss": 0.5}  # not read: step 5 is absent
  assert known.read_temporary(5) is True


def test_newer_than_lists_only_when_one_may_be(storage):
  save_steps(storage.url, [1, 2, 3])
  known = known_lib.KnownSteps(storage)
  deadline = deadline_lib.Deadline.start(10.0, "query_timeout_s")
  assert known.newer_than(3, None, deadline) == []
  assert known.newer_than(1, None, deadline) == [2, 3]
  assert known.newer_than(1, 9, deadline) == [2, 3, 9]  # and the flying
  save_steps(storage.url, [4])  # known newest is 3: not listed
  assert known.newer_than(3, None, deadline) == []
  assert known.newer_than(3, None, deadline, fresh=True) == [4]


def test_a_recent_listing_is_reused_while_its_newest_stays(storage):
  save_steps(storage.url, [1, 2])
  known = known_lib.KnownSteps(storage)
  assert known.recent_steps(None) is None  # nothing listed yet
  known.committed_now(None)
  assert known.recent_steps(None) == [1, 2]
  assert known.recent_steps(3) is None  # a save in flight may change it
  known.will_commit(3, 2)  # a save of this Checkpointer changes the newest
  known.committed(3, {})
  assert known.recent_steps(None) is None


def test_a_recent_listing_whose_newest_went_is_not_reused(storage):
  save_steps(storage.url, [1, 2])
  known = known_lib.KnownSteps(storage)
  known.committed_now(None)
  (storage.root / names_lib.step_dirname(2)).rename(
      storage.root / "moved-away")
  assert known.recent_steps(None) is None


def test_metrics_times_and_marks_are_read_once_and_forgotten(storage):
  t0 = time.time()
  save_steps(storage.url, [1], metrics={1: {"loss": 2.0}})
  known = known_lib.KnownSteps(storage)
  assert known.read_metrics(1) == {"loss": 2.0}
  assert known.read_time(1) >= t0 - 1
  assert known.read_temporary(1) is False
  known.committed(1, {"loss": 9.0})  # the cache answers from now on
  assert known.read_metrics(1) == {"loss": 9.0}
  known.deleted(1)
  assert known.read_metrics(1) == {"loss": 2.0}  # read again
  known.committed(1, {"loss": 9.0})
  known.forget()
  assert known.read_metrics(1) == {"loss": 2.0}


def test_scored_takes_the_best_and_the_newest_of_ties():
  metrics = {1: {"loss": 1.0}, 2: {"loss": 0.5}, 3: {"loss": 0.5},
             4: {"loss": float("nan")}, 5: {}}
  policy = RetentionPolicy(best_metric="loss", best_mode="min")
  assert known_lib.scored(policy, [1, 2, 3, 4, 5], metrics.__getitem__) == 3
  assert known_lib.scored(policy, [4, 5], metrics.__getitem__) is None


def test_a_save_begun_or_committed_during_a_listing_is_not_overwritten(
    storage, monkeypatch):
  """The listing's newest is noted only if no save began, committed or was
  forgotten while it listed (the caller saw no save in flight)."""
  save_steps(storage.url, [1, 2])
  known = known_lib.KnownSteps(storage)
  listing = steps_lib.committed_steps

  def listing_while(change):
    def list_steps(storage_):
      steps = listing(storage_)
      change()  # on another thread, between the listing and the noting
      return steps
    return list_steps

  monkeypatch.setattr(steps_lib, "committed_steps",
                      listing_while(lambda: known.will_commit(5, 2)))
  assert known.committed_now(None) == [1, 2]
  assert known.newest_bound(5) == 5
  monkeypatch.setattr(steps_lib, "committed_steps",
                      listing_while(lambda: known.committed(5, {})))
  known.committed_now(None)
  assert known.newest_bound(None) == 5  # the commit's, not the listing's 2
