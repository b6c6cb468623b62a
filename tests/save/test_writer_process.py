"""writer="process" (issue 50, item 1): a writer process per host writes each
staged save from shared memory, and (one process) commits it even if the
trainer dies once save() returned.

Real parts throughout: the writer is a real process started by ckpt, the
trainer of the kill tests a real process (tests/save/writer_trainer.py)
killed with SIGKILL, the disk real, a full disk a real tmpfs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from unittest import mock

import jax
import ml_dtypes
import numpy as np
import psutil
import pytest

import ckpt
from ckpt.save import handover
from ckpt.save import writer_client
from tests.conftest import mesh, named, random_array, sharded
from tests.save import writer_trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def segments(pid: int | None = None) -> list[str]:
  """This process's (or ``pid``'s) shared-memory segments of ckpt."""
  pid = os.getpid() if pid is None else pid
  return [n for n in os.listdir(handover.SHM_DIR)
          if n.startswith(f"ckpt-{pid}-")]


def writers() -> list[psutil.Process]:
  return [p for p in psutil.Process().children()
          if "ckpt.save.writer_main" in " ".join(p.cmdline())]


def wait_gone(pid: int, timeout_s: float = 60) -> None:
  try:
    psutil.Process(pid).wait(timeout_s)
  except psutil.NoSuchProcess:
    pass


def committed(root) -> list[int]:
  return sorted(int(n.split("_")[1]) for n in os.listdir(root)
                if n.startswith("checkpoint_") and "." not in n)


def state(rng):
  m = mesh()
  return {
      "w": sharded(random_array(rng, (256, 128)), named(m, "data", "model")),
      "rep": sharded(random_array(rng, (64, 32)), named(m)),
      "bf": sharded(random_array(rng, (32, 64)).astype(ml_dtypes.bfloat16),
                    named(m, None, "model")),
      "host": random_array(rng, (40, 10)),
      "tiny": np.arange(3, dtype=np.int32),
      "n": 7,
  }


def same(got, want) -> None:
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(g), np.asarray(w)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("fmt", ["zarr", "zarr3"])
@pytest.mark.parametrize("async_save", [True, False])
def test_process_writer_saves_and_restores_bit_exact(make_ckptr, ckpt_dir, rng,
                                                     fmt, async_save):
  ckptr = make_ckptr(writer="process", format=fmt, async_save=async_save)
  s = state(rng)
  for step in (1, 2):
    assert ckptr.save(step, s, host_state={"seen": step})
    ckptr.wait_until_finished()
  assert ckptr.all_steps() == [1, 2]
  (w,) = writers()  # one writer per Checkpointer, kept across saves
  assert w.pid != os.getpid()
  assert ckptr.last_save_stats.bytes_written > 0
  same(ckptr.restore(2), s)
  same(ckpt.load(str(ckpt_dir), 2), s)
  assert ckptr.host_state(2) == {"seen": 2}
  assert segments() == []
  ckptr.close()
  wait_gone(w.pid, 60)
  assert not w.is_running()


def test_process_writer_keeps_the_budget_and_shm_is_freed(make_ckptr, rng):
  """A state four times the budget: staging waits for the writer's writes
  (the budget holds), and every segment is unlinked once written."""
  ckptr = make_ckptr(writer="process", concurrent_bytes=1 << 20,
                     chunk_bytes=256 << 10)
  s = {f"x{i}": random_array(rng, (256, 256)) for i in range(4)}  # 4 x 256 KiB
  ckptr.save(3, s)
  ckptr.wait_until_finished()
  stats = ckptr.last_save_stats
  assert 0 < stats.peak_bytes_in_flight <= 1 << 20
  assert stats.bytes_written == 4 * (256 << 10)
  same(ckptr.restore(3), s)
  assert segments() == []


def test_writer_process_option_is_checked(make_ckptr, memory_url):
  with pytest.raises(ValueError, match="writer must be 'thread' or 'process'"):
    make_ckptr(writer="fork")
  with pytest.raises(ValueError, match="memory:// lives inside one process"):
    make_ckptr(memory_url, writer="process")


def test_a_writer_error_reaches_the_trainer_as_the_thread_raises_it(
    make_ckptr, tmpfs, rng):
  """A full disk (a real tmpfs): the writer's failure comes back to the
  trainer's next wait with the class and message the thread gives, the
  attempt is removed, and no shared memory is left."""
  s = {"w": random_array(rng, (1024, 1024))}  # 4 MiB on a 2 MiB disk
  got = {}
  for writer in ("thread", "process"):
    root = tmpfs("2m")
    ckptr = make_ckptr(str(root), writer=writer)
    ckptr.save(1, s)
    with pytest.raises(ckpt.CheckpointError) as e:
      ckptr.wait_until_finished()
    got[writer] = e.value
    assert ckptr.all_steps() == []
    assert [n for n in os.listdir(root) if n.startswith("checkpoint_")] == []
    ckptr.check_for_errors()  # raised once
  assert type(got["process"]) is type(got["thread"])
  for e in got.values():
    assert str(e).startswith("saving step 1 failed on process 0: leaf 'w': "
                             "writing "), str(e)
    assert "No space left on device" in str(e) or "ENOSPC" in str(e), str(e)
  assert segments() == []


def test_cancel_stops_the_writer_and_removes_the_attempt(make_ckptr, ckpt_dir,
                                                         rng):
  ckptr = make_ckptr(writer="process", chunk_bytes=64 << 10)
  s = {"w": random_array(rng, (2048, 1024))}  # 8 MiB in 128 chunk files
  ckptr.save(1, s)
  cancelled = ckptr.cancel()
  ckptr.wait_until_finished()  # a cancelled save raises nothing
  if cancelled:
    assert ckptr.all_steps() == []
    assert os.listdir(ckpt_dir) == [] or not [
        n for n in os.listdir(ckpt_dir) if n.startswith("checkpoint_1")]
  else:  # committed before the cancel reached it
    assert ckptr.all_steps() == [1]
  assert segments() == []
  assert ckptr.save(2, s)  # the writer goes on with the next save
  ckptr.wait_until_finished()
  same(ckptr.restore(2), s)


def test_a_killed_writer_fails_the_save_and_the_next_one_commits(
    make_ckptr, ckpt_dir, rng):
  """SIGKILL of the writer: the save fails on the trainer's next wait,
  naming the writer; nothing of it is committed, the attempt is removed,
  no segment is left; the next save starts a new writer and commits."""
  ckptr = make_ckptr(writer="process", chunk_bytes=64 << 10)
  s = {"w": random_array(rng, (2048, 1024))}
  ckptr.save(1, {"w": s["w"][:8]})
  ckptr.wait_until_finished()
  (w,) = writers()
  # The save below cannot end before the kill: the writer is stopped as
  # soon as it says it holds the lease (save() returns only after that),
  # by the thread that reads its replies, before it reads a box.
  begin = writer_client.WriterProcess.begin

  def stop_when_held(self, on_message):
    def on(m):
      if m is not None and m["kind"] == "held":
        w.suspend()
      on_message(m)
    return begin(self, on)

  with mock.patch.object(writer_client.WriterProcess, "begin", stop_when_held):
    ckptr.save(2, s)
  w.kill()
  with pytest.raises(ckpt.CheckpointError,
                     match=r"^the writer process \(pid \d+\) of this host "
                     r"ended \(killed by SIGKILL\) while writing step 2; "
                     r"the save failed$"):
    ckptr.wait_until_finished()
  assert ckptr.all_steps() == [1]
  assert segments() == []
  assert ckptr.save(3, s)
  ckptr.wait_until_finished()
  assert ckptr.all_steps() == [1, 3]
  assert [n for n in os.listdir(ckpt_dir) if ".tmp-" in n] == []
  same(ckptr.restore(3), s)


def run_trainer(root, step: int, mib: int) -> tuple[subprocess.Popen, dict]:
  proc = subprocess.Popen(
      [sys.executable, "-m", "tests.save.writer_trainer", str(root),
       str(step), str(mib)], cwd=REPO, stdout=subprocess.PIPE, text=True)
  line = proc.stdout.readline()
  if not line:
    proc.wait(60)
    pytest.fail(f"the trainer ended first (exit {proc.returncode})")
  return proc, json.loads(line)


def test_a_save_outlives_its_trainer(ckpt_dir):
  """The trainer is SIGKILLed once save() returned, its writer stopped
  meanwhile (nothing committed at the kill); let go, the writer finishes
  the save, commits it and exits; it restores bit-exact; no segment is
  left."""
  trainer, got = run_trainer(ckpt_dir, 5, 64)
  (pid,) = got["writers"]
  trainer.kill()
  trainer.wait(60)
  assert committed(ckpt_dir) == []  # not yet: the writer was stopped
  os.kill(pid, signal.SIGCONT)
  wait_gone(pid, 120)
  assert committed(ckpt_dir) == [5]
  restored = ckpt.load(str(ckpt_dir), 5)
  want = writer_trainer.state(5, 64)
  for k in want:
    assert np.asarray(restored[k]).tobytes() == np.asarray(want[k]).tobytes()
  assert segments(trainer.pid) == []


def test_trainer_and_writer_killed_commit_nothing_and_are_cleaned(
    make_ckptr, ckpt_dir, rng):
  """Trainer and writer of the host both SIGKILLed: no commit; the next
  job's save removes the attempt, its writer the segments left behind."""
  trainer, got = run_trainer(ckpt_dir, 5, 16)
  (pid,) = got["writers"]
  os.kill(pid, signal.SIGKILL)
  trainer.kill()
  trainer.wait(60)
  wait_gone(pid, 60)
  assert committed(ckpt_dir) == []
  ckptr = make_ckptr(writer="process", lease_s=1)
  s = {"w": random_array(rng, (64, 64))}
  deadline = time.monotonic() + 60
  step = 6
  ckptr.save(step, s)
  ckptr.wait_until_finished()
  assert segments(trainer.pid) == []  # swept by the new writer at its start
  while [n for n in os.listdir(ckpt_dir) if ".tmp-" in n]:
    # the dead job's attempt goes at a later save once its lease expired
    assert time.monotonic() < deadline, os.listdir(ckpt_dir)
    time.sleep(1.1)
    step += 1
    ckptr.save(step, s)
    ckptr.wait_until_finished()
  assert 5 not in ckptr.all_steps()


