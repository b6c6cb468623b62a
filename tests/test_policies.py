"""The policies Flax, Levanter and Orbax users write, ported to a Checkpointer
by a rename, each with the peer's own expected steps (one process; the
2-process runs of save_interval_secs and skip_while_saving are in
tests/multiprocess/test_policies_mp.py).

- save_interval_secs + temporary_time_saves: Levanter's
  tests/test_checkpoint.py (test_checkpointer_temporal_policy,
  test_checkpointer_mixed_policy).
- keep_steps: Orbax's v1 training Checkpointer test_preservation
  (LatestN(3) + CustomSteps([1, 3, 9]) keeps [1, 3, 7, 8, 9]).
- keep_period_exact=False: Flax's checkpoints_test.test_keep and Orbax's
  EveryNSteps(exact_interval=False) test.
- best-N without metrics: Orbax's preservation_policy_test.test_best_n_policy.
- skip_while_saving: Orbax's continuous checkpointing.
- Checkpointer(custom_metadata=) / root_metadata(): Orbax's root metadata.
"""

from __future__ import annotations

import datetime
import json
import os
import threading

import numpy as np
import pytest

import ckpt
from ckpt.cli import main as cli
from ckpt.format import root_metadata as root_format
from ckpt.format import seal
from ckpt.errors import CorruptCheckpointError


def state(step: int = 0):
  return {"w": np.full((4, 8), step, np.float32)}


def committed(ck) -> list[int]:
  ck.wait_until_finished()
  return ck.all_steps()


class Clock:
  """Levanter's ``dt_now_injection``: a datetime the test advances."""

  def __init__(self):
    self.now = datetime.datetime(2021, 1, 1, tzinfo=datetime.timezone.utc)

  def __call__(self):
    return self.now

  def advance(self, seconds: float) -> None:
    self.now += datetime.timedelta(seconds=seconds)


TICK = 10


# ---- 1-2. save_interval_secs and temporary steps (Levanter) -----------------


def test_levanter_temporal_policy(make_ckptr):
  """test_checkpointer_temporal_policy: steps saved by time alone are
  temporary; each goes once the next one lands."""
  clock = Clock()
  ck = make_ckptr(save_interval_secs=datetime.timedelta(seconds=TICK),
                  temporary_time_saves=True, clock=clock)
  assert not ck.save(0, state(0))  # the interval runs from the start
  clock.advance(TICK)
  assert ck.save(1, state(1))
  assert committed(ck) == [1]
  clock.advance(TICK - 1)
  assert not ck.save(2, state(2))
  assert committed(ck) == [1]
  clock.advance(1)
  assert ck.save(3, state(3))
  assert committed(ck) == [3]
  assert ck.metadata(3).step == 3


def levanter_every(step: int) -> int:
  """Levanter's [CheckpointInterval(every=2, until=10), (5, until=20),
  (10, until=None)]."""
  return 2 if step <= 10 else 5 if step <= 20 else 10


def test_levanter_mixed_policy(make_ckptr):
  """test_checkpointer_mixed_policy: steps of the step policy stay, steps
  saved by time are removed when the next one lands; the last one (49)
  stays as the newest. (Levanter never saves step 0: neither does this
  schedule.)"""
  clock = Clock()
  ck = make_ckptr(
      should_save_fn=lambda s, _: s > 0 and s % levanter_every(s) == 0,
      save_interval_secs=TICK, temporary_time_saves=True, clock=clock)
  ck.save(0, state(0))
  clock.advance(TICK)
  ck.save(1, state(1))
  assert committed(ck) == [1]
  clock.advance(TICK - 1)
  ck.save(2, state(2))  # by the step policy: 1 (temporary) goes
  assert committed(ck) == [2]
  clock.advance(1)
  ck.save(3, state(3))  # the interval runs from step 2's save
  assert committed(ck) == [2]
  for step in range(4, 11):
    clock.advance(TICK)
    ck.save(step, state(step))
  assert committed(ck) == [2, 4, 6, 8, 10]
  clock.advance(TICK - 1)
  ck.save(11, state(11))
  assert committed(ck) == [2, 4, 6, 8, 10]
  for step in range(12, 50):
    ck.save(step, state(step))
    clock.advance(TICK)
  assert committed(ck) == [2, 4, 6, 8, 10, 15, 20, 30, 40, 49]


