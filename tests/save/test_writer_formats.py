"""writer="process" covers what the thread writer covers (issue 50, item 1):
small leaves packed exactly as the thread packs them, format "ocdbt", and
the options that cannot work across processes refused with the reason.

Real parts: the writer is a real process started by ckpt, the disk real;
a step saved by each writer is compared file by file.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import ml_dtypes
import msgpack
import numpy as np
import pytest

import ckpt
from ckpt.commit.attempt import ATTEMPT_FILE
from ckpt.format import index as index_lib
from ckpt.format import seal
from ckpt.format import pack_index
from tests.conftest import mesh, named, random_array, sharded


def small_and_large(rng):
  """Small leaves (packed: host and sharded, several dtypes, a few packs
  with a 24 KiB budget) beside large arrays."""
  m = mesh()
  out = {
      "w": sharded(random_array(rng, (256, 128)), named(m, "data", "model")),
      "bf": sharded(random_array(rng, (32, 64)).astype(ml_dtypes.bfloat16),
                    named(m, None, "model")),
      "rep": sharded(random_array(rng, (64, 32)), named(m)),
      "host": random_array(rng, (40, 10)),
      "n": 7,
  }
  for i in range(40):
    out[f"s{i:02d}"] = random_array(rng, (5 + i, 17),
                                    (np.float32, np.int32, np.float16)[i % 3])
  return out


def step_files(root, step: int) -> dict[str, bytes]:
  """Every file of the committed step: relative path -> bytes."""
  base = os.path.join(root, f"checkpoint_{step}")
  out = {}
  for d, _, names in os.walk(base):
    for n in names:
      path = os.path.join(d, n)
      with open(path, "rb") as f:
        out[os.path.relpath(path, base)] = f.read()
  return out


def same(got, want) -> None:
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(g), np.asarray(w)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("fmt,options", [
    ("zarr", {}), ("zarr3", {}),
    ("zarr", {"save_dtype": "bfloat16", "compression": "zstd"}),
    ("zarr3", {"chunk_checksums": True, "compression": "zstd"})])
def test_process_writer_packs_small_leaves_as_the_thread_does(
    make_ckptr, tmp_path, rng, fmt, options):
  """The same state saved by the thread and by the writer process (with
  the options that change what is stored): the same files, each pack,
  pack table and chunk byte for byte the same, the same index but for its
  save time; the writer's own records aside."""
  s = small_and_large(rng)
  files, restored = {}, {}
  for writer in ("thread", "process"):
    root = tmp_path / writer
    ckptr = make_ckptr(str(root), writer=writer, format=fmt,
                       concurrent_bytes=24 << 10, chunk_bytes=16 << 10,
                       **options)
    ckptr.save(3, s, host_state={"h": 1})
    ckptr.wait_until_finished()
    restored[writer] = ckptr.restore(3)
    if not options:
      same(restored[writer], s)
    files[writer] = step_files(root, 3)
    ckptr.close()
  same(restored["process"], restored["thread"])
  thread, process = files["thread"], files["process"]
  writers = {k for k in process if k.startswith(index_lib.WRITERS_DIR + "/")}
  assert writers == {f"{index_lib.WRITERS_DIR}/0.msgpack"}
  assert set(thread) == set(process) - writers
  packs = sorted(k for k in thread if k.startswith(pack_index.PACK_DIR + "/"))
  assert len([k for k in packs if k.endswith(".bin")]) >= 3, packs
  assert pack_index.table_name(0) in packs
  for k in sorted(thread):
    if k == "index.msgpack":
      a, b = (index_lib.decode(f[k]) for f in (thread, process))
      assert index_lib.encode(dataclasses.replace(a, time=0)) == (
          index_lib.encode(dataclasses.replace(b, time=0)))
      assert sum(isinstance(e, pack_index.PackedEntry) for e in b.leaves) >= 40
    elif k in (ATTEMPT_FILE, "commit_success"):  # the attempt's: its token,
      a, b = (json.loads(f[k]) for f in (thread, process))  # lease, holder
      assert a.keys() == b.keys(), k
      assert a.get("step") == b.get("step") and a.get("dir") == b.get("dir")
    elif k.startswith(index_lib.CHECKSUMS_DIR + "/"):  # rows as writes ended
      a, b = (msgpack.unpackb(seal.unseal(f[k], k), raw=False)
              for f in (thread, process))
      assert a["process"] == b["process"] and sorted(a["boxes"]) == sorted(
          b["boxes"]), k
    else:
      assert thread[k] == process[k], k


