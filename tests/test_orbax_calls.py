"""The calls an Orbax user reaches for (issue 25, item 2), in one process:
the ``directory`` property, ``check_for_errors``, ``best_step``,
``save(custom_metadata=...)`` read back by ``metadata`` and ``ckpt
inspect``, ``save_on_steps``/``should_save_fn`` and ``cancel``. The
agreement of these across processes: tests/multiprocess/
test_orbax_calls_mp.py."""

from __future__ import annotations

import json
import math
import os
import threading
import time

import msgpack
from tests import sealed
import numpy as np
import pytest
from etils import epath

import ckpt
from ckpt.cli import main as cli
from ckpt.format import index as index_lib
from ckpt.save import write as save_lib
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.store import names

STATE = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "n": 5}


def _leftovers(root) -> list[str]:
  return sorted(os.path.relpath(os.path.join(d, n), root)
                for d, ds, fs in os.walk(root) for n in ds + fs
                if ".tmp-" in n or "pending" in d)


# ---- directory ----------------------------------------------------------

def test_directory_is_an_epath_for_a_local_root_and_the_url_else(tmp_path):
  with ckpt.Checkpointer(tmp_path / "a") as c:
    assert isinstance(c.directory, epath.Path)
    assert c.directory == epath.Path(tmp_path / "a")
  with ckpt.Checkpointer(f"file://{tmp_path}/b") as c:
    assert c.directory == epath.Path(tmp_path / "b")
  rel = os.path.relpath(tmp_path / "c")
  with ckpt.Checkpointer(rel) as c:
    assert c.directory == epath.Path(os.path.abspath(rel))
  with ckpt.Checkpointer("memory://orbax-calls-dir") as c:
    assert c.directory == "memory://orbax-calls-dir"


# ---- check_for_errors ---------------------------------------------------

@pytest.fixture
def failing_save(monkeypatch):
  """Saves stage, then wait for ``gate``, then fail in the background."""
  gate = threading.Event()
  orig = save_lib.write_owned

  async def write_owned(plan, kv, context, limiter, stats, on_staged,
                        *args):
    del plan, kv, context, limiter, stats, args
    on_staged()
    import asyncio  # pylint: disable=g-import-not-at-top
    assert await asyncio.to_thread(gate.wait, 60)
    raise OSError("the store said no")

  monkeypatch.setattr(save_lib, "write_owned", write_owned)
  yield gate
  gate.set()
  monkeypatch.setattr(save_lib, "write_owned", orig)


def test_check_for_errors_raises_a_failed_save_at_once_and_once(
    tmp_path, failing_save):
  c = ckpt.Checkpointer(tmp_path)
  assert c.save(1, STATE)
  assert c.is_saving_in_progress()
  t0 = time.monotonic()
  c.check_for_errors()  # in flight: returns at once, without waiting
  assert time.monotonic() - t0 < 1.0
  assert c.is_saving_in_progress()
  failing_save.set()
  deadline = time.monotonic() + 30
  while c.is_saving_in_progress() and time.monotonic() < deadline:
    time.sleep(0.01)
  assert not c.is_saving_in_progress()
  with pytest.raises(CheckpointError, match="saving step 1 failed.*the store"):
    c.check_for_errors()
  c.check_for_errors()  # raised once
  c.wait_until_finished()  # ... and not again here
  assert c.all_steps() == []
  c.close()


# ---- cancel (one process; two: test_orbax_calls_mp.py) -------------------

def test_cancel_removes_the_attempt_and_the_next_save_works(
    tmp_path, failing_save):
  c = ckpt.Checkpointer(tmp_path)
  assert c.cancel() is False  # nothing in flight
  assert c.save(1, STATE)
  assert c.is_saving_in_progress()
  assert len(_leftovers(tmp_path)) >= 1  # the attempt, being written
  assert c.cancel() is True
  assert not c.is_saving_in_progress()
  c.check_for_errors()  # a cancel is not a failure
  assert _leftovers(tmp_path) == []
  assert c.all_steps() == []
  failing_save.set()  # (the fixture's thread, still waiting on it)
  c.close()


def test_cancel_then_save(tmp_path, monkeypatch):
  gate = threading.Event()
  orig = save_lib.write_owned

  async def slow(*args, **kwargs):
    out = await orig(*args, **kwargs)
    import asyncio  # pylint: disable=g-import-not-at-top
    await asyncio.to_thread(gate.wait, 60)
    return out

  monkeypatch.setattr(save_lib, "write_owned", slow)
  with ckpt.Checkpointer(tmp_path) as c:
    assert c.save(1, STATE)
    t0 = time.monotonic()
    try:
      cancelled = c.cancel()
    finally:
      gate.set()  # (the held thread; and a failure here ends at once)
    assert cancelled is True
    assert time.monotonic() - t0 < 10
    assert _leftovers(tmp_path) == [] and c.all_steps() == []
    assert c.save(2, STATE)
    c.wait_until_finished()
    assert c.all_steps() == [2]
    assert c.cancel() is False  # committed: nothing to cancel
    np.testing.assert_array_equal(c.restore(2)["w"], STATE["w"])


