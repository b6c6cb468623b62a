"""SaveHistory alone: the facts ``should_save`` keeps of the saves
(ckpt/face/history.py). It does no I/O: no directory."""

from __future__ import annotations

from ckpt.face import history as history_lib


def test_nothing_is_known_at_first():
  history = history_lib.SaveHistory()
  assert history.last_saved is history_lib.UNKNOWN
  assert history.has_checkpoint is None


def test_a_save_is_the_last_saved_and_makes_a_checkpoint():
  history = history_lib.SaveHistory()
  history.saved(7)
  assert history.last_saved == 7 and history.has_checkpoint is True


def test_an_agreed_listing_of_an_empty_directory_knows_no_checkpoint():
  history = history_lib.SaveHistory()
  history.agreed_last_saved(None)
  assert history.last_saved is None and history.has_checkpoint is None
  history.agreed_last_saved(3)
  assert history.last_saved == 3 and history.has_checkpoint is True


def test_not_empty_is_kept_and_forget_drops_only_the_last_saved():
  history = history_lib.SaveHistory()
  history.agreed_not_empty()
  history.saved(4)
  history.forget()  # a cancel, a deletion, a reload
  assert history.last_saved is history_lib.UNKNOWN
  assert history.has_checkpoint is True
