"""reuse_unchanged=True on a bucket (memory://, the object-store layout;
the S3 and GCS emulators in tests/objectstore): unchanged leaves are held
by an earlier step (index version 6, ckpt/save/reuse_held.py), deletion
keeps what kept steps hold (ckpt/commit/held.py), every step restores and
verifies, and a kill at any request of retention loses nothing."""

from __future__ import annotations

import itertools
import os
import re

import numpy as np
import pytest

import ckpt
from ckpt.cli import integrity
from ckpt.commit import steps as steps_lib
from ckpt.errors import CorruptCheckpointError
from ckpt.restore import read as read_lib
from ckpt.store import names
from ckpt.store import storage as storage_lib

CHUNK = 64 << 10
_ids = itertools.count()


def _url() -> str:
  return f"memory://held-{os.getpid()}-{next(_ids)}"


def _frozen() -> np.ndarray:
  return np.random.default_rng(99).standard_normal((512, 256), np.float32)


def _state(step: int) -> dict:
  return {"frozen": _frozen(),
          "train": np.random.default_rng(step).standard_normal(
              (256, 256), np.float32)}


def _held(url: str, step: int) -> dict:
  s = storage_lib.Storage(url)
  index = read_lib.read_index(s, steps_lib.step_dir(s, step))
  assert index.version == 6
  return {e.relpath: e.held_by for e in index.leaves}


def _check(url: str, steps) -> None:
  """Every one of ``steps`` is committed, restores bit-exact, verifies."""
  assert steps_lib.committed_steps(storage_lib.Storage(url)) == list(steps)
  for s in steps:
    got, want = ckpt.load(url, s), _state(s)
    for k in want:
      assert got[k].tobytes() == want[k].tobytes(), (s, k)
    assert integrity.verify(url, step=s) == [], s


def _checkpointer(url: str, **kwargs) -> ckpt.Checkpointer:
  return ckpt.Checkpointer(url, reuse_unchanged=True, async_save=False,
                           chunk_bytes=CHUNK, **kwargs)


def _saved(url: str, steps: int) -> None:
  """Steps 0..steps-1 saved by one Checkpointer with reuse on."""
  with _checkpointer(url) as c:
    for step in range(steps):
      c.save(step, _state(step))


def _keys(url: str, prefix: str) -> list[str]:
  return storage_lib.Storage(url).list_keys(prefix)


def test_unchanged_leaves_are_held_across_retention_and_swept_after():
  url = _url()
  with _checkpointer(url, keep=2) as c:
    for step in range(2):  # two copies of the frozen leaf: steps 0 and 1
      c.save(step, _state(step))
      assert c.last_save_stats.bytes_reused == 0
    for step in range(2, 5):  # each holds the copy the step before holds
      c.save(step, _state(step))
      s = c.last_save_stats
      assert s.bytes_reused == _frozen().nbytes
      assert s.bytes_written == 256 * 256 * 4  # the changing leaf only
      assert s.chunks_reused == 8
    assert c.all_steps() == [3, 4]
    four, three = _held(url, 4)["frozen"], _held(url, 3)["frozen"]
    assert (four[0], three[0]) == (0, 1)  # two copies
    assert _held(url, 4)["train"] is None
    # Steps 0 and 1 were deleted by retention: only the arrays steps 3 and
    # 4 hold (and their .reuse files) are left of them.
    for holder in (four, three):
      where = f"checkpoint_{holder[0]}/{holder[1]}"
      left = _keys(url, f"checkpoint_{holder[0]}/")
      assert left and all(k.startswith((f"{where}/frozen/",
                                        f"{where}/.reuse/"))
                          for k in left), left
    assert not _keys(url, "checkpoint_2/")
    _check(url, [3, 4])
    # The frozen leaf changes: written in full, held by nobody, and once
    # retention removed the steps referring to step 0, nothing of it stays.
    for step in (5, 6):
      state = _state(step)
      state["frozen"] = state["frozen"] + 1
      c.save(step, state)
    assert _held(url, 6)["frozen"] is None
    assert c.all_steps() == [5, 6]
  assert not _keys(url, "checkpoint_0/")


def test_delete_and_rollback_keep_what_later_steps_hold():
  url = _url()
  with _checkpointer(url) as c:
    for step in range(3):
      c.save(step, _state(step))
    c.delete(0)  # holds frozen for step 2
    _check(url, [1, 2])
    c.delete(2)  # a rollback: the newest goes, then is saved again,
    c.save(2, _state(2))  # holding step 1's copy (step 0's is gone)
    assert _held(url, 2)["frozen"][0] == 1
    c.save(3, _state(3))  # would hold the step 2 deleted: writes in full
    assert _held(url, 3)["frozen"] is None
    _check(url, [1, 2, 3])
    for step in (2, 1, 3):
      c.delete(step)
  assert not _keys(url, "checkpoint_")