# ---- best_step ----------------------------------------------------------

def _saved(tmp_path, losses: dict, **kwargs) -> ckpt.Checkpointer:
  c = ckpt.Checkpointer(tmp_path, **kwargs)
  for s, loss in losses.items():
    c.save(s, STATE, metrics=None if loss is None else {"eval/loss": loss})
  c.wait_until_finished()
  return c


def test_best_step_min_max_ties_nan_and_without_metric(tmp_path):
  losses = {1: 3.0, 2: 1.0, 3: None, 4: float("nan"), 5: 1.0, 6: 2.0}
  with _saved(tmp_path / "min", losses, best_metric="eval/loss") as c:
    assert c.best_step() == 5  # 2 and 5 tie: the newer
  with _saved(tmp_path / "max", losses, best_metric="eval/loss",
              best_mode="max") as c:
    assert c.best_step() == 1
  with _saved(tmp_path / "fn", losses,
              best_fn=lambda m: -abs(m["eval/loss"] - 2.0),
              best_mode="max") as c:
    assert c.best_step() == 6
  with ckpt.Checkpointer(tmp_path / "min") as c:  # no best_metric
    assert c.best_step() is None
  with ckpt.Checkpointer(tmp_path / "none", best_metric="eval/loss") as c:
    assert c.best_step() is None
  with _saved(tmp_path / "nan", {1: float("nan"), 2: None},
              best_metric="eval/loss") as c:
    assert c.best_step() is None


# ---- custom_metadata ------------------------------------------------------

CUSTOM = {"data_pos": 123, "files": ["a", "b"], "nested": {"x": 1.5,
                                                          "ok": True,
                                                          "none": None}}


def test_custom_metadata_round_trip_metadata_and_inspect(tmp_path, capsys):
  with ckpt.Checkpointer(tmp_path) as c:
    c.save(1, STATE, custom_metadata=CUSTOM)
    c.save(2, STATE)
    c.wait_until_finished()
    assert c.metadata(1).custom_metadata == CUSTOM
    assert c.metadata(2).custom_metadata == {}
    assert c.metadata().custom_metadata == {}
  assert cli.main(["inspect", str(tmp_path), "--step", "1", "--json"]) == 0
  doc = json.loads(capsys.readouterr().out)
  assert doc["custom_metadata"] == CUSTOM
  assert cli.main(["inspect", str(tmp_path), "--step", "1"]) == 0
  text = capsys.readouterr().out
  assert f"custom    {json.dumps(CUSTOM, sort_keys=True)}" in text
  assert cli.main(["inspect", str(tmp_path), "--step", "2"]) == 0
  assert "custom " not in capsys.readouterr().out
  # metadata() reads the index only: no array data (the arrays can go).
  for d in (tmp_path / "checkpoint_1").iterdir():
    if d.name == "w":
      import shutil  # pylint: disable=g-import-not-at-top
      shutil.rmtree(d)
  with ckpt.Checkpointer(tmp_path) as c:
    assert c.metadata(1).custom_metadata == CUSTOM


@pytest.mark.parametrize("bad, words", [
    ([1, 2], "must be a dict"),
    ({1: "a"}, "key 1 is of type int"),
    ({"a": {"b": float("nan")}}, "custom_metadata['a']['b'] is nan"),
    ({"a": [1, float("inf")]}, "custom_metadata['a'][1] is inf"),
    ({"a": np.float32(1)}, "is a float32"),
    ({"a": (1, 2)}, "is a tuple"),
    ({"a": "x" * (1 << 20)}, "at most 1048576"),
])
def test_custom_metadata_refused_before_anything_is_written(tmp_path, bad,
                                                            words):
  with ckpt.Checkpointer(tmp_path) as c:
    c.save(1, STATE)
    with pytest.raises(ckpt.InvalidStateError) as e:
      c.save(2, STATE, custom_metadata=bad)
    assert words in str(e.value), str(e.value)
    assert c.all_steps() == [1]
    assert _leftovers(tmp_path) == []


def _index_with(tmp_path, value) -> bytes:
  with ckpt.Checkpointer(tmp_path) as c:
    c.save(1, STATE)
  path = tmp_path / "checkpoint_1" / names.INDEX_NAME
  doc = sealed.unpackb(path.read_bytes(), raw=False)
  assert "custom_metadata" not in doc  # optional: absent when not given
  doc["custom_metadata"] = value
  return sealed.packb(doc, use_bin_type=True)


