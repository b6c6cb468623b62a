"""close() racing save() on another thread (ckpt/face/loop.py).

A save held at a known point (inside a save transform, before anything is
written) while another thread calls close(): close waits for that save,
which commits; a save that starts once close has begun is refused, before
anything is written; close() called inside a save on its own thread is
refused. Each time: one clear outcome, and no ``*.tmp-*`` attempt left in
the directory. Before, the held save found its loop stopped once released:
it raised RuntimeError("Event loop is closed") and left its attempt.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import ckpt

STATE = {"w": np.arange(4096, dtype=np.float32), "n": 3}
LIMIT_S = 30.0  # every wait of these tests is bounded by this


def attempts_left(root) -> list[str]:
  return sorted(n for n in os.listdir(root) if ".tmp-" in n)


def in_thread(fn, *args, **kwargs):
  out = {}

  def run():
    try:
      out["value"] = fn(*args, **kwargs)
    except BaseException as e:  # pylint: disable=broad-except
      out["error"] = e
  t = threading.Thread(target=run, daemon=True)
  t.start()
  return t, out


@pytest.mark.parametrize("async_save", [True, False])
def test_close_waits_for_a_save_that_entered_first(tmp_path, async_save):
  ckptr = ckpt.Checkpointer(tmp_path, async_save=async_save)
  inside, release = threading.Event(), threading.Event()

  def hold(tree):
    inside.set()
    assert release.wait(LIMIT_S), "never released"
    return tree
  saver, saved = in_thread(ckptr.save, 1, STATE, transforms=[hold])
  assert inside.wait(LIMIT_S)
  closer, closed = in_thread(ckptr.close)
  # Time for a close that does not wait for the save to finish first (the
  # outcome below is the same whether close began within it or not).
  closer.join(0.5)
  release.set()
  saver.join(LIMIT_S)
  closer.join(LIMIT_S)
  assert not saver.is_alive() and not closer.is_alive(), "a call hung"
  assert "error" not in saved, repr(saved.get("error"))
  assert saved["value"] is True
  assert "error" not in closed, repr(closed.get("error"))
  assert attempts_left(tmp_path) == []
  with ckpt.Checkpointer(tmp_path) as reader:
    assert reader.all_steps() == [1]
    np.testing.assert_array_equal(reader.restore(1)["w"], STATE["w"])
  with pytest.raises(ckpt.CheckpointError, match="closed"):
    ckptr.save(2, STATE)  # closed now


def test_a_save_that_enters_once_close_began_is_refused(tmp_path):
  """A save in flight holds close(); a second thread's save that arrives
  then is refused at once, naming close, and writes nothing."""
  ckptr = ckpt.Checkpointer(tmp_path)
  inside, release = threading.Event(), threading.Event()

  def hold(tree):
    inside.set()
    assert release.wait(LIMIT_S), "never released"
    return tree
  saver, saved = in_thread(ckptr.save, 1, STATE, transforms=[hold])
  assert inside.wait(LIMIT_S)
  closer, closed = in_thread(ckptr.close)
  closer.join(0.5)
  assert closer.is_alive()  # waiting for save(1)
  late, refused = in_thread(ckptr.save, 2, STATE)
  late.join(LIMIT_S)
  error = refused.get("error")
  assert isinstance(error, ckpt.CheckpointError), repr(error)
  assert "save(2) refused: this Checkpointer is closed, or being closed by " \
      "close() on another thread; nothing was written" in str(error), error
  release.set()
  saver.join(LIMIT_S)
  closer.join(LIMIT_S)
  assert saved.get("value") is True, saved
  assert "error" not in closed, closed
  assert attempts_left(tmp_path) == []
  with ckpt.Checkpointer(tmp_path) as reader:
    assert reader.all_steps() == [1]


def test_close_inside_a_save_on_its_own_thread_is_refused(tmp_path):
  ckptr = ckpt.Checkpointer(tmp_path)

  def close_now(tree):
    ckptr.close()
    return tree
  with pytest.raises(ckpt.CheckpointError,
                     match=r"close\(\) was called inside save\(\)"):
    ckptr.save(1, STATE, transforms=[close_now])
  assert attempts_left(tmp_path) == []
  assert ckptr.save(1, STATE)  # still open
  ckptr.close()
  assert attempts_left(tmp_path) == []
  with ckpt.Checkpointer(tmp_path) as reader:
    assert reader.all_steps() == [1]