def test_verify_checks_held_chunks():
  url = _url()
  _saved(url, 3)
  holder = _held(url, 2)["frozen"]
  s = storage_lib.Storage(url)
  key = f"checkpoint_0/{holder[1]}/frozen/0.0"
  data = bytearray(s.read_bytes(key))
  data[100] ^= 1
  s.write_bytes(key, bytes(data))
  assert [p.path for p in integrity.verify(url, step=2)] == ["frozen"]
  assert integrity.verify(url, step=1) == []  # the other copy
  # The error names the holder's object, not the holding step's directory
  # (issue 44, item 7).
  with pytest.raises(CorruptCheckpointError, match=re.escape(f"{url}/{key}")):
    ckpt.load(url, 2)
  assert f"{url}/{key}" in integrity.verify(url, step=2)[0].message


def test_a_step_opened_alone_names_the_holder():
  url = _url()
  _saved(url, 3)
  with pytest.raises(ckpt.CheckpointError, match="held by step 0"):
    ckpt.load(f"{url}/checkpoint_2")


def test_a_previous_step_deleted_before_the_save_is_not_referred_to():
  """Another job deletes the step this Checkpointer would hold from (the
  one before its newest): the next save writes in full."""
  url = _url()
  with _checkpointer(url) as c:
    for step in range(2):
      c.save(step, _state(step))
    with ckpt.Checkpointer(url) as other:
      other.delete(0)
    c.save(2, _state(2))
    assert c.last_save_stats.bytes_reused == 0
    assert _held(url, 2)["frozen"] is None
    _check(url, [1, 2])


def test_a_previous_step_deleted_while_committing_fails_the_save(
    monkeypatch):
  """Another job deletes the previous step between this save's writes and
  its commit: the check after the commit removes the new step again, the
  save fails, and the next save writes in full."""
  from ckpt.save import runner  # pylint: disable=g-import-not-at-top
  url = _url()
  real_commit = runner.commit_lib.commit
  with _checkpointer(url) as c:
    for step in range(2):
      c.save(step, _state(step))

    def commit(storage, step, *args, **kwargs):
      out = real_commit(storage, step, *args, **kwargs)
      if step == 2:
        with ckpt.Checkpointer(url) as other:
          other.delete(0)
      return out

    monkeypatch.setattr(runner.commit_lib, "commit", commit)
    with pytest.raises(ckpt.CheckpointError, match="was deleted or replaced"):
      c.save(2, _state(2))
    monkeypatch.setattr(runner.commit_lib, "commit", real_commit)
    assert c.all_steps() == [1]
    c.save(2, _state(2))
    assert c.last_save_stats.bytes_reused == 0
    c.save(3, _state(3))
    assert c.last_save_stats.bytes_reused == _frozen().nbytes
  _check(url, [1, 2, 3])


class _Killed(BaseException):
  """The process died here (raised past every ``except Exception``)."""


@pytest.mark.parametrize("doomed", [[0], [0, 1, 2]])
def test_a_kill_at_any_request_of_a_deletion_loses_nothing(monkeypatch,
                                                           doomed):
  """Deleting ``doomed`` (steps 2 and 3 hold the frozen leaf of steps 0 and
  1) dies at its
  k-th delete request, for every k: each step kept restores bit-exact and
  verifies; the next save's cleanup finishes the deletion, and once every
  step is gone, nothing is left."""
  from ckpt.commit import cleanup  # pylint: disable=g-import-not-at-top
  real = storage_lib.Storage.delete_keys
  for k in itertools.count():
    url = _url()
    _saved(url, 4)
    calls = []

    def delete_keys(self, keys, what, k=k):
      calls.append(what)
      if len(calls) > k:
        raise _Killed(what)
      real(self, keys, what)

    monkeypatch.setattr(storage_lib.Storage, "delete_keys", delete_keys)
    storage = storage_lib.Storage(url)
    try:
      for s in doomed:
        cleanup.remove(storage, names.step_dirname(s))
      finished = True
    except _Killed:
      finished = False
    monkeypatch.setattr(storage_lib.Storage, "delete_keys", real)
    kept = [s for s in range(4) if s not in doomed]
    committed = steps_lib.committed_steps(storage)
    assert set(kept) <= set(committed), (k, committed)
    _check(url, committed)
    with _checkpointer(url, keep=1) as c:
      c.save(4, _state(4))  # its cleanup finishes the deletion
    _check(url, [4])
    assert not _keys(url, "pending/"), k
    # Step 4 holds the frozen leaf of the newest step before it (a new
    # Checkpointer starts from the steps' records): only that is left.
    holder = _held(url, 4)["frozen"]
    for s in range(4):
      left = _keys(url, f"checkpoint_{s}/")
      if holder is not None and s == holder[0]:
        where = f"checkpoint_{s}/{holder[1]}"
        assert left and all(x.startswith((f"{where}/frozen/",
                                          f"{where}/.reuse/"))
                            for x in left), (k, s, left)
      else:
        assert not left, (k, s)
    if finished:
      assert k > 0
      break
    assert k < 200