def test_process_writer_writes_ocdbt(make_ckptr, ckpt_dir, rng):
  """format="ocdbt": the writer writes this process's database and merges
  it into the step's before the index; restores bit for bit, also onto
  another mesh; packs as the thread does."""
  s = small_and_large(rng)
  ckptr = make_ckptr(writer="process", format="ocdbt", chunk_bytes=16 << 10)
  for step in (1, 2):
    assert ckptr.save(step, s)
    ckptr.wait_until_finished()
  assert ckptr.all_steps() == [1, 2]
  names = os.listdir(ckpt_dir / "checkpoint_2")
  assert "manifest.ocdbt" in names and "ocdbt.process_0" in names, names
  same(ckptr.restore(2), s)
  same(ckpt.load(str(ckpt_dir), 2), s)
  other = mesh((4, 2))
  target = jax.tree.map(lambda x: x, s)
  target["w"] = jax.ShapeDtypeStruct((256, 128), np.float32,
                                     sharding=named(other, "model", "data"))
  got = ckptr.restore(2, target=target)
  assert got["w"].sharding == target["w"].sharding
  same(got, s)


def ocdbt_files(files: dict[str, bytes]) -> dict[str, list[int]]:
  """The step's OCDBT files (the databases' data files and B+tree nodes,
  the manifests): directory -> sorted sizes (data files are named by
  TensorStore at random)."""
  out: dict[str, list[int]] = {}
  for k, v in files.items():
    if k.startswith(("ocdbt.", "manifest.ocdbt", "d/")):
      out.setdefault(os.path.dirname(k), []).append(len(v))
  return {d: sorted(sizes) for d, sizes in sorted(out.items())}


def test_process_writer_commits_ocdbt_in_the_threads_batches(make_ckptr,
                                                            tmp_path, rng):
  """format="ocdbt", 64 arrays of 4 boxes each under a budget of 16 boxes:
  the writer process commits the boxes in the batches the thread commits
  (one atomic OCDBT transaction per budget's worth of boxes, not one per
  box), so the step has the database files of a thread save: as many in
  each directory (16 data files for the 16 batches and one for the
  arrays' metadata), each batch's of the same size but for a few bytes of
  its B+tree nodes; restores bit for bit."""
  m = mesh((4,), ("x",), jax.devices()[:4])
  s = {f"a{i:02d}": sharded(random_array(rng, (128, 256)), named(m, "x"))
       for i in range(64)}  # 128 KiB each (not packed), 32 KiB per box
  files = {}
  for writer in ("thread", "process"):
    root = tmp_path / writer
    ckptr = make_ckptr(str(root), writer=writer, format="ocdbt",
                       concurrent_bytes=512 << 10, chunk_bytes=32 << 10)
    ckptr.save(1, s)
    ckptr.wait_until_finished()
    same(ckptr.restore(1), s)
    files[writer] = ocdbt_files(step_files(root, 1))
    ckptr.close()
  thread, process = files["thread"], files["process"]
  assert {d: len(v) for d, v in thread.items()} == {
      d: len(v) for d, v in process.items()}, files
  assert len(thread["ocdbt.process_0/d"]) == 256 // 16 + 1, thread
  # The batches' data files: the boxes' bytes (512 KiB each) beside their keys
  # and B+tree nodes, whose encoding varies by a few bytes with the order
  # the writes reached the transaction.
  data = {w: sorted(f["ocdbt.process_0/d"])[-16:] for w, f in files.items()}
  for a, b in zip(data["thread"], data["process"]):
    assert abs(a - b) <= 256, data


def test_writer_process_refuses_what_cannot_cross_processes(make_ckptr,
                                                           memory_url):
  with pytest.raises(ValueError, match="memory:// lives inside one process"):
    make_ckptr(memory_url, writer="process")
  with pytest.raises(ValueError, match="memory:// lives inside one process"):
    make_ckptr(memory_url, writer="process", reuse_unchanged=True)


CHUNK = 64 << 10


def chunk_files(step_dir, leaf: str) -> dict[str, os.stat_result]:
  base = step_dir / leaf
  return {str(p.relative_to(base)): p.stat() for p in base.rglob("*")
          if p.is_file() and not p.name.startswith((".z", "zarr.json"))}


