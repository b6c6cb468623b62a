"""The wording of every error ckpt raises, as a user sees it (issue 36,
item 7; issue 46, item 6): one test per error class of ``ckpt/errors.py``
and per error the agreement rounds raise, each produced by a real call
(never by constructing the exception) and compared whole, so that what it
names (the leaf path, what was expected, what was found, the fix) is pinned
here. Tests elsewhere match only what their behaviour adds.

- A target whose top level is not the checkpoint's (``{...}`` for a
  checkpoint of ``{"state": {...}}``, or the reverse) is told that the
  structures differ at the top, with both key sets and the target that fits,
  not to pass ``fallback_state``; a target with leaves that are truly new
  still is.
- A process that waits at a barrier for one that never comes says which
  process did not arrive, how long it waited, and why it waits that long
  (a real job of 2 processes).
- A root that does not exist is logged once at INFO, so that a typo in the
  path is visible before a job trains from scratch.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt
from ckpt.errors import MissingLeavesError
from ckpt.multihost import local_cluster
from tests.conftest import random_array
from tests.multiprocess import launch
from tests.multiprocess import onesided_worker
from tests.multiprocess import worker


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


# ---- one test per error class, the whole message ---------------------------

W = np.arange(8, dtype=np.float32)


def _raised(cls, fn, *args, **kwargs) -> str:
  """The message of the ``cls`` (exactly that class) ``fn`` raises."""
  with pytest.raises(cls) as e:
    fn(*args, **kwargs)
  assert type(e.value) is cls, repr(e.value)
  return str(e.value)


def test_checkpoint_error_names_the_call_and_what_was_written(make_ckptr):
  c = make_ckptr(async_save=False)
  c.close()
  assert _raised(ckpt.CheckpointError, c.save, 3, {"w": W}) == (
      "save(3) refused: this Checkpointer is closed, or being closed by "
      "close() on another thread; nothing was written")


def test_checkpoint_not_found_names_the_step_the_root_and_what_exists(
    make_ckptr, ckpt_dir, tmp_path):
  c = make_ckptr(async_save=False)
  c.save(1, {"w": W})
  assert _raised(ckpt.CheckpointNotFoundError, c.restore, 5) == (
      f"step 5 is not a committed checkpoint in {str(ckpt_dir)!r}; "
      "committed steps: [1]")
  empty = tmp_path / "empty"
  assert _raised(ckpt.CheckpointNotFoundError, make_ckptr(empty).restore) == (
      f"{str(empty)!r} holds no committed checkpoint (no checkpoint_<step>/ "
      "with an index; uncommitted *.tmp-* directories are ignored)")


def test_corrupt_checkpoint_names_the_file_and_the_damage(make_ckptr,
                                                          ckpt_dir):
  c = make_ckptr(async_save=False)
  c.save(1, {"w": W})
  index = ckpt_dir / "checkpoint_1" / "index.msgpack"
  index.write_bytes(index.read_bytes()[:len(index.read_bytes()) // 2])
  assert _raised(ckpt.CorruptCheckpointError,
                 make_ckptr().restore, 1) == (
      f"{index} is not a valid msgpack document (truncated or corrupt "
      "index, or over ckpt's limits for an index?): Unpack failed: "
      "incomplete input")


def test_orbax_import_error_names_the_leaf_the_claim_and_the_option(
    tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  from ckpt.cli import convert  # pylint: disable=g-import-not-at-top
  item = tmp_path / "item"
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)) as oc:
    oc.save(os.fspath(item),
            args=ocp.args.PyTreeSave({"b": np.ones(4, np.int32)}))
  # ``b`` claims 4 TiB and stores no chunk (missing chunks: fill values).
  for path, edit in ((item / "_METADATA", {
      "store_array_data_equal_to_fill_value": False}),
                     (item / "b" / ".zarray", {"shape": [2**40],
                                               "chunks": [2**20]})):
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
  for f in (item / "b").iterdir():
    if f.name != ".zarray":
      f.unlink()
  msg = _raised(ckpt.OrbaxImportError, convert.import_checkpoint, item,
                tmp_path / "c", 1)
  stored = msg.split("but it stores ")[1].split(" ")[0]
  assert msg == (
      f"{item}: its arrays claim 4398046511104 bytes, but it stores "
      f"{stored} bytes; an import writes at most 64x the bytes stored plus "
      "268435456 (missing chunks read as fill values, compressed ones "
      "expand: a truncated or hostile checkpoint). Largest: leaf 'b' "
      f"({item}/b/.zarray): 4398046511104 bytes. If it is what you expect "
      "(arrays of zeros, not stored), pass --allow-sparse "
      "(allow_sparse=True)"), msg
  assert not (tmp_path / "c").exists()


def test_tree_mismatch_names_the_leaf_what_is_saved_and_what_is_wanted(
    make_ckptr):
  c = make_ckptr(async_save=False)
  c.save(1, {"params": {"w": W}, "step": 1})
  assert _raised(ckpt.TreeMismatchError, c.restore, 1, target={
      "params": {"w": np.zeros(4, np.float32)}, "step": 0}) == (
      "leaf 'params/w': the checkpoint has shape (8,), the target wants (4,)")
  assert _raised(ckpt.TreeMismatchError, c.restore, 1, target={
      "params": {"w": np.zeros(8, np.int32)}, "step": 0}) == (
      "leaf 'params/w': the checkpoint has dtype float32, the target wants "
      "int32; only floating dtypes are cast on restore (pass a target with "
      "the saved dtype, or convert afterwards)")


def test_missing_leaves_names_them_what_the_checkpoint_has_and_the_fix(
    make_ckptr):
  c = make_ckptr(async_save=False)
  c.save(1, {"params": {"w": W}, "step": 1})
  assert _raised(ckpt.MissingLeavesError, c.restore, 1, target={
      "params": {"w": W, "b": np.zeros(2, np.float32)}, "step": 0}) == (
      "1 target leaves are missing from the checkpoint: params/b. The "
      "checkpoint has: [params/w, step]. Pass fallback_state= or a restore "
      "transform that provides them.")


def test_invalid_state_names_the_leaf_what_it_is_and_what_is_expected(
    make_ckptr):
  c = make_ckptr(async_save=False)
  assert _raised(ckpt.InvalidStateError, c.save, 2,
                 {"params": {"w": object()}}) == (
      "leaf 'params/w' is a builtins.object; expected a jax.Array, numpy "
      "array, scalar, str, bytes or None. Register custom containers as "
      "pytree nodes.")


def test_wait_timeout_names_the_step_the_bound_and_that_it_goes_on(
    make_ckptr):
  """A 64 MiB save cannot be committed in 0 s: the wait times out."""
  c = make_ckptr()
  c.save(1, {"w": np.ones((4096, 4096), np.float32)})
  assert _raised(ckpt.WaitTimeoutError, c.wait_until_finished, timeout=0) == (
      "wait_until_finished(timeout=0): the save of step 1 was not committed "
      "after 0 s on process 0; it goes on in the background and stays "
      "tracked (wait again, or the next save or close waits for it)")
  c.wait_until_finished()
  assert c.all_steps() == [1]


def test_a_refused_save_round_names_the_newer_steps_and_the_fix(make_ckptr,
                                                                ckpt_dir):
  """The save round's refusal (process 0 decides from agreed facts, every
  process raises the same CheckpointError)."""
  c = make_ckptr(async_save=False)
  c.save(5, {"w": W})
  assert _raised(ckpt.CheckpointError, c.save, 3, {"w": W}) == (
      f"cannot save step 3: newer committed step(s) [5] exist (in "
      f"{str(ckpt_dir)!r}). A save of an older step would start a new "
      "timeline while the newer steps stay, and latest_step()/restore() (a "
      "restarted job) would resume them. To roll back deliberately, call "
      "delete(s) for each of [5] (collective), then save step 3 again. "
      "Nothing was written.")
  assert c.all_steps() == [5]


def test_barrier_timeout_names_the_late_process_and_why_it_waited(tmp_path):
  """Process 0 calls save and process 1 does not (a real job of 2)."""
  p0, p1 = (worker.decode(onesided_worker.Result, r)
            for r in local_cluster.check(local_cluster.run(
                "tests.multiprocess.onesided_worker", {"dir": str(tmp_path)},
                num_processes=2, devices_per_process=1,
                timeout_s=launch.TIMEOUT_S, cwd=str(launch.REPO))))
  assert p1.save is None
  err = p0.save.error
  assert err is not None and err.type == "BarrierTimeoutError", p0
  # ckpt's words, then " Cause: " and the coordination service's (JAX's).
  ours, cause = err.msg.split(" Cause: ", 1)
  assert re.fullmatch(
      r"barrier 'ckpt/dir-[0-9a-f]+/save/1/0/start/in' \(the start of the "
      r"save of step 1\) failed after 3s on process 0 of 2; processes that "
      r"did not arrive: \[1\]\. Check that every process called the same "
      r"save/restore with the same step, and look at the logs of the late "
      r"processes\. \(barrier_timeout_s, 600 s by default, is how long a "
      r"process waits for the others: long enough for a peer still busy "
      r"with its previous work, such as a compile, an evaluation or a "
      r"synchronous save of a large state; a Checkpointer with a smaller "
      r"barrier_timeout_s reports a call missing on some process sooner\.\)",
      ours), ours
  assert "Barrier timed out" in cause, cause
  assert p0.save.seconds < 30, p0


def test_store_timeout_names_the_operation_the_url_the_stall_and_the_option(
    monkeypatch):
  """A real S3 client against a store that takes the connection and never
  answers (a listening socket nothing reads): the query's stall bound."""
  with socket.socket() as hole:
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)
    monkeypatch.setenv("AWS_ENDPOINT_URL",
                       f"http://127.0.0.1:{hole.getsockname()[1]}")
    for var, value in (("AWS_ACCESS_KEY_ID", "testing"),
                       ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_REGION", "us-east-1"),
                       ("AWS_EC2_METADATA_DISABLED", "true")):
      monkeypatch.setenv(var, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    c = ckpt.Checkpointer("s3://bucket/run", query_timeout_s=2)
    msg = _raised(ckpt.StoreTimeoutError, c.latest_step)
    stalled = msg.split("completed for ")[1].split(" s ")[0]  # measured
    assert float(stalled) >= 2.0, msg
    assert msg == (
        "listing the steps of 's3://bucket/run' stalled: nothing it waited "
        f"for from the store completed for {stalled} s (no request "
        "completed, no byte of its data moved), more than the 2 s allowed "
        "without progress. The bound is the Checkpointer argument query_timeout_s=2 "
        "(the longest time without progress, not the length of the "
        "operation); pass a larger value to wait longer, or None to wait as "
        "long as the store's retries take")
    c.close()
