"""Every file and directory of a committed step made durable once, before
the commit rename (ckpt/save/durable.py): TensorStore's file driver writes
with its sync off, and the save fsyncs what it wrote itself."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import ckpt
from ckpt.save import durable
from ckpt.save import rawwrite
from tests.conftest import named, random_array, record_fsync_and_rename, sharded


def _state(rng, mesh8):
  return {
      # arrays (not packed): 4 boxes over "model", one writer each
      "w": sharded(random_array(rng, (512, 256)), named(mesh8, "model", None)),
      # split two ways: 8 boxes
      "m": sharded(random_array(rng, (256, 512)), named(mesh8, "data", "model")),
      "host": random_array(rng, (40, 3)),  # a host numpy leaf
      "small": {"b": random_array(rng, (5,)), "c": np.int32(7)},  # packed
  }


def _entries(root: str) -> tuple[set[str], set[str]]:
  files, dirs = set(), set()
  for dirpath, _, names in os.walk(root):
    dirs.add(dirpath)
    files.update(os.path.join(dirpath, n) for n in names)
  return files, dirs


@pytest.mark.parametrize("fmt", ["zarr", "zarr3"])
@pytest.mark.parametrize("async_save", [False, True])
def test_each_file_and_directory_synced_once_before_the_rename(
    make_ckptr, ckpt_dir, rng, mesh8, monkeypatch, fmt, async_save):
  c = make_ckptr(format=fmt, async_save=async_save)
  c.save(1, _state(rng, mesh8))  # the root exists; step 2 is the one looked at
  c.wait_until_finished()
  calls = record_fsync_and_rename(monkeypatch)
  state = _state(rng, mesh8)
  c.save(2, state)
  c.wait_until_finished()
  monkeypatch.undo()
  root = os.path.realpath(ckpt_dir)
  final = os.path.join(root, "checkpoint_2")
  [commit] = [i for i, x in enumerate(calls)
              if x[0] == "rename" and x[2] == final]
  work = calls[commit][1]
  synced = [x[1] for x in calls[:commit] if x[0] == "fsync"]
  files, dirs = _entries(final)
  want = {os.path.normpath(os.path.join(work, os.path.relpath(p, final)))
          for p in files | dirs}
  # Files written "<name>.partial-<id>", fsynced, then renamed, by ckpt.
  got = [p.split(".partial-")[0] for p in synced]
  missing = want - set(got)
  assert not missing, sorted(missing)
  # The lease (attempt.json) is rewritten at each renewal: each version once.
  twice = sorted({p for p in got if got.count(p) > 1
                  and os.path.basename(p) != "attempt.json"})
  assert not twice, twice
  assert root in [x[1] for x in calls[commit + 1:] if x[0] == "fsync"]
  chunks = [p for p in files if os.path.basename(os.path.dirname(p)) == "w"
            and not os.path.basename(p).startswith((".z", "zarr"))]
  if fmt == "zarr":  # zarr3's chunks are in c/ below
    assert len(chunks) >= 4, files
  got_back = c.restore(2)
  for k in ("w", "m", "host"):
    np.testing.assert_array_equal(np.asarray(got_back[k]), np.asarray(state[k]))


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_SAVE = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import ckpt
    from ckpt.save import durable, pack
    pack.MAX_LEAF_BYTES = 0
    durable.DEFER_SYNC = sys.argv[2] == "1"
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("x",))
    rng = np.random.default_rng(0)
    state = {f"a{i}": jax.device_put(rng.standard_normal((64, 32), np.float32),
                                     NamedSharding(mesh, P("x")))
             for i in range(6)}
    with ckpt.Checkpointer(sys.argv[1], async_save=False) as c:
      c.save(1, state)
      c.save(2, state)
""")


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_fsyncs_of_a_save_are_one_per_file_and_directory(tmp_path):
  """strace counts every fsync of the process, TensorStore's included: a
  save makes each of its files and directories durable once (the driver's
  own sync was about two per chunk file)."""
  counts = {}
  for defer in ("1", "0"):
    root = tmp_path / f"root{defer}"
    script = tmp_path / "save.py"
    script.write_text(_SAVE)
    out = tmp_path / f"strace{defer}.txt"
    subprocess.run(
        ["strace", "-f", "-qq", "-e", "trace=fsync,fdatasync", "-o", str(out),
         sys.executable, str(script), str(root), defer],
        check=True, timeout=300, cwd=_REPO,
        env={**os.environ, "PYTHONPATH": _REPO})
    counts[defer] = sum(("fsync(" in line or "fdatasync(" in line)
                        for line in out.read_text().splitlines())
    files, dirs = _entries(str(root / "checkpoint_2"))
  # 6 arrays of 8 chunk files: 54 files and 7 directories a step, two steps,
  # plus the root's fsyncs and the lease writes.
  per_step = len(files) + len(dirs)
  assert len(files) >= 6 * 9, files
  assert counts["1"] <= 2 * per_step + 12, counts
  assert counts["0"] >= counts["1"] + 2 * 6 * 8, counts


