"""Retention alone, on a real directory: the pass after a commit deletes
what the policy drops, never a protected step, and the waits and the
deletion of one step (ckpt/face/retention.py)."""

from __future__ import annotations

import pytest

from ckpt.commit import steps as steps_lib
from ckpt.commit.retention import RetentionPolicy
from ckpt.errors import CheckpointError
from ckpt.face import known as known_lib
from ckpt.face import loop as loop_lib
from ckpt.face import retention as retention_lib
from tests.face.conftest import save_steps


@pytest.fixture
def make(storage):
  loops = []

  def make_retention(**policy) -> retention_lib.Retention:
    loop = loop_lib.BackgroundLoop("test")
    loops.append(loop)
    return retention_lib.Retention(
        storage, RetentionPolicy(**policy), known_lib.KnownSteps(storage),
        "dir-test", 60.0, loop)
  yield make_retention
  for loop in loops:
    loop.close(lambda: None)


def committed(retention, loop_of, step: int) -> None:
  """``Retention.committed`` where the Saver calls it: on the loop."""
  async def on_loop():
    retention.committed(step)
  loop_of.run(on_loop())


def test_the_pass_after_a_commit_deletes_what_the_policy_drops(storage, make):
  save_steps(storage.url, [1, 2, 3, 4])
  retention = make(keep=2)
  committed(retention, retention._loop, 4)  # pylint: disable=protected-access
  retention.wait(10.0)
  assert steps_lib.committed_steps(storage) == [3, 4]


def test_a_protected_step_survives_the_pass_until_released(storage, make):
  save_steps(storage.url, [1, 2, 3])
  retention = make(keep=1)
  retention.protect(1)
  committed(retention, retention._loop, 3)  # pylint: disable=protected-access
  retention.wait(10.0)
  assert steps_lib.committed_steps(storage) == [1, 3]
  with pytest.raises(CheckpointError, match="it is being read"):
    retention.delete(1)
  retention.release(1)
  retention.delete(1)
  assert steps_lib.committed_steps(storage) == [3]


def test_settle_waits_for_the_pass_before_a_listing(storage, make):
  save_steps(storage.url, [1, 2, 3])
  retention = make(keep=1)
  committed(retention, retention._loop, 3)  # pylint: disable=protected-access
  retention.settle()  # process 0: the pass in flight is done after it
  assert steps_lib.committed_steps(storage) == [3]


def test_without_a_pass_wait_returns(storage, make):
  save_steps(storage.url, [1])
  retention = make()
  retention.wait(10.0)
  retention.settle()
  assert steps_lib.committed_steps(storage) == [1]


def test_the_damaged_steps_are_kept_as_set(storage, make):
  retention = make(keep=1)
  assert retention.damaged() == frozenset()
  retention.set_damaged([5, 4])
  assert retention.damaged() == {4, 5}
  assert retention.deleting() == frozenset()


def test_a_step_not_committed_is_not_deleted(storage, make):
  save_steps(storage.url, [1])
  retention = make()
  with pytest.raises(CheckpointError, match="cannot delete step 2"):
    retention.delete(2)
  assert steps_lib.committed_steps(storage) == [1]
