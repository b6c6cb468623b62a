"""A background save that stays out of the training job's way
(ckpt/save/polite.py): its threads run at a lower priority, and an async save's
files leave the page cache once written.

Priorities are read back from the kernel (getpriority on each thread id);
the page cache from ``fincore`` (util-linux: mincore on each file).
"""

import os
import shutil
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

import ckpt
from ckpt.save import polite
from tests.conftest import named, random_array, sharded

linux_only = pytest.mark.skipif(not os.path.isdir("/proc/self/task"),
                                reason="per-thread priorities: Linux")


def _ts_threads() -> list[int]:
  out = []
  for t in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{t}/comm") as f:
        if f.read().strip() == "ts_pool_worker":
          out.append(int(t))
    except OSError:
      pass
  return out


def _nice(tid: int) -> int:
  return os.getpriority(os.PRIO_PROCESS, tid)


def _state(rng, mesh8):
  return {"w": sharded(random_array(rng, (512, 1024)),
                       named(mesh8, "data", "model")),
          "b": random_array(rng, (300,))}


@linux_only
def test_async_save_lowers_its_threads_priority(make_ckptr, rng, mesh8):
  main_nice = _nice(threading.get_native_id())
  c = make_ckptr(async_save=True)
  c.save(1, _state(rng, mesh8))
  c.wait_until_finished()
  assert _nice(c._loop.native_id) >= polite.BACKGROUND_NICE  # pylint: disable=protected-access
  ts = _ts_threads()
  assert ts, "no TensorStore worker thread found"
  assert all(_nice(t) >= polite.BACKGROUND_NICE for t in ts), [
      (t, _nice(t)) for t in ts]
  # The caller's own thread (the training loop) keeps its priority.
  assert _nice(threading.get_native_id()) == main_nice


@linux_only
@pytest.mark.parametrize("start, expected", [(3, 8), (12, 17), (16, 19)])
def test_a_thread_goes_below_the_one_that_started_it(monkeypatch, start,
                                                    expected):
  """BACKGROUND_NICE below the nice value it was started with, at most 19:
  never raised, and below a thread that was niced already."""
  monkeypatch.setattr(polite, "BACKGROUND_NICE", 5)
  seen = {}

  def body():
    tid = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, tid, start)
    polite.lower_this_thread()
    seen["after"] = _nice(tid)

  t = threading.Thread(target=body)
  t.start()
  t.join()
  assert seen["after"] == expected


_NICED_JOB = """
import os, sys, threading
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.nice(6)  # the whole job, as `nice -n 6 python train.py`
import numpy as np
import ckpt
from ckpt.save import polite

with ckpt.Checkpointer(sys.argv[1], async_save=True) as c:
  c.save(1, {"w": np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)})
  c.wait_until_finished()
  loop = os.getpriority(os.PRIO_PROCESS, c._loop.native_id)
ts = []
for t in os.listdir("/proc/self/task"):
  with open(f"/proc/self/task/{t}/comm") as f:
    if f.read().strip() == "ts_pool_worker":
      ts.append(os.getpriority(os.PRIO_PROCESS, int(t)))
print(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), loop,
      min(ts), polite.BACKGROUND_NICE)
"""


@linux_only
def test_a_job_niced_as_a_whole_saves_below_its_training(tmp_path):
  out = subprocess.run([sys.executable, "-c", _NICED_JOB, str(tmp_path)],
                       capture_output=True, text=True, timeout=120,
                       check=True).stdout.split()
  main, loop, ts, step = map(int, out)
  assert main == 6
  assert loop == ts == min(19, 6 + step), out


def _fs_type(path) -> str:
  return subprocess.run(["stat", "-f", "-c", "%T", str(path)],
                        capture_output=True, text=True, check=True).stdout.strip()


def _resident_bytes(step_dir: str) -> int:
  """Bytes in the page cache of the step's array data files (not the index,
  the commit files or the checksum file, written after the data)."""
  files = [os.path.join(d, f) for d, _, fs in os.walk(step_dir) for f in fs
           if os.path.relpath(d, step_dir) != "."
           and not os.path.relpath(d, step_dir).startswith(".")]
  assert files, f"no data files under {step_dir}"
  out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw",
                        "--output", "RES", *files],
                       capture_output=True, text=True, check=True).stdout
  return sum(int(x) for x in out.split())


needs_fincore = pytest.mark.skipif(shutil.which("fincore") is None,
                                   reason="needs fincore (util-linux)")


@needs_fincore
def test_async_save_drops_its_pages_sync_save_keeps_them(tmp_path, rng, mesh8):
  if _fs_type(tmp_path) in ("tmpfs", "ramfs"):
    pytest.skip("a tmpfs file's pages are its data")
  state = _state(rng, mesh8)
  with ckpt.Checkpointer(tmp_path / "sync", async_save=False) as c:
    c.save(1, state)
  with ckpt.Checkpointer(tmp_path / "async", async_save=True) as c:
    c.save(1, state)
    c.wait_until_finished()
  # The measurement can see pages: the sync save's are still cached.
  assert _resident_bytes(str(tmp_path / "sync" / "checkpoint_1")) > 0
  assert _resident_bytes(str(tmp_path / "async" / "checkpoint_1")) == 0
  with ckpt.Checkpointer(tmp_path / "async") as c:  # still restores
    out = c.restore(1, target=jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                       sharding=getattr(x, "sharding", None)),
        state))
  np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(state["w"]))
  np.testing.assert_array_equal(out["b"], state["b"])


@needs_fincore
def test_pages_stay_when_turned_off(tmp_path, rng, mesh8, monkeypatch):
  if _fs_type(tmp_path) in ("tmpfs", "ramfs"):
    pytest.skip("a tmpfs file's pages are its data")
  monkeypatch.setattr(polite, "DROP_WRITTEN_PAGES", False)
  with ckpt.Checkpointer(tmp_path / "async", async_save=True) as c:
    c.save(1, _state(rng, mesh8))
    c.wait_until_finished()
  assert _resident_bytes(str(tmp_path / "async" / "checkpoint_1")) > 0

