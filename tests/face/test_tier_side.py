"""The persistent tier's side (ckpt/face/tier_side.py ``TierSide``), on the
parts ``Parts.build`` wires (ckpt/face/parts.py) over a real directory:
what a MultiTierCheckpointer asks of the Checkpointer that is its
persistent tier, through that object only (no subclass of Checkpointer)."""

from __future__ import annotations

import numpy as np
import pytest

from ckpt.commit import lease as lease_lib
from ckpt.commit import steps as steps_lib
from ckpt.errors import CheckpointNotFoundError
from ckpt.face import decision as decision_lib
from ckpt.face import options as options_lib
from ckpt.face import parts as parts_lib
from ckpt.format import index as index_lib
from ckpt.restore import read as restore_lib
from tests.face.conftest import save_steps


class _Owner:
  """What a Checkpointer hands Parts.build: its close (run at the
  interpreter's exit, held weakly) and its lease sightings."""

  def __init__(self):
    self.lease_seen = lease_lib.Sightings()

  def close(self) -> None:
    pass


@pytest.fixture
def parts(tmp_path):
  options = options_lib.Options(async_save=False)
  owner = _Owner()
  built = parts_lib.Parts.build(str(tmp_path / "ckpts"), options,
                                options.settings(), owner.close,
                                lambda: owner.lease_seen)
  yield built
  built.loop.close(built.inflight.wait)


def test_newer_steps_but_the_damaged_ones(parts):
  save_steps(parts.storage.url, [1, 2, 3])
  side = parts.tier_side
  assert side.newer_than(1) == [2, 3]
  assert side.damaged_steps() == frozenset()
  parts.retention.set_damaged({3})  # a resume fell back past step 3
  assert side.damaged_steps() == frozenset({3})
  assert side.newer_than(1, fresh=True) == [2]


def test_delete_now_then_deleted(parts):
  save_steps(parts.storage.url, [1, 2])
  side = parts.tier_side
  assert side.newer_than(0) == [1, 2]  # known: 2 is the newest
  assert side.delete_now(2) is True
  side.deleted(2)
  assert steps_lib.committed_steps(parts.storage) == [1]
  assert side.newer_than(0) == [1]
  with pytest.raises(CheckpointNotFoundError):
    side.delete_now(2)


def test_verdict_then_save_as_keeps_its_temporary_mark(parts):
  side = parts.tier_side
  assert side.verdict(5, by_steps=True, force=False, restart=False).save
  assert not side.verdict(5, by_steps=False, force=False,
                          restart=False).save  # no rule, no interval
  assert side.save_as(5, {"w": np.arange(4.0)},
                      decision_lib.Verdict(save=True, temporary=True))
  side.settle()  # the save in flight ends (committed: async_save=False)
  assert steps_lib.committed_steps(parts.storage) == [5]
  index = restore_lib.read_index(parts.storage,
                                 steps_lib.step_dir(parts.storage, 5))
  assert isinstance(index, index_lib.Index) and index.temporary
  # A verdict that says no: nothing saved, False.
  assert side.save_as(6, {"w": np.arange(4.0)},
                      decision_lib.Verdict(save=False)) is False
  assert steps_lib.committed_steps(parts.storage) == [5]