def test_inspect_says_own_bytes_and_the_step_holding_the_rest(capsys):
  from ckpt.cli import main as cli_main  # pylint: disable=g-import-not-at-top
  url = _url()
  _saved(url, 3)
  assert cli_main.main(["inspect", url, "--step", "2", "--json"]) == 0
  r = __import__("json").loads(capsys.readouterr().out)["reuse"]
  assert r["own_bytes"] == 256 * 256 * 4
  assert r["reused_from"] == {"0": _frozen().nbytes}
  assert r["how"] == "held by reference"
  assert cli_main.main(["inspect", url, "--step", "2"]) == 0
  assert "512.0 KiB reused (512.0 KiB from step 0, held by reference)" in (
      capsys.readouterr().out)


def test_detach_makes_a_step_self_contained(capsys):
  """``ckpt detach``: step 2 copies what step 0 held for it; deleted
  alone with step 0 and 1 gone, nothing of them is left, and it restores."""
  from ckpt.cli import main as cli_main  # pylint: disable=g-import-not-at-top
  url = _url()
  with _checkpointer(url) as c:
    for step in range(3):
      c.save(step, _state(step))
    assert cli_main.main(["detach", url, "--step", "2"]) == 0
    assert "held by step 0" in capsys.readouterr().out
    assert _held(url, 2)["frozen"] is None
    c.delete(0)  # nobody refers to step 0 now: gone
    assert not _keys(url, "checkpoint_0/")
    c.delete(1)
    assert not _keys(url, "checkpoint_1/")
  _check(url, [2])
  assert cli_main.main(["detach", url]) == 0
  assert "holds nothing by reference" in capsys.readouterr().out


@pytest.mark.parametrize("how", ["lost", "damaged"])
def test_detach_refuses_a_holder_that_lost_or_damaged_a_chunk(capsys, how):
  """Issue 44, item 7: the holder of step 2's frozen leaf lost (or has a
  damaged) chunk object: ``ckpt detach`` fails, naming it, and leaves the
  index, the holder and the step exactly as they were."""
  from ckpt.cli import main as cli_main  # pylint: disable=g-import-not-at-top
  url = _url()
  _saved(url, 3)
  holder = _held(url, 2)["frozen"]
  s = storage_lib.Storage(url)
  key = f"checkpoint_{holder[0]}/{holder[1]}/frozen/0.1"
  if how == "lost":
    s.delete_key(key)
  else:
    data = bytearray(s.read_bytes(key))
    data[7] ^= 1
    s.write_bytes(key, bytes(data))
  before = {k: s.read_bytes(k) for k in s.list_all()}
  assert cli_main.main(["detach", url, "--step", "2"]) != 0
  err = capsys.readouterr().err
  assert "fails verification" in err and "frozen" in err, err
  assert {k: s.read_bytes(k) for k in s.list_all()} == before
  assert _held(url, 2)["frozen"] == holder


@pytest.mark.parametrize("budget,reused", [(4 << 20, True), (256 << 10, False)])
def test_async_saves_hold_back_at_most_their_budget(budget, reused):
  """Async saves stage copies: the unchanged boxes held back until the
  processes agree stay within concurrent_bytes; past it they are written
  (and their leaf with them), and every step still restores exactly."""
  url = _url()
  with ckpt.Checkpointer(url, reuse_unchanged=True, chunk_bytes=CHUNK,
                         concurrent_bytes=budget) as c:
    for step in range(3):
      c.save(step, _state(step))
      c.wait_until_finished()
    assert c.last_save_stats.bytes_reused == (_frozen().nbytes if reused
                                              else 0)
    assert (_held(url, 2)["frozen"] is not None) == reused
  _check(url, [0, 1, 2])



def test_cancel_of_a_save_that_holds_back_leaves_every_step_whole():
  """An async save cancelled (while holding back, or later): its attempt
  goes, nothing it referred to is touched, the next save holds again."""
  url = _url()
  with ckpt.Checkpointer(url, reuse_unchanged=True, chunk_bytes=CHUNK,
                         keep=2) as c:
    for step in range(2):
      c.save(step, _state(step))
      c.wait_until_finished()
    c.save(2, _state(2))
    cancelled = c.cancel()
    assert c.all_steps() == ([0, 1] if cancelled else [1, 2])
    c.save(3, _state(3))
    c.wait_until_finished()
    assert c.last_save_stats.bytes_reused == _frozen().nbytes
    assert c.all_steps()[-1] == 3
    kept = c.all_steps()
  _check(url, kept)
  assert not _keys(url, "pending/")


def test_a_root_copied_to_a_disk_restores_and_verifies(tmp_path):
  url = _url()
  _saved(url, 3)
  s = storage_lib.Storage(url)
  for k in s.list_all():
    p = tmp_path / k
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(s.read_bytes(k))
  for step in (1, 2):
    got = ckpt.load(str(tmp_path), step)
    assert got["frozen"].tobytes() == _frozen().tobytes()
    assert got["train"].tobytes() == _state(step)["train"].tobytes()
    assert integrity.verify(str(tmp_path), step=step) == []