def test_ocdbt_and_object_stores_keep_the_driver_sync():
  kv = {"driver": "file", "path": "/x/"}
  assert durable.deferred("zarr", kv)["file_io_sync"] is False
  assert durable.deferred("zarr3", kv)["file_io_sync"] is False
  assert "file_io_sync" not in durable.deferred("ocdbt", kv)
  s3 = {"driver": "s3", "bucket": "b", "path": "x/"}
  assert durable.deferred("zarr", s3) == s3
  user = {**kv, "file_io_sync": True}
  assert durable.deferred("zarr", user)["file_io_sync"] is True


def _data_files(root: str) -> set[str]:
  """Files under the array folders of every attempt of ``root`` (what
  TensorStore writes: chunks, temporary files, metadata)."""
  out = set()
  for d, _, fs in os.walk(root):
    parts = os.path.relpath(d, root).split(os.sep)
    if len(parts) >= 2 and parts[1].startswith("leaf"):
      out.update(os.path.join(d, f) for f in fs
                 if f not in (".zarray", "zarr.json"))
  return out


@pytest.mark.parametrize("async_save", [True, False])
@pytest.mark.parametrize("window_boxes, bounded", [(2, True), (64, False)])
def test_unsynced_bytes_stay_within_the_window(
    tmp_path, rng, monkeypatch, window_boxes, bounded, async_save):
  """At every fsync of a save, the files written and not yet synced fit in
  durable.WINDOW_BYTES (with a window of 64 boxes, the writes run ahead of
  their fsyncs: the count can fail)."""
  box = 256 * 1024 * 4  # one (256, 1024) float32 leaf: one chunk file
  monkeypatch.setattr(durable, "WINDOW_BYTES", window_boxes * box)
  synced: set[str] = set()
  most = [0]
  lock = threading.Lock()
  real = durable._fsync  # pylint: disable=protected-access

  def counting(path, drop=False):
    with lock:
      unsynced = _data_files(str(tmp_path)) - synced
      most[0] = max(most[0], len(unsynced))
    try:
      return real(path, drop)
    finally:
      with lock:
        synced.add(path)

  monkeypatch.setattr(durable, "_fsync", counting)
  real_sync = rawwrite.sync  # raw chunk files: fsynced where written

  def counting_raw(fd):
    path = os.readlink(f"/proc/self/fd/{fd}")
    with lock:
      unsynced = _data_files(str(tmp_path)) - synced
      most[0] = max(most[0], len(unsynced))
    try:
      return real_sync(fd)
    finally:
      with lock:
        synced.add(path)

  monkeypatch.setattr(rawwrite, "sync", counting_raw)
  state = {f"leaf{i}": random_array(rng, (256, 1024)) for i in range(24)}
  with ckpt.Checkpointer(tmp_path, async_save=async_save) as c:
    c.save(1, state)
    c.wait_until_finished()
    out = c.restore(1)
  for k, v in state.items():
    np.testing.assert_array_equal(out[k], v)
  if bounded:  # those in the window, and one being written as one ends
    assert 0 < most[0] <= window_boxes + 1, most[0]
  else:  # the measurement sees writes that run ahead of their fsyncs
    assert most[0] > 3, most[0]