def test_interval_combines_with_step_rules(make_ckptr):
  """save when either says so; without temporary_time_saves every step
  saved stays (retention as usual)."""
  clock = Clock()
  ck = make_ckptr(save_interval_steps=4, save_interval_secs=30, clock=clock)
  saved = []
  for step in range(12):
    if ck.should_save(step):
      assert ck.save(step, state(step))
      saved.append(step)
    clock.advance(12)
  # 0 and 4 and 8 by steps; 3 (36 s after 0), 7 (36 s after 4), 11.
  assert saved == [0, 3, 4, 7, 8, 11]
  assert committed(ck) == saved
  assert not any(ck.metadata(s).custom_metadata for s in saved)


def test_temporary_mark_is_in_the_index_and_shown(make_ckptr, ckpt_dir,
                                                  capsys):
  clock = Clock()
  ck = make_ckptr(save_on_steps=[0], save_interval_secs=TICK,
                  temporary_time_saves=True, clock=clock)
  assert ck.save(0, state(0))
  clock.advance(TICK)
  assert ck.save(5, state(5))
  ck.wait_until_finished()
  assert cli.main(["ls", str(ckpt_dir), "--json"]) == 0
  rows = json.loads(capsys.readouterr().out)["steps"]
  assert [(r["step"], r["temporary"]) for r in rows] == [(0, False),
                                                         (5, True)]
  assert cli.main(["ls", str(ckpt_dir)]) == 0
  text = capsys.readouterr().out
  assert "temporary" in text.splitlines()[2] and "temporary" not in (
      text.splitlines()[1])
  assert cli.main(["inspect", str(ckpt_dir), "--step", "5"]) == 0
  assert "temporary" in capsys.readouterr().out
  assert cli.main(["inspect", str(ckpt_dir), "--step", "0", "--json"]) == 0
  assert json.loads(capsys.readouterr().out)["temporary"] is False


def test_temporary_options_checked():
  with pytest.raises(ValueError, match="temporary_time_saves=True needs"):
    ckpt.Checkpointer("memory://x", temporary_time_saves=True)
  with pytest.raises(ValueError, match="save_interval_secs"):
    ckpt.Checkpointer("memory://x", save_interval_secs=-1)
  with pytest.raises(ValueError, match="skip_while_saving"):
    ckpt.Checkpointer("memory://x", skip_while_saving=1)


# ---- 3. keep_steps (Orbax's CustomSteps) -------------------------------------


@pytest.mark.parametrize("pins", [[1, 3, 9], {1, 3, 7}])
def test_orbax_latest_n_and_custom_steps(make_ckptr, pins):
  ck = make_ckptr(keep=3, keep_steps=pins)
  for step in range(10):
    ck.save(step, state(step))
  assert committed(ck) == [1, 3, 7, 8, 9]


# ---- 4. keep_period_exact=False (Flax, Orbax) --------------------------------


def test_flax_keep_every_n_steps(make_ckptr):
  ck = make_ckptr(keep=3, keep_period=7, keep_period_exact=False)
  for step in range(17, 37, 5):
    ck.save(step, state(step))
  assert committed(ck) == [17, 22, 27, 32]


def test_orbax_every_n_steps_inexact(make_ckptr):
  ck = make_ckptr(keep=1, keep_period=3, keep_period_exact=False)
  for step in [0, 1, 2, 4, 5, 8, 9, 13, 14, 25]:
    ck.save(step, state(step))
  assert committed(ck) == [0, 4, 8, 13, 25]