def reuse_state(step: int, frozen: np.ndarray) -> dict:
  m = mesh((4,), ("x",))
  train = np.random.default_rng(step).standard_normal((256, 256),
                                                       dtype=np.float32)
  return {"frozen": sharded(frozen, named(m, "x")),
          "train": sharded(train, named(m, "x")), "small": np.arange(7.0)}


@pytest.mark.parametrize("fmt", ["zarr", "zarr3"])
def test_process_writer_links_unchanged_chunks_as_the_thread_does(
    make_ckptr, tmp_path, fmt):
  """reuse_unchanged=True: the writer process links the same chunks as the
  thread (the same bytes written and reused per step); a linked-from
  chunk file rewritten behind ckpt's back (its stat changed) is found not
  what was stored and written again, not linked; a new writer (a new
  Checkpointer) links from the steps' records."""
  frozen = np.random.default_rng(99).standard_normal((512, 256),
                                                      dtype=np.float32)
  got = {}
  for writer in ("thread", "process"):
    root = tmp_path / writer
    ckptr = make_ckptr(str(root), writer=writer, format=fmt,
                       reuse_unchanged=True, chunk_bytes=CHUNK)
    stats = []
    for step in range(3):
      ckptr.save(step, reuse_state(step, frozen))
      ckptr.wait_until_finished()
      stats.append(ckptr.last_save_stats)
    got[writer] = [(s.bytes_written, s.bytes_reused, s.chunks_reused)
                   for s in stats]
    # Step 2 linked step 0's frozen chunks (step 1 is the second copy).
    zero = chunk_files(root / "checkpoint_0", "frozen")
    two = chunk_files(root / "checkpoint_2", "frozen")
    assert len(two) == frozen.nbytes // CHUNK
    assert all(st.st_ino == zero[n].st_ino for n, st in two.items()), writer
    # A chunk of step 1 rewritten in place (another mtime): step 3 does
    # not link it (its stat differs, its bytes are read again and differ).
    name = sorted(chunk_files(root / "checkpoint_1", "frozen"))[0]
    path = root / "checkpoint_1" / "frozen" / name
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    with open(path, "r+b") as f:
      f.write(data)
    ckptr.save(3, reuse_state(3, frozen))
    ckptr.wait_until_finished()
    three = chunk_files(root / "checkpoint_3", "frozen")
    one = chunk_files(root / "checkpoint_1", "frozen")
    assert three[name].st_ino != one[name].st_ino, writer
    assert all(st.st_ino == one[n].st_ino for n, st in three.items()
               if n != name), writer
    s = ckptr.last_save_stats
    got[writer].append((s.bytes_written, s.bytes_reused, s.chunks_reused))
    for step in (2, 3):
      same(ckptr.restore(step), reuse_state(step, frozen))
    ckptr.close()
    # A new Checkpointer (a new writer): step 4 links from step 2's
    # records (keep two copies: the step before the newest).
    ckptr = make_ckptr(str(root), writer=writer, format=fmt,
                       reuse_unchanged=True, chunk_bytes=CHUNK)
    ckptr.save(4, reuse_state(4, frozen))
    ckptr.wait_until_finished()
    s = ckptr.last_save_stats
    got[writer].append((s.bytes_written, s.bytes_reused, s.chunks_reused))
    same(ckptr.restore(4), reuse_state(4, frozen))
    ckptr.close()
  assert got["process"] == got["thread"], got
  assert got["thread"][2][1] == frozen.nbytes  # step 2: the frozen leaf
  assert got["thread"][3][1] == frozen.nbytes - CHUNK  # but the damaged one
  assert got["thread"][4][1] > 0


def test_progress_counts_the_bytes_the_writer_wrote(make_ckptr, rng):
  """progress= (and last_save_stats.bytes_written, which it reports) grows
  as the writer process writes, as with the thread: a state four times the
  budget cannot be staged before the writer freed three quarters of it, so
  those bytes are counted once save() returned."""
  ckptr = make_ckptr(writer="process", concurrent_bytes=1 << 20,
                     chunk_bytes=256 << 10)
  s = {f"x{i}": random_array(rng, (256, 1024)) for i in range(4)}  # 4 MiB
  seen = []
  ckptr.save(1, s, progress=lambda done, total: seen.append((done, total)))
  assert ckptr.last_save_stats.bytes_written >= 3 << 20
  ckptr.wait_until_finished()
  assert ckptr.last_save_stats.bytes_written == 4 << 20
  assert seen[-1] == (4 << 20, 4 << 20)
  assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:])), seen