@pytest.mark.parametrize("policy", [
    {"keep": 2},
    {"keep": 1, "keep_period": 2},
    {"keep": 2, "best_metric": "loss", "best_mode": "min"}],
    ids=["keep", "keep_period", "best_metric"])
def test_retention_after_the_writers_commit_is_the_threads(
    make_ckptr, tmp_path, rng, policy):
  """While the trainer lives, its Checkpointer applies the policy after
  each step the writers commit, as after the thread's commits."""
  s = {"w": random_array(rng, (32, 32)), "n": 1}
  loss = {1: 0.5, 2: 0.1, 3: 0.9, 4: 0.7, 5: 0.8}
  got = {}
  for writer in ("thread", "process"):
    ckptr = make_ckptr(tmp_path / writer, writer=writer, **policy)
    for step in range(1, 6):
      ckptr.save(step, s, metrics={"loss": loss[step]})
      ckptr.wait_until_finished()
    got[writer] = ckptr.all_steps()
    assert committed(tmp_path / writer) == got[writer]
  assert got["process"] == got["thread"] and len(got["thread"]) < 5, got


def test_rebuild_keeps_the_class_and_message():
  for e in (ckpt.CheckpointError("a"), OSError("b"), ValueError("c"),
            ckpt.errors.StoreTimeoutError("d")):
    got = handover.rebuild(handover.error_message(e))
    assert type(got) is type(e) and str(got) == str(e)
  got = handover.rebuild({"type": "Unknown", "message": "m"})
  assert type(got) is ckpt.CheckpointError and str(got) == "Unknown: m"