# ---- 7. best-N and steps without metrics (Orbax) -----------------------------


def test_orbax_best_n_without_metrics(make_ckptr):
  ck = make_ckptr(keep=4, best_metric="loss",
                  keep_checkpoints_without_metrics=False)
  for step, loss in enumerate([5, None, 4, None, 7]):
    ck.save(step, state(step), metrics=None if loss is None else {"loss": loss})
  assert committed(ck) == [0, 2, 4]


# ---- 5. skip_while_saving (Orbax's continuous checkpointing) -----------------


def test_skip_while_saving(make_ckptr):
  """While a save is writing (held in its progress callback), save() of
  the next steps returns False at once and should_save says False; a
  forced save would wait. Once it committed, the next step saves."""
  ck = make_ckptr(skip_while_saving=True)
  writing, release = threading.Event(), threading.Event()

  def hold(done, total):
    writing.set()
    release.wait(60)

  assert ck.save(0, state(0), progress=hold)
  assert writing.wait(60)
  try:
    assert ck.is_saving_in_progress()
    assert not ck.should_save(1)
    assert not ck.save(1, state(1))
    assert not ck.save(2, state(2))
    assert ck.last_save_stats.step == 0  # nothing staged for 1 or 2
  finally:
    release.set()
  ck.wait_until_finished()
  assert ck.should_save(3)
  assert ck.save(3, state(3))
  assert committed(ck) == [0, 3]


# ---- 6. root metadata (Orbax's RootMetadata) ---------------------------------


def test_root_metadata(make_ckptr, ckpt_dir, capsys, caplog):
  meta = {"model": {"layers": 4}, "run": "abc", "code": "v1.2"}
  ck = make_ckptr(custom_metadata=meta, keep=1)
  assert ck.root_metadata().custom_metadata == meta  # not written yet
  assert not os.path.exists(ckpt_dir / root_format.NAME)
  for step in range(3):
    ck.save(step, state(step))
  assert committed(ck) == [2]  # retention deleted 0 and 1: the root stays
  data = (ckpt_dir / root_format.NAME).read_bytes()
  assert json.loads(seal.unseal(data, "x"))["custom_metadata"] == meta
  ck.close()
  # Any reader, without the dict; ckpt inspect of the root.
  reader = make_ckptr()
  assert reader.root_metadata().custom_metadata == meta
  assert cli.main(["inspect", str(ckpt_dir), "--json"]) == 0
  assert json.loads(capsys.readouterr().out)["root_metadata"] == meta
  assert cli.main(["inspect", str(ckpt_dir)]) == 0
  assert '"run": "abc"' in capsys.readouterr().out
  # Reopened with another dict: the stored one stays, with a warning.
  other = make_ckptr(custom_metadata={"run": "other"})
  other.save(3, state(3))
  other.wait_until_finished()
  assert other.root_metadata().custom_metadata == meta
  assert "Root metadata is written once" in caplog.text
  # A flipped byte is found.
  broken = bytearray(data)
  broken[5] ^= 1
  (ckpt_dir / root_format.NAME).write_bytes(bytes(broken))
  with pytest.raises(CorruptCheckpointError, match="crc32c"):
    reader.root_metadata()


def test_root_metadata_without_any(make_ckptr):
  ck = make_ckptr()
  ck.save(0, state(0))
  assert ck.root_metadata().custom_metadata == {}


def test_root_metadata_checked():
  with pytest.raises(ValueError, match="custom_metadata"):
    ckpt.Checkpointer("memory://y", custom_metadata={"x": object()})
  with pytest.raises(ValueError, match="at most 65536"):
    ckpt.Checkpointer("memory://y", custom_metadata={"x": "a" * (70 << 10)})


# ---- the same policies through MultiTierCheckpointer -------------------------