@pytest.mark.parametrize("value, words", [
    (123, "custom_metadata as JSON text"),
    ("[1, 2]", "custom_metadata as a JSON object"),
    ('{"a": NaN}', "not valid JSON"),
    ('{"a": 1e999}', "not valid JSON"),
    ('{"a": ', "not valid JSON"),
    ("[" * 100000 + "]" * 100000, "not valid JSON"),
    ('{"a": "' + "x" * (1 << 20) + '"}', "at most 1048576 bytes"),
])
def test_index_decode_validates_custom_metadata(tmp_path, value, words):
  with pytest.raises(CorruptCheckpointError) as e:
    index_lib.decode(_index_with(tmp_path, value), "the index")
  assert words in str(e.value), str(e.value)


def test_an_index_without_custom_metadata_decodes_as_before(tmp_path):
  ix = index_lib.decode(_index_with(tmp_path, None))
  assert ix.custom_metadata is None
  assert index_lib.custom_metadata_of(ix) == {}
  ok = index_lib.decode(_index_with(tmp_path / "b", '{"a": [1, 2.5]}'))
  assert index_lib.custom_metadata_of(ok) == {"a": [1, 2.5]}
  assert not math.isnan(index_lib.custom_metadata_of(ok)["a"][1])


# ---- save_on_steps / should_save_fn ----------------------------------------

def test_should_save_with_save_on_steps_and_should_save_fn(tmp_path):
  seen = []

  def fn(step, last):
    seen.append((step, last))
    return step == 7

  with ckpt.Checkpointer(tmp_path / "all", save_interval_steps=5,
                         save_on_steps=[3, 11], should_save_fn=fn) as c:
    saved = [s for s in range(13) if c.save(s, STATE)]
    assert saved == [0, 3, 5, 7, 10, 11]
    c.wait_until_finished()
    assert c.all_steps() == saved
  assert (1, 0) in seen and (8, 7) in seen and (12, 11) in seen
  # should_save_fn alone: Orbax's rule (no first-step rule); last_saved
  # starts at the directory's newest step.
  with ckpt.Checkpointer(tmp_path / "all",
                         should_save_fn=lambda s, last: s - last >= 4) as c:
    assert [s for s in range(11, 20) if c.should_save(s)] == [15, 16, 17, 18,
                                                             19]
    assert c.save(15, STATE) and not c.should_save(16)
    assert c.should_save(19)
  with ckpt.Checkpointer(tmp_path / "empty",
                         should_save_fn=lambda s, last: last is None) as c:
    assert c.should_save(4)  # nothing saved yet: last_saved None
  with ckpt.Checkpointer(tmp_path / "on", save_on_steps=(2,)) as c:
    assert [s for s in range(5) if c.save(s, STATE)] == [0, 2]


@pytest.mark.parametrize("kwargs, words", [
    ({"save_on_steps": [1, -2]}, "save_on_steps must be a collection"),
    ({"save_on_steps": 5}, "save_on_steps must be a collection"),
    ({"should_save_fn": 3}, "should_save_fn must be a callable"),
])
def test_bad_save_policy_arguments(tmp_path, kwargs, words):
  with pytest.raises(ValueError, match=words):
    ckpt.Checkpointer(tmp_path, **kwargs)


# ---- the same calls on MultiTierCheckpointer ------------------------------

def test_multitier_has_the_same_calls(tmp_path):
  import jax  # pylint: disable=g-import-not-at-top
  state = {"w": jax.numpy.arange(8.0), "n": 1}
  seen = []

  def fn(step, last):
    seen.append((step, last))
    return step == 5

  mt = ckpt.MultiTierCheckpointer(
      str(tmp_path / "p"), local=str(tmp_path / "l"), local_interval=1,
      persistent_interval=4, best_metric="loss", save_on_steps={3},
      should_save_fn=fn)
  try:
    assert mt.directory == epath.Path(tmp_path / "p")
    assert [s for s in range(7) if mt.should_save_persistent(s)] == [0, 3, 4,
                                                                     5]
    assert mt.should_save(1) and not mt.should_save_persistent(1)
    for s in range(7):
      assert mt.save(s, state, metrics={"loss": abs(s - 3.2)},
                     custom_metadata={"s": s})
      mt.check_for_errors()
    with pytest.raises(ckpt.InvalidStateError, match="finite"):
      mt.save(7, state, custom_metadata={"x": float("nan")})  # local only too
    mt.wait_until_finished(timeout=60)
    assert not mt.is_saving_in_progress()
    assert mt.persistent.all_steps() == [0, 3, 4, 5]
    assert mt.best_step() == 3
    assert mt.metadata(5).custom_metadata == {"s": 5}
    assert mt.cancel() is False
    assert (6, 5) in seen
  finally:
    mt.close()
