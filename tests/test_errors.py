"""Errors that point the right way (issue 36, item 7), wording pinned.

- A target whose top level is not the checkpoint's (``{...}`` for a
  checkpoint of ``{"state": {...}}``, or the reverse) is told that the
  structures differ at the top, with both key sets and the target that fits,
  not to pass ``fallback_state``; a target with leaves that are truly new
  still is.
- A root that does not exist is logged once at INFO, so that a typo in the
  path is visible before a job trains from scratch.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt
from ckpt.errors import MissingLeavesError
from tests.conftest import random_array


def _state(rng):
  return {"params": {"w": random_array(rng, (4, 8)),
                     "b": random_array(rng, (8,))},
          "opt": {"mu": random_array(rng, (8,))}}


def _target(mesh8, tree):
  """ShapeDtypeStructs, replicated on ``mesh8``, for ``tree``'s arrays."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh8, P())), tree)


def test_a_target_missing_the_top_level_of_the_checkpoint(make_ckptr, rng,
                                                          mesh8):
  state = _state(rng)
  c = make_ckptr(async_save=False)
  c.save(1, {"state": state, "step": 3})
  with pytest.raises(MissingLeavesError) as e:
    c.restore(1, target=_target(mesh8, state))
  msg = str(e.value)
  assert msg == (
      "the target's structure differs from the checkpoint's at the top "
      "level: the target has top-level keys [opt, params], the checkpoint "
      "[state, step], so 3 target leaves are not in the checkpoint (e.g. "
      "'opt/mu'); the checkpoint holds the missing leaves one level down, "
      "under 'state' ('opt/mu' is saved as 'state/opt/mu'): restore with "
      "target={'state': <this target>} and take ['state'] of the result. "
      "(fallback_state= is for leaves the checkpoint does not have; these "
      "are in it under another path.)"), msg
  assert sorted(e.value.missing) == ["opt/mu", "params/b", "params/w"]
  # What the message says works.
  got = c.restore(1, target={"state": _target(mesh8, state)})["state"]
  assert np.array_equal(np.asarray(got["params"]["w"]), state["params"]["w"])


def test_a_target_with_an_extra_top_level(make_ckptr, rng, mesh8):
  state = _state(rng)
  c = make_ckptr(async_save=False)
  c.save(1, state)
  with pytest.raises(MissingLeavesError) as e:
    c.restore(1, target={"state": _target(mesh8, state)})
  msg = str(e.value)
  assert msg.startswith(
      "the target's structure differs from the checkpoint's at the top "
      "level: the target has top-level keys [state], the checkpoint [opt, "
      "params], so 3 target leaves are not in the checkpoint"), msg
  assert ("the target nests the checkpoint's leaves one level down, under "
          "'state' ('state/opt/mu' is saved as 'opt/mu'): restore with "
          "target=<this target>['state']") in msg, msg
  assert "fallback_state= is for leaves the checkpoint does not have" in msg


def test_top_levels_with_no_key_in_common(make_ckptr, rng, mesh8):
  c = make_ckptr(async_save=False)
  c.save(1, {"model": {"w": random_array(rng, (8,))}})
  with pytest.raises(MissingLeavesError) as e:
    c.restore(1, target={"params": {"kernel": _target(
        mesh8, random_array(rng, (8,)))}})
  msg = str(e.value)
  assert ("the target has top-level keys [params], the checkpoint [model]"
          in msg), msg
  assert ("pass a target of the checkpoint's structure (ckptr.metadata("
          "step).tree shows it), or a restore transform that renames its "
          "leaves") in msg, msg


def test_new_leaves_are_still_told_to_pass_fallback_state(make_ckptr, rng,
                                                          mesh8):
  """A leaf new in the model (an added top-level key, or one beside the
  saved ones) is missing, not a structure that differs."""
  state = _state(rng)
  c = make_ckptr(async_save=False)
  c.save(1, {**state, "old": 1})
  for target in ({**_target(mesh8, state), "ema": _target(mesh8, state)},
                 {"params": {**_target(mesh8, state["params"]),
                             "new": _target(mesh8, state["opt"]["mu"])}}):
    with pytest.raises(MissingLeavesError) as e:
      c.restore(1, target=target)
    msg = str(e.value)
    assert "differs from the checkpoint's at the top" not in msg, msg
    assert "Pass fallback_state= or a restore transform" in msg, msg


def test_a_missing_root_is_logged_once_at_info(make_ckptr, tmp_path, caplog):
  root = tmp_path / "ckpts-typo"
  c = make_ckptr(root)
  with caplog.at_level(logging.INFO, logger="absl"):
    assert c.latest_step() is None
    assert c.all_steps() == []
    with pytest.raises(ckpt.CheckpointNotFoundError):
      c.restore()
  said = [r for r in caplog.records
          if "starting from scratch" in r.getMessage()]
  assert [(r.levelno, r.getMessage()) for r in said] == [
      (logging.INFO,
       f"ckpt: no checkpoint directory {root}: starting from scratch")]


def test_an_existing_empty_root_is_not_reported_missing(make_ckptr, tmp_path,
                                                        caplog):
  root = tmp_path / "empty"
  root.mkdir()
  with caplog.at_level(logging.INFO, logger="absl"):
    assert make_ckptr(root).latest_step() is None
  assert not [r for r in caplog.records
              if "starting from scratch" in r.getMessage()]