@pytest.fixture
def make_multitier(tmp_path):
  opened = []

  def make(name="a", **kwargs):
    m = ckpt.MultiTierCheckpointer(str(tmp_path / name / "persistent"),
                                   local=str(tmp_path / name / "local"),
                                   **kwargs)
    opened.append(m)
    return m

  yield make
  for m in opened:
    try:
      m.close()
    except Exception:  # pylint: disable=broad-except
      pass


def test_multitier_retention_options(make_multitier):
  """keep_steps and keep_period_exact apply to the persistent tier's own
  retention (the local tier keeps local_keep steps)."""
  m = make_multitier(local_interval=1, persistent_interval=1,
                     persistent_keep=3, keep_steps=[1, 3, 9],
                     custom_metadata={"run": "tiers"})
  for step in range(10):
    m.save(step, state(step))
  m.wait_until_finished()
  assert m.persistent.all_steps() == [1, 3, 7, 8, 9]
  assert m.root_metadata().custom_metadata == {"run": "tiers"}
  m.close()
  m = make_multitier("b", local_interval=5, save_on_steps=range(17, 37, 5),
                     persistent_keep=3, keep_period=7, keep_period_exact=False)
  for step in range(17, 37, 5):
    m.save(step, state(step))
  m.wait_until_finished()
  assert m.persistent.all_steps() == [17, 22, 27, 32]


def test_multitier_temporary_time_saves(make_multitier):
  """Levanter's temporal test on the persistent tier: saved by time, each
  deleted once the next one lands; the local tier saves by its interval."""
  clock = Clock()
  m = make_multitier(local_interval=1000, persistent_interval=None,
                     save_interval_secs=TICK, temporary_time_saves=True,
                     clock=clock)
  assert not m.should_save(1) and not m.save(1, state(1))
  clock.advance(TICK)
  assert m.should_save(2)
  assert m.save(2, state(2))
  clock.advance(TICK)
  assert m.save(3, state(3))
  m.wait_until_finished()
  assert m.persistent.all_steps() == [3]
  assert m.persistent.metadata(3).step == 3


def test_multitier_skip_while_saving(make_multitier):
  m = make_multitier(local_interval=1000, persistent_interval=1,
                     skip_while_saving=True)
  writing, release = threading.Event(), threading.Event()

  def hold(done, total):
    writing.set()
    release.wait(60)

  assert m.save(1, state(1), progress=hold)
  assert writing.wait(60)
  try:
    assert not m.should_save(2) and not m.save(2, state(2))
  finally:
    release.set()
  m.wait_until_finished()
  assert m.save(3, state(3))
  m.wait_until_finished()
  assert m.persistent.all_steps() == [1, 3]


def test_temporary_field_is_sealed_and_checked(make_ckptr, ckpt_dir):
  """The mark is an optional field of the sealed index: a permanent step's
  index has no such key (older readers and golden indexes read the same),
  a temporary one has true, and a value that is not a boolean is refused."""
  import msgpack  # pylint: disable=g-import-not-at-top
  from ckpt.format import index as index_lib  # pylint: disable=g-import-not-at-top
  clock = Clock()
  ck = make_ckptr(save_on_steps=[0], save_interval_secs=TICK,
                  temporary_time_saves=True, clock=clock)
  ck.save(0, state(0))
  clock.advance(TICK)
  ck.save(1, state(1))
  ck.wait_until_finished()
  ck.close()
  docs = {}
  for s in (0, 1):
    path = ckpt_dir / f"checkpoint_{s}" / "index.msgpack"
    docs[s] = index_lib.unpack(seal.unseal(path.read_bytes(), str(path)))
  assert "temporary" not in docs[0] and docs[1]["temporary"] is True
  assert index_lib.decode((ckpt_dir / "checkpoint_1" / "index.msgpack")
                          .read_bytes()).temporary is True
  docs[1]["temporary"] = 1
  forged = seal.seal(msgpack.packb(docs[1], use_bin_type=True))
  with pytest.raises(CorruptCheckpointError, match="temporary as true or false"):
    index_lib.decode(forged)
